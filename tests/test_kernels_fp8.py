"""fp8 block weights (``quant="fp8_block"``) through the routed-expert Triton kernels, called directly on CPU tensors
in Triton's interpreter (``PTX=False``): the activation quantization (``quantize_fp8_rows`` and the in-kernel
``quantize_fp8_groups``) against ``quantize_fp8_per_token_group`` bitwise, ``fused_experts_triton`` on both
schedules (direct GEMVs; sorted with tail tiles and with a split gemm2) against ``fused_experts_torch`` on the
same quantized weights, the unfused ``expert_gemm1/2_triton`` against ``expert_gemm1/2_torch``, and the config
rules of the format.

The contract (DESIGN, "fp8 block quantization"): activations quantized per token per 128 columns (the input of
the second GEMM too, from the fp32 activation output), products in fp32 with both scales applied per 128-wide K
block. K and N are not multiples of 128 in most cases (partial blocks and groups). The interpreter's bf16 tl.dot
is wrong, so the cases use fp32 and fp16 activations; the kernels' fp8 products are exact there (e4m3 values
held in fp32). What differs from the PyTorch implementation is the order of the fp32 sums (and, for fp16,
where the intermediate of the unfused path is rounded): an intermediate value near an e4m3 rounding boundary
can then land on its other side (one e4m3 step), so the outputs agree closely (``TOLS``) but not bitwise.

The GPU (fp8 tensor cores, hardware conversion) is covered by tests/test_fused_experts_fp8_cuda.py.
"""

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import moe_extension.kernels._configs as configs
import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig
from moe_extension.kernels._quantize_fp8 import quantize_fp8_rows
from moe_extension.kernels._weight_formats import WeightOperand, fp8_weight_scales
from moe_extension.ops import fused_experts_torch
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant import e8m0_to_float, quantize_fp8_block, quantize_fp8_per_token_group
from tests.test_kernels_mxfp4 import local_ids, poisoned, routing, valid_slots  # noqa: F401  (fixture)
from tests.utils import INTERPRETED, rel_err

interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs the kernels on CPU tensors in Triton's interpreter "
                                 "(the GPU suite is tests/test_fused_experts_fp8_cuda.py)")

# Kernels against the PyTorch implementation (see the module docstring); measured on these cases: up to 1.2e-5
# with fp32 activations, 3.5e-4 with fp16 ones (the output's own fp16 rounding is ~3e-4).
TOLS = {torch.float32: 1e-4, torch.float16: 2e-3}


# ------------------------------------------------------------------------------------------ activation quant


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K", [128, 200, 1000, 1300])
def test_quantize_fp8_rows_equals_per_token_group_bitwise(dtype, K):
    """Every row's values and scales as ``quantize_fp8_per_token_group`` computes them (scales bitwise, values
    equal; a zero's sign aside): random rows at scales from 2^-30 to 2^30 (2^-12 to 2^12 in fp16), a zero row
    (scale 1e-10 / 448), and a row of exact e4m3 ties (x / s halfway between two e4m3 values), where a rounding
    off by one ulp would show."""
    torch.manual_seed(K)
    span = 12 if dtype == torch.float16 else 30
    x = torch.randn(7, K) * torch.logspace(-span, span, 7, base=2.0)[:, None]
    x[3] = 0
    # Row 5: amax 448 (s = 1), the other values halfway between neighbouring e4m3 values: ties to even.
    q_all = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    q_pos = q_all[(q_all > 0) & q_all.isfinite()].sort().values
    mids = (q_pos[:-1] + q_pos[1:]) / 2
    x[5] = mids[torch.arange(K) % mids.numel()] * torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)
    x[5, ::128] = 448.0
    x = x.to(dtype)
    q, s = quantize_fp8_rows(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, math.ceil(K / 128))
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_rows_ue8m0_equals_per_token_group_bitwise(dtype):
    """UE8M0: the scales rounded up to powers of two (within a factor 2 above the plain ones; exact powers of two
    stay), values and scales as ``quantize_fp8_per_token_group(ue8m0=True)`` bitwise."""
    torch.manual_seed(1)
    x = (torch.randn(6, 300) * torch.logspace(-20, 20, 6, base=2.0)[:, None]).to(dtype)
    x[2, :128] = 0
    x[4, 0] = 448.0 * 2.0**-3  # amax / 448 a power of two: kept
    x[4, 1:128] = x[4, 1:128].clamp(-1.0, 1.0) * 448.0 * 2.0**-4
    q, s = quantize_fp8_rows(x, ue8m0=True)
    q_ref, s_ref = quantize_fp8_per_token_group(x, ue8m0=True)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    plain = quantize_fp8_per_token_group(x)[1]
    assert (s.view(torch.int32) & 0x7FFFFF == 0).all(), "powers of two"
    assert (s >= plain).all() and (s < 2 * plain).all() and s[4, 0] == plain[4, 0] == 2.0**-3


@interpreted
def test_fp8_weight_scales_decode_every_byte():
    """The kernels' UE8M0 decode (``fp8_weight_scales``) gives ``e8m0_to_float`` for all 256 bytes (0: 2^-127,
    255: NaN) and leaves fp32 scales as they are."""
    @triton.jit
    def decode(s_ptr, out_ptr):
        offs = tl.arange(0, 256)
        tl.store(out_ptr + offs, fp8_weight_scales(tl.load(s_ptr + offs)))

    b = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    decode[(1,)](b, out)
    assert torch.equal(out[:255], e8m0_to_float(b)[:255]) and out[255].isnan() and out[0] == 2.0**-127
    f = torch.rand(256) + 0.5
    decode[(1,)](f, out)
    assert torch.equal(out, f)


