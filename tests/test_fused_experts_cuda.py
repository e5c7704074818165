"""GPU suite of the routed experts through the ops (torch.ops.moe_ext.fused_experts / fused_moe, which dispatch
CUDA + quant="none" to the Triton kernels of moe_extension.kernels):

- a sampled correctness matrix (~60 cases) that covers every value of every axis of the issue: M in {1, 3,
  77, 1000, 4096}, topk in {1, 2, 4, 6, 8}, E in {8, 64, 128, 256, 512}, (K, N) in {(2880, 2880), (2048, 768),
  (4096, 14336), (1000, 333)}, the five activations, bias on/off, expert_map with -1 entries,
  apply_router_weight_on_input, invalid ids, zero and huge rows, both weight layouts; bf16 (rel err <= 1e-2)
  and fp16 (<= 1e-3) against the fp64 loop of tests/reference.py (small cases) or the PyTorch implementation
  computing in fp32 on the GPU (large ones);
- indexing past 2^31 elements (M * topk * max(K, 2N) > 2^31);
- CUDA-graph capture of fused_experts and fused_moe at M in {1, 8, 64, 512} (and at 64, 512 with the
  persistent gemm2 forced on, at 512 with both GEMMs persistent): 12 replays with new inputs, each bitwise equal to
  eager; no host sync inside the ops;
- the persistent gemm1 bitwise equal to the tiled one (without tail tiles), before either gemm2;
- determinism (bitwise); torch.compile(fullgraph=True, dynamic=True): one graph for M from 2 to 4096 with
  error_on_recompile, and mode="reduce-overhead".
"""

import dataclasses
import math
import random

import pytest
import torch

import moe_extension.kernels.fused_experts as fe
from moe_extension.ops import fused_experts_torch
from tests.reference import fused_experts_reference, random_expert_map
from tests.utils import assert_graph_replays_match_eager, rel_err, record_results

cuda = pytest.mark.cuda

MS = (1, 3, 77, 1000, 4096)
TOPKS = (1, 2, 4, 6, 8)
ES = (8, 64, 128, 256, 512)
KNS = ((2880, 2880), (2048, 768), (4096, 14336), (1000, 333))
ACTS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep")
# NOTE: bf16 weight bytes per case stay under 8 GB (allocation, reference and run time): (4096, 14336)
# only with E = 8, (2880, 2880) up to E = 128; E = 256 / 512 with the two smaller shapes.
MAX_WEIGHT_BYTES = 8e9
NUM_CASES = 60


