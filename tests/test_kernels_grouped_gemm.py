"""The routed-expert Triton kernels (moe_extension.kernels) called directly: both schedules (direct GEMV,
expert-sorted grouped GEMMs), every activation, bias, expert_map, apply_router_weight_on_input, invalid
slots, strided inputs, split reduction, the unfused entry points, every output element written, determinism,
and the config heuristic / tables. Against the fp64 loop of tests/reference.py.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tiny shapes, fp32/fp16: the interpreter's
bf16 tl.dot is wrong); with CUDA the same cases run on the GPU, bf16 included.
"""

import dataclasses
import json

import pytest
import torch
import triton
import triton.language as tl

import moe_extension.kernels._configs as configs
import moe_extension.kernels._routing as routing_module
import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig
from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES, wrap
from moe_extension.kernels._routing import route
from tests.reference import (
    assert_close,
    expert_gemm1_reference,
    expert_gemm2_reference,
    fused_experts_reference,
    random_expert_map,
    random_experts,
    random_routing,
    tolerance,
)
from tests.utils import DEVICES, INTERPRETED, poison, record_results

DEVICE = "cuda" if "cuda" in DEVICES else "cpu"
pytestmark = [
    pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="needs CUDA or the Triton interpreter"),
]
# Dtypes of the cases: the interpreter's bf16 tl.dot is wrong, so fp32/fp16 there and bf16/fp16 on the GPU.
CASE_DTYPES = (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float32, torch.float16)
ALL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# Tiny tiles keep the interpreter fast; on the GPU they are valid configs too (tl.dot needs >= 16).
SORTED = MoeConfig("sorted", 16, GemmConfig(16, 16, 4, 2), GemmConfig(16, 16, 4, 2))
# Expert-major tile order (group_m 0) on the split config; the others use the grouped order.
SORTED_SPLIT = MoeConfig("sorted", 16, GemmConfig(32, 16, 4, 2, group_m=0),
                         GemmConfig(16, 16, 4, 2, group_m=0, split_k=2))
SORTED_BM32 = MoeConfig("sorted", 32, GemmConfig(16, 32, 4, 2), GemmConfig(32, 16, 4, 2))
# gemm2 in 16-row tiles of the 32-row blocks (tile_m): two programs per block.
SORTED_ROWS = MoeConfig("sorted", 32, GemmConfig(16, 32, 4, 2), GemmConfig(32, 16, 4, 2, tile_m=16))
DIRECT = MoeConfig("direct", 0, GemmConfig(8, 16, 4, 2), GemmConfig(4, 32, 4, 2))
# The tensor-core GEMVs of ``_gemv_dot`` (GemmConfig.dot: what the heuristic runs on an expert-parallel shard): whole
# reductions, and both reductions split (partials summed by the last program of each tile).
DIRECT_DOT = MoeConfig("direct", 0, GemmConfig(32, 128, 4, 2, group_m=0, dot=True),
                       GemmConfig(64, 128, 4, 2, group_m=0, dot=True))
DIRECT_DOT_SPLIT = MoeConfig("direct", 0, GemmConfig(32, 128, 4, 2, group_m=0, split_k=2, dot=True),
                             GemmConfig(64, 128, 4, 2, group_m=0, split_k=2, dot=True))
CONFIGS = {"sorted": SORTED, "sorted_split": SORTED_SPLIT, "sorted_bm32": SORTED_BM32, "sorted_rows": SORTED_ROWS,
           "direct": DIRECT, "direct_dot": DIRECT_DOT, "direct_dot_split": DIRECT_DOT_SPLIT}


def _case(M, topk, E, K, N, dtype, *, bias=False, emap=False, on_input=False, transposed=False, invalid=0.15,
          seed=0):
    torch.manual_seed(seed)
    num_ids = E + 5 if emap else E
    ex = random_experts(E, K, N, dtype=dtype, device=DEVICE, bias=bias, transposed=transposed)
    g, ids = random_routing(M, num_ids, topk, invalid=invalid, device=DEVICE)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    kw = dict(w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"], apply_router_weight_on_input=on_input,
              expert_map=random_expert_map(num_ids, E, device=DEVICE) if emap else None)
    return x, ex["w1"], ex["w2"], g, ids, kw


# (config, activation, dtype index, M, topk, E, K, N, options): every activation on both schedules, K with
# and without a tail step, topk 1 and non-powers of two.
FUSED_CASES = [
    ("sorted", "silu", 0, 5, 3, 6, 40, 24, dict(bias=True)),
    ("sorted", "swigluoai", 1, 7, 2, 5, 48, 16, dict(bias=True, on_input=True, emap=True)),
    ("sorted", "gelu", 0, 4, 4, 3, 32, 20, dict(emap=True, transposed=True)),
    ("sorted", "gelu_tanh", 1, 6, 1, 4, 40, 24, dict(bias=True)),
    ("sorted", "swiglustep", 0, 3, 6, 8, 24, 16, dict(on_input=True)),
    ("sorted_split", "silu", 1, 33, 2, 3, 32, 40, dict(bias=True, transposed=True)),  # 2 blocks per expert
    ("sorted_bm32", "swigluoai", 0, 11, 3, 4, 40, 24, dict(bias=True)),
    ("sorted_rows", "silu", 1, 29, 3, 4, 40, 24, dict(bias=True, emap=True, on_input=True)),  # 1-2 blocks per expert
    ("direct", "silu", 0, 1, 3, 6, 40, 24, dict(bias=True)),
    ("direct", "swigluoai", 1, 2, 4, 9, 48, 16, dict(bias=True, on_input=True, emap=True)),
    ("direct", "gelu", 0, 1, 2, 4, 24, 40, dict(transposed=True)),
    ("direct", "gelu_tanh", 1, 3, 2, 8, 32, 24, dict(emap=True)),
    ("direct", "swiglustep", 0, 1, 6, 7, 40, 16, dict(bias=True)),
    # tensor-core GEMVs (16-bit: fp16 in the interpreter, whose bf16 dot is wrong): K and N past one 128-column step
    # and with tails, every activation, bias, router weight on the input, an expert_map with ids of other ranks
    ("direct_dot", "silu", 1, 2, 3, 6, 200, 72, dict(bias=True, emap=True)),
    ("direct_dot", "swigluoai", 1, 1, 4, 5, 64, 136, dict(bias=True, on_input=True)),
    ("direct_dot_split", "gelu", 1, 3, 2, 4, 264, 160, dict(emap=True, on_input=True)),
    ("direct_dot_split", "gelu_tanh", 1, 2, 3, 8, 256, 256, dict(bias=True)),
    ("direct_dot_split", "swiglustep", 1, 1, 6, 7, 136, 200, dict(bias=True, emap=True, transposed=True)),
]


@pytest.mark.parametrize("cfg,act,dt,M,topk,E,K,N,opts", FUSED_CASES)
def test_fused_experts_matches_reference(cfg, act, dt, M, topk, E, K, N, opts):
    dtype = CASE_DTYPES[dt]
    x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, seed=M * 7 + K, **opts)
    out = fused_experts_triton(x, w1, w2, g, ids, act, config=CONFIGS[cfg], **kw)
    assert out.shape == (M, K) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, act, **kw), tolerance(dtype, DEVICE))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("M", [1, 9])
