"""The two routed expert GEMMs of the unfused path, plus the grouped-by-expert PyTorch machinery that
``fused_experts`` shares with them (argument validation: ``arg_checks``).

``moe_ext::expert_gemm1(hidden_states [M, K], w1 [E, 2N, K], topk_ids [M, topk], *, w1_bias [E, 2N] fp32,
expert_map [E_global] int32, topk_weights [M, topk] fp32, quant, w1_scale, lora_a, lora_b, token_lora_mapping)``
-> ``h [M, topk, 2N]`` in ``hidden_states.dtype``: ``h[t, j] = W1[e] x' + b1[e]`` with ``x' = g * x`` when
``topk_weights`` is given (apply_router_weight_on_input), else ``x``.

``moe_ext::expert_gemm2(intermediate [M, topk, N], w2 [E, K, N], topk_ids, *, w2_bias [E, K] fp32,
expert_map, topk_weights, quant, w2_scale, lora_a, lora_b, token_lora_mapping)`` -> ``y [M, topk, K]`` in
``intermediate.dtype``: ``y[t, j] = W2[e] a[t, j] + b2[e]``, times ``g`` when ``topk_weights`` is given.

LoRA (all three or none): ``lora_a [L, E, r, in]``, ``lora_b [L, E, out, r]``, ``token_lora_mapping [M]``
(``moe_extension.ops.lora``) add ``g B[l, e] (A[l, e] x)`` to the active pairs' rows (``x``: the GEMM's input,
unscaled; g as above, 1 without ``topk_weights``), the rows of the other pairs bit for bit as without LoRA.
On CUDA's direct schedule (decode) the expand runs in the GEMV's epilogue, before its one rounding; elsewhere it is
``add_lora`` on the rounded output (a second rounding).

Both: ``e`` is the local expert of slot ``(t, j)`` (through ``expert_map`` when given); invalid slots give
rows of exactly 0; math in fp32, one rounding at the end. Weight layouts per ``quant``:
``"none"``: same dtype as the activations; ``"fp8_block"``: e4m3fn + fp32 scales per 128 x 128 block, the
GEMM input quantized per row per 128 columns; ``"mxfp4"``: uint8 packed e2m1 ``[E, rows, cols / 2]`` +
E8M0 scales ``[E, rows, cols / 32]``, the GEMM input rounded to bf16. Any weight strides.

On CUDA the Triton kernels run for every ``quant`` (``moe_extension.kernels``); elsewhere the PyTorch
implementation below (``expert_gemm1_torch`` / ``expert_gemm2_torch``).
"""

from __future__ import annotations

import torch

from moe_extension.ops.arg_checks import (FLOAT_DTYPES, MXFP4_QUANTS, QUANT_FORMATS, TRITON_QUANT, WEIGHT_DTYPES,
                                          ArgChecker, require)
from moe_extension.quant.fp8_block import dequantize_fp8_block, fake_quantize_fp8_per_token_group
from moe_extension.quant.mxfp4 import dequantize_mxfp4
from moe_extension.quant.mxfp4_mma import dequantize_mxfp4_mma

def check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale, lora_a=None,
                       lora_b=None, token_lora_mapping=None):
    """Validates expert_gemm1's arguments; returns (M, topk, 2N)."""
    c = ArgChecker("expert_gemm1", "hidden_states", hidden_states)
    c.name("quant", quant, QUANT_FORMATS)
    c.rank("hidden_states", hidden_states, FLOAT_DTYPES, "[M, K]")
    m, k = hidden_states.shape
    if quant in MXFP4_QUANTS:
        c.mxfp4_dim("K (hidden_states.shape[1])", k)
    c.rank("w1", w1, WEIGHT_DTYPES.get(quant, (hidden_states.dtype,)), "[E, 2N, K]")
    e, rows = w1.shape[0], w1.shape[1]
    c.weight("w1", w1, quant, hidden_states.dtype, "[E, 2N, K]", (e, rows, k))
    c.scale("w1_scale", w1_scale, quant, (e, rows, k), "w1")
    c.bias("w1_bias", w1_bias, "[E, 2N]", (e, rows))
    c.expert_map(expert_map)
    c.routing(topk_ids, topk_weights, m)
    _check_lora(c, hidden_states, lora_a, lora_b, token_lora_mapping, e, rows, m)
    return m, topk_ids.shape[1], rows


