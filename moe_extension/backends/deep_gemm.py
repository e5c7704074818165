"""DeepGEMM (optional; CUDA sm_90): its m-grouped fp8 GEMM, contiguous layout, and the ``fused_experts`` route
built on it, which ``torch.ops.moe_ext.fused_experts(quant="fp8_block")`` runs for ``backend="deep_gemm"`` and,
where the stored crossover says it is faster, for ``backend="auto"`` (``auto_prefers``).

``fused_experts_deep_gemm(hidden_states, w1, w2, topk_weights, topk_ids, activation, *, w1_bias, w2_bias,
expert_map, apply_router_weight_on_input, w1_scale, w2_scale, alpha, limit) -> out [M, K]`` computes the
``moe_ext::fused_experts`` contract (docs/ops.md) for fp8 block weights: ``hidden_states [M, K]``
fp32/fp16/bf16, ``w1 [E, 2N, K]`` and ``w2 [E, K, N]`` float8_e4m3fn, ``w1_scale [E, 2N/128, K/128]`` and
``w2_scale [E, K/128, N/128]`` fp32 (one scale per 128 x 128 block), ``topk_weights [M, topk]`` fp32,
``topk_ids [M, topk]`` int32/int64, ``w1_bias [E, 2N]`` / ``w2_bias [E, K]`` fp32, ``expert_map [E_global]``
int32; ``out`` in ``hidden_states.dtype``, invalid slots contributing exactly 0.

``is_applicable(w1, w2, w1_scale, w2_scale)`` is its rule (``inapplicable_reasons`` names what fails): both
weights float8_e4m3fn and contiguous in that layout (K-major, DeepGEMM's B operand), the scales fp32 (or uint8
UE8M0 bytes: then the activations get power-of-two scales too, as in the ops) and contiguous, N and K multiples
of 128 and of DeepGEMM's alignment. Weights in another layout are not copied per call: the route does not apply to them (prepare them once, as ``TritonOrDeepGemmExperts`` does). Any M
is valid: every expert's segment is padded to the alignment; whether the route pays at small M is what the
crossover answers.

The route, all on the device with sizes from the shapes only (no host sync, capturable in a CUDA graph):
1. ``contiguous_layout``: each valid (token, slot) gets a row of a worst-case buffer of R rows where every
   expert owns a segment padded to the alignment; invalid slots share a trash row; ``m_indices`` labels the
   rows of a segment with its expert, the rest -1 (DeepGEMM skips those).
2. x quantized per token per 128 columns (``s = max(amax, 1e-10) / 448``; per slot ``g x`` with
   ``apply_router_weight_on_input``), scattered to the rows; DeepGEMM GEMM 1 -> h ``[R, 2N]`` bf16.
3. + b1 of the row's expert (in fp32), the native activation op on all R rows, quantized per row per 128
   columns; DeepGEMM GEMM 2 -> y ``[R, K]`` bf16.
4. The rows gathered back per slot, + b2, times g (unless on the input), invalid slots 0, summed over the
   slots in fp32 and rounded once to ``hidden_states.dtype``.

Precision: the PyTorch implementation and our Triton kernels quantize the second GEMM's input from fp32; the
route quantizes it from a bf16-rounded h (DeepGEMM writes bf16; without a bias the activation's output is
bf16 too). e4m3 re-quantization turns that 2^-9 perturbation into whole-step changes of a few percent of the
values: about 1.4e-2 of relative difference between the routes on random data (tests/test_backend_deep_gemm.py).

Scales stay fp32 (DeepGEMM's sm_90 kernels take fp32 scales; ``disable_ue8m0_cast`` keeps them from being
rounded to powers of two, which would change the format). DeepGEMM's sm_100 kernels take UE8M0 scales only,
so the route is not offered there. Importing this module does not import ``deep_gemm``; the first
``is_available()`` does, and a missing or unusable package is reported with its reason, never required.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch

from moe_extension.backends import crossover
from moe_extension.quant import FP8_BLOCK, e8m0_to_float, quantize_fp8_per_token_group

DEFAULT_ALIGNMENT = 128  # DeepGEMM's m alignment of the contiguous layout on sm_90
NAME = "deep_gemm"  # the accelerator's name in ``backend=`` and in the crossover table

_WHO = "deep_gemm backend"


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    """``(namespace, None)`` when DeepGEMM can run here, else ``(namespace or None, reason)``."""
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001  (any import failure means "not usable here")
        return None, f"cannot import deep_gemm ({type(exc).__name__}: {exc})"
    # DeepGEMM 2.x names first, then the 1.x names of the same functions.
    gemm = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None)
    legacy = gemm is None
    if legacy:
        gemm = getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", None)
    align = getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout", None) or getattr(
        deep_gemm, "get_m_alignment_for_contiguous_layout", None
    )
    if gemm is None or align is None:
        return None, "deep_gemm has no m-grouped contiguous fp8 GEMM / alignment query"
    dg = SimpleNamespace(gemm=gemm, legacy=legacy, align=align)
    if not torch.cuda.is_available():
        return dg, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return dg, (f"CUDA capability {major}.{minor}: the route needs sm_90 (DeepGEMM's fp8 kernels for other "
                    "architectures take UE8M0 scales, which would round the format's fp32 scales)")
    return dg, None


def unavailable_reason() -> str | None:
    """Why DeepGEMM cannot run here, or None when it can."""
    return _load()[1]


def is_available() -> bool:
    """True when deep_gemm imports with the grouped GEMM API and an sm_90 GPU is present."""
    return _load()[1] is None


@functools.cache
def alignment() -> int:
    """Rows per expert segment of the contiguous layout (``DEFAULT_ALIGNMENT`` when DeepGEMM is absent)."""
    dg, reason = _load()
    if reason is not None:
        return DEFAULT_ALIGNMENT
    value = dg.align()
    # Some releases answer [m, k]; the m alignment is what the layout needs.
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def granule() -> int:
    """What N and K must be multiples of: DeepGEMM's alignment and the fp8 block (128 both, in practice)."""
    return math.lcm(alignment(), FP8_BLOCK)