def test_default_configs(dtype, M):
    """config=None: the heuristic (or this GPU's table) at a direct (M = 1) and a sorted (M = 9) size."""
    x, w1, w2, g, ids, kw = _case(M, 4, 6, 64, 32, dtype, bias=True, seed=M)
    out = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", **kw)
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, "swigluoai", **kw), tolerance(dtype, DEVICE))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("M", [1, 2])
def test_default_configs_on_a_shard(dtype, M):
    """config=None on an expert-parallel shard (an expert_map over 4x the experts held, most slots elsewhere): the
    heuristic's direct schedule on the tensor-core GEMVs for 16-bit weights (the FMA GEMVs' sorted fallback for
    fp32), against the reference; calls whose routings hit none of the local experts give exactly 0."""
    E, topk, K, N = 6, 4, 200, 72
    torch.manual_seed(M)
    ex = random_experts(E, K, N, dtype=dtype, device=DEVICE, bias=True)
    emap = random_expert_map(4 * E, E, device=DEVICE)
    kw = dict(w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"], expert_map=emap)
    cfg = fe.select_config(M, torch.empty(M, K, dtype=dtype, device=DEVICE), fe.WeightOperand.of(ex["w1"]),
                           fe.WeightOperand.of(ex["w2"]), topk, None, "none", emap)
    assert (cfg.path, cfg.gemm1.dot, cfg.gemm2.dot) == (("direct", True, True) if dtype != torch.float32 else
                                                        ("sorted", False, False))
    for _ in range(3):
        g, ids = random_routing(M, 4 * E, topk, invalid=0.1, device=DEVICE)
        x = torch.randn(M, K, dtype=dtype, device=DEVICE)
        out = fused_experts_triton(x, ex["w1"], ex["w2"], g, ids, "silu", **kw)
        assert_close(out, fused_experts_reference(x, ex["w1"], ex["w2"], g, ids, "silu", **kw),
                     tolerance(dtype, DEVICE))
    elsewhere = torch.nonzero(emap.cpu() < 0).flatten()
    ids = elsewhere[torch.randint(0, elsewhere.numel(), (M, topk))].to(torch.int32).to(DEVICE)  # no slot here
    out = fused_experts_triton(torch.randn(M, K, dtype=dtype, device=DEVICE), ex["w1"], ex["w2"], g, ids, "silu", **kw)
    assert (out == 0).all()


@pytest.mark.parametrize("cfg", ["sorted", "direct", "direct_dot_split"])
@pytest.mark.parametrize("on_input", [False, True])
def test_unfused_gemms_match_reference(cfg, on_input):
    dtype = CASE_DTYPES[1]
    x, w1, w2, g, ids, kw = _case(5, 3, 6, 40, 24, dtype, bias=True, emap=True, seed=3)
    common = dict(expert_map=kw["expert_map"], config=CONFIGS[cfg])
    h = expert_gemm1_triton(x, w1, ids, w1_bias=kw["w1_bias"], topk_weights=g if on_input else None, **common)
    ref_h = expert_gemm1_reference(x, w1, ids, w1_bias=kw["w1_bias"], expert_map=kw["expert_map"],
                                   topk_weights=g if on_input else None)
    assert h.shape == (5, 3, 48) and h.dtype == dtype
    assert_close(h, ref_h, tolerance(dtype, DEVICE))
    a = torch.randn(5, 3, 24, dtype=dtype, device=DEVICE)
    a_strided = torch.randn(5, 4, 30, dtype=dtype, device=DEVICE)[:, 1:, 3:27]  # non-contiguous [M, topk, N]
    for inter in (a, a_strided):
        y = expert_gemm2_triton(inter, w2, ids, w2_bias=kw["w2_bias"], topk_weights=None if on_input else g,
                                **common)
        ref_y = expert_gemm2_reference(inter, w2, ids, w2_bias=kw["w2_bias"], expert_map=kw["expert_map"],
                                       topk_weights=None if on_input else g)
        assert_close(y, ref_y, tolerance(dtype, DEVICE))
    invalid = ref_h.abs().sum(-1) == 0
    assert invalid.any(), "the case must have invalid slots"
    assert (h.cpu()[invalid] == 0).all() and (y.cpu()[invalid] == 0).all(), "invalid slots give rows of exactly 0"


def _with_tma(cfg: MoeConfig) -> MoeConfig:
    return dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, tma_weights=True, tma_a=True),
                               gemm2=dataclasses.replace(cfg.gemm2, tma_weights=True, tma_a=True))


# (config, activation, K, N): a K tail step (K = 40 with block_k 16 is even, 56 with 32 is not), N not a
# multiple of block_n, a split reduction, and the unfused first GEMM (activation "none").
TMA_CASES = [
    ("sorted", "swigluoai", 40, 24),
    ("sorted", "silu", 56, 40),
    ("sorted_split", "gelu", 48, 40),
    ("sorted_bm32", "swiglustep", 56, 24),
    ("sorted", "none", 40, 24),
]


def _use_tma(monkeypatch):
    """TMA paths on: forced in the interpreter; on a GPU they need sm_90+ (skip otherwise)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(fe, "tma_capable", lambda device: True)
    elif not fe.tma_capable(torch.device(DEVICE)):
        pytest.skip("needs sm_90+ for TMA")


@pytest.mark.parametrize("cfg,act,K,N", TMA_CASES)
def test_tma_weights_equal_pointer_loads(monkeypatch, cfg, act, K, N):
    """tma_weights=True loads the weight tiles, tma_a=True gemm2's sorted rows and gemm1's token rows (copied
    into sorted order first), through TMA descriptors (sm_90+; in the interpreter, forced on): the results
    equal the pointer loads' bitwise, and the path is really taken."""
    _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    x, w1, w2, g, ids, kw = _case(9, 3, 5, K, N, dtype, bias=True, emap=True, seed=K + N)
    base, tma = CONFIGS[cfg], _with_tma(CONFIGS[cfg])
    assert fe._weight_desc(w1, 16, tma.gemm1) is not None and fe._weight_desc(w1, 16, base.gemm1) is None
    a_sorted = torch.empty(64, N, dtype=dtype, device=DEVICE)
    assert fe._sorted_rows_descs(a_sorted, 16, tma.gemm2)[0] is not None
    assert fe._sorted_rows_descs(a_sorted, 16, base.gemm2) == (None, None)
    routing = route(ids, 5, tma.block_m)
    assert fe._gathered_rows_descs(x, routing, 3, tma.gemm1)[0] is not None
    assert fe._gathered_rows_descs(x, routing, 3, base.gemm1) == (None,) * 4
    if act == "none":
        ref = expert_gemm1_triton(x, w1, ids, w1_bias=kw["w1_bias"], config=base)
        out = expert_gemm1_triton(x, w1, ids, w1_bias=kw["w1_bias"], config=tma)
    else:
        ref = fused_experts_triton(x, w1, w2, g, ids, act, config=base, **kw)
        out = fused_experts_triton(x, w1, w2, g, ids, act, config=tma, **kw)
        assert_close(out, fused_experts_reference(x, w1, w2, g, ids, act, **kw), tolerance(dtype, DEVICE))
    assert torch.equal(out, ref)


def _tail_routing(block_m: int):
    """topk 1 routing whose expert counts give every kind of block: partial blocks at most block_m / 2 full
    (tail tiles), partial blocks just above it, full blocks, an empty expert; plus invalid slots."""
    half = block_m // 2
    counts = [3, block_m + 5, half, half + 1, 2 * block_m + half, 0]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.tensor([-1, 6, -1])])
    ids = ids[torch.randperm(ids.numel())].to(torch.int32).view(-1, 1)
    return torch.rand(ids.shape[0], 1) + 0.05, ids, len(counts)


