"""GPU suite of MXFP4 weights (``quant="mxfp4"``) through the ops: ``torch.ops.moe_ext.fused_experts`` /
``fused_moe`` / ``expert_gemm1`` / ``expert_gemm2`` dispatch CUDA + mxfp4 to the Triton kernels (inline-PTX
decode, bf16 tensor cores, fp32 accumulation):

- a sampled correctness matrix (30 cases, every value of every axis): M in {1, 3, 77, 1000, 4096}, topk in
  {1, 2, 4, 6}, E in {8, 32, 128}, (K, N) in {(2880, 2880), (2048, 768), (1024, 352)}, the five activations, bias
  on/off, expert_map with -1 entries, apply_router_weight_on_input, invalid ids, bf16 and fp16 activations, both
  weight storages (contiguous [E, 2N, K/2] and transposed views of [E, K/2, 2N]); rel err <= 1e-2 against the
  PyTorch implementation (``fused_experts_torch``, fp32 math) on the same GPU;
- the PTX decode against ``dequantize_mxfp4`` bit for bit (every byte; every scale: 0 subnormal, 255 NaN);
- scales from 2^-20 to 2^20; a NaN scale (255) confined to its block's outputs (and
  propagated through swigluoai's clamps on the GPU);
- the unfused path (expert_gemm1 -> activation op -> expert_gemm2 with router weights -> slot sum) against the fused;
- CUDA-graph capture of each entry point at M in {1, 8, 64, 512}: 12 replays with new inputs, each bitwise equal
  to eager; no host sync inside the ops;
- determinism (bitwise); torch.compile(fullgraph=True, dynamic=True) of a gpt-oss-like MoE block (router,
  topk_softmax, fused_experts with MXFP4 weights and biases, swigluoai), one graph for M from 2 to 4096, and
  mode="reduce-overhead".

The interpreter's view of the same kernels (the portable decode) is tests/test_kernels_mxfp4.py.
"""

import math
import random

import pytest
import torch

from moe_extension.ops import fused_experts_torch, topk_softmax
from moe_extension.ops.activations import (gelu_and_mul, gelu_tanh_and_mul, silu_and_mul, swiglustep_and_mul,
                                           swigluoai_and_mul)
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant import dequantize_mxfp4
from tests.reference import random_expert_map
from tests.test_fused_experts_cuda import _routing
from tests.test_kernels_mxfp4 import DECODE_SCALES, assert_bitwise_with_nans, decode_case, run_decode
from tests.utils import assert_graph_replays_match_eager, entry_point_call, entry_point_inputs, rel_err

cuda = pytest.mark.cuda

MS = (1, 3, 77, 1000, 4096)
TOPKS = (1, 2, 4, 6)
ES = (8, 32, 128)
KNS = ((2880, 2880), (2048, 768), (1024, 352))
ACTS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep")
NUM_CASES = 30
TOL = 1e-2
# RMS of the 16 e2m1 values (uniform random codes): a scale of 2^-round(log2(E2M1_RMS * sqrt(cols))) gives weights
# of about 1 / sqrt(cols).
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