def test_quantize_fp8_rows_no_rows():
    q, s = quantize_fp8_rows(torch.empty(0, 300))
    assert q.shape == (0, 300) and s.shape == (0, 3)
    z = torch.full((5,), 7, dtype=torch.int32)
    quantize_fp8_rows(torch.empty(0, 300), zero=z)
    assert (z == 0).all()


@interpreted
@pytest.mark.parametrize("M, K, n", [(1, 300, 1), (1, 7168, 3000), (3, 1000, 9000)])
def test_quantize_fp8_rows_zeroes_the_counters(M, K, n):
    """``zero``: the same launch stores 0 in every element of the buffer (more elements than its programs store
    per pass included) and nothing past it; the quantized rows are those of the call without it."""
    torch.manual_seed(n)
    x = torch.randn(M, K)
    buf = torch.full((n + 16,), -5, dtype=torch.int32)
    q, s = quantize_fp8_rows(x, zero=buf[:n])
    assert (buf[:n] == 0).all() and (buf[n:] == -5).all()
    q_ref, s_ref = quantize_fp8_rows(x)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


# ------------------------------------------------------------------------------------------------ experts


def fp8_experts(E, K, N, *, bias=False, transposed=False, seed=0, ue8m0=False):
    """Quantized expert stacks (DESIGN's layout): w1 e4m3fn [E, 2N, K] + fp32 w1_scale [E, ceil(2N / 128),
    ceil(K / 128)], w2 [E, K, N] + w2_scale; per-block magnitudes spread over 2^-3 .. 2^3 so that every block
    has its own scale; with ``transposed`` weights and scales are .transpose(1, 2) views of [E, cols, rows]
    storage; fp32 biases; ``ue8m0``: power-of-two scales as uint8 E8M0 bytes."""
    gen = torch.Generator().manual_seed(seed)

    def stack(rows, cols):
        w = torch.randn(E, rows, cols, generator=gen) / math.sqrt(cols)
        spread = 2.0 ** torch.randint(-3, 4, (E, math.ceil(rows / 128), math.ceil(cols / 128)), generator=gen)
        return quantize_fp8_block(w * spread.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[..., :cols],
                                  ue8m0=ue8m0)

    w1, s1 = stack(2 * N, K)
    w2, s2 = stack(K, N)
    if transposed:
        w1, s1, w2, s2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w1, s1, w2, s2))
        assert w1.stride(2) != 1 and w2.stride(2) != 1
    b1 = torch.randn(E, 2 * N, generator=gen) * 0.5 if bias else None
    b2 = torch.randn(E, K, generator=gen) * 0.5 if bias else None
    return w1, s1, w2, s2, b1, b2


# Tiles the product accepts for fp8 block (each case checks that sanitize leaves them as they are): 128-column
# steps and 128-column output tiles (gemm1 quantizes whole groups of its output).
SORTED = MoeConfig("sorted", 16, GemmConfig(128, 128, 4, 2), GemmConfig(128, 128, 4, 2))
# block_m 32: partial blocks with <= 16 valid rows run 16-row tail tiles (both GEMMs).
SORTED_TAIL = MoeConfig("sorted", 32, GemmConfig(128, 128, 4, 2, tail_m=16), GemmConfig(128, 128, 4, 2, tail_m=16))
# gemm2's reduction in two splits of 128 columns, expert-major.
SORTED_SPLIT = MoeConfig("sorted", 16, GemmConfig(128, 128, 4, 2, group_m=0),
                         GemmConfig(128, 128, 4, 2, group_m=0, split_k=2))
# 128-row blocks (N a multiple of 128: one weight scale per 128-row part of a tile), 64-row tail tiles.
SORTED_128 = MoeConfig("sorted", 128, GemmConfig(128, 128, 8, 2, tail_m=64), GemmConfig(128, 128, 8, 2))
# gemm2 in 16-row tiles of the 32-row blocks (tile_m): two programs per block.
SORTED_ROWS = MoeConfig("sorted", 32, GemmConfig(128, 128, 4, 2), GemmConfig(128, 128, 4, 2, tile_m=16))
# The direct tensor-core GEMVs (``_gemv_dot``): gemm1 tiles of 128 output columns (its epilogue quantizes them for
# gemm2), 64-row gemm2 tiles, whole reductions; and both reductions split in two (partials summed by the program
# that counts last).
DIRECT = MoeConfig("direct", 0, GemmConfig(128, 128, 4, 2, group_m=0), GemmConfig(64, 128, 4, 2, group_m=0))
DIRECT_SPLIT = MoeConfig("direct", 0, GemmConfig(128, 128, 4, 2, group_m=0, split_k=2),
                         GemmConfig(128, 128, 4, 2, group_m=0, split_k=2))
CONFIGS = {"sorted": SORTED, "sorted_tail": SORTED_TAIL, "sorted_split": SORTED_SPLIT, "sorted_128": SORTED_128,
           "sorted_rows": SORTED_ROWS, "direct": DIRECT, "direct_split": DIRECT_SPLIT}


def checked_config(name, dtype, N, K, topk) -> MoeConfig:
    cfg = CONFIGS[name]
    assert configs.sanitize(cfg, dtype, N, K, topk, quant="fp8_block") == cfg, "a config the product would run"
    return cfg