@pytest.mark.parametrize("act,tma", [("swigluoai", False), ("silu", False), ("none", False), ("swigluoai", True)])
def test_tail_tiles(monkeypatch, act, tma):
    """tail_m: partial blocks with at most tail_m valid rows run tail_m-row tiles in the same launch (the
    routing has such blocks next to full and barely-partial ones); the results match the reference. With
    tma, gemm2's sorted rows come through the block and tail TMA descriptors (forced on in the interpreter), and
    both GEMMs walk the tiles in expert-major order."""
    if tma:
        _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    bm = 32 if DEVICE == "cpu" else 64
    torch.manual_seed(7)
    g, ids, E = _tail_routing(bm)
    g, ids = g.to(DEVICE), ids.to(DEVICE)
    ex = random_experts(E, 48, 40, dtype=dtype, device=DEVICE, bias=True)
    x = torch.randn(ids.shape[0], 48, dtype=dtype, device=DEVICE)
    tile = GemmConfig(16, 16, 4, 2, tail_m=bm // 2)
    order = 0 if tma else tile.group_m
    cfg = MoeConfig("sorted", bm, dataclasses.replace(tile, group_m=order, tma_a=tma),
                    dataclasses.replace(tile, tma_weights=tma, tma_a=tma, group_m=order))
    assert configs.sanitize(cfg, dtype, 40, 48) == cfg
    if act == "none":
        h = expert_gemm1_triton(x, ex["w1"], ids, w1_bias=ex["w1_bias"], config=cfg)
        assert_close(h, expert_gemm1_reference(x, ex["w1"], ids, w1_bias=ex["w1_bias"]), tolerance(dtype, DEVICE))
        a = torch.randn(ids.shape[0], 1, 40, dtype=dtype, device=DEVICE)
        y = expert_gemm2_triton(a, ex["w2"], ids, w2_bias=ex["w2_bias"], topk_weights=g, config=cfg)
        ref = expert_gemm2_reference(a, ex["w2"], ids, w2_bias=ex["w2_bias"], topk_weights=g)
        assert_close(y, ref, tolerance(dtype, DEVICE))
        return
    out = fused_experts_triton(x, ex["w1"], ex["w2"], g, ids, act, w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"],
                               config=cfg)
    ref = fused_experts_reference(x, ex["w1"], ex["w2"], g, ids, act, w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"])
    assert_close(out, ref, tolerance(dtype, DEVICE))


@pytest.mark.parametrize("tma,tail_m", [(False, 0), (True, 0), (False, 16)])
def test_gemm2_row_tiles(monkeypatch, tma, tail_m):
    """gemm2.tile_m: each block of block_m rows runs as block_m / tile_m programs of tile_m rows (with tma_a, the
    sorted rows come through tile_m-row descriptors; with tail_m, partial tiles run tail tiles), tiles of padding
    rows only exit at once. The routing has full, partial and one-row blocks; the fused op and the unfused
    expert_gemm2 match the reference and the whole-block tiles, every output written (poisoned outputs)."""
    if tma:
        _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    bm = 64
    torch.manual_seed(11)
    g, ids, E = _tail_routing(bm)
    g, ids = g.to(DEVICE), ids.to(DEVICE)
    ex = random_experts(E, 48, 40, dtype=dtype, device=DEVICE, bias=True)
    x = torch.randn(ids.shape[0], 48, dtype=dtype, device=DEVICE)
    whole = MoeConfig("sorted", bm, GemmConfig(16, 16, 4, 2), GemmConfig(16, 16, 4, 2, tma_a=tma, tail_m=tail_m))
    rows = dataclasses.replace(whole, gemm2=dataclasses.replace(whole.gemm2, tile_m=32))
    assert configs.sanitize(rows, dtype, 40, 48) == rows
    kw = dict(w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"])
    monkeypatch.setattr(fe, "torch", _PoisonedAllocations())
    out = fused_experts_triton(x, ex["w1"], ex["w2"], g, ids, "silu", config=rows, **kw)
    ref = fused_experts_reference(x, ex["w1"], ex["w2"], g, ids, "silu", **kw)
    assert_close(out, ref, tolerance(dtype, DEVICE))
    assert_close(out, fused_experts_triton(x, ex["w1"], ex["w2"], g, ids, "silu", config=whole, **kw).cpu(),
                 tolerance(dtype, DEVICE))
    a = torch.randn(ids.shape[0], 1, 40, dtype=dtype, device=DEVICE)
    y = expert_gemm2_triton(a, ex["w2"], ids, w2_bias=ex["w2_bias"], topk_weights=g, config=rows)
    assert_close(y, expert_gemm2_reference(a, ex["w2"], ids, w2_bias=ex["w2_bias"], topk_weights=g),
                 tolerance(dtype, DEVICE))


class _PoisonedAllocations:
    """Stands in for the torch module inside a kernels module (_routing, fused_experts): its workspaces start
    poisoned (NaN, or -12345 for integers), not as zeros or leftovers."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        return poison(torch.empty(*size, **kwargs))


@pytest.mark.parametrize("tail_m,tma,zero_padding", [(0, False, True), (16, False, True), (16, True, True),
                                                    (16, False, False), (0, True, False)])
def test_gemm1_padding_rows(monkeypatch, tail_m, tma, zero_padding):
    """gemm1 in sorted order writes every row of the used blocks: valid rows their values, padding rows 0
    (those past a tail tile too), so gemm2 never multiplies stale rows; with tma_a, the row copy's padding
    rows are 0 too. Unused blocks stay untouched. With zero_padding=False (the persistent gemm2 reads only
    valid rows) the padding rows are not written either. Workspaces start poisoned (NaN); w1 has a bias,
    whose activation is not 0."""
    if tma:
        _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    bm, K, N = 32, 48, 40
    torch.manual_seed(11)
    _, ids, E = _tail_routing(bm)
    ids = ids.to(DEVICE)
    ex = random_experts(E, K, N, dtype=dtype, device=DEVICE, bias=True)
    x = torch.randn(ids.shape[0], K, dtype=dtype, device=DEVICE)
    tile = GemmConfig(16, 16, 4, 2, tail_m=tail_m, tma_a=tma)
    r = route(ids, E, bm)
    h = poison(torch.empty(r.max_blocks * bm, N, dtype=dtype, device=DEVICE))
    monkeypatch.setattr(fe, "torch", _PoisonedAllocations())
    copy, _ = fe._gemm1_sorted(x, ex["w1"], ex["w1_bias"], h, True, r, 1, ACTIVATION_CODES["swigluoai"], None,
                               1.702, 7.0, tile, zero_padding=zero_padding)
    monkeypatch.undo()
    used = (r.block_expert >= 0).repeat_interleave(bm)
    valid = used & (r.sorted_pairs < ids.numel())
    padding = used & ~valid
    assert padding.sum() >= bm and (~used).any() and valid.sum() == ((ids >= 0) & (ids < E)).sum()
    assert (h[padding] == 0).all() if zero_padding else h[padding].isnan().all()
    assert h[valid].isfinite().all() and (h[valid] != 0).any()
    assert h[~used].isnan().all()
    if tma:
        assert (copy[padding] == 0).all() and copy[valid].isfinite().all() and copy[~used].isnan().all()


@pytest.mark.parametrize("bias,emap,on_input,group_m,K", [(True, True, False, 8, 48), (False, False, True, 0, 48),
                                                     (True, False, False, 2, 56), (False, True, False, 8, 44)])
def test_persistent_gemm2(monkeypatch, bias, emap, on_input, group_m, K):
    """gemm2.persistent: one program per SM (4 in the interpreter, each walking several tiles) reads and writes
    each expert's rows through ragged TMA descriptors, and the slot sum reads its sorted rows through
    ``inverse``: bitwise equal to the non-persistent gemm2 (same dot order) and close to the reference; the
    padding rows and unused blocks of its output (poisoned) are never written. Both tile orders. K = 44 makes
    the output rows 88 bytes, not TMA-capable: the non-persistent kernel runs instead."""
    _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    M, topk, E, N, bm = 97, 3, 6, 40, 16
    x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, bias=bias, emap=emap, on_input=on_input, seed=K + group_m)
    tile = GemmConfig(16, 16, 4, 2, group_m=group_m, tma_weights=True, tma_a=True)
    base = MoeConfig("sorted", bm, tile, tile)
    pers = dataclasses.replace(base, gemm2=dataclasses.replace(tile, persistent=True))
    assert configs.sanitize(pers, dtype, N, K, topk) == pers
    launched = []
    real = fe._gemm2_persistent

    def spy(a, w2_, bias_, y, routing, *args, **kwargs):
        launched.append((y, routing))
        real(a, w2_, bias_, y, routing, *args, **kwargs)

    monkeypatch.setattr(fe, "_gemm2_persistent", spy)
    ref = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", config=base, **kw)
    monkeypatch.setattr(fe, "torch", _PoisonedAllocations())
    out = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", config=pers, **kw)
    monkeypatch.setattr(fe, "torch", torch)
    assert torch.equal(out, ref)
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, "swigluoai", **kw), tolerance(dtype, DEVICE))
    if K * dtype.itemsize % 16:
        assert not launched
        return
    (y, r), = launched
    assert (r.expert_counts > bm).any() and (r.expert_counts % bm > 0).any(), "multi-block and partial experts"
    valid = torch.zeros(y.shape[0], dtype=torch.bool, device=DEVICE)
    valid[r.inverse[r.inverse >= 0].long()] = True
    assert y[valid].isfinite().all() and y[~valid].isnan().all()


@pytest.mark.parametrize("act,bias,emap,on_input,group_m,tma,gemm2_persistent", [
    ("swigluoai", True, True, False, 0, True, True), ("silu", False, False, True, 8, False, False),
    ("gelu", True, False, False, 2, True, False), ("gelu_tanh", False, True, False, 0, False, True)])
def test_persistent_gemm1(monkeypatch, act, bias, emap, on_input, group_m, tma, gemm2_persistent):
    """gemm1.persistent: one program per SM (4 in the interpreter, each walking several tiles of the used blocks)
    computes each tile as the one-program-per-tile launch does: the fused output bitwise equal to the tiled gemm1's
    (same dot order), close to the reference; both tile orders, with the persistent gemm2 after it (padding rows
    unwritten) or the tiled one (padding rows stored as 0). With pointer weight tiles (no TMA) the tiled launch runs
    instead. A tail_m asked for with it is dropped by ``sanitize``."""
    _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    M, topk, E, K, N, bm = 97, 3, 6, 48, 40, 16
    x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, bias=bias, emap=emap, on_input=on_input, seed=group_m + 5)
    g1 = GemmConfig(16, 16, 4, 2, group_m=group_m, tma_weights=tma)
    g2 = GemmConfig(16, 16, 4, 2, tma_weights=True, tma_a=True, persistent=gemm2_persistent)
    base = MoeConfig("sorted", bm, g1, g2)
    pers = dataclasses.replace(base, gemm1=dataclasses.replace(g1, persistent=True))
    assert configs.sanitize(pers, dtype, N, K, topk) == pers
    assert configs.sanitize(dataclasses.replace(pers, gemm1=dataclasses.replace(pers.gemm1, tail_m=8)), dtype, N, K,
                            topk) == pers
    taken = record_results(monkeypatch, fe, "_persistent_gemm1_ok")
    ref = fused_experts_triton(x, w1, w2, g, ids, act, config=base, **kw)
    assert not any(taken)
    monkeypatch.setattr(fe, "torch", _PoisonedAllocations())
    out = fused_experts_triton(x, w1, w2, g, ids, act, config=pers, **kw)
    monkeypatch.setattr(fe, "torch", torch)
    assert any(taken) == tma, "the persistent gemm1 ran with TMA weight tiles (pointer tiles: the tiled launch)"
    assert torch.equal(out, ref)
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, act, **kw), tolerance(dtype, DEVICE))


@pytest.mark.parametrize("act", ["swigluoai", "silu"])
def test_persistent_gemm1_narrow_n(monkeypatch, act):
    """The persistent gemm1 wraps its tiles' weight rows without a loop (``wrap``'s NO_LOOP: one subtraction, and a
    remainder where the range is narrower than the tile, ``test_wrap_is_the_remainder``): with N 4 (a tile's row
    indices past the range up to 3 times over) and N 20 (once) it equals the tiled launch bitwise and the reference
    closely (gate and up interleaved, and halves)."""
    _use_tma(monkeypatch)
    dtype = CASE_DTYPES[1]
    taken = record_results(monkeypatch, fe, "_persistent_gemm1_ok")
    for N in (4, 20):
        M, topk, E, K, bm = 41, 2, 4, 32, 16
        x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, bias=True, seed=9 + N)
        g1 = GemmConfig(16, 16, 4, 2, group_m=0, tma_weights=True)
        g2 = GemmConfig(16, 16, 4, 2, tma_weights=True, tma_a=True)
        base = MoeConfig("sorted", bm, g1, g2)
        pers = dataclasses.replace(base, gemm1=dataclasses.replace(g1, persistent=True))
        ref = fused_experts_triton(x, w1, w2, g, ids, act, config=base, **kw)
        taken.clear()
        out = fused_experts_triton(x, w1, w2, g, ids, act, config=pers, **kw)
        assert any(taken), "the persistent gemm1 ran"
        assert torch.equal(out, ref), (act, N)
        assert_close(out, fused_experts_reference(x, w1, w2, g, ids, act, **kw), tolerance(dtype, DEVICE))


@pytest.mark.parametrize("single_program_max_pairs", [0, 128])
@pytest.mark.parametrize("tail_m", [0, 16])
def test_gemm2_starts_on_counted_gemm1_tiles(monkeypatch, tail_m, single_program_max_pairs):
    """The fused path's per-expert handshake (under PDL on the GPU): the routing zeroes ``tiles_done`` (its
    workspaces poisoned here; both routing schedules), gemm1 with ``signal`` adds exactly its tile count per
    expert (tail tiles once, experts without rows 0), and a gemm2 that waits on those counts equals a gemm2
    launched after gemm1, bitwise. On sm_90+ both run with programmatic dependent launch."""
    dtype = CASE_DTYPES[1]
    M, topk, E, K, N, bm = 37, 3, 6, 40, 24, 32
    x, w1, w2, g, _, _ = _case(M, topk, E, K, N, dtype, seed=3)
    # Expert 0 takes every token's first slot (2 blocks, the second one partial), expert 3 none, and some
    # slots are invalid.
    others = torch.tensor([1, 2, 4, 5, -1], device=DEVICE)
    ids = torch.stack([torch.zeros(M, dtype=torch.long, device=DEVICE), others[torch.arange(M, device=DEVICE) % 4],
                       others[torch.arange(M, device=DEVICE) % 5]], dim=1)
    tile = GemmConfig(16, 16, 4, 2, tail_m=tail_m)
    cfg = MoeConfig("sorted", bm, tile, tile)
    assert configs.sanitize(cfg, dtype, N, K) == cfg
    monkeypatch.setattr(routing_module, "torch", _PoisonedAllocations())
    r = route(ids, E, bm, single_program_max_pairs=single_program_max_pairs)
    monkeypatch.undo()
    assert r.expert_counts[0] > bm and r.expert_counts[3] == 0
    assert (r.tiles_done == 0).all()
    pdl = fe.pdl_capable(torch.device(DEVICE))
    a = torch.empty(r.max_blocks * bm, N, dtype=dtype, device=DEVICE)
    fe._gemm1_sorted(x, w1, None, a, True, r, topk, ACTIVATION_CODES["silu"], None, 1.702, 7.0, tile, pdl,
                     signal=True)
    tiles_n1 = -(-N // tile.block_n)
    assert torch.equal(r.tiles_done, -(-r.expert_counts // bm) * tiles_n1)
    waited, after = (poison(torch.empty(1, M, topk, K, dtype=dtype, device=DEVICE)) for _ in range(2))
    fe._gemm2_sorted(a, True, w2, None, waited, r, topk, g, tile, pdl, wait_tiles_n1=tiles_n1)
    fe._gemm2_sorted(a, True, w2, None, after, r, topk, g, tile)
    valid = (r.inverse >= 0).view(M, topk)
    assert torch.equal(waited[:, valid], after[:, valid])
    assert waited[:, valid].isfinite().all()


def test_tma_weights_fall_back_for_transposed_weights(monkeypatch):
    monkeypatch.setattr(fe, "tma_capable", lambda device: True)
    ex = random_experts(3, 32, 16, dtype=torch.float16, device=DEVICE, transposed=True)
    cfg = GemmConfig(16, 16, 4, 2, tma_weights=True)
    assert fe._weight_desc(ex["w1"], 16, cfg) is None, "last dim not contiguous: pointer loads"


def test_every_output_written():
    """Each kernel writes every element it owns: outputs poisoned with NaN beforehand stay NaN only where
    nothing is owed (padding rows, invalid slots)."""
    dtype = CASE_DTYPES[0]
    M, topk, E, K, N = 6, 3, 5, 40, 24
    x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, bias=True, seed=11)
    act = ACTIVATION_CODES["silu"]
    r = route(ids, E, 16)
    valid_sorted = torch.zeros(r.max_blocks * 16, dtype=torch.bool)
    used = int((r.block_expert >= 0).sum()) * 16
    valid_sorted[:used] = (r.sorted_pairs[:used] < M * topk).cpu()
    valid_pair = (r.inverse >= 0).cpu().view(M, topk)
    a = poison(torch.empty(r.max_blocks * 16, N, dtype=dtype, device=DEVICE))
    fe._gemm1_sorted(x, w1, kw["w1_bias"], a, True, r, topk, act, None, 1.702, 7.0, SORTED.gemm1)
    assert a.cpu()[valid_sorted].isfinite().all()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)
    y = poison(torch.empty(2, M, topk, K, dtype=torch.float32, device=DEVICE))
    fe._gemm2_sorted(a, True, w2, kw["w2_bias"], y, r, topk, g, SORTED_SPLIT.gemm2)
    assert y.cpu()[:, valid_pair].isfinite().all()
    out = poison(torch.empty(M, K, dtype=dtype, device=DEVICE))
    fe._sum_slots(y, r.inverse, out, topk)
    assert out.isfinite().all(), "slot sum: every output element written, NaN in invalid slots ignored"
    a2 = poison(torch.empty(M * topk, N, dtype=dtype, device=DEVICE))
    fe._gemv1(x, w1, kw["w1_bias"], a2, ids, None, act, None, 1.702, 7.0, DIRECT.gemm1)
    assert a2.cpu()[valid_pair.view(-1)].isfinite().all()
    out2 = poison(torch.empty(M, K, dtype=dtype, device=DEVICE))
    fe._gemv2(a2.view(M, topk, N), w2, kw["w2_bias"], out2, ids, None, g, True, DIRECT.gemm2)
    assert out2.isfinite().all(), "direct slot sum: NaN rows of invalid slots never read"


# The interpreter's exp() of the huge negative gates overflows (-> 0, by design): numpy warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("cfg", ["sorted_split", "direct"])
def test_extreme_rows_and_garbage_in_invalid_slots(cfg):
    """Zero and huge rows give no NaN; router weights of invalid slots (NaN here) are never used."""
    dtype = CASE_DTYPES[0]
    M, topk, E, K, N = 4, 3, 4, 32, 16
    x, w1, w2, g, ids, kw = _case(M, topk, E, K, N, dtype, bias=True, invalid=0.4, seed=5)
    x[0] = 0
    x[1] *= 1e3
    ids[2, 0] = -1
    g_garbage = g.clone()
    g_garbage[ids < 0] = float("nan")
    g_garbage[ids >= E] = float("nan")
    out = fused_experts_triton(x, w1, w2, g_garbage, ids, "silu", config=CONFIGS[cfg], **kw)
    assert out.isfinite().all()
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, "silu", **kw), tolerance(dtype, DEVICE))
    ids_none = torch.full_like(ids, -1)
    out0 = fused_experts_triton(x, w1, w2, g_garbage, ids_none, "silu", config=CONFIGS[cfg], **kw)
    assert (out0 == 0).all(), "tokens whose slots are all invalid give exactly 0"


@pytest.mark.parametrize("cfg", ["sorted_split", "direct"])
def test_deterministic(cfg):
    x, w1, w2, g, ids, kw = _case(7, 4, 5, 40, 24, CASE_DTYPES[0], bias=True, seed=9)
    first = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", config=CONFIGS[cfg], **kw)
    second = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", config=CONFIGS[cfg], **kw)
    assert torch.equal(first, second)


def test_register_cap_reaches_the_sorted_launches():
    """GemmConfig.max_registers is the sorted tiles' launch option ``maxnreg`` (ptxas's register cap); 0 leaves
    the option out. A capped config computes the same output, bitwise."""
    assert "maxnreg" not in fe._tile_options(GemmConfig(64, 128, 4, 3), False)
    opts = fe._tile_options(GemmConfig(64, 128, 4, 3, max_registers=168), False)
    assert (opts["maxnreg"], opts["num_warps"], opts["num_stages"]) == (168, 4, 3)
    x, w1, w2, g, ids, kw = _case(7, 4, 5, 40, 24, CASE_DTYPES[0], bias=True, seed=9)
    capped = dataclasses.replace(SORTED, gemm1=dataclasses.replace(SORTED.gemm1, max_registers=168),
                                 gemm2=dataclasses.replace(SORTED.gemm2, max_registers=128))
    assert torch.equal(fused_experts_triton(x, w1, w2, g, ids, "silu", config=capped, **kw),
                       fused_experts_triton(x, w1, w2, g, ids, "silu", config=SORTED, **kw))


@triton.jit
def _wrap_kernel(out_ptr, n, SPAN: tl.constexpr, NO_LOOP: tl.constexpr):
    """out[pid, :SPAN] = wrap(pid + arange(SPAN), n, SPAN, NO_LOOP) for the program's start pid (< n)."""
    pid = tl.program_id(0)
    tl.store(out_ptr + pid * SPAN + tl.arange(0, SPAN), wrap(pid + tl.arange(0, SPAN), n, SPAN, NO_LOOP))


