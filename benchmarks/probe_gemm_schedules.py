"""A plain bf16 GEMM ``C [M, N] = A [M, K] @ B [N, K]^T`` (fp32 accumulation, TMA loads of A and B) in four launch
schedules of one Triton tile loop, against cuBLAS: what the tile schedule alone is worth on this GPU, without the
routing, gathers and epilogues of the expert kernels.

Variants, ``NAME_BN`` with BN the tile's N (tiles of 128 x BN x 64; 4 stages at BN 128, 3 at 256):

- ``t8``: tiled, one program per output tile, 8 warps;
- ``p8``: persistent, one program per SM walking the tiles in one flattened loop (``tl.range(flatten=True)``),
  8 warps (the form of ``gemm1_sorted_kernel`` PERSISTENT and ``_gemm2_persistent``);
- ``t4ws`` / ``p4ws``: the same with Triton's automatic warp specialization of the loop
  (``warp_specialize=True``: on sm_90, with 4 warps, a producer warp group and two consumer ones, 12 warps);
- ``cublas``: ``torch.matmul``.

Each (shape, variant) runs in a child process with a timeout (``--timeout``), so that a kernel that never ends costs
that and no more; a child prints one JSON line (time per call: the median of 7 CUDA-graph replays of 20 calls,
``harness.time_graph_us``; TFLOP/s; the output's max error relative to the fp32 product's max) or the parent prints
the timeout. Tiles in super-groups of 8 row blocks. CUDA only (sm_90+ for the TMA loads).

    python benchmarks/probe_gemm_schedules.py --shapes 8192x2816x2048 8192x8192x8192
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from harness import time_graph_us

VARIANTS = ("cublas", "p8_256", "t8_256", "p8_128", "p4ws_128", "t4ws_128", "p4ws_256", "t4ws_256")


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP: tl.constexpr):
    """(row block, column block) of ``tile`` in super-groups of GROUP row blocks."""
    first_m = tile // (GROUP * tiles_n) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (tile % (GROUP * tiles_n)) % size_m, (tile % (GROUP * tiles_n)) // size_m


@triton.jit
def _store_tile(c_ptr, acc, M, N, pm, pn, BM: tl.constexpr, BN: tl.constexpr):
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _tile_product(a_desc, b_desc, c_ptr, M, N, K, pm, pn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros([BM, BN], tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        acc = tl.dot(a_desc.load([pm * BM, kk * BK]), b_desc.load([pn * BN, kk * BK]).T, acc)
    _store_tile(c_ptr, acc, M, N, pm, pn, BM, BN)


@triton.jit
def gemm_persistent(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, GROUP: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pm, pn = _grouped_tile(tile, tiles_m, tiles_n, GROUP)
        _tile_product(a_desc, b_desc, c_ptr, M, N, K, pm, pn, BM, BN, BK)


@triton.jit
def gemm_tiled(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               WS: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr):
    pm, pn = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    acc = tl.zeros([BM, BN], tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES, warp_specialize=WS):
        acc = tl.dot(a_desc.load([pm * BM, kk * BK]), b_desc.load([pn * BN, kk * BK]).T, acc)
    _store_tile(c_ptr, acc, M, N, pm, pn, BM, BN)


def run_one(M: int, N: int, K: int, variant: str) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float().T
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    if variant == "cublas":
        def fn():
            torch.matmul(a, b.T, out=c)
    else:
        kind, bn = variant.rsplit("_", 1)
        BM, BN, BK = 128, int(bn), 64
        a_desc = TensorDescriptor(a, [M, K], [K, 1], [BM, BK])
        b_desc = TensorDescriptor(b, [N, K], [K, 1], [BN, BK])
        tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        stages = 3 if BN == 256 else 4
        persistent, warps, ws = {"p8": (True, 8, False), "p4ws": (True, 4, True), "t8": (False, 8, False),
                                 "t4ws": (False, 4, True)}[kind]

        def fn():
            if persistent:
                gemm_persistent[(min(sms, tiles),)](a_desc, b_desc, c, M, N, K, BM, BN, BK, sms, not ws, ws, 8,
                                                    num_warps=warps, num_stages=stages)
            else:
                gemm_tiled[(tiles,)](a_desc, b_desc, c, M, N, K, BM, BN, BK, ws, 8, stages, num_warps=warps)
    c.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    us = time_graph_us(lambda i: fn(), reps=20, replays=7)
    return {"M": M, "N": N, "K": K, "variant": variant, "us": us, "TFLOPs": 2 * M * N * K / us / 1e6, "rel_err": err}


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        M, N, K = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxNxK, got {text!r}") from None
    return M, N, K


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(8192, 2816, 2048), (8192, 8192, 8192)],
                   metavar="MxNxK")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--timeout", type=float, default=40.0, help="seconds per (shape, variant) child")
    p.add_argument("--budget", type=float, default=250.0, help="seconds for the whole run; the rest is skipped")
    p.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_gemm_schedules: needs a CUDA device", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(run_one(*(int(v) for v in args.child[:3]), args.child[3])), flush=True)
        return 0
    t0 = time.time()
    for M, N, K in args.shapes:
        for variant in args.variants:
            if time.time() - t0 > args.budget:
                print("out of time", flush=True)
                return 0
            try:
                r = subprocess.run([sys.executable, __file__, "--child", str(M), str(N), str(K), variant],
                                   capture_output=True, text=True, timeout=args.timeout)
                print(r.stdout.strip() or f"{M}x{N}x{K} {variant} rc {r.returncode} {r.stderr.strip()[-300:]}",
                      flush=True)
            except subprocess.TimeoutExpired:
                print(f"{M}x{N}x{K} {variant} TIMEOUT {args.timeout:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
