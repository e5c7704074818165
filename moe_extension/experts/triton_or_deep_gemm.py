"""TritonOrDeepGemmExperts: fp8 block-quantized experts through DeepGEMM when it applies, else ``fused_experts``.

``apply(hidden_states [M, K], topk_weights fp32 [M, topk], topk_ids int [M, topk]) -> [M, K]`` in the dtype
of ``hidden_states``, with weights held ``[E, in, out]`` float8_e4m3fn and fp32 scales per 128 x 128 block
(see ``moe_extension.experts.base``); activations are quantized per token per 128 columns (docs/formats.md).

Route: DeepGEMM's m-grouped contiguous GEMM (``moe_extension.backends.deep_gemm``) when it is importable,
the tensors are on CUDA and the case meets its rule (M >= alignment, N and K multiples of it, e4m3fn
weights, contiguous bf16 inputs); otherwise ``torch.ops.moe_ext.fused_experts(quant="fp8_block")``.

The DeepGEMM route, all on the device with shapes from the inputs only (no host sync):
1. ``contiguous_layout``: each valid (token, slot) gets a row in a buffer of R rows where every local
   expert owns a segment padded to the alignment (R is the worst case), invalid slots a trash row;
   ``m_indices`` labels segment rows with their expert, the rest -1 (not computed).
2. x quantized per token (per slot with ``apply_router_weight_on_input``: g * x), scattered to the rows;
   grouped GEMM 1; rows gathered back per slot, + b1; the native activation op; quantized; scattered;
   grouped GEMM 2; gathered, + b2, times g; invalid slots 0; summed over the slots in fp32.
"""

from __future__ import annotations

import torch

from moe_extension.backends import deep_gemm
from moe_extension.experts.base import ExpertsBase, Shape, _cdiv, gated_activation
from moe_extension.experts.unfused import slot_experts
from moe_extension.quant import FP8_BLOCK, quantize_fp8_per_token_group


def permuted_rows(num_slots: int, num_experts: int, align: int) -> int:
    """Rows of the contiguous layout: every expert's segment padded to ``align``, plus one trash block."""
    return _cdiv(num_slots + num_experts * (align - 1), align) * align + align