@pytest.mark.parametrize("no_loop", [False, True])
@pytest.mark.parametrize("SPAN", [16, 128])
@pytest.mark.parametrize("n", [1, 3, 16, 17, 100, 127, 128, 200])
def test_wrap_is_the_remainder(n, SPAN, no_loop):
    """``wrap`` (the tiles' row indices modulo their range, by conditional subtractions; NO_LOOP: one, and a
    remainder for a range narrower than the span) equals ``%`` for every start below n, also where the span covers
    the range several times (n < SPAN)."""
    out = poison(torch.empty(n, SPAN, dtype=torch.int32, device=DEVICE))
    _wrap_kernel[(n,)](out, n, SPAN=SPAN, NO_LOOP=no_loop)
    starts = torch.arange(n, device=DEVICE)[:, None]
    assert torch.equal(out, ((starts + torch.arange(SPAN, device=DEVICE)[None, :]) % n).to(torch.int32))


def test_empty_batch():
    x, w1, w2, g, ids, kw = _case(1, 2, 3, 16, 16, CASE_DTYPES[0])
    out = fused_experts_triton(x[:0], w1, w2, g[:0], ids[:0], "silu")
    assert out.shape == (0, 16)
    assert expert_gemm1_triton(x[:0], w1, ids[:0]).shape == (0, 2, 32)
    assert expert_gemm2_triton(torch.empty(0, 2, 16, dtype=x.dtype, device=DEVICE), w2, ids[:0]).shape == (0, 2, 16)


