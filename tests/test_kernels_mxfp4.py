"""MXFP4 weights (``quant="mxfp4"``) through the routed-expert Triton kernels, called directly on CPU tensors in
Triton's interpreter (the portable decode, ``PTX=False``): the decode itself against ``dequantize_mxfp4``
(every byte, every kind of scale), ``fused_experts_triton`` on both schedules (direct GEMVs; sorted with tail
tiles and with a split gemm2) against ``fused_experts_torch`` on the same quantized weights, the unfused
``expert_gemm1/2_triton`` against ``expert_gemm1/2_torch``, a NaN scale (255) confined to its outputs, scales
from 2^-20 to 2^20, and the config rules of the format.

The contract: activations rounded to bf16 before each GEMM, fp32 accumulation. The interpreter's bf16 tl.dot is
wrong and its fp32 -> bf16 cast truncates, so the cases use fp32 and fp16 activations (the MXFP4 path rounds
them to bf16 itself, with integer ops). Two places where the kernels round differently from the PyTorch
implementation, ~1e-3 of relative error on the output: the fused path stores its intermediate in the
activations' dtype and gemm2 rounds it to bf16: for fp16 a double rounding (fp32 -> fp16 -> bf16) where the
reference rounds once (fp32 -> bf16). (apply_router_weight_on_input rounds ``g x`` to bf16 as the reference does:
``test_on_input_router_weight_is_rounded_with_x``.)
So every case is checked tightly (1e-5 fp32, 1e-3 fp16) against the PyTorch GEMMs composed with the kernels'
rounding points (``kernel_rounding_reference``; for fp32 that is fused_experts_torch exactly), and against
fused_experts_torch itself with a tolerance that admits that rounding (5e-3).

The GPU (inline PTX decode, bf16 tensor cores) is covered by tests/test_fused_experts_mxfp4_cuda.py.
"""

import dataclasses
import json
import math

import pytest
import torch
import triton
import triton.language as tl

import moe_extension.kernels._configs as configs
import moe_extension.kernels._routing as routing_module
import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig
from moe_extension.kernels._weight_formats import mxfp4_decode
from moe_extension.ops import activation_torch, fused_experts_torch
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant import dequantize_mxfp4, quantize_mxfp4
from tests.reference import random_expert_map, random_routing
from tests.utils import INTERPRETED, poison, rel_err

interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs the kernels on CPU tensors in Triton's interpreter "
                                 "(the GPU suite is tests/test_fused_experts_mxfp4_cuda.py)")

FP32_TOL = 1e-5
FP16_TOL = 1e-3
# Against fused_experts_torch where the kernels round differently (fp16 intermediate, on-input router weights; see
# the module docstring): 0.9e-3 to 3e-3 measured on these cases.
ROUNDING_POINTS_TOL = 5e-3


# ------------------------------------------------------------------------------------------------- decode


