"""Tune the routed-expert Triton kernels on this GPU and write a config table for it.

For each model (E, topk, K, N) and token count M it times, by CUDA-graph replay over rotated random
routings (every token picks topk distinct experts, ``torch.rand(M, E).topk``), bf16:

- the sorted path: for each candidate ``block_m`` the routing, each first-GEMM tile candidate and each
  second-GEMM (+ slot sum) candidate on their own (each with pointer and with TMA loads; the first GEMM
  also with TMA weight tiles and pointer-gathered token rows), keeping the fastest of each, then the
  winner's tail tile heights (``tail_m``) and the winner in expert-major tile order (``group_m`` 0), the first
  GEMM's winner and a second GEMM with TMA rows also as persistent kernels (``persistent``; 16-bit weights; the
  second GEMM also in the heuristic's persistent tile, 256 output columns on 8 warps), at blocks of 128 rows and
  more the second GEMM's winner in row tiles of half the block on 4 warps (``tile_m``); the best ``block_m`` by the
  sum of the three;
- the direct path (tiny M only): each GEMV candidate of both GEMMs;
then times the best of each path end to end through ``fused_experts_triton`` and keeps the faster. The
winner is checked against the heuristic's output (rel err <= 1e-2) before it is written.

The table goes to ``<out>/<device>.json`` (the file ``moe_extension/kernels/_configs.py`` loads from
``moe_extension/configs/``), merged over the table already there for this device. Entries are keyed by
(E, N, K, topk, dtype, weight layouts, weight format); the activation is swigluoai (what the benchmark runs).

The default run (the three benchmark models at M in {1, 16, 64, 256, 1024, 4096}) was sized to take well
under 4 minutes on an H100, most of it Triton compiles (cached on disk for the next run), before the first
GEMM's third load variant (half again as many first-GEMM candidates; not re-timed). CUDA only.

``--quant mxfp4``: MXFP4 expert weights (packed e2m1 + E8M0 per 32, bf16-rounded activations; default
models gpt-oss-120b and gpt-oss-20b). Each model's weights are random normal / sqrt(cols), quantized once on
the GPU with ``moe_extension.quant.quantize_mxfp4`` (8 experts at a time) and passed to the launchers as
``WeightOperand(packed, scales, "mxfp4")``; ``--weight-layout transposed`` passes transposed views of
``[E, K/2, 2N]`` / ``[E, N/2, K]`` storage, scales alike. The search is the one above with MXFP4's own tile
lists (block_k 64 or 128; the H100's gpt-oss-120b winners among them) and without what MXFP4 weights do not
take: no TMA weight tiles and no persistent gemm2 (both need 16-bit weights), TMA rows only for gemm2's
sorted intermediate. Configs are sanitized for MXFP4, the end-to-end timings and the check run
``fused_experts_triton(..., quant="mxfp4", w1_scale, w2_scale)``, and the entries go under the key with
``,quant=mxfp4`` (``table_key(..., "mxfp4")``).

``--quant mxfp4_mma``: the same MXFP4 stacks prepared into the MMA layout (``prepare_mxfp4_mma``; contiguous,
so ``--weight-layout linear`` only, K and N multiples of 64), its own tile lists (block_k 128; 128 or 256 weight rows
per tile on 4 or 8 warps; split reductions of gemm2 for few row blocks; the direct schedule's tensor-core GEMVs with
their split reductions); entries under ``,quant=mxfp4_mma``.

``--quant fp8_block``: fp8 block weights (e4m3 values of about N(0, 16) with fp32 scales per 128 x 128 block;
default model deepseek-v3). The search takes fp8's own tiles (block_k 128, 128-column outputs, at most 64
rows per block: ``sanitize``'s rules), each with and without TMA weight tiles and TMA rows (gemm1: its token rows
gathered and quantized into sorted order; gemm2: its quantized intermediate). gemm1 is timed as the fused path
runs it (x quantized up front unless the rows are gathered, output stored quantized) and gemm2 on quantized
rows; at tiny M the direct schedule's tensor-core GEMVs too (splits and tile heights around ``dot_gemv_direct``,
gemv2 on the fp32 intermediate); the entries go under ``,quant=fp8_block``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))
from model_zoo import ZOO  # noqa: E402

MODELS = {
    "gpt-oss-120b": dict(E=128, topk=4, K=2880, N=2880),
    "qwen3-30b-a3b": dict(E=128, topk=8, K=2048, N=768),
    "mixtral-8x7b": dict(E=8, topk=2, K=4096, N=14336),
    "gpt-oss-20b": dict(E=32, topk=4, K=2880, N=2880),
    "deepseek-v3": dict(E=256, topk=8, K=7168, N=2048),
    "deepseek-v2-lite": dict(E=64, topk=6, K=2048, N=1408),
    # tensor-parallel shards with a short gemm2 reduction (N <= 256, _configs.PERSISTENT_GEMM2_MAX_N), not in the zoo:
    # DeepSeek-V3's experts over 8 GPUs (2048 / 8), Qwen3-30B-A3B's over 4 (768 / 4)
    "deepseek-v3-tp8": dict(E=256, topk=8, K=7168, N=256),
    "qwen3-30b-a3b-tp4": dict(E=128, topk=8, K=2048, N=192),
}
# The zoo of bench_zoo.py (model_zoo.ZOO) but its expert-parallel shard, whose routing (most slots on other GPUs)
# is not what the tuner draws.
MODELS.update({name: {k: s[k] for k in ("E", "topk", "K", "N")} for name, s in ZOO.items() if "E_global" not in s})
# --models by --quant: the three bf16 benchmark models; for MXFP4 the gpt-oss models, whose experts ship in it
DEFAULT_MODELS = {
    "none": ("gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"),
    "mxfp4": ("gpt-oss-120b", "gpt-oss-20b"),
    "mxfp4_mma": ("gpt-oss-120b", "gpt-oss-20b"),
    "fp8_block": ("deepseek-v3",),
}
MXFP4_QUANTIZE_CHUNK = 8  # experts quantized at a time (fp32 temporaries of ~0.5 GB per 8 gpt-oss W1s)
TOKENS = (1, 16, 64, 256, 1024, 4096)
ACTIVATION = "swigluoai"
DEVICE = "cuda"  # of the weights and inputs (the CPU tests run the tuner in Triton's interpreter)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quant", choices=("none", "mxfp4", "mxfp4_mma", "fp8_block"), default="none",
                   help="expert weight format: 'none' = weights in --dtype; 'mxfp4' / 'mxfp4_mma' / 'fp8_block' = "
                        "quantized weights, --dtype activations (default: %(default)s)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                   help=f"models to tune (default: {' '.join(DEFAULT_MODELS['none'])}; with --quant mxfp4 or "
                        f"mxfp4_mma {' '.join(DEFAULT_MODELS['mxfp4'])}; with --quant fp8_block "
                        f"{' '.join(DEFAULT_MODELS['fp8_block'])})")
    p.add_argument("--shape", nargs=4, type=int, action="append", metavar=("E", "TOPK", "K", "N"), default=[],
                   help="extra expert shape to tune (repeatable)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="M buckets (default: %(default)s)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--weight-layout", choices=("linear", "transposed"), default="linear",
                   help="'linear': w1 [E, 2N, K] contiguous; 'transposed': [E, K, 2N] storage passed as views "
                        "(MXFP4: packed [E, K/2, 2N] and scales [E, K/32, 2N])")
    p.add_argument("--out", default=None,
                   help="directory for <device>.json (default: moe_extension/configs, i.e. install the table)")
    p.add_argument("--sets", type=int, default=4, help="rotated routings per timing (default: %(default)s)")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = list(DEFAULT_MODELS[args.quant])
    if args.quant in ("mxfp4", "mxfp4_mma"):
        from moe_extension.quant import MXFP4_BLOCK
        from moe_extension.quant.mxfp4_mma import MMA_COLS

        mult = MXFP4_BLOCK if args.quant == "mxfp4" else MMA_COLS
        odd = [s for s in args.shape if s[2] % mult or s[3] % mult]
        if odd:
            p.error(f"--quant {args.quant} needs K and N multiples of {mult}; --shape {odd}")
    if args.quant == "mxfp4_mma" and args.weight_layout != "linear":
        p.error("--quant mxfp4_mma: the MMA layout is contiguous (--weight-layout linear)")
    return args


# ---------------------------------------------------------------------------------------------------
# Candidates (kept small: every distinct tile is one Triton compile)
# ---------------------------------------------------------------------------------------------------


def block_m_candidates(M: int, E: int, topk: int) -> list[int]:
    from moe_extension.kernels._configs import expected_hit_experts

    P = M * topk
    rows = P / max(expected_hit_experts(P, E), 1.0)
    ladder = [16, 32, 64, 128]
    best = min(ladder, key=lambda b: abs(math.log2(b) - math.log2(max(rows, 1.0))))
    i = ladder.index(best)
    if rows <= 24:
        return [16]
    # NOTE: the block nearest the expected rows per expert, the one below (less padding waste) and the one above
    # (an expert that spills into a second, small block runs twice the weight tiles; with MXFP4 it decodes them
    # twice). H100, the block above won: gpt-oss-120b mxfp4_mma M = 1024 block_m 64 against 32, tuner totals
    # 1160.4 -> 1084.1 us, gpt-oss-20b M = 256 311.7 -> 286.2 us (``python benchmarks/tune_fused_experts.py --quant
    # mxfp4_mma --tokens 256 1024``); bf16, qwen3-next-80b-a3b-tp2 M = 2048 (40 rows per expert) block_m 64 against
    # 32, 664.6 against 691.5 us (``--models qwen3-next-80b-a3b-tp2 --tokens 2048``).
    return sorted({ladder[max(0, i - 1)], best, ladder[min(len(ladder) - 1, i + 1)]})


def gemm1_candidates(block_m: int):
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:  # weight streaming: deep pipelines, 2-4 programs per SM
        return [G(64, 64, 4, 4), G(64, 128, 4, 3), G(32, 128, 4, 4), G(128, 64, 4, 4), G(64, 64, 4, 6)]
    if block_m == 64:
        return [G(64, 64, 4, 4), G(128, 64, 4, 3), G(64, 128, 4, 3), G(64, 64, 4, 5)]
    # NOTE: prefill tiles (block_m 128): on H100 128x64 w8 s4 won every large cell of the first tuning
    # run (gemm1 3621 us at mixtral M = 4096); the variants around it try deeper pipelines and L2 groups.
    return [G(64, 64, 8, 4), G(128, 64, 8, 3), G(64, 128, 8, 3), G(128, 64, 8, 4), G(128, 32, 8, 6),
            G(128, 64, 8, 4, group_m=16), G(128, 64, 8, 4, group_m=4)]


def gemm2_candidates(block_m: int, small: bool):
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:
        base = [G(64, 128, 4, 4), G(64, 64, 4, 4), G(32, 128, 4, 4), G(128, 64, 4, 4)]
        if small:  # few row blocks: split the reduction so the tiles fill the GPU
            base += [dataclasses.replace(base[0], split_k=2), dataclasses.replace(base[2], split_k=4)]
        return base
    if block_m == 64:
        return [G(128, 64, 4, 4), G(256, 64, 4, 3), G(64, 64, 4, 5), G(128, 128, 4, 3)]
    return [G(128, 64, 8, 4), G(256, 64, 8, 3), G(128, 128, 8, 3), G(256, 64, 8, 4), G(128, 64, 8, 5),
            G(128, 64, 8, 4, group_m=16)]


def mxfp4_gemm1_candidates(block_m: int):
    """gemm1 tiles for MXFP4 weights, block_k 64 or 128 (a step loads block_k / 2 bytes per weight row).
    NOTE: the tiles that measured best on an H100 for gpt-oss-120b (gemm1 / gemm2 alone), each list led by
    the heuristic's MXFP4 tile (the NOTE in ``_configs.heuristic_config``)."""
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:
        return [G(64, 64, 2, 4), G(64, 64, 4, 4), G(32, 64, 4, 4), G(64, 128, 4, 3)]
    if block_m == 64:
        return [G(64, 64, 4, 4), G(128, 64, 4, 3), G(64, 64, 8, 4), G(128, 64, 8, 3)]
    return [G(128, 64, 8, 3), G(64, 64, 8, 4), G(128, 64, 4, 3), G(64, 64, 4, 4)]