# (config, activation, dtype, M, topk, E, K, N, options): the five activations on each schedule, fp32 and fp16,
# bias, expert_map, on-input router weights (quantized per slot: g x), transposed storage, K / N whole and
# partial 128-column blocks.
FUSED_CASES = [
    ("sorted", "silu", torch.float32, 9, 3, 5, 200, 160, dict(bias=True)),
    ("sorted", "swigluoai", torch.float16, 12, 2, 6, 256, 96, dict(bias=True, on_input=True, emap=True)),
    ("sorted", "gelu", torch.float32, 6, 4, 4, 128, 300, dict(emap=True, transposed=True)),
    ("sorted_tail", "gelu_tanh", torch.float16, 40, 3, 6, 136, 128, dict(bias=True)),
    ("sorted_tail", "swiglustep", torch.float32, 48, 3, 5, 96, 140, dict(on_input=True, emap=True)),
    ("sorted_split", "silu", torch.float16, 16, 2, 4, 130, 256, dict(bias=True, emap=True)),
    ("sorted_split", "swigluoai", torch.float32, 10, 4, 5, 200, 333, dict(bias=True, transposed=True,
                                                                          on_input=True)),
    ("sorted_128", "silu", torch.float16, 150, 2, 3, 200, 256, dict(bias=True)),
    ("sorted_128", "swigluoai", torch.float32, 130, 2, 3, 256, 128, dict(on_input=True, emap=True)),
    ("sorted_rows", "silu", torch.float16, 40, 3, 4, 200, 256, dict(bias=True, emap=True)),
    ("direct", "silu", torch.float16, 1, 3, 8, 200, 160, dict(bias=True, emap=True)),
    ("direct", "swigluoai", torch.float32, 3, 4, 9, 256, 96, dict(bias=True, transposed=True, on_input=True)),
    ("direct", "gelu", torch.float16, 4, 2, 6, 300, 130, dict(bias=True)),
    ("direct_split", "gelu_tanh", torch.float32, 1, 6, 8, 300, 200, dict(emap=True, transposed=True)),
    ("direct_split", "swiglustep", torch.float16, 4, 1, 8, 140, 256, dict(bias=True, on_input=True)),
]


def _fused_id(case):
    cfg, act, dtype, M, topk, E, K, N, opts = case
    return f"{cfg}-{act}-{str(dtype)[6:]}-M{M}-k{topk}-E{E}-{K}x{N}-" + "".join(sorted(o[0] for o in opts if opts[o]))


@interpreted
@pytest.mark.parametrize("case", FUSED_CASES, ids=_fused_id)
def test_fused_experts_matches_torch(poisoned, case):  # noqa: F811  (the fixture)
    """fused_experts_triton(quant="fp8_block") against fused_experts_torch on the same quantized weights; every
    workspace and the output start NaN-poisoned, router weights of invalid slots are NaN, the last token has no
    valid slot (exactly 0)."""
    name, act, dtype, M, topk, E, K, N, opts = case
    cfg = checked_config(name, dtype, N, K, topk)
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=opts.get("bias", False),
                                         transposed=opts.get("transposed", False), seed=M * 31 + K + N)
    g, ids, emap = routing(M, topk, E, emap=opts.get("emap", False), seed=M + E)
    if name == "sorted_tail":
        counts = torch.bincount(local_ids(ids, emap, E).flatten() + 1, minlength=E + 1)[1:]
        assert ((counts > 0) & (counts <= 16)).any() and (counts > 16).any(), "tail tiles and full tiles"
    x = torch.randn(M, K, dtype=dtype)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, apply_router_weight_on_input=opts.get("on_input", False),
              alpha=1.702, limit=7.0)
    out = fused_experts_triton(x, w1, w2, g, ids, act, quant="fp8_block", w1_scale=s1, w2_scale=s2, config=cfg,
                               **kw)
    assert out.shape == (M, K) and out.dtype == dtype
    assert out.isfinite().all(), "every output element written, no NaN from poison or invalid slots"
    valid = valid_slots(ids, emap, E)
    assert valid.sum() >= min(M * topk // 3, 3) and (M == 1 or not valid[-1].any())
    assert (out[~valid.any(dim=1)] == 0).all(), "a token without valid slots gives exactly 0"
    ref = fused_experts_torch(x, w1, w2, g, ids, act, quant="fp8_block", w1_scale=s1, w2_scale=s2, **kw)
    assert rel_err(out, ref) <= TOLS[dtype]


UE8M0_CASES = [FUSED_CASES[i] for i in (0, 4, 6, 8)]


@interpreted
@pytest.mark.parametrize("case", UE8M0_CASES, ids=_fused_id)
def test_fused_experts_ue8m0_matches_torch(case):
    """UE8M0 byte scales (uint8 w1_scale / w2_scale): the kernels read the bytes as 2^(b - 127) and quantize the
    activations with power-of-two scales, as the PyTorch implementation does; that rule is visible (the same
    weights with the bytes' values as fp32 scales, so plain activation scales, give another output)."""
    name, act, dtype, M, topk, E, K, N, opts = case
    cfg = checked_config(name, dtype, N, K, topk)
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=opts.get("bias", False),
                                         transposed=opts.get("transposed", False), seed=M * 31 + K + N, ue8m0=True)
    assert s1.dtype == s2.dtype == torch.uint8
    g, ids, emap = routing(M, topk, E, emap=opts.get("emap", False), seed=M + E)
    x = torch.randn(M, K, dtype=dtype)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, apply_router_weight_on_input=opts.get("on_input", False))
    out = fused_experts_triton(x, w1, w2, g, ids, act, quant="fp8_block", w1_scale=s1, w2_scale=s2, config=cfg,
                               **kw)
    ref = fused_experts_torch(x, w1, w2, g, ids, act, quant="fp8_block", w1_scale=s1, w2_scale=s2, **kw)
    assert out.isfinite().all() and rel_err(out, ref) <= TOLS[dtype]
    plain = fused_experts_torch(x, w1, w2, g, ids, act, quant="fp8_block", w1_scale=e8m0_to_float(s1),
                                w2_scale=e8m0_to_float(s2), **kw)
    assert rel_err(plain, ref) > 10 * TOLS[dtype], "power-of-two activation scales change the output"


