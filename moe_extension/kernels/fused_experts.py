"""Launchers of the routed-expert Triton kernels: the entry points behind ``fused_experts``,
``expert_gemm1`` and ``expert_gemm2`` for every ``quant`` in ``_weight_formats.WEIGHT_FORMATS`` (arguments
already validated by the op layer).

Shapes: ``hidden_states [M, K]``, ``w1 [E, 2N, K]``, ``w2 [E, K, N]`` (any strides), ``w1_bias [E, 2N]``,
``w2_bias [E, K]``, ``topk_weights [M, topk]``, ``topk_ids [M, topk]`` int32/int64, ``expert_map
[E_global]`` int32. Outputs are contiguous, in the activations' dtype, accumulated in fp32.

Every size below comes from shapes (workspaces are worst-case sized), every launch goes to the current
stream, and nothing reads device memory on the host: capture-safe, and no host sync. Schedules
(see ``_configs``), with P = M * topk pairs:
- direct (decode: M = 1, or P * 8 <= E): 2 launches. ``gemv1`` (+ activation), grid
  (cdiv(N, BN), P) -> ``a [P, N]``; ``gemv2`` over each token's slots (the topk sum fused, fixed order),
  grid (cdiv(K, BN), M) -> ``out [M, K]``. MXFP4 in the MMA layout and fp8 block multiply in tensor-core
  steps (``_gemv_dot``): grids (tiles, P, splits of the reduction), or on an fp8 block shard expecting few local
  pairs as many programs as fit on the GPU, taking the local pairs' items in turn (``_gemv_work_list``); 3 launches
  (one zeroes the counters that let the last program of an output tile sum the partials and the slots in a fixed
  order; fp8 block: the one that quantizes x).
- sorted: 4 launches (6 when P > 128: the routing takes three; one more when gemm1 copies its token rows
  into sorted order for TMA loads, ``tma_a``). ``route`` -> ``gemm1`` (+ activation),
  grid (max_blocks * cdiv(N, BN),) -> ``a`` [sorted rows, N] -> ``gemm2``, grid (max_blocks * cdiv(K, BN),
  splits; with ``gemm2.tile_m`` max_blocks * block_m / tile_m * cdiv(K, BN)) -> per-slot ``y [splits, M, topk, K]``
  -> ``sum_slots``, grid (M, cdiv(K, 2048)) -> ``out``.
  max_blocks = P // block_m + min(P, E) bounds the non-empty expert blocks; programs of the blocks past
  the used ones read block_expert = -1 and exit at once. With ``gemm2.persistent`` (sm_90+), gemm2 is
  ``_gemm2_persistent``: one program per SM, grid (SMs,) -> sorted rows ``y [rows, K]``, which
  ``sum_slots`` reads through ``inverse``.
No float atomics anywhere: results are bitwise reproducible.

On sm_90+ every kernel of the sorted schedule is launched with programmatic dependent launch (PDL; the
direct schedule's two GEMVs only for fp8 block, after the quantization kernel, see the NOTE): a kernel's programs
may start while its predecessor drains; each waits for the predecessor's completion (``griddepcontrol.wait``) before
it touches memory, then lets its own successor launch. gemm2 of the fused path is the exception: it starts
a tile as soon as gemm1 has finished all the tiles of that tile's expert (gemm1 counts its finished tiles
per expert in ``Routing.tiles_done`` with a release increment; gemm2 acquires the count, and waits for
gemm1's whole grid only at its end, so that its completion still implies gemm1's; the persistent gemm2
launches without PDL, see the NOTE in ``fused_experts_triton``). No deadlock: gemm2's
programs launch only after every gemm1 program has started. Memory that a running kernel still reads is
never handed to a later allocation of the call (gemm1's row copy lives until the call returns).

NOTE: PDL (with gemm2's per-expert start) against plain stream order, H100, CUDA-graph replay medians of
interleaved rounds, us (benchmarks/results/ab_pdl_h100.txt: ``python benchmarks/ab_fused_experts.py --model MODEL
--tokens M --no-pdl``): qwen3 M = 64 410.0 against 417.4, M = 1024 488.2 against 496.4; mixtral M = 256 1029.5
against 1035.3; gpt-oss M = 16 854.4 against 867.0, M = 4096 2551.5 against 2587.1; inside the spread at the
power-capped qwen3 and mixtral M = 4096 cells. The direct schedule's GEMVs launch without it: with it gpt-oss
M = 1 took 72.7 us against 71.2 and mixtral M = 1 235.0 against 231.9 (same file). fp8 block is the exception:
its quantization kernel lets the next launch start at once, and with both GEMVs launched with PDL the DeepSeek-V3
layer took 130.9 us against 133.1 at M = 1, its shard of 32 of 256 experts 20.0 against 20.5 at M = 1 and 63.6
against 65.3 at M = 4; MXFP4 in the MMA layout (its GEMVs after a zero fill) took 38.7 against 36.8 with PDL at
gpt-oss-120b M = 1, 108.5 against 109.1 at M = 4 (benchmarks/results/ab_direct_pdl_h100.txt: ``python
benchmarks/ab_fused_experts.py --model deepseek-v3 --quant fp8_block [--local-experts 32] --tokens M --activation
silu --no-pdl``; ``--model gpt-oss-120b --quant mxfp4_mma --tokens M --direct-pdl``), and on an H200 with gemv2 at
119 registers 31.1 against 30.4 (benchmarks/results/ab_tile_rows_h200.txt).
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_extension.kernels import _grouped_gemm as kern
from moe_extension.kernels._gemm2_persistent import RAGGED_ROWS, gemm2_persistent_kernel, ragged_rows_desc
from moe_extension.kernels._configs import (GemmConfig, MoeConfig, get_config, gemv_programs_per_sm, is_row_major,
                                            shard_direct)
from moe_extension.kernels._launch import (cdiv, device_guard, join, next_power_of_2, pdl_capable, pdl_options,
                                           sm_count, tma_capable, tma_layout_ok)
from moe_extension.kernels._quantize_fp8 import quantize_fp8_rows
from moe_extension.kernels._routing import Routing, route
from moe_extension.kernels._gemv_dot import gemv1_dot_kernel, gemv2_dot_kernel
from moe_extension.kernels._weight_formats import WFMT_FP8_BLOCK, WeightOperand
from moe_extension.kernels.lora import (FusedExpand, add_lora_expand, add_lora_shrink_beside, expand_epilogue_args,
                                        lora_shrink_triton)


def _dot_precision(dtype: torch.dtype, w: WeightOperand | None = None) -> str:
    # NOTE: fp32 inputs use exact fp32 products (tf32 would cost ~1e-3 relative error); bf16/fp16 ignore it.
    # MXFP4 multiplies bf16 values: on the GPU as bf16, in the interpreter held in fp32 (exact products); fp8
    # block's dots take no precision argument (``_weight_formats._fp8_dot``).
    if w is not None and not w.dense:
        return "tf32" if _ptx(w.w.device) else "ieee"
    return "ieee" if dtype == torch.float32 else "tf32"


def _ptx(device: torch.device) -> bool:
    """Whether the kernels decode MXFP4 with inline PTX (a GPU) or with plain Triton ops (the interpreter)."""
    return device.type == "cuda"


def select_config(M: int, hidden_states: torch.Tensor, w1: WeightOperand, w2: WeightOperand, topk: int,
                  config: MoeConfig | None, quant: str = "none", expert_map: torch.Tensor | None = None) -> MoeConfig:
    """The config for this call: an explicit one (tuning, tests) or the table / heuristic choice, for the
    ``local_tokens`` of the call."""
    if config is not None:
        return config
    E, two_n, K = w1.shape
    return get_config(local_tokens(M, E, expert_map, quant, w1.w.element_size(), topk), E, two_n // 2, K, topk,
                      hidden_states.dtype, is_row_major(w1.w), is_row_major(w2.w), hidden_states.device, quant,
                      local_pairs(M, topk, E, expert_map))


def is_shard(E: int, expert_map: torch.Tensor | None) -> bool:
    """Whether a call holds an expert-parallel shard: an ``expert_map`` over more experts than the E held here."""
    return expert_map is not None and expert_map.numel() > E


def local_tokens(M: int, E: int, expert_map: torch.Tensor | None, quant: str = "none", esize: int = 2,
                 topk: int = 1) -> int:
    """The token count a config is chosen for: M, or on an expert-parallel shard (``is_shard``) M * E / E_global,
    at least 2: under uniform routing that share of the slots is local, so the local experts see the rows of that
    many tokens with every slot local (shapes only). The floor of 2 keeps a shard off the direct schedule of the FMA
    GEMVs, whose grid covers all M * topk pairs, most of them not local, and whose tiles span all a token's slots;
    where a shard's direct schedule runs the tensor-core GEMVs (``_configs.shard_dot_gemvs``: fp8 block, MXFP4 in the
    MMA layout, 16-bit dense weights of ``esize`` 2) the floor is 1 (``_configs.shard_direct``; 16-bit dense weights
    up to 2 expected local pairs of the ``topk`` slots): those split the local pairs' reductions over the GPU, where
    the sorted first GEMM has only its N tiles per expert (``shard_dot_gemvs`` has the 16-bit A/B).
    NOTE: MXFP4 in the MMA layout, gpt-oss-120b's shard of 32 of 128 experts on the H200, direct / sorted: M = 1
    18.3 / 21.9 us, M = 4 41.4 / 42.9 (``python benchmarks/ab_fused_experts.py --quant mxfp4_mma --model
    gpt-oss-120b --local-experts 32 --tokens 1 --other-schedule``; benchmarks/results/ab_dense_dot_gemvs_h200.txt).
    NOTE: DeepSeek-V3's 32-expert shard of 256 (bf16, ``python benchmarks/bench_zoo.py --models deepseek-v3-ep8``)
    on the H100, ours / floor before -> after this and ``_configs.dense_sorted_tiles`` together (not measured
    apart): M = 8 1.09 -> 1.06, 64 1.03 -> 0.99, 512 1.06 -> 1.02, 2048 1.18 -> 1.17, 8192 2.15 -> 1.62. M = 8
    with the direct schedule (chosen for 1 local token) took 458 us against 211 sorted. M = 1, the same shard,
    CUDA-graph medians over 8 random routings (0.75 local pairs on average): direct 59.4 us, sorted (the config
    of 2 tokens) 36.8; with no local pair 42.2 against 10.7 (the direct second GEMV's 3584 programs per token
    cost 40 us with nothing to read), with one 63.7 against 55.2 (the two configs timed through
    ``fused_experts_triton(config=...)``, as ``python benchmarks/ab_fused_experts.py --model deepseek-v3
    --local-experts 32 --tokens 1 --other-schedule`` now does; its figure: the deepseek-v3-ep8 M = 1 cell of
    bench_zoo.py).
    NOTE: DeepSeek-V3's 32-expert shard of 256 in fp8 block on the H100, the direct schedule (the heuristic's
    config at 1 token) against the sorted one (its config at 2), CUDA-graph medians over 8 random routings: M = 1
    25.1 against 40.7 us, M = 4 69.1 against 84.6 (the two configs timed through ``fused_experts_triton(config=...)``,
    as ``ab_fused_experts.py --quant fp8_block --activation silu --model deepseek-v3 --local-experts 32 --tokens M
    --other-schedule`` now does; the figures of the op: the shard's cells of bench_fused_experts_fp8.py)."""
    if not is_shard(E, expert_map):
        return M
    share = M * E / expert_map.numel()
    return max(1 if shard_direct(quant, esize, share * topk) else 2, round(share))


def local_pairs(M: int, topk: int, E: int, expert_map: torch.Tensor | None) -> int | None:
    """The (token, slot) pairs expected on the E experts held here: None (all M * topk) unless the call holds an
    expert-parallel shard (``is_shard``), else M * topk * E / E_global (uniform routing), at least 1. Sizes the direct
    tensor-core GEMVs' split reductions (``_configs.dot_gemv_direct``), whose programs of other pairs exit at once."""
    if not is_shard(E, expert_map):
        return None
    return max(1, round(M * topk * E / expert_map.numel()))


def _stride(t: torch.Tensor | None, dim: int) -> int:
    return t.stride(dim) if t is not None else 0


def _tma_weights_ok(w: torch.Tensor, cfg: GemmConfig) -> bool:
    """Whether cfg's weight tiles of w come by TMA: asked for (``tma_weights``), sm_90+ and a TMA-capable layout."""
    return cfg.tma_weights and tma_capable(w.device) and tma_layout_ok(w, cfg.block_k)


def _weight_desc(w: torch.Tensor, rows: int, cfg: GemmConfig, halves: int = 0) -> TensorDescriptor | None:
    """TMA descriptor of w [E, out, in] with block [1, rows, block_k] when cfg asks for it and the device
    (sm_90+) and layout (``_launch.tma_layout_ok``, rows within 256) allow it; None selects the pointer loads.
    ``halves`` (1 or 2): w [E, 2N, in] viewed as [E, 2, N, in], block [1, halves, rows, block_k]: with 2 the
    gate rows n.. stacked on the up rows N + n.. in one load, with 1 either of them."""
    if not _tma_weights_ok(w, cfg) or rows > 256:
        return None
    if halves:
        E, two_n, K = w.shape
        return TensorDescriptor(w, [E, 2, two_n // 2, K], [w.stride(0), two_n // 2 * w.stride(1), w.stride(1),
                                                          w.stride(2)], [1, halves, rows, cfg.block_k])
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, rows, cfg.block_k])


