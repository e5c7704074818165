"""Expert-parallel MoE layer (``moe_extension.parallel``) on W GPUs: per-phase times, weak-scaling
efficiency and all_to_all bandwidth against plain NCCL, in one run.

Layer: DeepSeek-V3-like, E 256 experts (E / W per rank, contiguous), topk 8, K 7168, N 2048, silu, bf16
weights (``--quant fp8_block``: e4m3 weights with 128x128 block scales). Per rank M tokens (``--tokens``),
routing ``uniform`` (topk distinct experts, uniform) or ``skewed`` (rank 0's experts 3x as likely per slot as
the others': with W = 2 about 3/4 of the slots land on rank 0). Rows move in bf16 or, ``--dispatch fp8``,
as e4m3 with per-128-column scales. Two modes: ``exact`` (capacity None: exact split sizes, one host sync)
and ``fixed`` (capacity = M: no host sync, what a captured decode step runs).

Per cell, medians over iterations (ms); a time of the whole call is the slowest rank's:
- ``dispatch`` (plan + pack + all_to_all), ``experts`` (``fused_experts`` on the received rows), ``combine``
  (all_to_all back + the per-token sum), between CUDA events, eager, each call from an idle GPU (so the host's
  issue time counts), the three phases of the rank whose experts ended last (a faster rank's combine holds
  its wait for the slower rank's experts).
- ``total``: the layer's forward call timed on its own, eager from an idle GPU; ``total_stream``: per call of
  ``iters`` calls issued back to back, eager (the host issues the next call while the GPU runs this one, as
  between the layers of a model); with a capacity also ``total_graph``: the call captured in a CUDA graph and
  replayed (what a captured decode step runs).
- ``single_gpu`` / ``single_gpu_stream`` / ``single_gpu_graph``: ``fused_experts`` on rank 0 alone with its
  E / W experts and M tokens routed uniformly over them (the same work per GPU as the uniform EP cell), timed
  the same three ways; ``weak_scaling = single_gpu / total`` and likewise ``weak_scaling_stream`` and
  ``weak_scaling_graph``. ``single_gpu_halves_graph``: the same tokens as two calls of M / 2 (CUDA graph): what
  splitting a batch into two micro-batches, to overlap one's collectives with the other's experts, costs in
  expert time (the weights are read twice), against the collectives' time it could hide.
- ``a2a_dispatch`` / ``a2a_combine``: a plain ``all_to_all_single`` of the same rows (same split sizes) in the
  same run; ``dispatch_bw`` etc.: bytes that leave a rank per second, and ``*_vs_plain`` their ratio. With a
  capacity on CUDA, the same from CUDA graphs of each phase alone and of the plain collectives
  (``dispatch_graph``, ``a2a_dispatch_graph``, ``dispatch_vs_plain_graph``, ...): the phases' GPU time without
  the host's; ``plan_graph`` and ``pack_graph``: the two launches of the dispatch before its all_to_all.

usage (on a machine with W GPUs): python benchmarks/bench_ep.py --world 2 [--tokens 128 4096]
    [--routing uniform skewed] [--quant none fp8_block] [--dispatch auto fp8] [--out DIR]
``--small --backend gloo``: a tiny layer on CPU processes (checks the script, not the numbers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

FULL = {"E": 256, "topk": 8, "K": 7168, "N": 2048}
SMALL = {"E": 8, "topk": 3, "K": 256, "N": 128}


def _mark(device):
    if device.type == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def _ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(times: list[float], device) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _of_last_rank(phases: list[float], device) -> list[float]:
    """``[dispatch, experts, combine]`` of the rank that reached the combine last (its experts ended last): the
    others' combine holds their wait for it."""
    mine = torch.tensor(phases, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max((t.tolist() for t in every), key=lambda p: p[0] + p[1])


def _stream_ms(call, reps: int, device, together: bool = True) -> float:
    """Milliseconds per call of ``reps`` calls issued back to back (the host runs ahead of the GPU), eager;
    ``together``: every rank starts at a barrier."""
    if together:
        dist.barrier()
    _sync(device)
    a = _mark(device)
    for _ in range(reps):
        call()
    b = _mark(device)
    _sync(device)
    return _ms(a, b) / reps


def _graph_ms(call, iters: int, warmup: int, device) -> float:
    """Median milliseconds of one replay of ``call`` captured in a CUDA graph (every rank replays together)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for it in range(warmup + iters):
        dist.barrier()
        _sync(device)
        a = _mark(device)
        graph.replay()
        b = _mark(device)
        _sync(device)
        if it >= warmup:
            times.append(_slowest([_ms(a, b)], device)[0])
    del graph
    return statistics.median(times)


def make_routing(M: int, E: int, topk: int, kind: str, owner: torch.Tensor, device, gen) -> tuple:
    """(topk_weights fp32, topk_ids int32) of M tokens: topk distinct experts, uniform or skewed to rank 0."""
    weight = torch.ones(E)
    if kind == "skewed":
        weight[owner == 0] = 3.0
    keys = torch.rand(M, E, generator=gen).log() / weight  # Efraimidis-Spirakis: top-k of u^(1/w)
    ids = keys.topk(topk, dim=1).indices.int()
    weights = torch.rand(M, topk, generator=gen).softmax(dim=1)
    return weights.to(device), ids.to(device)


def make_weights(e_local: int, K: int, N: int, quant: str, device) -> dict:
    if quant == "fp8_block":
        from harness import random_fp8_block_stack

        w1, s1 = random_fp8_block_stack(e_local, 2 * N, K, device, seed=1)
        w2, s2 = random_fp8_block_stack(e_local, K, N, device, seed=2)
        return {"w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": s2, "quant": quant}
    w1 = torch.randn(e_local, 2 * N, K, dtype=torch.bfloat16, device=device) / K ** 0.5
    w2 = torch.randn(e_local, K, N, dtype=torch.bfloat16, device=device) / N ** 0.5
    return {"w1": w1, "w2": w2, "quant": quant}


def bench_cell(layer, weights: dict, M: int, routing: str, mode: str, dispatch_dtype: str, shape: dict, device,
               iters: int, warmup: int) -> dict:
    from moe_extension.parallel import combine, dispatch
    from moe_extension.parallel.exchange import pack, plan, resolve_group

    rank, W = dist.get_rank(), dist.get_world_size()
    group = resolve_group(layer.group_name)
    gen = torch.Generator().manual_seed(1000 * rank + M)
    x = torch.randn(M, shape["K"], generator=gen).to(device=device, dtype=torch.bfloat16)
    tw, ids = make_routing(M, shape["E"], shape["topk"], routing, layer.expert_owner.cpu(), device, gen)
    layer.capacity = M if mode == "fixed" else None
    layer.dispatch_dtype = dispatch_dtype
    experts_kwargs = {"expert_map": layer.expert_map, "quant": weights["quant"],
                      "w1_scale": weights.get("w1_scale"), "w2_scale": weights.get("w2_scale")}
    phases, totals, plain = [], [], []
    for it in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = _mark(device)
        d = dispatch(x, tw, ids, layer.expert_owner, group, layer.capacity, dispatch_dtype == "fp8")
        t1 = _mark(device)
        y = torch.ops.moe_ext.fused_experts(d.fmt.hidden_states(d.recv), weights["w1"], weights["w2"],
                                            d.fmt.weights(d.recv).contiguous(), d.fmt.ids(d.recv).contiguous(),
                                            **experts_kwargs)
        t2 = _mark(device)
        combine(d, y, group, x.dtype)
        t3 = _mark(device)
        _sync(device)
        dist.barrier()
        s0 = _mark(device)
        layer(x, tw, ids)
        s1 = _mark(device)
        # plain all_to_all_single of the same rows, both directions
        send = torch.empty((d.plan.rows, d.fmt.row_bytes), dtype=torch.uint8, device=device)
        recv = torch.empty_like(d.recv)
        back = torch.empty((send.shape[0], y.shape[1]), dtype=y.dtype, device=device)
        sizes = (d.recv_counts, d.send_counts)
        dist.barrier()
        p0 = _mark(device)
        if d.send_counts is None:
            dist.all_to_all_single(recv, send)
        else:
            dist.all_to_all_single(recv, send[: sum(d.send_counts)], *sizes)
        p1 = _mark(device)
        if d.send_counts is None:
            dist.all_to_all_single(back, y)
        else:
            dist.all_to_all_single(back[: sum(d.send_counts)], y, d.send_counts, d.recv_counts)
        p2 = _mark(device)
        _sync(device)
        if it >= warmup:
            phases.append(_of_last_rank([_ms(t0, t1), _ms(t1, t2), _ms(t2, t3)], device))
            totals.append(_slowest([_ms(s0, s1)], device)[0])
            plain.append(_slowest([_ms(p0, p1), _ms(p1, p2)], device))
    stream = _slowest([_stream_ms(lambda: layer(x, tw, ids), iters, device)], device)[0]
    graphs = {}
    if mode == "fixed" and device.type == "cuda":
        # the call replayed (what a captured decode step runs), then each phase alone and the plain collectives
        graphs["total_graph"] = _graph_ms(lambda: layer(x, tw, ids), iters, warmup, device)
        is_fp8 = dispatch_dtype == "fp8"
        graphs["dispatch_graph"] = _graph_ms(
            lambda: dispatch(x, tw, ids, layer.expert_owner, group, layer.capacity, is_fp8), iters, warmup, device)
        graphs["plan_graph"] = _graph_ms(lambda: plan(ids, layer.expert_owner, W, layer.capacity), iters, warmup,
                                         device)
        graphs["pack_graph"] = _graph_ms(lambda: pack(x, tw, ids, layer.expert_owner, d.plan, d.fmt), iters, warmup,
                                         device)
        graphs["combine_graph"] = _graph_ms(lambda: combine(d, y, group, x.dtype), iters, warmup, device)
        graphs["a2a_dispatch_graph"] = _graph_ms(lambda: dist.all_to_all_single(recv, send), iters, warmup, device)
        graphs["a2a_combine_graph"] = _graph_ms(lambda: dist.all_to_all_single(back, y), iters, warmup, device)
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    # bytes that leave each rank (rows for other ranks), the largest over the ranks
    rows_off = d.plan.counts.clone()
    rows_off[rank] = 0
    off = torch.tensor([int(rows_off.sum())], dtype=torch.float64, device=device)
    dist.all_reduce(off, op=dist.ReduceOp.MAX)
    out_bytes = off.item() * d.fmt.row_bytes
    back_bytes = off.item() * shape["K"] * x.element_size()
    res = {"M": M, "routing": routing, "mode": mode, "dispatch_dtype": dispatch_dtype, "quant": weights["quant"],
           "dispatch": med(phases, 0), "experts": med(phases, 1), "combine": med(phases, 2),
           "total": statistics.median(totals), "total_stream": stream, "a2a_dispatch": med(plain, 0),
           "a2a_combine": med(plain, 1), "dispatch_bytes_off_rank": out_bytes, "combine_bytes_off_rank": back_bytes,
           **graphs}
    res["dispatch_bw"] = out_bytes / (res["dispatch"] * 1e-3)
    res["combine_bw"] = back_bytes / (res["combine"] * 1e-3)
    res["dispatch_vs_plain"] = res["a2a_dispatch"] / res["dispatch"]
    res["combine_vs_plain"] = res["a2a_combine"] / res["combine"]
    if graphs:
        res["dispatch_vs_plain_graph"] = graphs["a2a_dispatch_graph"] / graphs["dispatch_graph"]
        res["combine_vs_plain_graph"] = graphs["a2a_combine_graph"] / graphs["combine_graph"]
    return res


def single_gpu(weights: dict, M: int, shape: dict, device, iters: int, warmup: int) -> dict:
    """fused_experts of M tokens over this rank's experts alone (uniform routing), ms: ``single_gpu`` (median,
    eager from an idle GPU), ``single_gpu_stream`` (back to back) and, on CUDA, ``single_gpu_graph`` (per call
    replayed in a CUDA graph)."""
    e_local = weights["w1"].shape[0]
    gen = torch.Generator().manual_seed(7 + M)
    x = torch.randn(M, shape["K"], generator=gen).to(device=device, dtype=torch.bfloat16)
    tw, ids = make_routing(M, e_local, min(shape["topk"], e_local), "uniform", torch.zeros(e_local), device, gen)
    kw = {k: weights.get(k) for k in ("w1_scale", "w2_scale")}

    def call(_=None):
        return torch.ops.moe_ext.fused_experts(x, weights["w1"], weights["w2"], tw, ids, quant=weights["quant"], **kw)

    times = []
    for it in range(warmup + iters):
        _sync(device)
        a = _mark(device)
        call()
        b = _mark(device)
        _sync(device)
        if it >= warmup:
            times.append(_ms(a, b))
    res = {"single_gpu": statistics.median(times), "single_gpu_stream": _stream_ms(call, iters, device, together=False)}
    if device.type == "cuda":
        from harness import time_graph_us

        res["single_gpu_graph"] = time_graph_us(call, reps=5, replays=iters) / 1e3
        if M >= 2:  # the same tokens as two micro-batches: what splitting a batch to overlap its traffic costs
            h = M // 2

            def halves(_=None):
                for part in (slice(0, h), slice(h, M)):
                    torch.ops.moe_ext.fused_experts(x[part], weights["w1"], weights["w2"], tw[part], ids[part],
                                                    quant=weights["quant"], **kw)

            res["single_gpu_halves_graph"] = time_graph_us(halves, reps=5, replays=iters) / 1e3
    return res


def _worker(rank: int, args, store: str) -> None:
    backend = args.backend
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=args.world)
    from moe_extension.parallel import ExpertParallelMoE, contiguous_expert_map

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    shape = SMALL if args.small else FULL
    emap = contiguous_expert_map(shape["E"], args.world, rank)
    e_local = int((emap >= 0).sum())
    cells = []
    for quant in args.quant:
        torch.manual_seed(rank)
        weights = make_weights(e_local, shape["K"], shape["N"], quant, device)
        layer = ExpertParallelMoE(weights["w1"], weights["w2"], emap.to(device), quant=quant,
                                  w1_scale=weights.get("w1_scale"), w2_scale=weights.get("w2_scale"))
        for M in args.tokens:
            # rank 0 alone; the others wait at the barrier
            base = single_gpu(weights, M, shape, device, args.iters, args.warmup) if rank == 0 else {}
            dist.barrier()
            for routing in args.routing:
                for dispatch_dtype in args.dispatch:
                    for mode in args.modes:
                        res = bench_cell(layer, weights, M, routing, mode, dispatch_dtype, shape, device,
                                         args.iters, args.warmup)
                        if rank == 0:
                            for how in ("", "_stream", "_graph"):
                                if "total" + how in res and "single_gpu" + how in base:
                                    res["single_gpu" + how] = base["single_gpu" + how]
                                    res["weak_scaling" + how] = base["single_gpu" + how] / res["total" + how]
                            if "single_gpu_halves_graph" in base:
                                res["single_gpu_halves_graph"] = base["single_gpu_halves_graph"]
                            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in res.items()), flush=True)
                        cells.append(res)
        del layer, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        from harness import device_info, gpu_slug, write_json

        info = device_info("python " + " ".join(sys.argv)) if device.type == "cuda" else {"device": "cpu"}
        name = f"ep_w{args.world}_{gpu_slug() if device.type == 'cuda' else 'cpu'}{'_small' if args.small else ''}.json"
        path = write_json(name, {**info, "world_size": args.world, "backend": backend, "layer": shape,
                                 "cells": cells}, args.out)
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--routing", nargs="+", choices=("uniform", "skewed"), default=["uniform", "skewed"])
    p.add_argument("--quant", nargs="+", choices=("none", "fp8_block"), default=["none"])
    p.add_argument("--dispatch", nargs="+", choices=("auto", "fp8"), default=["auto", "fp8"])
    p.add_argument("--modes", nargs="+", choices=("exact", "fixed"), default=["exact", "fixed"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a tiny layer (script check)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.out is None:
        from harness import RESULTS_DIR

        args.out = str(RESULTS_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
