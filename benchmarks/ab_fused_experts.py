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
``--direct-pdl`` adds it with the direct schedule's tensor-core GEMVs launched with PDL whatever the
format (the launchers ``_gemv1`` / ``_gemv2`` wrapped by this script; the product does so for fp8 block only).
``--gemv-grids full`` (``work-list``) adds it with the direct schedule's tensor-core GEMVs launched with a program
per item (with work lists wherever the items do not fit on the GPU at once) whatever the format and shard
(``fused_experts._gemv_work_list`` replaced by this script).
``--zero-rows-in-gemv2`` adds it with the zero rows of the tokens without a local slot stored by gemv2's programs of
their slot 0 even where gemv1 takes a work list (whose programs store them otherwise; ``_gemv1`` wrapped by this
script to drop its ``zero_rows``).
``--other-schedule`` adds the heuristic's config of the schedule the table config does not run (direct or sorted).
``--table-from FILE`` adds the entry of another tuned table (``moe_extension/configs/<device>.json``, e.g. an H100's
on an H200, which runs the heuristic) for this cell, at the M bucket nearest ``--tokens``: the heuristic against a
tuned config on any GPU.
``--routing-from FILE`` adds the table config with the device routing of another version of
``moe_extension/kernels/_routing.py`` (``git show REV:moe_extension/kernels/_routing.py > FILE``): its ``route``
swapped in for the call, as the PDL options above swap launchers.
``--gemv-from FILE`` adds it with the direct schedule's tensor-core GEMV kernels of another version of
``moe_extension/kernels/_gemv_dot.py`` (``git show REV:moe_extension/kernels/_gemv_dot.py > FILE``), launched by this
version's launchers (launch options that the other kernels do not take left out).
``--grouped-gemm-from FILE`` adds it with the kernels of another version of ``moe_extension/kernels/_grouped_gemm.py``
(``git show REV:moe_extension/kernels/_grouped_gemm.py > FILE``: the sorted schedule's GEMMs, slot sum and row copy,
and the FMA GEMVs), that module swapped in for the call.
``--local-pairs K`` (with ``--local-experts``) reroutes every input set so that exactly K of its slots are local.
``--quant`` times MXFP4 (``mxfp4``, ``mxfp4_mma``) or fp8 block weights (the tuner's random stacks) instead of
bf16, and ``--local-experts L`` the first L of the model's E experts on this GPU (an ``expert_map`` over E;
random routing over all E, so most slots are elsewhere); triton_kernels is timed on bf16 weights of all E only.
``--activation`` times another activation than the benchmark's swigluoai (triton_kernels is then left out:
it fuses only swigluoai). ``--op expert_gemm2`` times the unfused
second GEMM (``expert_gemm2_triton`` on a random [M, topk, N] intermediate, router weights applied; the
routing included) instead of the whole op, without triton_kernels. ``--profile`` also prints each
kernel's mean time per call over eager calls on every input set (torch.profiler; short bursts, so clocks run above the
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
    p.add_argument("--other-schedule", action="store_true",
                   help="also time the heuristic's config of the other schedule (direct <-> sorted)")
    p.add_argument("--direct-pdl", action="store_true",
                   help="also time the table config with the direct schedule's GEMVs launched with PDL")
    p.add_argument("--gemv-grids", choices=("full", "work-list"), default=None,
                   help="also time the table config with the direct tensor-core GEMVs' grids forced: one program per "
                        "(tile, pair, split) item, or work lists where the items do not fit the GPU at once")
    p.add_argument("--zero-rows-in-gemv2", action="store_true",
                   help="also time the table config with the zero rows of tokens without a local slot from gemv2 "
                        "even where gemv1 takes a work list")
    p.add_argument("--table-from", default=None, metavar="FILE",
                   help="also time this tuned table's entry for the cell (a moe_extension/configs/*.json file)")
    p.add_argument("--routing-from", default=None, metavar="FILE",
                   help="also time the table config with the route() of this copy of kernels/_routing.py")
    p.add_argument("--gemv-from", default=None, metavar="FILE",
                   help="also time the table config with the direct GEMV kernels of this copy of kernels/_gemv_dot.py")
    p.add_argument("--grouped-gemm-from", default=None, metavar="FILE",
                   help="also time the table config with the kernels of this copy of kernels/_grouped_gemm.py")
    p.add_argument("--op", default="fused_experts", choices=["fused_experts", "expert_gemm2"],
                   help="what to time (default: the whole op)")
    p.add_argument("--quant", choices=("none", "mxfp4", "mxfp4_mma", "fp8_block"), default="none",
                   help="expert weight format (default: bf16 weights)")
    add_shard_arguments(p)
    args = p.parse_args(argv)
    if args.op == "expert_gemm2" and (args.no_pdl or args.persistent_pdl or args.direct_pdl or args.routing_from
                                      or args.gemv_from or args.grouped_gemm_from or args.zero_rows_in_gemv2):
        p.error("--no-pdl, --persistent-pdl, --direct-pdl, --routing-from, --gemv-from, --grouped-gemm-from and "
                "--zero-rows-in-gemv2 time fused_experts only")
    for opt, path in (("--routing-from", args.routing_from), ("--gemv-from", args.gemv_from),
                      ("--grouped-gemm-from", args.grouped_gemm_from)):
        if path is not None and not Path(path).is_file():
            p.error(f"{opt}: no file {path}")
    if args.table_from is not None and not Path(args.table_from).is_file():
        p.error(f"--table-from: no file {args.table_from}")
    check_shard_arguments(p, args)
    return args