def _sorted_rows_descs(a: torch.Tensor, block_m: int, cfg: GemmConfig):
    """TMA descriptors of the sorted intermediate a [rows, N] with blocks [block_m, block_k] and
    [tail_m, block_k] (None when tail_m = 0), or (None, None) for pointer loads: when cfg does not ask
    for it or the device (sm_90+) or layout (``_launch.tma_layout_ok``) does not allow it."""
    if not (cfg.tma_a and tma_capable(a.device) and tma_layout_ok(a, cfg.block_k)):
        return None, None

    def desc(rows):
        return TensorDescriptor(a, list(a.shape), list(a.stride()), [rows, cfg.block_k])

    return desc(block_m), desc(cfg.tail_m) if cfg.tail_m else None


def gathers_rows(x: torch.Tensor, cfg: GemmConfig, quantize: bool = False) -> bool:
    """Whether gemm1 copies its A rows into sorted order for TMA loads (``_gathered_rows_descs``): asked for
    (``tma_a``), sm_90+, 16-bit x, and rows of the copy (K elements of 2 bytes, 1 quantized) 16-byte multiples."""
    return (cfg.tma_a and tma_capable(x.device) and x.element_size() == 2
            and x.shape[1] * (1 if quantize else 2) % 16 == 0)


def _gathered_rows_descs(x, routing: Routing, topk, cfg: GemmConfig, pdl: bool = False, quantize: bool = False,
                         ue8m0: bool = False):
    """(a_desc, a_tail_desc, rows, rows_scale) of gemm1's A rows copied into sorted order (``rows``) by
    ``gather_rows_kernel`` when ``gathers_rows``; (None,) * 4 selects the gathered pointer loads. ``quantize`` (fp8
    block): the copy holds the rows quantized, e4m3 values and their scales ``rows_scale`` [rows, cdiv(K, 128)]
    (else None; ``ue8m0``: power-of-two scales)."""
    if not gathers_rows(x, cfg, quantize):
        return None, None, None, None
    K = x.shape[1]
    rows = torch.empty((routing.max_blocks * routing.block_m, K),
                       dtype=torch.float8_e4m3fn if quantize else x.dtype, device=x.device)
    rows_scale = (torch.empty((rows.shape[0], cdiv(K, 128)), dtype=torch.float32, device=x.device)
                  if quantize else None)
    descs = _sorted_rows_descs(rows, routing.block_m, cfg)
    if descs[0] is not None:
        # NOTE: [block_m, 256] per program, 8 warps: at mixtral M = 4096 (8192 rows of 4096 bf16, 67 MB
        # written) the copy took 40 us on the H100, about the copy ceiling.
        block_k = min(256, next_power_of_2(K))
        block_k = max(128, block_k) if quantize else block_k  # whole 128-column groups
        kern.gather_rows_kernel[(routing.max_blocks, cdiv(K, block_k))](
            x, rows, rows_scale if quantize else rows, routing.sorted_pairs, routing.block_expert,
            routing.inverse.numel(), topk, K, x.stride(0), x.stride(1), rows.stride(0), _stride(rows_scale, 0),
            BLOCK_M=routing.block_m, BLOCK_K=block_k, Q=quantize, PTX=_ptx(x.device), UE8M0=ue8m0,
            **pdl_options(pdl, num_warps=8),
        )
    return descs + (rows, rows_scale)


