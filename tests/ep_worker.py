"""Multi-process runs of the expert-parallel tests: ``run_cases(world_size, names, backend)`` spawns W ranks
(gloo on CPU tensors, or NCCL with one GPU per rank), each runs the named cases of ``CASES`` in order and
writes what it measured (or the exception it raised) to a JSON file; returns ``{name: [rank 0's, ...]}``.

Every rank builds the same problem from the case's seed: all experts (``random_experts``), every rank's tokens
and routing, the expert placement. It runs ``ExpertParallelMoE`` on its own tokens with its own experts and
compares with ``fused_experts`` on one process holding every expert (experts held by no rank mapped to -1):
``err`` is ``tests.utils.rel_err`` (||out - ref|| / ||ref||, inf where out is not finite).
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.utils import rel_err

TIMEOUT = datetime.timedelta(seconds=180)  # a rank left waiting in a collective fails instead of hanging


def run_cases(world_size: int, names: list[str], backend: str = "gloo") -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, names, backend, tmp), nprocs=world_size, join=True)
        per_rank = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [per_rank[r][name] for r in range(world_size)] for name in names}


def _worker(rank: int, world_size: int, names: list[str], backend: str, tmp: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    import moe_extension  # noqa: F401  (registers the ops)

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    results = {}
    for name in names:
        try:
            results[name] = {"ok": True, **CASES[name](Ctx(rank, world_size, device))}
        except Exception as e:  # noqa: BLE001  (recorded for the test to check)
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device


@dataclass
class Problem:
    """One rank's view of a case: its tokens, routing, experts, map, and the whole layer's weights."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    local: dict
    full: dict
    expert_map: torch.Tensor
    union_map: torch.Tensor
    all_tokens: list


def _placement(kind: str, E: int, W: int, gen: torch.Generator) -> list[torch.Tensor]:
    from moe_extension.parallel import contiguous_expert_map

    if kind == "contiguous":
        return [contiguous_expert_map(E, W, r) for r in range(W)]
    order = torch.randperm(E, generator=gen)
    held = E - 1 if kind == "gapped" else E  # "gapped": the last expert of ``order`` is held by no rank
    maps = [torch.full((E,), -1, dtype=torch.int32) for _ in range(W)]
    for r in range(W):
        mine = order[:held][r::W]
        maps[r][mine] = torch.randperm(mine.numel(), generator=gen).int()
    return maps


def make_problem(ctx: Ctx, seed: int, *, E: int = 8, K: int = 64, N: int = 48, topk: int = 3, ms=None,
                 dtype=torch.float32, quant: str = "none", bias: bool = False, placement: str = "contiguous",
                 routing: str = "random", invalid: float = 0.15) -> Problem:
    from tests.reference import random_experts, random_routing

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    full = random_experts(E, K, N, quant, dtype, bias=bias)
    maps = _placement(placement, E, ctx.world, gen)
    ms = ms or [int(v) for v in torch.randint(1, 10, (ctx.world,), generator=gen)]
    tokens = []
    for r in range(ctx.world):
        x = torch.randn(ms[r], K).to(dtype)
        weights, ids = random_routing(ms[r], E, topk, invalid=invalid)
        if routing == "skewed":  # every slot on an expert of rank 0
            mine = (maps[0] >= 0).nonzero().flatten().int()
            ids = mine[torch.randint(0, mine.numel(), ids.shape)]
        tokens.append((x, weights, ids))
    union = torch.full((E,), -1, dtype=torch.int32)
    for m in maps:
        union = torch.where(m >= 0, torch.arange(E, dtype=torch.int32), union)
    held = (maps[ctx.rank] >= 0).nonzero().flatten()
    order = held[maps[ctx.rank][held].argsort()]  # global ids in local order
    local = {k: None if v is None else v[order] for k, v in full.items()}
    dev = ctx.device
    to = lambda d: {k: None if v is None else v.to(dev) for k, v in d.items()}  # noqa: E731
    x, weights, ids = (t.to(dev) for t in tokens[ctx.rank])
    return Problem(x, weights, ids, to(local), to(full), maps[ctx.rank].to(dev), union.to(dev),
                   [tuple(t.to(dev) for t in tok) for tok in tokens])


def _weights_kwargs(d: dict, quant: str) -> dict:
    return {"w1_bias": d["w1_bias"], "w2_bias": d["w2_bias"], "quant": quant, "w1_scale": d["w1_scale"],
            "w2_scale": d["w2_scale"]}