def check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale, lora_a=None,
                       lora_b=None, token_lora_mapping=None):
    """Validates expert_gemm2's arguments; returns (M, topk, K)."""
    c = ArgChecker("expert_gemm2", "intermediate", intermediate)
    c.name("quant", quant, QUANT_FORMATS)
    c.rank("intermediate", intermediate, FLOAT_DTYPES, "[M, topk, N]")
    m, topk, n = intermediate.shape
    if quant in MXFP4_QUANTS:
        c.mxfp4_dim("N (intermediate.shape[2])", n)
    c.rank("w2", w2, WEIGHT_DTYPES.get(quant, (intermediate.dtype,)), "[E, K, N]")
    e, k = w2.shape[0], w2.shape[1]
    c.weight("w2", w2, quant, intermediate.dtype, "[E, K, N]", (e, k, n))
    c.scale("w2_scale", w2_scale, quant, (e, k, n), "w2")
    c.bias("w2_bias", w2_bias, "[E, K]", (e, k))
    c.expert_map(expert_map)
    c.routing(topk_ids, topk_weights, m, topk)
    _check_lora(c, intermediate, lora_a, lora_b, token_lora_mapping, e, k, m)
    return m, topk, k


def _check_lora(c: ArgChecker, x, lora_a, lora_b, token_lora_mapping, num_experts: int, rows: int, m: int) -> None:
    """The optional LoRA term of either GEMM: all three arguments or none (``ops.lora.check_lora_term``)."""
    given = [t is not None for t in (lora_a, lora_b, token_lora_mapping)]
    require(all(given) or not any(given), lambda: (
        f"{c.op}: lora_a, lora_b and token_lora_mapping go together (all three or none), got "
        + ", ".join(f"{n}={'a tensor' if g else 'None'}" for n, g in zip(("lora_a", "lora_b", "token_lora_mapping"),
                                                                        given))))
    if lora_a is not None:
        from moe_extension.ops.lora import check_lora_term

        check_lora_term(c, x, lora_a, lora_b, token_lora_mapping, num_experts, rows, m)


# ----------------------------------------------------------------------------------------------------
# The grouped PyTorch implementation (device-agnostic; fp32 math)
# ----------------------------------------------------------------------------------------------------


def group_by_expert(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int
) -> list[tuple[int, torch.Tensor]]:
    """``[(e, slots)]`` for every local expert ``e`` that at least one valid slot routes to, where ``slots``
    (int64) are the flat slot indices ``t * topk + j`` routed to ``e``, in increasing order.

    A slot is invalid (and dropped) when its id is < 0, >= E_global (with a map) or maps to a local id
    outside [0, E): such slots go to a sentinel bucket ``E`` that is never computed.
    """
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        local = ids
    else:
        e_global = expert_map.shape[0]
        inside = (ids >= 0) & (ids < e_global)
        local = torch.where(inside, expert_map.long()[ids.clamp(0, e_global - 1)], -1)
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    sorted_key, slots = torch.sort(key, stable=True)
    # NOTE: one device-to-host copy of E + 1 group starts per call: the per-expert loop needs the group
    # sizes on the host. This path is the CPU implementation and the CUDA fallback for quantized
    # formats; it is not CUDA-graph capturable (the Triton path is).
    starts = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=key.device)).tolist()
    return [(e, slots[starts[e] : starts[e + 1]]) for e in range(num_experts) if starts[e + 1] > starts[e]]