def mxfp4_gemm2_candidates(block_m: int, small: bool):
    """gemm2 (+ slot sum) tiles for MXFP4 weights; ``small`` (few row blocks) adds split reductions."""
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:
        base = [G(128, 64, 4, 4), G(128, 128, 4, 3), G(64, 128, 4, 3), G(128, 64, 2, 4)]
        if small:
            base += [dataclasses.replace(base[0], split_k=2), dataclasses.replace(base[0], split_k=4)]
        return base
    if block_m == 64:
        return [G(128, 64, 4, 4), G(256, 64, 8, 3), G(128, 128, 4, 3), G(128, 64, 8, 4)]
    return [G(256, 64, 8, 3), G(128, 64, 8, 4), G(128, 64, 4, 4), G(256, 64, 4, 3)]


def mxfp4_mma_gemm1_candidates(block_m: int):
    """gemm1 tiles for MXFP4 in the MMA layout (128-column steps; 2 x block_n weight rows, at least 128, as the MMA's
    M: ``mxfp4_mma_tiles``), each list led by the heuristic's 128 rows on 4 warps; at blocks of 64 also that tile
    capped at three programs' registers per SM (``MXFP4_MMA_GEMM1_REGISTERS``, the heuristic's for large layers).
    256 rows on 4 warps at block_m >= 64 is left out: it ran 9-10x slower on the H100 (gpt-oss-120b, M 4096: 4366
    against 476 us on 8 warps)."""
    from moe_extension.kernels._configs import MXFP4_MMA_GEMM1_REGISTERS
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:
        return [G(64, 128, 4, 4), G(128, 128, 8, 4), G(64, 128, 4, 6), G(128, 128, 4, 4), G(128, 128, 8, 6)]
    capped = [G(64, 128, 4, 3, max_registers=MXFP4_MMA_GEMM1_REGISTERS)] if block_m == 64 else []
    return [G(64, 128, 4, 3), *capped, G(128, 128, 8, 3), G(64, 128, 4, 4), G(128, 128, 8, 4)]