@interpreted
@pytest.mark.parametrize("name", ["sorted_split", "direct_split"])
def test_fused_experts_deterministic(name):
    E, K, N, M, topk = 6, 300, 260, 12 if name == "sorted_split" else 2, 3
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=True, seed=5)
    g, ids, _ = routing(M, topk, E, seed=3)
    x = torch.randn(M, K)
    cfg = checked_config(name, x.dtype, N, K, topk)
    runs = [fused_experts_triton(x, w1, w2, g, ids, "silu", quant="fp8_block", w1_scale=s1, w2_scale=s2, w1_bias=b1,
                                 w2_bias=b2, config=cfg) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@interpreted
@pytest.mark.parametrize("name,on_input,dtype,transposed,ue8m0", [
    ("sorted", False, torch.float32, False, False),
    ("sorted_tail", True, torch.float16, True, False),
    ("direct", False, torch.float16, True, False),
    ("direct", True, torch.float32, False, False),
    ("sorted", True, torch.float32, False, True),
    ("direct_split", False, torch.float32, True, True),
])
def test_expert_gemms_match_torch(name, on_input, dtype, transposed, ue8m0):
    """The unfused GEMMs (gemm1 without activation: 2N output columns; gemm2 reads [M, topk, N] in slot order
    and quantizes it as it loads it) against the PyTorch GEMMs on the same quantized weights (``ue8m0``: byte
    scales, power-of-two activation scales)."""
    E, K, N, topk = 5, 200, 160, 3
    M = 1 if name.startswith("direct") else 20
    cfg = checked_config(name, dtype, N, K, topk)
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=True, transposed=transposed, seed=7, ue8m0=ue8m0)
    g, ids, emap = routing(M, topk, E, emap=True, seed=11)
    g = torch.nan_to_num(g)
    x = torch.randn(M, K, dtype=dtype)
    kw = dict(expert_map=emap, topk_weights=g if on_input else None)
    h = expert_gemm1_triton(x, w1, ids, w1_bias=b1, quant="fp8_block", w1_scale=s1, config=cfg, **kw)
    h_ref = expert_gemm1_torch(x, w1, ids, w1_bias=b1, quant="fp8_block", w1_scale=s1, **kw)
    assert h.shape == (M, topk, 2 * N) and rel_err(h, h_ref) <= TOLS[dtype]
    a = torch.randn(M, topk, N, dtype=dtype)
    kw = dict(expert_map=emap, topk_weights=None if on_input else g)
    y = expert_gemm2_triton(a, w2, ids, w2_bias=b2, quant="fp8_block", w2_scale=s2, config=cfg, **kw)
    y_ref = expert_gemm2_torch(a, w2, ids, w2_bias=b2, quant="fp8_block", w2_scale=s2, **kw)
    assert y.shape == (M, topk, K) and rel_err(y, y_ref) <= TOLS[dtype]
    invalid = ~valid_slots(ids, emap, E)
    assert (h[invalid] == 0).all() and (y[invalid] == 0).all()


@interpreted
@pytest.mark.parametrize("name", ["direct", "direct_split"])
def test_direct_slot_sum_over_the_valid_slots(poisoned, name):  # noqa: F811  (the fixture)
    """The direct second GEMV sums only a token's valid slots (the programs of the others exit): tokens with no valid
    slot (exactly 0), with one (the first, last or a middle slot: the program that writes it alone, or with a split
    the one that counts last), with several and with all, against the PyTorch implementation; NaN-poisoned workspaces
    and output, NaN router weights on the invalid slots."""
    E, K, N, topk = 6, 200, 256, 4
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=True, seed=13)
    ids = torch.tensor([[-1, -1, -1, -1], [2, -1, -1, -1], [-1, -1, -1, 5], [-1, 3, 9, -1], [1, -1, 4, 0],
                        [0, 1, 2, 3], [-1, 8, 7, -1]], dtype=torch.int32)
    emap = torch.tensor([0, 1, 2, 3, 4, 5, -1, 1, -1, 3], dtype=torch.int32)  # ids 6 and 8 elsewhere, 9 -> 3
    M = ids.shape[0]
    valid = valid_slots(ids, emap, E)
    assert valid.sum(dim=1).tolist() == [0, 1, 1, 2, 3, 4, 1]
    g = torch.rand(M, topk).masked_fill(~valid, float("nan"))
    x = torch.randn(M, K)
    cfg = checked_config(name, x.dtype, N, K, topk)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, quant="fp8_block", w1_scale=s1, w2_scale=s2)
    out = fused_experts_triton(x, w1, w2, g, ids, "silu", config=cfg, **kw)
    assert out.isfinite().all() and (out[0] == 0).all()
    assert rel_err(out, fused_experts_torch(x, w1, w2, g, ids, "silu", **kw)) <= TOLS[x.dtype]


def test_gemv_work_lists_only_for_fp8_block_shards():
    """The direct tensor-core GEMVs take work lists for fp8 block weights on an expert-parallel shard expecting few
    local pairs only, and only where a program per item would not fit on the GPU at once (4 SMs off the GPU, 4
    programs each here)."""
    fp8 = WeightOperand(torch.empty(1, 128, 256), torch.empty(1, 1, 2), "fp8_block")
    mma = WeightOperand(torch.empty(1, 128, 128, dtype=torch.uint8), torch.empty(1, 128, 8, dtype=torch.uint8),
                        "mxfp4_mma")
    dense = WeightOperand.of(torch.empty(1, 128, 256, dtype=torch.bfloat16))
    few = fe.GEMV_WORK_LIST_PAIRS
    assert fe._gemv_work_list(fp8, 1) and fe._gemv_work_list(fp8, few) and not fe._gemv_work_list(fp8, few + 1)
    assert not fe._gemv_work_list(fp8, None), "not a shard"
    assert not fe._gemv_work_list(mma, 1) and not fe._gemv_work_list(dense, 1)
    emap = torch.full((256,), -1, dtype=torch.int32)
    assert fe.local_pairs(1, 8, 32, emap) == 1 and fe.local_pairs(4, 8, 32, emap) == 4  # DeepSeek-V3, 32 of 256
    cpu, cfg = torch.device("cpu"), DIRECT_SPLIT.gemm2
    assert fe._gemv_grid(2, 4, 2, cfg, 128, fp8, cpu, True) == ((2, 4, 2), False), "16 items fit: one each"
    assert fe._gemv_grid(2, 5, 2, cfg, 128, fp8, cpu, True) == ((16,), True)
    assert fe._gemv_grid(2, 5, 2, cfg, 128, fp8, cpu, False) == ((2, 5, 2), False)


