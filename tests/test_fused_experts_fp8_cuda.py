"""GPU suite of fp8 block weights (``quant="fp8_block"``) through the ops: ``torch.ops.moe_ext.fused_experts`` /
``fused_moe`` / ``expert_gemm1`` / ``expert_gemm2`` dispatch CUDA + fp8_block to the Triton kernels (activations
quantized per token per 128 columns inside the op, e4m3 tensor-core products, fp32 accumulation with both scales
per 128-wide K block), with ``backend="triton"`` so that the route is ours whatever ``auto`` picks:

- a sampled correctness matrix (30 cases, every value of every axis): M in {1, 3, 77, 1000, 4096}, topk in
  {1, 2, 6, 8}, E in {8, 64, 256}, (K, N) in {(7168, 2048), (2048, 1408), (1000, 333)} (not multiples of 128
  too), the five activations, bias on/off, expert_map with -1 entries, apply_router_weight_on_input, invalid ids,
  bf16 and fp16 activations, both weight storages (contiguous [E, 2N, K] and transposed views of [E, K, 2N]);
  rel err <= 1e-2 against the PyTorch implementation (``fused_experts_torch``: the same activation quantization,
  fp32 math) on the same GPU;
- the unfused path (expert_gemm1 -> activation op -> expert_gemm2 with router weights -> slot sum) against the same
  composition on the PyTorch GEMMs, and against the fused path;
- CUDA-graph capture of each entry point at M in {1, 8, 64, 512}: 12 replays with new inputs, each bitwise equal
  to eager; no host sync inside the ops;
- determinism (bitwise); torch.compile(fullgraph=True, dynamic=True) of a DeepSeek-like MoE block (router,
  topk_softmax, fused_experts with fp8 block weights), one graph for M from 2 to 8192, and mode="reduce-overhead".

The interpreter's view of the same kernels is tests/test_kernels_fp8.py.
"""

import math
import random

import pytest
import torch

import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig, sanitize
from moe_extension.ops import fused_experts_torch, topk_softmax
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant import ue8m0_scales
from tests.reference import random_expert_map
from tests.test_fused_experts_cuda import _routing
from tests.test_fused_experts_mxfp4_cuda import ACT_OPS, _local
from tests.utils import (assert_graph_replays_match_eager, entry_point_call, entry_point_inputs, record_results,
                         rel_err)

cuda = pytest.mark.cuda

MS = (1, 3, 77, 1000, 4096)
TOPKS = (1, 2, 6, 8)
ES = (8, 64, 256)
KNS = ((7168, 2048), (2048, 1408), (1000, 333))
ACTS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep")
NUM_CASES = 30
TOL = 1e-2
UNFUSED_TOL = 3e-2  # fused against unfused: see test_unfused_matches_torch_and_fused
FP8 = dict(quant="fp8_block", backend="triton")