def add_shard_arguments(p) -> None:
    """``--local-experts L`` and ``--local-pairs K``: the cell as an expert-parallel shard (this script's and
    ``profile_fused_experts.py``'s options; ``check_shard_arguments`` validates them)."""
    p.add_argument("--local-experts", type=int, default=None, metavar="L",
                   help="only the first L of the model's E experts here, through an expert_map")
    p.add_argument("--local-pairs", type=int, default=None, metavar="K",
                   help="with --local-experts: every input set routes exactly K of its M * topk slots here")


def check_shard_arguments(p, args) -> None:
    """``p.error`` where ``add_shard_arguments``' options do not fit together."""
    if args.local_experts is not None and args.local_experts < 1:
        p.error("--local-experts takes a positive count")
    if args.local_pairs is not None and (args.local_experts is None or args.local_pairs < 0):
        p.error("--local-pairs takes a count >= 0, with --local-experts")


def shard_sets(sets, local: int | None, pairs: int | None, E: int):
    """The input sets ``[(x, weights, ids)]`` with their routing rerouted by ``with_local_pairs`` (K = ``pairs``
    slots per set on the first ``local`` experts, the same generator seed for every caller), or as they are
    without ``pairs``."""
    if pairs is None:
        return sets
    import torch

    gen = torch.Generator().manual_seed(1)
    return [(x, g, with_local_pairs(ids, local, E, pairs, gen)) for x, g, ids in sets]


class KernelFrom:
    """A Triton kernel of another version of a module launched by this version's launcher: ``kernel[grid](...)``
    without the launch's upper-case (constexpr) keyword arguments that the kernel does not take; launch options
    (lower case: num_warps, launch_pdl, ...) and the kernel's own parameters pass."""

    def __init__(self, kernel):
        self.kernel = kernel

    def takes(self, name: str) -> bool:
        return name in self.kernel.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.kernel[grid](*args, **{k: v for k, v in kwargs.items() if self.takes(k) or k[0].islower()})
        return launch


def with_local_pairs(ids, L: int, E: int, k: int, gen):
    """``ids`` [M, topk] (distinct ids per token) rerouted so that exactly ``k`` slots, drawn at random, hold one of
    the first ``L`` experts and the others one of the rest (ids stay distinct within a token)."""
    import torch

    M, topk = ids.shape
    if not 0 <= k <= min(M * topk, M * L) or topk > E:
        raise ValueError(f"cannot route {k} of {M} x {topk} slots to {L} of {E} experts")
    out = torch.empty_like(ids)
    here = torch.zeros(M * topk, dtype=torch.bool)
    while True:  # k slots at random, at most L of them and at least topk - (E - L) in each token
        here[:] = False
        here[torch.randperm(M * topk, generator=gen)[:k]] = True
        n = here.view(M, topk).sum(dim=1)
        if ((n <= L) & (topk - n <= E - L)).all():
            break
    here = here.view(M, topk)
    for t in range(M):
        n = int(here[t].sum())
        local = torch.randperm(L, generator=gen)[:n]
        remote = L + torch.randperm(E - L, generator=gen)[:topk - n]
        out[t, here[t]] = local.to(ids.device, ids.dtype)
        out[t, ~here[t]] = remote.to(ids.device, ids.dtype)
    return out


def cell_weights(model: str, quant: str, local: int | None):
    """(w1, w2, expert_map) of the cell: the model's weights in ``quant`` (the tuner's random stacks, drawn after
    ``torch.manual_seed(0)``), the first ``local`` experts of them with the map of E ids onto them."""
    import torch
    import tune_fused_experts as T

    d = T.MODELS[model]
    E, K, N = d["E"], d["K"], d["N"]
    L = E if local is None else min(local, E)
    torch.manual_seed(0)
    if quant == "none":
        w1, w2 = T.make_weights(L, K, N, torch.bfloat16, "linear")
    elif quant == "fp8_block":
        w1, w2 = T.make_fp8_weights(L, K, N, "linear")
    else:
        w1, w2 = T.make_mxfp4_weights(L, K, N, "linear", quant)
    expert_map = None
    if local is not None:
        expert_map = torch.full((E,), -1, dtype=torch.int32, device=T.DEVICE)
        expert_map[:L] = torch.arange(L, dtype=torch.int32, device=T.DEVICE)
    return w1, w2, expert_map