@interpreted
@pytest.mark.parametrize("zeros_in", ["gemv1", "gemv2"])
def test_direct_gemvs_take_the_pairs_with_work_past_a_scan_chunk(poisoned, monkeypatch, zeros_in):  # noqa: F811
    """The direct GEMVs' work lists on an fp8 block shard: 12 and 16 programs (4 SMs in the interpreter), fewer than
    the items, take the (tile, pair, split) items of the pairs with work in turn, found by scanning the pairs 64 at a
    time: 84 pairs, the valid ones and the tokens without any valid slot on both sides of pair 64 (the fused op:
    their zeros, stored by gemv1's 12 programs, 21 tokens, or with ``_gemv1`` told nothing of them by gemv2's items
    of their slot 0; the unfused GEMMs: every valid pair's row), against the PyTorch implementation."""
    launch_gemv1, zeroed = fe._gemv1, []

    def gemv1(*args, zero_rows=None, **kwargs):
        zeroed.append(launch_gemv1(*args, zero_rows=zero_rows if zeros_in == "gemv1" else None, **kwargs))
        return zeroed[-1]

    monkeypatch.setattr(fe, "_gemv1", gemv1)
    E, K, N, topk, M = 2, 256, 128, 4, 21
    emap = torch.full((100,), -1, dtype=torch.int32)
    emap[10], emap[20] = 0, 1  # 2 of 100 experts here: 2 local pairs of the 84 expected
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=True, seed=5)
    assert fe._gemv_work_list(WeightOperand(w1, s1, "fp8_block"), fe.local_pairs(M, topk, E, emap))
    assert fe._gemv_grid(1, M * topk, 2, DIRECT_SPLIT.gemm1, 256, WeightOperand(w1, s1, "fp8_block"),
                         torch.device("cpu"), True) == ((12,), True), "3 programs of 256 weight rows per SM"
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (M, topk), generator=gen)
    ids[(ids == 10) | (ids == 20)] = 11
    for t, j, e in [(0, 1, 10), (5, 0, 20), (9, 3, 10), (16, 2, 20), (17, 0, 10), (17, 3, 20), (20, 1, 10)]:
        ids[t, j] = e  # valid slots on both sides of pair 64 (token 16's slots are pairs 64..67)
    ids = ids.to(torch.int32)
    valid = valid_slots(ids, emap, E)
    assert valid.flatten()[64:].any() and valid.flatten()[:64].any() and valid.sum() == 7
    g = torch.rand(M, topk, generator=gen).masked_fill(~valid, float("nan"))
    x = torch.randn(M, K, generator=gen)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, quant="fp8_block", w1_scale=s1, w2_scale=s2)
    out = fused_experts_triton(x, w1, w2, g, ids, "silu", config=DIRECT_SPLIT, **kw)
    assert zeroed == [zeros_in == "gemv1"]
    assert out.isfinite().all() and (out[~valid.any(dim=1)] == 0).all() and (~valid.any(dim=1)).sum() > 12
    assert rel_err(out, fused_experts_torch(x, w1, w2, g, ids, "silu", **kw)) <= TOLS[x.dtype]
    a = torch.randn(M, topk, N, generator=gen)
    y = expert_gemm2_triton(a, w2, ids, w2_bias=b2, quant="fp8_block", w2_scale=s2, config=DIRECT_SPLIT,
                            expert_map=emap)
    y_ref = expert_gemm2_torch(a, w2, ids, w2_bias=b2, quant="fp8_block", w2_scale=s2, expert_map=emap)
    assert rel_err(y[valid], y_ref[valid]) <= TOLS[x.dtype] and (y[~valid] == 0).all()


@triton.jit
def _zero_rows_kernel(z_ptr, n_tokens, width, stride_zm, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global,
                      E, has_map):
    from moe_extension.kernels._gemv_dot import _zero_rows
    _zero_rows(z_ptr, n_tokens, width, stride_zm, P, topk, ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, has_map)


@interpreted
def test_gemv1_zero_rows_read_a_token_s_slots_past_a_scan_chunk():
    """``_gemv_dot._zero_rows`` (gemv1's work lists store the fused op's zero rows): 3 programs over 7 tokens of 70
    slots (read 64 at a time), rows of 1100 columns (two stores of 1024) in a wider NaN-filled buffer: exactly the
    tokens without a valid slot are zeroed, whole rows, a valid slot past the first 64 included; other rows and the
    columns past the width untouched."""
    from moe_extension.kernels._gemv_dot import CHUNK
    M, topk, E, width = 7, 70, 3, 1100
    assert topk > CHUNK
    emap = torch.full((100,), -1, dtype=torch.int32)
    emap[40], emap[50], emap[60] = 0, 1, 2
    ids = torch.stack([torch.randperm(100, generator=torch.Generator().manual_seed(t))[:topk] for t in range(M)])
    ids[(ids == 40) | (ids == 50) | (ids == 60)] = 41
    ids[1, 66], ids[3, 0], ids[4, 69], ids[4, 3] = 50, 40, 60, -1
    ids[6, 2] = 200  # out of range: invalid
    ids = ids.to(torch.int32)
    valid = valid_slots(ids, emap, E)
    empty = ~valid.any(dim=1)
    assert empty.tolist() == [True, False, True, False, False, True, True]
    z = torch.full((M, width + 20), float("nan"))
    _zero_rows_kernel[(3,)](z, M, width, z.stride(0), M * topk, topk, ids, ids.stride(0), ids.stride(1), emap,
                            emap.numel(), E, 1)
    assert (z[empty, :width] == 0).all() and z[~empty].isnan().all() and z[:, width:].isnan().all()


