"""OAITritonMxfp4ExpertsMonolithic: router logits in, MoE output out (one ``fused_moe`` call).

``apply(hidden_states [M, K], router_logits [M, E_global], topk, renormalize) -> [M, K]`` in the dtype
of ``hidden_states``: top-k routing (``topk_softmax`` semantics: with ``renormalize`` a softmax over
the k largest logits, otherwise the top k of a softmax over all experts) and the experts run inside
``torch.ops.moe_ext.fused_moe``. Weights are held ``[E, in, out]`` (see ``moe_extension.experts.base``):
MXFP4 as gpt-oss ships them, or unquantized.
"""

from __future__ import annotations

import torch

from moe_extension.experts.base import ExpertsBase, Shape


class OAITritonMxfp4ExpertsMonolithic(ExpertsBase):
    """Monolithic experts: routing and experts in one op; quant "mxfp4" or "none"."""

    def moe_problem_size_from_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk: int,
        expert_map: torch.Tensor | None = None,
    ) -> tuple[int, int, int, int, int]:
        """``(E, M, N, K, topk)`` of a call that starts from router logits ``[M, E_global]``."""
        name = type(self).__name__
        for arg, t in (("hidden_states", hidden_states), ("router_logits", router_logits)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.apply: {arg} must be a Tensor, got {type(t).__name__}")
        M = hidden_states.size(0) if hidden_states.dim() > 0 else -1
        if router_logits.dim() != 2 or router_logits.size(0) != M:
            raise ValueError(
                f"{name}.apply: router_logits must have shape [M, E_global] with M = hidden_states.size(0) "
                f"= {M}, got {list(router_logits.shape)}"
            )
        if isinstance(topk, bool) or not isinstance(topk, int):
            raise TypeError(f"{name}.apply: topk must be an int, got {type(topk).__name__}")
        if not 1 <= topk <= router_logits.size(1):
            raise ValueError(f"{name}.apply: topk must be in [1, E_global = {router_logits.size(1)}], got {topk}")
        return self._check_call(hidden_states, None, (M, topk), expert_map)

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        # Routing results and the intermediate live inside the fused op.
        return {"output": (M, K)}

    def apply(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk: int,
        renormalize: bool,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Route with ``topk``/``renormalize``, then the experts; written into ``output`` when given."""
        self.moe_problem_size_from_logits(hidden_states, router_logits, topk, expert_map)
        weights = self.op_weights()
        result = torch.ops.moe_ext.fused_moe(
            hidden_states,
            weights["w1"],
            weights["w2"],
            router_logits,
            topk,
            bool(renormalize),
            self.activation,
            **self._op_kwargs(expert_map, apply_router_weight_on_input),
        )
        return self._into(result, output)
