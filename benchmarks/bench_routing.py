"""Latency of the device routing (``moe_extension.kernels._routing.route``), CUDA only.

The sorted schedule of ``fused_experts`` starts with this routing (expert-sorted, block-padded pair order from
``topk_ids``); at M 1-64 it is a fixed cost beside the two GEMMs. For each (E, topk) of public MoE layers
(``model_zoo.py`` and the three benchmark models) and M tokens, random routing (each token ``topk`` distinct
experts), the block_m of the bf16 heuristic for (M, E, topk) (16 where it runs the direct schedule), it times
in one run:

- ``ours``: ``route()`` as ``fused_experts`` launches it (PDL where the GPU has it): one program for
  ``P = M * topk <= SINGLE_PROGRAM_MAX_PAIRS`` pairs, three launches above;
- ``three_launches``: the three-launch schedule forced (``single_program_max_pairs=0``), at every P;
- ``against`` (with ``--against FILE``): ``route()`` of another version of ``kernels/_routing.py``
  (``git show REV:moe_extension/kernels/_routing.py > FILE``), launched as ``ours``; its outputs are checked equal
  to ours first;
- ``launch``: one empty single-program kernel launch, the floor of any one-launch routing under replay.

Times are medians of CUDA-graph replays over 4 rotated routings (``harness.time_graph_budget_us``); with
``--against``, ours and the other version alternate over 3 rounds (medians), so that both see the same clocks.
Prints a table and writes ``routing_<gpu>.json`` (device / torch / triton / command at the top level).

Run: python benchmarks/bench_routing.py [--tokens 1 8 16 64] [--against FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, device_info, gpu_slug, load_module, time_graph_budget_us, write_json  # noqa: E402
from model_zoo import ZOO  # noqa: E402

from moe_extension.kernels._configs import heuristic_config  # noqa: E402
from moe_extension.kernels._launch import grid_dependency, pdl_capable, pdl_options  # noqa: E402
from moe_extension.kernels._routing import SINGLE_PROGRAM_MAX_PAIRS, route  # noqa: E402

# (E, topk) of the three benchmark models beside the zoo's
BENCHMARK_MODELS = {"gpt-oss-120b": (128, 4), "qwen3-30b-a3b": (128, 8), "mixtral-8x7b": (8, 2)}
SETS = 4
ROUNDS = 3


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


def block_m_for(M: int, E: int, topk: int) -> int:
    """The sorted schedule's block_m for a bf16 call (the heuristic's; 16 where it runs the direct schedule)."""
    cfg = heuristic_config(M, E, 1024, 1024, topk, torch.bfloat16, True, True)
    return cfg.block_m if cfg.path == "sorted" else 16


def same_routing(a, b) -> bool:
    """Whether two Routing results agree (sorted rows past the used blocks are never written)."""
    used = int((a.block_expert >= 0).sum()) * a.block_m
    return (torch.equal(a.sorted_pairs[:used], b.sorted_pairs[:used]) and torch.equal(a.block_expert, b.block_expert)
            and torch.equal(a.inverse, b.inverse) and torch.equal(a.expert_counts, b.expert_counts)
            and torch.equal(a.expert_starts, b.expert_starts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--against", default=None, metavar="FILE",
                        help="also time route() of this copy of moe_extension/kernels/_routing.py")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_routing.py needs a CUDA device")
    other = load_module(args.against).route if args.against else None
    dev = torch.device("cuda")
    pdl = pdl_capable(dev)
    torch.manual_seed(0)
    x = torch.zeros(1, device=dev)
    launch_us = time_graph_budget_us(lambda i: _empty_kernel[(1,)](x, **pdl_options(pdl, num_warps=4)), SETS)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}  one empty launch {launch_us:.2f} us  (us per call)")
    print(f"{'layer':26s} {'E':>4s} {'topk':>4s} {'M':>5s} {'P':>6s} {'bm':>4s} {'ours':>7s} {'3 launches':>10s}"
          + (f" {'against':>8s}" if other else ""))
    for name, (E, topk) in layers().items():
        for M in args.tokens:
            sets = [torch.rand(M, E, device=dev).topk(topk, dim=1).indices.to(torch.int32) for _ in range(SETS)]
            bm = block_m_for(M, E, topk)
            P = M * topk
            row = {"layer": name, "E": E, "topk": topk, "M": M, "P": P, "block_m": bm,
                   "one_program": P <= SINGLE_PROGRAM_MAX_PAIRS}

            def ours(i):
                return route(sets[i % SETS], E, bm, pdl=pdl)

            if other is None:
                row["ours_us"] = time_graph_budget_us(ours, SETS)
            else:
                if not all(same_routing(route(s, E, bm), other(s, E, bm)) for s in sets):
                    sys.exit(f"{name} M={M}: the routing of {args.against} differs from ours")
                times = {"ours": [], "against": []}
                for _ in range(ROUNDS):
                    times["ours"].append(time_graph_budget_us(ours, SETS))
                    times["against"].append(time_graph_budget_us(lambda i: other(sets[i % SETS], E, bm, pdl=pdl), SETS))
                row["ours_us"] = statistics.median(times["ours"])
                row["against_us"] = statistics.median(times["against"])
            row["three_launches_us"] = time_graph_budget_us(
                lambda i: route(sets[i % SETS], E, bm, single_program_max_pairs=0, pdl=pdl), SETS)
            rows.append(row)
            print(f"{name:26s} {E:4d} {topk:4d} {M:5d} {P:6d} {bm:4d} {row['ours_us']:7.2f} "
                  f"{row['three_launches_us']:10.2f}" + (f" {row['against_us']:8.2f}" if other else ""), flush=True)
    payload = {**device_info(), "pdl": pdl, "launch_us": launch_us, "against": args.against,
               "block_m": "the bf16 heuristic's for (M, E, topk); 16 where it runs the direct schedule",
               "routing": "random: each token topk distinct experts (torch.rand(M, E).topk), 4 rotated sets",
               "timing": "CUDA-graph replay median per call (harness.time_graph_budget_us)"
                         + (f"; ours and against: medians of {ROUNDS} alternating rounds" if other else ""),
               "rows": rows}
    print(write_json(f"routing_{gpu_slug()}.json", payload, args.out))


if __name__ == "__main__":
    main()
