"""Triton kernels of expert parallelism's row traffic (layouts in ``moe_extension.parallel.rows``).

- ``plan_rows_triton``: the ``RowPlan`` in one launch of one program: a scan over the tokens in chunks that
  keeps a running row count per destination rank (with exact sizes, a first pass counts the rows so that
  the groups lie back to back). The plan's inputs and outputs are small (ids and ints), so one program
  suffices. Besides ``slot [M, W]`` it writes ``source [rows]``: ``t * W + r`` for the
  row holding token t for rank r.
- ``pack_rows_triton``: the send buffer ``uint8 [rows, row_bytes]``, grid (rows,): program p writes row p from
  its ``source`` (the hidden state, or its e4m3 values and per-128-column scales; then the token's ids on
  that rank and its weights), a padding row (ids -1; with a capacity), or, past the rows sent with exact
  sizes, nothing.
- ``combine_rows_triton``: ``out [M, K]``, grid (M, cdiv(K, BLOCK_K)): the returned rows of token t summed in
  fp32 in rank order, one rounding; NaN where the token did not fit its capacity.
- ``dequantize_rows_triton``: received fp8 rows ``q [R, K]`` e4m3 with ``s [R, ceil(K / 128)]`` fp32 (strided
  views of the buffer) -> ``[R, K]`` in the tokens' dtype, ``q * s`` rounded once, in one pass.

Same results as ``plan_rows`` / ``pack_rows_torch`` / ``combine_rows_torch`` / ``dequantize_fp8_per_token_group``
(the fp8 values bitwise: the same quantization rule, ``quantize_fp8_groups``). Launches on the current stream;
no host sync.

The plan is one launch because the PyTorch plan is about 15 small launches. Those are bound by host time
at decode: each costs more to issue than the GPU spends on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_extension.kernels._launch import cdiv, device_guard, next_power_of_2
from moe_extension.kernels._weight_formats import quantize_fp8_groups


@triton.jit
def _slot_ranks(ids_ptr, owner_ptr, rows, M, TOPK, E_GLOBAL, W, stride_im, BLOCK_T: tl.constexpr):
    """``(ids [R, BLOCK_T], rank [R, BLOCK_T])`` of tokens ``rows``: each slot's id and the rank holding its expert
    (-1: invalid id, or held by no rank)."""
    j = tl.arange(0, BLOCK_T)
    ids = tl.load(ids_ptr + rows[:, None].to(tl.int64) * stride_im + j[None, :],
                  mask=(rows < M)[:, None] & (j < TOPK)[None, :], other=-1)
    known = (ids >= 0) & (ids < E_GLOBAL)
    rank = tl.load(owner_ptr + tl.where(known, ids, 0), mask=known, other=-1)
    return ids, tl.where((rank >= 0) & (rank < W), rank, -1)


@triton.jit
def plan_rows_kernel(ids_ptr, owner_ptr, slot_ptr, source_ptr, counts_ptr, demand_ptr, overflow_ptr, M, TOPK,
                     E_GLOBAL, W, CAPACITY, stride_im, stride_sm,
                     FIXED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program: the tokens in chunks of BLOCK_M, a running count of rows per destination rank (a scan)."""
    ranks = tl.arange(0, BLOCK_W)
    start = ranks * CAPACITY
    if not FIXED:  # exact sizes: the destinations' groups back to back, so count them first
        total = tl.zeros((BLOCK_W,), dtype=tl.int32)
        for m0 in range(0, M, BLOCK_M):
            _, rank = _slot_ranks(ids_ptr, owner_ptr, m0 + tl.arange(0, BLOCK_M), M, TOPK, E_GLOBAL, W, stride_im,
                                  BLOCK_T)
            total += tl.sum(tl.max((rank[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1), axis=0)
        start = tl.cumsum(total, axis=0) - total
    seen = tl.zeros((BLOCK_W,), dtype=tl.int32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        _, rank = _slot_ranks(ids_ptr, owner_ptr, rows, M, TOPK, E_GLOBAL, W, stride_im, BLOCK_T)
        hit = tl.max((rank[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_M, BLOCK_W]
        position = seen[None, :] + tl.cumsum(hit, axis=0) - 1
        seen += tl.sum(hit, axis=0)
        fits = hit != 0
        if FIXED:
            fits = fits & (position < CAPACITY)
        slot = tl.where(fits, start[None, :] + position, -1)
        inside = (rows < M)[:, None] & (ranks < W)[None, :]
        tl.store(slot_ptr + rows[:, None].to(tl.int64) * stride_sm + ranks[None, :], slot.to(tl.int64), mask=inside)
        tl.store(source_ptr + slot, rows[:, None] * W + ranks[None, :], mask=inside & fits)
        over = tl.max(((hit != 0) & ~fits).to(tl.int32), axis=1)
        tl.store(overflow_ptr + rows, over != 0, mask=rows < M)
    tl.store(demand_ptr + ranks, seen.to(tl.int64), mask=ranks < W)
    if FIXED:
        seen = tl.minimum(seen, CAPACITY)
    tl.store(counts_ptr + ranks, seen.to(tl.int64), mask=ranks < W)


def plan_rows_triton(topk_ids: torch.Tensor, expert_owner: torch.Tensor, world_size: int, capacity: int | None):
    """``moe_extension.parallel.rows.plan_rows`` in one launch, with ``source`` filled (the pack kernel's input)."""
    from moe_extension.parallel.rows import RowPlan

    M, topk = topk_ids.shape
    dev = topk_ids.device
    rows = RowPlan.num_rows(M, world_size, capacity)
    slot = torch.empty((M, world_size), dtype=torch.int64, device=dev)
    source = torch.empty((max(rows, 1),), dtype=torch.int32, device=dev)
    counts = torch.empty((world_size,), dtype=torch.int64, device=dev)
    demand = torch.empty_like(counts)
    overflow = torch.empty((M,), dtype=torch.bool, device=dev)
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    block_t, block_w = next_power_of_2(topk), next_power_of_2(world_size)
    block_m = max(16, min(256, 8192 // (block_t * block_w)))
    with device_guard(dev):
        plan_rows_kernel[(1,)](
            ids, expert_owner, slot, source, counts, demand, overflow, M, topk, expert_owner.shape[0], world_size,
            0 if capacity is None else capacity, ids.stride(0), slot.stride(0),
            FIXED=capacity is not None, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4,
        )
    return RowPlan(slot, counts, demand, overflow, capacity, source)


@triton.jit
def pack_rows_kernel(x_ptr, w_ptr, ids_ptr, owner_ptr, source_ptr, counts_ptr, data_ptr, scale_ptr, out_ids_ptr,
                     out_w_ptr, M, K, TOPK, E_GLOBAL, W, CAPACITY, stride_xm, stride_xk, stride_wm, stride_im,
                     stride_dr, stride_gr, stride_ir, stride_vr,
                     FIXED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                     FP8: tl.constexpr, PTX: tl.constexpr):
    """Program p writes row p of the send buffer: a token's row, a padding row (ids -1; with a capacity) or,
    past the rows that are sent (exact sizes), nothing."""
    p = tl.program_id(0)
    j = tl.arange(0, BLOCK_T)
    if FIXED:
        if p % CAPACITY >= tl.load(counts_ptr + p // CAPACITY):
            tl.store(out_ids_ptr + p.to(tl.int64) * stride_ir + j, tl.full((BLOCK_T,), -1, tl.int32), mask=j < TOPK)
            return
    else:
        ranks = tl.arange(0, BLOCK_W)
        if p >= tl.sum(tl.load(counts_ptr + ranks, mask=ranks < W, other=0)):
            return
    src = tl.load(source_ptr + p)
    t = src // W
    r = src % W
    row = p.to(tl.int64)
    ids, rank = _slot_ranks(ids_ptr, owner_ptr, tl.full((1,), t, tl.int32), M, TOPK, E_GLOBAL, W, stride_im, BLOCK_T)
    tl.store(out_ids_ptr + row * stride_ir + j[None, :], tl.where(rank == r, ids, -1).to(tl.int32),
             mask=(j < TOPK)[None, :])
    tl.store(out_w_ptr + row * stride_vr + j, tl.load(w_ptr + t.to(tl.int64) * stride_wm + j, mask=j < TOPK),
             mask=j < TOPK)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xm + offs * stride_xk, mask=offs < K, other=0.0)
        if FP8:
            q, s = quantize_fp8_groups(x, PTX)
            tl.store(data_ptr + row * stride_dr + offs, q.to(data_ptr.dtype.element_ty), mask=offs < K)
            g = k0 // 128 + tl.arange(0, BLOCK_K // 128)
            tl.store(scale_ptr + row * stride_gr + g, s, mask=g < tl.cdiv(K, 128))
        else:
            tl.store(data_ptr + row * stride_dr + offs, x, mask=offs < K)


def pack_rows_triton(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     expert_owner: torch.Tensor, plan, fmt) -> torch.Tensor:
    """The send buffer of ``moe_extension.parallel.rows`` (``plan`` from ``plan_rows_triton``, ``fmt`` a
    RowFormat); with exact sizes the rows past ``plan.counts.sum()`` are left unwritten (they are not sent)."""
    M, W = plan.slot.shape
    dev = hidden_states.device
    buf = torch.empty((plan.rows, fmt.row_bytes), dtype=torch.uint8, device=dev)
    if plan.rows == 0:
        return buf
    out_ids, out_w = fmt.ids(buf), fmt.weights(buf)
    if fmt.fp8:
        data, scale = fmt.fp8_data(buf)
        block_k = min(1024, next_power_of_2(max(fmt.K, 128)))
    else:
        data = scale = fmt.data(buf)
        block_k = min(2048, next_power_of_2(fmt.K))
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    weights = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    fixed = plan.capacity is not None
    with device_guard(dev):
        pack_rows_kernel[(plan.rows,)](
            hidden_states, weights, ids, expert_owner, plan.source, plan.counts, data, scale, out_ids, out_w,
            M, fmt.K, fmt.topk, expert_owner.shape[0], W, plan.capacity or 0,
            hidden_states.stride(0), hidden_states.stride(1), weights.stride(0), ids.stride(0), data.stride(0),
            scale.stride(0), out_ids.stride(0), out_w.stride(0),
            FIXED=fixed, BLOCK_K=block_k, BLOCK_T=next_power_of_2(fmt.topk),
            BLOCK_W=next_power_of_2(W), FP8=fmt.fp8, PTX=dev.type == "cuda", num_warps=4,
        )
    return buf


@triton.jit
def combine_rows_kernel(y_ptr, slot_ptr, overflow_ptr, out_ptr, K, stride_yr, stride_sm, stride_ss, stride_om,
                        W: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for r in tl.static_range(W):
        row = tl.load(slot_ptr + t * stride_sm + r * stride_ss)
        if row >= 0:
            acc += tl.load(y_ptr + row * stride_yr + offs, mask=offs < K, other=0.0).to(tl.float32)
    if tl.load(overflow_ptr + t) != 0:
        acc = tl.full((BLOCK_K,), float("nan"), tl.float32)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < K)


def combine_rows_triton(returned: torch.Tensor, plan, dtype: torch.dtype) -> torch.Tensor:
    """``out [M, K]`` from the returned rows (``combine_rows_torch``'s result; ``returned [rows, K]``, unit stride
    along K)."""
    M, W = plan.slot.shape
    K = returned.shape[1]
    out = torch.empty((M, K), dtype=dtype, device=returned.device)
    if M == 0:
        return out
    block_k = min(1024, next_power_of_2(K))
    with device_guard(returned.device):
        combine_rows_kernel[(M, cdiv(K, block_k))](
            returned, plan.slot, plan.overflow, out, K, returned.stride(0), plan.slot.stride(0),
            plan.slot.stride(1), out.stride(0), W=W, BLOCK_K=block_k, num_warps=4,
        )
    return out


@triton.jit
def dequantize_rows_kernel(q_ptr, s_ptr, out_ptr, K, stride_qr, stride_sr, stride_or, BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    q = tl.load(q_ptr + r * stride_qr + offs, mask=offs < K, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + r * stride_sr + offs // 128, mask=offs < K, other=0.0)
    tl.store(out_ptr + r * stride_or + offs, (q * s).to(out_ptr.dtype.element_ty), mask=offs < K)


def dequantize_rows_triton(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [R, K]`` float8_e4m3fn and ``s [R, ceil(K / 128)]`` fp32 (unit stride along columns) -> ``[R, K]``
    ``dtype``: ``dequantize_fp8_per_token_group(q, s).to(dtype)`` in one launch, bitwise equal."""
    R, K = q.shape
    out = torch.empty((R, K), dtype=dtype, device=q.device)
    if R == 0 or K == 0:
        return out
    block_k = min(2048, next_power_of_2(max(K, 128)))
    with device_guard(q.device):
        dequantize_rows_kernel[(R, cdiv(K, block_k))](
            q, s, out, K, q.stride(0), s.stride(0), out.stride(0), BLOCK_K=block_k, num_warps=4,
        )
    return out