def slot_experts(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local expert of each slot (clamped into [0, E), int64) and whether the slot is valid (docs/ops.md, invalid ids).

    Pure tensor code: no host sync, shapes from the inputs only.
    """
    ids = topk_ids.long()
    if expert_map is None:
        local = ids
        valid = (ids >= 0) & (ids < num_experts)
    else:
        num_global = expert_map.size(0)
        local = expert_map.long()[ids.clamp(0, max(num_global - 1, 0))]
        valid = (ids >= 0) & (ids < num_global) & (local >= 0) & (local < num_experts)
    return local.clamp(0, num_experts - 1), valid


def gemm_input(x: torch.Tensor, quant: str, ue8m0: bool = False) -> torch.Tensor:
    """fp32 rows ``[n, cols]`` -> the fp32 values the GEMM multiplies: fp8 quantize-dequantize per 128
    columns (fp8_block; ``ue8m0``: power-of-two scales), rounded to bf16 (mxfp4), unchanged (none)."""
    if quant == "fp8_block":
        return fake_quantize_fp8_per_token_group(x, ue8m0=ue8m0)
    if quant in MXFP4_QUANTS:
        return x.to(torch.bfloat16).float()
    return x


class ExpertWeights:
    """One expert weight stack (logical ``[E, rows, cols]``, any strides) with its scales and fp32 bias;
    ``linear(e, x)`` = ``x @ W[e]^T + b[e]`` in fp32 for ``x [n, cols]`` fp32."""

    def __init__(self, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, quant: str):
        self.w, self.scale, self.bias, self.quant = w, scale, bias, quant
        self._workspace: torch.Tensor | None = None

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """``gemm_input`` of this format (fp8 block with UE8M0 weight scales: power-of-two activation scales)."""
        return gemm_input(x, self.quant, self.quant == "fp8_block" and self.scale.dtype == torch.uint8)

    def dense(self, e: int) -> torch.Tensor:
        """fp32 ``W[e]`` [rows, cols]; only this expert is dequantized."""
        if self.quant == "fp8_block":
            return dequantize_fp8_block(self.w[e], self.scale[e])
        if self.quant == "mxfp4":
            return dequantize_mxfp4(self.w[e], self.scale[e])
        if self.quant == "mxfp4_mma":
            return dequantize_mxfp4_mma(self.w[e], self.scale[e])
        if self.w.dtype == torch.float32:
            return self.w[e]
        if self._workspace is None:
            # NOTE: one fp32 buffer reused for every expert (same strides as W[e], so transposed storage
            # stays a cheap copy): a fresh 66 MB allocation per expert costs ~100 ms of page faults on this
            # 2-core machine against ~5 ms for the bf16 -> fp32 copy itself (gpt-oss-20b w1).
            self._workspace = torch.empty_like(self.w[e], dtype=torch.float32)
        return self._workspace.copy_(self.w[e])

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[e]
        return torch.nn.functional.linear(x, self.dense(e), bias)


def expert_gemm1_torch(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None) -> torch.Tensor:
    """PyTorch implementation of expert_gemm1 (any device): ``[M, topk, 2N]`` in ``hidden_states.dtype``; the LoRA
    term added to the rounded GEMM output by ``add_lora_torch``."""
    m, topk, rows = check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale,
                                       lora_a, lora_b, token_lora_mapping)
    out = torch.zeros((m * topk, rows), dtype=torch.float32, device=hidden_states.device)
    weights = ExpertWeights(w1, w1_scale, w1_bias, quant)
    x = hidden_states.float()
    g = None if topk_weights is None else topk_weights.reshape(-1)
    for e, slots in group_by_expert(topk_ids, expert_map, w1.shape[0]):
        xe = x[slots // topk]
        if g is not None:
            xe = xe * g[slots, None]
        out[slots] = weights.linear(e, weights.gemm_input(xe))
    h = out.view(m, topk, rows).to(hidden_states.dtype)
    return _with_lora(h, hidden_states, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)


def expert_gemm2_torch(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None) -> torch.Tensor:
    """PyTorch implementation of expert_gemm2 (any device): ``[M, topk, K]`` in ``intermediate.dtype``; LoRA as in
    ``expert_gemm1_torch``."""
    m, topk, k = check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale,
                                    lora_a, lora_b, token_lora_mapping)
    out = torch.zeros((m * topk, k), dtype=torch.float32, device=intermediate.device)
    weights = ExpertWeights(w2, w2_scale, w2_bias, quant)
    a = intermediate.reshape(m * topk, intermediate.shape[2])
    g = None if topk_weights is None else topk_weights.reshape(-1)
    for e, slots in group_by_expert(topk_ids, expert_map, w2.shape[0]):
        y = weights.linear(e, weights.gemm_input(a[slots].float()))
        out[slots] = y if g is None else y * g[slots, None]
    y = out.view(m, topk, k).to(intermediate.dtype)
    return _with_lora(y, intermediate, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)


def _with_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights) -> torch.Tensor:
    if lora_a is not None:
        from moe_extension.ops.lora import add_lora_torch

        add_lora_torch(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map=expert_map,
                       topk_weights=topk_weights)
    return out


# ----------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------

torch.library.define(
    "moe_ext::expert_gemm1",
    "(Tensor hidden_states, Tensor w1, Tensor topk_ids, *, Tensor? w1_bias=None, Tensor? expert_map=None, "
    'Tensor? topk_weights=None, str quant="none", Tensor? w1_scale=None, Tensor? lora_a=None, Tensor? lora_b=None, '
    "Tensor? token_lora_mapping=None) -> Tensor",
)
torch.library.define(
    "moe_ext::expert_gemm2",
    "(Tensor intermediate, Tensor w2, Tensor topk_ids, *, Tensor? w2_bias=None, Tensor? expert_map=None, "
    'Tensor? topk_weights=None, str quant="none", Tensor? w2_scale=None, Tensor? lora_a=None, Tensor? lora_b=None, '
    "Tensor? token_lora_mapping=None) -> Tensor",
)


@torch.library.register_fake("moe_ext::expert_gemm1")
def _expert_gemm1_fake(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None):
    m, topk, rows = check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant,
                                       w1_scale, lora_a, lora_b, token_lora_mapping)
    return hidden_states.new_empty((m, topk, rows))


@torch.library.register_fake("moe_ext::expert_gemm2")
def _expert_gemm2_fake(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None):
    m, topk, k = check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale,
                                    lora_a, lora_b, token_lora_mapping)
    return intermediate.new_empty((m, topk, k))


torch.library.impl("moe_ext::expert_gemm1", "cpu")(expert_gemm1_torch)
torch.library.impl("moe_ext::expert_gemm2", "cpu")(expert_gemm2_torch)


@torch.library.impl("moe_ext::expert_gemm1", "cuda")
def _expert_gemm1_cuda(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None):
    if quant not in TRITON_QUANT:
        return expert_gemm1_torch(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                                  topk_weights=topk_weights, quant=quant, w1_scale=w1_scale, lora_a=lora_a,
                                  lora_b=lora_b, token_lora_mapping=token_lora_mapping)
    check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale, lora_a, lora_b,
                       token_lora_mapping)
    from moe_extension.kernels import expert_gemm1_triton

    return expert_gemm1_triton(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                               topk_weights=topk_weights, quant=quant, w1_scale=w1_scale, lora_a=lora_a,
                               lora_b=lora_b, token_lora_mapping=token_lora_mapping)


@torch.library.impl("moe_ext::expert_gemm2", "cuda")
def _expert_gemm2_cuda(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None):
    if quant not in TRITON_QUANT:
        return expert_gemm2_torch(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                                  topk_weights=topk_weights, quant=quant, w2_scale=w2_scale, lora_a=lora_a,
                                  lora_b=lora_b, token_lora_mapping=token_lora_mapping)
    check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale, lora_a, lora_b,
                       token_lora_mapping)
    from moe_extension.kernels import expert_gemm2_triton

    return expert_gemm2_triton(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                               topk_weights=topk_weights, quant=quant, w2_scale=w2_scale, lora_a=lora_a,
                               lora_b=lora_b, token_lora_mapping=token_lora_mapping)


def expert_gemm1(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                 quant="none", w1_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None) -> torch.Tensor:
    """``torch.ops.moe_ext.expert_gemm1``: ``h [M, topk, 2N]`` (see the module docstring)."""
    return torch.ops.moe_ext.expert_gemm1(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                                          topk_weights=topk_weights, quant=quant, w1_scale=w1_scale, lora_a=lora_a,
                                          lora_b=lora_b, token_lora_mapping=token_lora_mapping)


def expert_gemm2(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                 quant="none", w2_scale=None, lora_a=None, lora_b=None, token_lora_mapping=None) -> torch.Tensor:
    """``torch.ops.moe_ext.expert_gemm2``: ``y [M, topk, K]`` (see the module docstring)."""
    return torch.ops.moe_ext.expert_gemm2(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                                          topk_weights=topk_weights, quant=quant, w2_scale=w2_scale, lora_a=lora_a,
                                          lora_b=lora_b, token_lora_mapping=token_lora_mapping)
