"""MXFP4 in the MMA layout (``quant="mxfp4_mma"``, ``moe_extension.quant.mxfp4_mma``): the layout helpers on the
CPU (round trip, exact dequantization, the NaN group rule, clear errors), the ops' PyTorch path (the same numbers
as ``quant="mxfp4"``), and the Triton kernels in the interpreter (portable decode, ``PTX=False``, fp32 / fp16
activations as in tests/test_kernels_mxfp4.py) against the PyTorch implementation on the checkpoint layout:
every activation, biases, expert_map, on-input router weights, invalid ids, tail tiles, split gemm2, a masked
last chunk of 64 columns, the unfused GEMMs, a NaN scale confined to its outputs, poisoned workspaces. The GPU's
inline PTX decode of a word (``_weight_formats._MMA_WORD_ASM``) has its bit operations run here against the layout.

The GPU (inline PTX decode, wgmma with the decoded tile as the register operand) is covered by
tests/test_fused_experts_mxfp4_cuda.py, which runs its matrix for both layouts.
"""

import math

import pytest
import torch

import moe_extension  # noqa: F401  (registers the ops)
import moe_extension.kernels._configs as configs
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig
from moe_extension.ops import fused_experts_torch
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant import dequantize_mxfp4, quantize_mxfp4
from moe_extension.quant.mxfp4_mma import (MMA_MAX_SCALE, MMA_NAN_SCALE, dequantize_mxfp4_mma, prepare_mxfp4_mma,
                                           unprepare_mxfp4_mma)
from tests.test_kernels_mxfp4 import (FP16_TOL, FP32_TOL, ROUNDING_POINTS_TOL, _fused_id, interpreted,
                                      kernel_rounding_reference, local_ids, mxfp4_experts, poisoned, routing,
                                      valid_slots)
from tests.utils import rel_err

__all__ = ["poisoned"]  # the fixture, imported for the tests below


def mma_experts(E, K, N, *, bias=False, seed=0, nan_group=False):
    """(checkpoint stacks, MMA-layout stacks): w1, s1, w2, s2, b1, b2 each."""
    w1, s1, w2, s2, b1, b2 = mxfp4_experts(E, K, N, bias=bias, seed=seed)
    if nan_group:
        s1[0, 3, 1] = 255
    q1, t1 = prepare_mxfp4_mma(w1, s1)
    q2, t2 = prepare_mxfp4_mma(w2, s2)
    return (w1, s1, w2, s2, b1, b2), (q1, t1, q2, t2, b1, b2)


# ------------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("shape", [(16, 64), (3, 48, 192), (2, 2, 32, 128)])
def test_prepare_round_trip_and_dequantize_exactly(shape):
    *lead, rows, cols = shape
    gen = torch.Generator().manual_seed(rows + cols)
    q, s = quantize_mxfp4(torch.randn(*shape, generator=gen))
    s.view(-1)[torch.randperm(s.numel(), generator=gen)[:8]] = torch.tensor([0, 1, 126, 127, 128, 147, 148, 255],
                                                                            dtype=torch.uint8)
    qp, sp = prepare_mxfp4_mma(q, s)
    assert qp.shape == q.shape and sp.shape == s.shape and qp.is_contiguous() and sp.is_contiguous()
    assert not torch.equal(qp, q), "the bytes move"
    assert sorted(sp.unique().tolist())[-2:] == [148, MMA_NAN_SCALE], "finite scales stay, NaN groups store 149"
    q2, s2 = unprepare_mxfp4_mma(qp, sp)
    assert torch.equal(s2, s)
    nan_cols = (s == 255).repeat_interleave(16, dim=-1)
    assert torch.equal(q2[~nan_cols], q[~nan_cols]) and (q2[nan_cols] == 0).all(), "NaN groups store zero codes"
    ref, got = dequantize_mxfp4(q, s), dequantize_mxfp4_mma(qp, sp)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("shape", [(2, 0, 64), (2, 16, 0), (0, 16, 64)])
