"""Triton kernels of the LoRA terms on the routed experts: per (token, slot) pair ``p = t * topk + j`` with the
token's adapter ``l = token_lora_mapping[t]`` and the slot's local expert ``e`` (``_routing.local_expert``),

    shrink:  u[p]   = A[l, e] x[p]                 A [L, E, r, in], x[p] = x[t] or x[t, j]      u fp32 [r]
    expand:  out[p] = round(out[p] + g[p] B[l, e] u[p])   B [L, E, n, r], out [M, topk, n]   g: router weight or 1

for the active pairs (valid expert, adapter in [0, L)); the others are never touched by the expand. Math in
fp32, one rounding per stored value of ``out``; no float atomics (bitwise reproducible).

A pair's group is ``l * E + e`` (``slot_group``). Two schedules:
- direct (a few pairs: decode): the shrink runs one program per (pair, row of A), the expand one per (pair,
  column tile of B), or a base GEMV adds it in its epilogue (``lora_rows_delta``); each reads its own adapter
  tiles; fp32 products and sums.
- grouped: ``lora_group_ids_kernel`` writes every pair's group (-1 inactive) and ``_routing.route`` sorts the
  pairs by group into blocks of ``BLOCK_M`` pairs of one group; a shrink program multiplies a block's rows by
  its group's A (read once per block, not per pair), an expand program a block's ``u`` by a run of column tiles
  of B. Programs walk the blocks with a grid stride (blocks past the used ones read group -1 and are skipped), so
  the grid does not grow with the worst-case block count (L * E groups).
  Tensor-core dots: the shrink's x with A when both have the same 16-bit dtype (exact products, fp32
  accumulation); the expand's ``u`` with a bf16 B as two bf16 dots, ``u``'s high and low bf16 parts (16 bits of
  ``u``'s mantissa). Every other combination (the expand with fp32 or fp16 B, the shrink with mixed or fp32
  dtypes, anything in the interpreter) multiplies in fp32 ("ieee").
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_extension.kernels._routing import local_expert

# How the expand multiplies u (fp32) by B: fp32 products, or u split into two bf16 parts against bf16 B.
EXPAND_F32, EXPAND_BF16_SPLIT = tl.constexpr(0), tl.constexpr(1)
# NOTE: the slot arguments and the router-weight strides stay unspecialized (one compiled kernel for every batch
# and routing); the sizes R, K, NOUT and the other strides are specialized, so that Triton sees their
# divisibility by 16 and vectorizes the masked row loads and stores. H100, add_lora of gpt-oss-20b's w13 (E 32,
# 4 adapters) at M = 4096, rank 16: 612 us with them unspecialized (the expand alone 530), 237 us specialized
# (193); column add_w13_us of python benchmarks/bench_lora.py --models gpt-oss-20b --tokens 4096 --ranks 16.
_SLOT_ARGS = ["stride_im", "stride_ik", "E_global", "E", "P", "topk", "has_map", "stride_lm", "L"]


@triton.jit
def slot_group(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, lora_ptr, stride_lm, L, p):
    """Group ``l * E + e`` of pairs ``p`` (int32) and whether the pair is active; -1 for inactive pairs."""
    e, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    t = tl.where(p < P, p // topk, 0)
    adapter = tl.load(lora_ptr + t.to(tl.int64) * stride_lm, mask=p < P, other=-1)
    # Compared in the mapping's own dtype (an int64 id >= 2^31 must not wrap into range).
    active = valid & (adapter >= 0) & (adapter < L)
    return tl.where(active, tl.where(active, adapter, 0).to(tl.int32) * E + e, -1), active


@triton.jit
def lora_rows_delta(u_ptr, stride_up, b_ptr, stride_bl, stride_be, stride_bn, stride_br, lora_ptr, stride_lm, L, R, p,
                    t, expert, rows, BLOCK_R: tl.constexpr):
    """The expand of one valid pair fused into a base GEMV's epilogue: ``B[l, e][rows] u[p]`` fp32 [ROWS] and
    whether the pair is active (its token's adapter ``l`` in [0, L)); 0 for an inactive pair. ``u`` fp32 rows of
    ``lora_shrink`` (``stride_up`` per pair), ``B [L, E, n, r]``."""
    adapter = tl.load(lora_ptr + t.to(tl.int64) * stride_lm)
    # Compared in the mapping's own dtype (an int64 id >= 2^31 must not wrap into range), as slot_group does.
    active = (adapter >= 0) & (adapter < L)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < tl.where(active, R, 0)  # (not ``& active``: the interpreter rejects a block & scalar-bool mask)
    u = tl.load(u_ptr + p.to(tl.int64) * stride_up + r, mask=r_ok, other=0.0)
    b_rows = b_ptr + tl.where(active, adapter, 0).to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    b = tl.load(b_rows + rows.to(tl.int64)[:, None] * stride_bn + r[None, :] * stride_br, mask=r_ok[None, :],
                other=0.0)
    return tl.sum(b.to(tl.float32) * u[None, :], axis=1), active


@triton.jit
def group_matrix(ptr, g, E, stride_l, stride_e):
    """Base pointer of group g's matrix in a stack [L, E, rows, cols]: entry [l, e] for g = l * E + e."""
    adapter = g // E
    return ptr + adapter.to(tl.int64) * stride_l + (g - adapter * E).to(tl.int64) * stride_e


@triton.jit(do_not_specialize=_SLOT_ARGS)
def lora_group_ids_kernel(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, lora_ptr, stride_lm,
                          L, groups_ptr, BLOCK: tl.constexpr):
    """groups[p] = slot_group(p) for BLOCK pairs per program (int32, -1 inactive): the keys of the grouped schedule."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g, _ = slot_group(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, lora_ptr, stride_lm, L, p)
    tl.store(groups_ptr + p, g, mask=p < P)


@triton.jit(do_not_specialize=_SLOT_ARGS)
def lora_shrink_direct_kernel(x_ptr, stride_xm, stride_xj, stride_xk, a_ptr, stride_al, stride_ae, stride_ar,
                              stride_ak, u_ptr, stride_up, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P,
                              topk, has_map, lora_ptr, stride_lm, L, R, K, BLOCK_R: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """u[p, r0:r0+BLOCK_R] = A[l, e][r0:r0+BLOCK_R] x[p], program (pair, row tile); 0 for inactive pairs."""
    p = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    g, active = slot_group(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, lora_ptr, stride_lm,
                           L, p)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if active:
        t = p // topk
        x_row = x_ptr + t.to(tl.int64) * stride_xm + (p - t * topk) * stride_xj
        a_rows = group_matrix(a_ptr, g, E, stride_al, stride_ae) + r[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            ak = tl.load(a_rows + k[None, :] * stride_ak, mask=(r < R)[:, None] & (k < K)[None, :], other=0.0)
            acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    tl.store(u_ptr + p.to(tl.int64) * stride_up + r, acc, mask=r < R)


@triton.jit(do_not_specialize=_SLOT_ARGS + ["stride_wm", "stride_wj"])
def lora_expand_direct_kernel(out_ptr, stride_om, stride_oj, stride_on, u_ptr, stride_up, b_ptr, stride_bl, stride_be,
                              stride_bn, stride_br, w_ptr, stride_wm, stride_wj, ids_ptr, stride_im, stride_ik, map_ptr,
                              E_global, E, P, topk, has_map, lora_ptr, stride_lm, L, R, NOUT, HAS_W: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[p, n tile] += g[p] B[l, e][n tile] u[p], program (pair, column tile); inactive pairs untouched."""
    p = tl.program_id(0)
    g, active = slot_group(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, lora_ptr, stride_lm,
                           L, p)
    if active:
        t = p // topk
        j = p - t * topk
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        u = tl.load(u_ptr + p.to(tl.int64) * stride_up + r, mask=r < R, other=0.0)
        b = tl.load(group_matrix(b_ptr, g, E, stride_bl, stride_be) + n[:, None] * stride_bn + r[None, :] * stride_br,
                    mask=(n < NOUT)[:, None] & (r < R)[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1)
        if HAS_W:
            delta *= tl.load(w_ptr + t.to(tl.int64) * stride_wm + j * stride_wj)
        ptrs = out_ptr + t.to(tl.int64) * stride_om + j * stride_oj + n * stride_on
        old = tl.load(ptrs, mask=n < NOUT, other=0.0)
        tl.store(ptrs, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=n < NOUT)


@triton.jit
def _block_pairs(sorted_ptr, b, P, topk, BLOCK_M: tl.constexpr):
    """The pairs of sorted block b (the sentinel P in padding rows), which rows are real, and their tokens and
    slots (0 for padding rows)."""
    pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < P
    p = tl.where(real, pairs, 0)
    t = p // topk
    return p, real, t, p - t * topk


@triton.jit(do_not_specialize=["P", "topk", "E", "max_blocks"])
def lora_shrink_grouped_kernel(x_ptr, stride_xm, stride_xj, stride_xk, a_ptr, stride_al, stride_ae, stride_ar,
                               stride_ak, u_ptr, stride_up, sorted_ptr, block_group_ptr, max_blocks, P, topk, E, R, K,
                               SORTED_OUT: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """u rows of the blocks pid, pid + grid, ...: [BLOCK_M pairs, r] = x rows [BLOCK_M, K] @ A[l, e]^T. Rows go
    to the sorted positions (SORTED_OUT: the expand of the same plan reads them there) or to the pairs."""
    r = tl.arange(0, BLOCK_R)
    for b in range(tl.program_id(0), max_blocks, tl.num_programs(0)):
        g = tl.load(block_group_ptr + b)
        if g >= 0:
            pairs, real, t, j = _block_pairs(sorted_ptr, b, P, topk, BLOCK_M)
            x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_xm + j[:, None] * stride_xj
            a_cols = group_matrix(a_ptr, g, E, stride_al, stride_ae) + r[None, :] * stride_ar
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_rows + k[None, :] * stride_xk, mask=real[:, None] & (k < K)[None, :], other=0.0)
                ak = tl.load(a_cols + k[:, None] * stride_ak, mask=(k < K)[:, None] & (r < R)[None, :], other=0.0)
                if F32:
                    acc = tl.dot(xk.to(tl.float32), ak.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xk, ak, acc)
            if SORTED_OUT:
                u_rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
            else:
                u_rows = pairs
            tl.store(u_ptr + u_rows.to(tl.int64)[:, None] * stride_up + r[None, :], acc,
                     mask=real[:, None] & (r < R)[None, :])


@triton.jit(do_not_specialize=["P", "topk", "E", "max_blocks", "stride_wm", "stride_wj"])
def lora_expand_grouped_kernel(out_ptr, stride_om, stride_oj, stride_on, u_ptr, stride_up, b_ptr, stride_bl, stride_be,
                               stride_bn, stride_br, w_ptr, stride_wm, stride_wj, sorted_ptr, block_group_ptr,
                               max_blocks, P, topk, E, R, NOUT, SORTED_IN: tl.constexpr, HAS_W: tl.constexpr,
                               MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_R: tl.constexpr, TILES: tl.constexpr):
    """out rows of the blocks pid0, pid0 + grid0, ..., columns of the run pid1 of TILES column tiles (BLOCK_N
    each): += g * (u rows [BLOCK_M, r] @ B[l, e]^T). A program walks its run tile by tile, so the loads of the
    next tile of out and B overlap the current one's (software pipelining) and each row is read in order."""
    r = tl.arange(0, BLOCK_R)
    n_run = tl.program_id(1) * TILES * BLOCK_N
    for b in range(tl.program_id(0), max_blocks, tl.num_programs(0)):
        g = tl.load(block_group_ptr + b)
        if g >= 0:
            pairs, real, t, j = _block_pairs(sorted_ptr, b, P, topk, BLOCK_M)
            if SORTED_IN:
                u_rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
            else:
                u_rows = pairs
            u = tl.load(u_ptr + u_rows.to(tl.int64)[:, None] * stride_up + r[None, :],
                        mask=real[:, None] & (r < R)[None, :], other=0.0)
            if MODE == EXPAND_BF16_SPLIT:
                u_hi = u.to(tl.bfloat16)
                u_lo = (u - u_hi.to(tl.float32)).to(tl.bfloat16)
            if HAS_W:
                gw = tl.load(w_ptr + t.to(tl.int64) * stride_wm + j * stride_wj, mask=real, other=0.0)
            b_cols = group_matrix(b_ptr, g, E, stride_bl, stride_be) + r[:, None] * stride_br
            rows = out_ptr + (t.to(tl.int64) * stride_om + j * stride_oj)
            for i in range(TILES):
                n = n_run + i * BLOCK_N + tl.arange(0, BLOCK_N)
                bt = tl.load(b_cols + n[None, :] * stride_bn, mask=(r < R)[:, None] & (n < NOUT)[None, :], other=0.0)
                ptrs = rows[:, None] + n[None, :] * stride_on
                mask = real[:, None] & (n < NOUT)[None, :]
                old = tl.load(ptrs, mask=mask, other=0.0)
                if MODE == EXPAND_BF16_SPLIT:
                    delta = tl.dot(u_lo, bt, tl.dot(u_hi, bt))
                else:
                    delta = tl.dot(u, bt.to(tl.float32), input_precision="ieee")
                if HAS_W:
                    delta *= gw[:, None]
                tl.store(ptrs, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)