def mxfp4_mma_gemm2_candidates(block_m: int, small: bool):
    """gemm2 (+ slot sum) tiles for MXFP4 in the MMA layout (block_n weight rows, at least 128, as the MMA's M), led
    by the heuristic's; ``small`` (few row blocks) adds split reductions."""
    from moe_extension.kernels._configs import GemmConfig as G

    if block_m <= 32:
        base = [G(128, 128, 4, 4), G(256, 128, 8, 4), G(256, 128, 4, 4), G(128, 128, 4, 6)]
        if small:
            base += [dataclasses.replace(base[0], split_k=s) for s in (2, 4, 8)]
        return base
    return [G(128, 128, 4, 3), G(256, 128, 8, 3), G(128, 128, 4, 4), G(256, 128, 8, 4)]


def fp8_gemm1_candidates(block_m: int):
    """gemm1 tiles for fp8 block weights: 128 x (2 x 128) weight rows per 128-column step (the heuristic's tile
    first), deeper pipelines and L2 super-groups."""
    from moe_extension.kernels._configs import GemmConfig as G

    warps = 8 if block_m >= 64 else 4
    return [G(128, 128, warps, 3, group_m=0), G(128, 128, warps, 4, group_m=0), G(128, 128, warps, 3, group_m=8),
            G(128, 128, 4 if warps == 8 else 8, 3, group_m=0)]