def layer_of(p: Problem, quant: str = "none", **kwargs):
    from moe_extension.parallel import ExpertParallelMoE

    # the map on the host: the layer moves it to the weights' device (NCCL gathers CUDA tensors)
    return ExpertParallelMoE(p.local["w1"], p.local["w2"], p.expert_map.cpu(), **_weights_kwargs(p.local, quant),
                             **kwargs)


def reference(p: Problem, x=None, quant: str = "none", activation: str = "silu", on_input: bool = False,
              weights=None, ids=None) -> torch.Tensor:
    return torch.ops.moe_ext.fused_experts(
        p.x if x is None else x, p.full["w1"], p.full["w2"], p.weights if weights is None else weights,
        p.ids if ids is None else ids, activation, expert_map=p.union_map, apply_router_weight_on_input=on_input,
        **_weights_kwargs(p.full, quant),
    )


def _compare(p: Problem, out: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"err": rel_err(out, ref), "shape_ok": list(out.shape) == list(ref.shape), "dtype": str(out.dtype),
            "M": p.x.shape[0]}


# ----------------------------------------------------------------------------------------------------- cases

def _basic(ctx, seed, capacity=None, **problem):
    p = make_problem(ctx, seed, **problem)
    cap = None if capacity is None else max(len(t[0]) for t in p.all_tokens) if capacity == "worst" else capacity
    return _compare(p, layer_of(p, capacity=cap)(p.x, p.weights, p.ids), reference(p))


def case_random(ctx):
    return _basic(ctx, 1)


def case_random_bf16(ctx):
    return _basic(ctx, 2, dtype=torch.bfloat16, topk=4)


def case_random_fixed(ctx):
    return _basic(ctx, 3, capacity="worst")


def case_skewed(ctx):
    return _basic(ctx, 4, routing="skewed", invalid=0.0)


def case_skewed_fixed(ctx):
    return _basic(ctx, 4, capacity="worst", routing="skewed", invalid=0.0)


def case_invalid_ids(ctx):
    return _basic(ctx, 5, invalid=0.5, placement="gapped")


def case_permuted_map(ctx):
    return _basic(ctx, 6, placement="permuted", topk=5, E=12)


def case_empty_ranks(ctx):
    ms = [0 if r % 2 else 6 for r in range(ctx.world)]
    return _basic(ctx, 7, ms=ms)


def case_empty_ranks_fixed(ctx):
    ms = [0 if r % 2 else 6 for r in range(ctx.world)]
    return _basic(ctx, 7, ms=ms, capacity=6)


def case_fixed_equals_exact(ctx):
    p = make_problem(ctx, 8, topk=4)
    exact = layer_of(p)(p.x, p.weights, p.ids)
    fixed = layer_of(p, capacity=16)(p.x, p.weights, p.ids)
    ref = reference(p)
    return {"equal": bool(torch.equal(exact, fixed)), "err": rel_err(exact, ref), "err_fixed": rel_err(fixed, ref),
            "device": ctx.device.type}


def case_on_input_bias_swigluoai(ctx):
    p = make_problem(ctx, 9, bias=True, N=32)
    layer = layer_of(p, activation="swigluoai", alpha=1.5, limit=5.0)
    out = layer(p.x, p.weights, p.ids, apply_router_weight_on_input=True)
    ref = torch.ops.moe_ext.fused_experts(p.x, p.full["w1"], p.full["w2"], p.weights, p.ids, "swigluoai",
                                          expert_map=p.union_map, apply_router_weight_on_input=True, alpha=1.5,
                                          limit=5.0, **_weights_kwargs(p.full, "none"))
    return _compare(p, out, ref)


def _fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """What the experts receive with dispatch_dtype="fp8": x quantized per 128 columns, multiplied out."""
    from moe_extension.quant.fp8_block import fake_quantize_fp8_per_token_group

    return fake_quantize_fp8_per_token_group(x).to(x.dtype)


def case_fp8_dispatch(ctx):
    p = make_problem(ctx, 10, dtype=torch.bfloat16, K=200, N=40)
    out = layer_of(p, dispatch_dtype="fp8", capacity=9)(p.x, p.weights, p.ids)
    res = _compare(p, out, reference(p, x=_fp8_rows(p.x)))
    res["err_vs_unquantized"] = rel_err(out, reference(p))
    return res


def case_quant_fp8_block(ctx):
    p = make_problem(ctx, 11, dtype=torch.bfloat16, quant="fp8_block", K=160, N=96)
    out = layer_of(p, "fp8_block", dispatch_dtype="fp8")(p.x, p.weights, p.ids)
    return _compare(p, out, reference(p, x=_fp8_rows(p.x), quant="fp8_block"))


