"""UnfusedOAITritonExperts: the expert pipeline in separate steps, each an injection point, plus LoRA.

``apply(hidden_states [M, K], topk_weights fp32 [M, topk], topk_ids int [M, topk]) -> [M, K]`` runs

    h   = gemm1(x) [+ B13[l,e] (A13[l,e] x)]       torch.ops.moe_ext.expert_gemm1        h [M, topk, 2N]
    a   = act(h)                                   apply_activation: the native *_and_mul op, into a buffer
    y   = g * (gemm2(a) [+ B2[l,e] (A2[l,e] a)])   torch.ops.moe_ext.expert_gemm2 (router weight g applied there)
    out = sum_j y[:, j]                            moe_sum: torch.ops.moe_ext.moe_sum    out [M, K]

in the dtype of ``hidden_states``. Subclasses override any step. LoRA adapters (``LoRAWeights``:
``A13 [L, E, r, K]``, ``B13 [L, E, 2N, r]``, ``A2 [L, E, r2, N]``, ``B2 [L, E, K, r2]``, rows of B13
laid out like w1's) are attached with ``set_lora``; ``apply(..., token_lora_mapping=[M] int)`` picks
one adapter per token, -1 (or any id outside [0, L)) for none; the GEMM ops then add the LoRA terms [in
brackets] (their ``lora_a`` / ``lora_b`` / ``token_lora_mapping``). Tokens without an adapter, and invalid
slots, get exactly the output of the same call without LoRA.

The second LoRA term is scaled by the router weight like the base term: g * (W2 a + b2 + B2 A2 a) =
g * gemm2(a) + g * (B2 A2 a), so the base GEMM keeps applying g itself and the slots without an adapter
keep its result bit for bit. With ``apply_router_weight_on_input`` the first GEMM and the first LoRA
term both see g * x. LoRA math runs in fp32; on CUDA at decode the GEMVs add the expand in their epilogue (one
rounding), otherwise ``add_lora`` adds it to the rounded GEMM output (``moe_extension.ops.expert_gemm``). Under
CUDA graphs, change adapters in place (``copy_`` into the attached tensors) and the mapping in its captured buffer:
no recapture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_extension.experts.base import ExpertsBase, Shape, gated_activation, resize_workspace


@dataclass(frozen=True)
class LoRAWeights:
    """Stacked LoRA adapters of the two expert GEMMs, indexed ``[adapter, local expert]``."""

    a13: torch.Tensor  # [L, E, r, K]
    b13: torch.Tensor  # [L, E, 2N, r]
    a2: torch.Tensor  # [L, E, r2, N]
    b2: torch.Tensor  # [L, E, K, r2]

    @property
    def num_adapters(self) -> int:
        return self.a13.size(0)


class UnfusedOAITritonExperts(ExpertsBase):
    """Experts as separate steps (``gemm1``, ``apply_activation``, ``gemm2``, ``moe_sum``; the GEMMs with their
    LoRA terms), each overridable. Quant "none", "mxfp4" or "fp8_block"; every activation."""

    _QUANT_SCHEMES = ("none", "mxfp4", "fp8_block")

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, *, lora: LoRAWeights | None = None, **kwargs) -> None:
        super().__init__(w1, w2, **kwargs)
        self.lora: LoRAWeights | None = None
        self.set_lora(lora)

    @classmethod
    def supports_lora(cls) -> bool:
        return True

    def set_lora(self, lora: LoRAWeights | None) -> None:
        """Attach (or with None detach) stacked LoRA adapters; see ``LoRAWeights`` for the shapes."""
        if lora is not None:
            _check_lora(type(self).__name__, lora, self.num_experts, self.intermediate_size, self.hidden_size,
                        self.w1.device)
        self.lora = lora

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        return {"h": (M * topk, 2 * N), "a": (M * topk, N), "y": (M, topk, K), "output": (M, K)}

    # -- the steps (injection points) ---------------------------------------------------------------
    def gemm1(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        input_weights: torch.Tensor | None,
        token_lora_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``h [M, topk, 2N] = W1[e] (g x) + b1[e]``, g = ``input_weights`` when given; invalid slots 0. With
        ``token_lora_mapping``: plus ``B13[l,e] (A13[l,e] (g x))`` on the slots with an adapter."""
        weights = self.op_weights()
        lora = self._lora_args(1, token_lora_mapping)
        return torch.ops.moe_ext.expert_gemm1(
            hidden_states,
            weights["w1"],
            topk_ids,
            w1_bias=self.w1_bias,
            expert_map=expert_map,
            topk_weights=input_weights,
            quant=self.op_quant,
            w1_scale=weights["w1_scale"],
            **lora,
        )

    def apply_activation(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The native gated activation: ``out [S, N] = act(h [S, 2N])``; returns ``out``."""
        return gated_activation(self.activation, out, h, self.alpha, self.limit)

    def gemm2(
        self,
        a: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        output_weights: torch.Tensor | None,
        token_lora_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``y [M, topk, K] = g (W2[e] a + b2[e])``, g = ``output_weights`` when given; invalid slots 0. With
        ``token_lora_mapping``: plus ``g B2[l,e] (A2[l,e] a)`` on the slots with an adapter."""
        weights = self.op_weights()
        lora = self._lora_args(2, token_lora_mapping)
        return torch.ops.moe_ext.expert_gemm2(
            a,
            weights["w2"],
            topk_ids,
            w2_bias=self.w2_bias,
            expert_map=expert_map,
            topk_weights=output_weights,
            quant=self.op_quant,
            w2_scale=weights["w2_scale"],
            **lora,
        )

    def _lora_args(self, gemm: int, token_lora_mapping: torch.Tensor | None) -> dict:
        """The LoRA keyword arguments of GEMM 1 or 2 (none without a mapping)."""
        if token_lora_mapping is None:
            return {}
        a, b = (self.lora.a13, self.lora.b13) if gemm == 1 else (self.lora.a2, self.lora.b2)
        return {"lora_a": a, "lora_b": b, "token_lora_mapping": token_lora_mapping}

    def moe_sum(
        self,
        y: torch.Tensor,
        output: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        """``output [M, K] = sum_j y[:, j]`` over the valid slots; returns ``output``."""
        torch.ops.moe_ext.moe_sum(y, output, topk_ids, expert_map)
        return output

    # -- the pipeline -------------------------------------------------------------------------------
    def _check_lora_mapping(self, token_lora_mapping: torch.Tensor, hidden_states: torch.Tensor) -> None:
        name, M = type(self).__name__, hidden_states.size(0)
        if self.lora is None:
            raise ValueError(f"{name}.apply: token_lora_mapping given but no LoRA adapters are attached (set_lora)")
        if (
            not isinstance(token_lora_mapping, torch.Tensor)
            or token_lora_mapping.shape != (M,)
            or token_lora_mapping.is_floating_point()
            or token_lora_mapping.is_complex()
        ):
            raise ValueError(
                f"{name}.apply: token_lora_mapping must be an integer tensor of shape [M] = [{M}], got "
                f"{getattr(token_lora_mapping, 'dtype', type(token_lora_mapping).__name__)} "
                f"{list(getattr(token_lora_mapping, 'shape', []))}"
            )
        if token_lora_mapping.device != hidden_states.device:
            raise ValueError(
                f"{name}.apply: token_lora_mapping is on {token_lora_mapping.device}, "
                f"hidden_states on {hidden_states.device}"
            )

    def apply(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        *,
        token_lora_mapping: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The steps above. ``workspace`` (from ``make_workspace``, or larger contiguous buffers) gives
        the activation buffer ``"a"`` and the result buffer ``"output"``; ``output`` wins over the latter."""
        E, M, N, K, topk = self._check_call(
            hidden_states, topk_weights, self._routing_shape(topk_weights, topk_ids), expert_map
        )
        if token_lora_mapping is not None:
            self._check_lora_mapping(token_lora_mapping, hidden_states)
        workspace = workspace or {}
        input_weights = topk_weights if apply_router_weight_on_input else None
        output_weights = None if apply_router_weight_on_input else topk_weights

        h = self.gemm1(hidden_states, topk_ids, expert_map, input_weights, token_lora_mapping)
        S = M * topk
        a_shape = (S, N)
        a = (
            resize_workspace(workspace["a"], a_shape)
            if "a" in workspace
            else torch.empty(a_shape, dtype=hidden_states.dtype, device=hidden_states.device)
        )
        a = self.apply_activation(h.reshape(S, 2 * N), a).view(M, topk, N)
        y = self.gemm2(a, topk_ids, expert_map, output_weights, token_lora_mapping)
        if output is None:
            output = (
                resize_workspace(workspace["output"], (M, K))
                if "output" in workspace
                else torch.empty((M, K), dtype=hidden_states.dtype, device=hidden_states.device)
            )
        return self.moe_sum(y, output, topk_ids, expert_map)


def _check_lora(name: str, lora: LoRAWeights, E: int, N: int, K: int, device: torch.device) -> None:
    if not isinstance(lora, LoRAWeights):
        raise TypeError(f"{name}: lora must be a LoRAWeights, got {type(lora).__name__}")
    for arg in ("a13", "b13", "a2", "b2"):
        t = getattr(lora, arg)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: lora.{arg} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: lora.{arg} must be 4-D [L, E, rows, cols], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: lora.{arg} must be a floating-point tensor, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: lora.{arg} is on {t.device} but the weights are on {device}")
    L, r13, r2 = lora.a13.size(0), lora.a13.size(2), lora.a2.size(2)
    expected = {
        "a13": ((L, E, r13, K), "[L, E, r, K]"),
        "b13": ((L, E, 2 * N, r13), "[L, E, 2N, r]"),
        "a2": ((L, E, r2, N), "[L, E, r2, N]"),
        "b2": ((L, E, K, r2), "[L, E, K, r2]"),
    }
    for arg, (shape, layout) in expected.items():
        got = tuple(getattr(lora, arg).shape)
        if got != shape:
            raise ValueError(f"{name}: lora.{arg} must have shape {layout} = {list(shape)}, got {list(got)}")
