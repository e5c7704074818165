"""Direct (per-pair, no routing) expert GEMVs with tensor-core steps and a split reduction: the decode schedule of
the weight formats of ``WeightOperand.dot_gemvs``: MXFP4 in the MMA layout (``WFMT_MXFP4_MMA``, whose tiles only go
through tensor cores) and fp8 block (``WFMT_FP8_BLOCK``: e4m3 tiles into the fp8 MMA, no dequantization); and of
16-bit dense weights where the config says so (``GemmConfig.dot``: the heuristic's choice on an expert-parallel
shard, ``_configs.shard_dot_gemvs``).

Pairs ``p = t * topk + j`` of token ``t`` and slot ``j``; ``e`` = local expert of the slot (``_routing.local_expert``);
weights ``[E, out, in]`` in the format ``WFMT`` (``_weight_formats``). A program multiplies one tile of weight rows
by one activation row over one split of the reduction: ``dot_step_t`` with the tile's weight rows as the MMA's M and
the row as column 0 of its 16 (the other columns are zeros), so the weights are decoded (MXFP4) or the row quantized
(fp8 block, per 128 columns) exactly as in the sorted kernels.

Items (tile of output columns, pair, split of the reduction); a pair has work when its slot is valid (gemv2 with
ZERO_ROWS also slot 0 of a token without valid slots: that token's zeros, at split 0). Grid (cdiv(N_OUT, BLOCK_N),
P, SPLIT): a program per item, those of pairs without work exit. With WORK_LIST, grid (programs,): each program
takes the items of the pairs with work in turn (item ``i``, ``i + programs``, ...), the pairs found in order by
scanning them CHUNK at a time (``_active_pairs``, ``_nth_active``); the host's choice (``fused_experts._gemv_grid``,
``_gemv_work_list``), where the waves of exiting programs of an expert-parallel shard cost more than the loop.

- ``gemv1_dot_kernel``: x[t] times the rows of gemm1's output tile (2 BLOCK_N rows with a gated activation, stacked
  as in ``_grouped_gemm._gemm1_block``) -> ``a[p, tile]`` with gemm1's epilogue (router weight or not, bias,
  activation); rows of invalid pairs untouched. With WORK_LIST and ZERO_ROWS it also stores the zero rows of the
  fused op's output (``z``: the tokens without a valid slot, ``_zero_rows``), which gemv2 then leaves alone.
- ``gemv2_dot_kernel``: W2[e] rows times a[t, j] -> ``out[t, tile]`` summed over the token's slots in slot order
  (SUM_SLOTS; a token without valid slots gets 0 here with ZERO_ROWS, else from gemv1), or ``out[t, j, tile]`` per
  pair (rows of invalid pairs untouched), with bias and router weight as gemm2.

NOTE: grids of pair groups sized by the pairs expected here, whose programs took their group's valid pairs one after
the other, were never faster on the H200 and slower where a program took several (DeepSeek-V3 fp8 block, 32 of 256
experts: M = 1 16.3 against 16.1 us, M = 8 94.9 against 90.2; Qwen3-30B-A3B, 16 of 128: M = 1 10.3 against 8.4),
and the loop over pairs held 133-254 registers against 40-94 (benchmarks/results/ab_pair_groups_h200.txt: ``python
benchmarks/ab_fused_experts.py --quant fp8_block --activation silu --model deepseek-v3 --tokens 1 --local-experts 32
--all-pair-groups`` at 22e42fd). The work lists spread the items with work over all programs instead.

Split reduction: with SPLIT > 1 (gemv2: or more than one valid slot per output tile), each program stores its fp32
partial sum in ``part``, then increments its output tile's counter in ``cnt`` (int32, zeroed by the caller; release:
its stores come first); the program that brings the counter to the number of programs of the tile (acquire: SPLIT
times the valid slots) reads the partials back in split (and slot) order and runs the epilogue. Whichever program
counts last, the sums are the same: bitwise reproducible, no float atomics, no host sync, every size from shapes.

NOTE: gemv1 does not prefetch gemv2's weights into L2: with each program prefetching its share of its pair expert's
gemv2 slice, gemv1 slowed more than gemv2 gained (H200, gpt-oss-120b MXFP4 M = 1: 32.2 against 28.5 us, gemv1 19.4
against 15.8, gemv2 10.7 against 11.0; fp8 block, DeepSeek-V3's shard of 32 of 256 experts M = 1 17.6 against 16.6;
benchmarks/results/ab_decode_pipes_h200.txt, section 3d).

NOTE: MXFP4's GEMVs stream their weights at about half the rate of a plain read of the same bytes; a CUDA kernel
of this form did not change that: fragment words loaded straight into registers, decoded there and fed to mma.sync,
took 15.3-15.7 us for gpt-oss-120b's first GEMV at M = 1 on the H200 against 16.2 for gemv1 here (eager), 11.4 for its
own loads and 8.8 for a streaming read of the codes (second GEMV 9.1 against 11.1, 5.2 streamed), and no less with
its loads kept in flight by cp.async while its warps decoded (15.9-19.3): not load latency bounds it (which pipe does
was not profiled). Nor an fp8 form of it (codes placed as e4m3 in 5 integer instructions per word instead of 13, the
bf16 row split exactly into e4m3 hi and lo columns): on mma.sync m16n8k32 22.2 us against 15.7, since sm_90 runs that
MMA as conversions and fp16 MMAs; on wgmma m64n8k32, one warpgroup per 64 rows over all of K, 14.7 for the first GEMV
but 11.7 for the second, and with K split over 2 to 8 blocks 18.2-30.3 and 10.4-16.6 (faster only at one pair)
(benchmarks/results/probe_mxfp4_gemv_h200.txt: ``nvcc -O3 -std=c++17 -gencode
arch=compute_90a,code=sm_90a -o /tmp/probe_mxfp4_gemv benchmarks/probe_mxfp4_gemv.cu && /tmp/probe_mxfp4_gemv``).

PDL (launched with programmatic dependent launch): a program reads only the call's inputs (ids, map, router weights)
before it waits for the previous kernel (``_launch.grid_dependency``); the activations, the counters and every store
come after. A program of one item waits only if its pair has work, after reading its pair's inputs (waiting first,
then reading them, took Qwen3-30B-A3B's fp8 block layer 20.6 against 19.0 us at M = 1 on the H200:
benchmarks/results/ab_gemv_work_list_h200.txt, run 3); one with a work list waits once, before its items.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_extension.kernels._grouped_gemm import _RUNTIME_STRIDES, gemm1_epilogue, gemm1_weight_rows, wrap
from moe_extension.kernels._launch import grid_dependency
from moe_extension.kernels._lora import lora_rows_delta
from moe_extension.kernels._routing import local_expert
from moe_extension.kernels._weight_formats import (acc_finish, dot_step_t, quantize_fp8_groups, tile_ptrs,
                                                   weight_advance)

# Pairs scanned at a time for those with work (``_active_pairs``); a decode call has a few to a few dozen.
CHUNK = tl.constexpr(64)
# Columns of a zero row stored at a time (``_zero_rows``).
ZERO_BLOCK = tl.constexpr(1024)


@triton.jit
def _rows_times_row(x_row, xs_row, w_ptr, ws_ptr, e64, wr, g, k0, k_end, stride_xk, stride_we, stride_wn, stride_wk,
                    stride_se, stride_sn, stride_sk, W_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    WFMT: tl.constexpr, PTX: tl.constexpr, DOT_PREC: tl.constexpr, G_ON_A: tl.constexpr,
                    A_Q: tl.constexpr):
    """[W_ROWS] fp32: sum over k0 <= k < k_end of W[e, wr, k] * x[k] (x = the row at ``x_row``, times ``g`` first
    with G_ON_A), in tensor-core steps of BLOCK_K columns (k0 a multiple of BLOCK_K). A_Q (fp8 block): the row holds
    e4m3 values already, and ``xs_row`` its scales per 128 columns (``quantize_fp8_rows``; one per step)."""
    r16 = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs, s_ptrs = tile_ptrs(w_ptr, ws_ptr, e64, wr, k0, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                               stride_sk, BLOCK_K, WFMT, False)
    # The row as row 0 of a 16-row tile loaded like any dot operand (rows 1.. masked: zeros, nothing read), which
    # Triton pipelines into shared memory with the weight tiles.
    # NOTE: a plain load of the row per step (not pipelined, its latency in every step) took the GEMVs 24.6 and
    # 16.4 us at gpt-oss-120b M = 1 on the H100, this form 20.9 and 15.1 (torch.profiler kernel times of eager
    # calls, measured by replacing the load; 128-row tiles on 4 warps, splits 2 and 4).
    acc_t = tl.zeros([W_ROWS, 16], dtype=tl.float32)
    for kk in range(0, tl.cdiv(k_end - k0, BLOCK_K)):
        k_left = k_end - k0 - kk * BLOCK_K
        x_ptrs = x_row + (k0 + kk * BLOCK_K + offs_k)[None, :] * stride_xk + r16[:, None] * 0
        if EVEN_K:
            a = tl.load(x_ptrs, mask=(r16 == 0)[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=(r16 == 0)[:, None] & (offs_k < k_left)[None, :], other=0.0)
        if A_Q:
            a_s = tl.load(xs_row + k0 // BLOCK_K + kk)
        else:
            a_s = g  # unused
        if G_ON_A:
            a = a.to(tl.float32) * g[:, None]
        acc_t = dot_step_t(acc_t, a, a_s, w_ptrs, s_ptrs, k_left, EVEN_K, BLOCK_K, WFMT, PTX, DOT_PREC, A_Q)
        w_ptrs, s_ptrs = weight_advance(w_ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)
    acc_t = acc_finish(acc_t, WFMT)
    # rows 1.. multiplied zeros: only row 0 is kept (a NaN weight must not reach it through them)
    return tl.sum(tl.where((r16 == 0)[None, :], acc_t, 0.0), axis=1)


@triton.jit
def _arrive(cnt_ptr, expected):
    """After this program's partial stores: count it in ``cnt_ptr`` (acq_rel, gpu scope); True for the program that
    completes the count (the others' partials are then visible to it)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == expected - 1


@triton.jit
def _active(pp, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map, ZERO_ROWS: tl.constexpr):
    """Whether the pairs ``pp`` (int32 [CHUNK]) have work: a valid slot, or (ZERO_ROWS) slot 0 of a token none of
    whose slots is valid (its output row of zeros)."""
    _, ok = local_expert(ids_ptr, pp, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    if ZERO_ROWS:
        first = (pp // topk) * topk
        any_ok = pp < 0
        for jj in range(0, topk):
            _, o = local_expert(ids_ptr, first + jj, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
            any_ok = any_ok | o
        ok = ok | ((pp == first) & (pp < P) & ~any_ok)
    return ok


@triton.jit
def _active_pairs(P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map, ZERO_ROWS: tl.constexpr):
    """The pairs with work (``_active``): the first CHUNK pairs' indices, flags and running counts, and the count
    over all P pairs."""
    pp0 = tl.arange(0, CHUNK)
    act0 = _active(pp0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map, ZERO_ROWS)
    cum0 = tl.cumsum(act0.to(tl.int32), axis=0)
    n = tl.sum(act0.to(tl.int32), axis=0)
    for c0 in range(CHUNK, P, CHUNK):
        act = _active(c0 + pp0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map, ZERO_ROWS)
        n += tl.sum(act.to(tl.int32), axis=0)
    return pp0, act0, cum0, n


@triton.jit
def _nth_active(q, pp0, act0, cum0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
                ZERO_ROWS: tl.constexpr):
    """The pair of the q-th (from 0) pair with work, in pair order (q below their count)."""
    p = tl.max(tl.where(act0 & (cum0 == q + 1), pp0, -1), axis=0)
    n = tl.max(cum0, axis=0)
    if q >= n:  # past the first CHUNK pairs (P > CHUNK): scan on
        for c0 in range(CHUNK, P, CHUNK):
            act = _active(c0 + pp0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
                          ZERO_ROWS)
            cum = n + tl.cumsum(act.to(tl.int32), axis=0)
            p = tl.maximum(p, tl.max(tl.where(act & (cum == q + 1), c0 + pp0, -1), axis=0))
            n = tl.max(cum, axis=0)
    return p


@triton.jit
def _items(P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map, per_pair,
           ZERO_ROWS: tl.constexpr, WORK_LIST: tl.constexpr):
    """The program's item loop (start, end, step) and, with WORK_LIST, the first scan chunk of the pairs with work
    (``_active_pairs``); without, its one item (from the program ids, ``_item``)."""
    if WORK_LIST:
        pp0, act0, cum0, n_active = _active_pairs(P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E,
                                                  has_map, ZERO_ROWS)
        return tl.program_id(0), n_active * per_pair, tl.num_programs(0), pp0, act0, cum0
    else:
        pp0 = tl.arange(0, CHUNK)
        return 0, 1, 1, pp0, pp0 < 0, pp0


@triton.jit
def _item(item, per_pair, pp0, act0, cum0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
          SPLIT: tl.constexpr, ZERO_ROWS: tl.constexpr, WORK_LIST: tl.constexpr):
    """(output tile, pair, split) of the program's item: of the pairs with work the ``item // per_pair``-th, with
    WORK_LIST; else the program's ids."""
    if WORK_LIST:
        q = item // per_pair
        pid_n = (item - q * per_pair) // SPLIT
        p = _nth_active(q, pp0, act0, cum0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
                        ZERO_ROWS)
        return pid_n, p, item - q * per_pair - pid_n * SPLIT
    else:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _zero_rows(z_ptr, n_tokens, width, stride_zm, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E,
               has_map):
    """Zeroes ``z[t, :width]`` (the fused op's output, rows of contiguous columns, row stride ``stride_zm``) for the
    tokens t none of whose slots is valid: the tokens ``program_id``, ``program_id + programs``, ...; each token's
    slots are read CHUNK at a time."""
    jj = tl.arange(0, CHUNK)
    zeros = tl.zeros([ZERO_BLOCK], dtype=z_ptr.dtype.element_ty)
    for t in range(tl.program_id(0), n_tokens, tl.num_programs(0)):
        n_valid = t * 0
        for j0 in range(0, topk, CHUNK):
            _, ok = local_expert(ids_ptr, t * topk + j0 + jj, tl.minimum(P, t * topk + topk), stride_im, stride_ik,
                                 map_ptr, E_global, E, topk, has_map)
            n_valid += tl.sum(ok.to(tl.int32), axis=0)
        if n_valid == 0:
            for c0 in range(0, width, ZERO_BLOCK):
                offs = c0 + tl.arange(0, ZERO_BLOCK)
                tl.store(z_ptr + tl.cast(t, tl.int64) * stride_zm + offs, zeros, mask=offs < width)


@triton.jit(do_not_specialize=["E_global", "E", "P", "topk", "has_map", "has_bias", "router_on_input",
                               *_RUNTIME_STRIDES, "stride_im", "stride_ik", "n_tokens", "z_width", "stride_zm"])
def gemv1_dot_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, os_ptr, part_ptr, cnt_ptr, gw_ptr, ids_ptr, map_ptr, E_global, E,
    P, topk, N_OUT, N_HALF, K, k_per_split, has_map, has_bias, router_on_input,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_bn,
    stride_om, stride_on, stride_im, stride_ik, stride_gm, stride_gk, stride_xsm, stride_osm, alpha, limit,
    u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr, lm_ptr, stride_lm, L, R,
    z_ptr, n_tokens, z_width, stride_zm,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr, G_ON_A: tl.constexpr, LORA: tl.constexpr,
    BLOCK_R: tl.constexpr, A_Q: tl.constexpr, Q_OUT: tl.constexpr, PDL: tl.constexpr, WORK_LIST: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
):
    """out[p, n0:n0+BLOCK_N] of gemm1 (module docstring); ``part`` [SPLIT, P, tiles, W_ROWS] fp32 and ``cnt``
    [P, tiles] with SPLIT > 1. G_ON_A as in ``_gemm1_block``. LORA (ACT 0 only): plus ``g B[l, e] u[p]`` on the
    active pairs (``_lora.lora_rows_delta``), before the one rounding. fp8 block: A_Q, ``x`` holds e4m3 rows and
    ``xs_ptr`` their scales per 128 columns (row stride ``stride_xsm``); Q_OUT (BLOCK_N a multiple of 128), the
    output is stored quantized for gemm2 (e4m3 values in ``out``, scales per 128 columns in ``os_ptr``, row stride
    ``stride_osm``), as ``quantize_fp8_groups`` computes them from the fp32 result."""
    tl.static_assert(not LORA or ACT == 0, "the LoRA expand is fused without an activation only")
    tiles = tl.cdiv(N_OUT, BLOCK_N)
    per_pair = tiles * SPLIT
    W_ROWS: tl.constexpr = BLOCK_N if ACT == 0 else 2 * BLOCK_N
    start, end, step, pp0, act0, cum0 = _items(P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
                                               per_pair, False, WORK_LIST)
    if WORK_LIST:
        grid_dependency(PDL)
        if ZERO_ROWS:
            _zero_rows(z_ptr, n_tokens, z_width, stride_zm, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global,
                       E, has_map)
    for item in range(start, end, step):
        pid_n, p, s = _item(item, per_pair, pp0, act0, cum0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global,
                            E, has_map, SPLIT, False, WORK_LIST)
        expert, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
        if valid:
            t = p // topk
            n0 = pid_n * BLOCK_N
            wr = gemm1_weight_rows(n0, N_OUT, N_HALF, ACT, BLOCK_N)
            zero = tl.zeros([1], dtype=tl.int32)
            g = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + (p - t * topk) * stride_gk + zero,
                        mask=zero + router_on_input != 0, other=1.0).to(tl.float32)
            if not WORK_LIST:
                grid_dependency(PDL)
            k0 = s * k_per_split
            h = _rows_times_row(x_ptr + t.to(tl.int64) * stride_xm, xs_ptr + t.to(tl.int64) * stride_xsm, w_ptr,
                                ws_ptr, expert.to(tl.int64), wr, g, k0, tl.minimum(K, k0 + k_per_split), stride_xk,
                                stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, W_ROWS, BLOCK_K,
                                EVEN_K, WFMT, PTX, DOT_PREC, G_ON_A, A_Q)
            last = True
            if SPLIT > 1:
                tile = p * tiles + pid_n
                c = tl.arange(0, W_ROWS)
                tl.store(part_ptr + (s * P * tiles + tile).to(tl.int64) * W_ROWS + c, h)
                last = _arrive(cnt_ptr + tile, SPLIT)
                if last:
                    h = tl.zeros([W_ROWS], dtype=tl.float32)
                    for ss in range(SPLIT):
                        h += tl.load(part_ptr + (ss * P * tiles + tile).to(tl.int64) * W_ROWS + c, cache_modifier=".cg")
            if last:
                result = gemm1_epilogue(h[None, :], g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be,
                                        stride_bn, alpha, limit, ACT, G_ON_A)
                result = tl.reshape(result, (BLOCK_N,))
                if LORA:
                    delta, active = lora_rows_delta(u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn,
                                                    stride_lbr, lm_ptr, stride_lm, L, R, p, t, expert, wr, BLOCK_R)
                    result = tl.where(active, result + g * delta, result)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                if Q_OUT:
                    # Columns past N_OUT (wrapped weight rows) stay out of the groups' amax.
                    result, q_s = quantize_fp8_groups(tl.where(offs_n < N_OUT, result, 0.0), PTX,
                                                      ws_ptr.dtype.element_ty == tl.uint8)
                    offs_g = n0 // 128 + tl.arange(0, BLOCK_N // 128)
                    tl.store(os_ptr + p.to(tl.int64) * stride_osm + offs_g, q_s, mask=offs_g < tl.cdiv(N_OUT, 128))
                tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n * stride_on, result.to(out_ptr.dtype.element_ty),
                         mask=offs_n < N_OUT)


@triton.jit(do_not_specialize=["E_global", "E", "P", "topk", "nslot", "has_map", "has_bias", "apply_weight",
                               *_RUNTIME_STRIDES, "stride_im", "stride_ik"])
def gemv2_dot_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, gw_ptr, ids_ptr, map_ptr, E_global, E,
    P, topk, nslot, N_OUT, K, k_per_split, has_map, has_bias, apply_weight,
    stride_at, stride_aj, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_ot, stride_oj, stride_on, stride_im, stride_ik, stride_gm, stride_gk, stride_asp,
    u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr, lm_ptr, stride_lm, L, R,
    SUM_SLOTS: tl.constexpr, SLOTS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr,
    LORA: tl.constexpr, BLOCK_R: tl.constexpr, A_Q: tl.constexpr, PDL: tl.constexpr, WORK_LIST: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
):
    """out of gemm2 (module docstring): nslot = topk (SUM_SLOTS) or 1, SLOTS >= nslot a power of two; ``part``
    [SPLIT, P, tiles, BLOCK_N] fp32 and ``cnt`` [M or P, tiles] when nslot * SPLIT > 1. LORA (per pair only):
    plus ``g B[l, e] u[p]`` on the active pairs, as in ``gemv1_dot_kernel``. A_Q (fp8 block): ``a`` holds e4m3
    values, ``as_ptr`` their scales per pair and 128 columns (pair stride ``stride_asp``)."""
    tl.static_assert(not LORA or not SUM_SLOTS, "the LoRA expand is fused per pair only")
    tl.static_assert(SUM_SLOTS or not ZERO_ROWS, "zero rows are the slot sum's")
    tiles = tl.cdiv(N_OUT, BLOCK_N)
    per_pair = tiles * SPLIT
    c = tl.arange(0, BLOCK_N)
    jj = tl.arange(0, SLOTS)
    start, end, step, pp0, act0, cum0 = _items(P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map,
                                               per_pair, ZERO_ROWS, WORK_LIST)
    if WORK_LIST:
        grid_dependency(PDL)
    for item in range(start, end, step):
        pid_n, p, s = _item(item, per_pair, pp0, act0, cum0, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global,
                            E, has_map, SPLIT, ZERO_ROWS, WORK_LIST)
        t = p // topk
        j = p - t * topk
        expert, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
        if SUM_SLOTS:
            first, slot0, group = t * topk, 0, t
        else:
            first, slot0, group = p, j, p
        e_vec, ok_vec = local_expert(ids_ptr, first + jj, tl.where(jj < nslot, P, 0), stride_im, stride_ik, map_ptr,
                                     E_global, E, topk, has_map)
        if SUM_SLOTS:
            # Only the token's valid slots take part (an expert-parallel shard's token has few); a token without
            # any gets its zeros from its slot 0 at split 0 (ZERO_ROWS; else gemv1 stored them).
            valid_slots = tl.sum(ok_vec.to(tl.int32), axis=0)
            run = valid | (ZERO_ROWS & (valid_slots == 0) & (j == 0) & (s == 0))
            arrivals = valid_slots * SPLIT
        else:
            run = valid
            arrivals = SPLIT
        if run:
            n0 = pid_n * BLOCK_N
            wr = wrap(n0 + c, N_OUT, BLOCK_N)
            h = tl.zeros([BLOCK_N], dtype=tl.float32)
            if not WORK_LIST:
                grid_dependency(PDL)
            if valid:
                k0 = s * k_per_split
                h = _rows_times_row(a_ptr + t.to(tl.int64) * stride_at + j * stride_aj,
                                    as_ptr + p.to(tl.int64) * stride_asp, w_ptr, ws_ptr, expert.to(tl.int64), wr, 1.0,
                                    k0, tl.minimum(K, k0 + k_per_split), stride_ak, stride_we, stride_wn, stride_wk,
                                    stride_se, stride_sn, stride_sk, BLOCK_N, BLOCK_K, EVEN_K, WFMT, PTX, DOT_PREC,
                                    False, A_Q)
                if arrivals > 1:
                    tl.store(part_ptr + (s * P * tiles + p * tiles + pid_n).to(tl.int64) * BLOCK_N + c, h)
            last = arrivals <= 1
            if arrivals > 1:
                last = _arrive(cnt_ptr + group * tiles + pid_n, arrivals)
            if last:
                if arrivals > 1:
                    acc = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
                    for ss in range(SPLIT):
                        acc += tl.load(part_ptr + (ss * P * tiles + (first + jj) * tiles + pid_n).to(tl.int64)[:, None]
                                       * BLOCK_N + c[None, :], mask=ok_vec[:, None], other=0.0, cache_modifier=".cg")
                else:
                    acc = tl.where(ok_vec[:, None], tl.broadcast_to(h[None, :], (SLOTS, BLOCK_N)), 0.0)
                e64 = tl.where(ok_vec, e_vec, 0).to(tl.int64)
                b_ok = ok_vec[:, None] & (wr[None, :] < tl.where(has_bias != 0, N_OUT, 0))
                acc += tl.load(bias_ptr + e64[:, None] * stride_be + wr[None, :] * stride_bn, mask=b_ok,
                               other=0.0).to(tl.float32)
                g_vec = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + (slot0 + jj) * stride_gk,
                                mask=ok_vec & (jj < tl.where(apply_weight != 0, nslot, 0)), other=1.0).to(tl.float32)
                out = tl.sum(acc * tl.where(ok_vec, g_vec, 0.0)[:, None], axis=0)
                if LORA:
                    delta, active = lora_rows_delta(u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn,
                                                    stride_lbr, lm_ptr, stride_lm, L, R, p, t, expert, wr, BLOCK_R)
                    out = tl.where(active, out + tl.sum(g_vec, axis=0) * delta, out)
                offs_n = n0 + c
                tl.store(out_ptr + t.to(tl.int64) * stride_ot + slot0 * stride_oj + offs_n * stride_on,
                         out.to(out_ptr.dtype.element_ty), mask=offs_n < N_OUT)