@triton.jit
def _decode_kernel(q_ptr, s_ptr, lo_ptr, hi_ptr, R: tl.constexpr, C: tl.constexpr, THREE_D: tl.constexpr,
                   PTX: tl.constexpr):
    """lo/hi [R, C] fp32 = mxfp4_decode of q [R, C] bytes with s [R, C / 16] scales (as a [2, R / 2, ...] tile
    with THREE_D)."""
    r = tl.arange(0, R)[:, None]
    q = tl.load(q_ptr + r * C + tl.arange(0, C)[None, :])
    s = tl.load(s_ptr + r * (C // 16) + tl.arange(0, C // 16)[None, :])
    if THREE_D:
        lo, hi = mxfp4_decode(q.reshape(2, R // 2, C), s.reshape(2, R // 2, C // 16), PTX)
        lo, hi = lo.reshape(R, C), hi.reshape(R, C)
    else:
        lo, hi = mxfp4_decode(q, s, PTX)
    offs = r * C + tl.arange(0, C)[None, :]
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(hi_ptr + offs, hi.to(tl.float32))


# 16 scales: the subnormal 2^-127 (0), the extremes (1, 254), NaN (255), 1.0 (127), 2^20 (147) and others.
DECODE_SCALES = (0, 1, 2, 64, 100, 107, 126, 127, 128, 133, 147, 160, 200, 253, 254, 255)


def decode_case(device):
    """q [16, 256]: every row holds all 256 byte values; s [16, 16]: row r's group g has DECODE_SCALES[(r + g) %
    16], so each byte meets every scale (in some row) and the groups of a row all differ."""
    R = len(DECODE_SCALES)
    q = torch.arange(256, dtype=torch.int32).repeat(R, 1).to(torch.uint8)
    idx = (torch.arange(R)[:, None] + torch.arange(16)[None, :]) % R
    s = torch.tensor(DECODE_SCALES, dtype=torch.int32)[idx].to(torch.uint8)
    return q.to(device), s.to(device)


def run_decode(q, s, ptx: bool, three_d: bool) -> torch.Tensor:
    """The decoded values [R, 512] fp32, columns in order (the even ones from lo, the odd ones from hi)."""
    R, C = q.shape
    lo, hi = (torch.empty(R, C, dtype=torch.float32, device=q.device) for _ in range(2))
    _decode_kernel[(1,)](q, s, poison(lo), poison(hi), R=R, C=C, THREE_D=three_d, PTX=ptx)
    return torch.stack([lo, hi], dim=-1).reshape(R, 2 * C)


def assert_bitwise_with_nans(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN exactly where ``ref`` is NaN, every other element bit for bit (signed zeros and subnormals included)."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), "NaN exactly where the reference is NaN"
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32)), "bitwise equal elsewhere"


# s = 254 times the codes 4 and 6 is past fp32's range: inf in both (numpy warns in the interpreter).
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("three_d", [False, True])
def test_portable_decode_equals_dequantize_bitwise(three_d):
    """mxfp4_decode(PTX=False), the interpreter's (and any GPU's portable) decode, is dequantize_mxfp4 bit for bit:
    all 256 bytes (both nibbles, -0 included) under scales 0 (2^-127: subnormal products), 1, 127, 147, 254 and
    255 (NaN for the whole group) among others; 2-D tiles (the GEMMs) and 3-D tiles (the second GEMV)."""
    device = "cuda" if not INTERPRETED else "cpu"
    q, s = decode_case(device)
    ref = dequantize_mxfp4(q, s)
    tiny = ref[s.repeat_interleave(32, dim=1) == 0]
    assert (tiny != 0).any() and (tiny.abs() <= 6 * 2.0**-127).all(), "s = 0: 2^-127, subnormal products"
    assert ref.isnan().sum() == 16 * 32 and (ref.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()
    assert_bitwise_with_nans(run_decode(q, s, False, three_d), ref)


# ------------------------------------------------------------------------------------------------- inputs


def mxfp4_experts(E, K, N, *, bias=False, transposed=False, seed=0, device="cpu"):
    """Quantized expert stacks: w1 uint8 [E, 2N, K/2] + w1_scale [E, 2N, K/32], w2 [E, K, N/2] + w2_scale
    [E, K, N/32] (with ``transposed``: weights and scales as .transpose(1, 2) views of [E, cols, rows] storage),
    fp32 biases."""
    gen = torch.Generator().manual_seed(seed)
    w1, s1 = quantize_mxfp4(torch.randn(E, 2 * N, K, generator=gen) / math.sqrt(K))
    w2, s2 = quantize_mxfp4(torch.randn(E, K, N, generator=gen) / math.sqrt(N))
    if transposed:
        w1, s1, w2, s2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w1, s1, w2, s2))
        assert w1.stride(2) != 1 and w2.stride(2) != 1
    b1 = torch.randn(E, 2 * N, generator=gen) * 0.5 if bias else None
    b2 = torch.randn(E, K, generator=gen) * 0.5 if bias else None
    return [None if t is None else t.to(device) for t in (w1, s1, w2, s2, b1, b2)]


def routing(M, topk, E, *, emap=False, seed=0):
    """(g, ids, expert_map): ids in [0, E (+ 5 with a map)) with ~20% invalid (-1, E_global, 2^31 - 1), the last
    token (when M > 1) with no valid slot, and NaN router weights on the invalid slots (never to be read)."""
    torch.manual_seed(seed)
    num_ids = E + 5 if emap else E
    g, ids = random_routing(M, num_ids, topk, invalid=0.2)
    if M > 1:
        ids[-1] = -1
    emap_t = random_expert_map(num_ids, E) if emap else None
    return g.masked_fill(~valid_slots(ids, emap_t, E), float("nan")), ids, emap_t


def local_ids(ids, emap, E):
    """The local expert of each slot, -1 for invalid slots."""
    ids = ids.long()
    if emap is not None:
        in_map = (ids >= 0) & (ids < emap.numel())
        ids = torch.where(in_map, emap.long()[ids.clamp(0, emap.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < E), ids, -1)


def valid_slots(ids, emap, E):
    return local_ids(ids, emap, E) >= 0


class _PoisonedAllocations:
    """Stands in for the torch module inside a kernels module: its torch.empty workspaces and outputs start
    poisoned (NaN, or -12345 for integers)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        return poison(torch.empty(*size, **kwargs))


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty of the launchers and of the routing returns NaN / -12345 filled memory."""
    monkeypatch.setattr(fe, "torch", _PoisonedAllocations())
    monkeypatch.setattr(routing_module, "torch", _PoisonedAllocations())


# ------------------------------------------------------------------------------------------------- configs

# Tiles the product accepts for MXFP4 (each case checks sanitize leaves them as they are): block_k 32 / 64 (one
# or two scale groups per row, K = 96 with 64 takes a masked tail step), 1 warp (>= 4 packed bytes per thread).
SORTED = MoeConfig("sorted", 16, GemmConfig(32, 64, 1, 2), GemmConfig(32, 32, 1, 2))
# block_m 32: partial blocks with <= 16 valid rows run 16-row tail tiles (both GEMMs).
SORTED_TAIL = MoeConfig("sorted", 32, GemmConfig(16, 32, 1, 2, tail_m=16), GemmConfig(32, 64, 1, 2, tail_m=16))
# gemm2's reduction (N = 96 or 128) in two splits of 64 columns (N = 96: the second one a masked 32), expert-major.
SORTED_SPLIT = MoeConfig("sorted", 16, GemmConfig(32, 64, 1, 2, group_m=0),
                         GemmConfig(16, 64, 1, 2, group_m=0, split_k=2))
DIRECT = MoeConfig("direct", 0, GemmConfig(32, 32, 1, 2), GemmConfig(32, 64, 1, 2))
CONFIGS = {"sorted": SORTED, "sorted_tail": SORTED_TAIL, "sorted_split": SORTED_SPLIT, "direct": DIRECT}


def checked_config(name, dtype, N, K, topk) -> MoeConfig:
    cfg = CONFIGS[name]
    assert configs.sanitize(cfg, dtype, N, K, topk, quant="mxfp4") == cfg, "a config the product would run"
    return cfg


# ------------------------------------------------------------------------------------------------- fused


def kernel_rounding_reference(x, w1, w2, g, ids, act, s1, s2, kw):
    """fused_experts from the PyTorch GEMMs (bf16-rounded inputs, fp32 math) with the kernels' rounding points:
    the intermediate rounded to x.dtype (as the kernels store it) before gemm2 rounds it to bf16. fp32: exactly
    fused_experts_torch's math."""
    on_input, emap = kw["apply_router_weight_on_input"], kw["expert_map"]
    h = expert_gemm1_torch(x.float(), w1, ids, w1_bias=kw["w1_bias"], expert_map=emap,
                           topk_weights=g if on_input else None, quant="mxfp4", w1_scale=s1)
    a = activation_torch(h, act, kw["alpha"], kw["limit"]).to(x.dtype).float()
    y = expert_gemm2_torch(a, w2, ids, w2_bias=kw["w2_bias"], expert_map=emap, topk_weights=None if on_input else g,
                           quant="mxfp4", w2_scale=s2)
    return y.sum(dim=1).to(x.dtype)


# (config, activation, dtype, M, topk, E, K, N, options): the five activations on each schedule, fp32 and fp16,
# bias, expert_map, on-input router weights, transposed storage, K / N of 1, 2, 3 and 4 scale groups per 64.
FUSED_CASES = [
    ("sorted", "silu", torch.float32, 9, 3, 5, 96, 64, dict(bias=True)),
    ("sorted", "swigluoai", torch.float16, 12, 2, 6, 64, 96, dict(bias=True, on_input=True, emap=True)),
    ("sorted", "gelu", torch.float32, 6, 4, 4, 128, 32, dict(emap=True, transposed=True)),
    ("sorted_tail", "gelu_tanh", torch.float16, 40, 3, 6, 64, 64, dict(bias=True, transposed=True)),
    ("sorted_tail", "swiglustep", torch.float32, 48, 3, 5, 96, 32, dict(on_input=True, emap=True)),
    ("sorted_split", "silu", torch.float16, 16, 2, 4, 64, 96, dict(bias=True, emap=True)),
    ("sorted_split", "swigluoai", torch.float32, 10, 4, 5, 96, 128, dict(bias=True, transposed=True,
                                                                         on_input=True)),
    ("direct", "silu", torch.float16, 1, 3, 8, 96, 64, dict(bias=True, emap=True)),
    ("direct", "swigluoai", torch.float32, 3, 4, 9, 64, 32, dict(bias=True, transposed=True, on_input=True)),
    ("direct", "gelu", torch.float16, 4, 2, 6, 128, 64, dict(bias=True)),
    ("direct", "gelu_tanh", torch.float32, 1, 6, 8, 64, 96, dict(emap=True, transposed=True)),
    ("direct", "swiglustep", torch.float16, 4, 1, 8, 96, 32, dict(bias=True, on_input=True)),
]


def _fused_id(case):
    cfg, act, dtype, M, topk, E, K, N, opts = case
    return f"{cfg}-{act}-{str(dtype)[6:]}-M{M}-k{topk}-E{E}-{K}x{N}-" + "".join(sorted(o[0] for o in opts if opts[o]))


@interpreted
@pytest.mark.parametrize("case", FUSED_CASES, ids=_fused_id)
def test_fused_experts_matches_torch(poisoned, case):
    """fused_experts_triton(quant="mxfp4") against fused_experts_torch on the same quantized weights; every
    workspace and the output start NaN-poisoned, router weights of invalid slots are NaN, the last token has no
    valid slot (exactly 0)."""
    name, act, dtype, M, topk, E, K, N, opts = case
    cfg = checked_config(name, dtype, N, K, topk)
    w1, s1, w2, s2, b1, b2 = mxfp4_experts(E, K, N, bias=opts.get("bias", False),
                                           transposed=opts.get("transposed", False), seed=M * 31 + K + N)
    g, ids, emap = routing(M, topk, E, emap=opts.get("emap", False), seed=M + E)
    if name == "sorted_tail":
        counts = torch.bincount(local_ids(ids, emap, E).flatten() + 1, minlength=E + 1)[1:]
        assert ((counts > 0) & (counts <= 16)).any() and (counts > 16).any(), "tail tiles and full tiles"
    x = torch.randn(M, K, dtype=dtype)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, apply_router_weight_on_input=opts.get("on_input", False),
              alpha=1.702, limit=7.0)
    out = fused_experts_triton(x, w1, w2, g, ids, act, quant="mxfp4", w1_scale=s1, w2_scale=s2, config=cfg, **kw)
    assert out.shape == (M, K) and out.dtype == dtype
    assert out.isfinite().all(), "every output element written, no NaN from poison or invalid slots"
    valid = valid_slots(ids, emap, E)
    assert valid.sum() >= min(M * topk // 3, 3) and (M == 1 or not valid[-1].any())
    assert (out[~valid.any(dim=1)] == 0).all(), "a token without valid slots gives exactly 0"
    ref = fused_experts_torch(x, w1, w2, g, ids, act, quant="mxfp4", w1_scale=s1, w2_scale=s2, **kw)
    tol = FP32_TOL if dtype == torch.float32 else FP16_TOL
    assert rel_err(out, kernel_rounding_reference(x, w1, w2, g, ids, act, s1, s2, kw)) <= tol
    assert rel_err(out, ref) <= (FP32_TOL if dtype == torch.float32 else ROUNDING_POINTS_TOL)


@interpreted
@pytest.mark.parametrize("name", ["sorted_split", "direct"])
def test_fused_experts_deterministic(name):
    w1, s1, w2, s2, b1, b2 = mxfp4_experts(5, 64, 96, bias=True, seed=1)
    g, ids, _ = routing(6, 4, 5, seed=2)
    x = torch.randn(6, 64)
    cfg = checked_config(name, x.dtype, 96, 64, 4)
    first, second = (fused_experts_triton(x, w1, w2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2, quant="mxfp4",
                                          w1_scale=s1, w2_scale=s2, config=cfg) for _ in range(2))
    assert torch.equal(first, second)


# ------------------------------------------------------------------------------------------------- unfused


@interpreted
@pytest.mark.parametrize("name,on_input,dtype,transposed", [
    ("sorted", False, torch.float32, False),
    ("sorted_tail", True, torch.float32, True),
    ("direct", False, torch.float16, True),
    ("direct", True, torch.float32, False),
])
def test_expert_gemms_match_torch(name, on_input, dtype, transposed):
    """expert_gemm1_triton / expert_gemm2_triton(quant="mxfp4") against expert_gemm1_torch / expert_gemm2_torch
    (expert_map, bias, router weights on the input of gemm1 or the output of gemm2, a strided intermediate);
    rows of invalid slots exactly 0."""
    M, topk, E, K, N = 20, 3, 5, 96, 64
    cfg = checked_config(name, dtype, N, K, topk)
    w1, s1, w2, s2, b1, b2 = mxfp4_experts(E, K, N, bias=True, transposed=transposed, seed=4)
    g, ids, emap = routing(M, topk, E, emap=True, seed=5)
    x = torch.randn(M, K, dtype=dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP16_TOL
    g1 = g if on_input else None
    h = expert_gemm1_triton(x, w1, ids, w1_bias=b1, expert_map=emap, topk_weights=g1, quant="mxfp4", w1_scale=s1,
                            config=cfg)
    ref_h = expert_gemm1_torch(x, w1, ids, w1_bias=b1, expert_map=emap, topk_weights=g1, quant="mxfp4",
                               w1_scale=s1)
    assert h.shape == (M, topk, 2 * N) and h.dtype == dtype
    assert rel_err(h, ref_h) <= tol
    invalid = ~valid_slots(ids, emap, E)
    assert invalid.any() and (h[invalid] == 0).all(), "invalid slots give rows of exactly 0"
    g2 = None if on_input else g
    a = torch.randn(M, topk, N, dtype=dtype)
    a_strided = torch.randn(M, topk + 1, N + 32, dtype=dtype)[:, 1:, 16:16 + N]  # non-contiguous [M, topk, N]
    for inter in (a, a_strided):
        y = expert_gemm2_triton(inter, w2, ids, w2_bias=b2, expert_map=emap, topk_weights=g2, quant="mxfp4",
                                w2_scale=s2, config=cfg)
        ref_y = expert_gemm2_torch(inter, w2, ids, w2_bias=b2, expert_map=emap, topk_weights=g2, quant="mxfp4",
                                   w2_scale=s2)
        assert y.shape == (M, topk, K) and y.dtype == dtype
        assert rel_err(y, ref_y) <= tol
        assert (y[invalid] == 0).all(), "invalid slots give rows of exactly 0"


@interpreted
@pytest.mark.parametrize("name", ["sorted", "direct"])
def test_on_input_router_weight_is_rounded_with_x(name):
    """apply_router_weight_on_input with MXFP4: the GEMM input is bf16(g x) (the fp32 product rounded), as
    expert_gemm1_torch, fused_experts_torch and tests/reference.py have it."""
    M, topk, E, K, N = 8, 3, 4, 96, 32
    cfg = checked_config(name, torch.float32, N, K, topk)
    w1, s1, _, _, b1, _ = mxfp4_experts(E, K, N, bias=True, seed=12)
    g, ids, _ = routing(M, topk, E, seed=13)
    x = torch.randn(M, K)
    h = expert_gemm1_triton(x, w1, ids, w1_bias=b1, topk_weights=g, quant="mxfp4", w1_scale=s1, config=cfg)
    ref = expert_gemm1_torch(x, w1, ids, w1_bias=b1, topk_weights=g, quant="mxfp4", w1_scale=s1)
    assert rel_err(h, ref) <= FP32_TOL


# ------------------------------------------------------------------------------------------------- scales


@interpreted
@pytest.mark.parametrize("name", ["sorted", "direct"])
def test_nan_scale_stays_in_its_block(name):
    """One w1 scale byte 255 (expert e, row n, group gi): expert_gemm1 gives NaN in column n of the pairs routed to
    e and nowhere else; every other element is finite and matches the reference. The reference agrees on
    where the NaN are."""
    M, topk, E, K, N = 12, 3, 4, 96, 32
    cfg = checked_config(name, torch.float32, N, K, topk)
    w1, s1, _, _, b1, _ = mxfp4_experts(E, K, N, bias=True, seed=6)
    g, ids, _ = routing(M, topk, E, seed=7)
    e, n, gi = 2, 37, 1
    s1[e, n, gi] = 255
    x = torch.randn(M, K)
    h = expert_gemm1_triton(x, w1, ids, w1_bias=b1, quant="mxfp4", w1_scale=s1, config=cfg)
    ref = expert_gemm1_torch(x, w1, ids, w1_bias=b1, quant="mxfp4", w1_scale=s1)
    routed = local_ids(ids, None, E) == e
    assert routed.any() and (~routed & valid_slots(ids, None, E)).any()
    expected_nan = torch.zeros_like(h, dtype=torch.bool)
    expected_nan[routed, n] = True
    assert torch.equal(ref.isnan(), expected_nan), "the reference: NaN in column n of e's pairs"
    assert torch.equal(h.isnan(), expected_nan), "NaN confined to column n of the pairs routed to e"
    assert h[~expected_nan].isfinite().all()
    assert rel_err(h[~expected_nan], ref[~expected_nan]) <= FP32_TOL


@interpreted
def test_nan_scale_confined_to_its_tokens_fused(poisoned):
    """The fused path (split gemm2): a NaN scale in w1 of expert 1 makes every output of the tokens with a slot on
    expert 1 NaN (one intermediate column feeds all of gemm2), a NaN scale in w2 of expert 3 (row 5) only column 5
    of the tokens on expert 3; everything else is finite and equals the reference, which has the same NaN."""
    M, topk, E, K, N = 12, 2, 5, 64, 128
    cfg = checked_config("sorted_split", torch.float32, N, K, topk)
    w1, s1, w2, s2, b1, b2 = mxfp4_experts(E, K, N, bias=True, seed=8)
    g, ids, _ = routing(M, topk, E, seed=9)
    s1[1, 70, 0] = 255
    s2[3, 5, 3] = 255
    x = torch.randn(M, K)
    kw = dict(w1_bias=b1, w2_bias=b2, quant="mxfp4", w1_scale=s1, w2_scale=s2)
    out = fused_experts_triton(x, w1, w2, g, ids, "silu", config=cfg, **kw)
    ref = fused_experts_torch(x, w1, w2, g, ids, "silu", **kw)
    local = local_ids(ids, None, E)
    on1, on3 = (local == 1).any(dim=1), (local == 3).any(dim=1)
    assert on1.any() and (on3 & ~on1).any() and (~on1 & ~on3).sum() >= 3
    expected_nan = torch.zeros(M, K, dtype=torch.bool)
    expected_nan[on1] = True
    expected_nan[on3, 5] = True
    assert torch.equal(ref.isnan(), expected_nan)
    assert torch.equal(out.isnan(), expected_nan)
    assert rel_err(out[~expected_nan], ref[~expected_nan]) <= FP32_TOL


def wide_scale_experts(E, K, N, seed):
    """Random codes (every byte value) with random scales in both stacks: rows 0, 3, 6.. from 107..111 (2^-20 ..
    2^-16), rows 1, 4, 7.. from 143..147 (2^16 .. 2^20), the others from all of 107..147."""
    gen = torch.Generator().manual_seed(seed)

    def stack(rows, cols):
        codes = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        s = torch.randint(107, 148, (E, rows, cols // 32), generator=gen, dtype=torch.int32)
        kind = (torch.arange(rows) % 3)[None, :, None]
        s = torch.where(kind == 0, 107 + s % 5, torch.where(kind == 1, 143 + s % 5, s))
        return codes, s.to(torch.uint8)

    (w1, s1), (w2, s2) = stack(2 * N, K), stack(K, N)
    assert s1.min() == 107 and s1.max() == 147
    return w1, s1, w2, s2


def per_column_rel_err(out, ref):
    """The largest rel err over the output columns (one column = one weight row: its own magnitude)."""
    out, ref = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    assert out.isfinite().all()
    return ((out - ref).norm(dim=0) / ref.norm(dim=0).clamp_min(1e-300)).max().item()


@interpreted
# swigluoai's exp(-alpha * gate) of the huge negative gates overflows to inf (sigmoid 0, by design): numpy warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("name", ["sorted", "direct"])
def test_scales_from_2e_minus_20_to_2e20(name):
    """Scales spanning 2^-20 .. 2^20 (s = 107..147) in every row: each output column of both GEMMs matches the
    reference on its own magnitude, and so does the fused path (swigluoai clamps the huge gates)."""
    M, topk, E, K, N = 8, 2, 3, 96, 64
    cfg = checked_config(name, torch.float32, N, K, topk)
    w1, s1, w2, s2 = wide_scale_experts(E, K, N, seed=10)
    g, ids, _ = routing(M, topk, E, seed=11)
    x = torch.randn(M, K)
    h = expert_gemm1_triton(x, w1, ids, quant="mxfp4", w1_scale=s1, config=cfg)
    ref_h = expert_gemm1_torch(x, w1, ids, quant="mxfp4", w1_scale=s1)
    valid = valid_slots(ids, None, E)
    col_max = ref_h[valid].abs().amax(dim=0)
    assert col_max.max() / col_max.min() > 1e9, "output columns of very different magnitudes"
    assert per_column_rel_err(h[valid], ref_h[valid]) <= FP32_TOL
    a = torch.randn(M, topk, N)
    y = expert_gemm2_triton(a, w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2, config=cfg)
    ref_y = expert_gemm2_torch(a, w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2)
    assert per_column_rel_err(y[valid], ref_y[valid]) <= FP32_TOL
    out = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", quant="mxfp4", w1_scale=s1, w2_scale=s2, config=cfg)
    ref = fused_experts_torch(x, w1, w2, g, ids, "swigluoai", quant="mxfp4", w1_scale=s1, w2_scale=s2)
    assert per_column_rel_err(out[:-1], ref[:-1]) <= FP32_TOL


# ------------------------------------------------------------------------------------------------- config rules


@pytest.mark.parametrize("path", ["sorted", "direct"])
def test_sanitize_mxfp4(path):
    """sanitize(quant="mxfp4"): block_k of at least one scale group, no TMA weight tiles, no persistent gemm2, at
    least 4 packed bytes per thread; the same config for bf16 keeps its block_k 16, TMA and persistent flags."""
    wild = GemmConfig(64, 16, 8, 4, tma_weights=True, persistent=True)
    cfg = MoeConfig(path, 64 if path == "sorted" else 0, wild, dataclasses.replace(wild, tma_a=True))
    for N, K, topk in ((2880, 2880, 4), (768, 2048, 8), (32, 64, 1)):
        out = configs.sanitize(cfg, torch.bfloat16, N, K, topk, quant="mxfp4")
        rows = (1, 1) if path == "sorted" else (1, configs.triton_next_pow2(topk))
        for g, row_mult in zip((out.gemm1, out.gemm2), rows):
            assert g.block_k >= 32 and not g.tma_weights and not g.persistent
            assert row_mult * g.block_n * g.block_k // 2 // (32 * g.num_warps) >= 4
    dense = configs.sanitize(cfg, torch.bfloat16, 768, 2048, 8)
    assert dense.gemm1.block_k == 16 and dense.gemm1.tma_weights
    assert dense.gemm2.persistent == (path == "sorted")


@pytest.mark.parametrize("M", [1, 3, 64, 1000, 4096])
@pytest.mark.parametrize("E,topk,K,N", [(128, 4, 2880, 2880), (32, 4, 2880, 2880), (8, 2, 1024, 352)])
def test_mxfp4_heuristic_configs(M, E, topk, K, N):
    """The heuristic for MXFP4 sanitizes to itself (no clamping needed) and keeps the format's rules."""
    for dtype in (torch.bfloat16, torch.float16):
        cfg = configs.heuristic_config(M, E, N, K, topk, dtype, True, True, 132, "mxfp4")
        assert cfg.path == ("direct" if configs.use_direct(M, E, topk, "mxfp4") else "sorted")
        san = configs.sanitize(cfg, dtype, N, K, topk, quant="mxfp4")
        for g in (san.gemm1, san.gemm2):
            assert g.block_k >= 32 and not g.tma_weights and not g.persistent
        if cfg.path == "sorted":
            assert san == cfg


def test_table_keys_carry_the_format(tmp_path, monkeypatch):
    """table_key appends ",quant=mxfp4"; a table holding only the bf16 entry of a shape does not serve MXFP4 calls
    (they get the MXFP4 heuristic) and an MXFP4 entry does not serve bf16 calls."""
    args = (8, 64, 32, 2, torch.bfloat16, True, True)
    key_none, key_mx = configs.table_key(*args), configs.table_key(*args, "mxfp4")
    assert key_mx == key_none + ",quant=mxfp4" and configs.table_key(*args, "none") == key_none
    bf16_entry = MoeConfig("sorted", 32, GemmConfig(32, 16, 4, 2), GemmConfig(32, 16, 4, 2))
    mx_entry = MoeConfig("sorted", 16, GemmConfig(64, 64, 2, 3), GemmConfig(128, 64, 4, 3))
    table = {"device": "Fake GPU", "configs": {key_none: {"16": bf16_entry.to_json()}}}
    path = tmp_path / f"{configs.device_slug('Fake GPU')}.json"
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "_device_facts", lambda device: ("Fake GPU", 132))

    def get(quant):
        configs._load_table.cache_clear()
        configs.get_config.cache_clear()
        return configs.get_config(16, *args, torch.device("cpu"), quant)

    try:
        path.write_text(json.dumps(table))
        assert get("none") == configs.sanitize(bf16_entry, torch.bfloat16, 64, 32, 2)
        heuristic = configs.heuristic_config(16, 8, 64, 32, 2, torch.bfloat16, True, True, 132, "mxfp4")
        assert get("mxfp4") == configs.sanitize(heuristic, torch.bfloat16, 64, 32, 2, quant="mxfp4")
        assert get("mxfp4") != get("none")
        table["configs"] = {key_mx: {"16": mx_entry.to_json()}}
        path.write_text(json.dumps(table))
        assert get("mxfp4") == configs.sanitize(mx_entry, torch.bfloat16, 64, 32, 2, quant="mxfp4")
        assert get("none") == configs.sanitize(configs.heuristic_config(16, *args), torch.bfloat16, 64, 32, 2)
    finally:
        configs._load_table.cache_clear()
        configs.get_config.cache_clear()