def fp8_gemm2_candidates(block_m: int, small: bool):
    """gemm2 (+ slot sum) tiles for fp8 block weights; ``small`` (few row blocks) adds split reductions."""
    from moe_extension.kernels._configs import GemmConfig as G

    base = [G(128, 128, 4, 4), G(128, 128, 4, 3), G(256, 128, 8, 3), G(128, 128, 8, 3)]
    if small:
        base += [dataclasses.replace(base[0], split_k=2), dataclasses.replace(base[0], split_k=4)]
    return base


def with_tma(candidates, weights_only: bool = False, quant: str = "none"):
    """Each candidate with pointer loads and with TMA loads of the weight tiles and the A rows (gemm2: its
    sorted rows; gemm1: the token rows copied into sorted order, the copy timed with it); with
    ``weights_only`` (gemm1) also with TMA loads of the weight tiles alone.

    MXFP4 (``quant="mxfp4"`` / ``"mxfp4_mma"``): its weight tiles are always pointer loads (packed bytes and
    scales, decoded in registers), so each candidate gets only the variant with TMA loads of its A rows.
    NOTE: for gemm1 that pays on some shapes and not on others; H100, mxfp4_mma, gemm1 alone (the copy included)
    without -> with TMA rows, from ``python benchmarks/tune_fused_experts.py --quant mxfp4_mma --tokens 1024 4096``:
    gpt-oss-20b 128x128 w8 s3 M = 4096 1365.3 -> 1225.3 us, M = 1024 468.8 -> 409.5; gpt-oss-120b M = 1024 block_m
    16 64x128 w4 1030.2 -> 1033.8, block_m 64 128x128 w8 754.7 -> 765.7: a per-shape choice of the table."""
    if quant in ("mxfp4", "mxfp4_mma"):
        return [g for c in candidates for g in (c, dataclasses.replace(c, tma_a=True))]
    if quant == "fp8_block":  # every combination: TMA weights and TMA rows each pay on some shapes
        return [dataclasses.replace(c, tma_weights=w, tma_a=a) for c in candidates for w in (True, False)
                for a in (False, True)]
    loads = [(True, True)] + ([(True, False)] if weights_only else [])
    return [g for c in candidates for g in [c] + [dataclasses.replace(c, tma_weights=w, tma_a=a) for w, a in loads]]


def sorted_candidates(block_m: int, small: bool, dtype, N: int, K: int, quant: str = "none"):
    """(gemm1 tiles, gemm2 tiles) that the sorted path times at ``block_m``, sanitized for (dtype, N, K,
    quant); ``small``: few row blocks (gemm2 adds split reductions). MXFP4 drops the tiles that sanitize
    into an earlier one."""
    from moe_extension.kernels._configs import MoeConfig, sanitize

    if quant == "none":
        g1s = with_tma(gemm1_candidates(block_m), weights_only=True)
        g2s = with_tma(gemm2_candidates(block_m, small))
    elif quant == "fp8_block":
        g1s = with_tma(fp8_gemm1_candidates(block_m), quant=quant)
        g2s = with_tma(fp8_gemm2_candidates(block_m, small), quant=quant)
    elif quant == "mxfp4_mma":
        g1s = with_tma(mxfp4_mma_gemm1_candidates(block_m), weights_only=True, quant=quant)
        g2s = with_tma(mxfp4_mma_gemm2_candidates(block_m, small), quant=quant)
    else:
        g1s = with_tma(mxfp4_gemm1_candidates(block_m), weights_only=True, quant=quant)
        g2s = with_tma(mxfp4_gemm2_candidates(block_m, small), quant=quant)
    g1s = [sanitize(MoeConfig("sorted", block_m, g, g), dtype, N, K, 1, quant).gemm1 for g in g1s]
    g2s = [sanitize(MoeConfig("sorted", block_m, g, g), dtype, N, K, 1, quant).gemm2 for g in g2s]
    if quant != "none":
        g1s, g2s = list(dict.fromkeys(g1s)), list(dict.fromkeys(g2s))
    return g1s, g2s