@interpreted
@pytest.mark.parametrize("name", ["sorted_split", "direct_split"])
@pytest.mark.parametrize("K,N", [(200, 0), (0, 160)])
def test_empty_hidden_or_intermediate(name, K, N):
    """An empty intermediate (N = 0: each valid slot's w2 bias, weighted) or hidden dim (empty output) on both
    schedules, split reductions included."""
    w1, s1, w2, s2, b1, b2 = fp8_experts(4, K, N, bias=True, seed=K + N)
    M = 1 if name == "direct_split" else 20
    g, ids, _ = routing(M, 3, 4, seed=M)
    x = torch.randn(M, K)
    kw = dict(w1_bias=b1, w2_bias=b2, quant="fp8_block", w1_scale=s1, w2_scale=s2)
    out = fused_experts_triton(x, w1, w2, g, ids, "silu", config=CONFIGS[name], **kw)
    ref = fused_experts_torch(x, w1, w2, g, ids, "silu", **kw)
    assert out.shape == (M, K) and out.isfinite().all() and rel_err(out, ref) <= TOLS[torch.float32]


@interpreted
@pytest.mark.parametrize("quant,on_input,want", [("fp8_block", False, True), ("fp8_block", True, False),
                                                 ("mxfp4_mma", False, False)])
def test_direct_schedule_pdl_rule(monkeypatch, quant, on_input, want):
    """Where the device has PDL, the direct schedule launches both GEMVs with it only for fp8 block after the
    quantization kernel (which then triggers its successor at once); on the input (a zero fill instead) and the
    MXFP4 MMA layout keep stream order (the NOTE in kernels/fused_experts.py). The interpreter runs no PDL: the
    launchers are wrapped to record the choice and launch without it."""
    from moe_extension.quant import quantize_mxfp4
    from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma

    seen = {}
    gemv1, gemv2, quantize = fe._gemv1, fe._gemv2, fe.quantize_fp8_rows

    def record(name, launch):
        def wrapped(*args, pdl=False, **kwargs):
            seen[name] = pdl
            return launch(*args, pdl=False, **kwargs)
        return wrapped

    def quantize_recorded(*args, trigger=False, **kwargs):
        seen["trigger"] = trigger
        return quantize(*args, **kwargs)

    monkeypatch.setattr(fe, "pdl_capable", lambda device: True)
    monkeypatch.setattr(fe, "_gemv1", record("gemv1", gemv1))
    monkeypatch.setattr(fe, "_gemv2", record("gemv2", gemv2))
    monkeypatch.setattr(fe, "quantize_fp8_rows", quantize_recorded)
    E, K, N = 4, 256, 128
    g, ids, _ = routing(1, 2, E, seed=3)
    x = torch.randn(1, K)
    if quant == "fp8_block":
        w1, s1, w2, s2, _, _ = fp8_experts(E, K, N, seed=3)
    else:
        gen = torch.Generator().manual_seed(3)
        (w1, s1), (w2, s2) = (prepare_mxfp4_mma(*quantize_mxfp4(torch.randn(E, r, c, generator=gen) / c ** 0.5))
                              for r, c in ((2 * N, K), (K, N)))
        x = x.half()
    kw = dict(quant=quant, w1_scale=s1, w2_scale=s2, apply_router_weight_on_input=on_input)
    out = fused_experts_triton(x, w1, w2, g, ids, "silu", **kw)  # M = 1: the direct schedule
    assert seen["gemv1"] is want and seen["gemv2"] is want and seen.get("trigger", False) is want
    assert rel_err(out, fused_experts_torch(x, w1, w2, g, ids, "silu", **kw)) <= TOLS[x.dtype]


# ------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 256, 1024, 4096, 8192])
@pytest.mark.parametrize("E,topk,K,N", [(256, 8, 7168, 2048), (64, 6, 2048, 1408), (8, 2, 1000, 333),
                                        (256, 8, 7168, 256)])
def test_fp8_heuristic_configs(M, E, topk, K, N, dtype):
    """The configs the product picks for fp8 block on any shape: whole 128-column scale blocks per step, gemm1
    output tiles of whole 128-column groups (its epilogue quantizes them), blocks of at most fp8_max_block_m rows,
    no persistent gemm2, and the pipelined tiles within the shared-memory budget."""
    cfg = configs.get_config(M, E, N, K, topk, dtype, True, True, torch.device("cpu"), "fp8_block")
    a_esize = torch.empty((), dtype=dtype).element_size()
    assert cfg.block_m <= configs.fp8_max_block_m(N)
    for g, mult in ((cfg.gemm1, 2), (cfg.gemm2, 1)):
        assert not g.persistent
        if cfg.path == "sorted":
            assert g.block_k == 128 and g.block_n % 128 == 0
            rows = g.tile_m or cfg.block_m  # gemm2's row tiles (tile_m) or the block
            assert g.num_stages * (rows * a_esize + mult * g.block_n) * g.block_k <= configs.SMEM_BUDGET
        else:  # the tensor-core GEMVs: 64 to 256 weight rows (a warpgroup's MMA takes 64)
            assert g.block_k == 128 and 64 <= mult * g.block_n <= 256
    assert cfg.path == ("direct" if configs.use_direct(M, E, topk, "fp8_block") else "sorted")
    assert configs.sanitize(cfg, dtype, N, K, topk, quant="fp8_block") == cfg