def test_prepare_empty_weights(shape):
    """Stacks with no rows, no columns or no experts prepare (and go back) to the same empty shapes."""
    q, s = quantize_mxfp4(torch.randn(*shape))
    qp, sp = prepare_mxfp4_mma(q, s)
    assert qp.shape == q.shape and sp.shape == s.shape
    q2, s2 = unprepare_mxfp4_mma(qp, sp)
    assert q2.shape == q.shape and s2.shape == s.shape and dequantize_mxfp4_mma(qp, sp).shape == shape


def test_prepare_accepts_strided_views():
    q, s = quantize_mxfp4(torch.randn(2, 32, 128))
    qt, st = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, s))
    a, b = prepare_mxfp4_mma(q, s), prepare_mxfp4_mma(qt, st)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("byte", [MMA_MAX_SCALE + 1, 200, 254])
def test_prepare_rejects_scales_above_the_layouts_range(byte):
    q, s = quantize_mxfp4(torch.randn(2, 16, 64))
    s[1, 5, 1] = byte
    with pytest.raises(ValueError, match=rf"at most 2\^21 \(E8M0 byte <= 148\) or NaN \(255\), got byte {byte}"):
        prepare_mxfp4_mma(q, s)


@pytest.mark.parametrize("rows,cols,match", [(24, 64, "rows % 16"), (16, 96, "cols % 64")])
def test_prepare_rejects_shapes_outside_the_layout(rows, cols, match):
    q, s = quantize_mxfp4(torch.randn(rows, cols))
    with pytest.raises(ValueError, match=match):
        prepare_mxfp4_mma(q, s)


def test_ops_reject_non_contiguous_or_partial_bands():
    (w1, s1, w2, s2, _, _), (q1, t1, q2, t2, _, _) = mma_experts(2, 64, 64)
    x, ids, g = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    view = q1.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w1 contiguous"):
        torch.ops.moe_ext.fused_experts(x, view, q2, g, ids, quant="mxfp4_mma", w1_scale=t1, w2_scale=t2)
    with pytest.raises(ValueError, match="mxfp4_mma' needs w1's rows % 16"):
        torch.ops.moe_ext.expert_gemm1(x, q1[:, :8].contiguous(), ids, quant="mxfp4_mma",
                                       w1_scale=t1[:, :8].contiguous())


def test_op_cpu_equals_checkpoint_layout():
    """The PyTorch implementation on the MMA layout gives what it gives on the checkpoint layout, bitwise."""
    (w1, s1, w2, s2, b1, b2), (q1, t1, q2, t2, _, _) = mma_experts(4, 128, 64, bias=True, seed=3)
    g, ids, emap = routing(7, 2, 4, emap=True, seed=5)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap)
    ref = torch.ops.moe_ext.fused_experts(x, w1, w2, g.nan_to_num(0.0), ids, "swigluoai", quant="mxfp4", w1_scale=s1,
                                          w2_scale=s2, **kw)
    out = torch.ops.moe_ext.fused_experts(x, q1, q2, g.nan_to_num(0.0), ids, "swigluoai", quant="mxfp4_mma",
                                          w1_scale=t1, w2_scale=t2, **kw)
    assert torch.equal(out, ref)


def test_opcheck_fused_experts_mma():
    (_, _, _, _, b1, b2), (q1, t1, q2, t2, _, _) = mma_experts(3, 64, 64, bias=True, seed=1)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 3, (5, 2), dtype=torch.int32)
    torch.library.opcheck(torch.ops.moe_ext.fused_experts.default, (x, q1, q2, torch.rand(5, 2), ids),
                          dict(quant="mxfp4_mma", w1_scale=t1, w2_scale=t2, w1_bias=b1, w2_bias=b2))


# ------------------------------------------------------------------------------------------------- kernels