def _gemm1_sorted(x, w1, bias, out, out_sorted, routing: Routing, topk, act, weights, alpha, limit,
                  cfg: GemmConfig, pdl: bool = False, signal: bool = False, zero_padding: bool = True,
                  x_scale: torch.Tensor | None = None, out_scale: torch.Tensor | None = None):
    """out rows (sorted positions or pairs) of the first GEMM; act 0 writes h [.., 2N], else a [.., N].

    fp8 block: ``x_scale`` given: x is quantized already (``quantize_fp8_rows``: e4m3 rows and their
    scales [M, cdiv(K, 128)]); ``out_scale`` given (out_sorted): out is stored quantized, e4m3 values and their
    scales [rows, cdiv(N, 128)], for the fp8 gemm2.

    zero_padding (out_sorted): store the padding rows of the used blocks as 0 (False: leave them unwritten,
    for a consumer that reads only valid rows). pdl: launch with programmatic dependent launch. signal: count
    each finished tile in ``routing.tiles_done[expert]`` (for a gemm2 launched with ``wait_tiles_n1``).
    Returns the row copy workspaces of ``tma_a`` (rows and, quantized, their scales; or None): with PDL they
    must stay allocated until a kernel that waits for this one's completion has been launched."""
    w1 = WeightOperand.of(w1)
    E, two_n, K = w1.shape
    n_out = two_n if act == kern.ACT_NONE else two_n // 2
    fp8 = w1.fmt == WFMT_FP8_BLOCK
    block_n = cfg.block_n
    if fp8 and act == kern.ACT_NONE:
        # fp8 block: the tile without an activation holds the same 2 x block_n weight rows (two 128-row parts)
        # as the gated one.
        # NOTE: expert_gemm1 on the DeepSeek-V3 layer (E 256, topk 8, K 7168, N 2048) at M = 8192, H100, the
        # table's config (block_m 128, 8 warps, 3 stages): 6727.5 us (572 TFLOP/s) with 128 weight rows per tile
        # (expert_gemm1_triton with config= gemm1 block_n 64) against 5965.4 us (645 TFLOP/s) with 2 x 128.
        block_n = 2 * cfg.block_n
    grid = (routing.max_blocks * cdiv(n_out, block_n),)
    persistent = out_sorted and not signal and _persistent_gemm1_ok(cfg, w1)
    if persistent:
        grid = (min(sm_count(x.device), grid[0]),)
    halves = act not in (kern.ACT_NONE, kern.ACT_SWIGLUOAI)
    if not w1.element_tiles:
        w_desc = None
    elif fp8:  # loads of 128-row parts (_gemm1_block)
        w_desc = _weight_desc(w1.w, 128, cfg, halves=int(halves))
    elif act == kern.ACT_SWIGLUOAI:
        w_desc = _weight_desc(w1.w, 2 * cfg.block_n, cfg)
    else:
        w_desc = _weight_desc(w1.w, cfg.block_n, cfg, halves=2 * int(halves))
    a_desc, a_tail_desc, rows, rows_scale = (
        _gathered_rows_descs(x, routing, topk, cfg, pdl, quantize=w1.fmt == WFMT_FP8_BLOCK and weights is None,
                             ue8m0=w1.ue8m0)
        if out_sorted and x_scale is None else (None,) * 4)
    if rows_scale is not None:
        x_scale = rows_scale
    kern.gemm1_sorted_kernel[grid](
        x, x_scale if x_scale is not None else x, a_desc, a_tail_desc, w1.w, w_desc, w1.scale,
        bias if bias is not None else out, out, out_scale if out_scale is not None else out,
        weights if weights is not None else out,
        routing.sorted_pairs, routing.block_expert, routing.expert_counts, routing.expert_starts,
        routing.tiles_done, routing.inverse.numel(), topk, n_out, two_n // 2, K, routing.max_blocks,
        E - 1, int(bias is not None), int(weights is not None),
        x.stride(0), x.stride(1), _stride(x_scale, 0), *w1.strides, _stride(bias, 0), _stride(bias, 1),
        out.stride(0), out.stride(1), _stride(out_scale, 0), _stride(weights, 0), _stride(weights, 1), float(alpha),
        float(limit), ACT=act, OUT_SORTED=out_sorted, ZERO_PAD=out_sorted and zero_padding, EVEN_K=K % cfg.block_k == 0,
        DOT_PREC=_dot_precision(x.dtype, w1), WFMT=w1.fmt, PTX=_ptx(x.device),
        G_ON_A=weights is not None and not w1.dense,
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        W_DESC=w_desc is not None, TAIL_M=cfg.tail_m, A_DESC=a_desc is not None, SIGNAL=signal,
        Q_OUT=out_scale is not None, A_Q=x_scale is not None, ROW_SCALES=fp8 and halves and two_n // 2 % 128 != 0,
        PERSISTENT=persistent, NUM_SMS=sm_count(x.device) if persistent else 1, **_tile_options(cfg, pdl),
    )
    return rows, rows_scale


