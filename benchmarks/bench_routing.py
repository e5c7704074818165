"""Latency of the device routing (``moe_extension.kernels._routing.route``) at decode and small batches, CUDA only.

The sorted schedule of ``fused_experts`` starts with this routing (expert-sorted, block-padded pair order from
``topk_ids``); at M 1-64 it is a fixed cost beside the two GEMMs. For each (E, topk) of public MoE layers
(``model_zoo.py`` and the three benchmark models) and M tokens, random routing (each token ``topk`` distinct
experts), ``block_m`` 16 (the heuristic's blocks at these M), it times in one run:

- ``ours``: ``route()`` as ``fused_experts`` launches it (PDL where the GPU has it): one program for
  ``P = M * topk <= SINGLE_PROGRAM_MAX_PAIRS`` pairs, three launches above;
- ``three_launches``: the three-launch schedule forced (``single_program_max_pairs=0``), at every P;
- ``launch``: one empty single-program kernel launch, the floor of any one-launch routing under replay.

Times are medians of CUDA-graph replays over 4 rotated routings (``harness.time_graph_budget_us``). Prints a
table and writes ``routing_<gpu>.json`` (device / torch / triton / command at the top level).

Run: python benchmarks/bench_routing.py [--tokens 1 8 16 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, device_info, gpu_slug, time_graph_budget_us, write_json  # noqa: E402
from model_zoo import ZOO  # noqa: E402

from moe_extension.kernels._launch import grid_dependency, pdl_capable, pdl_options  # noqa: E402
from moe_extension.kernels._routing import SINGLE_PROGRAM_MAX_PAIRS, route  # noqa: E402

# (E, topk) of the three benchmark models beside the zoo's
BENCHMARK_MODELS = {"gpt-oss-120b": (128, 4), "qwen3-30b-a3b": (128, 8), "mixtral-8x7b": (8, 2)}
BLOCK_M = 16
SETS = 4


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    grid_dependency(PDL)


def layers() -> dict[str, tuple[int, int]]:
    """Name -> (E, topk), one name per distinct pair (zoo order, then the benchmark models)."""
    out: dict[str, tuple[int, int]] = {}
    for name, shape in {**{n: (s["E"], s["topk"]) for n, s in ZOO.items()}, **BENCHMARK_MODELS}.items():
        if shape not in out.values():
            out[name] = shape
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_routing.py needs a CUDA device")
    dev = torch.device("cuda")
    pdl = pdl_capable(dev)
    torch.manual_seed(0)
    x = torch.zeros(1, device=dev)
    launch_us = time_graph_budget_us(lambda i: _empty_kernel[(1,)](x, **pdl_options(pdl, num_warps=4)), SETS)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}  block_m {BLOCK_M}  one empty launch {launch_us:.2f} us  (us per call)")
    print(f"{'layer':26s} {'E':>4s} {'topk':>4s} {'M':>5s} {'P':>5s} {'ours':>7s} {'3 launches':>10s}")
    for name, (E, topk) in layers().items():
        for M in args.tokens:
            sets = [torch.rand(M, E, device=dev).topk(topk, dim=1).indices.to(torch.int32) for _ in range(SETS)]
            ours = time_graph_budget_us(lambda i: route(sets[i % SETS], E, BLOCK_M, pdl=pdl), SETS)
            three = time_graph_budget_us(
                lambda i: route(sets[i % SETS], E, BLOCK_M, single_program_max_pairs=0, pdl=pdl), SETS)
            P = M * topk
            rows.append({"layer": name, "E": E, "topk": topk, "M": M, "P": P, "one_program": P <= SINGLE_PROGRAM_MAX_PAIRS,
                         "ours_us": ours, "three_launches_us": three})
            print(f"{name:26s} {E:4d} {topk:4d} {M:5d} {P:5d} {ours:7.2f} {three:10.2f}", flush=True)
    payload = {**device_info(), "block_m": BLOCK_M, "pdl": pdl, "launch_us": launch_us,
               "routing": "random: each token topk distinct experts (torch.rand(M, E).topk), 4 rotated sets",
               "timing": "CUDA-graph replay median per call (harness.time_graph_budget_us)", "rows": rows}
    print(write_json(f"routing_{gpu_slug()}.json", payload, args.out))


if __name__ == "__main__":
    main()