def table_entry(path: str, key: str, M: int):
    """The MoeConfig of tuned table ``path`` for ``key`` at the M bucket nearest M on a log scale (``get_config``'s
    measure; unsanitized), or None when the table has no entry for the key."""
    from moe_extension.kernels._configs import _nearest_bucket, read_table

    per_m = read_table(path).get(key, {})
    return per_m[_nearest_bucket(list(per_m), M)] if per_m else None


def apply(cfg, variant: dict):
    """cfg with the overrides of ``variant`` (block_m, gemm1 / gemm2 fields)."""
    changes = {k: v for k, v in variant.items() if k not in ("gemm1", "gemm2")}
    for name in ("gemm1", "gemm2"):
        if name in variant:
            changes[name] = dataclasses.replace(getattr(cfg, name), **variant[name])
    return dataclasses.replace(cfg, **changes)


def kernel_times_us(fn, calls: int = 5) -> dict[str, float]:
    """Mean device time (us) per call of each kernel that fn(i) launches, over the eager calls fn(0) ..
    fn(calls - 1) (the caller's input sets in turn: an expert-parallel shard's routings differ in their local
    pairs, one set may have none)."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
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

    if not torch.cuda.is_available():
        print("ab_fused_experts: needs a CUDA device", file=sys.stderr)
        return 2
    d = T.MODELS[args.model]
    E, topk, K, N, M = d["E"], d["topk"], d["K"], d["N"], args.tokens
    w1_ops, w2_ops, expert_map = cell_weights(args.model, args.quant, args.local_experts)
    w1, w2, quant_args = T.fused_call_args(w1_ops, w2_ops)
    sets = shard_sets(T.make_sets(E, topk, K, M, torch.bfloat16, args.sets), args.local_experts, args.local_pairs, E)
    n = len(sets)
    table = fe.select_config(M, sets[0][0], fe.WeightOperand.of(w1_ops), fe.WeightOperand.of(w2_ops), topk, None,
                             args.quant, expert_map)
    configs = {"table": table}
    configs.update({f"variant {i}": apply(table, json.loads(v)) for i, v in enumerate(args.variant)})
    if args.other_schedule:
        from moe_extension.kernels._configs import heuristic_config, sanitize

        lt = fe.local_tokens(M, w1.shape[0], expert_map, args.quant, topk=topk)
        other = heuristic_config(lt, w1.shape[0], N, K, topk, torch.bfloat16, True, True,
                                 torch.cuda.get_device_properties(0).multi_processor_count, args.quant,
                                 path="sorted" if table.path == "direct" else "direct")
        configs["other schedule"] = sanitize(other, torch.bfloat16, N, K, topk, args.quant)
    if args.table_from:
        from moe_extension.kernels._configs import sanitize, table_key

        key = table_key(w1.shape[0], N, K, topk, torch.bfloat16, True, True, args.quant)
        entry = table_entry(args.table_from, key, M)
        if entry is None:
            print(f"ab_fused_experts: {args.table_from} has no entry {key}", file=sys.stderr)
            return 2
        configs["table from " + Path(args.table_from).stem] = sanitize(entry, torch.bfloat16, N, K, topk, args.quant)
    if args.op == "expert_gemm2":
        inter = [torch.randn(M, topk, N, dtype=torch.bfloat16, device=w2.device) for _ in range(n)]
        gemm2_args = {k: v for k, v in quant_args.items() if k != "w1_scale"}

        def call(c, i, pdl=True):
            return expert_gemm2_triton(inter[i % n], w2, sets[i % n][2], topk_weights=sets[i % n][1], config=c,
                                       expert_map=expert_map, **gemm2_args)
    else:
        def call(c, i, pdl=True):
            return fused_experts_triton(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2], args.activation,
                                        config=c, expert_map=expert_map, pdl=pdl, **quant_args)
    runs = {name: (lambda i, c=c: call(c, i)) for name, c in configs.items()}
    if args.no_pdl:
        runs["table, no PDL"] = lambda i: call(table, i, pdl=False)
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
    if args.direct_pdl:
        launch_gemvs = fe._gemv1, fe._gemv2

        def direct_pdl(i):
            # both GEMVs launched with PDL, for this call only (captured with the call, as above)
            on = fe.pdl_capable(sets[0][0].device)
            fe._gemv1 = lambda *a, pdl=False, **k: launch_gemvs[0](*a, pdl=on, **k)
            fe._gemv2 = lambda *a, pdl=False, **k: launch_gemvs[1](*a, pdl=on, **k)
            try:
                return call(table, i)
            finally:
                fe._gemv1, fe._gemv2 = launch_gemvs

        runs["table, direct GEMVs PDL"] = direct_pdl
    if args.gemv_grids:
        work_list_rule = fe._gemv_work_list

        def forced_grids(i):
            # the GEMVs' grids as asked, for this call only (captured with the call, as above)
            fe._gemv_work_list = lambda w, pairs: args.gemv_grids == "work-list"
            try:
                return call(table, i)
            finally:
                fe._gemv_work_list = work_list_rule

        runs[f"table, GEMV grids {args.gemv_grids}"] = forced_grids
    if args.zero_rows_in_gemv2:
        launch_gemv1 = fe._gemv1

        def zero_rows_in_gemv2(i):
            # gemv1 without the zero rows, for this call only (captured with the call, as above): gemv2 stores them
            fe._gemv1 = lambda *a, zero_rows=None, **k: launch_gemv1(*a, **k)
            try:
                return call(table, i)
            finally:
                fe._gemv1 = launch_gemv1

        runs["table, zero rows in gemv2"] = zero_rows_in_gemv2
    def with_attr(name, value):
        # the table config with fe.<name> replaced for this call only (captured with the call, as above)
        def run(i):
            own = getattr(fe, name)
            setattr(fe, name, value)
            try:
                return call(table, i)
            finally:
                setattr(fe, name, own)

        return run

    if args.routing_from:
        from harness import load_module

        # the other version's route()
        runs["table, routing from " + Path(args.routing_from).name] = with_attr(
            "route", load_module(args.routing_from).route)
    if args.gemv_from:
        from harness import load_module

        other = load_module(args.gemv_from)
        own = fe.gemv1_dot_kernel, fe.gemv2_dot_kernel, fe._gemv_work_list
        shims = tuple(KernelFrom(k) for k in (other.gemv1_dot_kernel, other.gemv2_dot_kernel))

        def other_gemvs(i):
            # the other version's GEMV kernels for this call only (captured with the call, as above); without a
            # WORK_LIST parameter, one program per item
            fe.gemv1_dot_kernel, fe.gemv2_dot_kernel = shims
            if not shims[0].takes("WORK_LIST"):
                fe._gemv_work_list = lambda w, pairs: False
            try:
                return call(table, i)
            finally:
                fe.gemv1_dot_kernel, fe.gemv2_dot_kernel, fe._gemv_work_list = own

        runs["table, GEMVs from " + Path(args.gemv_from).name] = other_gemvs
    if args.grouped_gemm_from:
        from harness import load_module

        # the other version's kernels of _grouped_gemm (the module the launchers call them through)
        runs["table, kernels from " + Path(args.grouped_gemm_from).name] = with_attr(
            "kern", load_module(args.grouped_gemm_from))
    if (tk.is_available() and args.activation == T.ACTIVATION and args.op == "fused_experts" and args.quant == "none"
            and args.local_experts is None):
        runs["triton_kernels"] = lambda i: tk.fused_experts(sets[i % n][0], w1, w2, sets[i % n][1], sets[i % n][2],
                                                            T.ACTIVATION)
    what = args.activation if args.op == "fused_experts" else args.op
    where = "" if args.local_experts is None else f"  {args.local_experts} of {E} experts here"
    if args.local_pairs is not None:
        where += f", {args.local_pairs} local pairs per set"
    print(f"{torch.cuda.get_device_name()}  {args.model} M={M}  {what}  quant={args.quant}{where}  "
          f"{args.rounds} interleaved rounds")
    ref = runs["table"](0)
    for name, c in configs.items():
        out = runs[name](0)
        same = torch.equal(out, ref)
        diff = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        err = "" if same else f" (max |diff| / max |table| {diff.item():.1e})"
        print(f"  {name:14s} {c.path} block_m {c.block_m}  gemm1 {T.tile_name(c.gemm1)} | gemm2 {T.tile_name(c.gemm2)}"
              f"  bitwise equal to table: {same}{err}")
    for name in runs:
        if name.startswith("table, "):
            print(f"  {name}  bitwise equal to table: {torch.equal(runs[name](0), ref)}")
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(T.time_us(fn, n))
    for name, v in times.items():
        print(f"  {name:14s} " + " ".join(f"{x:8.1f}" for x in v) + f"   median {statistics.median(v):8.1f} us")
    if args.profile:
        for name, fn in runs.items():
            times = kernel_times_us(fn, max(5, n))
            print(f"  {name:14s} eager per kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
                  + f"; sum {sum(times.values()):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
