"""Kernel configurations of the routed-expert kernels: a heuristic per (E, N, K, topk, dtype, weight
layouts, M bucket) and tuned tables loaded from ``moe_extension/configs/<device>.json``.

A ``MoeConfig`` picks the schedule of one ``fused_experts`` call:
- ``path="direct"``: no routing; per-pair GEMV for the first GEMM, per-token GEMV that sums the slots for
  the second (2 launches; the tensor-core GEMVs, whose split reductions count arrivals, after one that zeroes the
  counters). For tiny batches, where every program streams weights.
- ``path="sorted"``: routing into ``block_m``-row expert blocks, grouped GEMMs on tensor cores, then the
  deterministic slot sum (4 launches; 6 when the routing takes three; one more when gemm1 copies its
  token rows into sorted order, ``tma_a``).

``gemm1`` / ``gemm2`` hold the tile of each GEMM: ``block_n`` output columns (of the activation output for
gemm1, of K for gemm2), ``block_k`` reduction step, ``group_m`` (sorted: row blocks per L2 super-group;
0: expert-major order), ``split_k`` (sorted gemm2: splits of the reduction dim summed by the slot-sum
kernel), ``num_warps``, ``num_stages``, ``tma_weights`` (sorted: weight tiles loaded by TMA where the layout
allows), ``tail_m`` (sorted: partial blocks with at most tail_m valid rows run tail_m-row tiles), ``tma_a``
(sorted, fused path: gemm2's sorted intermediate rows, and gemm1's token rows copied into sorted order,
loaded by TMA), ``persistent`` (sorted, fused path: gemm2 as a persistent kernel, one program per SM), ``tile_m``
(sorted gemm2: rows per program), ``dot`` (direct path, 16-bit dense weights: the tensor-core GEMV of ``_gemv_dot``
instead of the FMA one; the heuristic's choice on an expert-parallel shard).

Table file (written by ``benchmarks/tune_fused_experts.py``)::

    {"device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "torch": "...",
     "configs": {"E=128,N=2880,K=2880,topk=4,dtype=bfloat16,w1=row,w2=row":
                    {"1": {"path": "direct", "block_m": 0, "gemm1": {...}, "gemm2": {...}}, "16": {...}}}}

For a call with M tokens the entry of the nearest tuned M (in log2 distance) is used; keys not in the
table fall back to the heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# NOTE: Triton reserves some shared memory for layout conversions; staying under 200 KB of pipelined
# tiles keeps every config below the H100's 227 KB per-block limit (a compile error otherwise).
SMEM_BUDGET = 200 * 1024
# NOTE: the persistent gemm2 also holds its [block_m, block_n] output tile in shared memory for the TMA
# store: 3 stages of 128 x (128 + 256) x 64 bf16 plus the 128 x 256 tile compiled to 213,528 B on the H100.
PERSISTENT_SMEM_BUDGET = 216 * 1024
# NOTE: the persistent gemm1 holds its [block_m, block_n] output tile (after the activation) in shared memory too:
# 4 stages of 128 x (128 + 256) x 64 bf16 plus the 128 x 128 tile compiled to 229,408 B (``python
# benchmarks/compile_report.py --device "NVIDIA H200" --model deepseek-v2-lite --tokens 2048``, Triton 3.6), 32 B
# over this count: the budget keeps that config, 2 KB under the 227 KB per-block limit.
PERSISTENT_GEMM1_SMEM_BUDGET = 225 * 1024
# NOTE: fp8 block adds each 128-column block's product to the accumulator after scaling it, so a tile holds two
# fp32 [block_m, weight rows] tiles in registers, and a weight scale per column unless its rows share a scale
# block (``fp8_part_scales``). Triton 3.6 for sm_90 (gemm1_sorted_kernel compiled with triton.compile for
# GPUTarget("cuda", 90, 32), then ptxas -v; E4M3 wgmma, silu, 8 warps, 3 stages): 64 x (2 x 128) 220 registers
# with one scale per 128-row part (255 with one per row); 128 x (2 x 128) 255 registers, its 136 B of spills
# outside the k loop; with scales per row (the up rows when N is not a multiple of 128) 1180 B of spills. So
# 128-row blocks only where N is a multiple of 128.
FP8_MAX_BLOCK_M = 128


def fp8_max_block_m(N: int) -> int:
    """Rows per block of fp8 block tiles for intermediate size N (see FP8_MAX_BLOCK_M)."""
    return FP8_MAX_BLOCK_M if N % 128 == 0 else 64


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # Sorted path: row blocks that walk the N tiles together (an L2 super-group); 0 = expert-major order
    # (each expert's blocks walk its N tiles together: every weight tile is read from DRAM once).
    group_m: int = 8
    split_k: int = 1
    # Sorted path: weight tiles through a TMA descriptor (Hopper and newer, 16-bit weights whose last dim
    # is contiguous and whose strides are 16-byte multiples; otherwise the pointer loads are used).
    tma_weights: bool = False
    # Sorted path: a block with at most tail_m valid rows (an expert's last, partial block) runs a
    # tail_m-row tile in the same launch (0: every block runs block_m rows).
    tail_m: int = 0
    # Sorted path, fused: the A operand loaded by TMA where the device and layout allow. gemm2's A is the
    # expert-sorted intermediate (contiguous rows per block); gemm1's token rows are first copied into
    # sorted order (one extra pass over P rows of x, for TMA instead of gathered pointer loads).
    # NOTE: H100, gemm1 with the copy: mixtral M = 4096 3114 -> 2889 us + 40 us of copy (a win); qwen3
    # M = 4096 451 -> 433 us + 62 us of copy (a loss): a per-shape choice of the table.
    tma_a: bool = False
    # Sorted path, fused: one program per SM walks the tiles. gemm2 (``_gemm2_persistent``): A rows and
    # output rows by ragged TMA bounded to each expert (padding rows neither read nor written), the output in
    # sorted order for the slot sum; tail_m and split_k do not apply. Needs sm_90+, 16-bit activations and
    # TMA-capable layouts, else the non-persistent kernel runs. gemm1 (``gemm1_sorted_kernel`` PERSISTENT):
    # 16-bit weights whose tiles come by TMA (else the tiled launch runs), no tail tiles (sanitize sets tail_m 0),
    # and no per-tile signal to gemm2 (which then waits for gemm1's completion).
    persistent: bool = False
    # Sorted path, gemm2 only: rows per program (0 = block_m), a power of two below block_m: each block runs as
    # block_m / tile_m programs (super-grouped order, group_m >= 1), so that a short reduction (few steps per tile)
    # has smaller tiles, on fewer warps, several to an SM, whose loads overlap each other's epilogues.
    tile_m: int = 0
    # Direct path, 16-bit dense weights: this GEMM's GEMV on tensor cores (``_gemv_dot``; the heuristic's choice on
    # an expert-parallel shard, ``shard_dot_gemvs``) instead of the FMA GEMV of ``_grouped_gemm``. The formats of
    # DOT_GEMV_QUANTS always run the tensor-core GEMVs and leave it False (``sanitize`` clears it but for 16-bit
    # dense weights on the direct path).
    dot: bool = False
    # Sorted path: registers per thread that ptxas may use (0: its own choice). A cap lets one more program share
    # an SM where registers, not shared memory, bound the programs per SM (more warps to hide each other's decode,
    # MMA and load latencies), at the price of spills where the tile needs more.
    max_registers: int = 0


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    path: str  # "direct" | "sorted"
    block_m: int  # rows per expert block (sorted path); 0 for the direct path
    gemm1: GemmConfig
    gemm2: GemmConfig

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> "MoeConfig":
        return MoeConfig(
            path=d["path"], block_m=int(d.get("block_m", 0)),
            gemm1=GemmConfig(**d["gemm1"]), gemm2=GemmConfig(**d["gemm2"]),
        )


def is_row_major(w: torch.Tensor) -> bool:
    """True when the last (reduction) dim of an [E, out, in] weight is contiguous (nn.Linear layout)."""
    return w.stride(2) == 1


def table_key(E: int, N: int, K: int, topk: int, dtype: torch.dtype, w1_row: bool, w2_row: bool,
              quant: str = "none") -> str:
    """The table's key of a shape; quantized weight formats append ``,quant=<format>``."""
    dt = str(dtype).removeprefix("torch.")
    key = f"E={E},N={N},K={K},topk={topk},dtype={dt},w1={'row' if w1_row else 'col'},w2={'row' if w2_row else 'col'}"
    return key if quant == "none" else f"{key},quant={quant}"


def device_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def table_path(device_name: str) -> Path:
    return CONFIG_DIR / f"{device_slug(device_name)}.json"


def read_table(path) -> dict:
    """A tuned table file -> {key: {M bucket: MoeConfig}} (unsanitized)."""
    with open(path) as f:
        data = json.load(f)
    return {key: {int(m): MoeConfig.from_json(c) for m, c in per_m.items()}
            for key, per_m in data.get("configs", {}).items()}


@functools.lru_cache(maxsize=None)
def _load_table(device_name: str) -> dict:
    path = table_path(device_name)
    return read_table(path) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "cpu", 132
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def _nearest_bucket(buckets, M: int) -> int:
    lm = math.log2(max(M, 1))
    return min(buckets, key=lambda b: (abs(math.log2(b) - lm), b))


@functools.lru_cache(maxsize=8192)
def get_config(M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype, w1_row: bool, w2_row: bool,
               device: torch.device, quant: str = "none", local_pairs: int | None = None) -> MoeConfig:
    """Tuned entry for this device if the table has the key, else the heuristic; always sanitized. ``local_pairs``:
    the (token, slot) pairs expected on these E experts when an expert-parallel shard holds them (None: M * topk),
    which sizes the split reductions of the direct tensor-core GEMVs (``dot_gemv_direct``).

    NOTE: memoized: eager forwards pay a dict lookup, not the table search and sanitizing (~tens of us).
    """
    name, sms = _device_facts(device)
    shard = local_pairs is not None
    per_m = _load_table(name).get(table_key(E, N, K, topk, dtype, w1_row, w2_row, quant), {})
    # A direct-path entry tuned at a smaller M does not carry over to an M where pairs share experts.
    usable = [b for b, c in per_m.items()
              if not (c.path == "direct" and M > b and not use_direct(M, E, topk, quant))]
    cfg = per_m[_nearest_bucket(usable, M)] if usable else None
    esize = torch.empty((), dtype=dtype).element_size()
    if cfg is None or (cfg.path == "direct" and shard and shard_dot_gemvs(quant, esize)):
        # (the tuner's pairs are all local: a tensor-core GEMV entry's splits do not carry over to a shard's few, and
        # a 16-bit entry's GEMVs are the FMA ones)
        cfg = heuristic_config(M, E, N, K, topk, dtype, w1_row, w2_row, sms, quant,
                               path=None if cfg is None else "direct", local_pairs=local_pairs)
    return sanitize(cfg, dtype, N, K, topk, quant)


