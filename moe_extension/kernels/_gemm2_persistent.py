"""Persistent second GEMM of the fused path (sm_90+, 16-bit activations): one program per SM walks the
[BLOCK_M, BLOCK_N] output tiles of the used expert blocks in a flattened loop.

    y[row, n] = (sum_k a[row, k] W2[e, n, k] + b2[e, n]) * g[t, j]    for the valid rows of expert e

Shapes: ``a [rows, N]`` (gemm1's expert-sorted output, each expert's rows padded to a multiple of BLOCK_M),
``w2 [E, K_OUT, N]`` (logical [E, out, in]), ``y [rows, K_OUT]`` in the activations' dtype, in the same
sorted order (the slot sum reads it through ``inverse``); pair ``p = sorted[row]``, ``t = p // topk``,
``j = p % topk``; fp32 accumulation. The same dot order as ``gemm2_sorted_kernel`` (bitwise-equal results).

The rows of ``a`` and ``y`` go through *ragged* TMA descriptors (``ragged_rows_desc``) bounded to the tile's
expert, rows [start_e, start_e + count_e): its padding rows are neither read (they load as 0) nor written.
Tail tiles (``tail_m``) and split reductions do not apply here.

NOTE: H100, qwen3-30b-a3b M = 4096 (bf16, 128 x 256 x 64 tiles, 8 warps, 3 stages), the table entry with this
kernel against the same entry with the non-persistent gemm2, 5 interleaved rounds of CUDA-graph replay: 801.0
against 802.1 us for the whole op, level within the spread (benchmarks/results/ab_gemm2_persistent_h100.txt,
from ``python benchmarks/ab_fused_experts.py --model qwen3-30b-a3b --tokens 4096 --variant '{"gemm2":
{"persistent": false, "tail_m": 64, "num_stages": 4}}'``); the benchmark runs with it won the cell against
triton_kernels (benchmarks/results/fused_experts_h100.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_extension.kernels._grouped_gemm import _RUNTIME_STRIDES, _tile
from moe_extension.kernels._launch import grid_dependency

# Rows of the ragged dim (2^30): the TMA bound that masks the rows past an expert's count (the device helpers
# spell it out as a local constexpr: the interpreter mishandles constexpr globals in tensor arithmetic).
RAGGED_ROWS = 1 << 30
_OUTER = 0x7FFF0000  # bound of the two leading coordinates (any value above 2^31 - 2^30 - 1 works)


def ragged_rows_desc(t: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """TMA descriptor of a row-major ``t [rows, C]`` through which ``_load_rows`` / ``_store_rows`` reach
    only the rows [start, start + count) of one segment: rows past the count load as 0 and are not stored.

    Row ``start + r`` sits at the 4-D coordinates (2^30, start + count, 2^30 - count + r, c) with strides
    (2^34 - s, s, s, 1) (s = row stride, in elements): modulo 2^64 the offset is (start + r) s, since
    2^30 (2^34 - s) = 2^64 - 2^30 s. TMA bounds each coordinate by its dim, and dim 2 holds 2^30 rows, so
    r >= count falls outside. Needs rows < 2^30 and 16-byte aligned rows (``_launch.tma_layout_ok``)."""
    s = t.stride(0)
    return TensorDescriptor(t, [_OUTER, _OUTER, RAGGED_ROWS, t.shape[1]], [(1 << 34) - s, s, s, 1],
                            [1, 1, block_rows, block_cols])


@triton.jit
def _load_rows(desc, start, count, r, c, BR: tl.constexpr, BC: tl.constexpr):
    """[BR, BC] block at local row r, column c of the segment [start, start + count) (see ragged_rows_desc)."""
    ROWS: tl.constexpr = 1 << 30
    return desc.load([ROWS, start + count, ROWS - count + r, c]).reshape(BR, BC)


@triton.jit
def _store_rows(desc, start, count, r, c, tile, BR: tl.constexpr, BC: tl.constexpr):
    """Store the [BR, BC] tile at local row r, column c of the segment; rows past its count are dropped."""
    ROWS: tl.constexpr = 1 << 30
    desc.store([ROWS, start + count, ROWS - count + r, c], tile.reshape(1, 1, BR, BC))


@triton.jit(do_not_specialize=["last_expert", "P", "topk", "apply_weight", *_RUNTIME_STRIDES])
def gemm2_persistent_kernel(
    a_desc, w_desc, y_desc, bias_ptr, gw_ptr, sorted_ptr, block_expert_ptr, counts_ptr, starts_ptr,
    last_expert, P, topk, N_OUT, K, apply_weight, stride_be, stride_bn, stride_gm, stride_gk,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, PDL: tl.constexpr,
):
    """y rows of the used blocks (N_OUT output columns, K the reduction dim); a_desc and y_desc are
    ``ragged_rows_desc`` descriptors (blocks [BLOCK_M, BLOCK_K] and [BLOCK_M, BLOCK_N]), w_desc a TMA
    descriptor of w [E, N_OUT, K] (block [1, BLOCK_N, BLOCK_K]). The used blocks end where the last local
    expert's (``last_expert``) padded rows end; the tile order is ``_tile``'s. apply_weight: runtime flag.
    HAS_BIAS: b2 [E, N_OUT] at bias_ptr (a compile-time flag here: no masked load on the way out).
    PDL: waits for the previous kernel (gemm1) at the start."""
    grid_dependency(PDL)
    used = (tl.load(starts_ptr + last_expert)
            + tl.cdiv(tl.load(counts_ptr + last_expert), BLOCK_M) * BLOCK_M) // BLOCK_M
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    w_lim = tl.where(apply_weight != 0, P, 0)
    for tile in tl.range(tl.program_id(0), used * tiles_n, NUM_SMS, flatten=True):
        expert, pid_m, pid_n = _tile(tile, used, tiles_n, block_expert_ptr, counts_ptr, starts_ptr, BLOCK_M,
                                     GROUP_M)
        row0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        start = tl.load(starts_ptr + expert)
        count = tl.load(counts_ptr + expert)
        # The router weights are loaded before the main loop, which hides their two dependent loads.
        pair = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
        t = pair // topk
        g = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + (pair - t * topk) * stride_gk, mask=pair < w_lim,
                    other=1.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            a = _load_rows(a_desc, start, count, row0 - start, kk * BLOCK_K, BLOCK_M, BLOCK_K)
            w = w_desc.load([expert, n0, kk * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            wr = n0 + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + wr * stride_bn, mask=wr < N_OUT,
                           other=0.0).to(tl.float32)[None, :]
        acc = acc * g.to(tl.float32)[:, None]
        _store_rows(y_desc, start, count, row0 - start, n0, acc.to(y_desc.dtype), BLOCK_M, BLOCK_N)