@pytest.mark.parametrize("cfg", ["sorted", "sorted_split", "direct"])
@pytest.mark.parametrize("K,N", [(16, 0), (0, 16), (0, 0)])
def test_empty_hidden_or_intermediate(cfg, K, N):
    """Weights with an empty dimension (intermediate N = 0: the output is each valid slot's w2 bias, weighted;
    hidden K = 0: empty outputs) on every schedule, split reductions included: the fp64 reference's values."""
    M = 1 if cfg == "direct" else 20
    x, w1, w2, g, ids, kw = _case(M, 3, 4, K, N, CASE_DTYPES[0], bias=True, seed=K + N)
    for on_input in (False, True):
        kw["apply_router_weight_on_input"] = on_input
        out = fused_experts_triton(x, w1, w2, g, ids, "swigluoai", config=CONFIGS[cfg], **kw)
        ref = fused_experts_reference(x, w1, w2, g, ids, "swigluoai", **kw)
        assert out.shape == (M, K) and (K == 0 or out.abs().max() > 0)
        assert_close(out, ref, tolerance(x.dtype))
    h = expert_gemm1_triton(x, w1, ids, w1_bias=kw["w1_bias"], config=CONFIGS[cfg])
    assert_close(h, expert_gemm1_reference(x, w1, ids, w1_bias=kw["w1_bias"]), tolerance(x.dtype))
    a = torch.randn(M, 3, N, dtype=x.dtype, device=DEVICE)
    y = expert_gemm2_triton(a, w2, ids, w2_bias=kw["w2_bias"], topk_weights=g, config=CONFIGS[cfg])
    assert y.shape == (M, 3, K)
    assert_close(y, expert_gemm2_reference(a, w2, ids, w2_bias=kw["w2_bias"], topk_weights=g), tolerance(x.dtype))