# The tiles mxfp4_mma_tiles admits: 128 (gemm1: 2 x 64) and 256 weight rows per tile, 128-column steps (K = 192:
# a masked last chunk).
SORTED = MoeConfig("sorted", 16, GemmConfig(64, 128, 4, 2, group_m=0), GemmConfig(128, 128, 4, 2))
SORTED_TAIL = MoeConfig("sorted", 32, GemmConfig(128, 128, 8, 2, tail_m=16), GemmConfig(256, 128, 8, 2, tail_m=16))
SORTED_SPLIT = MoeConfig("sorted", 16, GemmConfig(64, 128, 4, 2, group_m=0), GemmConfig(128, 128, 4, 2, split_k=2))
# Blocks of 64 rows (the tuned tables' blocks at M 256-1024) with tail tiles of 32 rows in both GEMMs.
SORTED_WIDE = MoeConfig("sorted", 64, GemmConfig(64, 128, 4, 2, group_m=0, tail_m=32),
                        GemmConfig(128, 128, 4, 2, tail_m=32))
# The direct schedule (``_gemv_dot``): whole reductions, and both reductions split (partials + last-program sum).
DIRECT = MoeConfig("direct", 0, GemmConfig(64, 128, 4, 2, group_m=0), GemmConfig(128, 128, 4, 2, group_m=0))
DIRECT_SPLIT = MoeConfig("direct", 0, GemmConfig(64, 128, 4, 2, group_m=0, split_k=2),
                         GemmConfig(128, 128, 4, 2, group_m=0, split_k=2))
CONFIGS = {"sorted": SORTED, "sorted_tail": SORTED_TAIL, "sorted_split": SORTED_SPLIT, "sorted_wide": SORTED_WIDE,
           "direct": DIRECT, "direct_split": DIRECT_SPLIT}


def checked_config(name, dtype, N, K, topk) -> MoeConfig:
    cfg = CONFIGS[name]
    assert configs.sanitize(cfg, dtype, N, K, topk, quant="mxfp4_mma") == cfg, "a config the product would run"
    return cfg


FUSED_CASES = [
    ("sorted", "silu", torch.float32, 9, 3, 5, 192, 64, dict(bias=True)),
    ("sorted", "swigluoai", torch.float16, 12, 2, 6, 64, 128, dict(bias=True, on_input=True, emap=True)),
    ("sorted_tail", "gelu", torch.float32, 48, 3, 5, 128, 64, dict(emap=True)),
    ("sorted_tail", "gelu_tanh", torch.float16, 36, 3, 5, 64, 192, dict(bias=True)),
    ("sorted_split", "swiglustep", torch.float32, 10, 4, 5, 64, 256, dict(on_input=True, emap=True)),
    ("sorted_wide", "swigluoai", torch.float32, 160, 2, 3, 192, 64, dict(bias=True, on_input=True)),
    ("direct", "silu", torch.float16, 7, 2, 6, 128, 64, dict(bias=True, on_input=True, emap=True)),
    ("direct_split", "swigluoai", torch.float32, 6, 3, 5, 192, 256, dict(bias=True)),
    ("direct_split", "gelu", torch.float32, 9, 1, 5, 256, 192, dict(emap=True)),
]


@interpreted
@pytest.mark.parametrize("case", FUSED_CASES, ids=_fused_id)
def test_fused_experts_matches_torch(poisoned, case):
    """fused_experts_triton(quant="mxfp4_mma") against fused_experts_torch on the checkpoint layout of the same
    weights; workspaces poisoned, NaN router weights on invalid slots, a token without valid slots gives 0."""
    name, act, dtype, M, topk, E, K, N, opts = case
    cfg = checked_config(name, dtype, N, K, topk)
    (w1, s1, w2, s2, b1, b2), (q1, t1, q2, t2, _, _) = mma_experts(E, K, N, bias=opts.get("bias", False),
                                                                   seed=M * 31 + K + N)
    g, ids, emap = routing(M, topk, E, emap=opts.get("emap", False), seed=M + E)
    if name == "sorted_tail":
        counts = torch.bincount(local_ids(ids, emap, E).flatten() + 1, minlength=E + 1)[1:]
        assert ((counts > 0) & (counts <= 16)).any() and (counts > 16).any(), "tail tiles and full tiles"
    if name == "sorted_wide":
        counts = torch.bincount(local_ids(ids, emap, E).flatten() + 1, minlength=E + 1)[1:]
        assert (counts > 64).any() and ((counts % 64 > 0) & (counts % 64 <= 32)).any(), "64-row and 32-row tiles"
    x = torch.randn(M, K, dtype=dtype)
    kw = dict(w1_bias=b1, w2_bias=b2, expert_map=emap, apply_router_weight_on_input=opts.get("on_input", False),
              alpha=1.702, limit=7.0)
    out = fused_experts_triton(x, q1, q2, g, ids, act, quant="mxfp4_mma", w1_scale=t1, w2_scale=t2, config=cfg, **kw)
    assert out.shape == (M, K) and out.dtype == dtype and out.isfinite().all()
    valid = valid_slots(ids, emap, E)
    assert (out[~valid.any(dim=1)] == 0).all()
    ref = fused_experts_torch(x, w1, w2, g, ids, act, quant="mxfp4", w1_scale=s1, w2_scale=s2, **kw)
    tol = FP32_TOL if dtype == torch.float32 else FP16_TOL
    assert rel_err(out, kernel_rounding_reference(x, w1, w2, g, ids, act, s1, s2, kw)) <= tol
    assert rel_err(out, ref) <= (FP32_TOL if dtype == torch.float32 else ROUNDING_POINTS_TOL)