def inapplicable_reasons(w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None,
                         w2_scale: torch.Tensor | None) -> list[str]:
    """The rules of the route that ``w1 [E, 2N, K]``, ``w2 [E, K, N]`` and their scales break (module
    docstring), each in words; empty when it applies. Says nothing about availability (``is_available``)."""
    step = granule()
    K, N = w1.shape[2], w2.shape[2]
    reasons = []
    for arg, w in (("w1", w1), ("w2", w2)):
        if w.dtype != torch.float8_e4m3fn:
            reasons.append(f"{arg} must be float8_e4m3fn, got {w.dtype}")
    for dim, size in (("N", N), ("K", K)):
        if size % step:
            reasons.append(f"{dim} = {size} must be a multiple of {step} (DeepGEMM's alignment and the fp8 block)")
    for arg, t, layout in (("w1", w1, "[E, 2N, K]"), ("w2", w2, "[E, K, N]"),
                           ("w1_scale", w1_scale, "[E, 2N/128, K/128]"), ("w2_scale", w2_scale, "[E, K/128, N/128]")):
        if t is None:
            reasons.append(f"{arg} is missing")
        elif not t.is_contiguous():
            reasons.append(f"{arg} must be contiguous {layout} (DeepGEMM's K-major layout), got strides "
                           f"{tuple(t.stride())}: prepare the weights once, not per call")
    for arg, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if s is not None and s.dtype not in (torch.float32, torch.uint8):
            reasons.append(f"{arg} must be float32 or uint8 (UE8M0), got {s.dtype}")
    return reasons


def is_applicable(w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None) -> bool:
    """Whether the route's rule holds for these weights (``inapplicable_reasons`` is empty)."""
    return not inapplicable_reasons(w1, w2, w1_scale, w2_scale)