def _sample_cases(n: int = NUM_CASES, seed: int = 2026) -> list[dict]:
    """Deterministic sample: every axis cycles with a different stride, so each value appears, combined
    differently; E = 256 only with the smaller shapes (the DeepSeek-V3 shape at E 256 is 11 GB of weights)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        k, nn = KNS[i % len(KNS)]
        e = ES[(i + i // 3 + rng.randrange(2)) % len(ES)]
        if (k, nn) == KNS[0] and e == 256:
            e = 64
        cases.append(dict(
            M=MS[(i * 3 + i // 5) % len(MS)], topk=TOPKS[(i * 3 + i // 4) % len(TOPKS)], E=e, K=k, N=nn,
            act=ACTS[(i + i // 10) % len(ACTS)], bias=i % 2 == 1, emap=i % 4 == 1, on_input=i % 5 == 2,
            invalid=i % 6 != 4, transposed=(i // 2) % 3 == 1,
            dtype=torch.float16 if i % 10 == 7 else torch.bfloat16, seed=i,
        ))
    return cases


CASES = _sample_cases()
# NOTE: like tests/test_fused_experts_cuda.py: under pytest-xdist with --dist loadgroup the cases with large
# weights (and the reference's per-expert fp32 copies) run one at a time on one worker.
heavy = pytest.mark.xdist_group("gpu_memory")
HEAVY_WEIGHT_BYTES = 1e9


def _params(cases: list[dict]) -> list:
    return [pytest.param(c, marks=heavy) if c["E"] * 3 * c["K"] * c["N"] > HEAVY_WEIGHT_BYTES else c for c in cases]


def _case_id(c: dict) -> str:
    flags = "".join(f for f, on in (("b", c["bias"]), ("m", c["emap"]), ("i", c["on_input"]), ("t", c["transposed"]),
                                    ("v", c["invalid"])) if on)
    return f"M{c['M']}-k{c['topk']}-E{c['E']}-{c['K']}x{c['N']}-{c['act']}-{str(c['dtype'])[6:]}-{flags}"


def test_matrix_covers_every_axis_value():
    """The sampled matrix hits every value of every axis (runs anywhere: it is about the sample itself)."""
    for axis, values in (("M", MS), ("topk", TOPKS), ("E", ES), ("act", ACTS)):
        assert {c[axis] for c in CASES} == set(values), axis
    assert {(c["K"], c["N"]) for c in CASES} == set(KNS)
    for flag in ("bias", "emap", "on_input", "invalid", "transposed"):
        assert {c[flag] for c in CASES} == {False, True}, flag
    assert {c["dtype"] for c in CASES} == {torch.bfloat16, torch.float16}
    assert {c["M"] for c in CASES if (c["K"], c["N"]) == KNS[0]} >= {1, 4096}, "DeepSeek-V3's shape, decode and prefill"


# ------------------------------------------------------------------------------------------------- inputs


def _stack(E, rows, cols, gen, transposed):
    """fp8 block stack of logical [E, rows, cols]: e4m3 values of about N(0, 16) (float8_e4m3fn [E, rows, cols])
    and fp32 scales [E, ceil(rows / 128), ceil(cols / 128)] of 1 / (16 sqrt(cols)) times 2^[-1, 1] (so every block
    differs); with ``transposed`` both as .transpose(1, 2) views of [E, cols, rows] storage."""
    q = (torch.randn(E, rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen) * 16).to(torch.float8_e4m3fn)
    s = 2.0 ** (torch.rand(E, math.ceil(rows / 128), math.ceil(cols / 128), device="cuda", generator=gen) * 2 - 1)
    s = s / (16 * math.sqrt(cols))
    if transposed:
        q, s = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, s))
    return q, s


def _experts(E, K, N, gen, *, bias=False, transposed=False):
    """(w1, w1_scale, w2, w2_scale, w1_bias, w2_bias) on the GPU; w1 [E, 2N, K], w2 [E, K, N]."""
    w1, s1 = _stack(E, 2 * N, K, gen, transposed)
    w2, s2 = _stack(E, K, N, gen, transposed)
    b1 = torch.randn(E, 2 * N, device="cuda", generator=gen) * 0.5 if bias else None
    b2 = torch.randn(E, K, device="cuda", generator=gen) * 0.5 if bias else None
    return w1, s1, w2, s2, b1, b2


def _fused(x, w1, s1, w2, s2, g, ids, act, **kw):
    return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, act, w1_scale=s1, w2_scale=s2, **FP8, **kw)


# ------------------------------------------------------------------------------------------------- matrix


@cuda
@pytest.mark.parametrize("c", _params(CASES), ids=_case_id)
def test_fused_experts_matrix(c):
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    M, topk, E, K, N, dtype = c["M"], c["topk"], c["E"], c["K"], c["N"], c["dtype"]
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=c["bias"], transposed=c["transposed"])
    assert (w1.stride(2) == 1) != c["transposed"] and (s2.stride(2) == 1) != c["transposed"]
    e_ids = E + 3 if c["emap"] else E
    g, ids = _routing(M, e_ids, topk, c["invalid"], gen)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    kw = dict(w1_bias=b1, w2_bias=b2, apply_router_weight_on_input=c["on_input"],
              expert_map=random_expert_map(e_ids, E, device="cuda") if c["emap"] else None)
    out = _fused(x, w1, s1, w2, s2, g, ids, c["act"], **kw)
    torch.cuda.synchronize()
    assert out.shape == (M, K) and out.dtype == dtype
    assert out.isfinite().all(), "no NaN / Inf"
    # The PyTorch implementation quantizes x.float() as the kernels quantize x (the same values); fp32 result.
    ref = fused_experts_torch(x.float(), w1, w2, g, ids, c["act"], quant="fp8_block", w1_scale=s1, w2_scale=s2,
                              **kw)
    err = rel_err(out, ref)
    assert err <= TOL, f"rel_err {err:.3e} > {TOL}"
    dead = (_local(ids, kw["expert_map"], E) < 0).all(dim=1)
    assert (out[dead] == 0).all(), "tokens whose slots are all invalid give exactly 0"


# ------------------------------------------------------------------------------------------------- unfused


@cuda
@pytest.mark.parametrize("M,topk,E,K,N,act,on_input,emap", [
    (1, 8, 64, 7168, 2048, "silu", False, False),
    (77, 2, 8, 1000, 333, "silu", True, True),
    (1000, 6, 64, 2048, 1408, "gelu_tanh", False, True),
    (4096, 8, 64, 7168, 2048, "silu", False, False),
    (3, 1, 8, 2048, 1408, "swiglustep", True, False),
    (512, 6, 256, 1000, 333, "swigluoai", False, False),
])
def test_unfused_matches_torch_and_fused(M, topk, E, K, N, act, on_input, emap):
    """expert_gemm1 -> the activation op -> expert_gemm2 with the router weights -> sum over the slots (router
    weights on gemm1's input instead with on_input): within 1e-2 of the same composition on the PyTorch GEMMs
    (``expert_gemm1/2_torch``, which quantize their inputs the same way), and within UNFUSED_TOL of fused_experts.
    The unfused path rounds h and the activation output to bf16 before the second GEMM quantizes them, where the
    fused path quantizes the fp32 values: a bf16 rounding (2^-9) moves ~3% of the values across an e4m3 rounding
    boundary (steps of 2^-4 to 2^-3), one e4m3 step each: measured 1.0e-2 to 1.5e-2 between the two paths."""
    gen = torch.Generator(device="cuda").manual_seed(M * 10 + topk)
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=M == 77)
    e_ids = E + 3 if emap else E
    g, ids = _routing(M, e_ids, topk, True, gen)
    ids[-1, 0] = -1  # at least one invalid slot
    expert_map = random_expert_map(e_ids, E, device="cuda") if emap else None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw1 = dict(w1_bias=b1, expert_map=expert_map, topk_weights=g if on_input else None, quant="fp8_block",
               w1_scale=s1)
    kw2 = dict(w2_bias=b2, expert_map=expert_map, topk_weights=None if on_input else g, quant="fp8_block",
               w2_scale=s2)
    h = torch.ops.moe_ext.expert_gemm1(x, w1, ids, **kw1)
    a = ACT_OPS[act](h)
    y = torch.ops.moe_ext.expert_gemm2(a, w2, ids, **kw2)
    unfused = y.float().sum(dim=1)
    h_ref = expert_gemm1_torch(x, w1, ids, **kw1)
    y_ref = expert_gemm2_torch(ACT_OPS[act](h_ref), w2, ids, **kw2)
    fused = _fused(x, w1, s1, w2, s2, g, ids, act, w1_bias=b1, w2_bias=b2, expert_map=expert_map,
                   apply_router_weight_on_input=on_input)
    assert h.shape == (M, topk, 2 * N) and y.shape == (M, topk, K)
    assert fused.isfinite().all() and unfused.isfinite().all()
    assert rel_err(h, h_ref) <= TOL
    err = rel_err(unfused, y_ref.float().sum(dim=1))
    assert err <= TOL, f"unfused against the PyTorch GEMMs: rel_err {err:.3e} > {TOL}"
    err = rel_err(fused, unfused)
    assert err <= UNFUSED_TOL, f"fused against unfused: rel_err {err:.3e} > {UNFUSED_TOL}"
    invalid = _local(ids, expert_map, E) < 0
    assert invalid.any() and (h[invalid] == 0).all() and (y[invalid] == 0).all(), "invalid slots: rows of 0"


# ------------------------------------------------------------------------------------------------- direct tiles


def _direct_tiles() -> list:
    """The direct schedule's tensor-core GEMV tiles that ``fp8_gemv_tiles`` admits and the tuner may pick: gemm1
    128 output columns (256 weight rows with gate and up) on 4 and on 8 warps, gemm2 64, 128 and 256 weight rows,
    reductions whole and split (a split of whole 128-column steps; the last one partial where K or N is not a
    multiple of 128)."""
    g1s = [GemmConfig(128, 128, 4, 4, group_m=0, split_k=1), GemmConfig(128, 128, 4, 3, group_m=0, split_k=2),
           GemmConfig(128, 128, 4, 4, group_m=0, split_k=4), GemmConfig(128, 128, 8, 3, group_m=0, split_k=2)]
    g2s = [GemmConfig(64, 128, 4, 4, group_m=0, split_k=2), GemmConfig(128, 128, 4, 3, group_m=0, split_k=1),
           GemmConfig(256, 128, 8, 4, group_m=0, split_k=2), GemmConfig(128, 128, 4, 4, group_m=0, split_k=3)]
    return [MoeConfig("direct", 0, g1, g2) for g1, g2 in zip(g1s, g2s)]


@cuda
@pytest.mark.parametrize("cfg", _direct_tiles(), ids=lambda c: f"g1_{c.gemm1.block_n}w{c.gemm1.num_warps}s"
                         f"{c.gemm1.split_k}-g2_{c.gemm2.block_n}w{c.gemm2.num_warps}s{c.gemm2.split_k}")
@pytest.mark.parametrize("K,N,act", [(1000, 333, "swigluoai"), (2048, 1408, "silu")])
def test_direct_tiles(cfg, K, N, act):
    """Each direct GEMV tile, fused (with an expert_map, invalid slots and biases) and unfused, against the PyTorch
    implementation."""
    E, topk, M = 8, 4, 3
    assert sanitize(cfg, torch.bfloat16, N, K, topk, quant="fp8_block") == cfg
    gen = torch.Generator(device="cuda").manual_seed(cfg.gemm1.block_n + K)
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    g, ids = _routing(M, E + 3, topk, True, gen)
    emap = random_expert_map(E + 3, E, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, quant="fp8_block", w1_scale=s1, w2_scale=s2)
    out = fused_experts_triton(x, w1, w2, g, ids, act, config=cfg, **kw)
    ref = fused_experts_torch(x.float(), w1, w2, g, ids, act, **kw)
    assert out.isfinite().all() and rel_err(out, ref) <= TOL
    h = expert_gemm1_triton(x, w1, ids, w1_bias=b1, expert_map=emap, quant="fp8_block", w1_scale=s1, config=cfg)
    h_ref = expert_gemm1_torch(x, w1, ids, w1_bias=b1, expert_map=emap, quant="fp8_block", w1_scale=s1)
    assert rel_err(h, h_ref) <= TOL
    a = torch.randn(M, topk, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = expert_gemm2_triton(a, w2, ids, topk_weights=g, expert_map=emap, quant="fp8_block", w2_scale=s2, config=cfg)
    y_ref = expert_gemm2_torch(a, w2, ids, topk_weights=g, expert_map=emap, quant="fp8_block", w2_scale=s2)
    assert rel_err(y, y_ref) <= TOL


# ------------------------------------------------------------------------------------------------- UE8M0


@cuda
@pytest.mark.parametrize("M,topk,E,K,N,act,on_input,transposed", [
    (1, 8, 64, 2048, 1408, "silu", False, False),
    (300, 6, 64, 2048, 1408, "swigluoai", True, True),
    (4096, 8, 16, 7168, 2048, "silu", False, False),
    (77, 2, 8, 1000, 333, "gelu", False, True),
])
def test_ue8m0_scales(M, topk, E, K, N, act, on_input, transposed):
    """UE8M0 byte scales (the weights' scales rounded up to powers of two, uint8): fused_experts and the unfused
    GEMMs within 1e-2 of the PyTorch implementation (which quantizes the activations with power-of-two scales
    too), and CUDA-graph replays bitwise equal to eager."""
    gen = torch.Generator(device="cuda").manual_seed(M + K)
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=transposed)
    s1, s2 = ue8m0_scales(s1), ue8m0_scales(s2)  # the same codes, scales up to 2x: still within e4m3's range
    g, ids = _routing(M, E + 2, topk, True, gen)
    emap = random_expert_map(E + 2, E, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, apply_router_weight_on_input=on_input)
    out = _fused(x, w1, s1, w2, s2, g, ids, act, **kw)
    ref = fused_experts_torch(x.float(), w1, w2, g, ids, act, quant="fp8_block", w1_scale=s1, w2_scale=s2, **kw)
    assert out.isfinite().all() and rel_err(out, ref) <= TOL
    kw1 = dict(w1_bias=b1, expert_map=emap, topk_weights=g if on_input else None, quant="fp8_block", w1_scale=s1)
    h = torch.ops.moe_ext.expert_gemm1(x, w1, ids, **kw1)
    assert rel_err(h, expert_gemm1_torch(x, w1, ids, **kw1)) <= TOL
    a = ACT_OPS[act](h)
    kw2 = dict(w2_bias=b2, expert_map=emap, topk_weights=None if on_input else g, quant="fp8_block", w2_scale=s2)
    assert rel_err(torch.ops.moe_ext.expert_gemm2(a, w2, ids, **kw2), expert_gemm2_torch(a, w2, ids, **kw2)) <= TOL
    if M <= 300:
        call = entry_point_call("fused_experts", "fp8_block", act, topk, (w1, s1, w2, s2, b1, b2), emap,
                                backend="triton")
        fresh = lambda: entry_point_inputs("fused_experts", M, E, topk, K, N, _routing, gen)  # noqa: E731
        assert_graph_replays_match_eager(call, fresh(), fresh, finite=True)


# ------------------------------------------------------------------------------------------------- CUDA graphs

GRAPH_SHAPE = dict(E=16, topk=4, K=384, N=320)
ENTRY_POINTS = ("fused_experts", "fused_moe", "expert_gemm1", "expert_gemm2")


@cuda
@pytest.mark.parametrize("op", ENTRY_POINTS)
@pytest.mark.parametrize("M", [1, 8, 64, 512])
def test_cuda_graph_replays_match_eager(op, M):
    """Each fp8 block entry point captured in a CUDA graph (after a warm-up on a side stream, and one eager call
    under sync debug mode "error": no host sync inside the op): 12 replays with new inputs copied into the static
    ones, each bitwise equal to an eager call on the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    E, topk, K, N = GRAPH_SHAPE["E"], GRAPH_SHAPE["topk"], GRAPH_SHAPE["K"], GRAPH_SHAPE["N"]
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=op == "expert_gemm2")
    emap = random_expert_map(E + 2, E, device="cuda")  # two global ids are not local (-1)
    call = entry_point_call(op, "fp8_block", "silu", topk, (w1, s1, w2, s2, b1, b2), emap, backend="triton")

    def fresh():
        return entry_point_inputs(op, M, E, topk, K, N, _routing, gen)

    assert_graph_replays_match_eager(call, fresh(), fresh, finite=True)


@cuda
@pytest.mark.parametrize("M", [1, 4])
def test_shard_work_lists_in_a_cuda_graph(monkeypatch, M):
    """An fp8 block expert-parallel shard at decode (16 of 256 experts, topk 8: at most 2 local pairs expected), whose
    direct GEMVs take work lists (gemv1's programs also store the zero rows of the tokens without a local slot):
    captured once, replayed 12 times with new hidden states and routings (invalid ids too; most tokens have no local
    slot), bitwise equal to eager; one eager call against the PyTorch implementation."""
    grids, zeroed = record_results(monkeypatch, fe, "_gemv_grid"), record_results(monkeypatch, fe, "_gemv1")
    gen = torch.Generator(device="cuda").manual_seed(40 + M)
    E, E_global, topk, K, N = 16, 256, 8, 2048, 1408
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    emap = random_expert_map(E_global, E, device="cuda")

    def call(inputs):
        x, g, ids = inputs
        return _fused(x, w1, s1, w2, s2, g, ids, "silu", w1_bias=b1, w2_bias=b2, expert_map=emap)

    def inputs():
        return [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                *_routing(M, E_global, topk, True, gen)]

    x, g, ids = inputs()
    out = call([x, g, ids])
    ref = fused_experts_torch(x.float(), w1, w2, g, ids, "silu", w1_bias=b1, w2_bias=b2, expert_map=emap,
                              quant="fp8_block", w1_scale=s1, w2_scale=s2)
    assert rel_err(out, ref) <= TOL
    assert (out[(_local(ids, emap, E) < 0).all(dim=1)] == 0).all()
    assert_graph_replays_match_eager(call, inputs(), inputs, finite=True)
    assert [work_list for _, work_list in grids[:2]] == [True, True], "both GEMVs took work lists"
    assert zeroed and all(zeroed), "gemv1 stored the zero rows"


# ------------------------------------------------------------------------------------------------- determinism, compile


@cuda
def test_deterministic_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(7)
    E, K, N = 64, 2048, 1408
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    for M in (1, 1000):
        g, ids = _routing(M, E, 6, True, gen)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        first, second = (_fused(x, w1, s1, w2, s2, g, ids, "silu", w1_bias=b1, w2_bias=b2) for _ in range(2))
        assert first.isfinite().all() and torch.equal(first, second)
        h1, h2 = (torch.ops.moe_ext.expert_gemm1(x, w1, ids, quant="fp8_block", w1_scale=s1) for _ in range(2))
        assert torch.equal(h1, h2)


class DeepSeekLikeBlock(torch.nn.Module):
    """Router (fp32 linear) -> topk_softmax -> fused_experts with fp8 block weights and silu."""

    def __init__(self, E=64, topk=6, K=2048, N=1408, seed=5):
        super().__init__()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.topk = topk
        self.router = torch.nn.Linear(K, E, device="cuda")
        w1, s1, w2, s2, _, _ = _experts(E, K, N, gen)
        for name, t in (("w1", w1), ("w1_scale", s1), ("w2", w2), ("w2_scale", s2)):
            self.register_buffer(name, t)

    def forward(self, x):
        topk_weights, topk_ids = topk_softmax(self.router(x.float()), self.topk, False)
        return torch.ops.moe_ext.fused_experts(x, self.w1, self.w2, topk_weights, topk_ids, "silu",
                                               w1_scale=self.w1_scale, w2_scale=self.w2_scale, **FP8)


@cuda
def test_compile_deepseek_like_block():
    """torch.compile(fullgraph=True, dynamic=True): no recompile for M from 17 to 8192 once M = 2 and 3 have
    compiled; every size matches eager. mode="reduce-overhead" (CUDA graphs) matches eager too."""
    import torch._dynamo

    gen = torch.Generator(device="cuda").manual_seed(3)
    block = DeepSeekLikeBlock()
    K = block.router.in_features

    def check(fn, M):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        with torch.no_grad():
            got, want = fn(x), block(x)
        assert got.shape == (M, K) and got.dtype == torch.bfloat16 and got.isfinite().all()
        err = rel_err(got, want)
        assert err <= 1e-3, f"M = {M}: rel_err {err:.3e} against eager"

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for M in (2, 3):
        check(compiled, M)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (17, 64, 333, 1000, 4096, 8192):
            check(compiled, M)

    torch._dynamo.reset()
    overhead = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for M in (64, 64, 64, 512, 512):
        check(overhead, M)