def test_direct_gemv_splits_follow_the_local_pairs(monkeypatch):
    """The direct tensor-core GEMVs split each reduction while twice its programs fit on the GPU at once: the
    table's tuned DeepSeek-V3 entry at M = 1 for the whole layer (8 local pairs: gemv1 split 2, gemv2 unsplit), and
    for an expert-parallel shard (32 of 256 experts: 1 local pair expected) splits that give that pair's 16 gemv1
    tiles and 112 gemv2 tiles as many programs. ``local_pairs`` comes from the expert_map; a tuned direct entry,
    sized for all pairs, is not used for a shard."""
    dev = torch.device("cpu")
    layer = configs.get_config(1, 256, 2048, 7168, 8, torch.bfloat16, True, True, dev, "fp8_block")
    shard = configs.get_config(1, 32, 2048, 7168, 8, torch.bfloat16, True, True, dev, "fp8_block", local_pairs=1)
    assert layer.path == shard.path == "direct"
    assert (layer.gemm1.split_k, layer.gemm2.split_k) == (2, 1)
    assert (shard.gemm1.split_k, shard.gemm2.split_k) == (16, 4)
    assert fe.local_pairs(1, 8, 32, None) is None and fe.local_pairs(1, 8, 256, torch.zeros(256)) is None
    assert fe.local_pairs(1, 8, 32, torch.zeros(256)) == 1 and fe.local_pairs(4, 8, 32, torch.zeros(256)) == 4
    assert fe.local_pairs(1, 2, 4, torch.zeros(256)) == 1, "at least one pair"
    h100 = configs._load_table("NVIDIA H100 80GB HBM3")
    tuned = h100["E=256,N=2048,K=7168,topk=8,dtype=bfloat16,w1=row,w2=row,quant=fp8_block"][1]
    assert tuned.path == "direct" and (tuned.gemm1.split_k, tuned.gemm2.split_k) == (2, 1)
    monkeypatch.setattr(configs, "_device_facts", lambda device: ("NVIDIA H100 80GB HBM3", 132))
    get = configs.get_config.__wrapped__  # not the memoized one: its entries for "cpu" came from the heuristic
    key = (1, 256, 2048, 7168, 8, torch.bfloat16, True, True, dev, "fp8_block")
    assert get(*key) == tuned
    assert get(*key, local_pairs=1) == configs.sanitize(
        configs.dot_gemv_direct(1, 2048, 7168, 132, "fp8_block"), torch.bfloat16, 2048, 7168, 8, "fp8_block")


@pytest.mark.parametrize("pairs,N,stages", [(8, 2048, 3), (8, 512, 3), (16, 2048, 4), (1, 2048, 4), (6, 2048, 3),
                                             (5, 2048, 4)])
def test_fp8_gemv2_stages_for_one_wave(pairs, N, stages):
    """fp8 block's second direct GEMV (K 7168: 112 tiles of 64 rows per pair) takes 3 stages only where that puts all
    its programs on 132 SMs at once (7 per SM at 30 KB; 5 at 40 KB in 4 stages): 6 to 8 pairs; fewer fit in 4 stages,
    more need several waves either way. Sanitizing keeps it."""
    cfg = configs.dot_gemv_direct(pairs, N, 7168, 132, "fp8_block")
    assert cfg.gemm2.num_stages == stages and cfg.gemm2.split_k == (4 if pairs == 1 else 1)
    assert cfg.gemm1.num_stages == 3
    clean = configs.sanitize(cfg, torch.bfloat16, N, 7168, 8, "fp8_block")
    assert clean.gemm2.num_stages == stages
    assert configs.heuristic_config(1, 256, N, 7168, 8, torch.bfloat16, True, True, quant="fp8_block").gemm2 == (
        configs.dot_gemv_direct(8, N, 7168, 132, "fp8_block").gemm2)


def test_heuristic_forced_schedule():
    """``path`` forces either schedule in the heuristic (``ab_fused_experts.py --other-schedule``); None follows
    ``use_direct``."""
    for M, path in ((16, "direct"), (1, "sorted"), (1, None), (16, None)):
        cfg = configs.heuristic_config(M, 128, 768, 2048, 8, torch.bfloat16, True, True, quant="fp8_block", path=path)
        assert cfg.path == (path or ("direct" if configs.use_direct(M, 128, 8, "fp8_block") else "sorted"))


@pytest.mark.parametrize("N,rows", [(512, 64), (768, 64), (1024, 64), (2048, 0), (1000, 0)])
def test_fp8_heuristic_gemm2_row_tiles(N, rows):
    """Blocks of 128 rows with a short second reduction (N <= 1024): gemm2 in 64-row tiles on 4 warps; longer
    reductions (and N not a multiple of 128, whose blocks hold 64 rows) keep whole-block tiles."""
    cfg = configs.heuristic_config(8192, 256, N, 7168, 8, torch.bfloat16, True, True, quant="fp8_block")
    cfg = configs.sanitize(cfg, torch.bfloat16, N, 7168, 8, quant="fp8_block")
    assert cfg.gemm2.tile_m == rows and cfg.block_m == (128 if N % 128 == 0 else 64)
    whole_block_warps = 8 if cfg.block_m == 128 else 4
    assert cfg.gemm2.num_warps == (4 if rows else whole_block_warps)