@interpreted
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("schedule", ["sorted", "sorted_wide", "direct_split"])
def test_expert_gemms_match_torch(on_input, schedule):
    M, topk, E, K, N = 400 if schedule == "sorted_wide" else 11, 2, 4, 128, 64
    (w1, s1, w2, s2, b1, b2), (q1, t1, q2, t2, _, _) = mma_experts(E, K, N, bias=True, seed=7)
    g, ids, emap = routing(M, topk, E, emap=True, seed=2)
    if schedule == "sorted_wide":
        assert (torch.bincount(local_ids(ids, emap, E).flatten() + 1, minlength=E + 1)[1:] > 64).any(), "64-row tiles"
    g = g.nan_to_num(0.0)
    x = torch.randn(M, K)
    cfg = CONFIGS[schedule]
    h = expert_gemm1_triton(x, q1, ids, w1_bias=b1, expert_map=emap, topk_weights=g if on_input else None,
                            quant="mxfp4_mma", w1_scale=t1, config=cfg)
    h_ref = expert_gemm1_torch(x, w1, ids, w1_bias=b1, expert_map=emap, topk_weights=g if on_input else None,
                               quant="mxfp4", w1_scale=s1)
    assert rel_err(h, h_ref) <= FP32_TOL
    a = torch.randn(M, topk, N)
    y = expert_gemm2_triton(a, q2, ids, w2_bias=b2, expert_map=emap, topk_weights=g, quant="mxfp4_mma", w2_scale=t2,
                            config=cfg)
    y_ref = expert_gemm2_torch(a, w2, ids, w2_bias=b2, expert_map=emap, topk_weights=g, quant="mxfp4", w2_scale=s2)
    assert rel_err(y, y_ref) <= FP32_TOL


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("schedule", ["sorted", "direct"])
def test_nan_scale_stays_in_its_block(schedule):
    """A NaN scale (255) in w1 row 3 makes exactly that output column NaN for the tokens routed to expert 0."""
    M, E, K, N = 6, 2, 64, 64
    (w1, s1, _, _, _, _), (q1, t1, _, _, _, _) = mma_experts(E, K, N, nan_group=True)
    ids = torch.tensor([[0], [1], [0], [1], [0], [1]], dtype=torch.int32)
    x = torch.randn(M, K)
    h = expert_gemm1_triton(x, q1, ids, quant="mxfp4_mma", w1_scale=t1, config=CONFIGS[schedule])
    nan = h.isnan()
    assert nan[ids[:, 0] == 0, 0, 3].all() and nan.sum() == (ids == 0).sum()
    ref = expert_gemm1_torch(x, w1, ids, quant="mxfp4", w1_scale=s1)
    assert rel_err(h.nan_to_num(0.0), ref.nan_to_num(0.0)) <= FP32_TOL


