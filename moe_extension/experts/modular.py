"""OAITritonExperts: the modular expert class with a fused activation (one ``fused_experts`` call).

``apply(hidden_states [M, K], topk_weights fp32 [M, topk], topk_ids int [M, topk]) -> [M, K]`` in the
dtype of ``hidden_states``: both expert GEMMs, the activation between them, the router weights and the
sum over the top-k slots happen inside ``torch.ops.moe_ext.fused_experts``, so the only buffer the
caller sees is the output. Weights are held ``[E, in, out]`` (see ``moe_extension.experts.base``).
"""

from __future__ import annotations

import torch

from moe_extension.experts.base import ExpertsBase, Shape


class OAITritonExperts(ExpertsBase):
    """Modular experts (routing done by the caller), activation fused into the expert GEMMs.

    Quant schemes "none" (fp32/fp16/bf16 weights) and "mxfp4" (gpt-oss); every activation of
    ``moe_extension.ops.ACTIVATIONS``, "swigluoai" by default.
    """

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        # The fused op keeps its intermediate [M * topk, N] internally; nothing else is exposed.
        return {"output": (M, K)}

    def apply(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(hidden_states[t])`` (docs/ops.md);
        written into ``output`` when given."""
        self._check_call(hidden_states, topk_weights, self._routing_shape(topk_weights, topk_ids), expert_map)
        weights = self.op_weights()
        result = torch.ops.moe_ext.fused_experts(
            hidden_states,
            weights["w1"],
            weights["w2"],
            topk_weights,
            topk_ids,
            self.activation,
            **self._op_kwargs(expert_map, apply_router_weight_on_input),
        )
        return self._into(result, output)