def test_fp8_heuristic_block_rows():
    """Rows per block of the sorted schedule by the rows per expert expected: blocks of 64 from 28 rows on (one
    block for most experts where two of 32 would stream their weights twice), 32 at 17-28, 16 up to 16, 128 beyond
    160 where N is a multiple of 128 (else at most 64); gemm1 at blocks of 64 in 4 stages where they fit the
    shared-memory budget (bf16 activations; fp32 ones 3) and without tail tiles (blocks of 128: 32-row ones)."""
    def block_m(M, E=256, N=2048, topk=8):
        return configs.heuristic_config(M, E, N, 7168, topk, torch.bfloat16, True, True, quant="fp8_block").block_m

    def gemm1_stages(M, dtype):
        cfg = configs.heuristic_config(M, 256, 2048, 7168, 8, dtype, True, True, quant="fp8_block")
        return configs.sanitize(cfg, dtype, 2048, 7168, 8, quant="fp8_block").gemm1.num_stages

    assert block_m(1024) == 64 and block_m(1280) == 64  # 32 and 40 rows per expert
    assert block_m(1024, N=512) == 64 and block_m(1024, N=1000) == 64
    assert block_m(960) == 64 and block_m(880) == 32  # 30 and 27.5 rows
    assert block_m(768) == 32 and block_m(600) == 32  # 24 and 18.75 rows
    assert block_m(480) == 16  # 15 rows
    assert block_m(8192) == 128 and block_m(8192, N=1000) == 64  # 256 rows
    assert block_m(2048, E=512, N=256, topk=10) == 64  # 40 rows
    assert gemm1_stages(1024, torch.bfloat16) == 4 and gemm1_stages(1024, torch.float32) == 3
    assert gemm1_stages(768, torch.bfloat16) == 3 and gemm1_stages(8192, torch.bfloat16) == 3  # blocks of 32, 128
    tails = [configs.heuristic_config(M, 256, 2048, 7168, 8, torch.bfloat16, True, True, quant="fp8_block").gemm1.tail_m
             for M in (768, 1024, 4096, 8192)]
    assert tails == [0, 0, 0, 32]


def test_sanitize_fp8_fixes_tiles():
    """Tiles from an older table or a hand-written config come out in the format's rules."""
    bad = MoeConfig("sorted", 128, GemmConfig(64, 64, 4, 4, tma_weights=True, tma_a=True),
                    GemmConfig(32, 256, 8, 4, persistent=True, split_k=4))
    cfg = configs.sanitize(bad, torch.bfloat16, 333, 1000, 8, quant="fp8_block")
    assert (cfg.gemm1.block_k, cfg.gemm2.block_k) == (128, 128)
    assert cfg.gemm1.block_n == 128 and cfg.gemm2.block_n == 128
    assert cfg.block_m == 64 and not cfg.gemm2.persistent  # N not a multiple of 128: see fp8_max_block_m
    assert configs.sanitize(bad, torch.bfloat16, 2048, 1000, 8, quant="fp8_block").block_m == 128
    assert cfg.gemm2.split_k <= math.ceil(333 / 128)
    direct = configs.sanitize(dataclasses.replace(bad, path="direct", block_m=0), torch.bfloat16, 333, 1000, 8,
                              quant="fp8_block")
    assert (direct.gemm1.block_k, direct.gemm2.block_k) == (128, 128)
    assert (direct.gemm1.block_n, direct.gemm2.block_n) == (128, 64)  # 256 and 64 weight rows
    assert direct.gemm2.num_warps == 4 and not direct.gemm2.persistent


@interpreted
@pytest.mark.parametrize("name,act,K,N,ue8m0", [("sorted", "silu", 256, 256, False),
                                                ("sorted_tail", "swigluoai", 384, 128, False),
                                                ("sorted_split", "gelu", 256, 384, False),
                                                ("sorted", "swigluoai", 256, 128, True),
                                                ("sorted_rows", "silu", 256, 256, False)])
def test_tma_paths_equal_pointer_loads(monkeypatch, name, act, K, N, ue8m0):
    """tma_weights=True loads the e4m3 weight tiles through TMA descriptors (``dot_tile``), tma_a=True gathers gemm1's
    token rows into sorted order quantized (``gather_rows_kernel`` with Q: per-sorted-row scales) and loads gemm2's
    quantized intermediate by TMA (sm_90+; in the interpreter, forced on): the outputs equal the pointer loads'
    bitwise (the same quantized values, the same products in the same order), and the paths are really taken."""
    monkeypatch.setattr(fe, "tma_capable", lambda device: True)
    E, topk, M = 5, 3, 24
    base = CONFIGS[name]
    tma = dataclasses.replace(base, gemm1=dataclasses.replace(base.gemm1, tma_weights=True, tma_a=True),
                              gemm2=dataclasses.replace(base.gemm2, tma_weights=True, tma_a=True))
    assert configs.sanitize(tma, torch.float16, N, K, topk, quant="fp8_block") == tma
    w1, s1, w2, s2, b1, b2 = fp8_experts(E, K, N, bias=True, seed=K + N, ue8m0=ue8m0)
    g, ids, emap = routing(M, topk, E, emap=True, seed=9)
    x = torch.randn(M, K, dtype=torch.float16)
    assert fe._weight_desc(w1, 128, tma.gemm1) is not None and fe._weight_desc(w1, 128, base.gemm1) is None
    assert fe.gathers_rows(x, tma.gemm1, quantize=True) and not fe.gathers_rows(x, base.gemm1, quantize=True)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, quant="fp8_block", w1_scale=s1, w2_scale=s2)
    ref = fused_experts_triton(x, w1, w2, g, ids, act, config=base, **kw)
    out = fused_experts_triton(x, w1, w2, g, ids, act, config=tma, **kw)
    assert out.isfinite().all() and torch.equal(out, ref)
    assert rel_err(out, fused_experts_torch(x, w1, w2, g, ids, act, **kw)) <= TOLS[torch.float16]
