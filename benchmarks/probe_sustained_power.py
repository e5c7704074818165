"""Sustained replay of one bf16 ``fused_experts`` cell, ours against triton_kernels, one implementation at a time,
with the SM clock and board power sampled by ``nvidia-smi``: time per call, mean clock, mean power and the energy
per call (power x time) of each phase.

The benchmarks time their columns in interleaved rounds of ~25 ms CUDA-graph replays (``harness.time_interleaved_us``),
which puts the columns under the same clock drift; under the power cap the clock of a 25 ms replay still depends on
what ran just before it. This probe runs each implementation alone for ``--seconds`` (a graph of ``--calls`` calls
replayed back to back), then the other, ``--alternations`` times, so that each phase reaches the clock the power cap
sets for its own kernels, as a long prefill sees. The first 0.3 s of a phase are left out of its samples.

Each cell is ``MODEL:M`` with MODEL of ``tune_fused_experts.MODELS`` (bf16 weights, swigluoai, random routing over 4
rotated input sets, as ``ab_fused_experts.py`` draws them; ours with the config the ops pick). CUDA and
triton_kernels on ``PYTHONPATH`` only.

    python benchmarks/probe_sustained_power.py qwen3-30b-a3b:4096 deepseek-v2-lite:2048
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
SKIP_S = 0.3  # the start of a phase left out of its samples (the clock settling)
SAMPLE_MS = 50  # nvidia-smi's sampling interval


def parse_args(argv=None) -> argparse.Namespace:
    from tune_fused_experts import MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cells", nargs="+", metavar="MODEL:M", help="model of tune_fused_experts.MODELS and token count")
    p.add_argument("--seconds", type=float, default=4.0, help="length of one phase")
    p.add_argument("--alternations", type=int, default=2, help="phases per implementation, alternated")
    p.add_argument("--calls", type=int, default=40, help="calls per CUDA graph")
    args = p.parse_args(argv)
    cells = []
    for cell in args.cells:
        model, _, m = cell.partition(":")
        if model not in MODELS or not m.isdigit() or int(m) < 1:
            p.error(f"cell {cell!r}: expected MODEL:M with MODEL one of {sorted(MODELS)} and M >= 1")
        cells.append((model, int(m)))
    args.cells = cells
    return args


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """(epoch seconds, SM clock MHz, power W) per line of ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw
    --format=csv,noheader,nounits`` (its timestamps in the machine's local time, as ``time.time()`` compares)."""
    samples = []
    for line in text.strip().splitlines():
        stamp, clock, power = (field.strip() for field in line.split(","))
        t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, float(clock), float(power)))
    return samples


def phase_means(samples, t0: float, t1: float) -> tuple[float, float, int]:
    """Mean SM clock and power of the samples in [t0, t1], and their count (NaN means where there are none)."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return float("nan"), float("nan"), 0
    return statistics.mean(s[1] for s in inside), statistics.mean(s[2] for s in inside), len(inside)


def sustained_us(fn, calls: int, seconds: float) -> tuple[float, float, float]:
    """A CUDA graph of fn(0) .. fn(calls - 1) replayed back to back for ``seconds``: (us per call, start, end of the
    phase in epoch seconds)."""
    import torch
    from harness import _capture

    graph = _capture(fn, calls)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, replays = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(5):
            graph.replay()
        replays += 5
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls), t0, time.time()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_sustained_power: needs a CUDA device", file=sys.stderr)
        return 2
    import tune_fused_experts as T
    from ab_fused_experts import cell_weights
    from moe_extension.backends import triton_kernels as tk
    from moe_extension.kernels import fused_experts_triton

    if not tk.is_available():
        print("probe_sustained_power: needs triton_kernels on PYTHONPATH", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  swigluoai, bf16  phases of {args.seconds} s, graphs of {args.calls} calls")
    for model, M in args.cells:
        d = T.MODELS[model]
        w1, w2, _ = cell_weights(model, "none", None)
        sets = T.make_sets(d["E"], d["topk"], d["K"], M, torch.bfloat16, 4)
        runs = {
            "ours": lambda i: fused_experts_triton(sets[i % 4][0], w1, w2, sets[i % 4][1], sets[i % 4][2],
                                                   T.ACTIVATION),
            "triton_kernels": lambda i: tk.fused_experts(sets[i % 4][0], w1, w2, sets[i % 4][1], sets[i % 4][2],
                                                         T.ACTIVATION),
        }
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE,
                               text=True)
        phases = []
        for _ in range(args.alternations):
            for name, fn in runs.items():
                us, t0, t1 = sustained_us(fn, args.calls, args.seconds)
                phases.append((name, us, t0 + SKIP_S, t1))
                time.sleep(1.0)
        smi.terminate()
        samples = parse_samples(smi.communicate()[0])
        print(f"{model} M={M}")
        for name, us, t0, t1 in phases:
            clock, power, n = phase_means(samples, t0, t1)
            print(f"  {name:15s} {us:8.1f} us/call  SM clock {clock:6.0f} MHz  power {power:6.1f} W  "
                  f"energy {power * us * 1e-3:7.2f} mJ/call  ({n} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