def expected_hit_experts(P: int, E: int) -> float:
    """Expected number of distinct experts among P uniformly routed pairs."""
    return E * (1.0 - (1.0 - 1.0 / E) ** P) if P > 0 else 0.0


def use_direct(M: int, E: int, topk: int, quant: str = "none") -> bool:
    """Whether a call of M tokens runs the direct schedule (no routing, a GEMV per pair) rather than the sorted one.
    NOTE: the direct path re-reads an expert's weights once per pair that hits it, so it pays only while pairs
    rarely share an expert (expected shared fraction ~ P / 2E); it saves the routing and slot-sum launches. With
    the one-program sorted routing (2-4 us), 16-bit weights ran sorted faster from P = E / 16 on the H200
    (deepseek-v3-tp4 M = 2, P 16 of E 256: 93.1 against 98.2 us; qwen3-next-80b-a3b-tp2 M = 4, P 40 of 512: 42.9
    against 46.1) and direct faster below (qwen3-next M = 2, P 20: 26.0 against 27.7). The other formats stay direct
    up to P = E / 8: the tensor-core GEMVs of MXFP4 in the MMA layout measured so (gpt-oss-120b MXFP4 M = 4, P 16 of
    128: 88.7 against 93.2); fp8 block and MXFP4 in the checkpoint layout not re-measured.
    benchmarks/results/ab_direct_vs_sorted_h200.txt: ``ab_fused_experts.py ... --other-schedule``."""
    P = M * topk
    if quant == "none":
        return M == 1 or 16 * P < E
    return M == 1 or 8 * P <= E


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


# Reduction steps of the second GEMM (N / block_k) up to which its tiles at blocks of up to 64 rows run in 3 stages
# instead of 4 (16-bit weights: ``dense_sorted_tiles``; fp8 block: ``heuristic_config``).
SHORT_REDUCTION_STEPS = 8

# 16-bit weights, sorted schedule: the largest N (gemm2's reduction) at which blocks of 32 and 64 rows run gemm2 as the
# persistent kernel (``dense_sorted_tiles``): at most 4 steps of 64 per tile, too few to hide a tile's prologue and
# epilogue behind its own loads.
PERSISTENT_GEMM2_MAX_N = 256


def persistent_gemm2_tile(g: GemmConfig) -> GemmConfig:
    """``g`` as the persistent gemm2's tile of 16-bit weights (``dense_sorted_tiles``; the tuner times it too): 256
    output columns in steps of 64 on 8 warps, weights by TMA."""
    return dataclasses.replace(g, block_n=256, block_k=64, num_warps=8, tma_weights=True, persistent=True)


def _short_gemm2_stages(block_m: int, N: int, block_k: int, stages: int) -> int:
    """gemm2's pipeline stages: 3 for a short reduction (at most SHORT_REDUCTION_STEPS steps of block_k) at blocks
    of up to 64 rows, else ``stages`` (see the NOTEs where the two formats call it)."""
    return 3 if block_m <= 64 and N <= SHORT_REDUCTION_STEPS * block_k else stages