def auto_prefers(M: int, topk: int, num_global_experts: int | None, w1: torch.Tensor, w2: torch.Tensor,
                 w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> bool:
    """``backend="auto"`` with fp8 block weights on CUDA: whether the route runs for ``M`` tokens, ``topk``
    slots and ``num_global_experts`` (the expert_map's length, None without one): the device's stored
    crossover says DeepGEMM is faster for this shape (``moe_extension.backends.crossover``), DeepGEMM is
    available and the route applies. Shapes and cached answers only: no host sync."""
    E, K, N = w1.shape[0], w1.shape[2], w2.shape[2]
    return (
        crossover.prefers(NAME, "fp8_block", w1.device, M, E, N, K, topk, num_global_experts)
        and is_available()
        and is_applicable(w1, w2, w1_scale, w2_scale)
    )


def m_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """DeepGEMM's grouped GEMM: for every row r with ``e = m_indices[r] >= 0``

        out[r, :] = (a[r, :] * a_scale[r, k // 128]) @ (b[e] * b_scale[e, n // 128, k // 128]).T

    ``a [R, K]`` float8_e4m3fn, ``a_scale [R, K/128]`` fp32, ``b [E, N, K]`` float8_e4m3fn (K-major),
    ``b_scale [E, N/128, K/128]`` fp32, ``out [R, N]`` bf16, ``m_indices [R]`` int32; rows with
    ``m_indices < 0`` are left as they were. Fills ``out`` and returns it."""
    dg, reason = _load()
    if reason is not None:
        raise RuntimeError(
            f"{_WHO}: DeepGEMM is not available: {reason}. It is optional (docs/benchmarks.md says how to put "
            "the copy vendored in the vllm wheel on PYTHONPATH); backend='auto' runs our Triton kernels."
        )
    if dg.legacy:
        dg.gemm((a, a_scale), (b, b_scale), out, m_indices)
    else:
        # NOTE: our scales are plain fp32 (no UE8M0 rounding): keep DeepGEMM from casting them.
        dg.gemm((a, a_scale), (b, b_scale), out, m_indices, disable_ue8m0_cast=True)
    return out


def permuted_rows(num_slots: int, num_experts: int, align: int) -> int:
    """Rows R of the contiguous layout: the slots, every hit expert's segment padded to ``align`` (at most
    min(E, slots) experts are hit), rounded up to ``align``, plus one trash block."""
    padded = num_slots + min(num_experts, num_slots) * (align - 1)
    return -(-padded // align) * align + align


def contiguous_layout(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM's contiguous layout of the slots of ``topk_ids [M, topk]``, on their device.

    Returns ``dest [M*topk]`` int64 (the row of each slot: expert e's slots in slot order from the start of
    its segment; invalid slots share the trash row ``R - align``), ``m_indices [R]`` int32 (the expert of each
    row of a segment, -1 elsewhere; segments in expert order, each ``align``-aligned and padded to a multiple
    of it), and per slot the local expert (clamped, int64) and validity, both ``[M*topk]``.
    ``R = permuted_rows(M*topk, num_experts, align)``.
    """
    from moe_extension.ops.expert_gemm import slot_experts

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


def _scatter_rows(q: torch.Tensor, s: torch.Tensor, dest: torch.Tensor, rows: int):
    """fp8 rows ``q [S, W]`` and their scales ``s [S, W/128]`` placed at rows ``dest`` of ``[rows, W]``
    buffers (other rows uninitialized: never read back). The scales are laid out MN-major (rows contiguous),
    the layout DeepGEMM's sm_90 kernels read, so it does not transpose them."""
    # NOTE: the fp8 bytes move as uint8 (index_put on float8 is not implemented on every device).
    buf_q = torch.empty((rows, q.size(1)), dtype=torch.uint8, device=q.device)
    buf_s = torch.empty((s.size(1), rows), dtype=torch.float32, device=q.device).t()
    buf_q[dest] = q.view(torch.uint8)
    buf_s[dest] = s
    return buf_q.view(torch.float8_e4m3fn), buf_s


def fused_experts_deep_gemm(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu", *,
                            w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                            expert_map: torch.Tensor | None = None, apply_router_weight_on_input: bool = False,
                            w1_scale: torch.Tensor, w2_scale: torch.Tensor, alpha: float = 1.702,
                            limit: float = 7.0) -> torch.Tensor:
    """``out [M, K]`` of ``fused_experts(quant="fp8_block")`` through DeepGEMM (module docstring). The caller
    validates the arguments as the op does; raises ValueError where the route does not apply (naming the
    rules), RuntimeError where DeepGEMM is not available."""
    reasons = inapplicable_reasons(w1, w2, w1_scale, w2_scale)
    if reasons:
        raise ValueError(f"{_WHO}: the DeepGEMM route does not apply: {'; '.join(reasons)}")
    M, K = hidden_states.shape
    E, N, topk = w1.size(0), w2.size(2), topk_ids.size(1)
    S, device = M * topk, hidden_states.device
    if M == 0:
        return hidden_states.new_zeros((0, K))
    dest, m_indices, local, valid = contiguous_layout(topk_ids, expert_map, E, alignment())
    R = m_indices.numel()
    # UE8M0 byte scales: power-of-two activation scales, the weights' bytes as the fp32 values DeepGEMM takes.
    ue8m0 = w1_scale.dtype == torch.uint8
    if ue8m0:
        w1_scale, w2_scale = e8m0_to_float(w1_scale), e8m0_to_float(w2_scale)
    if apply_router_weight_on_input:
        x_slots = (hidden_states.float().unsqueeze(1) * topk_weights.unsqueeze(2)).reshape(S, K)
        a1q, a1s = _scatter_rows(*quantize_fp8_per_token_group(x_slots, ue8m0=ue8m0), dest, R)
    else:
        # x is quantized once per token; each of its slots gets a copy of the row.
        q, s = quantize_fp8_per_token_group(hidden_states, ue8m0=ue8m0)
        token = torch.arange(S, device=device) // topk
        a1q, a1s = _scatter_rows(q.index_select(0, token), s.index_select(0, token), dest, R)
    h = torch.empty((R, 2 * N), dtype=torch.bfloat16, device=device)
    m_grouped_fp8_gemm(a1q, a1s, w1, w1_scale, h, m_indices)
    if w1_bias is not None:
        # Rows outside the segments (label -1) take expert 0's bias: they are never read back.
        h = w1_bias.index_select(0, m_indices.clamp(min=0).long()).add_(h)
    from moe_extension.experts.base import gated_activation  # here: moe_extension.experts imports this module

    a = gated_activation(activation, h.new_empty((h.size(0), h.size(1) // 2)), h, alpha, limit)
    a2q, a2s = quantize_fp8_per_token_group(a, ue8m0=ue8m0)
    y_rows = torch.empty((R, K), dtype=torch.bfloat16, device=device)
    m_grouped_fp8_gemm(a2q, a2s, w2, w2_scale, y_rows, m_indices)
    y = y_rows.index_select(0, dest).float()
    if w2_bias is not None:
        y.add_(w2_bias.index_select(0, local))
    if not apply_router_weight_on_input:
        y.mul_(topk_weights.reshape(S, 1))
    y.masked_fill_(~valid.unsqueeze(1), 0.0)  # invalid slots read the trash row: whatever it holds, 0
    return y.view(M, topk, K).sum(dim=1).to(hidden_states.dtype)