def _persistent_gemm1_ok(cfg: GemmConfig, w1: WeightOperand) -> bool:
    """Whether the fused path's gemm1 runs persistent (one program per SM walking the used blocks' tiles,
    ``gemm1_sorted_kernel`` PERSISTENT): asked for, without tail tiles (``sanitize`` keeps it to 16-bit weights),
    with its weight tiles by TMA (``_weight_desc``: sm_90+, a TMA-capable layout); it then signals no tiles to gemm2.
    NOTE: only with TMA weight tiles: the flattened loop of the MXFP4 MMA layout's pointer-loaded tiles took 2.1-2.7x
    the tiled launch's time on an H200 (benchmarks/results/ab_persistent_gemm1_h200.txt, run 3), and pointer loads
    of 16-bit tiles in it were never measured."""
    return cfg.persistent and cfg.tail_m == 0 and w1.dense and cfg.block_n <= 128 and _tma_weights_ok(w1.w, cfg)


def split_reduction(N: int, cfg: GemmConfig) -> tuple[int, int]:
    """(non-empty splits, columns per split) of the reduction dim N: cfg.split_k splits of whole BLOCK_K steps,
    fewer when the steps run out; N = 0: one empty split (the epilogues still run: the biases)."""
    per_split = max(1, cdiv(cdiv(N, max(1, cfg.split_k)), cfg.block_k)) * cfg.block_k
    return max(1, cdiv(N, per_split)), per_split


def effective_splits(N: int, cfg: GemmConfig) -> int:
    """Non-empty splits of the reduction dim N when each split takes whole BLOCK_K steps."""
    return split_reduction(N, cfg)[0]