def heuristic_config(M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype, w1_row: bool, w2_row: bool,
                     num_sms: int = 132, quant: str = "none", path: str | None = None,
                     local_pairs: int | None = None) -> MoeConfig:
    """The untuned config of a call; ``path`` ("direct" / "sorted") forces the schedule (None: ``use_direct``);
    ``local_pairs`` as in ``get_config``."""
    esize = torch.empty((), dtype=dtype).element_size()
    P = M * topk
    direct = use_direct(M, E, topk, quant) if path is None else path == "direct"
    if direct and (quant in DOT_GEMV_QUANTS or (local_pairs is not None and shard_dot_gemvs(quant, esize))):
        return dot_gemv_direct(P if local_pairs is None else max(1, local_pairs), N, K, num_sms, quant)
    if direct:
        # NOTE: MXFP4 tiles hold twice the elements (4 KB of packed codes per step, half the bytes of a bf16
        # tile): the same bytes in flight per program.
        return _heuristic_direct(M, P, topk, N, K, esize, w1_row, w2_row, num_sms,
                                 tile=8192 if quant == "mxfp4" else None)
    rows = P / max(expected_hit_experts(P, E), 1.0)
    # NOTE: block_m trades padding waste (up to block_m - 1 rows per hit expert) against tile efficiency;
    # wgmma needs 64 rows per warpgroup, smaller blocks run mma.sync (fine while weight-streaming).
    block_m = 16 if rows <= 16 else 32 if rows <= 40 else 64 if rows <= 160 else 128
    if (rows > 24 and quant == "none" and esize == 2) or (rows > 28 and quant == "fp8_block"):
        # 16-bit weights: see dense_sorted_tiles (blocks of 64 from 24 rows per expert on). fp8 block from 28 (between
        # the 24 and 32 measured below): at 32-40 rows per expert about half the experts' rows spill into a second
        # block of 32, whose tile reads the expert's weights again.
        # NOTE: fp8 block on an H200, whole op, silu, CUDA-graph medians of 5 interleaved rounds, blocks of 64
        # against 32 (the heuristic's other tiles): 32 rows per expert DeepSeek-V3 (M 1024) 3158.6 against 3831.9 us,
        # its TP-4 shard (N 512) 946.6 against 1110.8, Qwen3-30B-A3B (M 512) 244.6 against 256.7; 40 rows
        # qwen3-next-80b-a3b-tp2 (M 2048) 410.5 against 538.3; at 24 rows blocks of 32 stay ahead (DeepSeek-V3
        # M 768 2979.0 against 3090.6), and at 16 (M 512: 2897.4, blocks of 64 3011.3)
        # (benchmarks/results/ab_fp8_block_rows_h200.txt: ``python benchmarks/ab_fused_experts.py --quant fp8_block
        # --activation silu --model deepseek-v3 --tokens 1024 --variant '{"block_m": 64, ...}'``).
        block_m = max(block_m, 64)
    if (rows >= 96 and quant == "mxfp4_mma") or (rows >= 64 and quant == "none" and esize == 2):
        # MXFP4 MMA layout: the block's tokens are the MMA's N, a wider N amortizes the decode (mxfp4_mma_heuristic).
        # 16-bit weights: see dense_sorted_tiles.
        block_m = 128
    one_block = quant == "mxfp4_mma" and block_m == 32 and rows > MXFP4_MMA_ONE_BLOCK_ROWS
    if one_block:
        # one block for most experts rather than two (each decodes the expert's weights), with 32-row tail tiles
        # for the experts that fill half of it (MXFP4_MMA_ONE_BLOCK_ROWS)
        block_m = 64
    big = block_m >= 128
    # NOTE: gemm1 tiles cover 2 * block_n weight rows (gate + up); block_k 64 keeps 4 stages in smem.
    # NOTE: an expert's last block is partial (half empty on average); in gemm1 a quarter-height tail tile
    # for it paid on an H200 with these tiles: qwen3 M = 4096 (block_m 128) 663 -> 517 us, mixtral
    # M = 1024 1301 -> 1090 us, qwen3 M = 1024 (block_m 64, tail 16) 303 -> 236 us. gemm2 gained < 3%.
    g1 = GemmConfig(block_n=64, block_k=64, num_warps=8 if big else 4, num_stages=4, group_m=8,
                    tail_m=block_m // 4 if block_m >= 64 else 0)
    bn2 = 64 if block_m <= 32 else 128
    bk2 = 128 if block_m < 64 and N % 128 == 0 else 64
    # NOTE: gemm2's A operand is the sorted intermediate (contiguous rows per block): TMA loads of it cut
    # gemm2 on an H100 at mixtral M = 4096 from 1694 to 1552 us and at qwen3 M = 4096 from 275 to 270 us.
    g2 = GemmConfig(block_n=bn2, block_k=bk2, num_warps=8 if big else 4, num_stages=4, group_m=8, tma_a=block_m >= 64)
    if esize == 4:
        g1 = dataclasses.replace(g1, block_k=32, num_stages=3)
        g2 = dataclasses.replace(g2, block_k=32, num_stages=3)
    elif quant == "none":
        g1, g2 = dense_sorted_tiles(block_m, N, g1, g2)
    # NOTE: split the second GEMM's reduction when its tiles cannot fill the GPU twice over (decode-like
    # batches on the sorted path); partial sums go through the fp32 workspace that the slot sum reads.
    blocks = expected_hit_experts(P, E) + P / block_m
    tiles = blocks * math.ceil(K / g2.block_n)
    split = 1
    while tiles * split < 2 * num_sms and split < 8 and N >= 2 * split * g2.block_k:
        split *= 2
    g2 = dataclasses.replace(g2, split_k=split)
    if quant == "mxfp4":
        # NOTE: MXFP4 decodes every weight tile in registers, so its steps are short (64 columns: 32 bytes
        # per weight row) and small blocks run on few warps. H100, gpt-oss-120b, gemm1 / gemm2 alone, fastest
        # of the tuner's MXFP4 tiles: M = 64 (block_m 16) 64x64 on 2 warps 640 us (4 warps 678), gemm2 128x64
        # on 4 warps 363 us; M = 4096 (block_m 128) 128x64 on 8 warps 2449 us, gemm2 256x64 on 8 warps 1349 us
        # (``python benchmarks/tune_fused_experts.py --quant mxfp4 --models gpt-oss-120b --tokens 64 4096``
        # times these tiles among its candidates).
        small = block_m <= 32
        g1 = dataclasses.replace(g1, block_n=128 if block_m == 128 else 64, block_k=64,
                                 num_warps=2 if small else 4 if block_m == 64 else 8,
                                 num_stages=4 if block_m < 128 else 3, tma_weights=False)
        g2 = dataclasses.replace(g2, block_n=128 if block_m < 128 else 256, block_k=64,
                                 num_warps=4 if block_m < 128 else 8, num_stages=4 if block_m < 128 else 3,
                                 tma_weights=False)
    if quant == "fp8_block":
        # fp8 block: one 128-column scale block per step (block_k 128, fixed) and 128 output columns, so that
        # gemm1's epilogue quantizes whole 128-column groups of its output; weight tiles by TMA; rows per block
        # at most fp8_max_block_m (see FP8_MAX_BLOCK_M).
        # NOTE: gemm1 in expert-major order (group_m 0) against L2 super-groups of 8: DeepSeek-V3 layer (E 256,
        # topk 8, K 7168, N 2048) on the H100, fused_experts 4487 -> 4362 us at M = 1024, 11891 -> 11655 us at
        # M = 8192, 3401 -> 3394 at M = 64 (``python benchmarks/bench_fused_experts_fp8.py --skip-peers``).
        block_m = min(block_m, fp8_max_block_m(N))
        # NOTE: gemm1 at blocks of 64 in 4 stages (160 KB of shared memory; one program per SM either way, its 224
        # registers on 8 warps bound it: compile_report.py) against 3: H200, silu, CUDA-graph medians of 5
        # interleaved rounds, DeepSeek-V3 M = 1024 3036.1 against 3186.7 us, its TP-4 shard (N 512) 919.2 against
        # 946.6, qwen3-next-80b-a3b-tp2 M = 2048 398.9 against 409.0, Qwen3-30B-A3B M = 1024 270.0 against 279.8
        # (benchmarks/results/ab_fp8_block_rows_h200.txt, run 2:
        # ``python benchmarks/ab_fused_experts.py --quant fp8_block --activation silu --model deepseek-v3 --tokens
        # 1024 --variant '{"gemm1": {"num_stages": 4}}'``); fp8_tiles takes stages off where they do not fit.
        # NOTE: and without 16-row tail tiles there (an expert's last block in one 64-row tile): same GPU and
        # rounds, Qwen3-30B-A3B M = 2048 417.7 against 424.3 us, Qwen3-235B-A22B TP 4 M = 2048 461.8 against 468.2,
        # qwen3-next-80b-a3b-tp2 M = 2048 391.6 against 398.6, DeepSeek-V3 TP 4 M = 1024 893.7 against 901.8,
        # DeepSeek-V3 M = 1024 2905.8 against 2901.7 (run 5 there: ``--variant '{"gemm1": {"tail_m": 0}}'``). The
        # persistent gemm1 (one program per SM walking the tiles; 250 registers) was no faster: 461.2 at
        # Qwen3-30B-A3B, 2954.8 at DeepSeek-V3, so fp8 block keeps the tiled launch (``sanitize``).
        g1 = dataclasses.replace(g1, block_n=128, block_k=128, num_warps=8 if block_m >= 64 else 4,
                                 num_stages=4 if block_m == 64 else 3, group_m=0, tma_weights=True, tma_a=False,
                                 tail_m=block_m // 4 if block_m >= 128 else 0)
        # NOTE: TMA loads of gemm2's quantized intermediate at block_m 64: 12069 -> 11785 us at M = 8192 and
        # 6700 -> 6563 at M = 4096 (block_m 32 at M = 1024: 4336 -> 4340). gemm1's sorted quantized copy for TMA
        # (tma_a) was slower: 12069 -> 12497 at M = 8192, 4336 -> 4418 at M = 1024 (same layer and command).
        # NOTE: blocks of 128 rows take 8 warps in both GEMMs: the tuner's pick for the DeepSeek-V3 layer at M = 8192
        # on the H100 (``python benchmarks/tune_fused_experts.py --quant fp8_block --tokens 8192``: 9860 us, gemm1
        # 8 warps 3 stages, gemm2 128 x 128 on 8 warps 4 stages).
        # NOTE: a short reduction (at most SHORT_REDUCTION_STEPS steps of 128) at blocks of up to 64 rows in 3 stages,
        # as for 16-bit weights (``dense_sorted_tiles``): H200, silu, 3 against 4 stages at blocks of 16 rows,
        # qwen3-next-80b-a3b-tp2 (N 256) M = 512 245.0 against 249.9 us, M = 8 48.3 against 49.2; qwen3-235b-a22b-tp4
        # (N 384) M = 64 172.1 against 175.4; 2 stages slower than 4 in all three
        # (benchmarks/results/ab_gemm2_short_stages_h200.txt, runs 3 and 4: ``python benchmarks/ab_fused_experts.py
        # --quant fp8_block --activation silu --model qwen3-next-80b-a3b-tp2 --tokens 512 --variant '{"gemm2":
        # {"num_stages": 4}}'``).
        g2 = dataclasses.replace(g2, block_n=128, block_k=128, num_warps=8 if block_m == 128 else 4,
                                 num_stages=_short_gemm2_stages(block_m, N, 128, 4), tma_weights=True,
                                 tma_a=block_m >= 64)
        if block_m == 128 and N <= 1024:
            # NOTE: a short reduction (N / 128 <= 8 steps per tile) in tiles of 64 of the block's 128 rows on 4 warps,
            # two programs to an SM whose loads overlap each other's epilogues, instead of one 8-warp program per SM
            # that stalls between tiles. H100, M = 8192, whole op: DeepSeek-V3 at TP 4 (E 256, topk 8, K 7168, N 512)
            # 3667.1 -> 3274.8 us (gemm2 alone 1810.7 -> 1419.7 eager), Qwen3-30B-A3B (E 128, topk 8, K 2048,
            # N 768) 1446.6 -> 1338.0, outputs bitwise equal (``python benchmarks/ab_fused_experts.py --model
            # deepseek-v3-tp4 --tokens 8192 --quant fp8_block --variant '{"gemm2": {"tile_m": 0, "num_warps": 8}}'``).
            # 32-row tiles were slower (4731.2 and 1914.4 against 3647.8 and 1425.8), and DeepSeek-V3's own N = 2048
            # gained nothing (10129.0 against 10649.4 us, within that cell's spread): N <= 1024 only
            # (benchmarks/results/ab_fp8_gemm2_row_tiles_h100.txt).
            g2 = dataclasses.replace(g2, num_warps=4, tile_m=64)
    if quant == "mxfp4_mma":
        g1, g2 = mxfp4_mma_heuristic(block_m, g1, g2, blocks, K, N, num_sms, one_block)
    return MoeConfig("sorted", block_m, g1, g2)


def dense_sorted_tiles(block_m: int, N: int, g1: GemmConfig, g2: GemmConfig) -> tuple[GemmConfig, GemmConfig]:
    """16-bit weights, sorted schedule: the tiles that the tuner picks on the H100 (``tune_fused_experts.py``: the
    table's entries for the three benchmark models and its runs on the zoo of ``bench_zoo.py``), as a rule of
    block_m (from 64 rows per expert on, blocks of 128: ``heuristic_config``):

    - 16 rows: gemm1 tiles of 32 columns (64 weight rows) in 128-column steps; gemm2's weights by TMA, in tiles of
      128 output columns where N <= 1024 (measured on an H200, see the NOTE below);
    - 32 rows: gemm1 64 x 128 steps, 3 stages, weights by TMA in expert-major order, 16-row tail tiles; gemm2's
      weights and rows by TMA;
    - 64 rows: gemm1's weights by TMA in expert-major order, 128 columns (256 weight rows) for N >= 2048;
    - 128 rows: gemm1 128 columns (256 weight rows), weights by TMA in expert-major order, persistent (no tail
      tiles); gemm2 256 output columns, weights by TMA, persistent;
    - 32 and 64 rows, gemm2 persistent (256 output columns on 8 warps, weights by TMA) where its reduction has at
      most 4 steps of 64 (``PERSISTENT_GEMM2_MAX_N``);
    - up to 64 rows, gemm2 in 3 stages (4 elsewhere) where its reduction is short (``SHORT_REDUCTION_STEPS``).

    From 24 rows per expert on, blocks of 64 rows: at 32-40 rows an expert often spills into a second, small
    block of 32 that runs its weight tiles again. From 64 rows, blocks of 128, and gemm2 runs as the persistent
    kernel: a block of 128 holds what would be an expert's full block of 64 and its partial second one.

    NOTE: blocks of 128 (the tiles of this rule) against blocks of 64 on the zoo cells with 48-77 rows per expert
    (H100, bf16, swigluoai, the zoo's inputs; CUDA-graph medians of 3 interleaved rounds, bitwise equal outputs):
    deepseek-v2 M = 2048 (77 rows) 2881.7 against 3053.0 us, deepseek-v3-ep8 M = 2048 (64) 1072.7 against 1135.3,
    deepseek-v3-tp4 M = 2048 (64) 2260.8 against 2309.2, jamba-v0.1 M = 512 (64) 2045.5 against 2156.9,
    phi-3.5-moe M = 512 (64) 924.3 against 960.3, qwen2-57b-a14b-tp2 M = 512 (64) 687.8 against 693.4; but
    deepseek-v2-lite M = 512 (48 rows) 444.8 against 426.5. The same two configs on the A/B script's own inputs
    (random routing, not the zoo's; this command was not run for these figures):
    ``python benchmarks/ab_fused_experts.py --model deepseek-v2 --tokens 2048 --variant VARIANT64`` with VARIANT64
    the blocks of 64: ``{"block_m": 64, "gemm1": {"block_n": 64, "num_warps": 4, "tail_m": 16}, "gemm2":
    {"block_n": 128, "num_warps": 4, "num_stages": 4, "tma_weights": false, "persistent": false}}`` (N < 2048).
    The op's figures with every peer: benchmarks/results/zoo_blocks128_*_h100.json.

    NOTE: the tuner's runs on two zoo shapes (``python benchmarks/tune_fused_experts.py --models
    qwen3-next-80b-a3b-tp2 qwen3-235b-a22b-tp4 --tokens 1 8 64 512 2048 8192``, H100, bf16, swigluoai), tuner totals:
    blocks of 64 against 32 at qwen3-next M = 2048 (40 rows per expert) 664.6 against 691.5 us, and the tuned
    entry (block_m 64) at qwen3-235b M = 512 (32 rows) 459.6 against this rule's former block of 32, 482.4 us end to
    end; the persistent gemm2 against the same tile non-persistent at blocks of 128: qwen3-235b M = 8192 684.8
    against 829.8 us (gemm2 + slot sum), M = 2048 255.4 against 295.2, qwen3-next M = 8192 559.9 against 598.7.

    NOTE: against the tiles this rule replaced (64-column gemm1 tiles from pointers at every block_m, 128-column
    gemm2 tiles, blocks of 128 rows from 160 rows per expert on), the 14 zoo shapes without table entries on the
    H100 (``python benchmarks/bench_zoo.py``, bf16, swigluoai; the expert-parallel shard also with
    ``fused_experts.local_tokens``): ours / floor 0.74-0.94x at M = 8192 (geomean
    0.81), 0.79-1.00x at M = 2048 (0.87), 0.86-1.03x at M = 512 (0.95), 0.95-1.01x at M 8 and 64; geomean over
    the 84 cells 1.314 -> 1.228 (M = 1 runs the direct schedule, unchanged). The tuner's runs on three of those
    shapes (``python benchmarks/tune_fused_experts.py --models dbrx-tp8 qwen3-next-80b-a3b-tp2 deepseek-v3-tp4
    --tokens 512 2048 8192``) chose blocks of 128 rows at 128 and 160 rows per expert (dbrx-tp8 M = 512: 356
    against 391 us for blocks of 64; qwen3-next M = 8192: 1126 against 1173)."""
    if block_m == 16:
        g1 = dataclasses.replace(g1, block_n=32, block_k=128)
        # NOTE: a reduction of at most 8 steps (N <= 1024): gemm2 tiles of 128 output columns, half the programs,
        # each with its prologue and epilogue over twice the rows. H200, bf16, swigluoai, CUDA-graph medians of 3
        # interleaved rounds, outputs bitwise equal, 128 against 64 columns: qwen3-next-80b-a3b-tp2 (N 256) M = 8
        # 81.9 against 84.5 us, M = 64 308.0 against 317.9, M = 512 444.2 against 453.9; qwen3-235b-a22b-tp4 (N 384)
        # M = 8 134.5 against 137.9, M = 64 290.3 against 296.3; deepseek-v3-tp4 (N 512) M = 64 1115.4 against
        # 1126.2. Longer reductions gained less or lost: N 1408-1536 0.2-0.9%, jamba-v0.1 (N 14336) M = 8 807.8
        # against 798.9 (benchmarks/results/ab_gemm2_wide_tiles_h200.txt: ``python benchmarks/ab_fused_experts.py
        # --model qwen3-235b-a22b-tp4 --tokens 8 --variant '{"gemm2": {"block_n": 128}}'``, and so on).
        g2 = dataclasses.replace(g2, tma_weights=True, block_n=128 if N <= 1024 else g2.block_n)
    elif block_m == 32:
        g1 = dataclasses.replace(g1, block_n=64, block_k=128, num_stages=3, group_m=0, tail_m=16, tma_weights=True)
        g2 = dataclasses.replace(g2, tma_weights=True, tma_a=True)
    elif block_m == 64:
        wide = N >= 2048
        g1 = dataclasses.replace(g1, block_n=128 if wide else 64, num_stages=3 if wide else 4, group_m=0,
                                 tma_weights=True)
    elif block_m == 128:
        # NOTE: gemm1 persistent without tail tiles against the tiled launch with 32-row tail tiles (the rule
        # before), H200, bf16, swigluoai, medians of 3 interleaved CUDA-graph rounds, outputs bitwise equal:
        # deepseek-v2-lite M = 2048 (192 rows per expert) 519.2 against 553.2 us, M = 8192 1580.1 against 1662.3;
        # dbrx-tp8 M = 8192 2793.4 against 2879.5; qwen2-57b-a14b-tp2 M = 8192 3149.7 against 3286.3; qwen3-30b-a3b
        # M = 4096 742.8 against 761.5; mixtral-8x7b-tp2 M = 2048 1341.5 against 1357.2, M = 8192 4693.3 against
        # 4694.9; qwen3-235b-a22b-tp4 M = 8192 1424.5 against 1401.4; at 64-136 rows per expert level or faster
        # (llama-4-scout M = 2048 1376.5 against 1406.8, deepseek-v3-tp4 M = 2048 1619.7 against 1615.7)
        # (benchmarks/results/ab_persistent_gemm1_h200.txt; the former rule is the variant of ``python
        # benchmarks/ab_fused_experts.py --model deepseek-v2-lite --tokens 2048 --variant '{"gemm1": {"persistent":
        # false, "tail_m": 32}}'``, and so on). Its rows copied for TMA loads (tma_a) were slower. Nor do 64-row
        # tails pay where an expert's last block is mostly padding: qwen3-next-80b-a3b-tp2 M = 8192 (160 rows per
        # expert) 926.6 against 935.0 us, level within -1.7% to +4.0% on six such cells, and a tiled gemm2 with tails
        # 0.5-15% slower than the persistent one (benchmarks/results/ab_persistent_tails_h200.txt: ``--variant
        # '{"gemm1": {"persistent": false, "tail_m": 64}}'``), that against a persistent gemm1 whose tile loop Triton
        # had left unfused, since fused again 4-8% faster (benchmarks/results/ab_gemm1_fused_loop_h200.txt).
        g1 = dataclasses.replace(g1, block_n=128, group_m=0, tma_weights=True, persistent=True, tail_m=0)
        g2 = dataclasses.replace(persistent_gemm2_tile(g2), num_stages=3)
    # NOTE: a short reduction (at most 8 steps) in 3 stages instead of 4: the stages' shared memory bounds the
    # programs an SM holds, and in a reduction this short a program's loads overlap more with the other
    # programs' epilogues than with its own later steps. H200, bf16, swigluoai, CUDA-graph medians of 3
    # interleaved rounds, outputs bitwise equal, 3 against 4 stages: qwen3-next-80b-a3b-tp2 (N 256) M = 2048
    # (blocks of 64) 475.5 against 512.7 us, M = 512 (blocks of 16) 411.5 against 429.5, M = 64 289.3 against
    # 300.9, M = 8 69.5 against 70.9; qwen3-235b-a22b-tp4 (N 384) M = 512 318.6 against 326.5; deepseek-v3-tp4
    # (N 512) M = 512 (blocks of 32) 1341.3 against 1352.9; qwen3-30b-a3b (N 768) M 16-256 within 0.2%; never
    # slower in 13 cells (2 to 6 steps). With the 22 steps of N = 1408 level (deepseek-v2-lite M = 512 299.9
    # against 300.6, qwen1.5-moe-a2.7b 277.5 against 276.1); the bound of 8 steps is that of the other
    # short-reduction rules here (nothing between 6 and 22 steps was measured)
    # (benchmarks/results/ab_gemm2_short_stages_h200.txt: ``python benchmarks/ab_fused_experts.py --model
    # qwen3-next-80b-a3b-tp2 --tokens 2048 --variant '{"gemm2": {"num_stages": 4}}'``, and so on).
    if block_m in (32, 64) and N <= PERSISTENT_GEMM2_MAX_N:
        # NOTE: a reduction of at most 4 steps of 64: gemm2 as the persistent kernel (256 output columns on 8 warps,
        # one program per SM walking the tiles, so one tile's loads overlap the previous tile's epilogue, and
        # padding rows neither read nor written) instead of a program per tile. H200, bf16, swigluoai, CUDA-graph
        # medians of 5 interleaved rounds, outputs bitwise equal, against the tiled gemm2: blocks of 32
        # qwen3-next-80b-a3b-tp2 (N 256) M = 1024 432.1 against 468.6 us, deepseek-v3-tp8 (N 256) M = 512 699.4
        # against 755.6, qwen3-30b-a3b-tp4 (N 192) M = 256 98.0 against 97.7; blocks of 64 qwen3-next M = 2048 469.0
        # against 490.0, deepseek-v3-tp8 M = 1024 755.8 against 787.7, qwen3-30b-a3b-tp4 M = 512 104.6 against 108.3
        # (benchmarks/results/ab_gemm2_persistent_short_h200.txt, run 3: ``python benchmarks/ab_fused_experts.py
        # --model qwen3-next-80b-a3b-tp2 --tokens 2048 --variant '{"gemm2": {"block_n": 128, "num_warps": 4,
        # "persistent": false, "tma_weights": false}}'``, and so on). block_k 64: at blocks of 32 the table's 128 in 3
        # stages was slower (442.0 and 703.4 us), and ``sanitize``'s shared-memory budget leaves it 2. Runs 1-2 there:
        # level from N 384 on at blocks of 64 (qwen3-235b-a22b-tp4 M = 512 316.7 against 315.4, deepseek-v3-tp4
        # M = 1024 1384.3 against 1389.2, gpt-oss-120b M = 1024 1585.3 against 1599.3), slower at N 1408
        # (deepseek-v2-lite M = 512 293.4 against 290.1) and at blocks of 16 (qwen3-next M = 512 418.6 against 410.0);
        # 128 columns on 4 warps never faster.
        g2 = persistent_gemm2_tile(g2)
    g2 = dataclasses.replace(g2, num_stages=_short_gemm2_stages(block_m, N, g2.block_k, g2.num_stages))
    return g1, g2


# Intermediate size N from which the MXFP4 MMA-layout heuristic runs the large layers' tiles (``mxfp4_mma_heuristic``).
# NOTE: H200, whole op, CUDA-graph medians of 5 interleaved rounds, outputs bitwise equal, the small layers' tiles ->
# the large layers': blocks of 128 with gemm1 on TMA rows (then on 256 weight rows and 8 warps; its tile now is
# MXFP4_MMA_WIDE_GEMM1_STAGES's, measured against that one): gpt-oss-120b M 4096 2110 -> 2018 us, gpt-oss-20b
# M 1024 526 -> 515, the Mixtral-8x7B shape (N 14336) M 1024 1583 -> 1484, DeepSeek-V2-Lite's (N 1408) M 2048
# 599 -> 591, but Qwen3-30B-A3B's (N 768) M 4096 801 -> 841 (benchmarks/results/ab_mxfp4_large_layers_h200.txt:
# ``python benchmarks/ab_fused_experts.py --quant mxfp4_mma --model MODEL --tokens M --variant ...``).
# NOTE: the large layers' gemm2 at blocks of 64, with a 32-row tail, in 128 columns on 4 warps (two programs per SM)
# against 256 on 8 (one): gpt-oss-20b M 384 (48 rows per expert) 234.3 against 246.3 us, the Mixtral-8x7B shape M 256
# 524.6 against 535.7, Qwen2-57B-A14B TP 2 M 512 343.8 against 354.2, gpt-oss-120b M 2048 1249.9 against 1272.7, and
# in the one-block cells (MXFP4_MMA_ONE_BLOCK_ROWS) gpt-oss-20b M 256 203.1 against 217.4
# (benchmarks/results/ab_mxfp4_one_block_tail_h200.txt, runs 5 and 6: ``python benchmarks/ab_fused_experts.py --quant
# mxfp4_mma --model MODEL --tokens M --variant '{"gemm2": {"block_n": 256, "num_warps": 8}}'``).
MXFP4_MMA_WIDE_N = 1024

# The large layers' gemm1 at blocks of 128 (``mxfp4_mma_heuristic``): 128 weight rows (64 columns of gate and up) on 4
# warps in 2 stages, 74 KB of shared memory and 254 registers, so that two programs share each SM and one decodes
# while the other's MMAs run (compile_report.py under Triton 3.6); 3 stages (115 KB) fit one.
# NOTE: H200, whole op, CUDA-graph medians of 7 interleaved rounds, outputs bitwise equal, against 256 weight rows on 8
# warps in 3 stages (one program per SM): gpt-oss-20b M 4096 1691.1 against 1765.4 us (gemm1 eager 923.0 against
# 1027.7; an earlier run 1603.0 against 1706.9), M 2048 913.7 against 920.7, M 8192 3213.3 against 3272.8;
# gpt-oss-120b M 8192 3582.3 against 3647.8, M 4096 2022.8 against 2015.8 (gemm1 eager 1184.3 against 1196.7); the
# Mixtral-8x7B shape M 4096 5227.5 against 5295.4, M 1024 1509.7 against 1499.7; DeepSeek-V2-Lite's M 4096 970.3
# against 993.5; Llama-4-Scout's M 4096 2042.9 against 2086.2; Phi-3.5-MoE's M 2048 1319.9 against 1318.8;
# Qwen2-57B-A14B TP 2 M 4096 1960.7 against 1948.4 (benchmarks/results/ab_mxfp4_gemm1_two_programs_h200.txt:
# ``python benchmarks/ab_fused_experts.py --quant mxfp4_mma --model MODEL --tokens M --variant '{"gemm1":
# {"block_n": 128, "num_warps": 8, "num_stages": 3}}'``). 2 stages where the layer is not large (Qwen3-30B-A3B's
# N 768, M 4096) were slower: 840.1 against 798.4.
MXFP4_MMA_WIDE_GEMM1_STAGES = 2

# Register cap of the large layers' gemm1 tile at blocks of 64 (64 columns of gate and up on 4 warps, 66.5 KB of
# shared memory): 168 = 65536 registers / (3 programs x 128 threads), rounded down to 8, so that a third program
# shares each SM (ptxas's own choice, 196, fits two; at 168 it spills 8 bytes and its k loop issues 395 instructions
# against 402: ``compile_report.py`` under Triton 3.6).
# NOTE: H200, whole op, CUDA-graph medians of 5-7 interleaved rounds, outputs bitwise equal: gpt-oss-20b M 256
# 237.2 -> 225.7 us, M 128 221.7 -> 210.1, gpt-oss-120b M 1024 927.8 -> 885.4 (160: 890.7; a second run 929.0 ->
# 911.4), the Mixtral-8x7B shape M 256 (64 rows per expert) 564.0 -> 566.1. ncu on the uncapped gemm1 at 120b M 1024:
# 1.96 warps active per scheduler, tensor pipe 54% and ALU 43% of active cycles, about their sum in time: the
# decode of one program and the MMA of another overlap little with two programs per SM. Not for other tiles:
# gemm2 at blocks of 16 capped at 128 (four programs instead of three) no faster (120b M 256 565.3 -> 567.6,
# 20b M 64 140.6 -> 141.3); Qwen3-30B-A3B's gemm2 (N 768) at 168 spills 240 bytes, M 1024 289.1 -> 296.0; fp8
# block's gemm1 at blocks of 16 capped at 168 no faster on DeepSeek-V3 (M 64 2334.0 -> 2338.3) and slower on its
# shard of 32 of 256 experts (315.2 -> 343.6). Nor a second program of gemm2 at blocks of 128 by 2 stages instead
# of 3 (shared memory 74 KB, 255 registers): gpt-oss-20b M 4096 1722.3 -> 1740.3, M 1024 514.9 -> 530.5, gpt-oss-120b
# M 4096 2005.8 -> 2051.4. (benchmarks/results/ab_register_caps_h200.txt: ``python
# benchmarks/ab_fused_experts.py --quant mxfp4_mma --model MODEL --tokens M --variant '{"gemm1": {"max_registers":
# 168}}'``.)
MXFP4_MMA_GEMM1_REGISTERS = 168

# Expected rows per expert above which (up to 40) the MXFP4 MMA-layout heuristic runs an expert's rows as one block of
# 64 instead of blocks of 32 (``heuristic_config``; each block decodes the expert's weights, and at 32 rows per expert
# about half the experts would spill into a second block of 32), with tail tiles of MXFP4_MMA_ONE_BLOCK_TAIL rows in
# both GEMMs: an expert with at most 32 rows runs a 32-token MMA instead of 64 (``mxfp4_mma_heuristic``).
# NOTE: one block of 64 instead of two of 32 (gemm1 with TMA rows, no tail tile, gemm2 256 columns on 8 warps with a
# 32-row tail), H200, CUDA-graph medians of 5 interleaved rounds: gpt-oss-120b M 1024 983 -> 922 us, gpt-oss-20b M 256
# 252 -> 236; without gemm1's TMA rows, gemm2's tail or the block of 64 (gemm2's tiles alone) slower: 985, 965 and 1007
# us at 120b M 1024; gemm1 with a 16-row tail 243 us at 20b M 256 (benchmarks/results/ab_mxfp4_large_layers_h200.txt).
# Then gemm1's 32-row tail, outputs bitwise equal: gpt-oss-20b M 256 228.0 -> 217.3, gpt-oss-120b M 1024 889.5 -> 863.1,
# DeepSeek-V2-Lite M 256 163.5 -> 149.8, Llama-4-Scout M 512 523.9 -> 508.6, Qwen2-57B-A14B TP 2 M 256 256.8 -> 247.1,
# Phi-3.5-MoE M 256 318.9 -> 306.2, DBRX TP 8 M 128 127.0 -> 125.0; level at 40 rows (gpt-oss-20b M 320 232.5 -> 232.1).
# Where an expert's second block is its tail (48-64 rows per expert) the 16-row tail stays: a 32-row one was level or
# slower (gpt-oss-120b M 2048 1284.8 -> 1311.3, Qwen3-30B-A3B M 1024 283.3 -> 291.8). Layers below MXFP4_MMA_WIDE_N, one
# block of 64 with these tails against blocks of 32 at 32 rows: Qwen3-30B-A3B M 512 186.0 against 214.0, Qwen3-235B-A22B
# TP 4 M 512 226.2 against 250.4, DeepSeek-V3 TP 4 M 1024 896.3 against 1008.1 (in 4 stages, uncapped: 193.8, 227.8,
# 909.7). Their gemm2 split in two or in 4 stages: slower or level (gpt-oss-20b M 256 239.1 / 218.4 against 216.5,
# gpt-oss-120b M 1024 904.3 / 858.1 against 845.5).
# NOTE: the crossover lies between 24 and 28 rows: one block against blocks of 32 at 20 / 24 / 28 rows, gpt-oss-20b
# (M 160 / 192 / 224) 194.3 / 199.3 / 210.4 against 179.4 / 195.1 / 215.4, Qwen3-30B-A3B (M 320 / 384 / 448) 169.3 /
# 171.3 / 177.7 against 156.0 / 166.0 / 187.9, gpt-oss-120b M 640 (20 rows) 760.9 against 736.2; qwen3-next-80b-a3b TP 2
# (E 512, N 256, whose gathered row copy holds 64 rows per expert) favours blocks of 32 up to 28 rows at least (M 1024 /
# 1229 / 1434: 330.6 / 341.7 / 354.8 against 291.6 / 311.0 / 342.7)
# (benchmarks/results/ab_mxfp4_one_block_tail_h200.txt: ``python benchmarks/ab_fused_experts.py --quant mxfp4_mma
# --model MODEL --tokens M --variant '{"gemm1": {"tail_m": 32}}'`` and the other variants in the file).
MXFP4_MMA_ONE_BLOCK_ROWS = 26
MXFP4_MMA_ONE_BLOCK_TAIL = 32


def mxfp4_mma_heuristic(block_m: int, g1: GemmConfig, g2: GemmConfig, blocks: float, K: int, N: int,
                        num_sms: int, one_block: bool = False) -> tuple[GemmConfig, GemmConfig]:
    """MXFP4 in the MMA layout (tensor-core steps only; the weight tile is the MMA's M, the block's tokens its N);
    ``blocks``: the expected row blocks of the sorted schedule.
    NOTE: 128 weight rows on 4 warps per tile in both GEMMs (the fused gemm1's 64 columns of gate and up;
    gemm2's 128 output columns) at blocks of 16 and 32 tokens: the 256-row tiles on 8 warps were 10-29% slower end
    to end there (H100, 120b: M 16 308 against 269 us; ``python benchmarks/tune_fused_experts.py --quant
    mxfp4_mma``). From 96 rows per expert, blocks of 128 tokens with tail tiles (gemm1 32 rows, 16 in large
    layers; gemm2 16) and pointer loads of gemm2's rows (H100, 120b M 4096: 2246 us against 2902 for blocks of
    64; 20b M 1024: 594 against 768; gemm2 with TMA rows 887 against 698 us at 20b M 4096). Layers from N =
    MXFP4_MMA_WIDE_N on take wider tiles from blocks of 64 on (see there). ``one_block``: an expert's rows in one
    block of 64 (MXFP4_MMA_ONE_BLOCK_ROWS), both GEMMs with MXFP4_MMA_ONE_BLOCK_TAIL-row tail tiles."""
    bn1, bn2 = 64, 128
    # Few row blocks (decode): gemm2 splits its reduction until there are two tiles per SM.
    split = 1
    while blocks * math.ceil(K / bn2) * split < 2 * num_sms and split < 8 and N >= 2 * split * 128:
        split *= 2
    stages = 3 if block_m >= 64 else 4
    wide = block_m >= 128
    g1 = dataclasses.replace(g1, block_n=bn1, block_k=128, num_warps=4, num_stages=stages, tma_weights=False,
                             tma_a=False, group_m=0, tail_m=32 if wide else g1.tail_m)
    g2 = dataclasses.replace(g2, block_n=bn2, block_k=128, num_warps=4, num_stages=stages, tma_weights=False,
                             split_k=split, tail_m=16 if wide else g2.tail_m, tma_a=g2.tma_a and not wide)
    if one_block or (N >= MXFP4_MMA_WIDE_N and block_m == 64):
        # The one-block cells (any layer) and the large layers' other blocks of 64: gemm1 on TMA rows, capped at three
        # programs' registers per SM (MXFP4_MMA_GEMM1_REGISTERS), gemm2 with a 32-row tail tile; in the one-block
        # cells gemm1's tail has 32 rows too (MXFP4_MMA_ONE_BLOCK_TAIL), elsewhere block_m / 4.
        # NOTE: gemm1's 16-row tail tile at blocks of 64 (where one block does not hold most experts' rows): H200,
        # whole op, CUDA-graph medians of 7 interleaved rounds, outputs bitwise equal, with against without it:
        # gpt-oss-120b M 2048 (64 rows per expert) 1261.7 against 1328.3 us, Qwen2-57B-A14B TP 2 M 512 357.7 against
        # 371.0, the Mixtral-8x7B shape M 256 533.3 against 547.2, level at 48 rows (gpt-oss-20b M 384 242.3 against
        # 242.1, DeepSeek-V2-Lite's M 512 182.2 against 180.8) and in the one-block cells (gpt-oss-20b M 256 226.1
        # against 226.0, gpt-oss-120b M 1024 883.5 against 884.2; they run MXFP4_MMA_ONE_BLOCK_TAIL's 32 rows)
        # (benchmarks/results/ab_mxfp4_gemm1_tail_h200.txt, runs 3 and 4: ``python benchmarks/ab_fused_experts.py
        # --quant mxfp4_mma --model MODEL --tokens M --variant '{"gemm1": {"tail_m": 0}}'``). Before the tail test
        # read the expert's count (``_grouped_gemm._rows_from``) the tail serialized the kernel's wgmma and lost.
        g1 = dataclasses.replace(g1, tma_a=True, max_registers=MXFP4_MMA_GEMM1_REGISTERS,
                                 tail_m=MXFP4_MMA_ONE_BLOCK_TAIL if one_block else g1.tail_m)
        g2 = dataclasses.replace(g2, tma_a=True, tail_m=MXFP4_MMA_ONE_BLOCK_TAIL)
    if N >= MXFP4_MMA_WIDE_N and wide:
        # Large layers at blocks of 128: gemm1 on TMA rows, its tile of 128 weight rows on 4 warps in 2 stages (two
        # programs per SM: MXFP4_MMA_WIDE_GEMM1_STAGES) with a 16-row tail.
        g1 = dataclasses.replace(g1, num_stages=MXFP4_MMA_WIDE_GEMM1_STAGES, tma_a=True, tail_m=16)
    return g1, g2


# Weight formats whose direct schedule always runs the tensor-core GEMVs of ``_gemv_dot`` (``GemmConfig.dot``).
DOT_GEMV_QUANTS = ("mxfp4_mma", "fp8_block")


def shard_dot_gemvs(quant: str, esize: int) -> bool:
    """Whether the direct schedule of an expert-parallel shard (an expert_map over more experts than held) runs the
    tensor-core GEMVs of ``_gemv_dot`` rather than the FMA GEMVs of ``_grouped_gemm``: the formats of DOT_GEMV_QUANTS
    (always, shard or not) and 16-bit dense weights (``esize`` 2), whose few local pairs the FMA GEMVs' tiles of all
    a token's slots leave mostly empty, while the tensor-core GEMVs' programs of other pairs exit and their split
    reductions spread the local pairs' weights over the GPU.
    NOTE: H200, silu, CUDA-graph medians of 5 interleaved rounds over 8 routings (benchmarks/results/
    ab_dense_dot_gemvs_h200.txt, the commands there; the shard's config is now this one, which ``python
    benchmarks/ab_fused_experts.py --model deepseek-v3 --local-experts 32 --tokens 1 --activation silu
    --other-schedule`` times against the sorted schedule's): DeepSeek-V3's shard of 32 of 256 experts, bf16,
    tensor-core GEMVs against the sorted schedule the op ran before (and the FMA GEMVs): M = 1 40.6 against 49.9 us
    (62.5), M = 2 56.3 against 65.9 (108.7), M = 4 94.4 against 94.3 (207.8). Without a shard the FMA GEMVs were as
    fast or faster at M = 1 in all 6 models tried, e.g. qwen3-next-80b-a3b-tp2 15.7 against 19.4 us, llama-4-scout
    64.6 against 67.3, qwen3-235b-a22b-tp4 28.1 against 28.2: the heuristic keeps them there; and where ``use_direct``
    gives the sorted schedule (M 4-16, swigluoai), it beat the tensor-core GEMVs in 9 of 10 cells, e.g.
    qwen3-next-80b-a3b-tp2 M = 8 69.6 against 75.2 us, qwen3-235b-a22b-tp4 M = 8 127.6 against 148.9, gpt-oss-120b
    M = 8 343.0 against 374.8 (deepseek-v3-tp4 M = 4 the exception: 177.3 against 167.7; same file, ``--variant``
    with ``dot_gemv_direct``'s config, the commands there)."""
    return quant in DOT_GEMV_QUANTS or (quant == "none" and esize == 2)


# NOTE: the expected local pairs up to which a shard of 16-bit dense weights takes the direct schedule (its tensor-core
# GEMVs); from there on the sorted one streams the shard's experts at about the copy bandwidth. H200, DeepSeek-V3's
# shard of 32 of 256 experts (topk 8), silu: direct / sorted 40.7 / 49.8 us at M = 1 (1 local pair), 56.3 / 65.9 at
# M = 2, 94.4 / 94.3 at M = 4, 168.5 / 153.2 at M = 8 (benchmarks/results/ab_dense_dot_gemvs_h200.txt: ``python
# benchmarks/ab_fused_experts.py --model deepseek-v3 --local-experts 32 --tokens 8 --activation silu
# --other-schedule``).
SHARD_DIRECT_PAIRS_16BIT = 2


def shard_direct(quant: str, esize: int, pairs: float) -> bool:
    """Whether an expert-parallel shard expecting ``pairs`` local (token, slot) pairs may take the direct schedule
    (``fused_experts.local_tokens``: its floor of 1 token): where that schedule runs the tensor-core GEMVs
    (``shard_dot_gemvs``), for 16-bit dense weights up to SHARD_DIRECT_PAIRS_16BIT pairs."""
    if quant == "none":
        return esize == 2 and pairs <= SHARD_DIRECT_PAIRS_16BIT
    return shard_dot_gemvs(quant, esize)


# NOTE: shared memory of an SM on Hopper (sm_90), for how many direct GEMV programs one SM holds at once.
SM_SHARED_MEMORY = 228 * 1024


def dot_gemv_direct(pairs: int, N: int, K: int, num_sms: int, quant: str = "mxfp4_mma") -> MoeConfig:
    """The direct schedule on the tensor-core GEMVs (``_gemv_dot``: no routing, per-pair GEMVs; ``GemmConfig.dot``;
    quant "none": 16-bit dense weights, ``shard_dot_gemvs``) for ``pairs`` (token, slot) pairs on these experts (the
    programs of other pairs exit at once): 128 weight rows on 4 warps per tile (gemm1: 64 columns of gate and up),
    128-column steps, 3 stages (16-bit dense: 4 stages or 64-row tiles were slower, ``shard_dot_gemvs``'s A/B); fp8
    block: gemm1 128 columns (256 rows, see ``fp8_gemv_tiles``), gemm2 64 rows in 4 stages (3 where that makes one
    wave, ``_one_wave_stages``). Each reduction splits in two while twice its programs still fit on the GPU at once:
    per SM as many as their pipelined tiles' shared memory allows (``gemv_smem``), at most 4, so that every program
    streams from the start and none waits for a second wave.
    NOTE: the rule gives the tuner's picks on the H100 (``python benchmarks/tune_fused_experts.py --quant mxfp4_mma
    --tokens 1``, gpt-oss-120b M = 1: gemv1 split 2 21.7 us (unsplit 24.7, split 4 24.6, 256 rows on 8 warps 26.1);
    gemv2 split 4 15.5 us (split 2 16.7, split 8 18.7, 256 rows on 8 warps 19.4); end to end 36.8 us against 48.9 for
    the best sorted config), and the table's DeepSeek-V3 fp8 block entry at M = 1 (gemv1 split 2, gemv2 unsplit).
    NOTE: against the rule it replaced (split until the programs reach two per SM), H200, fp8 block at M = 1,
    CUDA-graph medians of 5 interleaved rounds (benchmarks/results/ab_direct_splits_h200.txt): Qwen3-30B-A3B (E 128,
    topk 8, K 2048, N 768) gemv1 split 4 18.8 us against split 8 22.2; DeepSeek-V3's shard of 32 of 256 experts (1
    local pair on average) 21.3-22.3 us for every split tried (gemv1 4-16, gemv2 1-4): there the splits do not
    matter. Splits that are not powers of two were slower (H200, gpt-oss-120b MXFP4 at M = 1: 33.9 us against gemv1
    split 3 37.3, gemv2 split 3 35.3, split 6 37.2; same file, run at cac8f66).
    NOTE: MXFP4, other tiles at gpt-oss-120b M = 1 on the H200, 28.6 us with these: 64-row tiles (gemv1 32 columns of
    gate and up, gemv2 64 rows; twice the programs) 42.5 at the same splits, 39.9-42.4 at others; 128 rows on 8 warps
    46.6 (benchmarks/results/ab_gemv_tiles_h200.txt: ``python benchmarks/ab_fused_experts.py --quant mxfp4_mma --model
    gpt-oss-120b --tokens 1 --variant '{"gemm1": {"block_n": 32}, "gemm2": {"block_n": 64}}'``). Fewer stages were
    slower too: 1 (tiles loaded straight into registers) 38.9, 2 stages 34.1
    (benchmarks/results/ab_gemv_stages_h200.txt: ``--variant '{"gemm1": {"num_stages": 1}, "gemm2": {"num_stages":
    1}}'``)."""
    fp8 = quant == "fp8_block"

    def split(g: GemmConfig, rows: int, tiles: int, reduction: int) -> GemmConfig:
        per_sm = gemv_programs_per_sm(g.num_stages, rows, quant)
        s = 1
        while tiles * 2 * s <= per_sm * num_sms and reduction >= 2 * s * 128:
            s *= 2
        return dataclasses.replace(g, split_k=s)

    bn1 = 128 if fp8 else 64
    dense = quant == "none"
    g1 = split(GemmConfig(block_n=bn1, block_k=128, num_warps=4, num_stages=3, group_m=0, dot=dense), 2 * bn1,
               pairs * math.ceil(N / bn1), K)
    bn2 = 64 if fp8 else 128
    g2 = split(GemmConfig(block_n=bn2, block_k=128, num_warps=4, num_stages=4 if fp8 else 3, group_m=0, dot=dense),
               bn2, pairs * math.ceil(K / bn2), N)
    if fp8:
        g2 = _one_wave_stages(g2, bn2, pairs * math.ceil(K / bn2) * g2.split_k, quant, num_sms)
    return MoeConfig("direct", 0, g1, g2)


# Shared memory that the runtime reserves per program (block) on sm_90, beside its own (CUDA's occupancy rules;
# benchmarks/compile_report.py counts programs per SM with it too).
BLOCK_RESERVED_SHARED_MEMORY = 1024


def _one_wave_stages(g: GemmConfig, rows: int, programs: int, quant: str, num_sms: int) -> GemmConfig:
    """A direct tensor-core GEMV of ``programs`` programs in 4 stages: 3 instead where only that puts them all on the
    GPU at once (one wave: per SM as many as their shared memory allows, ``gemv_smem`` plus the driver's reserve;
    fp8 block's second GEMV holds 48 registers on 4 warps, so its shared memory is what bounds it), else unchanged.
    NOTE: fp8 block's second GEMV at M = 1 with topk 8 and K 7168 (896 programs of 64 rows: 5 per SM at 40 KB in 4
    stages, 660 at once on 132 SMs; 7 at 30 KB in 3, 924), H200, silu, CUDA-graph medians of 5 interleaved rounds,
    outputs bitwise equal: DeepSeek-V3 96.1 -> 94.3 us, its TP-4 shard (N 512) 34.5 -> 31.3 (run 3 of
    benchmarks/results/ab_fp8_gemv2_stages_h200.txt: ``python benchmarks/ab_fused_experts.py --quant fp8_block
    --model deepseek-v3 --activation silu --tokens 1 --variant '{"gemm2": {"num_stages": 4}}'``; run 2, before the
    rule, 93.7 -> 91.3 and 34.3 -> 31.1, gemv2 alone 34.2 -> 31.5 and 14.8 -> 11.2 us eager);
    where 4 stages need several waves anyway (M = 2 and 4: 1792 and 3584 programs) 3 stages were level (177.0
    against 176.8 us, 338.4 against 337.4), so the rule takes them only for the one wave."""
    def fit(stages: int) -> int:
        per_sm = SM_SHARED_MEMORY // (gemv_smem(stages, rows, quant) + BLOCK_RESERVED_SHARED_MEMORY)
        return per_sm * num_sms

    if g.num_stages == 4 and fit(4) < programs <= fit(3):
        g = dataclasses.replace(g, num_stages=3)
    return g


def gemv_smem(stages: int, rows: int, quant: str) -> int:
    """Bytes of shared memory of a direct tensor-core GEMV program's pipelined tiles (``_gemv_dot``): per stage the
    16-row activation tile of 128 columns (e4m3 for fp8 block, which quantizes it up front, else 16-bit) and
    ``rows`` weight rows of 128 columns (fp8: a byte each; 16-bit dense: two; MXFP4 in the MMA layout: codes and
    scales, 17 / 32 byte)."""
    if quant == "fp8_block":
        return stages * (16 + rows) * 128
    if quant == "none":
        return stages * (16 + rows) * 128 * 2
    return stages * (16 * 128 * 2 + rows * 128 * 17 // 32)


def gemv_programs_per_sm(stages: int, rows: int, quant: str) -> int:
    """Programs of a direct tensor-core GEMV (``_gemv_dot``) that one SM holds at once: as many as their pipelined
    tiles' shared memory allows (``gemv_smem``), at most 4."""
    return max(1, min(4, SM_SHARED_MEMORY // gemv_smem(stages, rows, quant)))


def _heuristic_direct(M, P, topk, N, K, esize, w1_row, w2_row, num_sms, tile=None) -> MoeConfig:
    # NOTE: GEMV tiles of ~4 K elements (8 KB bf16) per load, 4 stages in flight, 4 warps: 2-4 programs
    # per SM keep ~64 KB of weight loads in flight per SM. The contiguous dim gets >= 64 bytes per row
    # (>= 2 sectors); the other dim shrinks until there are >= 3 programs per SM. The second GEMV's tile
    # spans all slots of a token: slots x block_n x block_k.
    tile = tile or (4096 if esize <= 2 else 2048)
    slots = triton_next_pow2(topk)
    contig = 128 // esize
    if w1_row:
        bk1 = _reduction_tile(K)
        bn1 = max(1, tile // (2 * bk1))
        while P * math.ceil(N / bn1) < 3 * num_sms and bn1 > 2:
            bn1 //= 2
    else:
        bn1 = max(contig // 2, 16)
        bk1 = max(16, tile // (2 * bn1))
    g1 = GemmConfig(block_n=bn1, block_k=bk1, num_warps=4, num_stages=4)
    if w2_row:
        bk2 = min(_reduction_tile(N), max(16, tile // slots))
        bn2 = max(1, tile // (slots * bk2))
        while M * math.ceil(K / bn2) < 3 * num_sms and bn2 > 1:
            bn2 //= 2
        if bn2 == 1 and bk2 >= 256:
            # NOTE: two output rows of half the reduction rather than one: the tuner's pick at qwen3-next-80b-a3b-tp2
            # M = 1 (E 512, topk 10, N 256; H100): 17.5 us end to end against 23.1 for one row of 256 (``python
            # benchmarks/tune_fused_experts.py --models qwen3-next-80b-a3b-tp2 --tokens 1``).
            bn2, bk2 = 2, bk2 // 2
    else:
        # NOTE: the output dim is the contiguous one here; 32-byte rows are the smallest that waste no
        # sector, so that is as far as the tile narrows to make programs.
        bn2 = contig // 2 if M * math.ceil(K / (contig // 2)) >= 3 * num_sms else contig // 4
        bk2 = max(16, tile // (slots * bn2))
    g2 = GemmConfig(block_n=bn2, block_k=bk2, num_warps=4, num_stages=4)
    return MoeConfig("direct", 0, g1, g2)


def _reduction_tile(k: int) -> int:
    # NOTE: 256 (512 B per bf16 row) even when it does not divide k: the masked tail step costs less than
    # the 4x more loop steps of a 64-wide tile (2880 = 11.25 x 256).
    return min(256, max(16, triton_next_pow2(k)))


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def sanitize(cfg: MoeConfig, dtype: torch.dtype, N: int, K: int, topk: int = 1, quant: str = "none") -> MoeConfig:
    """Clamp a config to what the kernels accept: power-of-two tiles (>= 16 for tensor-core dots), a
    tail_m of 0 or 16 .. block_m / 2 (sorted only), a split_k that leaves every split work, and pipelined
    tiles within the shared-memory budget (the direct second GEMV's tile spans next_pow2(topk) slots).
    MXFP4 weights: block_k of at least one scale group (32) and tiles of at least 4 packed bytes per thread
    (``mxfp4_tiles``), pointer loads of the weights and no persistent GEMMs (both need 16-bit weights).
    fp8 block: ``fp8_tiles`` (sorted) and ``fp8_gemv_tiles`` (direct), whole 128-column scale blocks per step,
    block_m up to ``fp8_max_block_m``, no persistent GEMMs. A persistent gemm1 runs no tail tiles (tail_m 0).
    The direct schedule's tensor-core GEMVs (the formats of DOT_GEMV_QUANTS, and 16-bit dense weights with
    ``GemmConfig.dot``, which is cleared for the others and on the sorted path): 128-column steps, tiles of whole
    MMAs (``mxfp4_mma_tiles``, ``fp8_gemv_tiles``, ``dense_gemv_tiles``)."""
    esize = torch.empty((), dtype=dtype).element_size()
    g1, g2 = cfg.gemm1, cfg.gemm2
    if not (cfg.path == "direct" and quant == "none" and esize == 2):
        g1, g2 = dataclasses.replace(g1, dot=False), dataclasses.replace(g2, dot=False)
    dot1, dot2 = (g.dot or quant in DOT_GEMV_QUANTS for g in (g1, g2))
    if quant == "mxfp4":
        # The pipelined budget counts weight tiles as if 16-bit: an upper bound of the packed tiles plus the
        # decoded tile the dot reads.
        esize = max(esize, 2)
    if quant in ("mxfp4", "mxfp4_mma"):
        # NOTE: no persistent gemm1 either: in the MMA layout it took 2.1-2.7x the time of the tiled launch without
        # tail tiles on an H200 (gpt-oss-20b M = 4096 4726.0 against 1945.0 us, gpt-oss-120b M = 1024 2313.4 against
        # 1114.9; benchmarks/results/ab_persistent_gemm1_h200.txt, run 3). Statically (Triton 3.6, sm_90) its
        # flattened loop spills 372 / 208 B and serializes its wgmma, the tiled one 56 / 56 B, pipelined (``python
        # benchmarks/compile_report.py --device "NVIDIA H200" --model gpt-oss-20b --tokens 4096 --quant mxfp4_mma
        # --variant '{"gemm1": {"persistent": true, "tail_m": 0}}'`` at 492e533, where sanitize let it through).
        g1 = dataclasses.replace(g1, tma_weights=False, persistent=False)
        g2 = dataclasses.replace(g2, tma_weights=False, persistent=False)
    a_esize = esize
    if quant == "mxfp4_mma":
        esize = 1  # a loose bound for _fit; mxfp4_mma_tiles counts the stages' bytes exactly
    if quant == "fp8_block":
        # 1-byte weight tiles; fp8_tiles then counts the activation tiles at their own size.
        esize = 1
        g1 = dataclasses.replace(g1, persistent=False)
        g2 = dataclasses.replace(g2, persistent=False)
    if cfg.path == "sorted":
        bm = min(fp8_max_block_m(N) if quant == "fp8_block" else 128, max(16, triton_next_pow2(cfg.block_m)))
        g1 = _fit(dataclasses.replace(g1, split_k=1, tail_m=0 if g1.persistent else _tail(g1.tail_m, bm)), bm, 2, 16,
                  esize, out_tile=g1.persistent, budget=PERSISTENT_GEMM1_SMEM_BUDGET)
        g1 = dataclasses.replace(g1, tile_m=0)
        # MXFP4 keeps whole-block gemm2 tiles (the MMA layout's tile shapes are each checked on the GPU:
        # mxfp4_mma_tiles).
        tm = 0 if quant in ("mxfp4", "mxfp4_mma") else _tile_m(g2, bm)
        if g2.persistent:
            g2 = _fit(dataclasses.replace(g2, tail_m=0, split_k=1, tile_m=0), bm, 1, 16, esize, out_tile=True)
        else:
            g2 = _fit(dataclasses.replace(g2, tail_m=_tail(g2.tail_m, tm or bm), tile_m=tm,
                                          group_m=max(1, g2.group_m) if tm else g2.group_m), tm or bm, 1, 16, esize)
            g2 = dataclasses.replace(g2, split_k=max(1, min(g2.split_k, math.ceil(N / g2.block_k))))
        if quant == "mxfp4":
            g1, g2 = mxfp4_tiles(g1, 1, K), mxfp4_tiles(g2, 1, N)
        if quant == "mxfp4_mma":
            g1, g2 = mxfp4_mma_tiles(g1, 2, bm, a_esize), mxfp4_mma_tiles(g2, 1, bm, a_esize)
        if quant == "fp8_block":
            g1, g2 = fp8_tiles(g1, bm, 2, a_esize), fp8_tiles(g2, g2.tile_m or bm, 1, a_esize)
            g2 = dataclasses.replace(g2, split_k=max(1, min(g2.split_k, math.ceil(N / 128))))
        return MoeConfig("sorted", bm, g1, g2)

    def tensor_core_gemv(g: GemmConfig, row_mult: int, reduction: int, cap: int) -> GemmConfig:
        # ``_gemv_dot``: 16 A rows, splits of whole steps; MXFP4 in the MMA layout the sorted tiles' rule, fp8 block
        # ``fp8_gemv_tiles``, 16-bit dense ``dense_gemv_tiles``.
        g = dataclasses.replace(g, block_n=min(cap, triton_next_pow2(g.block_n)), tail_m=0, tma_a=False)
        if quant == "mxfp4_mma":
            g = mxfp4_mma_tiles(g, row_mult, 16, a_esize)
        elif quant == "fp8_block":
            g = fp8_gemv_tiles(g, row_mult, a_esize if row_mult == 2 else 1)
        else:
            g = dense_gemv_tiles(g, row_mult)
        return dataclasses.replace(g, split_k=max(1, min(g.split_k, math.ceil(reduction / g.block_k))))

    if dot1:
        g1 = tensor_core_gemv(g1, 2, K, 128)
    else:
        g1 = _fit(dataclasses.replace(g1, split_k=1, tail_m=0, tma_a=False, persistent=False), 0, 2, 1, esize)
        if quant == "mxfp4":
            g1 = mxfp4_tiles(g1, 1, K)
    if dot2:
        g2 = tensor_core_gemv(g2, 1, N, 256)
    else:
        g2 = _fit(dataclasses.replace(g2, split_k=1, tail_m=0, tma_a=False, persistent=False), 0,
                  triton_next_pow2(topk), 1, esize)
        if quant == "mxfp4":
            g2 = mxfp4_tiles(g2, triton_next_pow2(topk), N)
    return MoeConfig("direct", 0, g1, g2)


def fp8_tiles(g: GemmConfig, block_m: int, col_mult: int, a_esize: int) -> GemmConfig:
    """An fp8 block tile of the sorted schedule: block_k = 128 (one scale block per step) and block_n a multiple of
    128 (gemm1's epilogue quantizes whole 128-column groups; gemm1, ``col_mult`` 2: 128, its tiles hold at most two
    128-row parts). Stages shrink until the activation tiles (``a_esize`` bytes, the worst case: they may be
    quantized already) and the 1-byte weight tiles fit SMEM_BUDGET."""
    bn = 128 if col_mult == 2 else max(128, g.block_n)
    stages = g.num_stages

    def smem():
        return stages * (block_m * a_esize + col_mult * bn) * 128

    while smem() > SMEM_BUDGET and stages > 2:
        stages -= 1
    return dataclasses.replace(g, block_n=bn, block_k=128, num_stages=stages)


def fp8_gemv_tiles(g: GemmConfig, row_mult: int, a_esize: int) -> GemmConfig:
    """An fp8 block tile of the direct tensor-core GEMVs (``_gemv_dot``): block_k = 128 (one scale block per step);
    gemm1 (``row_mult`` 2) 128 output columns (its epilogue quantizes whole 128-column groups for gemm2; 256 weight
    rows with a gated activation), gemm2 64 to 256 weight rows (a warpgroup's MMA takes 64); 8 warps only for 256
    rows; stages whose 16-row activation tiles (``a_esize`` bytes) and weight tiles fit SMEM_BUDGET."""
    bn = 128 if row_mult == 2 else min(max(g.block_n, 64), 256)
    warps = 8 if g.num_warps >= 8 and row_mult * bn >= 256 else 4
    stages = max(2, g.num_stages)

    def smem():
        return stages * (16 * a_esize + row_mult * bn) * 128

    while smem() > SMEM_BUDGET and stages > 2:
        stages -= 1
    return dataclasses.replace(g, block_n=bn, block_k=128, num_warps=warps, num_stages=stages, tma_weights=False,
                               persistent=False)


def dense_gemv_tiles(g: GemmConfig, row_mult: int) -> GemmConfig:
    """A 16-bit dense tile of the direct tensor-core GEMVs (``_gemv_dot``): block_k = 128, at least 64 weight rows
    (gemm1, ``row_mult`` 2: block_n >= 32; a warpgroup's MMA takes 64), 8 warps only for 256 rows, stages (at least
    2) whose tiles fit SMEM_BUDGET (``gemv_smem``)."""
    bn = max(g.block_n, 64 // row_mult)
    warps = 8 if g.num_warps >= 8 and row_mult * bn >= 256 else 4
    stages = max(2, g.num_stages)
    while gemv_smem(stages, row_mult * bn, "none") > SMEM_BUDGET and stages > 2:
        stages -= 1
    return dataclasses.replace(g, block_n=bn, block_k=128, num_warps=warps, num_stages=stages, tma_weights=False,
                               persistent=False)


def mxfp4_mma_tiles(g: GemmConfig, row_mult: int, block_m: int, a_esize: int) -> GemmConfig:
    """An MXFP4 MMA-layout tile: steps of two chunks (block_k 128), at least 128 // row_mult * row_mult weight rows
    (gemm1: block_n >= 64, whose fused tiles hold 2 x block_n rows and the unfused ones block_n; gemm2: block_n >=
    128), 8 warps only for 256 rows or more, stages whose activation tiles (block_m x block_k, ``a_esize`` bytes) and
    codes + scales (17 / 32 byte per weight) fit SMEM_BUDGET.
    NOTE: other tiles computed wrong sums on the H100 (Triton 3.6): 32-row unfused gemm1 tiles, 64-row fused gemm1
    tiles with some gated activations, 128-row tiles in 64-column steps. ``test_every_admitted_tile`` in
    tests/test_fused_experts_mxfp4_mma_cuda.py runs each tile shape this rule admits against the reference."""
    warps = 8 if g.num_warps >= 8 else 4
    bn = max(g.block_n, 128 // row_mult)
    if row_mult * bn < 256:
        warps = 4
    stages = g.num_stages
    bk = 128

    def smem():
        return stages * (block_m * bk * a_esize + row_mult * bn * bk * 17 // 32)

    while smem() > SMEM_BUDGET and stages > 2:
        stages -= 1
    return dataclasses.replace(g, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma_weights=False,
                               persistent=False)


def mxfp4_tiles(g: GemmConfig, row_mult: int, reduction: int) -> GemmConfig:
    """An MXFP4 weight tile (at least row_mult * block_n rows of block_k values, block_k / 2 bytes each) of at
    least one scale group per row and at least 4 bytes per thread: the decode takes the bytes four to a
    register. ``reduction`` (K or N) bounds how far block_k grows for that."""
    bk = max(32, g.block_k)
    warps = g.num_warps

    def bytes_per_thread():
        return row_mult * g.block_n * bk // 2 // (32 * warps)

    while bytes_per_thread() < 4 and bk < max(32, triton_next_pow2(reduction)):
        bk *= 2
    while bytes_per_thread() < 4 and warps > 1:
        warps //= 2
    return dataclasses.replace(g, block_k=bk, num_warps=warps)


def _tile_m(g: GemmConfig, block_m: int) -> int:
    """gemm2's rows per program: 0 (the block's) or a power of two in [16, block_m / 2]; 0 with the persistent
    gemm2, which walks whole blocks."""
    if g.tile_m <= 0 or g.persistent or g.tile_m >= block_m:
        return 0
    return max(16, _pow2_floor(g.tile_m))


def _tail(tail_m: int, block_m: int) -> int:
    """0 (off) or a power of two in [16, block_m / 2]."""
    if tail_m <= 0 or block_m < 32:
        return 0
    return min(block_m // 2, max(16, _pow2_floor(tail_m)))


def _fit(g: GemmConfig, block_m: int, col_mult: int, min_n: int, esize: int, out_tile: bool = False,
         budget: int = PERSISTENT_SMEM_BUDGET) -> GemmConfig:
    """Power-of-two tiles (block_k >= 16, block_n >= min_n), 2-6 stages whose tiles (block_m x block_k
    activations + block_k x col_mult * block_n weights) fit SMEM_BUDGET: fewer stages first, then a
    shorter block_k, then a narrower block_n. ``out_tile`` (the persistent GEMMs): the pipelined tiles within
    SMEM_BUDGET and, with the block_m x block_n output tile, within ``budget`` (PERSISTENT_SMEM_BUDGET: gemm2's)."""
    bn, bk = max(min_n, _pow2_floor(g.block_n)), max(16, _pow2_floor(g.block_k))
    stages = max(2, min(g.num_stages, 6))

    def over():
        pipelined = stages * (block_m + col_mult * bn) * bk * esize
        return pipelined > SMEM_BUDGET or (out_tile and pipelined + block_m * bn * esize > budget)

    while over() and stages > 2:
        stages -= 1
    while over() and bk > 16:
        bk //= 2
    while over() and bn > min_n:
        bn //= 2
    warps = g.num_warps if g.num_warps in (1, 2, 4, 8, 16) else 4
    return dataclasses.replace(g, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps,
                               group_m=max(0, g.group_m), split_k=max(1, g.split_k))