@interpreted
@pytest.mark.parametrize("schedule", ["sorted_split", "direct_split"])
def test_scales_across_the_layouts_range(schedule):
    """Rows whose scales span E8M0 bytes 22 .. MMA_MAX_SCALE (2^-105 .. 2^21): every output column (one weight row)
    within FP32_TOL of the PyTorch path, for the unfused gemm1 and gemm2 (the kernels' bf16 factors and the
    accumulator's 2^MMA_EXCESS)."""
    bytes_ = torch.tensor([22, 60, 107, 120, 127, 135, 147, MMA_MAX_SCALE], dtype=torch.uint8)
    (w1, s1, w2, s2, _, _), _ = mma_experts(2, 128, 64, seed=5)
    s1[:] = bytes_.repeat(s1.shape[1] // len(bytes_))[None, :, None]
    s2[:] = bytes_.repeat(s2.shape[1] // len(bytes_))[None, :, None]
    (q1, t1), (q2, t2) = prepare_mxfp4_mma(w1, s1), prepare_mxfp4_mma(w2, s2)
    g, ids, _ = routing(7, 2, 2, seed=3)
    x, a = torch.randn(7, 128), torch.randn(7, 2, 64)
    cfg = CONFIGS[schedule]
    h = expert_gemm1_triton(x, q1, ids, quant="mxfp4_mma", w1_scale=t1, config=cfg)
    h_ref = expert_gemm1_torch(x, w1, ids, quant="mxfp4", w1_scale=s1)
    y = expert_gemm2_triton(a, q2, ids, quant="mxfp4_mma", w2_scale=t2, config=cfg)
    y_ref = expert_gemm2_torch(a, w2, ids, quant="mxfp4", w2_scale=s2)
    for got, ref in ((h, h_ref), (y, y_ref)):
        got, ref = got.flatten(0, -2).double(), ref.flatten(0, -2).double()
        assert ref.abs().amax(0).min() > 0, "every column holds values"
        err = (got - ref).norm(dim=0) / ref.norm(dim=0)
        assert err.max() <= FP32_TOL, err


def _run_word_asm(asm: str, word: int) -> list[int]:
    """The bf16x2 bit patterns the PTX of ``_mma_words`` hands to its four FMAs ($0..$3, before the scale) for one
    32-bit MMA-layout word $4: its integer instructions executed here (mov, and, mul.lo, shf.l.wrap, lop3 0xEA)."""
    m32 = (1 << 32) - 1
    regs, out = {"$4": word}, {}

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    for line in asm.strip().strip("{}").split(";"):
        if not line.strip() or line.split()[0] == ".reg":
            continue
        op, *args = line.replace(",", " ").split()
        if op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "mul.lo.u32":
            regs[args[0]] = (val(args[1]) * val(args[2])) & m32
        elif op == "shf.l.wrap.b32":
            assert args[1] == args[2], "a rotation: the same word funnelled"
            r = val(args[3]) % 32
            regs[args[0]] = ((val(args[1]) << r) | (val(args[1]) >> (32 - r))) & m32
        elif op == "lop3.b32":
            assert args[4].lower() == "0xea", "(a & b) | c"
            regs[args[0]] = (val(args[1]) & val(args[2])) | val(args[3])
        elif op == "fma.rn.bf16x2":
            out[args[0]] = val(args[1])
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return [out[f"${r}"] for r in range(4)]


def test_decode_asm_places_every_code_bit():
    """The inline PTX of the MMA-layout decode (rotations written as multiplies where ``_aligned`` finds no mask bit
    among the wrapped ones) puts each code's sign at bit 15 and magnitude at bits 8..6 of its lane, for every bit of
    the word: the layout's own definition (``_source_bit``) checked one set bit at a time, and on random words."""
    from moe_extension.kernels._weight_formats import _MMA_WORD_ASM
    from moe_extension.quant.mxfp4_mma import _TARGET, _source_bit

    def expected(word):
        regs = [0] * 4
        for a in (0, 1):
            for h in (0, 1):
                for lane in (0, 1):
                    for bit, target in _TARGET.items():
                        if word >> _source_bit(a, h, lane, bit) & 1:
                            regs[2 * a + h] |= 1 << (target + 16 * lane)
        return regs

    asm = _MMA_WORD_ASM.value
    assert "mul.lo.u32" in asm, "the shift-only rotations go to the FMA pipe"
    g = torch.Generator().manual_seed(0)
    words = [1 << b for b in range(32)] + torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64).tolist()
    for word in words:
        assert _run_word_asm(asm, word) == expected(word), hex(word)


def test_direct_schedule_takes_the_layouts_tiles():
    """A direct config is clamped to the MMA tiles (128-column steps, at least 128 weight rows, power-of-two
    tiles) and to splits that each get a step."""
    cfg = configs.sanitize(MoeConfig("direct", 0, GemmConfig(32, 64, 4, 2, split_k=8), GemmConfig(96, 64, 8, 2,
                                                                                                  split_k=3)),
                           torch.float32, 256, 192, 2, quant="mxfp4_mma")
    assert cfg.path == "direct"
    assert (cfg.gemm1.block_n, cfg.gemm1.block_k, cfg.gemm1.num_warps, cfg.gemm1.split_k) == (64, 128, 4, 2)
    assert (cfg.gemm2.block_n, cfg.gemm2.block_k, cfg.gemm2.num_warps, cfg.gemm2.split_k) == (128, 128, 4, 2)
    assert configs.sanitize(cfg, torch.float32, 256, 192, 2, quant="mxfp4_mma") == cfg


@pytest.mark.parametrize("M, path", [(1, "direct"), (4, "direct"), (16, "sorted")])
def test_heuristic_runs_direct_at_decode(M, path):
    """gpt-oss-120b (E 128, topk 4): the direct schedule while pairs rarely share an expert, both reductions split
    at M = 1 (180 / 92 tiles of 128 rows: fewer than two per SM of 132)."""
    raw = configs.heuristic_config(M, 128, 2880, 2880, 4, torch.bfloat16, True, True, 132, "mxfp4_mma")
    cfg = configs.sanitize(raw, torch.bfloat16, 2880, 2880, 4, "mxfp4_mma")
    assert cfg == raw and cfg.path == path
    assert cfg.gemm1.block_k % 64 == 0 and cfg.gemm2.block_k % 64 == 0
    assert math.gcd(2 * cfg.gemm1.block_n, 16) == 16
    if M == 1:
        assert cfg.gemm1.split_k > 1 and cfg.gemm2.split_k > 1


@pytest.mark.parametrize("M", [1, 16, 256, 4096])
def test_heuristic_tiles_are_admitted(M):
    """The heuristic's tiles are ones ``mxfp4_mma_tiles`` admits unchanged (the tiles the GPU suite checks), and the
    decode cells split gemm2's reduction while a 4096-token batch does not."""
    raw = configs.heuristic_config(M, 128, 2880, 2880, 4, torch.bfloat16, True, True, 132, "mxfp4_mma")
    cfg = configs.sanitize(raw, torch.bfloat16, 2880, 2880, 4, "mxfp4_mma")
    assert (cfg.gemm1, cfg.gemm2) == (raw.gemm1, raw.gemm2)
    assert (cfg.gemm2.split_k > 1) == (M == 1)


# (E, topk, K, N, M): block_m, gemm1 (block_n, num_warps, num_stages, tail_m, tma_a, max_registers), gemm2 (block_n,
# num_warps, tail_m)
LAYER_TILES = {
    (128, 4, 2880, 2880, 1024): (64, (64, 4, 3, 32, True, 168), (128, 4, 32)),  # gpt-oss-120b: 32 rows per expert
    (32, 4, 2880, 2880, 224): (64, (64, 4, 3, 32, True, 168), (128, 4, 32)),  # gpt-oss-20b: 28 rows
    (32, 4, 2880, 2880, 192): (32, (64, 4, 4, 0, False, 0), (128, 4, 0)),  # gpt-oss-20b: 24 rows
    (8, 2, 4096, 14336, 256): (64, (64, 4, 3, 16, True, 168), (128, 4, 32)),  # Mixtral-8x7B: 64 rows
    (64, 6, 2048, 1408, 512): (64, (64, 4, 3, 16, True, 168), (128, 4, 32)),  # DeepSeek-V2-Lite: 48 rows
    (128, 8, 2048, 768, 1024): (64, (64, 4, 3, 16, False, 0), (128, 4, 0)),  # Qwen3-30B-A3B (N 768): 64 rows
    (32, 4, 2880, 2880, 4096): (128, (64, 4, 2, 16, True, 0), (128, 4, 16)),  # gpt-oss-20b: 512 rows
    (128, 8, 2048, 768, 512): (64, (64, 4, 3, 32, True, 168), (128, 4, 32)),  # Qwen3-30B-A3B (N 768): 32 rows
    (128, 8, 4096, 384, 512): (64, (64, 4, 3, 32, True, 168), (128, 4, 32)),  # Qwen3-235B-A22B TP 4: 32 rows
    (128, 8, 2048, 768, 4096): (128, (64, 4, 3, 32, False, 0), (128, 4, 16)),  # Qwen3-30B-A3B: 256 rows
}


@pytest.mark.parametrize("shape", list(LAYER_TILES))
def test_heuristic_widens_tiles_of_large_layers(shape):
    """More than 26 and at most 40 expected rows per expert (MXFP4_MMA_ONE_BLOCK_ROWS) run as one block of 64 whose
    GEMMs take 32-row tails (MXFP4_MMA_ONE_BLOCK_TAIL), gemm1 with TMA rows, capped at three programs' registers per
    SM, gemm2 128 columns on 4 warps; fewer rows run blocks of 32. From N = MXFP4_MMA_WIDE_N on, the sorted tiles
    widen: other blocks of 64 run gemm1 so (with a 16-row tail), gemm2 with a 32-row tail; blocks of 128 run gemm1 on
    TMA rows in 2 stages (two programs per SM, MXFP4_MMA_WIDE_GEMM1_STAGES); a smaller layer keeps 3 stages at blocks
    of 128 and 128-row tiles on 4 warps, and outside the one-block cells gemm1 on pointer loads, uncapped. Tiles
    admitted unchanged."""
    E, topk, K, N, M = shape
    raw = configs.heuristic_config(M, E, N, K, topk, torch.bfloat16, True, True, 132, "mxfp4_mma")
    assert configs.sanitize(raw, torch.bfloat16, N, K, topk, "mxfp4_mma") == raw
    g1, g2 = raw.gemm1, raw.gemm2
    got = (raw.block_m, (g1.block_n, g1.num_warps, g1.num_stages, g1.tail_m, g1.tma_a, g1.max_registers),
           (g2.block_n, g2.num_warps, g2.tail_m))
    assert raw.path == "sorted" and got == LAYER_TILES[shape]
    if g1.tail_m == configs.MXFP4_MMA_ONE_BLOCK_TAIL == g2.tail_m and raw.block_m == 64:  # one block: any N
        assert g1.tma_a and g1.max_registers and (g2.block_n, g2.num_warps) == (128, 4)
    else:
        assert (N >= configs.MXFP4_MMA_WIDE_N and raw.block_m >= 64) == g1.tma_a


@interpreted
@pytest.mark.parametrize("name", ["sorted_split", "direct_split"])
@pytest.mark.parametrize("K,N", [(128, 0), (0, 128)])
def test_empty_hidden_or_intermediate(name, K, N):
    """An empty intermediate (N = 0: each valid slot's w2 bias, weighted) or hidden dim (empty output) on both
    schedules, split reductions included, against the PyTorch implementation on the checkpoint layout."""
    (w1, s1, w2, s2, b1, b2), (q1, t1, q2, t2, _, _) = mma_experts(4, K, N, bias=True, seed=K + N)
    M = 1 if name == "direct_split" else 20
    g, ids, _ = routing(M, 3, 4, seed=M)
    x = torch.randn(M, K, dtype=torch.float16)
    out = fused_experts_triton(x, q1, q2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2, quant="mxfp4_mma",
                               w1_scale=t1, w2_scale=t2, config=CONFIGS[name])
    ref = fused_experts_torch(x, w1, w2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2, quant="mxfp4", w1_scale=s1,
                              w2_scale=s2)
    assert out.shape == (M, K) and out.isfinite().all() and rel_err(out, ref) <= FP16_TOL