def _gemm2_sorted(a, a_sorted, w2, bias, y, routing: Routing, topk, weights, cfg: GemmConfig, pdl: bool = False,
                  wait_tiles_n1: int = 0, a_scale: torch.Tensor | None = None):
    """y [splits, M, topk, K] of the second GEMM; ``a`` is [sorted rows, N] (a_sorted) or [M, topk, N].
    fp8 block: ``a_scale`` given (a_sorted), a holds gemm1's quantized rows and these their scales.

    pdl: launch with programmatic dependent launch. wait_tiles_n1 > 0 (gemm1's N tiles; with pdl, after a
    gemm1 launched with ``signal``): each tile waits until its expert's gemm1 tiles have all counted instead
    of waiting for gemm1's whole grid."""
    w2 = WeightOperand.of(w2)
    E, K, N = w2.shape
    splits = y.shape[0]
    k_per_split = cdiv(cdiv(N, splits), cfg.block_k) * cfg.block_k
    if a_sorted:
        stride_am, stride_aj, stride_ak = a.stride(0), 0, a.stride(1)
    else:
        stride_am, stride_aj, stride_ak = a.stride(0), a.stride(1), a.stride(2)
    rows = cfg.tile_m or routing.block_m
    grid = (routing.max_blocks * (routing.block_m // rows) * cdiv(K, cfg.block_n), splits)
    w_desc = _weight_desc(w2.w, cfg.block_n, cfg) if w2.element_tiles else None
    a_desc, a_tail_desc = _sorted_rows_descs(a, rows, cfg) if a_sorted else (None, None)
    kern.gemm2_sorted_kernel[grid](
        a, a_scale if a_scale is not None else a, a_desc, a_tail_desc, w2.w, w_desc, w2.scale,
        bias if bias is not None else y, y,
        weights if weights is not None else y,
        routing.sorted_pairs, routing.block_expert, routing.expert_counts, routing.expert_starts,
        routing.tiles_done, wait_tiles_n1, routing.inverse.numel(), topk, K, N, routing.max_blocks, k_per_split,
        int(bias is not None), int(weights is not None), stride_am, stride_aj, stride_ak, _stride(a_scale, 0),
        *w2.strides,
        _stride(bias, 0), _stride(bias, 1), y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        _stride(weights, 0), _stride(weights, 1),
        A_SORTED=a_sorted, WFMT=w2.fmt, PTX=_ptx(a.device),
        EVEN_K=(N % cfg.block_k == 0 and k_per_split % cfg.block_k == 0), DOT_PREC=_dot_precision(a.dtype, w2),
        BLOCK_M=routing.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        W_DESC=w_desc is not None, TAIL_M=cfg.tail_m, A_DESC=a_desc is not None, WAIT=wait_tiles_n1 > 0,
        A_Q=a_scale is not None, TILE_M=0 if rows == routing.block_m else rows, **_tile_options(cfg, pdl),
    )


def _tile_options(cfg: GemmConfig, pdl: bool) -> dict:
    """Launch options of a sorted-path tile: its warps and stages, its register cap where it sets one
    (``GemmConfig.max_registers``), PDL as asked."""
    cap = {"maxnreg": cfg.max_registers} if cfg.max_registers else {}
    return pdl_options(pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cap)


def _persistent_gemm2_ok(a: torch.Tensor, w2: torch.Tensor, cfg: GemmConfig) -> bool:
    """Whether the persistent gemm2 can run on the sorted ``a``: asked for, one split, sm_90+, TMA layouts
    (``_launch.tma_layout_ok``) for a, w2 and its output rows (contiguous [rows, K] in a's dtype), tiles within TMA's
    256-element box, and rows within the ragged descriptors' 2^30."""
    K = w2.shape[1]
    return (cfg.persistent and cfg.split_k == 1 and cfg.block_n <= 256 and tma_capable(a.device)
            and tma_layout_ok(a, cfg.block_k) and tma_layout_ok(w2, cfg.block_k)
            and K * a.element_size() % 16 == 0 and a.shape[0] < RAGGED_ROWS)


def _gemm2_persistent(a, w2, bias, y, routing: Routing, topk, weights, cfg: GemmConfig, pdl: bool = False):
    """y [sorted rows, K] of the second GEMM from the sorted ``a`` [sorted rows, N], one program per SM (see
    the module ``_gemm2_persistent``); rows of the padding and of unused blocks are neither read nor written."""
    E, K, N = w2.shape
    bm = routing.block_m
    sms = sm_count(a.device)
    w_desc = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [1, cfg.block_n, cfg.block_k])
    grid = (min(sms, routing.max_blocks * cdiv(K, cfg.block_n)),)
    gemm2_persistent_kernel[grid](
        ragged_rows_desc(a, bm, cfg.block_k), w_desc, ragged_rows_desc(y, bm, cfg.block_n),
        bias if bias is not None else y, weights if weights is not None else y,
        routing.sorted_pairs, routing.block_expert, routing.expert_counts, routing.expert_starts,
        E - 1, routing.inverse.numel(), topk, K, N, int(weights is not None),
        _stride(bias, 0), _stride(bias, 1), _stride(weights, 0), _stride(weights, 1),
        HAS_BIAS=bias is not None, DOT_PREC=_dot_precision(a.dtype), BLOCK_M=bm, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=sms,
        **pdl_options(pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def _sum_slots(y, inverse, out, topk, pdl: bool = False):
    """out [M, K] from per-slot rows y [splits, M, topk, K], or from sorted rows y [rows, K] (2-D: the
    persistent gemm2's) read through ``inverse``."""
    M, K = out.shape
    if y.dim() == 2:
        splits, strides = 1, (0, y.stride(0), 0, y.stride(1))
    else:
        splits, strides = y.shape[0], y.stride()
    # NOTE: one token row per program, K in 1-2 K chunks: loads of 16 B per thread, and at M = 1 the
    # launch is a handful of programs.
    block_n = min(next_power_of_2(K), 2048)
    kern.sum_slots_kernel[(M, cdiv(K, block_n))](
        y, out, inverse, M, topk, K, splits, *strides, out.stride(0), out.stride(1), BLOCK_T=1, BLOCK_N=block_n,
        SLOTS=next_power_of_2(topk), Y_SORTED=y.dim() == 2, **pdl_options(pdl, num_warps=4),
    )


def _gemv1_dot_counters(P: int, n_out: int, K: int, cfg: GemmConfig) -> int:
    """The int32 counters ``gemv1_dot_kernel`` needs (0: none, its reduction is not split)."""
    return P * cdiv(n_out, cfg.block_n) if split_reduction(K, cfg)[0] > 1 else 0


def _gemv2_dot_counters(M: int, topk: int, K: int, N: int, cfg: GemmConfig, sum_slots: bool) -> int:
    """The int32 counters ``gemv2_dot_kernel`` needs (0: none, one program per output tile)."""
    groups = M if sum_slots else M * topk
    arrivals = (topk if sum_slots else 1) * split_reduction(N, cfg)[0]
    return groups * cdiv(K, cfg.block_n) if arrivals > 1 else 0


def _zeroed_counters(n: int, device) -> torch.Tensor:
    return torch.zeros((max(1, n),), dtype=torch.int32, device=device)


# The expected local pairs up to which an fp8 block shard's direct GEMVs take work lists (``_gemv_work_list``).
GEMV_WORK_LIST_PAIRS = 2


def _gemv_work_list(w: WeightOperand, pairs: int | None) -> bool:
    """Whether the tensor-core GEMVs (``_gemv_dot``) of weights ``w`` take work lists (``_gemv_grid``): fp8 block
    weights on an expert-parallel shard expecting up to GEMV_WORK_LIST_PAIRS local pairs (``pairs``:
    ``local_pairs``, None off a shard), whose items mostly have no work.
    NOTE: a program of the one-per-item grid whose pair has no work still costs its launch and the loads of its
    pair's id and expert. DeepSeek-V3's fp8 block shard of 32 of 256 experts, silu, H200, CUDA-graph medians of
    interleaved rounds (benchmarks/results/ab_gemv_work_list_h200.txt): M = 1 16.1 us against 16.8 with the
    one-per-item kernels before the work lists (``python benchmarks/ab_fused_experts.py --quant fp8_block --activation
    silu --model deepseek-v3 --local-experts 32 --tokens 1 --gemv-from FILE``, FILE = ``git show
    fca1e63:moe_extension/kernels/_gemv_dot.py``); M = 2 25.3 against 25.8 for the one-per-item grid, M = 4 49.7
    against 47.4 (``--tokens M --gemv-grids full``). Elsewhere the loop over the items costs more than the exits
    save (same file): it holds more registers (MXFP4's gemv2 231 against 126: two programs per SM instead of four;
    gpt-oss-120b, 32 of 128 experts, M = 1 23.8 against 16.4 us), the whole fp8 layer's pairs all have work, and
    16-bit weights gained at most what they lost (DeepSeek-V3's shard M = 1 28.6 against 29.8, M = 2 52.9 against
    52.3)."""
    return w.fmt == WFMT_FP8_BLOCK and pairs is not None and pairs <= GEMV_WORK_LIST_PAIRS


def _gemv_grid(tiles: int, pairs: int, splits: int, cfg: GemmConfig, rows: int, w: WeightOperand,
               device: torch.device, work_list: bool) -> tuple[tuple[int, ...], bool]:
    """(grid, WORK_LIST) of a tensor-core GEMV launch (``_gemv_dot``) of ``tiles`` output tiles, ``pairs`` (token,
    slot) pairs and ``splits`` splits of the reduction: a program per (tile, pair, split) item, whose programs of
    pairs without work exit; or, with ``work_list`` where those items do not all fit on the GPU at once, as many
    programs as fit (``gemv_programs_per_sm`` per SM), which take the items of the pairs with work in turn."""
    fit = gemv_programs_per_sm(cfg.num_stages, rows, w.quant) * sm_count(device)
    if not work_list or tiles * pairs * splits <= fit:
        return (tiles, pairs, splits), False
    return (fit,), True


def _gemv1(x, w1, bias, out, topk_ids, expert_map, act, weights, alpha, limit, cfg: GemmConfig, counters=None,
           lora: FusedExpand | None = None, out_scale: torch.Tensor | None = None,
           x_scale: torch.Tensor | None = None, pdl: bool = False, zero_rows: torch.Tensor | None = None) -> bool:
    """Rows p of out [P, n_out] for the valid pairs (direct path). Tensor-core GEMVs (``WeightOperand.dot_gemvs``, or
    16-bit dense weights with ``cfg.dot``):
    ``counters`` (zeroed int32, at least ``_gemv1_dot_counters``; None: allocated here). ``lora`` (act none only):
    the LoRA expand added in the epilogue (``kernels.lora.FusedExpand``). fp8 block: x quantized up front
    (``quantize_fp8_rows``) unless the router weights scale it (``weights``: g x is quantized per pair, per step);
    ``out_scale`` [P, cdiv(n_out, 128)] (cfg.block_n a multiple of 128): out is e4m3 and the rows are stored
    quantized, these their scales. ``x_scale``: x is e4m3 already, these its scales (``quantize_fp8_rows``).
    ``pdl`` (tensor-core GEMVs): launched with programmatic dependent launch. ``zero_rows`` (the fused op's output
    [M, K], contiguous rows): where the launch takes a work list, it also zeroes the rows of the tokens without a
    valid slot and returns True (``_gemv2`` is then told to leave them); False otherwise.
    NOTE: the zero rows from gemv1's work-list programs (after their scan, beside their items) instead of gemv2's
    items of such a token's slot 0 (which wait for gemv1's completion, then read the token's routing again): H200,
    DeepSeek-V3's fp8 block shard of 32 of 256 experts, CUDA-graph medians of 5 interleaved rounds over 8 routings,
    outputs bitwise equal: M = 1 without a local pair 4.8 against 7.7 us, M = 1 on random routings 21.2 against 22.2,
    M = 2 25.7 against 26.9, M = 1 with one local pair (no zero row) 23.5 against 23.5
    (benchmarks/results/ab_gemv1_zero_rows_h200.txt: ``python benchmarks/ab_fused_experts.py --quant fp8_block --model
    deepseek-v3 --local-experts 32 --activation silu --tokens 1 --local-pairs 0 --sets 8 --zero-rows-in-gemv2``)."""
    lora_args, lora_flags = expand_epilogue_args(lora, out)
    w1 = WeightOperand.of(w1)
    E, two_n, K = w1.shape
    M, topk = topk_ids.shape
    n_out = two_n if act == kern.ACT_NONE else two_n // 2
    has_map = expert_map is not None
    if w1.dot_gemvs or cfg.dot:
        if w1.fmt == WFMT_FP8_BLOCK and weights is None and x_scale is None:
            # NOTE: quantized in the GEMV's steps instead (the row as a 16-row tile), the DeepSeek-V3 layer's gemv1
            # took 202.5 us at M = 1 on the H100 (1.16 TB/s; ncu: issue-bound, 2 warps per scheduler; _gemv1 timed
            # alone, 128 weight rows on 4 warps, split 2). On e4m3 rows the tuner's gemv1 candidates take
            # 89.5 to 95.4 us (2.5-2.6 TB/s; ``python benchmarks/tune_fused_experts.py --quant fp8_block --tokens 1``).
            x, x_scale = quantize_fp8_rows(x, w1.ue8m0)
        tiles = cdiv(n_out, cfg.block_n)
        splits, per_split = split_reduction(K, cfg)
        w_rows = cfg.block_n if act == kern.ACT_NONE else 2 * cfg.block_n
        part = torch.empty((splits, M * topk, tiles, w_rows) if splits > 1 else (1,), dtype=torch.float32,
                           device=x.device)
        cnt = counters if counters is not None else _zeroed_counters(_gemv1_dot_counters(M * topk, n_out, K, cfg),
                                                                     x.device)
        grid, work_list = _gemv_grid(tiles, M * topk, splits, cfg, w_rows, w1, x.device,
                                     _gemv_work_list(w1, local_pairs(M, topk, E, expert_map)))
        zeroes = work_list and zero_rows is not None
        z = zero_rows if zeroes else out
        gemv1_dot_kernel[grid](
            x, x_scale if x_scale is not None else x, w1.w, w1.scale, bias if bias is not None else out, out,
            out_scale if out_scale is not None else out, part, cnt, weights if weights is not None else out,
            topk_ids, expert_map if has_map else topk_ids, expert_map.numel() if has_map else E, E,
            M * topk, topk, n_out, two_n // 2, K, per_split, int(has_map), int(bias is not None),
            int(weights is not None), x.stride(0), x.stride(1), *w1.strides, _stride(bias, 0), _stride(bias, 1),
            out.stride(0), out.stride(1), topk_ids.stride(0), topk_ids.stride(1),
            _stride(weights, 0), _stride(weights, 1), _stride(x_scale, 0), _stride(out_scale, 0), float(alpha),
            float(limit), *lora_args, z, z.shape[0] if zeroes else 0, z.shape[1], z.stride(0),
            ACT=act, EVEN_K=K % cfg.block_k == 0, SPLIT=splits, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_PREC=_dot_precision(x.dtype, w1), WFMT=w1.fmt, PTX=_ptx(x.device),
            G_ON_A=weights is not None and not w1.dense, A_Q=x_scale is not None, Q_OUT=out_scale is not None,
            WORK_LIST=work_list, ZERO_ROWS=zeroes, **lora_flags,
            **pdl_options(pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )
        return zeroes
    grid = (cdiv(n_out, cfg.block_n), M * topk)
    kern.gemv1_kernel[grid](
        x, w1.w, w1.scale, bias if bias is not None else out, out, weights if weights is not None else out,
        topk_ids, expert_map if has_map else topk_ids, expert_map.numel() if has_map else E, E,
        M * topk, topk, n_out, two_n // 2, K, int(has_map), int(bias is not None), int(weights is not None),
        x.stride(0), x.stride(1), *w1.strides, _stride(bias, 0), _stride(bias, 1),
        out.stride(0), out.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        _stride(weights, 0), _stride(weights, 1), float(alpha), float(limit), *lora_args,
        ACT=act, EVEN_K=K % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        WFMT=w1.fmt, PTX=_ptx(x.device), G_ON_A=weights is not None and not w1.dense, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **lora_flags,
    )
    return False


def _gemv2(a, w2, bias, out, topk_ids, expert_map, weights, sum_slots: bool, cfg: GemmConfig, counters=None,
           lora: FusedExpand | None = None, a_scale: torch.Tensor | None = None, pdl: bool = False,
           zero_rows: bool = True):
    """Direct second GEMM. ``a [M, topk, N]``; out [M, K] (sum_slots) or [M, topk, K]. ``counters`` and ``lora``
    (not with sum_slots): as in ``_gemv1`` (``_gemv2_dot_counters``). fp8 block: ``a`` e4m3 with ``a_scale``
    [M * topk, cdiv(N, 128)] its scales (gemv1's quantized output), or quantized here (``quantize_fp8_rows``).
    ``pdl``: as in ``_gemv1``. ``zero_rows`` False (with sum_slots): the rows of the tokens without a valid slot are
    zeroed already (``_gemv1``'s ``zero_rows``); the tensor-core GEMV leaves them."""
    lora_args, lora_flags = expand_epilogue_args(lora, out)
    w2 = WeightOperand.of(w2)
    E, K, N = w2.shape
    M, topk = topk_ids.shape
    has_map = expert_map is not None
    if sum_slots:
        stride_ot, stride_oj, stride_on = out.stride(0), 0, out.stride(1)
    else:
        stride_ot, stride_oj, stride_on = out.stride(0), out.stride(1), out.stride(2)
    slots = next_power_of_2(topk) if sum_slots else 1
    if w2.dot_gemvs or cfg.dot:
        if w2.fmt == WFMT_FP8_BLOCK and a_scale is None:
            q, a_scale = quantize_fp8_rows(a.reshape(M * topk, N), w2.ue8m0)
            a = q.view(M, topk, N)
        tiles = cdiv(K, cfg.block_n)
        splits, per_split = split_reduction(N, cfg)
        nslot = topk if sum_slots else 1
        part = torch.empty((splits, M * topk, tiles, cfg.block_n) if nslot * splits > 1 else (1,), dtype=torch.float32,
                           device=a.device)
        cnt = counters if counters is not None else _zeroed_counters(
            _gemv2_dot_counters(M, topk, K, N, cfg, sum_slots), a.device)
        grid, work_list = _gemv_grid(tiles, M * topk, splits, cfg, cfg.block_n, w2, a.device,
                                     _gemv_work_list(w2, local_pairs(M, topk, E, expert_map)))
        gemv2_dot_kernel[grid](
            a, a_scale if a_scale is not None else a, w2.w, w2.scale, bias if bias is not None else out, out, part, cnt,
            weights if weights is not None else out, topk_ids, expert_map if has_map else topk_ids,
            expert_map.numel() if has_map else E, E, M * topk, topk, nslot, K, N, per_split, int(has_map),
            int(bias is not None), int(weights is not None), a.stride(0), a.stride(1), a.stride(2), *w2.strides,
            _stride(bias, 0), _stride(bias, 1), stride_ot, stride_oj, stride_on, topk_ids.stride(0),
            topk_ids.stride(1), _stride(weights, 0), _stride(weights, 1), _stride(a_scale, 0), *lora_args,
            SUM_SLOTS=sum_slots, SLOTS=slots, EVEN_K=N % cfg.block_k == 0, SPLIT=splits, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, DOT_PREC=_dot_precision(a.dtype, w2), WFMT=w2.fmt, PTX=_ptx(a.device),
            A_Q=a_scale is not None, WORK_LIST=work_list, ZERO_ROWS=sum_slots and zero_rows, **lora_flags,
            **pdl_options(pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )
        return
    # NOTE: cfg.block_n is sized for tiles of all the token's slots (SLOTS x block_n x block_k); one pair
    # per program streams a SLOTS times wider tile instead, the same bytes per step.
    block_n = cfg.block_n if sum_slots else cfg.block_n * next_power_of_2(topk)
    grid = (cdiv(K, block_n), M if sum_slots else M * topk)
    kern.gemv2_kernel[grid](
        a, w2.w, w2.scale, bias if bias is not None else out, out, weights if weights is not None else out,
        topk_ids, expert_map if has_map else topk_ids, expert_map.numel() if has_map else E, E,
        M * topk, topk, topk if sum_slots else 1, K, N, int(has_map), int(bias is not None),
        int(weights is not None), a.stride(0), a.stride(1), a.stride(2), *w2.strides,
        _stride(bias, 0), _stride(bias, 1), stride_ot, stride_oj, stride_on,
        topk_ids.stride(0), topk_ids.stride(1), _stride(weights, 0), _stride(weights, 1), *lora_args,
        SUM_SLOTS=sum_slots, SLOTS=slots, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, WFMT=w2.fmt, PTX=_ptx(a.device), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **lora_flags,
    )


def fused_experts_triton(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu", *,
                         w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                         expert_map: torch.Tensor | None = None, apply_router_weight_on_input: bool = False,
                         alpha: float = 1.702, limit: float = 7.0, quant: str = "none",
                         w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                         config: MoeConfig | None = None, pdl: bool = True) -> torch.Tensor:
    """out [M, K] = sum_j g_j FFN_{e_j}(x) (or sum_j FFN_{e_j}(g_j x) with apply_router_weight_on_input).

    quant: "none", "mxfp4" or "fp8_block" (w1 / w2 with their scales; see ``_weight_formats``). fp8 block
    quantizes the activations per token per 128 columns: x once up front (``quantize_fp8_rows``; per slot inside
    gemm1 with apply_router_weight_on_input, since g x is what is quantized) and gemm1's output in its epilogue
    (e4m3 rows + scales, gemm2's input), in both schedules. pdl: programmatic dependent launch where the device
    has it (False: plain stream order, for A/B runs)."""
    M, K = hidden_states.shape
    w1, w2 = WeightOperand(w1, w1_scale, quant), WeightOperand(w2, w2_scale, quant)
    E, two_n, _ = w1.shape
    N = two_n // 2
    topk = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    act = kern.ACTIVATION_CODES[activation]
    if M == 0 or K == 0 or E == 0:  # E = 0 (a rank without experts): every slot is invalid, the output 0
        return torch.zeros((M, K), dtype=dtype, device=dev)
    cfg = select_config(M, hidden_states, w1, w2, topk, config, quant, expert_map)
    w_in = topk_weights if apply_router_weight_on_input else None
    w_out = None if apply_router_weight_on_input else topk_weights
    out = torch.empty((M, K), dtype=dtype, device=dev)
    pdl = pdl and pdl_capable(dev)
    fp8 = w1.fmt == WFMT_FP8_BLOCK
    with device_guard(dev):
        if cfg.path == "direct":
            # fp8 block: gemv1 stores its rows quantized (e4m3 + scales), gemv2's input.
            a = torch.empty((M, topk, N), dtype=torch.float8_e4m3fn if fp8 else dtype, device=dev)
            a_scale = torch.empty((M * topk, cdiv(N, 128)), dtype=torch.float32, device=dev) if fp8 else None
            c1 = c2 = None
            x, x_scale = hidden_states, None
            dot1, dot2 = w1.dot_gemvs or cfg.gemm1.dot, w2.dot_gemvs or cfg.gemm2.dot
            if dot1 or dot2:
                # both tensor-core GEMVs' counters zeroed by one launch: with fp8's quantization of x, or alone
                n1 = _gemv1_dot_counters(M * topk, N, K, cfg.gemm1) if dot1 else 0
                n2 = _gemv2_dot_counters(M, topk, K, N, cfg.gemm2, True) if dot2 else 0
                cnt = torch.empty((max(1, n1 + n2),), dtype=torch.int32, device=dev)
                if fp8 and w_in is None:
                    x, x_scale = quantize_fp8_rows(hidden_states, w1.ue8m0, zero=cnt, trigger=pdl)
                else:
                    cnt.zero_()
                c1, c2 = cnt[:max(1, n1)], cnt[n1:] if n2 else cnt
            # With PDL only after the quantization, which lets gemv1 launch at once (see the NOTE in the docstring).
            dot_pdl = pdl and fp8 and w_in is None
            zeroed = _gemv1(x, w1, w1_bias, a.view(M * topk, N), topk_ids, expert_map, act, w_in, alpha, limit,
                            cfg.gemm1, c1, out_scale=a_scale, x_scale=x_scale, pdl=dot_pdl, zero_rows=out)
            _gemv2(a, w2, w2_bias, out, topk_ids, expert_map, w_out, True, cfg.gemm2, c2, a_scale=a_scale, pdl=dot_pdl,
                   zero_rows=not zeroed)
            return out
        x, x_scale, a_scale = hidden_states, None, None
        if fp8 and w_in is None and not gathers_rows(hidden_states, cfg.gemm1, quantize=True):
            x, x_scale = quantize_fp8_rows(hidden_states, w1.ue8m0)
        routing = route(topk_ids, E, cfg.block_m, expert_map, pdl=pdl)
        a = torch.empty((routing.max_blocks * cfg.block_m, N), dtype=torch.float8_e4m3fn if fp8 else dtype,
                        device=dev)
        if fp8:
            a_scale = torch.empty((a.shape[0], cdiv(N, 128)), dtype=torch.float32, device=dev)
        # With PDL, gemm2 starts while gemm1 still runs (see the module docstring): gemm1 counts its finished
        # tiles per expert, gemm2's tiles wait for their expert's count, and gemm1's row copy (if any) stays
        # allocated until the end of the call, so that y cannot take its memory while gemm1 reads it. The
        # persistent gemm2 reads only valid rows, so gemm1 leaves the padding rows unwritten for it (at qwen3
        # M = 4096 ~8k rows, 12.6 MB of stores; the end-to-end change was inside the noise).
        persistent = w2.dense and _persistent_gemm2_ok(a, w2.w, cfg.gemm2)
        # A persistent gemm1 signals no tiles: gemm2 then waits for its completion.
        signal = pdl and not persistent and not _persistent_gemm1_ok(cfg.gemm1, w1)
        rows = _gemm1_sorted(x, w1, w1_bias, a, True, routing, topk, act, w_in, alpha, limit, cfg.gemm1, pdl,
                             signal=signal, zero_padding=not persistent, x_scale=x_scale, out_scale=a_scale)
        if persistent:
            # Sorted rows (padding rows never written), summed through routing.inverse.
            y = torch.empty((a.shape[0], K), dtype=dtype, device=dev)
            # NOTE: in plain stream order (after gemm1's completion; the slot sum after it keeps PDL): H100,
            # qwen3-30b-a3b M = 4096, 8 interleaved rounds, median 785.0 us with PDL -> 775.9 without
            # (triton_kernels 774.9; benchmarks/results/ab_persistent_pdl_h100.txt, from
            # ``python benchmarks/ab_fused_experts.py --model qwen3-30b-a3b --tokens 4096 --persistent-pdl``).
            _gemm2_persistent(a, w2.w, w2_bias, y, routing, topk, w_out, cfg.gemm2, pdl=False)
        else:
            splits = effective_splits(N, cfg.gemm2)
            # NOTE: per-slot rows are stored in the activations' dtype (half the bytes of fp32: at qwen3
            # M = 4096 that is 134 MB written + read instead of 268 MB); split partials need fp32.
            y = torch.empty((splits, M, topk, K), dtype=dtype if splits == 1 else torch.float32, device=dev)
            _gemm2_sorted(a, True, w2, w2_bias, y, routing, topk, w_out, cfg.gemm2, pdl,
                          wait_tiles_n1=cdiv(N, cfg.gemm1.block_n) if signal else 0, a_scale=a_scale)
        _sum_slots(y, routing.inverse, out, topk, pdl)
        del rows
    return out


def expert_gemm1_triton(hidden_states: torch.Tensor, w1: torch.Tensor, topk_ids: torch.Tensor, *,
                        w1_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                        topk_weights: torch.Tensor | None = None, quant: str = "none",
                        w1_scale: torch.Tensor | None = None, lora_a: torch.Tensor | None = None,
                        lora_b: torch.Tensor | None = None, token_lora_mapping: torch.Tensor | None = None,
                        config: MoeConfig | None = None) -> torch.Tensor:
    """h [M, topk, 2N] = W1[e] (g x or x) + b1[e]; rows of invalid slots are 0. quant: "none", "mxfp4" or
    "fp8_block" (x, or g x, quantized as in ``fused_experts_triton``). With ``lora_a`` / ``lora_b`` /
    ``token_lora_mapping``: plus ``g B[l, e] (A[l, e] x)`` on the active pairs (``_lora_term``)."""
    M, K = hidden_states.shape
    w1 = WeightOperand(w1, w1_scale, quant)
    E, two_n, _ = w1.shape
    topk = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    h = torch.zeros((M, topk, two_n), dtype=dtype, device=dev)
    if h.numel() == 0 or E == 0:
        return h
    cfg = config or get_config(local_tokens(M, E, expert_map, quant, w1.w.element_size(), topk), E, two_n // 2, K,
                               topk, dtype, is_row_major(w1.w), True, dev, quant, local_pairs(M, topk, E, expert_map))
    h_rows = h.view(M * topk, two_n)
    pdl = pdl_capable(dev)
    with device_guard(dev):
        if cfg.path == "direct":
            fused = _fused_expand(hidden_states, lora_a, lora_b, token_lora_mapping, topk_ids, expert_map)
            _gemv1(hidden_states, w1, w1_bias, h_rows, topk_ids, expert_map, kern.ACT_NONE, topk_weights, 0.0, 0.0,
                   cfg.gemm1, lora=fused)
        else:
            shrunk, side = add_lora_shrink_beside(hidden_states, lora_a, topk_ids, token_lora_mapping, expert_map)
            x, x_scale = hidden_states, None
            if w1.fmt == WFMT_FP8_BLOCK and topk_weights is None:
                x, x_scale = quantize_fp8_rows(hidden_states, w1.ue8m0)
            routing = route(topk_ids, E, cfg.block_m, expert_map, pdl=pdl)
            _gemm1_sorted(x, w1, w1_bias, h_rows, False, routing, topk, kern.ACT_NONE, topk_weights, 0.0, 0.0,
                          cfg.gemm1, pdl, x_scale=x_scale)
            if shrunk is not None:
                join(dev, side)
                add_lora_expand(h, shrunk, lora_b, topk_weights=topk_weights)
    return h


def _fused_expand(x, lora_a, lora_b, token_lora_mapping, topk_ids, expert_map) -> FusedExpand | None:
    """The LoRA term of a direct-schedule GEMM (None without adapters): ``u = A[l, e] x`` per pair now (one shrink
    launch), its expand added in the GEMV's epilogue, before the one rounding.
    NOTE: against ``add_lora`` after the GEMV (a shrink and an expand launch per term, the expand re-reading and
    re-writing the GEMV's output), H100, ``UnfusedOAITritonExperts`` with 4 adapters at M = 1, over the same call
    without LoRA (``python benchmarks/bench_lora.py --tokens 1``, column ratio): rank 16 1.243 -> 1.156
    (gpt-oss-20b), 1.235 -> 1.170 (gpt-oss-120b); rank 64 1.250 -> 1.195, 1.246 -> 1.194 (this change alone; the
    one-row shrink of ``kernels.lora._shrink`` came after)."""
    if lora_a is None:
        return None
    u = lora_shrink_triton(x, lora_a, topk_ids, token_lora_mapping, expert_map=expert_map)
    return FusedExpand(u, lora_b, token_lora_mapping)


def expert_gemm2_triton(intermediate: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, *,
                        w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                        topk_weights: torch.Tensor | None = None, quant: str = "none",
                        w2_scale: torch.Tensor | None = None, lora_a: torch.Tensor | None = None,
                        lora_b: torch.Tensor | None = None, token_lora_mapping: torch.Tensor | None = None,
                        config: MoeConfig | None = None) -> torch.Tensor:
    """y [M, topk, K] = (W2[e] a + b2[e]) (times g when topk_weights is given); rows of invalid slots are 0.
    quant: "none", "mxfp4" or "fp8_block" (``intermediate`` quantized per row per 128 columns as it is loaded).
    LoRA as in ``expert_gemm1_triton``: plus ``g B[l, e] (A[l, e] a)`` on the active pairs."""
    M, topk, N = intermediate.shape
    w2 = WeightOperand(w2, w2_scale, quant)
    E, K, _ = w2.shape
    dev, dtype = intermediate.device, intermediate.dtype
    y = torch.zeros((M, topk, K), dtype=dtype, device=dev)
    if y.numel() == 0 or E == 0:
        return y
    if config is None:
        config = get_config(local_tokens(M, E, expert_map, quant, w2.w.element_size(), topk), E, N, K, topk, dtype,
                            True, is_row_major(w2.w), dev, quant, local_pairs(M, topk, E, expert_map))
    pdl = pdl_capable(dev)
    with device_guard(dev):
        if config.path == "direct":
            fused = _fused_expand(intermediate, lora_a, lora_b, token_lora_mapping, topk_ids, expert_map)
            _gemv2(intermediate, w2, w2_bias, y, topk_ids, expert_map, topk_weights, False, config.gemm2, lora=fused)
        else:
            shrunk, side = add_lora_shrink_beside(intermediate, lora_a, topk_ids, token_lora_mapping, expert_map)
            routing = route(topk_ids, E, config.block_m, expert_map, pdl=pdl)
            _gemm2_sorted(intermediate, False, w2, w2_bias, y.unsqueeze(0), routing, topk, topk_weights, config.gemm2,
                          pdl)
            if shrunk is not None:
                join(dev, side)
                add_lora_expand(y, shrunk, lora_b, topk_weights=topk_weights)
    return y