def _sample_cases(n: int = NUM_CASES, seed: int = 2025) -> list[dict]:
    """Deterministic sample: every axis cycles with a different stride, so each value appears, combined
    differently."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        k, nn = KNS[i % len(KNS)]
        cases.append(dict(
            M=MS[(i * 3 + i // 5) % len(MS)], topk=TOPKS[(i * 3 + i // 4) % len(TOPKS)],
            E=ES[(i + i // 3 + rng.randrange(2)) % len(ES)], K=k, N=nn, act=ACTS[(i + i // 10) % len(ACTS)],
            bias=i % 2 == 1, emap=i % 4 == 1, on_input=i % 5 == 2, invalid=i % 6 != 4, transposed=(i // 2) % 3 == 1,
            dtype=torch.float16 if i % 10 == 7 else torch.bfloat16, seed=i,
        ))
    return cases


CASES = _sample_cases()
# NOTE: like tests/test_fused_experts_cuda.py: under pytest-xdist with --dist loadgroup the cases with large
# weights (and the reference's per-expert fp32 copies) run one at a time on one worker.
heavy = pytest.mark.xdist_group("gpu_memory")
HEAVY_WEIGHT_BYTES = 1e9


def _weight_bytes(c: dict) -> float:
    return c["E"] * 3 * c["K"] * c["N"] * 17 / 32  # packed codes (1/2 byte) + scales (1/32 byte) per element


def _params(cases: list[dict]) -> list:
    return [pytest.param(c, marks=heavy) if _weight_bytes(c) > HEAVY_WEIGHT_BYTES else c for c in cases]


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
    assert {c["E"] for c in CASES if (c["K"], c["N"]) == (2880, 2880)} >= {128}, "gpt-oss-120b's shape"
    assert {c["M"] for c in CASES if c["E"] == 128} >= {1, 4096}
    assert all(c["K"] % 32 == 0 and c["N"] % 32 == 0 for c in CASES)


# ------------------------------------------------------------------------------------------------- inputs


def _stack(E, rows, cols, gen, transposed, scales=None):
    """MXFP4 stack of logical [E, rows, cols]: uniform random codes (uint8 [E, rows, cols/2], every byte value) and
    scales (uint8 [E, rows, cols/32]) of about 1/sqrt(cols) (a base value +-1), or ``scales(shape, gen)``; with
    ``transposed`` both as .transpose(1, 2) views of [E, cols/2, rows] / [E, cols/32, rows] storage."""
    base = 127 - round(math.log2(E2M1_RMS * math.sqrt(cols)))
    q = torch.randint(0, 256, (E, rows, cols // 2), device="cuda", dtype=torch.uint8, generator=gen)
    if scales is None:
        s = torch.randint(base - 1, base + 2, (E, rows, cols // 32), device="cuda", dtype=torch.uint8, generator=gen)
    else:
        s = scales((E, rows, cols // 32), gen)
    if transposed:
        q, s = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, s))
    return q, s


def _experts(E, K, N, gen, *, bias=False, transposed=False, scales=None):
    """(w1, w1_scale, w2, w2_scale, w1_bias, w2_bias) on the GPU; w1 [E, 2N, K/2], w2 [E, K, N/2]."""
    w1, s1 = _stack(E, 2 * N, K, gen, transposed, scales)
    w2, s2 = _stack(E, K, N, gen, transposed, scales)
    b1 = torch.randn(E, 2 * N, device="cuda", generator=gen) * 0.5 if bias else None
    b2 = torch.randn(E, K, device="cuda", generator=gen) * 0.5 if bias else None
    return w1, s1, w2, s2, b1, b2


def _local(ids, emap, E):
    """The local expert of each slot, -1 for invalid ones."""
    ids = ids.long()
    if emap is not None:
        ids = torch.where((ids >= 0) & (ids < emap.numel()), emap.long()[ids.clamp(0, emap.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < E), ids, -1)


def _fused(x, w1, s1, w2, s2, g, ids, act, **kw):
    return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, act, quant="mxfp4", w1_scale=s1, w2_scale=s2, **kw)


def _fused_reference(x, w1, s1, w2, s2, g, ids, act, **kw):
    """The PyTorch implementation on the GPU (per active expert, dequantized in fp32) from fp32 activations (the
    same values; both round them to bf16 for the GEMMs): an fp32 result, no rounding of its own output."""
    return fused_experts_torch(x.float(), w1, w2, g, ids, act, quant="mxfp4", w1_scale=s1, w2_scale=s2, **kw)


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
    ref = _fused_reference(x, w1, s1, w2, s2, g, ids, c["act"], **kw)
    err = rel_err(out, ref)
    assert err <= TOL, f"rel_err {err:.3e} > {TOL}"
    dead = (_local(ids, kw["expert_map"], E) < 0).all(dim=1)
    assert (out[dead] == 0).all(), "tokens whose slots are all invalid give exactly 0"


# ------------------------------------------------------------------------------------------------- decode and scales


@cuda
@pytest.mark.parametrize("three_d", [False, True])
def test_ptx_decode_equals_dequantize_bitwise(three_d):
    """The inline-PTX decode (the GEMMs' on the GPU) is dequantize_mxfp4 bit for bit for every byte under every scale:
    0 (2^-127, subnormal products kept), 1 .. 254 (2^-126 .. 2^127; inf past bf16's range, as in fp32) and NaN for
    255. The portable decode (PTX=False) is exact everywhere, on the GPU too."""
    q, s = decode_case("cuda")
    ref = dequantize_mxfp4(q, s)
    assert_bitwise_with_nans(run_decode(q, s, True, three_d), ref)
    assert {0, 1, 127, 147, 254, 255} <= set(DECODE_SCALES)
    assert_bitwise_with_nans(run_decode(q, s, False, three_d), ref)


def _wide_scales(shape, gen):
    """Scales [E, rows, groups] from 107..147 (2^-20 .. 2^20): rows 0, 3, 6.. from 107..111, rows 1, 4, 7.. from
    143..147, the others from the whole range."""
    s = torch.randint(107, 148, shape, device="cuda", dtype=torch.int32, generator=gen)
    kind = (torch.arange(shape[1], device="cuda") % 3)[None, :, None]
    return torch.where(kind == 0, 107 + s % 5, torch.where(kind == 1, 143 + s % 5, s)).to(torch.uint8)


def _per_column_rel_err(out, ref):
    """The largest rel err over the output columns (each column is one weight row, of its own magnitude)."""
    out, ref = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    assert out.isfinite().all()
    return ((out - ref).norm(dim=0) / ref.norm(dim=0).clamp_min(1e-300)).max().item()


@cuda
@pytest.mark.parametrize("M", [1, 200])
def test_scales_from_2e_minus_20_to_2e20(M):
    """Scales spanning 2^-20 .. 2^20 (s = 107 .. 147): each output column of expert_gemm1 and expert_gemm2 matches
    the PyTorch implementation on its own magnitude (M = 1: the GEMVs; 200: the grouped GEMMs), and so does
    fused_experts (swigluoai clamps the huge gates)."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    E, topk, K, N = 8, 2, 1024, 352
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, transposed=M == 1, scales=_wide_scales)
    assert s1.min() == 107 and s1.max() == 147 and s2.min() == 107 and s2.max() == 147
    g, ids = _routing(M, E, topk, True, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    valid = _local(ids, None, E) >= 0
    h = torch.ops.moe_ext.expert_gemm1(x, w1, ids, quant="mxfp4", w1_scale=s1)
    ref_h = expert_gemm1_torch(x.float(), w1, ids, quant="mxfp4", w1_scale=s1)
    col_max = ref_h[valid].abs().amax(dim=0)
    assert col_max.max() / col_max.min() > 1e9, "output columns of very different magnitudes"
    assert _per_column_rel_err(h[valid], ref_h[valid]) <= TOL
    a = torch.randn(M, topk, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.ops.moe_ext.expert_gemm2(a, w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2)
    ref_y = expert_gemm2_torch(a.float(), w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2)
    assert _per_column_rel_err(y[valid], ref_y[valid]) <= TOL
    out = _fused(x, w1, s1, w2, s2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2)
    ref = _fused_reference(x, w1, s1, w2, s2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2)
    live = valid.any(dim=1)
    assert _per_column_rel_err(out[live], ref[live]) <= TOL


def _nan_scale_case(M):
    """Inputs with one w1 scale byte 255 (expert e, row n = 2N - 5, group 17) and the slots routed to e."""
    gen = torch.Generator(device="cuda").manual_seed(100 + M)
    E, topk, K, N = 8, 4, 1024, 352
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    g, ids = _routing(M, E, topk, True, gen)
    local = _local(ids, None, E)
    e = int(local[0][local[0] >= 0][0]) if M == 1 else 3
    n = 2 * N - 5
    s1[e, n, 17] = 255
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    routed = local == e
    assert routed.any() and (M == 1 or ((local >= 0) & ~routed).any())
    return x, (w1, s1, w2, s2), dict(w1_bias=b1, w2_bias=b2), g, ids, routed, n


@cuda
@pytest.mark.parametrize("M", [1, 77, 1000])
def test_nan_scale_stays_in_its_block(M):
    """One w1 scale byte 255 (expert e, row n, group 17): expert_gemm1 gives NaN in column n of exactly the pairs
    routed to e, everything else is finite and matches; fused_experts (silu) makes exactly the tokens with a slot
    on e NaN, the others are finite and match, and with swigluoai too the tokens not on e are finite and match.
    The PyTorch implementation agrees on where the NaN are. M = 1 runs the GEMVs, 77 and 1000 the grouped GEMMs."""
    x, (w1, s1, w2, s2), biases, g, ids, routed, n = _nan_scale_case(M)
    h = torch.ops.moe_ext.expert_gemm1(x, w1, ids, w1_bias=biases["w1_bias"], quant="mxfp4", w1_scale=s1)
    ref_h = expert_gemm1_torch(x.float(), w1, ids, w1_bias=biases["w1_bias"], quant="mxfp4", w1_scale=s1)
    expected = torch.zeros_like(h, dtype=torch.bool)
    expected[routed, n] = True
    assert torch.equal(ref_h.isnan(), expected)
    assert torch.equal(h.isnan(), expected), "NaN confined to column n of the pairs routed to e"
    assert rel_err(h[~expected], ref_h[~expected]) <= TOL
    hit = routed.any(dim=1)
    for act in ("silu", "swigluoai"):
        out = _fused(x, w1, s1, w2, s2, g, ids, act, **biases)
        ref = _fused_reference(x, w1, s1, w2, s2, g, ids, act, **biases)
        assert ref[hit].isnan().all() and ref[~hit].isfinite().all()
        if act == "silu":
            assert out[hit].isnan().all(), "a NaN weight makes its tokens' outputs NaN"
        assert out[~hit].isfinite().all(), "tokens not routed to e stay finite"
        if (~hit).any():
            assert rel_err(out[~hit], ref[~hit]) <= TOL


@cuda
@pytest.mark.parametrize("M", [1, 77])
def test_nan_scale_propagates_through_swigluoai(M):
    """A NaN weight (scale 255) feeding an up row: the tokens routed to its expert are NaN with swigluoai, as in the
    PyTorch implementation (and with silu, test_nan_scale_stays_in_its_block)."""
    x, (w1, s1, w2, s2), biases, g, ids, routed, _ = _nan_scale_case(M)
    out = _fused(x, w1, s1, w2, s2, g, ids, "swigluoai", **biases)
    assert out[routed.any(dim=1)].isnan().all()


# ------------------------------------------------------------------------------------------------- unfused


ACT_OPS = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "swigluoai": swigluoai_and_mul,
           "swiglustep": swiglustep_and_mul}


@cuda
@pytest.mark.parametrize("M,topk,E,K,N,act,on_input,emap", [
    (1, 4, 32, 2880, 2880, "swigluoai", False, False),
    (77, 2, 8, 1024, 352, "silu", True, True),
    (1000, 6, 32, 2048, 768, "gelu_tanh", False, True),
    (4096, 4, 128, 2880, 2880, "swigluoai", False, False),
    (3, 1, 8, 2048, 768, "swiglustep", True, False),
    (512, 4, 32, 1024, 352, "gelu", False, False),
])
def test_unfused_equals_fused(M, topk, E, K, N, act, on_input, emap):
    """expert_gemm1 -> the activation op -> expert_gemm2 with the router weights -> sum over the slots (router
    weights on gemm1's input instead with on_input) equals fused_experts within 1e-2 (it rounds h to bf16 where
    the fused path keeps it in fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(M * 10 + topk)
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=M == 77)
    e_ids = E + 3 if emap else E
    g, ids = _routing(M, e_ids, topk, True, gen)
    expert_map = random_expert_map(e_ids, E, device="cuda") if emap else None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.ops.moe_ext.expert_gemm1(x, w1, ids, w1_bias=b1, expert_map=expert_map,
                                       topk_weights=g if on_input else None, quant="mxfp4", w1_scale=s1)
    a = ACT_OPS[act](h)
    y = torch.ops.moe_ext.expert_gemm2(a, w2, ids, w2_bias=b2, expert_map=expert_map,
                                       topk_weights=None if on_input else g, quant="mxfp4", w2_scale=s2)
    unfused = y.float().sum(dim=1)
    fused = _fused(x, w1, s1, w2, s2, g, ids, act, w1_bias=b1, w2_bias=b2, expert_map=expert_map,
                   apply_router_weight_on_input=on_input)
    assert h.shape == (M, topk, 2 * N) and y.shape == (M, topk, K)
    assert fused.isfinite().all() and unfused.isfinite().all()
    err = rel_err(fused, unfused)
    assert err <= TOL, f"rel_err {err:.3e} > {TOL}"
    invalid = _local(ids, expert_map, E) < 0
    assert invalid.any() and (h[invalid] == 0).all() and (y[invalid] == 0).all(), "invalid slots: rows of 0"


# ------------------------------------------------------------------------------------------------- CUDA graphs

GRAPH_SHAPE = dict(E=16, topk=4, K=256, N=192)
ENTRY_POINTS = ("fused_experts", "fused_moe", "expert_gemm1", "expert_gemm2")


@cuda
@pytest.mark.parametrize("op", ENTRY_POINTS)
@pytest.mark.parametrize("M", [1, 8, 64, 512])
def test_cuda_graph_replays_match_eager(op, M):
    """Each MXFP4 entry point captured in a CUDA graph (after a warm-up on a side stream, and one eager call under
    sync debug mode "error": no host sync inside the op): 12 replays with new inputs copied into the static ones,
    each bitwise equal to an eager call on the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    E, topk, K, N = GRAPH_SHAPE["E"], GRAPH_SHAPE["topk"], GRAPH_SHAPE["K"], GRAPH_SHAPE["N"]
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=op == "expert_gemm2")
    emap = random_expert_map(E + 2, E, device="cuda")  # two global ids are not local (-1)
    call = entry_point_call(op, "mxfp4", "swigluoai", topk, (w1, s1, w2, s2, b1, b2), emap)

    def fresh():
        return entry_point_inputs(op, M, E, topk, K, N, _routing, gen)

    assert_graph_replays_match_eager(call, fresh(), fresh, finite=True)


# ------------------------------------------------------------------------------------------------- determinism, compile


@cuda
def test_deterministic_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(7)
    E, K, N = 32, 2048, 768
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    for M in (1, 1000):
        g, ids = _routing(M, E, 4, True, gen)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        first, second = (_fused(x, w1, s1, w2, s2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2) for _ in range(2))
        assert first.isfinite().all() and torch.equal(first, second)
        h1, h2 = (torch.ops.moe_ext.expert_gemm1(x, w1, ids, quant="mxfp4", w1_scale=s1) for _ in range(2))
        assert torch.equal(h1, h2)


class GptOssLikeBlock(torch.nn.Module):
    """Router (fp32 linear, as gpt-oss computes its logits in fp32 from bf16 hidden states) -> topk_softmax
    (renormalized) -> fused_experts with MXFP4 weights, biases and swigluoai."""

    def __init__(self, E=32, topk=4, K=1024, N=352, seed=5):
        super().__init__()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.topk = topk
        self.router = torch.nn.Linear(K, E, device="cuda")
        w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True, transposed=True)
        for name, t in (("w1", w1), ("w1_scale", s1), ("w2", w2), ("w2_scale", s2), ("w1_bias", b1),
                        ("w2_bias", b2)):
            self.register_buffer(name, t)

    def forward(self, x):
        topk_weights, topk_ids = topk_softmax(self.router(x.float()), self.topk, True)
        return torch.ops.moe_ext.fused_experts(x, self.w1, self.w2, topk_weights, topk_ids, "swigluoai",
                                               w1_bias=self.w1_bias, w2_bias=self.w2_bias, quant="mxfp4",
                                               w1_scale=self.w1_scale, w2_scale=self.w2_scale)


@cuda
def test_compile_gpt_oss_like_block():
    """torch.compile(fullgraph=True, dynamic=True): no recompile for M from 17 to 4096 once M = 2 and 3 have
    compiled; every size matches eager. mode="reduce-overhead" (CUDA graphs) matches eager too."""
    import torch._dynamo

    gen = torch.Generator(device="cuda").manual_seed(3)
    block = GptOssLikeBlock()
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
        for M in (17, 64, 333, 1000, 4096):
            check(compiled, M)

    torch._dynamo.reset()
    overhead = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for M in (64, 64, 64, 512, 512):
        check(overhead, M)
