"""Triton kernels of the routed expert GEMMs (fp32 accumulation, one rounding per stored value).

Pairs ``p = t * topk + j`` of token ``t`` and slot ``j``; ``e`` = local expert of the slot (see
``_routing.local_expert``). Weights come in logical ``[E, out, in]`` layout with any strides, in the format
selected by the ``WFMT`` constexpr (``_weight_formats``: dense 16/32-bit, or MXFP4 codes with their scales at
``ws_ptr``); every kernel addresses, loads and multiplies its weight tiles through that module's plug, so the
tile loops, epilogues and schedules below are the same for every format. TMA weight tiles and the persistent
gemm2 take dense 16-bit weights only.

Grouped (expert-sorted) kernels, walking the blocks of ``_routing.route``:
- ``gather_rows_kernel`` (optional): copies the rows ``x[t]`` into sorted order for gemm1's TMA loads.
- ``gemm1_sorted_kernel``: rows ``x[t]`` gathered by token (or the copied sorted rows), times ``W1[e]^T``
  ([E, 2N, K]); epilogue: router weight (apply_router_weight_on_input: ``W(g x) = g (W x)``, applied
  before the bias), bias, then one of the five activations (output ``a`` [rows, N]) or none (output ``h``
  [rows, 2N]). Output rows are either the sorted positions (the fused path's workspace) or the pairs
  (``[M, topk, 2N]``).
- ``gemm2_sorted_kernel``: rows of ``a`` (sorted positions or pairs) times ``W2[e]^T`` ([E, K, N]), bias,
  router weight; writes per-slot rows ``y[split, t, j, :]`` (optionally split over the reduction dim).
- ``sum_slots_kernel``: ``out[t] = sum_{split, j valid} y[split, t, j]`` in a fixed order (deterministic).
The fused path's gemm2 can also run persistent (``_gemm2_persistent``), writing sorted rows that the slot
sum reads through ``inverse``.
gemm1 can count its finished tiles per expert and gemm2 start an expert's tiles once that count is
complete (the fused path under programmatic dependent launch; see ``fused_experts``).
Both GEMMs compute one output tile in ``_gemm1_block`` / ``_gemm2_block``; with ``TAIL_M`` set, a block
whose valid rows (they come first, padding last) number at most TAIL_M runs a TAIL_M-row tile: an expert's
last, partial block costs a fraction of a full one, in the same launch as the expert's full blocks (whose
weight tiles it then reads from L2).

Direct (per-pair GEMV) kernels for tiny batches, no routing needed:
- ``gemv1_kernel``: one program per (pair, tile of outputs), same epilogue as gemm1.
- ``gemv2_kernel``: one program per (token, tile of K) that loops over the token's slots and sums them in
  a fixed order (the reduction over topk fused, deterministic); or one program per (pair, tile).

Activation codes: 0 none, 1 silu, 2 gelu (erf), 3 gelu_tanh, 4 swigluoai (interleaved gate/up rows),
5 swiglustep. gemm1 multiplies one weight tile of ``2 * BLOCK_N`` rows per step for the gated activations:
the halves activations stack the gate rows ``n0 ...`` on the up rows ``N + n0 ...`` and split the two
column halves in registers; swigluoai reads the consecutive rows ``2 n0 ...`` and splits even (gate) / odd
(up) columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_extension.kernels._launch import grid_dependency
from moe_extension.kernels._lora import lora_rows_delta
from moe_extension.kernels._routing import local_expert
from moe_extension.kernels._weight_formats import (acc_finish, dot_step, dot_tile, fma_step, fp8_operand,
                                                   fp8_part_scales, quantize_fp8_groups, scale_rows, tile_ptrs,
                                                   weight_advance, weight_ptrs)

ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_SWIGLUOAI, ACT_SWIGLUSTEP = range(6)
# Strides of the bias and router-weight tensors feed only the epilogue: left unspecialized (one compiled
# kernel whether the tensor is given, absent (stride 0) or strided).
_RUNTIME_STRIDES = ["stride_be", "stride_bn", "stride_gm", "stride_gk"]
ACTIVATION_CODES = {
    "silu": ACT_SILU,
    "gelu": ACT_GELU,
    "gelu_tanh": ACT_GELU_TANH,
    "swigluoai": ACT_SWIGLUOAI,
    "swiglustep": ACT_SWIGLUSTEP,
}


@triton.jit
def _sigmoid(x):
    # exp(-x) overflows to inf for very negative x, giving exactly 0 (never NaN).
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): +-1 at the extremes without inf / inf.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _clamp(x, limit):
    """clamp(x, -limit, limit) that keeps NaN (like torch.clamp; the default min / max return the number)."""
    return tl.minimum(tl.maximum(x, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def activate(gate, up, alpha, limit, ACT: tl.constexpr):
    """fp32 gated activation of matching gate/up tiles."""
    if ACT == 1:
        out = gate * _sigmoid(gate) * up
    elif ACT == 2:
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACT == 3:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + _tanh(inner)) * up
    elif ACT == 4:
        g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        u = _clamp(up, limit)
        out = g * _sigmoid(alpha * g) * (u + 1.0)
    else:
        s = tl.minimum(gate * _sigmoid(gate), limit, propagate_nan=tl.PropagateNan.ALL)
        out = s * _clamp(up, limit)
    return out


@triton.jit
def wrap(x, n, SPAN: tl.constexpr, NO_LOOP: tl.constexpr = False):
    """``x % n`` of an int32 tile ``x`` within [0, n + SPAN) (a tile's row indices from a start below ``n``, SPAN
    their count), by ``cdiv(SPAN, n)`` conditional subtractions: one where the tile is no wider than the range.
    NO_LOOP: one conditional subtraction, and for a narrower range (n < SPAN) a remainder in a branch taken only then.
    NOTE: a remainder by a runtime value is a ~25-instruction sequence per element, and Triton computes a tile's row
    vector in each layout that uses it (16 elements per thread where the MMA layout's bands take their minimum): with
    ``%``, 1447 SASS instructions ran before gemv1's k loop (387 per step) at gpt-oss-120b M = 1, with this 751
    (``python benchmarks/compile_report.py --model gpt-oss-120b --quant mxfp4_mma --tokens 1 --dump DIR``). Timed, the
    MXFP4 calls did not change beyond the spread (H200, M 1-4096: benchmarks/results/ab_tile_rows_h200.txt; bf16 was
    not timed then, and its persistent gemm1 had lost 4-8%: the NOTE below); the code is the smaller and leaves gemv2
    119 registers instead of 148. NO_LOOP's branch costs the GEMVs registers (at
    gpt-oss-120b M = 1 gemv1 133 against 127, gemv2 148 against 126: 3 programs per SM against 4), so they keep the
    loop.
    NOTE: NO_LOOP in the persistent gemm1: the loop is a second inner loop in its tile loop beside the k loop, and
    Triton fuses a ``tl.range(flatten=True)`` nest only when it holds one inner loop (FuseNestedLoops'
    ``shouldFuse``): with the loop, each tile refilled its pipeline, 4-8% of the first GEMM's time
    (benchmarks/results/ab_gemm1_fused_loop_h200.txt)."""
    if NO_LOOP:
        x = tl.where(x >= n, x - n, x)
        if n < SPAN:
            x = x % n
    else:
        for _ in range(0, tl.cdiv(SPAN, n)):
            x = tl.where(x >= n, x - n, x)
    return x


@triton.jit
def gemm1_weight_rows(n0, N_OUT, N_HALF, ACT: tl.constexpr, BLOCK_N: tl.constexpr, NO_LOOP: tl.constexpr = False):
    """The weight rows of gemm1's output tile at columns n0..: without an activation the BLOCK_N output rows;
    swigluoai the 2 * BLOCK_N interleaved rows from 2 n0; the halves activations BLOCK_N gate rows from n0 stacked
    on the BLOCK_N up rows from N + n0. Rows wrap modulo their range (loads in bounds; the columns they feed are not
    stored). NO_LOOP: ``wrap`` without its loop."""
    if ACT == 0:
        wr = wrap(n0 + tl.arange(0, BLOCK_N), N_OUT, BLOCK_N, NO_LOOP)
    elif ACT == 4:
        wr = wrap(2 * n0 + tl.arange(0, 2 * BLOCK_N), 2 * N_HALF, 2 * BLOCK_N, NO_LOOP)
    else:
        c = tl.arange(0, 2 * BLOCK_N)
        wr = (c // BLOCK_N) * N_HALF + wrap(n0 + c % BLOCK_N, N_HALF, BLOCK_N, NO_LOOP)
    return wr


@triton.jit
def _weighted_biased(acc, g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be, stride_bn,
                     G_ON_A: tl.constexpr):
    """``acc`` [BM, R] (sums of the weight rows ``wr``) times the router weights ``g`` [BM] unless G_ON_A
    (W (g x) + b = g (W x) + b), plus the bias of those rows."""
    if not G_ON_A:
        acc = acc * g[:, None]
    b_lim = tl.where(has_bias != 0, 2 * N_HALF + N_OUT, 0)  # above every row index when on, 0 when off
    return acc + tl.load(bias_ptr + expert.to(tl.int64) * stride_be + wr * stride_bn, mask=wr < b_lim,
                         other=0.0).to(tl.float32)[None, :]


@triton.jit
def _concat_columns(a, b):
    """[BM, C] and [BM, C] -> [BM, 2 C]: the columns of ``a`` then those of ``b``."""
    BM: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BM, 2 * C))


@triton.jit
def _activate_rows(acc, alpha, limit, ACT: tl.constexpr):
    """The activation of a tile of summed weight rows [BM, R] as ``gemm1_weight_rows`` orders them -> [BM, R / 2]
    (none: [BM, R] unchanged): swigluoai splits even (gate) / odd (up) columns, the halves activations the
    first (gate) / second (up) halves."""
    BM: tl.constexpr = acc.shape[0]
    R: tl.constexpr = acc.shape[1]
    if ACT == 0:
        result = acc
    elif ACT == 4:
        gate, up = tl.split(tl.reshape(acc, (BM, R // 2, 2)))
        result = activate(gate, up, alpha, limit, ACT)
    else:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, R // 2)), (0, 2, 1)))
        result = activate(gate, up, alpha, limit, ACT)
    return result


@triton.jit
def gemm1_epilogue(acc, g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be, stride_bn, alpha, limit,
                   ACT: tl.constexpr, G_ON_A: tl.constexpr):
    """gemm1's output tile [BM, BLOCK_N] (fp32) from the sums ``acc`` [BM, W_ROWS] of its weight rows ``wr``
    (``gemm1_weight_rows``): times the router weights, plus the bias (``_weighted_biased``), then the
    activation."""
    acc = _weighted_biased(acc, g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be, stride_bn, G_ON_A)
    return _activate_rows(acc, alpha, limit, ACT)


@triton.jit
def gemm1_epilogue_parts(acc, acc_b, g, bias_ptr, expert, wr, wr_b, has_bias, N_OUT, N_HALF, stride_be, stride_bn,
                         alpha, limit, ACT: tl.constexpr, G_ON_A: tl.constexpr):
    """``gemm1_epilogue`` of a tile summed in two parts, ``acc`` of the weight rows ``wr`` and ``acc_b`` of
    ``wr_b`` (each [BM, W_ROWS / 2]), the two halves of the rows in ``gemm1_weight_rows`` order: for the halves
    activations the gate rows and the up rows, for swigluoai and none those of the first and of the second
    half of the output columns."""
    acc = _weighted_biased(acc, g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be, stride_bn, G_ON_A)
    acc_b = _weighted_biased(acc_b, g, bias_ptr, expert, wr_b, has_bias, N_OUT, N_HALF, stride_be, stride_bn, G_ON_A)
    if ACT == 0 or ACT == 4:
        result = _concat_columns(_activate_rows(acc, alpha, limit, ACT), _activate_rows(acc_b, alpha, limit, ACT))
    else:
        result = activate(acc, acc_b, alpha, limit, ACT)
    return result


@triton.jit
def _tile(pid, num_blocks_m, num_tiles_n, block_expert_ptr, counts_ptr, starts_ptr, BLOCK_M: tl.constexpr,
          GROUP_M: tl.constexpr, SUB: tl.constexpr = 1):
    """(expert, row block, N tile) of program ``pid``; expert -1 for programs past the used blocks.
    SUB > 1 (GROUP_M > 0 only): ``num_blocks_m`` counts row tiles of BLOCK_M / SUB rows, SUB per block of
    BLOCK_M rows, and the returned row block is such a tile.

    GROUP_M > 0, super-grouped order: GROUP_M row blocks walk the N tiles together, row block fastest, so a
    weight tile is reused from L2 by the GROUP_M blocks and an A block by the N tiles.
    GROUP_M = 0, expert-major order: all row blocks of one expert walk its N tiles together (the group is
    the expert: each weight tile is read from DRAM once), experts in turn. Expert e owns the programs
    [s_e, s_e + n_e) * num_tiles_n, s_e = its first block, n_e = its block count.
    """
    if GROUP_M == 0:
        expert = tl.load(block_expert_ptr + pid // num_tiles_n)
        e = tl.maximum(expert, 0)
        first = tl.load(starts_ptr + e) // BLOCK_M
        blocks = tl.maximum(tl.cdiv(tl.load(counts_ptr + e), BLOCK_M), 1)
        local = pid - first * num_tiles_n
        return expert, first + local % blocks, local // blocks
    tl.static_assert(SUB == 1 or GROUP_M > 0, "row tiles smaller than a block need the super-grouped order")
    per_group = GROUP_M * num_tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return tl.load(block_expert_ptr + pid_m // SUB), pid_m, pid_n


@triton.jit
def _rows_from(counts_ptr, starts_ptr, expert, row0):
    """Valid (non-padding) rows of ``expert``'s sorted rows from row0 on (its block or row tile and the rest of its
    blocks): an expert's valid pairs come first in its blocks, ``expert_counts`` of them from ``expert_starts``.
    NOTE: two scalar loads, not a sum over the block's sorted entries: with that sum (a block-wide reduction) before
    them, ptxas serialized the wgmma of gemm1's two tiles at blocks of 64 on 4 warps (C7515; compile_report.py under
    Triton 3.6, MXFP4 in the MMA layout, Qwen3-30B-A3B M = 1024: "SERIALIZED", 164 registers; with these loads
    pipelined, 213 registers)."""
    return tl.load(counts_ptr + expert) - (row0 - tl.load(starts_ptr + expert))


@triton.jit
def _gemm1_tma_tile(w_desc, expert, n0, k, ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                    PART: tl.constexpr):
    """gemm1's weight tile [ROWS, BLOCK_K] at columns k.. for the output columns n0.. by TMA (``_weight_desc``):
    the rows of ``gemm1_weight_rows``, or with PART 1 the second ROWS of them (fp8 block's second part). Without
    an activation and with the interleaved one (4) consecutive rows of [E, rows, K]; with the halves activations
    the gate and up halves of the [E, 2, N, K] view (one part: a box of both, PART 1: the up half)."""
    if ACT == 0:
        w = w_desc.load([expert, n0 + PART * ROWS, k])
    elif ACT == 4:
        w = w_desc.load([expert, 2 * n0 + PART * ROWS, k])
    else:
        w = w_desc.load([expert, PART, n0, k])
    return w.reshape(ROWS, BLOCK_K)


@triton.jit
def _gemm1_block(x_ptr, xs_ptr, a_desc, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, os_ptr, gw_ptr, sorted_ptr,
                 expert, row0, n0, P, topk, N_OUT, N_HALF, K, has_bias, router_on_input,
                 stride_xm, stride_xk, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                 stride_be, stride_bn,
                 stride_om, stride_on, stride_osm, stride_gm, stride_gk, alpha, limit,
                 ACT: tl.constexpr, OUT_SORTED: tl.constexpr, ZERO_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT_PREC: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 W_DESC: tl.constexpr, A_DESC: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr,
                 G_ON_A: tl.constexpr, Q_OUT: tl.constexpr, A_Q: tl.constexpr, ROW_SCALES: tl.constexpr,
                 NO_LOOP: tl.constexpr = False):
    """The [BM, BLOCK_N] output tile of gemm1 at sorted rows row0.. and columns n0.. (expert ``expert``).
    NO_LOOP: the weight rows wrap without a loop (``gemm1_weight_rows``).
    G_ON_A: the router weights (apply_router_weight_on_input) scale the A rows, for weight formats whose GEMM
    rounds or quantizes its input (MXFP4: bf16(g x), fp8 block: fp8(g x)); otherwise they scale the product
    (W (g x) = g (W x)). Q_OUT (OUT_SORTED; BLOCK_N a multiple of 128): the tile is stored quantized for the
    fp8 gemm2, e4m3 values in ``out`` and their per-row, per-128-column scales in ``os_ptr`` (row stride
    ``stride_osm``), as ``quantize_fp8_groups`` computes them from the fp32 result. A_Q (fp8 block, not
    G_ON_A): ``x`` holds the tokens quantized already (e4m3) and ``xs_ptr`` their scales per token (stride
    ``stride_xsm``) and 128-column group; with A_DESC the rows of ``a_desc`` and the scales are per sorted row
    (``gather_rows_kernel`` with Q)."""
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < P
    # Padding rows read as 0 (masked loads) and, in sorted order with ZERO_PAD, are stored as 0 (see the NOTE
    # at the end).
    token = tl.where(row_ok, pair // topk, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # One weight tile of W_ROWS rows (``gemm1_weight_rows``) per step, one dot. Pointer loads wrap rows modulo
    # their range (in bounds, no mask), TMA loads read rows past the end as 0; the columns they feed are not stored.
    # NOTE: the halves activations' one [BM, 2 BLOCK_N] dot (it was a gate and an up dot of [BM, BLOCK_N],
    # each reading the A tile) took gemm1 (silu, H100, eager) 448.5 -> 436.3 us at qwen3 M = 4096,
    # 2838 -> 2770 us at mixtral M = 4096 and 861 -> 838 us at mixtral M = 1024
    # (benchmarks/results/ab_silu_stacked_h100.txt); the outputs stayed bitwise equal.
    W_ROWS: tl.constexpr = BLOCK_N if ACT == 0 else 2 * BLOCK_N
    # fp8 block: the weight rows in parts of 128, each with its own accumulator and one scale per step (see
    # fp8_part_scales; ROW_SCALES: the up part of the halves activations starts inside a scale block when N is
    # not a multiple of 128, and takes a scale per row).
    PARTS: tl.constexpr = W_ROWS // 128 if WFMT == 2 else 1
    tl.static_assert(WFMT != 2 or (W_ROWS == 128 * PARTS and PARTS <= 2 and (PARTS == 2 or ACT == 0)),
                     "fp8 block gemm1 tiles: 128 output columns with an activation, 128 or 256 without")
    wr = gemm1_weight_rows(n0, N_OUT, N_HALF, ACT, BLOCK_N, NO_LOOP)
    e64 = expert.to(tl.int64)
    if PARTS == 2:
        wr, wr_b = tl.split(tl.permute(tl.reshape(wr, (2, W_ROWS // 2)), (1, 0)))
    else:
        wr_b = wr
    w_ptrs, s_ptrs = tile_ptrs(w_ptr, ws_ptr, e64, wr, 0, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                               stride_sk, BLOCK_K, WFMT, True)
    if PARTS == 2:
        w_ptrs_b, s_ptrs_b = tile_ptrs(w_ptr, ws_ptr, e64, wr_b, 0, stride_we, stride_wn, stride_wk, stride_se,
                                       stride_sn, stride_sk, BLOCK_K, WFMT, True)
    else:
        w_ptrs_b, s_ptrs_b = w_ptrs, s_ptrs
    if WFMT == 2:
        # The parts' first rows: multiples of 128 (ACT 0 / 4: n0 and 2 n0 are; wrapped parts feed no stored column).
        if ACT == 0:
            row_b = (n0 + W_ROWS // 2) % N_OUT
        elif ACT == 4:
            row_b = (2 * n0 + W_ROWS // 2) % (2 * N_HALF)
        else:
            row_b = N_HALF + n0
        s_ptrs = fp8_part_scales(ws_ptr, e64, 2 * n0 if ACT == 4 else n0, stride_se, stride_sn)
        if not ROW_SCALES:
            s_ptrs_b = fp8_part_scales(ws_ptr, e64, row_b, stride_se, stride_sn)
    # apply_router_weight_on_input: g of each row (1 when off).
    g = tl.load(gw_ptr + token.to(tl.int64) * stride_gm + (pair - token * topk) * stride_gk,
                mask=pair < tl.where(router_on_input != 0, P, 0), other=1.0).to(tl.float32)
    if A_Q:
        # Scales per token, or per sorted row when the rows come in sorted order (A_DESC)
        xs_ptrs = xs_ptr + (rows if A_DESC else token).to(tl.int64) * stride_xsm
    acc = tl.zeros([BM, W_ROWS // PARTS], dtype=tl.float32)
    if PARTS == 2:
        acc_b = tl.zeros([BM, W_ROWS // PARTS], dtype=tl.float32)
    else:
        acc_b = acc  # unused
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if not EVEN_K:
            k_ok = offs_k < K - kk * BLOCK_K
        if A_Q:
            a_s = tl.load(xs_ptrs + kk, mask=row_ok, other=0.0)
        else:
            a_s = g  # unused
        if A_DESC:
            a = a_desc.load([row0, kk * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if G_ON_A:
            a = a.to(tl.float32) * g[:, None]
        if PARTS == 2:
            # One quantization of the step's activations for both parts.
            a, a_s = fp8_operand(a, a_s, s_ptrs, PTX, A_Q)
            if W_DESC:
                w = _gemm1_tma_tile(w_desc, expert, n0, kk * BLOCK_K, ACT, W_ROWS // 2, BLOCK_K, 0)
                w_b = _gemm1_tma_tile(w_desc, expert, n0, kk * BLOCK_K, ACT, W_ROWS // 2, BLOCK_K, 1)
                acc = dot_tile(acc, a, a_s, w.T, s_ptrs, WFMT, PTX, DOT_PREC, True)
                acc_b = dot_tile(acc_b, a, a_s, w_b.T, s_ptrs_b, WFMT, PTX, DOT_PREC, True)
            else:
                acc = dot_step(acc, a, a_s, w_ptrs, s_ptrs, K - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX, DOT_PREC,
                               True)
                acc_b = dot_step(acc_b, a, a_s, w_ptrs_b, s_ptrs_b, K - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX,
                                 DOT_PREC, True)
            w_ptrs_b, s_ptrs_b = weight_advance(w_ptrs_b, s_ptrs_b, stride_wk, stride_sk, BLOCK_K, WFMT)
        elif W_DESC:
            w = _gemm1_tma_tile(w_desc, expert, n0, kk * BLOCK_K, ACT, W_ROWS, BLOCK_K, 0)
            acc = dot_tile(acc, a, a_s, w.T, s_ptrs, WFMT, PTX, DOT_PREC, A_Q)
        else:
            acc = dot_step(acc, a, a_s, w_ptrs, s_ptrs, K - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX, DOT_PREC, A_Q)
        a_ptrs += BLOCK_K * stride_xk
        w_ptrs, s_ptrs = weight_advance(w_ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)
    acc = acc_finish(acc, WFMT)

    if PARTS == 2:
        result = gemm1_epilogue_parts(acc, acc_b, g, bias_ptr, expert, wr, wr_b, has_bias, N_OUT, N_HALF, stride_be,
                                      stride_bn, alpha, limit, ACT, G_ON_A)
    else:
        result = gemm1_epilogue(acc, g, bias_ptr, expert, wr, has_bias, N_OUT, N_HALF, stride_be, stride_bn, alpha,
                                limit, ACT, G_ON_A)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N_OUT)[None, :]
    if Q_OUT:
        # Columns past N_OUT (wrapped weight rows) stay out of the groups' amax; padding rows quantize to 0.
        result, q_s = quantize_fp8_groups(tl.where(row_ok[:, None] & n_ok, result, 0.0), PTX,
                                         ws_ptr.dtype.element_ty == tl.uint8)
        offs_g = n0 // 128 + tl.arange(0, BLOCK_N // 128)
        tl.store(os_ptr + rows.to(tl.int64)[:, None] * stride_osm + offs_g[None, :], q_s,
                 mask=(offs_g < tl.cdiv(N_OUT, 128))[None, :] & (row_ok[:, None] | ZERO_PAD))
    if OUT_SORTED:
        # NOTE: every row of a used block holds a value or 0 (padding rows here, the rows past a tail tile
        # in gemm1_sorted_kernel), so gemm2 multiplies zeros, not stale rows, in its padding rows: zero
        # operands cost the tensor cores less power, and the large batches run power-capped. H100, qwen3
        # M = 4096 under replay: 801.9 us against 817.6 with padding rows that read token 0's row and were not
        # stored; gemm1 eager 430.8 against 445.3 us (benchmarks/results/ab_zero_padding_h100.txt).
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        if ZERO_PAD:
            if not Q_OUT:
                result = tl.where(row_ok[:, None], result, 0.0)
            tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok)
    else:
        o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok)


@triton.jit(do_not_specialize=["P", "topk", "num_blocks_m", "has_bias", "router_on_input", *_RUNTIME_STRIDES])
def gemm1_sorted_kernel(
    x_ptr, xs_ptr, a_desc, a_tail_desc, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, os_ptr, gw_ptr, sorted_ptr,
    block_expert_ptr, counts_ptr, starts_ptr, done_ptr, P, topk, N_OUT, N_HALF, K, num_blocks_m, last_expert, has_bias,
    router_on_input, stride_xm, stride_xk, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_om, stride_on, stride_osm, stride_gm, stride_gk, alpha, limit,
    ACT: tl.constexpr, OUT_SORTED: tl.constexpr, ZERO_PAD: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, W_DESC: tl.constexpr, TAIL_M: tl.constexpr, A_DESC: tl.constexpr, PDL: tl.constexpr,
    SIGNAL: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr, G_ON_A: tl.constexpr, Q_OUT: tl.constexpr,
    A_Q: tl.constexpr, ROW_SCALES: tl.constexpr, PERSISTENT: tl.constexpr = False, NUM_SMS: tl.constexpr = 1,
):
    """out[row, n] for n < N_OUT (N_OUT = N with an activation, 2N without; N_HALF = N).

    TAIL_M (0: off): a block with at most TAIL_M valid rows (an expert's last, partial block) runs a TAIL_M-row
    tile instead, in the same launch and L2 group as its expert's full blocks. OUT_SORTED: the rows are
    sorted positions; with ZERO_PAD the padding rows of the used blocks (those of a tail block past its tile
    included) are stored as 0, without it they are not written (for a consumer that reads only valid rows).
    W_DESC: the weight tiles come through ``w_desc``, a TMA descriptor of w [E, 2N, K] (block
    [1, weight rows per tile, BLOCK_K]) or, for the halves activations, of its view [E, 2, N, K] (block
    [1, 2, BLOCK_N, BLOCK_K]: gate and up rows in one load); rows and columns past the end read as 0. fp8
    block loads its tiles in parts of 128 rows (``_gemm1_block``): block [1, 128, BLOCK_K] of w, or for the
    halves activations [1, 1, BLOCK_N, BLOCK_K] of the view. ROW_SCALES (fp8 block, halves activations, N not
    a multiple of 128): the up rows' scales are loaded per row.
    A_DESC (OUT_SORTED only): the A rows come in sorted order through ``a_desc`` (block [BLOCK_M, BLOCK_K])
    and, for tail tiles, ``a_tail_desc`` (block [TAIL_M, BLOCK_K]), TMA descriptors of the rows that
    ``gather_rows_kernel`` copied (columns past K read as 0), instead of gathered pointer loads of x.
    PDL: programmatic dependent launch (``_routing.grid_dependency``). SIGNAL: after its tile's stores, each
    program adds 1 to ``done[expert]`` (release, gpu scope): an expert's count reaches
    cdiv(count, BLOCK_M) * cdiv(N_OUT, BLOCK_N) when all its tiles are stored.
    PERSISTENT (TAIL_M 0, no SIGNAL): NUM_SMS programs walk the tiles of the used blocks (those up to the end of
    expert ``last_expert``'s padded rows) in one flattened loop (``tl.range(flatten=True)``: Triton pipelines it
    as one loop, so a program's next tile can load while its current one finishes; it fuses the nest only while the
    tile holds no loop but its k loop, hence ``wrap``'s NO_LOOP), in ``_tile``'s order, each tile as above.

    NOTE: topk, has_bias, router_on_input and the bias / router-weight strides are runtime values (not
    specialized) that only touch one division per row and the epilogue (masked loads, no branches): models
    and flag settings share one compiled kernel, so cold starts (bare GPU machine, tests, tuning) compile
    few variants.
    """
    grid_dependency(PDL)
    if PERSISTENT:
        tl.static_assert(TAIL_M == 0 and not SIGNAL, "the persistent gemm1 runs whole blocks and signals nothing")
        # The used blocks end where the last local expert's padded rows end (as in _gemm2_persistent).
        used = (tl.load(starts_ptr + last_expert)
                + tl.cdiv(tl.load(counts_ptr + last_expert), BLOCK_M) * BLOCK_M) // BLOCK_M
        tiles_n = tl.cdiv(N_OUT, BLOCK_N)
        for tile in tl.range(tl.program_id(0), used * tiles_n, NUM_SMS, flatten=True):
            expert, pid_m, pid_n = _tile(tile, used, tiles_n, block_expert_ptr, counts_ptr, starts_ptr, BLOCK_M,
                                         GROUP_M)
            _gemm1_block(x_ptr, xs_ptr, a_desc, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, os_ptr, gw_ptr, sorted_ptr,
                         expert, pid_m * BLOCK_M, pid_n * BLOCK_N, P, topk, N_OUT, N_HALF, K, has_bias,
                         router_on_input, stride_xm, stride_xk, stride_xsm, stride_we, stride_wn, stride_wk, stride_se,
                         stride_sn, stride_sk, stride_be, stride_bn, stride_om, stride_on, stride_osm, stride_gm,
                         stride_gk, alpha, limit, ACT, OUT_SORTED, ZERO_PAD, EVEN_K, DOT_PREC, BLOCK_M, BLOCK_N,
                         BLOCK_K, W_DESC, A_DESC, WFMT, PTX, G_ON_A, Q_OUT, A_Q, ROW_SCALES, True)
        return
    expert, pid_m, pid_n = _tile(tl.program_id(0), num_blocks_m, tl.cdiv(N_OUT, BLOCK_N), block_expert_ptr, counts_ptr,
                                 starts_ptr, BLOCK_M, GROUP_M)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    if TAIL_M > 0 and _rows_from(counts_ptr, starts_ptr, expert, row0) <= TAIL_M:
        _gemm1_block(x_ptr, xs_ptr, a_tail_desc, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, os_ptr, gw_ptr, sorted_ptr,
                     expert, row0, pid_n * BLOCK_N, P, topk, N_OUT, N_HALF, K, has_bias, router_on_input,
                     stride_xm, stride_xk, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                     stride_be, stride_bn, stride_om, stride_on, stride_osm, stride_gm, stride_gk, alpha, limit,
                     ACT, OUT_SORTED, ZERO_PAD, EVEN_K, DOT_PREC, TAIL_M, BLOCK_N, BLOCK_K, W_DESC, A_DESC, WFMT, PTX,
                     G_ON_A, Q_OUT, A_Q, ROW_SCALES)
        if OUT_SORTED and ZERO_PAD:  # the block's rows past the tail tile: 0
            r = tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + (row0 + r).to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
                     tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                     mask=(r >= TAIL_M)[:, None] & (offs_n < N_OUT)[None, :])
            if Q_OUT:
                offs_g = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
                tl.store(os_ptr + (row0 + r).to(tl.int64)[:, None] * stride_osm + offs_g[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N // 128], dtype=tl.float32),
                         mask=(r >= TAIL_M)[:, None] & (offs_g < tl.cdiv(N_OUT, 128))[None, :])
    else:
        _gemm1_block(x_ptr, xs_ptr, a_desc, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, os_ptr, gw_ptr, sorted_ptr,
                     expert, row0, pid_n * BLOCK_N, P, topk, N_OUT, N_HALF, K, has_bias, router_on_input,
                     stride_xm, stride_xk, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                     stride_be, stride_bn, stride_om, stride_on, stride_osm, stride_gm, stride_gk, alpha, limit,
                     ACT, OUT_SORTED, ZERO_PAD, EVEN_K, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, W_DESC, A_DESC, WFMT, PTX,
                     G_ON_A, Q_OUT, A_Q, ROW_SCALES)
    if SIGNAL:
        # Every thread's stores come before one gpu-scope release increment of the expert's counter.
        tl.debug_barrier()
        tl.atomic_add(done_ptr + expert, 1, sem="release", scope="gpu")


@triton.jit
def _gemm2_block(a_ptr, as_ptr, a_desc, w_ptr, w_desc, ws_ptr, bias_ptr, y_ptr, gw_ptr, sorted_ptr, expert, row0, n0,
                 split, P, topk, N_OUT, K, k_per_split, has_bias, apply_weight,
                 stride_am, stride_aj, stride_ak, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                 stride_sk, stride_be, stride_bn,
                 stride_ys, stride_yt, stride_yj, stride_yn, stride_gm, stride_gk,
                 A_SORTED: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
                 BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_DESC: tl.constexpr,
                 A_DESC: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr, A_Q: tl.constexpr):
    """The [BM, BLOCK_N] tile of gemm2's split ``split`` at sorted rows row0.. and columns n0..
    A_Q (fp8 block, A_SORTED): ``a`` holds e4m3 values and ``as_ptr`` their scales per row (stride
    ``stride_asm``) and 128-column group (gemm1's Q_OUT output)."""
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < P
    safe_pair = tl.where(row_ok, pair, 0)
    t = safe_pair // topk
    j = safe_pair - t * topk
    # NOTE: k_per_split stays specialized (a multiple of BLOCK_K, so always "divisible by 16"): the K
    # offsets must be provably aligned or the loads are not vectorized and not cp.async-pipelined.
    k_start = tl.multiple_of(split * k_per_split, BLOCK_K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    if A_SORTED:
        a_rows = rows.to(tl.int64) * stride_am
    else:
        a_rows = t.to(tl.int64) * stride_am + j * stride_aj
    a_ptrs = a_ptr + a_rows[:, None] + offs_k[None, :] * stride_ak
    wr = wrap(n0 + tl.arange(0, BLOCK_N), N_OUT, BLOCK_N)
    e64 = expert.to(tl.int64)
    w_ptrs, s_ptrs = tile_ptrs(w_ptr, ws_ptr, e64, wr, k_start, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                               stride_sk, BLOCK_K, WFMT, True)
    if WFMT == 2 and BLOCK_N == 128:  # one 128-row part: one weight scale per step
        s_ptrs = fp8_part_scales(ws_ptr, e64, n0, stride_se, stride_sn) + (k_start // 128) * stride_sk
    if A_Q:
        as_ptrs = as_ptr + rows.to(tl.int64) * stride_asm + k_start // 128
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(k_start + k_per_split, K)
    for kk in range(0, tl.cdiv(k_end - k_start, BLOCK_K)):
        if A_DESC:
            a = a_desc.load([row0, k_start + kk * BLOCK_K])
        elif EVEN_K:
            # NOTE: padding rows read as 0 (they read pair 0's row before): the unfused expert_gemm2 at
            # qwen3 M = 4096 took 332.5 -> 323.4 us under replay (eager kernel 282.4 -> 270.1), at M = 64
            # 146.8 -> 143.6 (H100, benchmarks/results/ab_gemm2_zero_padding_h100.txt).
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_end - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if A_Q:
            a_s = tl.load(as_ptrs + kk, mask=row_ok, other=0.0)
        else:
            a_s = row_ok  # unused
        if W_DESC:
            w = w_desc.load([expert, n0, k_start + kk * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            acc = dot_tile(acc, a, a_s, w, s_ptrs, WFMT, PTX, DOT_PREC, A_Q)
        else:
            acc = dot_step(acc, a, a_s, w_ptrs, s_ptrs, k_end - k_start - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX,
                           DOT_PREC, A_Q)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs, s_ptrs = weight_advance(w_ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)
    acc = acc_finish(acc, WFMT)

    b_lim = tl.where((has_bias != 0) & (split == 0), N_OUT, 0)
    acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + wr * stride_bn, mask=wr < b_lim,
                   other=0.0).to(tl.float32)[None, :]
    g = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + j * stride_gk,
                mask=pair < tl.where(apply_weight != 0, P, 0), other=1.0)
    acc = acc * g.to(tl.float32)[:, None]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    y_rows = split.to(tl.int64) * stride_ys + t.to(tl.int64) * stride_yt + j.to(tl.int64) * stride_yj
    y_ptrs = y_ptr + y_rows[:, None] + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N_OUT)[None, :])


@triton.jit(do_not_specialize=["P", "topk", "num_blocks_m", "has_bias", "apply_weight", "tiles_n1",
                               *_RUNTIME_STRIDES])
def gemm2_sorted_kernel(
    a_ptr, as_ptr, a_desc, a_tail_desc, w_ptr, w_desc, ws_ptr, bias_ptr, y_ptr, gw_ptr, sorted_ptr, block_expert_ptr,
    counts_ptr, starts_ptr, done_ptr, tiles_n1, P, topk, N_OUT, K, num_blocks_m, k_per_split, has_bias, apply_weight,
    stride_am, stride_aj, stride_ak, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn,
    stride_ys, stride_yt, stride_yj, stride_yn, stride_gm, stride_gk,
    A_SORTED: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_DESC: tl.constexpr, TAIL_M: tl.constexpr, A_DESC: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
    WFMT: tl.constexpr, PTX: tl.constexpr, A_Q: tl.constexpr, TILE_M: tl.constexpr = 0,
):
    """y[s, t, j, n] = (sum over this split's k of a[row, k] W2[e, n, k] (+ b2[e, n] in split 0)) * g.

    Rows of ``a``: the sorted position (A_SORTED, stride_am) or the pair (stride_am per token, stride_aj
    per slot). program_id(1) is the split of the reduction dim (k_per_split, a multiple of BLOCK_K, each).
    EVEN_K: every split's range is full BLOCK_K steps inside K. has_bias / apply_weight: runtime flags.
    TAIL_M: as in gemm1 (blocks with at most TAIL_M valid rows run a TAIL_M-row tile).
    TILE_M (0: BLOCK_M): rows per program, a divisor of BLOCK_M; each block of BLOCK_M rows runs as
    BLOCK_M / TILE_M programs (GROUP_M > 0; the grid's first dim counts them), a tile of padding rows only exits
    at once, and TAIL_M applies per tile.
    W_DESC: weight tiles through the TMA descriptor ``w_desc`` of w [E, N_OUT, K] (block [1, BLOCK_N,
    BLOCK_K]); a tile reaching past this split's range is multiplied by the masked (zero) columns of ``a``.
    A_DESC (A_SORTED only): the rows of ``a`` come through ``a_desc`` (block [BLOCK_M, BLOCK_K]) and, for
    tail tiles, ``a_tail_desc`` (block [TAIL_M, BLOCK_K]), TMA descriptors of a [rows, N]; columns past N
    read as 0, and a split's range is whole BLOCK_K steps, so no load crosses into the next split.
    PDL: programmatic dependent launch. WAIT (after a gemm1 with SIGNAL; tiles_n1 = its N tiles): instead of
    waiting for gemm1's grid at the start, a program waits until ``done[expert]`` reaches the expert's gemm1
    tile count (acquire, gpu scope), and, with PDL, for gemm1's grid at its end.
    """
    if WAIT:
        if PDL:
            gdc_launch_dependents()
    else:
        grid_dependency(PDL)
    ROWS: tl.constexpr = BLOCK_M if TILE_M == 0 else TILE_M
    expert, pid_m, pid_n = _tile(tl.program_id(0), num_blocks_m * (BLOCK_M // ROWS), tl.cdiv(N_OUT, BLOCK_N),
                                 block_expert_ptr, counts_ptr, starts_ptr, BLOCK_M, GROUP_M, BLOCK_M // ROWS)
    split = tl.program_id(1)
    if expert < 0:
        return
    row0 = pid_m * ROWS
    if ROWS < BLOCK_M:
        # Valid rows come first in a block: a tile that starts on a padding row has none.
        if tl.load(sorted_ptr + row0) >= P:
            return
    if WAIT:
        # The expert's rows of a are final once all its gemm1 tiles have counted: acquire, then order the
        # TMA (async proxy) reads after it.
        need = tl.cdiv(tl.load(counts_ptr + expert), BLOCK_M) * tiles_n1
        done = tl.atomic_add(done_ptr + expert, 0, sem="acquire", scope="gpu")
        while done < need:
            done = tl.atomic_add(done_ptr + expert, 0, sem="acquire", scope="gpu")
        if PDL:
            tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
    if TAIL_M > 0 and _rows_from(counts_ptr, starts_ptr, expert, row0) <= TAIL_M:
        _gemm2_block(a_ptr, as_ptr, a_tail_desc, w_ptr, w_desc, ws_ptr, bias_ptr, y_ptr, gw_ptr, sorted_ptr, expert,
                     row0, pid_n * BLOCK_N, split, P, topk, N_OUT, K, k_per_split, has_bias, apply_weight,
                     stride_am, stride_aj, stride_ak, stride_asm, stride_we, stride_wn, stride_wk, stride_se,
                     stride_sn, stride_sk, stride_be, stride_bn, stride_ys, stride_yt, stride_yj, stride_yn, stride_gm,
                     stride_gk, A_SORTED, EVEN_K, DOT_PREC, TAIL_M, BLOCK_N, BLOCK_K, W_DESC, A_DESC, WFMT, PTX, A_Q)
    else:
        _gemm2_block(a_ptr, as_ptr, a_desc, w_ptr, w_desc, ws_ptr, bias_ptr, y_ptr, gw_ptr, sorted_ptr, expert, row0,
                     pid_n * BLOCK_N, split, P, topk, N_OUT, K, k_per_split, has_bias, apply_weight,
                     stride_am, stride_aj, stride_ak, stride_asm, stride_we, stride_wn, stride_wk, stride_se,
                     stride_sn, stride_sk, stride_be, stride_bn, stride_ys, stride_yt, stride_yj, stride_yn, stride_gm,
                     stride_gk, A_SORTED, EVEN_K, DOT_PREC, ROWS, BLOCK_N, BLOCK_K, W_DESC, A_DESC, WFMT, PTX, A_Q)
    if WAIT:
        if PDL:
            # gemm1 has completed (all its tiles counted): this grid's completion implies gemm1's.
            gdc_wait()


@triton.jit(do_not_specialize=["P", "topk"])
def gather_rows_kernel(x_ptr, out_ptr, os_ptr, sorted_ptr, block_expert_ptr, P, topk, K, stride_xm, stride_xk,
                       stride_om, stride_osm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       Q: tl.constexpr, PTX: tl.constexpr, UE8M0: tl.constexpr):
    """out[row, k] = x[sorted[row] // topk, k] for the valid rows of the used blocks and 0 for their padding
    rows, program (block, k tile): gemm1's A operand in sorted order, for TMA loads (unused blocks
    untouched; zero padding rows: see the NOTE in _gemm1_block). Q (fp8 block; BLOCK_K a multiple of 128): the
    rows are stored quantized (``quantize_fp8_groups``: e4m3 in ``out``, scales per row and 128-column group in
    ``os_ptr``, row stride ``stride_osm``; UE8M0: power-of-two scales), the same values as quantizing x per token."""
    grid_dependency(PDL)
    block = tl.program_id(0)
    if tl.load(block_expert_ptr + block) < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < P
    token = tl.where(row_ok, pair // topk, 0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = (offs_k < K)[None, :]
    vals = tl.load(x_ptr + token.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                   mask=row_ok[:, None] & k_ok, other=0.0)
    if Q:
        vals, scales = quantize_fp8_groups(vals, PTX, UE8M0)
        offs_g = tl.program_id(1) * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
        tl.store(os_ptr + rows.to(tl.int64)[:, None] * stride_osm + offs_g[None, :], scales,
                 mask=(offs_g < tl.cdiv(K, 128))[None, :])
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_k[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=k_ok)


@triton.jit(do_not_specialize=["M", "topk", "SPLITS"])
def sum_slots_kernel(
    y_ptr, out_ptr, inverse_ptr, M, topk, N_OUT, SPLITS,
    stride_ys, stride_yt, stride_yj, stride_yn, stride_om, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr, Y_SORTED: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, n] = sum over splits s and valid slots j (inverse[t * topk + j] >= 0) of y[s, t, j, n], in
    increasing (s, j): deterministic. Y_SORTED: y is [sorted rows, N_OUT] instead (the persistent gemm2's
    output, one split), the slot's row is inverse[t * topk + j] and stride_yt the row stride. SLOTS >= topk, a
    power of two: a token's inverse entries are read as one vector before the slots' rows, so that no row load
    waits for a load of its index, and the loop over the slots is unrolled by 4 (four slots' row loads in flight).

    NOTE: against a loop that loaded each slot's index and then its row, H200, end to end: qwen3-next-80b-a3b-tp2
    M = 8 (topk 10) 79.0-79.3 against 82.2 us, qwen3-235b-a22b-tp4 M = 8 133.6-134.0 against 136.0
    (benchmarks/results/ab_sum_slots_h200.txt: ``python benchmarks/ab_fused_experts.py --model qwen3-next-80b-a3b-tp2
    --tokens 8`` before and after)."""
    grid_dependency(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < M
    n_ok = offs_n < N_OUT
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    t64 = offs_t.to(tl.int64)
    jj = tl.arange(0, SLOTS)
    rows = tl.load(inverse_ptr + t64[:, None] * topk + jj[None, :], mask=t_ok[:, None] & (jj < topk)[None, :],
                   other=-1)
    y_tile = y_ptr + t64[:, None] * stride_yt + offs_n[None, :] * stride_yn
    for _ in range(0, SPLITS):
        for j in tl.range(0, topk, loop_unroll_factor=4):
            row = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
            if Y_SORTED:
                y_ptrs = y_ptr + tl.maximum(row, 0).to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
            else:
                y_ptrs = y_tile + j * stride_yj
            valid = t_ok & (row >= 0)
            acc += tl.load(y_ptrs, mask=valid[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        y_tile += stride_ys
    o_ptrs = out_ptr + t64[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["E_global", "E", "P", "topk", "has_map", "has_bias", "router_on_input",
                               *_RUNTIME_STRIDES, "stride_im", "stride_ik"])
def gemv1_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, gw_ptr, ids_ptr, map_ptr, E_global, E,
    P, topk, N_OUT, N_HALF, K, has_map, has_bias, router_on_input,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_bn,
    stride_om, stride_on, stride_im, stride_ik, stride_gm, stride_gk, alpha, limit,
    u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr, lm_ptr, stride_lm, L, R,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr, G_ON_A: tl.constexpr,
    LORA: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Per pair p = program_id(1): out[p, n0:n0+BLOCK_N] as in gemm1 (rows of invalid pairs untouched; G_ON_A as
    in ``_gemm1_block``). LORA (ACT 0 only): plus ``g B[l, e] u[p]`` on the active pairs (``_lora.lora_rows_delta``,
    the arguments from ``u_ptr`` on), before the one rounding.

    The weight tile is [rows, BLOCK_K]; products accumulate elementwise in a 2-D fp32 tile that is reduced
    over k once at the end (no cross-thread reduction inside the loop).
    NOTE: Triton software-pipelines loads that feed no tl.dot only in loops that carry their own
    num_stages (tl.range), hence NUM_STAGES on the loop.
    """
    tl.static_assert(not LORA or ACT == 0, "the LoRA expand is fused without an activation only")
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    expert, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    if not valid:
        return
    t = p // topk
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xm + offs_k * stride_xk
    n0 = pid_n * BLOCK_N
    ACC_K: tl.constexpr = BLOCK_K // 2 if WFMT == 1 else BLOCK_K
    if ACT == 0:
        wr = wrap(n0 + tl.arange(0, BLOCK_N), N_OUT, BLOCK_N)
        acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    elif ACT == 4:
        wr = wrap(2 * n0 + tl.arange(0, 2 * BLOCK_N), 2 * N_HALF, 2 * BLOCK_N)
        acc = tl.zeros([2 * BLOCK_N, ACC_K], dtype=tl.float32)
    else:
        wr = wrap(n0 + tl.arange(0, BLOCK_N), N_HALF, BLOCK_N)
        acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    e64, wr64 = expert.to(tl.int64), wr.to(tl.int64)
    w_rows = e64 * stride_we + wr64 * stride_wn
    w_ptrs, s_ptrs = weight_ptrs(w_ptr, ws_ptr, w_rows, scale_rows(e64, wr64, stride_se, stride_sn, WFMT), 0,
                                 stride_wk, stride_sk, BLOCK_K, WFMT, False)
    u_ptrs, us_ptrs = weight_ptrs(w_ptr, ws_ptr, w_rows + N_HALF * stride_wn,
                                  scale_rows(e64, wr64 + N_HALF, stride_se, stride_sn, WFMT), 0, stride_wk, stride_sk,
                                  BLOCK_K, WFMT, False)
    g = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + (p - t * topk) * stride_gk, mask=router_on_input != 0,
                other=1.0).to(tl.float32)
    g_lora = g
    for kk in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_k < K - kk * BLOCK_K, other=0.0)
        if G_ON_A:
            x = x.to(tl.float32) * g
        acc = fma_step(acc, x, w_ptrs, s_ptrs, K - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX)
        if ACT != 0 and ACT != 4:
            acc_u = fma_step(acc_u, x, u_ptrs, us_ptrs, K - kk * BLOCK_K, EVEN_K, BLOCK_K, WFMT, PTX)
            u_ptrs, us_ptrs = weight_advance(u_ptrs, us_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs, s_ptrs = weight_advance(w_ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)

    if G_ON_A:
        g = 1.0
    h = tl.sum(acc, axis=1) * g
    b_base = bias_ptr + expert.to(tl.int64) * stride_be
    b_lim = tl.where(has_bias != 0, 2 * N_HALF + N_OUT, 0)
    h += tl.load(b_base + wr * stride_bn, mask=wr < b_lim, other=0.0).to(tl.float32)
    if ACT == 0:
        result = h
        if LORA:
            delta, active = lora_rows_delta(u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr,
                                            lm_ptr, stride_lm, L, R, p, t, expert, wr, BLOCK_R)
            result = tl.where(active, h + g_lora * delta, h)
    elif ACT == 4:
        gate, up = tl.split(tl.reshape(h, (BLOCK_N, 2)))
        result = activate(gate, up, alpha, limit, ACT)
    else:
        hu = tl.sum(acc_u, axis=1) * g
        hu += tl.load(b_base + (wr + N_HALF) * stride_bn, mask=wr < b_lim, other=0.0).to(tl.float32)
        result = activate(h, hu, alpha, limit, ACT)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n * stride_on, result.to(out_ptr.dtype.element_ty),
             mask=offs_n < N_OUT)


@triton.jit(do_not_specialize=["E_global", "E", "P", "topk", "nslot", "has_map", "has_bias", "apply_weight",
                               *_RUNTIME_STRIDES, "stride_im", "stride_ik"])
def gemv2_kernel(
    a_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, gw_ptr, ids_ptr, map_ptr, E_global, E,
    P, topk, nslot, N_OUT, K, has_map, has_bias, apply_weight,
    stride_at, stride_aj, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_ot, stride_oj, stride_on, stride_im, stride_ik, stride_gm, stride_gk,
    u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr, lm_ptr, stride_lm, L, R,
    SUM_SLOTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, WFMT: tl.constexpr, PTX: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """SUM_SLOTS: program (n tile, token t) computes out[t, n] = sum_j valid (W2[e_j] a[t, j] + b2[e_j]) g_j
    (the topk sum fused; a fixed reduction order: deterministic; invalid slots add nothing). Otherwise
    program (n tile, pair p) computes out[t, j, n] for one pair (rows of invalid pairs untouched).
    nslot = topk or 1 accordingly, SLOTS >= nslot a power of two. LORA (per pair only): plus ``g B[l, e] u[p]``
    on the active pairs (as in ``gemv1_kernel``).

    NOTE: every step streams the [SLOTS, BLOCK_N, BLOCK_K] weight tile of all the program's slots at once:
    per-slot expert pointers are computed once before the loop (no per-step slot bookkeeping: a first
    version that walked (slot, k) steps one slot at a time spent ~140 instructions and 5 barriers per 8
    weight elements per thread), invalid slots are masked rows that load nothing.
    """
    tl.static_assert(not LORA or not SUM_SLOTS, "the LoRA expand is fused per pair only")
    pid_n = tl.program_id(0)
    if SUM_SLOTS:
        t = tl.program_id(1)
        slot0 = 0
    else:
        p0 = tl.program_id(1)
        t = p0 // topk
        slot0 = p0 - t * topk
    jj = tl.arange(0, SLOTS)
    slot_p = t * topk + slot0 + jj
    e_vec, ok_vec = local_expert(ids_ptr, slot_p, tl.where(jj < nslot, P, 0), stride_im, stride_ik,
                                 map_ptr, E_global, E, topk, has_map)
    g_vec = tl.load(gw_ptr + t.to(tl.int64) * stride_gm + (slot0 + jj) * stride_gk,
                    mask=ok_vec & (jj < tl.where(apply_weight != 0, nslot, 0)), other=1.0).to(tl.float32)
    g_vec = tl.where(ok_vec, g_vec, 0.0)
    if not SUM_SLOTS:
        if tl.sum(ok_vec.to(tl.int32), axis=0) == 0:
            return

    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wr = wrap(offs_n, N_OUT, BLOCK_N)
    e64 = tl.where(ok_vec, e_vec, 0).to(tl.int64)
    wr64 = wr.to(tl.int64)
    w_ptrs, s_ptrs = weight_ptrs(w_ptr, ws_ptr, e64[:, None] * stride_we + wr64[None, :] * stride_wn,
                                 scale_rows(e64[:, None], wr64[None, :], stride_se, stride_sn, WFMT), 0, stride_wk,
                                 stride_sk, BLOCK_K, WFMT, False)
    a_ptrs = a_ptr + t.to(tl.int64) * stride_at + (slot0 + jj)[:, None] * stride_aj + offs_k[None, :] * stride_ak
    k_lim = tl.where(ok_vec, K, 0)  # per slot: an invalid slot loads nothing
    ACC_K: tl.constexpr = BLOCK_K // 2 if WFMT == 1 else BLOCK_K
    acc = tl.zeros([SLOTS, BLOCK_N, ACC_K], dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        k_left = k_lim - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left[:, None], other=0.0)
        acc = fma_step(acc, a, w_ptrs, s_ptrs, k_left[:, None, None], False, BLOCK_K, WFMT, PTX)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs, s_ptrs = weight_advance(w_ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K, WFMT)
    # Router weights (0 for invalid slots) applied once per slot, after its reduction over k.
    out = tl.sum(tl.sum(acc, axis=2) * g_vec[:, None], axis=0)
    # Biases of all slots in one [SLOTS, BLOCK_N] load, weighted and summed over the slots.
    b_ptrs = bias_ptr + e64[:, None] * stride_be + wr[None, :] * stride_bn
    b_ok = ok_vec[:, None] & (wr[None, :] < tl.where(has_bias != 0, N_OUT, 0))
    b = tl.load(b_ptrs, mask=b_ok, other=0.0).to(tl.float32)
    out += tl.sum(b * g_vec[:, None], axis=0)
    if LORA:
        delta, active = lora_rows_delta(u_ptr, stride_up, lb_ptr, stride_lbl, stride_lbe, stride_lbn, stride_lbr,
                                        lm_ptr, stride_lm, L, R, t * topk + slot0, t, tl.sum(e64, axis=0), wr,
                                        BLOCK_R)
        out = tl.where(active, out + tl.sum(g_vec, axis=0) * delta, out)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + slot0 * stride_oj + offs_n * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_n < N_OUT)
