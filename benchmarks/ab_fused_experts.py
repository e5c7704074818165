"""A/B a config change of the routed-expert kernels against the table entry, end to end, interleaved.

The tuner times one candidate once; under the H100's power cap one timing moves by 2-10%, so a table entry
is changed only when this script confirms it. For one (model, M) cell of the benchmark's shapes (bf16,
swigluoai, random routing over rotated input sets) it times ``fused_experts_triton`` with the config the
table (or heuristic) gives, with that config after each ``--variant`` override, and ``triton_kernels`` when
importable, in ``--rounds`` interleaved rounds (each a CUDA-graph replay median, ``tune_fused_experts.time_us``),
checks every variant's output bitwise against the table config's, and prints per-round times and medians.

    python benchmarks/ab_fused_experts.py --model mixtral-8x7b --tokens 4096 \\
        --variant '{"gemm1": {"tma_a": false}, "gemm2": {"tma_a": false, "tma_weights": false}}'

A variant is JSON: ``{"block_m": .., "gemm1": {GemmConfig field: value}, "gemm2": {...}}`` (any subset),
applied with ``dataclasses.replace``. ``--no-pdl`` adds the table config launched without programmatic
dependent launch; ``--persistent-pdl`` adds it with the persistent gemm2 launched with PDL (the
launcher's ``_gemm2_persistent`` wrapped by this script; the product launches it without).
``--activation`` times another activation than the benchmark's swigluoai (triton_kernels is then left out:
it fuses only swigluoai). ``--op expert_gemm2`` times the unfused
second GEMM (``expert_gemm2_triton`` on a random [M, topk, N] intermediate, router weights applied; the
routing included) instead of the whole op, without triton_kernels. ``--profile`` also prints each
kernel's mean time per call over a few eager calls (torch.profiler; short bursts, so clocks run above the
power-capped ones of the replay timing). CUDA only (``--help`` works anywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from tune_fused_experts import add_cell_arguments  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_cell_arguments(p)
    p.add_argument("--variant", action="append", default=[], help="JSON overrides of the table config")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--sets", type=int, default=4, help="rotated input sets")
    p.add_argument("--activation", default="swigluoai", choices=sorted(ACTIVATION_CODES),
                   help="default: the benchmark's")
    p.add_argument("--profile", action="store_true", help="per-kernel eager times of each config")
    p.add_argument("--no-pdl", action="store_true",
                   help="also time the table config without programmatic dependent launch")
    p.add_argument("--persistent-pdl", action="store_true",
                   help="also time the table config with the persistent gemm2 launched with PDL")
    p.add_argument("--op", default="fused_experts", choices=["fused_experts", "expert_gemm2"],
                   help="what to time (default: the whole op)")
    args = p.parse_args(argv)
    if args.op == "expert_gemm2" and (args.no_pdl or args.persistent_pdl):
        p.error("--no-pdl and --persistent-pdl time fused_experts only")
    return args


def apply(cfg, variant: dict):
    """cfg with the overrides of ``variant`` (block_m, gemm1 / gemm2 fields)."""
    changes = {k: v for k, v in variant.items() if k not in ("gemm1", "gemm2")}
    for name in ("gemm1", "gemm2"):
        if name in variant:
            changes[name] = dataclasses.replace(getattr(cfg, name), **variant[name])
    return dataclasses.replace(cfg, **changes)


def kernel_times_us(fn, calls: int = 5) -> dict[str, float]:
    """Mean device time (us) per call of each kernel that fn() launches, over ``calls`` eager calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(ev.name, []).append(ev.device_time_total)
    # a kernel launched k times per call (triton_kernels' two matmuls share a name) counts k times
    return {name: sum(v) / calls for name, v in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import tune_fused_experts as T

    import moe_extension.kernels.fused_experts as fe
    from moe_extension.backends import triton_kernels as tk
    from moe_extension.kernels import expert_gemm2_triton, fused_experts_triton
    from moe_extension.kernels._configs import get_config

    if not torch.cuda.is_available():
        print("ab_fused_experts: needs a CUDA device", file=sys.stderr)
        return 2
    d = T.MODELS[args.model]
    E, topk, K, N, M = d["E"], d["topk"], d["K"], d["N"], args.tokens
    w1, w2, sets = T.cell_inputs(args.model, M, args.sets)
    n = len(sets)
    table = get_config(M, E, N, K, topk, torch.bfloat16, True, True, w1.device)
    configs = {"table": table}
    configs.update({f"variant {i}": apply(table, json.loads(v)) for i, v in enumerate(args.variant)})
    if args.op == "expert_gemm2":
        inter = [torch.randn(M, topk, N, dtype=w2.dtype, device=w2.device) for _ in range(n)]

        def call(c, i):
            return expert_gemm2_triton(inter[i % n], w2, sets[i % n][2], topk_weights=sets[i % n][1], config=c)
    else:
        def call(c, i):
            return fused_experts_triton(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2], args.activation,
                                        config=c)
    runs = {name: (lambda i, c=c: call(c, i)) for name, c in configs.items()}
    if args.no_pdl:
        runs["table, no PDL"] = lambda i: fused_experts_triton(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2],
                                                               args.activation, config=table, pdl=False)
    if args.persistent_pdl:
        launch_persistent = fe._gemm2_persistent

        def persistent_pdl(i):
            # the persistent gemm2 launched with PDL (where the device has it), for this call only: the
            # wrapper is in place while the benchmark captures the call, so the graph replays it
            fe._gemm2_persistent = lambda *a, pdl=False: launch_persistent(*a, pdl=fe.pdl_capable(a[0].device))
            try:
                return call(table, i)
            finally:
                fe._gemm2_persistent = launch_persistent

        runs["table, persistent gemm2 PDL"] = persistent_pdl
    if tk.is_available() and args.activation == T.ACTIVATION and args.op == "fused_experts":
        runs["triton_kernels"] = lambda i: tk.fused_experts(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2],
                                                            T.ACTIVATION)
    what = args.activation if args.op == "fused_experts" else args.op
    print(f"{torch.cuda.get_device_name()}  {args.model} M={M}  {what}  {args.rounds} interleaved rounds")
    ref = runs["table"](0)
    for name, c in configs.items():
        same = torch.equal(runs[name](0), ref)
        print(f"  {name:14s} block_m {c.block_m}  gemm1 {T.tile_name(c.gemm1)} | gemm2 {T.tile_name(c.gemm2)}"
              f"  bitwise equal to table: {same}")
    for name in ("table, no PDL", "table, persistent gemm2 PDL"):
        if name in runs:
            print(f"  {name}  bitwise equal to table: {torch.equal(runs[name](0), ref)}")
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(T.time_us(fn, n))
    for name, v in times.items():
        print(f"  {name:14s} " + " ".join(f"{x:8.1f}" for x in v) + f"   median {statistics.median(v):8.1f} us")
    if args.profile:
        for name, fn in runs.items():
            times = kernel_times_us(lambda: fn(0))
            print(f"  {name:14s} eager per kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
                  + f"; sum {sum(times.values()):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