def test_no_experts():
    """A rank that holds no experts (E = 0, ids over other ranks' experts through an expert_map): every slot is
    invalid, so the outputs are 0, as the reference gives them."""
    x, w1, w2, g, ids, kw = _case(20, 3, 4, 16, 16, CASE_DTYPES[0], bias=True)
    none1, none2 = w1[:0], w2[:0]
    emap = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    for M in (1, 20):
        out = fused_experts_triton(x[:M], none1, none2, g[:M], ids[:M], "silu", expert_map=emap)
        ref = fused_experts_reference(x[:M], none1, none2, g[:M], ids[:M], "silu", expert_map=emap)
        assert out.shape == (M, 16) and (out == 0).all() and (ref == 0).all()
    assert (expert_gemm1_triton(x, none1, ids, expert_map=emap) == 0).all()
    a = torch.randn(20, 3, 16, dtype=x.dtype, device=DEVICE)
    assert (expert_gemm2_triton(a, none2, ids, expert_map=emap) == 0).all()


# ------------------------------------------------------------------------------------------------ configs

ISSUE_SHAPES = [(128, 4, 2880, 2880), (128, 8, 2048, 768), (8, 2, 4096, 14336), (512, 8, 1000, 333),
                (64, 6, 2048, 1408), (256, 8, 7168, 2048)]