def contiguous_layout(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM's contiguous layout of the slots of ``topk_ids [M, topk]``.

    Returns ``dest [M*topk]`` int64 (the row of each slot; invalid slots share the trash row R - align),
    ``m_indices [R]`` int32 (expert of each row of a segment, -1 elsewhere), and per slot the local
    expert (clamped, int64) and validity, both ``[M*topk]``.
    """
    local, valid = slot_experts(topk_ids, expert_map, num_experts)
    local, valid = local.reshape(-1), valid.reshape(-1)
    device, E = local.device, num_experts
    S = local.numel()
    R = permuted_rows(S, E, align)
    key = torch.where(valid, local, E)  # invalid slots sort after every expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + align - 1) // align * align
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each key
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(S, device=device) - first[sorted_key]
    dest_sorted = torch.where(sorted_key < E, seg_start[sorted_key.clamp(max=E - 1)] + rank, R - align)
    dest = torch.empty_like(dest_sorted).scatter_(0, order, dest_sorted)
    label = torch.searchsorted(seg_end, torch.arange(R, device=device), right=True)
    m_indices = torch.where(label < E, label, -1).to(torch.int32)
    return dest, m_indices, local, valid


class TritonOrDeepGemmExperts(ExpertsBase):
    """fp8 block experts: DeepGEMM grouped GEMMs when applicable, ``fused_experts`` otherwise."""

    _QUANT_SCHEMES = ("fp8_block",)
    _DEFAULT_ACTIVATION = "silu"

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        w1_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        w1_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: str | None = None,
        alpha: float = 1.702,
        limit: float = 7.0,
        backend: str = "auto",
        allow_deep_gemm: bool = True,
    ) -> None:
        super().__init__(
            w1, w2, w1_bias=w1_bias, w2_bias=w2_bias, quant="fp8_block", w1_scale=w1_scale, w2_scale=w2_scale,
            activation=activation, alpha=alpha, limit=limit, backend=backend,
        )
        if not isinstance(allow_deep_gemm, bool):
            raise TypeError(f"{type(self).__name__}: allow_deep_gemm must be a bool, got {type(allow_deep_gemm).__name__}")
        # Availability and alignment are settled here, outside any traced call.
        self.allow_deep_gemm = allow_deep_gemm and deep_gemm.is_available()
        self.alignment = deep_gemm.alignment()
        self._dg_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def uses_deep_gemm(self, hidden_states: torch.Tensor) -> bool:
        """Whether ``apply(hidden_states, ...)`` takes the DeepGEMM route."""
        if not (self.allow_deep_gemm and hidden_states.is_cuda):
            return False
        weights = self.op_weights()
        return deep_gemm.is_applicable(hidden_states, weights["w1"], weights["w2"])

    def _deep_gemm_shape(self, M: int, N: int, K: int) -> bool:
        align = self.alignment
        return self.allow_deep_gemm and M >= align and N % align == 0 and K % align == 0

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        if not self._deep_gemm_shape(M, N, K):
            return {"output": (M, K)}
        # Pessimistic: rows for every expert's padded segment. The fp8 copies of the GEMM inputs
        # ([R, K] and [R, N], one byte per element) come on top of these.
        R = permuted_rows(M * topk, E, self.alignment)
        return {"h": (R, 2 * N), "a": (M * topk, N), "y": (R, K), "output": (M, K)}

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
        """``out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(hidden_states[t])``, fp8 block weights."""
        self._check_call(hidden_states, topk_weights, self._routing_shape(topk_weights, topk_ids), expert_map)
        if self.uses_deep_gemm(hidden_states):
            result = self.apply_deep_gemm(hidden_states, topk_weights, topk_ids, expert_map, apply_router_weight_on_input)
        else:
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

    def _deep_gemm_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: DeepGEMM reads block scales [E, out/128, in/128] contiguous; the held scales are the
        # transposed layout, so they are copied once (E * 2N * K / 16384 floats, a few MB at most) and kept.
        if self._dg_scales is None:
            self._dg_scales = (
                self.w1_scale.transpose(1, 2).contiguous(),
                self.w2_scale.transpose(1, 2).contiguous(),
            )
        return self._dg_scales

    def apply_deep_gemm(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """The DeepGEMM route (module docstring); callers check ``uses_deep_gemm`` first."""
        M, K = hidden_states.shape
        topk = topk_ids.size(1)
        E, N, S = self.num_experts, self.intermediate_size, M * topk
        device, dtype = hidden_states.device, hidden_states.dtype
        weights = self.op_weights()
        w1_scale, w2_scale = self._deep_gemm_scales()
        dest, m_indices, local, valid = contiguous_layout(topk_ids, expert_map, E, self.alignment)
        R = m_indices.numel()
        gates = topk_weights.float().reshape(S, 1)

        def scatter_quantized(x: torch.Tensor, rows_from: torch.Tensor | None, width: int):
            # NOTE: the fp8 bytes move as uint8 (index_put on float8 is not implemented everywhere).
            q, s = quantize_fp8_per_token_group(x, FP8_BLOCK)
            if rows_from is not None:
                q, s = q.index_select(0, rows_from), s.index_select(0, rows_from)
            buf_q = torch.empty((R, width), dtype=torch.uint8, device=device)
            buf_s = torch.empty((R, s.size(1)), dtype=torch.float32, device=device)
            buf_q[dest] = q.view(torch.uint8)
            buf_s[dest] = s
            return buf_q.view(torch.float8_e4m3fn), buf_s

        if apply_router_weight_on_input:
            x_slots = (hidden_states.float().unsqueeze(1) * gates.view(M, topk, 1)).reshape(S, K)
            a1q, a1s = scatter_quantized(x_slots, None, K)
        else:
            token_of_slot = torch.arange(S, device=device) // topk
            a1q, a1s = scatter_quantized(hidden_states, token_of_slot, K)
        h_rows = torch.empty((R, 2 * N), dtype=torch.bfloat16, device=device)
        deep_gemm.m_grouped_fp8_gemm(a1q, a1s, weights["w1"], w1_scale, h_rows, m_indices)
        h = h_rows[dest]
        if self.w1_bias is not None:
            h = (h.float() + self.w1_bias[local]).to(torch.bfloat16)
        a = torch.empty((S, N), dtype=torch.bfloat16, device=device)
        gated_activation(self.activation, a, h, self.alpha, self.limit)
        a2q, a2s = scatter_quantized(a, None, N)
        y_rows = torch.empty((R, K), dtype=torch.bfloat16, device=device)
        deep_gemm.m_grouped_fp8_gemm(a2q, a2s, weights["w2"], w2_scale, y_rows, m_indices)
        y = y_rows[dest].float()
        if self.w2_bias is not None:
            y = y + self.w2_bias[local]
        if not apply_router_weight_on_input:
            y = y * gates
        y = torch.where(valid.unsqueeze(1), y, 0.0)
        return y.view(M, topk, K).sum(dim=1).to(dtype)