def case_quant_mxfp4(ctx):
    p = make_problem(ctx, 12, dtype=torch.bfloat16, quant="mxfp4", K=64, N=64, bias=True)
    out = layer_of(p, "mxfp4", activation="swigluoai")(p.x, p.weights, p.ids)
    return _compare(p, out, reference(p, quant="mxfp4", activation="swigluoai"))


def case_logits(ctx):
    p = make_problem(ctx, 13, E=16, topk=4)
    logits = torch.randn(p.x.shape[0], 16, device=ctx.device)
    bias = torch.randn(16, device=ctx.device)
    kw = {"num_expert_group": 4, "topk_group": 2, "scoring_func": "sigmoid", "e_score_correction_bias": bias,
          "routed_scaling_factor": 2.5}
    out = layer_of(p).forward_logits(p.x, logits, 4, True, **kw)
    weights, ids = torch.ops.moe_ext.grouped_topk(logits, 4, True, **kw)
    return _compare(p, out, reference(p, weights=weights, ids=ids))


def case_deterministic(ctx):
    p = make_problem(ctx, 14, dtype=torch.bfloat16, topk=4)
    layer = layer_of(p)
    return {"equal": all(torch.equal(layer(p.x, p.weights, p.ids), layer(p.x, p.weights, p.ids)) for _ in range(3))}


def case_overflow(ctx):
    """Rank 0 routes 6 tokens to rank 1's experts with capacity 2: every rank must raise, none hang."""
    p = make_problem(ctx, 15, ms=[6] * ctx.world, invalid=0.0)
    ids = p.ids
    if ctx.rank == 0:
        theirs = (p.expert_map < 0).nonzero().flatten()  # contiguous placement: rank 1 holds the next range
        first = int(theirs[theirs > int((p.expert_map >= 0).nonzero().max())][0])
        ids = torch.full_like(p.ids, first)
    out = layer_of(p, capacity=2)(p.x, p.weights, ids)
    return {"nan_rows": int(out.isnan().any(dim=1).sum())}


def case_compile(ctx):
    p = make_problem(ctx, 16)
    layer = layer_of(p, capacity=16)
    backend = "inductor" if ctx.device.type == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    errs = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in (3, 5, 9):
            x = torch.randn(m, 64, device=ctx.device)
            weights = torch.rand(m, 3, device=ctx.device)
            ids = torch.randint(0, 8, (m, 3), device=ctx.device, dtype=torch.int32)
            for t in (x, weights, ids):
                torch._dynamo.mark_dynamic(t, 0)
            errs.append(rel_err(compiled(x, weights, ids), reference(p, x=x, weights=weights, ids=ids)))
    return {"err": max(errs)}


def case_opcheck(ctx):
    from tests.reference import opcheck_utils

    p = make_problem(ctx, 17, ms=[5] * ctx.world)
    args = (p.x, p.local["w1"], p.local["w2"], p.weights, p.ids, p.expert_map, layer_of(p).expert_owner,
            dist.group.WORLD.group_name)
    torch.library.opcheck(torch.ops.moe_ext.ep_fused_experts.default, args, {"capacity": 5},
                          test_utils=opcheck_utils("none"))
    return {}


def case_cuda_graph(ctx):
    """Fixed capacity captured once, replayed 12 times with new tokens and routing: bitwise the eager result."""
    p = make_problem(ctx, 18, dtype=torch.bfloat16, ms=[32] * ctx.world, K=256, N=128, topk=4, E=16)
    layer = layer_of(p, capacity=32)
    x, weights, ids = p.x.clone(), p.weights.clone(), p.ids.clone()
    for _ in range(2):
        layer(x, weights, ids)  # warm up: Triton compiles, NCCL communicators
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, weights, ids)
    equal, errs = True, []
    for i in range(12):
        torch.manual_seed(100 + i)
        x.copy_(torch.randn_like(x))
        weights.copy_(torch.rand_like(weights))
        ids.copy_(torch.randint(-1, 17, ids.shape, device=ids.device, dtype=ids.dtype))
        graph.replay()
        eager = layer(x, weights, ids)
        equal &= bool(torch.equal(out, eager))
        errs.append(rel_err(out, reference(p, x=x, weights=weights, ids=ids)))
    return {"equal": equal, "err": max(errs)}


CASES = {name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")}
