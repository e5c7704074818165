"""Fused softmax + top-k routing: gating logits [M, E] (fp32/fp16/bf16, any strides) -> topk_weights fp32
[M, topk] and topk_ids int32 [M, topk].

- ``renormalize=False``: softmax over all E, then the top-k of the fp32 probabilities (not renormalized).
- ``renormalize=True``: top-k of the raw logits, then softmax over the k chosen values.
Largest first, ties (equal values) to the lower expert id; any k from 1 to E, E up to 512 (any E that fits
a tile). Math in fp32. A NaN row selects nothing valid: its ids are >= E (invalid slots downstream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_extension.kernels._launch import cdiv, device_guard, next_power_of_2


@triton.jit(do_not_specialize=["M"])
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, M, E,
    stride_lm, stride_le, stride_wm, stride_wk, stride_im, stride_ik,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    col_ok = cols < E
    r64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + r64[:, None] * stride_lm + cols[None, :] * stride_le,
                mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    if not RENORMALIZE:
        # Select on the probabilities themselves: values that round to the same probability (e.g. both
        # underflowing to 0) tie, and ties go to the lower id.
        num = tl.where(col_ok[None, :], tl.exp(x - row_max[:, None]), 0.0)
        x = num / tl.sum(num, axis=1)[:, None]
    kcols = tl.arange(0, TOPK_P2)
    sel_val = tl.zeros([BLOCK_R, TOPK_P2], dtype=tl.float32)
    sel_id = tl.zeros([BLOCK_R, TOPK_P2], dtype=tl.int32)
    taken = ~col_ok[None, :] | (rows[:, None] < 0)
    for i in range(0, TOPK):
        cand = tl.where(taken, float("-inf"), x)
        best = tl.max(cand, axis=1)
        # Lowest column holding the maximum among the columns not taken yet (ties -> lower expert id).
        idx = tl.min(tl.where((cand == best[:, None]) & ~taken, cols[None, :], BLOCK_E), axis=1)
        taken = taken | (cols[None, :] == idx[:, None])
        sel_val = tl.where(kcols[None, :] == i, best[:, None], sel_val)
        sel_id = tl.where(kcols[None, :] == i, idx[:, None], sel_id)
    k_ok = kcols < TOPK
    if RENORMALIZE:
        # The first selected value is the row maximum: exp(v - max) <= 1, sum >= 1.
        num = tl.where(k_ok[None, :], tl.exp(sel_val - row_max[:, None]), 0.0)
        weights = num / tl.sum(num, axis=1)[:, None]
    else:
        weights = sel_val
    mask = row_ok[:, None] & k_ok[None, :]
    tl.store(weights_ptr + r64[:, None] * stride_wm + kcols[None, :] * stride_wk, weights, mask=mask)
    tl.store(ids_ptr + r64[:, None] * stride_im + kcols[None, :] * stride_ik, sel_id, mask=mask)


def topk_softmax_triton(gating_output: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [M, topk], topk_ids int32 [M, topk]) of gating logits [M, E]."""
    M, E = gating_output.shape
    dev = gating_output.device
    weights = torch.empty((M, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((M, topk), dtype=torch.int32, device=dev)
    if M == 0:
        return weights, ids
    block_e = max(16, next_power_of_2(E))
    # NOTE: ~4 K logits per program (rows x padded experts): one row per program at E = 512 (the k
    # selection passes are reductions over the row), up to 64 rows at small E; fewer rows for tiny M.
    block_r = max(1, min(64, 4096 // block_e, next_power_of_2(M)))
    num_warps = 8 if block_e >= 512 else 4
    grid = (cdiv(M, block_r),)
    with device_guard(dev):
        _topk_softmax_kernel[grid](
            gating_output, weights, ids, M, E,
            gating_output.stride(0), gating_output.stride(1), weights.stride(0), weights.stride(1),
            ids.stride(0), ids.stride(1),
            TOPK=topk, TOPK_P2=max(2, next_power_of_2(topk)), RENORMALIZE=bool(renormalize),
            BLOCK_R=block_r, BLOCK_E=block_e, num_warps=num_warps,
        )
    return weights, ids