def _sample_cases(n: int = NUM_CASES, seed: int = 2024) -> list[dict]:
    """Deterministic sample: every axis cycles with a different stride so each value appears, combined
    differently; E cycles through the values whose weights fit the memory budget for the case's shape."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        k, nn = KNS[i % len(KNS)]
        fits = [e for e in ES if e * 3 * k * nn * 2 <= MAX_WEIGHT_BYTES]
        e = fits[(i // len(KNS) + rng.randrange(2)) % len(fits)]
        cases.append(dict(
            M=MS[(i * 3 + i // 5) % len(MS)], topk=TOPKS[(i * 7 + 1) % len(TOPKS)], E=e, K=k, N=nn,
            act=ACTS[(i + i // 10) % len(ACTS)], bias=i % 2 == 1, emap=i % 3 == 0, on_input=i % 4 == 2,
            invalid=i % 5 != 4, extreme=i % 6 == 5, transposed=i % 7 == 3,
            dtype=torch.float16 if i % 10 == 7 else torch.bfloat16, seed=i,
        ))
    return cases


CASES = _sample_cases()
# NOTE: a case also holds fp32 copies of its weights for the reference (3x the bf16 bytes, up to ~24 GB);
# under pytest-xdist with --dist loadgroup the cases over 2 GB of weights run one at a time on one worker:
# with 4 or 8 workers on the 80 GB H100 the suite otherwise ran out of memory in 3 to 5 of them.
heavy = pytest.mark.xdist_group("gpu_memory")
HEAVY_WEIGHT_BYTES = 2e9


def _params(cases: list[dict]) -> list:
    return [pytest.param(c, marks=heavy) if c["E"] * 3 * c["K"] * c["N"] * 2 > HEAVY_WEIGHT_BYTES else c
            for c in cases]


def _case_id(c: dict) -> str:
    flags = "".join(f for f, on in (("b", c["bias"]), ("m", c["emap"]), ("i", c["on_input"]), ("x", c["extreme"]),
                                    ("t", c["transposed"]), ("v", c["invalid"])) if on)
    return f"M{c['M']}-k{c['topk']}-E{c['E']}-{c['K']}x{c['N']}-{c['act']}-{str(c['dtype'])[6:]}-{flags}"


def test_matrix_covers_every_axis_value():
    """The sampled matrix hits every value of every axis (runs anywhere: it is about the sample itself)."""
    for axis, values in (("M", MS), ("topk", TOPKS), ("E", ES), ("act", ACTS)):
        assert {c[axis] for c in CASES} == set(values), axis
    assert {(c["K"], c["N"]) for c in CASES} == set(KNS)
    for flag in ("bias", "emap", "on_input", "invalid", "extreme", "transposed"):
        assert {c[flag] for c in CASES} == {False, True}, flag
    assert {c["dtype"] for c in CASES} == {torch.bfloat16, torch.float16}
    assert all(c["E"] * 3 * c["K"] * c["N"] * 2 <= MAX_WEIGHT_BYTES for c in CASES)


def _weights(E, K, N, dtype, transposed, bias, gen):
    def stack(rows, cols):
        shape = (E, cols, rows) if transposed else (E, rows, cols)
        w = torch.randn(shape, device="cuda", dtype=dtype, generator=gen).mul_(1.0 / math.sqrt(cols))
        return w.transpose(1, 2) if transposed else w

    w1, w2 = stack(2 * N, K), stack(K, N)
    b1 = torch.randn(E, 2 * N, device="cuda", generator=gen) * 0.5 if bias else None
    b2 = torch.randn(E, K, device="cuda", generator=gen) * 0.5 if bias else None
    return w1, w2, b1, b2


def _routing(M, E_ids, topk, invalid, gen):
    """Each token picks topk distinct ids; with ``invalid`` about 15% become -1 / E_ids / 2^31 - 1."""
    scores = torch.rand(M, E_ids, device="cuda", generator=gen)
    g, ids = scores.topk(topk, dim=1)
    if invalid:
        bad = torch.tensor([-1, E_ids, 2**31 - 1], device="cuda")[torch.randint(0, 3, (M, topk), device="cuda",
                                                                                generator=gen)]
        ids = torch.where(torch.rand(M, topk, device="cuda", generator=gen) < 0.15, bad, ids)
    return (g / g.sum(1, keepdim=True)).float(), ids.to(torch.int32)


def _reference(x, w1, w2, g, ids, act, kw):
    """fp64 loop on the CPU for small cases (it copies the weights to the host), else the PyTorch
    implementation on fp32 copies of the inputs on the GPU (fp32 math, no rounding of its output)."""
    M, K = x.shape
    work = ids.shape[1] * M * 3 * K * w2.shape[2]
    if work <= 3e8 and w1.numel() * w1.element_size() <= 5e8:
        return fused_experts_reference(x, w1, w2, g, ids, act, **kw)
    return fused_experts_torch(x.float(), w1.float(), w2.float(), g, ids, act, **kw)


@cuda
@pytest.mark.parametrize("c", _params(CASES), ids=_case_id)
def test_fused_experts_matrix(c):
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    M, topk, E, K, N, dtype = c["M"], c["topk"], c["E"], c["K"], c["N"], c["dtype"]
    w1, w2, b1, b2 = _weights(E, K, N, dtype, c["transposed"], c["bias"], gen)
    e_ids = E + 3 if c["emap"] else E
    g, ids = _routing(M, e_ids, topk, c["invalid"], gen)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    if c["extreme"]:
        x[0] = 0
        # huge within the dtype: the gated product of a x1e3 row overflows fp16 (max 65504), not bf16
        x[M // 2] *= 1e3 if dtype == torch.bfloat16 else 30.0
    kw = dict(w1_bias=b1, w2_bias=b2, apply_router_weight_on_input=c["on_input"],
              expert_map=random_expert_map(e_ids, E, device="cuda") if c["emap"] else None)
    out = torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, c["act"], **kw)
    torch.cuda.synchronize()
    assert out.shape == (M, K) and out.dtype == dtype
    assert out.isfinite().all(), "no NaN / Inf"
    ref = _reference(x, w1, w2, g, ids, c["act"], kw)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    err = rel_err(out.cpu(), ref.cpu())
    assert err <= tol, f"rel_err {err:.3e} > {tol}"
    local = ids.long() if kw["expert_map"] is None else torch.where(
        (ids >= 0) & (ids < e_ids), kw["expert_map"].long()[ids.long().clamp(0, e_ids - 1)], -1)
    dead = ((local < 0) | (local >= E)).all(dim=1)
    assert (out[dead] == 0).all(), "tokens whose slots are all invalid give exactly 0"


@cuda
@heavy
def test_indexing_past_2_31():
    """M * topk * max(K, 2N) > 2^31: the per-slot rows and the sorted activations are indexed in int64."""
    M, topk, E, K, N = 65600, 8, 8, 4096, 4096
    assert M * topk * max(K, 2 * N) > 2**31 and M * topk * K > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w2, _, _ = _weights(E, K, N, torch.bfloat16, False, False, gen)
    g, ids = _routing(M, E, topk, True, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "silu")
    # the last tokens (their slot rows start past 2^31 elements) and a random sample
    rows = torch.cat([torch.arange(M - 48, M, device="cuda"), torch.randint(0, M, (48,), device="cuda",
                                                                             generator=gen)])
    ref = fused_experts_torch(x[rows].float(), w1.float(), w2.float(), g[rows], ids[rows], "silu")
    assert out.isfinite().all()
    assert rel_err(out[rows], ref) <= 1e-2
    del out, x


GRAPH_SHAPE = dict(E=16, topk=4, K=256, N=192)


def _graph_inputs(M, gen, op):
    E, topk, K = GRAPH_SHAPE["E"], GRAPH_SHAPE["topk"], GRAPH_SHAPE["K"]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    if op == "fused_moe":
        return [x, torch.randn(M, E + 2, device="cuda", generator=gen)]
    g, ids = _routing(M, E + 2, topk, True, gen)
    return [x, g, ids]


def _persistent_gemm2(monkeypatch, force_pdl: bool = False, gemm1: bool = False) -> list:
    """Every sorted-path config of the fused path with ``gemm2.persistent`` (sm_90+; skip otherwise); returns
    the list that records the ``pdl`` flag of each launch of the persistent gemm2 (so a test can check the
    path was taken, and how it was launched). ``force_pdl``: launch it with PDL. ``gemm1``: the persistent gemm1
    too (no tail tiles)."""
    if not fe.tma_capable(torch.device("cuda")):
        pytest.skip("the persistent gemm2 needs sm_90+")
    table = fe.get_config

    def get_config(*args):
        cfg = table(*args)
        if cfg.path != "sorted":
            return cfg
        g1 = dataclasses.replace(cfg.gemm1, persistent=True, tail_m=0) if gemm1 else cfg.gemm1
        return dataclasses.replace(cfg, gemm1=g1, gemm2=dataclasses.replace(
            cfg.gemm2, persistent=True, tail_m=0, split_k=1, num_stages=min(cfg.gemm2.num_stages, 3)))

    monkeypatch.setattr(fe, "get_config", get_config)
    launches = []
    launch = fe._gemm2_persistent

    def counted(a, w2, bias, y, routing, topk, weights, cfg, pdl=False):
        pdl = pdl or force_pdl
        launches.append(pdl)
        return launch(a, w2, bias, y, routing, topk, weights, cfg, pdl)

    monkeypatch.setattr(fe, "_gemm2_persistent", counted)
    return launches


@cuda
@pytest.mark.parametrize("op", ["fused_experts", "fused_moe"])
@pytest.mark.parametrize("M,persistent", [(1, False), (8, False), (64, False), (512, False), (64, True),
                                          (512, True), (512, "pdl"), (512, "gemm1")])
def test_cuda_graph_replays_match_eager(monkeypatch, op, M, persistent):
    """persistent: the sorted path with the persistent gemm2 (forced on); "pdl": launched with PDL too
    (the product launches it without); "gemm1": the persistent gemm1 too."""
    launches = (_persistent_gemm2(monkeypatch, force_pdl=persistent == "pdl", gemm1=persistent == "gemm1")
                if persistent else None)
    gemm1_runs = record_results(monkeypatch, fe, "_persistent_gemm1_ok")
    gen = torch.Generator(device="cuda").manual_seed(M)
    E, topk, K, N = GRAPH_SHAPE["E"], GRAPH_SHAPE["topk"], GRAPH_SHAPE["K"], GRAPH_SHAPE["N"]
    w1, w2, b1, b2 = _weights(E, K, N, torch.bfloat16, False, True, gen)
    emap = random_expert_map(E + 2, E, device="cuda")  # two global ids are not local (-1)

    def call(inputs):
        if op == "fused_moe":
            x, logits = inputs
            return torch.ops.moe_ext.fused_moe(x, w1, w2, logits, topk, True, "swigluoai", w1_bias=b1, w2_bias=b2,
                                               expert_map=emap)
        x, g, ids = inputs
        return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2,
                                               expert_map=emap)

    assert_graph_replays_match_eager(call, _graph_inputs(M, gen, op), lambda: _graph_inputs(M, gen, op))
    if persistent:
        assert launches, "the persistent gemm2 ran"
        assert all(pdl == (persistent == "pdl") for pdl in launches), "launched with PDL only when asked"
    if persistent == "gemm1":
        assert any(gemm1_runs), "the persistent gemm1 ran"


@cuda
@pytest.mark.parametrize("M,N,block_m", [(200, 256, 32), (400, 192, 64), (400, 200, 64)])
def test_persistent_gemm2_at_short_reductions(monkeypatch, M, N, block_m):
    """The heuristic's persistent gemm2 at blocks of 32 and 64 rows where the reduction is short (N <= 256: E 64,
    topk 6, about 19 and 38 rows per expert; N 200 no multiple of 64): against the reference with biases, an expert map
    with -1 entries and invalid ids; then captured in a CUDA graph, 12 replays with new inputs bitwise equal to
    eager."""
    if not fe.tma_capable(torch.device("cuda")):
        pytest.skip("the persistent gemm2 needs sm_90+")
    launches = record_results(monkeypatch, fe, "_gemm2_persistent")
    gen = torch.Generator(device="cuda").manual_seed(M + N)
    E, topk, K = 64, 6, 384
    cfg = fe.get_config(M, E, N, K, topk, torch.bfloat16, True, True, torch.device("cuda"))
    assert cfg.block_m == block_m and cfg.gemm2.persistent, cfg
    w1, w2, b1, b2 = _weights(E, K, N, torch.bfloat16, False, True, gen)
    emap = random_expert_map(E + 3, E, device="cuda")
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap)

    def inputs():
        return [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                *_routing(M, E + 3, topk, True, gen)]

    def call(args):
        x, g, ids = args
        return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "swigluoai", **kw)

    first = inputs()
    out = call(first)
    assert launches, "the persistent gemm2 ran"
    err = rel_err(out.cpu(), _reference(*first[:1], w1, w2, *first[1:], "swigluoai", kw).cpu())
    assert err <= 1e-2, f"rel_err {err:.3e}"
    assert_graph_replays_match_eager(call, first, inputs)


@cuda
@pytest.mark.parametrize("M", [1, 2])
def test_cuda_graph_replays_match_eager_on_a_shard(monkeypatch, M):
    """A bf16 expert-parallel shard (16 of 64 experts, topk 4: at most 2 local pairs expected) at decode: the direct
    schedule's tensor-core GEMVs (their counters zeroed inside the graph) captured once and replayed with new hidden
    states and routings (invalid ids too), bitwise equal to eager."""
    launched = []
    kernel = fe.gemv1_dot_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fe, "gemv1_dot_kernel", Spy())
    gen = torch.Generator(device="cuda").manual_seed(100 + M)
    E, E_global, topk, K, N = 16, 64, 4, 256, 192
    w1, w2, b1, b2 = _weights(E, K, N, torch.bfloat16, False, True, gen)
    emap = random_expert_map(E_global, E, device="cuda")

    def call(inputs):
        x, g, ids = inputs
        return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2,
                                               expert_map=emap)

    def inputs():
        return [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                *_routing(M, E_global, topk, True, gen)]

    assert_graph_replays_match_eager(call, inputs(), inputs)
    assert launched, "the tensor-core GEMVs ran"


@cuda
@pytest.mark.parametrize("act", ["swigluoai", "silu", "gelu"])
@pytest.mark.parametrize("gemm2_persistent", [False, True])
def test_persistent_gemm1_matches_tiles(monkeypatch, act, gemm2_persistent):
    """The persistent gemm1 (one program per SM over the used blocks' tiles) computes every tile as the
    one-program-per-tile launch without tail tiles: outputs bitwise equal, with the persistent gemm2 after it or
    the tiled gemm2 launched with PDL (which must then wait for gemm1's completion, not for per-tile signals)."""
    if not fe.tma_capable(torch.device("cuda")):
        pytest.skip("the persistent kernels need sm_90+")
    taken = record_results(monkeypatch, fe, "_persistent_gemm1_ok")
    gen = torch.Generator(device="cuda").manual_seed(11)
    for M, E, topk, K, N in [(77, 8, 2, 1024, 704), (1000, 64, 6, 2048, 768), (4096, 16, 4, 1000, 333)]:
        w1, w2, b1, b2 = _weights(E, K, N, torch.bfloat16, False, True, gen)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        g, ids = _routing(M, E, topk, True, gen)
        cfg = fe.get_config(M, E, N, K, topk, torch.bfloat16, True, True, x.device)
        cfg = dataclasses.replace(cfg, path="sorted", block_m=cfg.block_m or 64,
                                  gemm1=dataclasses.replace(cfg.gemm1, tail_m=0, persistent=False),
                                  gemm2=dataclasses.replace(cfg.gemm2, persistent=gemm2_persistent, tail_m=0,
                                                            split_k=1, num_stages=min(cfg.gemm2.num_stages, 3)))
        outs = []
        for persistent in (False, True):
            c = dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, persistent=persistent))
            taken.clear()
            outs.append(fe.fused_experts_triton(x, w1, w2, g, ids, act, w1_bias=b1, w2_bias=b2, config=c))
            assert any(taken) == persistent, "the persistent gemm1 ran exactly when asked"
        assert torch.equal(outs[0], outs[1]), (M, E, act)
        assert outs[0].isfinite().all() and outs[0].abs().max() > 0


@cuda
def test_deterministic_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(7)
    w1, w2, b1, b2 = _weights(64, 1024, 512, torch.bfloat16, False, True, gen)
    for M in (1, 1000):
        g, ids = _routing(M, 64, 6, True, gen)
        x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
        first = torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "silu", w1_bias=b1, w2_bias=b2)
        second = torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "silu", w1_bias=b1, w2_bias=b2)
        assert torch.equal(first, second)


@cuda
def test_compile_dynamic_one_graph():
    import torch._dynamo

    gen = torch.Generator(device="cuda").manual_seed(3)
    E, topk, K, N = 32, 4, 512, 256
    w1, w2, _, _ = _weights(E, K, N, torch.bfloat16, False, False, gen)

    def layer(x, g, ids):
        return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "swigluoai") * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (2, 3, 17, 64, 333, 1000, 4096):
            g, ids = _routing(M, E, topk, True, gen)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            assert torch.equal(compiled(x, g, ids), layer(x, g, ids))

    overhead = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        g, ids = _routing(64, E, topk, True, gen)
        x = torch.randn(64, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        assert torch.equal(overhead(x, g, ids), layer(x, g, ids))