@pytest.mark.parametrize("E,topk,K,N", ISSUE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heuristic_configs_are_valid(E, topk, K, N, dtype):
    esize = torch.empty((), dtype=dtype).element_size()
    for M in (1, 2, 3, 16, 77, 256, 1000, 4096, 65536):
        for rows in (True, False):
            cfg = configs.sanitize(configs.heuristic_config(M, E, N, K, topk, dtype, rows, rows), dtype, N, K,
                                   topk)
            assert cfg.path == ("direct" if configs.use_direct(M, E, topk) else "sorted")
            for g in (cfg.gemm1, cfg.gemm2):
                assert g.block_n & (g.block_n - 1) == 0 and g.block_k & (g.block_k - 1) == 0
                assert g.num_warps in (1, 2, 4, 8, 16) and 2 <= g.num_stages <= 6
            if cfg.path == "direct":
                slots = 1 << (topk - 1).bit_length()
                assert 2 * cfg.gemm1.block_n * cfg.gemm1.block_k <= 8192, "gemv1 fp32 accumulator tile"
                assert slots * cfg.gemm2.block_n * cfg.gemm2.block_k <= 8192, "gemv2 fp32 accumulator tile"
            if cfg.path == "sorted":
                bm = cfg.block_m
                assert bm in (16, 32, 64, 128) and min(cfg.gemm1.block_n, cfg.gemm1.block_k) >= 16
                smem1 = cfg.gemm1.num_stages * (bm + 2 * cfg.gemm1.block_n) * cfg.gemm1.block_k * esize
                smem2 = cfg.gemm2.num_stages * (bm + cfg.gemm2.block_n) * cfg.gemm2.block_k * esize
                assert max(smem1, smem2) <= configs.SMEM_BUDGET
                assert 1 <= fe.effective_splits(N, cfg.gemm2) <= cfg.gemm2.split_k


def test_sanitize_clamps():
    wild = MoeConfig("sorted", 100, GemmConfig(300, 200, 3, 9, tail_m=100),
                     GemmConfig(8, 8, 4, 7, split_k=64, tail_m=5))
    cfg = configs.sanitize(wild, torch.bfloat16, 40, 40)
    assert cfg.gemm1.tail_m == 64 and cfg.gemm2.tail_m == 16, "tails: powers of two in [16, block_m / 2]"
    direct = MoeConfig("direct", 0, GemmConfig(8, 8, tail_m=32), GemmConfig(8, 8, tail_m=32))
    assert configs.sanitize(direct, torch.bfloat16, 40, 40).gemm1.tail_m == 0, "no tails on the direct path"
    # 2 stages of 128 x 128 + 128 x 512 bf16 tiles are 320 KB: block_k halves until they fit (160 KB).
    assert cfg.block_m == 128 and cfg.gemm1.block_n == 256 and cfg.gemm1.block_k == 64
    assert cfg.gemm1.num_warps == 4 and cfg.gemm1.num_stages == 2
    assert cfg.gemm2.block_n == 16 and cfg.gemm2.block_k == 16 and cfg.gemm2.split_k == 3
    assert cfg.gemm2.num_stages == 6


def test_sanitize_fits_the_persistent_gemm1_output_tile():
    """A persistent gemm1 holds its [block_m, block_n] output tile in shared memory too: its pipelined tiles stay
    within SMEM_BUDGET (never more stages than the tiled gemm1) and, with the output tile, within
    PERSISTENT_GEMM1_SMEM_BUDGET; the heuristic's persistent tile (128 x 256 x 64 bf16, 4 stages) is within both."""
    def fitted(dtype, persistent):
        tile = GemmConfig(128, 32, 8, 4, tma_weights=True, persistent=persistent)
        return configs.sanitize(MoeConfig("sorted", 128, tile, tile), dtype, 1408, 2048, 6).gemm1

    # fp32: 4 stages of 128 x (128 + 256) x 32 are 192 KB, 256 KB with the 64 KB output tile: 3 stages then.
    stage, out_tile = (128 + 256) * 32 * 4, 128 * 128 * 4
    assert fitted(torch.float32, False).num_stages == 4 and fitted(torch.float32, True).num_stages == 3
    assert 3 * stage + out_tile <= configs.PERSISTENT_GEMM1_SMEM_BUDGET < 4 * stage + out_tile
    h = configs.heuristic_config(2048, 64, 1408, 2048, 6, torch.bfloat16, True, True, 132)
    assert h.gemm1.persistent and (h.block_m, h.gemm1.block_n, h.gemm1.block_k, h.gemm1.num_stages) == (128, 128, 64, 4)
    assert configs.sanitize(h, torch.bfloat16, 1408, 2048, 6) == h
    assert 4 * (128 + 256) * 64 * 2 + 128 * 128 * 2 <= configs.PERSISTENT_GEMM1_SMEM_BUDGET


def test_sanitize_gemm2_row_tiles():
    """gemm2.tile_m: a power of two in [16, block_m / 2] or 0 (the block), super-grouped order (group_m >= 1),
    tails within the tile; 0 with the persistent gemm2, in gemm1, and for MXFP4."""
    base = MoeConfig("sorted", 128, GemmConfig(64, 64, 8, 4), GemmConfig(128, 64, 4, 4, group_m=0, tile_m=48,
                                                                          tail_m=64))
    cfg = configs.sanitize(base, torch.bfloat16, 2048, 2048)
    assert (cfg.gemm2.tile_m, cfg.gemm2.group_m, cfg.gemm2.tail_m) == (32, 1, 16)
    for tile_m in (128, 256, -1):
        other = dataclasses.replace(base, gemm2=dataclasses.replace(base.gemm2, tile_m=tile_m))
        assert configs.sanitize(other, torch.bfloat16, 2048, 2048).gemm2.tile_m == 0
    small = dataclasses.replace(base, gemm2=dataclasses.replace(base.gemm2, tile_m=4))
    assert configs.sanitize(small, torch.bfloat16, 2048, 2048).gemm2.tile_m == 16
    persistent = dataclasses.replace(base, gemm2=dataclasses.replace(base.gemm2, persistent=True))
    assert configs.sanitize(persistent, torch.bfloat16, 2048, 2048).gemm2.tile_m == 0
    in_gemm1 = dataclasses.replace(base, gemm1=dataclasses.replace(base.gemm1, tile_m=64))
    assert configs.sanitize(in_gemm1, torch.bfloat16, 2048, 2048).gemm1.tile_m == 0
    for quant in ("mxfp4", "mxfp4_mma"):
        assert configs.sanitize(base, torch.bfloat16, 2048, 2048, quant=quant).gemm2.tile_m == 0


def test_dense_heuristic_tiles_by_block_m():
    """16-bit weights (dbrx-tp8's experts: E 16, topk 4, K 6144, N 1344): blocks of 64 rows from 24 rows per expert
    on, of 128 from 64, and the tiles of ``dense_sorted_tiles`` per block height (both GEMMs persistent at 128; at 16
    rows gemm2 tiles of 128 columns where N <= 1024);
    fp32 activations and the quantized formats keep their own rules (never a persistent gemm1)."""
    def bf16(M, N=1344, dtype=torch.bfloat16, quant="none"):
        return configs.heuristic_config(M, 16, N, 6144, 4, dtype, True, True, 132, quant)

    c = bf16(512)  # 128 rows per expert
    assert c.block_m == 128 and (c.gemm1.block_n, c.gemm1.group_m, c.gemm1.tma_weights) == (128, 0, True)
    assert c.gemm1.persistent and c.gemm1.tail_m == 0
    assert (c.gemm2.block_n, c.gemm2.tma_weights, c.gemm2.persistent) == (256, True, True)
    assert bf16(300).block_m == 128 and bf16(256).block_m == 128  # 75 and 64 rows
    c = bf16(240)  # 60 rows
    assert c.block_m == 64 and c.gemm1.block_n == 64 and c.gemm1.tma_weights and bf16(240, N=4096).gemm1.block_n == 128
    assert not c.gemm2.persistent and not c.gemm1.persistent
    assert bf16(128).block_m == 64 and bf16(100).block_m == 64  # 32 and 25 rows: the block above
    c = bf16(80)  # 20 rows
    assert c.block_m == 32 and (c.gemm1.block_k, c.gemm1.tail_m) == (128, 16) and c.gemm2.tma_a and c.gemm2.tma_weights
    c = bf16(32)  # 8 rows
    assert c.block_m == 16 and (c.gemm1.block_n, c.gemm1.block_k) == (32, 128) and c.gemm2.tma_weights
    assert c.gemm2.block_n == 64 and bf16(32, N=1024).gemm2.block_n == 128  # 128 columns for short reductions
    assert bf16(512, dtype=torch.float32).block_m == 64 and not bf16(512, dtype=torch.float32).gemm1.tma_weights
    assert bf16(128, quant="mxfp4").block_m == 32 and not bf16(512, quant="mxfp4").gemm2.persistent
    mx = bf16(512, quant="mxfp4")
    assert mx.block_m == 64 and mx.gemm1.group_m == 8 and not mx.gemm1.tma_weights
    assert bf16(512, quant="fp8_block").block_m == 64
    assert not any(configs.get_config(8192, 16, 1344, 6144, 4, torch.bfloat16, True, True, torch.device("cpu"),
                                      q).gemm1.persistent for q in ("mxfp4", "mxfp4_mma", "fp8_block"))


@pytest.mark.parametrize("M,N,quant,block_m,stages", [
    (8, 256, "none", 16, 3),  # qwen3-next-80b-a3b-tp2 (E 512, topk 10): 2 steps of 128
    (2048, 256, "none", 64, 3),  # 4 steps of 64
    (2048, 384, "none", 64, 3),  # 6 steps of 64
    (1024, 1024, "none", 32, 3),  # 8 steps of 128: the last short one
    (2048, 1024, "none", 64, 4),  # 16 steps of 64
    (8, 1408, "none", 16, 4),  # 11 steps of 128
    (8192, 256, "none", 128, 3),  # blocks of 128: the persistent gemm2's own 3 stages
    (8, 256, "fp8_block", 16, 3),
    (512, 1024, "fp8_block", 16, 3),
    (8, 2048, "fp8_block", 16, 4),  # DeepSeek-V3's N: 16 steps
])
def test_short_reduction_gemm2_stages(M, N, quant, block_m, stages):
    """The second GEMM of blocks of up to 64 rows runs a reduction of at most SHORT_REDUCTION_STEPS steps in 3
    stages, longer ones in 4 (16-bit weights and fp8 block; benchmarks/results/ab_gemm2_short_stages_h200.txt)."""
    c = configs.sanitize(configs.heuristic_config(M, 512, N, 2048, 10, torch.bfloat16, True, True, 132, quant),
                         torch.bfloat16, N, 2048, 10, quant=quant)
    assert c.path == "sorted" and c.block_m == block_m
    assert c.gemm2.num_stages == stages
    assert configs.SHORT_REDUCTION_STEPS == 8


@pytest.mark.parametrize("M,N,block_m,persistent", [
    (2048, 256, 64, True),  # qwen3-next-80b-a3b-tp2 (E 512, topk 10): 40 rows per expert, 4 steps of 64
    (1024, 256, 32, True),  # 20 rows per expert
    (1024, 192, 32, True),  # 3 steps of 64 (192 is no multiple of 128)
    (2048, 320, 64, False),  # 5 steps
    (2048, 384, 64, False),
    (512, 256, 16, False),  # blocks of 16: the tiled gemm2 (the persistent one was slower)
    (8192, 256, 128, True),  # blocks of 128: persistent whatever N
])
def test_persistent_gemm2_at_short_reductions(M, N, block_m, persistent):
    """16-bit weights at blocks of 32 and 64 rows run gemm2 as the persistent kernel (256 output columns on 8 warps,
    weights by TMA) where its reduction has at most 4 steps of 64 (N <= PERSISTENT_GEMM2_MAX_N); not at blocks of 16,
    nor for fp32 activations or the quantized formats (benchmarks/results/ab_gemm2_persistent_short_h200.txt)."""
    def config(quant="none", dtype=torch.bfloat16):
        return configs.sanitize(configs.heuristic_config(M, 512, N, 2048, 10, dtype, True, True, 132, quant),
                                dtype, N, 2048, 10, quant=quant)

    c = config()
    assert c.path == "sorted" and c.block_m == block_m
    assert c.gemm2.persistent == persistent
    if persistent:
        assert (c.gemm2.block_n, c.gemm2.num_warps, c.gemm2.tma_weights, c.gemm2.split_k) == (256, 8, True, 1)
    assert configs.PERSISTENT_GEMM2_MAX_N == 256
    assert not config(dtype=torch.float32).gemm2.persistent
    assert not any(config(q).gemm2.persistent for q in ("mxfp4", "mxfp4_mma", "fp8_block"))


@pytest.mark.parametrize("M,E,topk,quant,direct", [
    (1, 8, 2, "none", True),  # M = 1: always direct
    (2, 512, 10, "none", True),  # qwen3-next-80b-a3b-tp2 M = 2: direct 26.0 against 27.7 us
    (4, 512, 10, "none", False),  # M = 4: sorted 42.9 against 46.1
    (2, 256, 8, "none", False),  # deepseek-v3-tp4 M = 2: sorted 93.1 against 98.2
    (4, 128, 4, "none", False),  # gpt-oss-120b bf16 M = 4: sorted 184.6 against 186.8
    (4, 128, 4, "mxfp4_mma", True),  # gpt-oss-120b MXFP4 M = 4: direct 88.7 against 93.2
    (4, 256, 8, "fp8_block", True),
])
def test_use_direct_follows_the_measured_cells(M, E, topk, quant, direct):
    """The schedule rule at the cells of benchmarks/results/ab_direct_vs_sorted_h200.txt (H200)."""
    assert configs.use_direct(M, E, topk, quant) == direct
    assert configs.heuristic_config(M, E, 1024, 2048, topk, torch.bfloat16, True, True, 132,
                                    quant).path == ("direct" if direct else "sorted")


def test_direct_heuristic_second_gemv_rows():
    """The second GEMV's tile spans the slots: with many slots (qwen3-next-80b-a3b-tp2: E 512, topk 10, N 256) it
    takes two output rows of half the reduction, never one row; wider tiles keep their shape (gpt-oss-120b)."""
    c = configs.heuristic_config(1, 512, 256, 2048, 10, torch.bfloat16, True, True, 132)
    assert c.path == "direct" and (c.gemm2.block_n, c.gemm2.block_k) == (2, 128)
    c = configs.heuristic_config(1, 128, 2880, 2880, 4, torch.bfloat16, True, True, 132)
    assert c.path == "direct" and (c.gemm2.block_n, c.gemm2.block_k) == (4, 256)


def test_local_tokens_of_an_expert_parallel_shard(monkeypatch):
    """With an expert_map over more experts than the weights hold, the config is chosen for the tokens whose
    slots are as many as the local share of M's (uniform routing): M * E / E_global, at least 2 where the direct
    schedule's GEMVs are the FMA ones (also at M = 1: a shard takes the sorted schedule, not those, whose tiles span
    every slot), at least 1 where they are the tensor-core ones."""
    shard = torch.full((256,), -1, dtype=torch.int32)
    assert fe.local_tokens(4096, 32, None) == 4096 and fe.local_tokens(4096, 32, torch.arange(32)) == 4096
    assert fe.local_tokens(4096, 32, shard) == 512 and fe.local_tokens(100, 32, shard) == 12
    # floor 2 where the shard's direct schedule would run the FMA GEMVs (fp32 weights, MXFP4's checkpoint layout)
    assert fe.local_tokens(1, 32, shard, esize=4) == 2 and fe.local_tokens(8, 32, shard, esize=4) == 2
    assert fe.local_tokens(1, 32, shard, "mxfp4", 1) == 2
    # floor 1 where it runs the tensor-core GEMVs: the direct schedule for shards of few local tokens
    for quant, esize in (("fp8_block", 1), ("mxfp4_mma", 1)):
        assert [fe.local_tokens(m, 32, shard, quant, esize, 8) for m in (1, 8)] == [1, 1]
        assert fe.local_tokens(4096, 32, shard, quant, esize, 8) == 512
    # 16-bit dense weights up to 2 local pairs expected (topk 8 of 256 experts, 32 here: M / 4 pairs)
    assert [fe.local_tokens(m, 32, shard, "none", 2, 8) for m in (1, 2, 4, 8, 16, 4096)] == [1, 1, 2, 2, 2, 512]
    assert fe.local_tokens(1, 32, None) == 1
    asked = []
    monkeypatch.setattr(fe, "get_config", lambda M, *args: asked.append(M) or configs.get_config(M, *args))
    x = torch.zeros(64, 32, dtype=torch.bfloat16)
    w1 = torch.zeros(4, 32, 32, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 32, 16, dtype=torch.bfloat16)
    cfg = fe.select_config(64, x, fe.WeightOperand.of(w1), fe.WeightOperand.of(w2), 2, None, "none",
                           torch.full((32,), -1, dtype=torch.int32))
    assert asked == [8] and cfg == configs.get_config(8, 4, 16, 32, 2, torch.bfloat16, True, True, x.device)


def test_shard_direct_configs_run_the_tensor_core_gemvs():
    """DeepSeek-V3's shard of 32 of 256 experts in bf16 at M = 1 (one local pair expected): the heuristic's direct
    schedule on the tensor-core GEMVs, splits sized for that pair; the same shape without a shard keeps the FMA
    GEMVs. sanitize keeps ``dot`` for 16-bit dense direct configs (clamping their tiles to whole MMAs in 128-column
    steps that fit shared memory) and clears it elsewhere (the formats that always run those GEMVs take their tiles
    without it)."""
    dev = torch.device("cpu")
    shard = configs.get_config(1, 32, 2048, 7168, 8, torch.bfloat16, True, True, dev, local_pairs=1)
    assert shard == configs.sanitize(configs.dot_gemv_direct(1, 2048, 7168, 132, "none"), torch.bfloat16, 2048, 7168,
                                     8)
    assert shard.path == "direct" and shard.gemm1.dot and shard.gemm2.dot
    assert (shard.gemm1.block_n, shard.gemm1.block_k, shard.gemm1.split_k) == (64, 128, 8)
    assert (shard.gemm2.block_n, shard.gemm2.split_k) == (128, 4)
    plain = configs.get_config(1, 32, 2048, 7168, 8, torch.bfloat16, True, True, dev)
    assert plain.path == "direct" and not plain.gemm1.dot and not plain.gemm2.dot
    fp32 = configs.get_config(2, 32, 2048, 7168, 8, torch.float32, True, True, dev, local_pairs=2)
    assert not fp32.gemm1.dot and not fp32.gemm2.dot
    odd = MoeConfig("direct", 0, GemmConfig(8, 32, 8, 6, split_k=64, dot=True), GemmConfig(512, 16, 8, 6, dot=True))
    c = configs.sanitize(odd, torch.float16, 200, 72, 4)
    assert (c.gemm1.block_n, c.gemm1.block_k, c.gemm1.num_warps, c.gemm1.split_k) == (32, 128, 4, 1)
    assert (c.gemm2.block_n, c.gemm2.block_k, c.gemm2.num_warps, c.gemm2.split_k) == (256, 128, 8, 1)
    for g, rows in ((c.gemm1, 64), (c.gemm2, 256)):
        assert g.dot and configs.gemv_smem(g.num_stages, rows, "none") <= configs.SMEM_BUDGET
    assert not any(g.dot for g in (configs.sanitize(odd, torch.float32, 200, 72, 4).gemm1,
                                   configs.sanitize(dataclasses.replace(odd, path="sorted", block_m=16),
                                                    torch.float16, 200, 72, 4).gemm2))
    mma = configs.sanitize(odd, torch.bfloat16, 2880, 2880, 4, "mxfp4_mma")
    assert not mma.gemm1.dot and (mma.gemm1.block_n, mma.gemm1.block_k) == (64, 128)
    assert not configs.sanitize(odd, torch.bfloat16, 2880, 2880, 4, "mxfp4").gemm2.dot


def test_table_lookup(tmp_path, monkeypatch):
    """Tuned entries: nearest M bucket in log2; a direct entry never serves a larger M unsuited to it."""
    key = configs.table_key(8, 64, 32, 2, torch.bfloat16, True, True)
    direct = MoeConfig("direct", 0, GemmConfig(8, 64), GemmConfig(4, 64))
    sorted16 = MoeConfig("sorted", 16, GemmConfig(32, 64), GemmConfig(32, 64))
    sorted128 = MoeConfig("sorted", 128, GemmConfig(64, 64, 8, 3), GemmConfig(128, 64, 8, 3))
    table = {"device": "Fake GPU", "configs": {key: {"1": direct.to_json(), "16": sorted16.to_json(),
                                                     "4096": sorted128.to_json()}}}
    (tmp_path / f"{configs.device_slug('Fake GPU')}.json").write_text(json.dumps(table))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "_device_facts", lambda device: ("Fake GPU", 132))
    configs._load_table.cache_clear()
    configs.get_config.cache_clear()
    try:
        def get(M):
            return configs.get_config(M, 8, 64, 32, 2, torch.bfloat16, True, True, torch.device("cpu"))

        assert get(1) == configs.sanitize(direct, torch.bfloat16, 64, 32, 2)
        assert get(2).path == "sorted" and get(2).block_m == 16  # E = 8: M = 2 pairs share experts
        assert get(100).block_m == 16 and get(3000).block_m == 128
        other = configs.get_config(1, 8, 64, 32, 4, torch.bfloat16, True, True, torch.device("cpu"))
        assert other == configs.sanitize(configs.heuristic_config(1, 8, 64, 32, 4, torch.bfloat16, True, True),
                                         torch.bfloat16, 64, 32, 4)
    finally:
        configs._load_table.cache_clear()
        configs.get_config.cache_clear()


def test_config_json_roundtrip():
    cfg = MoeConfig("sorted", 64, GemmConfig(64, 64, 4, 4, 8, 1), GemmConfig(128, 64, 4, 3, 4, 2))
    assert MoeConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert dataclasses.asdict(cfg)["gemm2"]["split_k"] == 2