def tail_variants(g, block_m: int):
    """The tile ``g`` with each tail tile height (16, 32, 64 rows; at most block_m / 2)."""
    if g is None:
        return []
    return [dataclasses.replace(g, tail_m=t) for t in (16, 32, 64) if t <= block_m // 2]


def fastest(time_fn, candidates, block_m: int):
    """(µs, tile) of the fastest candidate, then of the winner's tail variants, then of the winner in
    expert-major tile order (group_m 0); (inf, None) if all fail."""
    best = min(((time_fn(g), g) for g in candidates), key=lambda x: x[0], default=(math.inf, None))
    if best[1] is None:
        return best
    best = min([best] + [(time_fn(g), g) for g in tail_variants(best[1], block_m)], key=lambda x: x[0])
    expert_major = dataclasses.replace(best[1], group_m=0)
    return min(best, (time_fn(expert_major), expert_major), key=lambda x: x[0])


def tile_name(g) -> str:
    return (f"{g.block_n:3d}x{g.block_k:3d} w{g.num_warps} s{g.num_stages} g{g.group_m} split{g.split_k}"
            f"{' tma' if g.tma_weights else ''}{' tmaA' if g.tma_a else ''}{f' tail{g.tail_m}' if g.tail_m else ''}"
            f"{' persistent' if g.persistent else ''}{f' rows{g.tile_m}' if g.tile_m else ''}"
            f"{f' regs{g.max_registers}' if g.max_registers else ''}")


def direct_candidates(heuristic, quant: str = "none"):
    """GEMV tiles around the heuristic's: the same bytes per step reshaped, deeper pipelines, more warps. The
    tensor-core GEMVs (MXFP4 in the MMA layout, fp8 block; 128-column steps): the split of each reduction halved and
    doubled, one more stage, and 256 weight rows on 8 warps (gemm1's gated tiles: 128 columns of gate and up)."""
    from moe_extension.kernels._configs import DOT_GEMV_QUANTS

    if quant in DOT_GEMV_QUANTS:
        out = []
        for which, g in enumerate((heuristic.gemm1, heuristic.gemm2)):
            cands = [g, dataclasses.replace(g, split_k=max(1, g.split_k // 2)),
                     dataclasses.replace(g, split_k=2 * g.split_k), dataclasses.replace(g, num_stages=4),
                     dataclasses.replace(g, block_n=128 if which == 0 else 256, num_warps=8)]
            out.append(list(dict.fromkeys(cands)))  # an unsplit reduction has no half split
        return out
    out = []
    for g in (heuristic.gemm1, heuristic.gemm2):
        wide = dataclasses.replace(g, block_n=g.block_n * 2, block_k=max(16, g.block_k // 2))
        deep = dataclasses.replace(g, block_n=max(1, g.block_n // 2), block_k=g.block_k * 2)
        out.append([g, wide, deep, dataclasses.replace(g, num_stages=6), dataclasses.replace(g, num_warps=8)])
    return out


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def time_us(fn, n_sets: int) -> float:
    """Median µs per call of fn(i) (i rotates over the input sets), by CUDA-graph replay of ~25 ms of calls
    (``harness.time_graph_budget_us``); inf on failure."""
    from harness import time_graph_budget_us

    try:
        return time_graph_budget_us(fn, n_sets)
    except Exception as exc:  # a config that fails to compile or launch is skipped, not fatal
        print(f"      skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        return math.inf


def make_weights(E, K, N, dtype, layout):
    """w1 [E, 2N, K], w2 [E, K, N]: contiguous ('linear') or transposed views of [E, in, out] storage."""
    def stack(rows, cols):
        shape = (E, rows, cols) if layout == "linear" else (E, cols, rows)
        w = torch.randn(shape, dtype=dtype, device=DEVICE).mul_(1.0 / math.sqrt(cols))
        return w if layout == "linear" else w.transpose(1, 2)

    return stack(2 * N, K), stack(K, N)


def make_mxfp4_weights(E, K, N, layout, quant="mxfp4"):
    """(w1, w2) as ``WeightOperand(packed, scales, quant)`` of random normal / sqrt(cols) weights quantized
    on the GPU (``quantize_mxfp4``, MXFP4_QUANTIZE_CHUNK experts at a time): w1 packed ``[E, 2N, K/2]`` +
    scales ``[E, 2N, K/32]``, w2 ``[E, K, N/2]`` + ``[E, K, N/32]``; contiguous ('linear') or transposed views
    of ``[E, K/2, 2N]`` / ``[E, K/32, 2N]`` (w2: ``[E, N/2, K]`` / ``[E, N/32, K]``) storage ('transposed').
    ``quant="mxfp4_mma"``: the same stacks prepared into the MMA layout (``prepare_mxfp4_mma``; linear only)."""
    import harness
    from moe_extension.kernels._weight_formats import WeightOperand
    from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma

    def as_layout(t):
        return t if layout == "linear" else t.transpose(1, 2).contiguous().transpose(1, 2)

    def stack(rows, cols):
        packed, scales, _ = harness.random_mxfp4_stack(E, rows, cols, DEVICE, MXFP4_QUANTIZE_CHUNK)
        if quant == "mxfp4_mma":
            return WeightOperand(*prepare_mxfp4_mma(packed, scales), quant)
        return WeightOperand(as_layout(packed), as_layout(scales), "mxfp4")

    w1, w2 = stack(2 * N, K), stack(K, N)
    torch.cuda.empty_cache()
    return w1, w2


def make_fp8_weights(E, K, N, layout):
    """(w1, w2) as ``WeightOperand(q, scales, "fp8_block")`` of ``harness.random_fp8_block_stack`` stacks
    (``[E, 2N, K]`` / ``[E, K, N]``, fp32 scales per 128 x 128 block); contiguous ('linear') or transposed views
    of ``[E, cols, rows]`` storage, scales alike."""
    import harness
    from moe_extension.kernels._weight_formats import WeightOperand

    def stack(rows, cols):
        q, s = harness.random_fp8_block_stack(E, rows, cols, DEVICE)
        if layout != "linear":
            q, s = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, s))
        return WeightOperand(q, s, "fp8_block")

    return stack(2 * N, K), stack(K, N)


def weight_quant(w) -> str:
    """The ``quant`` of a weight stack as the launchers take it: a tensor (dense) or a ``WeightOperand``."""
    from moe_extension.kernels._weight_formats import WEIGHT_FORMATS, WeightOperand

    if not isinstance(w, WeightOperand):
        return "none"
    return next(q for q, code in WEIGHT_FORMATS.items() if code == w.fmt)


def fused_call_args(w1, w2):
    """(w1, w2, keyword arguments) of ``fused_experts_triton`` for the stacks ``w1``, ``w2``: the tensors and
    nothing for dense weights; the packed data and ``quant``, ``w1_scale``, ``w2_scale`` for WeightOperands."""
    quant = weight_quant(w1)
    if quant == "none":
        return w1, w2, {}
    return w1.w, w2.w, dict(quant=quant, w1_scale=w1.scale, w2_scale=w2.scale)


def add_cell_arguments(p) -> None:
    """``--model`` and ``--tokens``: one benchmark cell (the A/B and profiling scripts' options)."""
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="a benchmark model")
    p.add_argument("--tokens", type=int, required=True, help="M")


def make_sets(E, topk, K, M, dtype, n_sets):
    """Rotated (x, topk_weights, topk_ids) sets with random routing."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(M, K, dtype=dtype, device=DEVICE)
        scores = torch.rand(M, E, device=DEVICE)
        g, ids = scores.topk(topk, dim=1)
        sets.append((x, (g / g.sum(1, keepdim=True)).float().contiguous(), ids.to(torch.int32).contiguous()))
    return sets


# ---------------------------------------------------------------------------------------------------
# Tuning one (model, M) cell
# ---------------------------------------------------------------------------------------------------


def tune_sorted(w1, w2, sets, E, topk, K, N, M, act):
    """w1, w2: tensors, or ``WeightOperand``s (MXFP4); (µs, MoeConfig) of the best sorted config or None."""
    import moe_extension.kernels.fused_experts as fe
    from moe_extension.kernels._configs import MoeConfig, persistent_gemm2_tile, sanitize
    from moe_extension.kernels._routing import route

    from moe_extension.kernels._configs import fp8_max_block_m
    from moe_extension.kernels._quantize_fp8 import quantize_fp8_rows

    quant = weight_quant(w1)
    fp8 = quant == "fp8_block"
    dtype, device = sets[0][0].dtype, sets[0][0].device
    n = len(sets)
    best = None
    bms = block_m_candidates(M, E, topk)
    if fp8:
        bms = sorted({min(bm, fp8_max_block_m(N)) for bm in bms})
    # fp8 block: x quantized up front (as the fused path does unless gemm1 gathers its rows), the
    # intermediate stored quantized (e4m3 rows + scales per 128 columns)
    xq = [quantize_fp8_rows(x) if fp8 else (x, None) for x, _, _ in sets]
    for bm in bms:
        routings = [route(ids, E, bm) for _, _, ids in sets]
        t_route = time_us(lambda i: route(sets[i % n][2], E, bm), n)
        a_ws = [torch.randn(r.max_blocks * bm, N, dtype=dtype, device=device) for r in routings]
        a_scales = [None] * n
        if fp8:
            a_ws = [a.to(torch.float8_e4m3fn) for a in a_ws]
            a_scales = [torch.full((a.shape[0], math.ceil(N / 128)), 1e-2, device=device) for a in a_ws]

        def time_g1(g1):
            def run1(i):
                j = i % n
                x, x_scale = (sets[j][0], None) if fp8 and fe.gathers_rows(sets[j][0], g1, quantize=True) else xq[j]
                fe._gemm1_sorted(x, w1, None, a_ws[j], True, routings[j], topk, act, None, 1.702, 7.0, g1,
                                 x_scale=x_scale, out_scale=a_scales[j])

            t = time_us(run1, n)
            print(f"    bm {bm:3d} gemm1 {tile_name(g1)}: {t:9.1f} us")
            return t

        def time_g2(g2):
            # the persistent gemm2 takes 16-bit weights only: never with MXFP4 (a WeightOperand)
            persistent = quant == "none" and fe._persistent_gemm2_ok(a_ws[0], w2, g2)
            splits = fe.effective_splits(N, g2)
            shape = (a_ws[0].shape[0], K) if persistent else (splits, M, topk, K)
            ys = [torch.empty(shape, dtype=dtype if splits == 1 else torch.float32, device=device)
                  for _ in range(n)]
            outs = [torch.empty(M, K, dtype=dtype, device=device) for _ in range(n)]

            def run2(i):
                j = i % n
                if persistent:
                    fe._gemm2_persistent(a_ws[j], w2, None, ys[j], routings[j], topk, sets[j][1], g2)
                else:
                    fe._gemm2_sorted(a_ws[j], True, w2, None, ys[j], routings[j], topk, sets[j][1], g2,
                                     a_scale=a_scales[j])
                fe._sum_slots(ys[j], routings[j].inverse, outs[j], topk)

            t = time_us(run2, n)
            print(f"    bm {bm:3d} gemm2 {tile_name(g2)}: {t:9.1f} us")
            return t

        few_blocks = (M * topk / bm + min(M * topk, E)) * math.ceil(K / 64) < 4 * 132
        g1s, g2s = sorted_candidates(bm, few_blocks, dtype, N, K, quant)
        g1_best = fastest(time_g1, g1s, bm)
        if quant == "none" and g1_best[1] is not None and g1_best[1].tma_weights:
            # the winner as a persistent kernel (no tail tiles; TMA weight tiles: fused_experts._persistent_gemm1_ok)
            g = sanitize(MoeConfig("sorted", bm, dataclasses.replace(g1_best[1], persistent=True), g1_best[1]),
                         dtype, N, K).gemm1
            g1_best = min(g1_best, (time_g1(g), g), key=lambda x: x[0])
        g2_best = fastest(time_g2, g2s, bm)
        if quant == "none" and g2_best[1] is not None and g2_best[1].tma_a:
            # the winner as a persistent kernel (its stages refit to hold the output tile), and the persistent tile of
            # the heuristic (256 output columns on 8 warps, weights by TMA: _configs.persistent_gemm2_tile), which the
            # winner's own width and warps can miss (benchmarks/results/ab_gemm2_persistent_short_h200.txt)
            tiles = (dataclasses.replace(g2_best[1], persistent=True), persistent_gemm2_tile(g2_best[1]))
            for g in dict.fromkeys(sanitize(MoeConfig("sorted", bm, t, t), dtype, N, K).gemm2 for t in tiles):
                g2_best = min(g2_best, (time_g2(g), g), key=lambda x: x[0])
        if bm >= 128 and quant in ("none", "fp8_block") and g2_best[1] is not None and not g2_best[1].persistent:
            # the winner in row tiles of half the block on 4 warps (tile_m: two programs per block)
            g = dataclasses.replace(g2_best[1], tile_m=bm // 2, num_warps=4)
            g = sanitize(MoeConfig("sorted", bm, g, g), dtype, N, K, 1, quant).gemm2
            g2_best = min(g2_best, (time_g2(g), g), key=lambda x: x[0])
        total = t_route + g1_best[0] + g2_best[0]
        print(f"    bm {bm:3d}: route {t_route:.1f} + gemm1 {g1_best[0]:.1f} + gemm2/sum {g2_best[0]:.1f} "
              f"= {total:.1f} us")
        if g1_best[1] is not None and g2_best[1] is not None and (best is None or total < best[0]):
            best = (total, MoeConfig("sorted", bm, g1_best[1], g2_best[1]))
    return best


def tune_direct(w1, w2, sets, E, topk, K, N, M, act, w1_row, w2_row):
    """w1, w2: tensors, or ``WeightOperand``s (MXFP4); (µs, MoeConfig) of the best direct config or None."""
    import moe_extension.kernels.fused_experts as fe
    from moe_extension.kernels._configs import MoeConfig, heuristic_config, sanitize

    quant = weight_quant(w1)
    dtype, device = sets[0][0].dtype, sets[0][0].device
    n = len(sets)
    a_ws = [torch.randn(M, topk, N, dtype=dtype, device=device) for _ in range(n)]
    a_scales = [None] * n
    if quant == "fp8_block":  # the intermediate as the fused path holds it: e4m3 rows and their scales
        from moe_extension.kernels._quantize_fp8 import quantize_fp8_rows

        quantized = [quantize_fp8_rows(a.view(M * topk, N)) for a in a_ws]
        a_ws, a_scales = [q.view(M, topk, N) for q, _ in quantized], [s for _, s in quantized]
    outs = [torch.empty(M, K, dtype=dtype, device=device) for _ in range(n)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 132
    g1c, g2c = direct_candidates(heuristic_config(M, E, N, K, topk, dtype, w1_row, w2_row, sms, quant), quant)
    best1, best2 = (math.inf, None), (math.inf, None)
    for g1 in g1c:
        g1 = sanitize(MoeConfig("direct", 0, g1, g1), dtype, N, K, topk, quant).gemm1
        t = time_us(lambda i: fe._gemv1(sets[i % n][0], w1, None, a_ws[i % n].view(M * topk, N), sets[i % n][2],
                                        None, act, None, 1.702, 7.0, g1, out_scale=a_scales[i % n]), n)
        print(f"    direct gemv1 {g1.block_n:3d}x{g1.block_k:3d} w{g1.num_warps} s{g1.num_stages} split{g1.split_k}: "
              f"{t:9.1f} us")
        best1 = min(best1, (t, g1), key=lambda x: x[0])
    for g2 in g2c:
        g2 = sanitize(MoeConfig("direct", 0, g2, g2), dtype, N, K, topk, quant).gemm2
        t = time_us(lambda i: fe._gemv2(a_ws[i % n], w2, None, outs[i % n], sets[i % n][2], None, sets[i % n][1],
                                        True, g2, a_scale=a_scales[i % n]), n)
        print(f"    direct gemv2 {g2.block_n:3d}x{g2.block_k:3d} w{g2.num_warps} s{g2.num_stages} split{g2.split_k}: "
              f"{t:9.1f} us")
        best2 = min(best2, (t, g2), key=lambda x: x[0])
    if best1[1] is None or best2[1] is None:
        return None
    return best1[0] + best2[0], MoeConfig("direct", 0, best1[1], best2[1])


def tune_cell(w1, w2, sets, E, topk, K, N, M, act, w1_row, w2_row):
    """(µs, MoeConfig) of the fastest config of one (shape, M) cell, end to end; w1, w2: tensors, or
    ``WeightOperand``s (MXFP4: timed and checked through ``fused_experts_triton(..., quant="mxfp4")``)."""
    from moe_extension.kernels import fused_experts_triton
    from moe_extension.kernels._configs import heuristic_config, sanitize, use_direct

    quant = weight_quant(w1)
    dtype, device = sets[0][0].dtype, sets[0][0].device
    n = len(sets)
    finalists = []
    if use_direct(M, E, topk, quant) or M <= 4:
        d = tune_direct(w1, w2, sets, E, topk, K, N, M, act, w1_row, w2_row)
        if d:
            finalists.append(d[1])
    s = tune_sorted(w1, w2, sets, E, topk, K, N, M, act)
    if s:
        finalists.append(s[1])
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 132
    heur = sanitize(heuristic_config(M, E, N, K, topk, dtype, w1_row, w2_row, sms, quant), dtype, N, K, topk, quant)
    x, g, ids = sets[0]
    w1, w2, qkw = fused_call_args(w1, w2)
    ref = fused_experts_triton(x, w1, w2, g, ids, ACTIVATION, config=heur, **qkw).double()
    best = (math.inf, heur)
    for cfg in finalists + [heur]:
        out = fused_experts_triton(x, w1, w2, g, ids, ACTIVATION, config=cfg, **qkw).double()
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-30)) if out.isfinite().all() else math.inf
        if err > 1e-2:
            print(f"    REJECTED (rel err {err:.2e} vs heuristic): {cfg}")
            continue
        t = time_us(lambda i, cfg=cfg: fused_experts_triton(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2],
                                                            ACTIVATION, config=cfg, **qkw), n)
        tag = "heuristic" if cfg is heur else cfg.path
        print(f"    end-to-end {tag:9s}: {t:9.1f} us")
        if t < best[0]:
            best = (t, cfg)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_fused_experts: needs a CUDA device", file=sys.stderr)
        return 1
    from moe_extension.kernels._configs import CONFIG_DIR, device_slug, table_key
    from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES

    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name(0)
    shapes = [(name, MODELS[name]) for name in args.models]
    shapes += [(f"E{e}_topk{k}_K{kk}_N{n}", dict(E=e, topk=k, K=kk, N=n)) for e, k, kk, n in args.shape]
    out_dir = Path(args.out) if args.out else CONFIG_DIR
    out_path = out_dir / f"{device_slug(device_name)}.json"
    installed = CONFIG_DIR / f"{device_slug(device_name)}.json"
    base = out_path if out_path.exists() else installed
    table = json.loads(base.read_text()) if base.exists() else {}
    table.update(device=device_name, triton=__import__("triton").__version__, torch=torch.__version__)
    configs = table.setdefault("configs", {})
    act = ACTIVATION_CODES[ACTIVATION]
    linear = args.weight_layout == "linear"
    summary = []
    torch.manual_seed(0)
    for name, s in shapes:
        E, topk, K, N = s["E"], s["topk"], s["K"], s["N"]
        key = table_key(E, N, K, topk, dtype, linear, linear, args.quant)
        print(f"== {name} ({key})")
        entry = configs.setdefault(key, {})
        if args.quant in ("mxfp4", "mxfp4_mma"):
            w1, w2 = make_mxfp4_weights(E, K, N, args.weight_layout, args.quant)
        elif args.quant == "fp8_block":
            w1, w2 = make_fp8_weights(E, K, N, args.weight_layout)
        else:
            w1, w2 = make_weights(E, K, N, dtype, args.weight_layout)
        for M in args.tokens:
            sets = make_sets(E, topk, K, M, dtype, args.sets)
            print(f"  M={M} ({time.time() - t0:.0f} s)")
            t, cfg = tune_cell(w1, w2, sets, E, topk, K, N, M, act, linear, linear)
            entry[str(M)] = cfg.to_json()
            summary.append((name, M, t, cfg))
            # Written after every cell, so a run stopped by a time limit keeps what it tuned.
            out_dir.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        del w1, w2
        torch.cuda.empty_cache()
    print(f"\n{'model':16s} {'M':>5s} {'us':>9s}  config")
    for name, M, t, cfg in summary:
        g1, g2 = cfg.gemm1, cfg.gemm2
        print(f"{name:16s} {M:5d} {t:9.1f}  {cfg.path:6s} bm{cfg.block_m:<3d} "
              f"g1 {tile_name(g1)}  g2 {tile_name(g2)}")
    print(f"wrote {out_path} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
