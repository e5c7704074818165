"""Host time of one eager ``fused_experts`` call: how long the CPU takes to issue it, against the GPU's time.

An eager call costs its host time (Python, argument checks, config choice, the launches) or its GPU time,
whichever is longer, and from an idle GPU both add up to the first launch. With the GPU held busy by a sleep
kernel, ``host_us`` is the wall time per call of ``--calls`` calls issued back to back (the sleep outlasts them:
checked, else the cell says so), the least of 7 such samples (``host_median_us``: their median); ``gpu_us`` is
the call replayed in a CUDA graph; ``eager_idle_us`` one call from an idle GPU (CUDA events around it).
Cells: the DeepSeek-V3 layer's 64-expert shard (E 64, topk 8, K 7168, N 2048, silu) in bf16 and fp8 block, and
gpt-oss-120b (E 128, topk 4, K = N = 2880, swigluoai) in MXFP4 (the MMA layout, prepared once), M in
``--tokens``. ``--profile`` adds the cProfile lines of the slowest functions per cell (own time) to the output.

    python benchmarks/bench_host.py [--tokens 1 128 4096] [--calls 20] [--profile] [--out DIR]

Writes ``host_<gpu>.json``. CUDA only (``--help`` works anywhere).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_DEEPSEEK_SHARD = {"E": 64, "topk": 8, "K": 7168, "N": 2048, "activation": "silu"}
CELLS = {
    "deepseek-v3-e64-bf16": {**_DEEPSEEK_SHARD, "quant": "none"},
    "deepseek-v3-e64-fp8_block": {**_DEEPSEEK_SHARD, "quant": "fp8_block"},
    "gpt-oss-120b-mxfp4": {"E": 128, "topk": 4, "K": 2880, "N": 2880, "activation": "swigluoai", "quant": "mxfp4_mma"},
}


def make_layer(cell: dict, device) -> dict:
    """The cell's weights (and scales): bf16 and fp8 block as ``bench_ep`` draws them, MXFP4 prepared once."""
    E, K, N, quant = cell["E"], cell["K"], cell["N"], cell["quant"]
    if quant != "mxfp4_mma":
        from bench_ep import make_weights

        return make_weights(E, K, N, quant, device)
    from harness import random_mxfp4_stack

    from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma

    w1, s1 = prepare_mxfp4_mma(*random_mxfp4_stack(E, 2 * N, K, device)[:2])
    w2, s2 = prepare_mxfp4_mma(*random_mxfp4_stack(E, K, N, device)[:2])
    return {"w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": s2}


def measure(cell: dict, layer: dict, M: int, calls: int, profile: bool) -> dict:
    import torch
    from harness import time_graph_us

    device = layer["w1"].device
    gen = torch.Generator(device=device).manual_seed(M)
    x = torch.randn(M, cell["K"], device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(M, cell["E"], device=device, generator=gen).topk(cell["topk"], dim=1).indices.int()
    tw = torch.randn(M, cell["topk"], device=device, generator=gen).softmax(dim=1)

    def call(_=None):
        return torch.ops.moe_ext.fused_experts(x, layer["w1"], layer["w2"], tw, ids, cell["activation"],
                                               quant=cell["quant"], w1_scale=layer.get("w1_scale"),
                                               w2_scale=layer.get("w2_scale"))

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    idle = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        idle.append(a.elapsed_time(b) * 1e3)

    def host_us(prof: cProfile.Profile | None = None) -> tuple[float, bool]:
        """(us per call issued behind a sleep kernel, whether the sleep outlasted the calls); under ``prof``."""
        torch.cuda.synchronize()
        torch.cuda._sleep(600_000_000)  # ~0.35 s of GPU cycles: the calls queue behind it
        busy = torch.cuda.Event()
        busy.record()
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t = (time.perf_counter() - t0) / calls * 1e6
        if prof is not None:
            prof.disable()
        held = not busy.query()  # the sleep still running: no call waited for the GPU
        torch.cuda.synchronize()
        return t, held

    samples = [host_us() for _ in range(7)]
    # the least of the samples: interference (other processes, the collector) only adds time
    res = {"M": M, "host_us": min(t for t, _ in samples), "host_median_us": statistics.median(t for t, _ in samples),
           "host_measured_with_gpu_busy": all(h for _, h in samples),
           "eager_idle_us": statistics.median(idle), "gpu_us": time_graph_us(call, reps=5, replays=10)}
    if profile:
        prof = cProfile.Profile()
        host_us(prof)
        for key, order, lines in (("profile_tottime", "tottime", 25), ("profile_cumulative", "cumulative", 40)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(lines)
            res[key] = s.getvalue()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    from harness import RESULTS_DIR, device_info, gpu_slug, write_json

    import moe_extension  # noqa: F401  (registers the ops)

    if not torch.cuda.is_available():
        print("bench_host: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    for name in args.cells:
        cell = CELLS[name]
        layer = make_layer(cell, device)
        for M in args.tokens:
            r = {"cell": name, **cell, **measure(cell, layer, M, args.calls, args.profile)}
            print(f"{name} M={M} host {r['host_us']:.1f} us (GPU busy throughout: "
                  f"{r['host_measured_with_gpu_busy']}), eager from idle {r['eager_idle_us']:.1f} us, "
                  f"graph {r['gpu_us']:.1f} us", flush=True)
            if args.profile:
                print(r["profile_tottime"], r["profile_cumulative"], sep="\n", flush=True)
            rows.append(r)
        del layer
        torch.cuda.empty_cache()
    path = write_json(f"host_{gpu_slug()}.json",
                      {**device_info("python " + " ".join(sys.argv)), "calls": args.calls, "rows": rows},
                      args.out or RESULTS_DIR)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
