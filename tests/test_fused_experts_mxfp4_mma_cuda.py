"""GPU suite of MXFP4 in the MMA layout (``quant="mxfp4_mma"``, weights from ``prepare_mxfp4_mma``): the MXFP4
matrix's cases whose shapes the layout takes (K and N multiples of 64) against the PyTorch implementation on the
checkpoint layout (rel err <= 1e-2) and against ``quant="mxfp4"``'s kernels; wide scales and a NaN scale; the
unfused GEMMs; every tile shape the layout's tile rule admits; CUDA-graph capture of every entry point with 12
changed-input replays bitwise equal to eager; determinism. Skips without CUDA (the CPU side: tests/test_kernels_mxfp4_mma.py)."""

import pytest
import torch

from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton, fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, MoeConfig, sanitize
from moe_extension.ops.expert_gemm import expert_gemm1_torch, expert_gemm2_torch
from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma
from tests.reference import random_expert_map
from tests.test_fused_experts_cuda import _routing
from tests.test_fused_experts_mxfp4_cuda import (CASES, GRAPH_SHAPE, TOL, _case_id, _experts, _fused, _fused_reference,
                                                 _local, _params, _per_column_rel_err, _wide_scales)
from tests.utils import assert_graph_replays_match_eager, entry_point_call, entry_point_inputs, rel_err

cuda = pytest.mark.cuda
MMA_CASES = [c for c in CASES if c["K"] % 64 == 0 and c["N"] % 64 == 0]


def _prepared(w1, s1, w2, s2):
    return (*prepare_mxfp4_mma(w1, s1), *prepare_mxfp4_mma(w2, s2))


def test_cases_cover_decode_and_prefill():
    ms = {c["M"] for c in MMA_CASES}
    assert len(MMA_CASES) >= 15 and 1 in ms and max(ms) >= 1000


@cuda
@pytest.mark.parametrize("c", _params(MMA_CASES), ids=_case_id)
def test_fused_experts_matrix(c):
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    M, topk, E, K, N, dtype = c["M"], c["topk"], c["E"], c["K"], c["N"], c["dtype"]
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=c["bias"], transposed=c["transposed"])
    q1, t1, q2, t2 = _prepared(w1, s1, w2, s2)
    e_ids = E + 3 if c["emap"] else E
    g, ids = _routing(M, e_ids, topk, c["invalid"], gen)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    kw = dict(w1_bias=b1, w2_bias=b2, apply_router_weight_on_input=c["on_input"],
              expert_map=random_expert_map(e_ids, E, device="cuda") if c["emap"] else None)
    out = torch.ops.moe_ext.fused_experts(x, q1, q2, g, ids, c["act"], quant="mxfp4_mma", w1_scale=t1, w2_scale=t2,
                                          **kw)
    torch.cuda.synchronize()
    assert out.shape == (M, K) and out.dtype == dtype and out.isfinite().all()
    ref = _fused_reference(x, w1, s1, w2, s2, g, ids, c["act"], **kw)
    assert rel_err(out, ref) <= TOL
    assert rel_err(out, _fused(x, w1, s1, w2, s2, g, ids, c["act"], **kw)) <= TOL
    dead = (_local(ids, kw["expert_map"], E) < 0).all(dim=1)
    assert (out[dead] == 0).all()


@cuda
@pytest.mark.parametrize("M", [1, 200])
def test_scales_from_2e_minus_20_to_2e20_and_nan(M):
    gen = torch.Generator(device="cuda").manual_seed(M)
    E, K, N, topk = 4, 256, 128, 2
    w1, s1, w2, s2, _, _ = _experts(E, K, N, gen, scales=_wide_scales)
    s1[1, 5, 2] = 255
    q1, t1, q2, t2 = _prepared(w1, s1, w2, s2)
    g, ids = _routing(M, E, topk, False, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.ops.moe_ext.expert_gemm1(x, q1, ids, quant="mxfp4_mma", w1_scale=t1)
    ref_h = expert_gemm1_torch(x.float(), w1, ids, quant="mxfp4", w1_scale=s1)
    assert torch.equal(h.isnan(), ref_h.isnan()), "the NaN scale gives NaN exactly in its outputs"
    fin = ref_h.isfinite()
    assert rel_err(h.float()[fin], ref_h[fin]) <= TOL
    a = torch.randn(M, topk, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.ops.moe_ext.expert_gemm2(a, q2, ids, topk_weights=g, quant="mxfp4_mma", w2_scale=t2)
    ref_y = expert_gemm2_torch(a.float(), w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2)
    assert rel_err(y, ref_y) <= TOL
    # per output column (weight row), so that rows of small scales count as much as those of large ones
    assert _per_column_rel_err(h.nan_to_num(0.0), ref_h.nan_to_num(0.0)) <= TOL
    assert _per_column_rel_err(y, ref_y) <= TOL


@cuda
@pytest.mark.parametrize("op", ("fused_experts", "fused_moe", "expert_gemm1", "expert_gemm2"))
@pytest.mark.parametrize("M", [1, 8, 64, 512])
def test_cuda_graph_replays_match_eager(op, M):
    gen = torch.Generator(device="cuda").manual_seed(M + 1)
    E, topk, K, N = GRAPH_SHAPE["E"], GRAPH_SHAPE["topk"], GRAPH_SHAPE["K"], GRAPH_SHAPE["N"]
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    emap = random_expert_map(E + 2, E, device="cuda")
    call = entry_point_call(op, "mxfp4_mma", "swigluoai", topk, (*_prepared(w1, s1, w2, s2), b1, b2), emap)

    def fresh():
        return entry_point_inputs(op, M, E, topk, K, N, _routing, gen)

    assert_graph_replays_match_eager(call, fresh(), fresh, finite=True)


def _admitted_tiles():
    """One config per tile shape that ``mxfp4_mma_tiles`` admits (each as sanitize leaves it): gemm1 of 64 or 128
    columns (128 / 256 fused rows) on 4 or 8 warps, gemm2 of 128 or 256 rows on 4 or 8 warps, split or not; in the
    sorted schedule and in the direct one (both reductions split or not); and the heuristic's tiles of one-block cells
    (``MXFP4_MMA_ONE_BLOCK_TAIL``) and of large layers (``MXFP4_MMA_WIDE_N``: TMA rows, tail tiles, gemm1's register
    cap and 2 stages)."""
    g1s = [GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 4, 3), GemmConfig(128, 128, 8, 3)]
    g2s = [GemmConfig(128, 128, 4, 3), GemmConfig(256, 128, 4, 3), GemmConfig(256, 128, 8, 3),
           GemmConfig(128, 128, 4, 3, split_k=2)]
    direct = [(GemmConfig(64, 128, 4, 3, group_m=0), GemmConfig(128, 128, 4, 3, group_m=0)),
              (GemmConfig(64, 128, 4, 4, group_m=0, split_k=3), GemmConfig(128, 128, 4, 4, group_m=0, split_k=2)),
              (GemmConfig(128, 128, 8, 3, group_m=0, split_k=2), GemmConfig(256, 128, 8, 3, group_m=0, split_k=2)),
              (GemmConfig(128, 128, 4, 3, group_m=0, split_k=4), GemmConfig(256, 128, 4, 3, group_m=0, split_k=2))]
    large = [MoeConfig("sorted", 64, GemmConfig(64, 128, 4, 3, tma_a=True, tail_m=32, max_registers=168),
                       GemmConfig(128, 128, 4, 3, tma_a=True, tail_m=32)),
             MoeConfig("sorted", 64, GemmConfig(64, 128, 4, 3, tma_a=True, tail_m=16, max_registers=168),
                       GemmConfig(128, 128, 4, 3, tma_a=True, tail_m=32)),
             MoeConfig("sorted", 128, GemmConfig(64, 128, 4, 2, group_m=0, tma_a=True, tail_m=16),
                       GemmConfig(128, 128, 4, 3, tail_m=16))]
    return ([MoeConfig("sorted", bm, g1, g2) for bm in (16, 64) for g1, g2 in zip(g1s + g1s[:1], g2s)]
            + [MoeConfig("direct", 0, g1, g2) for g1, g2 in direct] + large)


@cuda
@pytest.mark.parametrize("cfg", _admitted_tiles(), ids=lambda c: f"{c.path}-bm{c.block_m}-g1_{c.gemm1.block_n}w"
                         f"{c.gemm1.num_warps}s{c.gemm1.split_k}-g2_{c.gemm2.block_n}w{c.gemm2.num_warps}"
                         f"s{c.gemm2.split_k}")
@pytest.mark.parametrize("act", ["swigluoai", "swiglustep"])
def test_every_admitted_tile(cfg, act):
    """Every tile shape the MMA layout's rule admits, fused (interleaved and split gate/up rows) and unfused
    (gemm1's tiles then hold block_n rows), against the PyTorch implementation."""
    E, topk, K, N, M = 8, 2, 512, 256, 96
    assert sanitize(cfg, torch.bfloat16, N, K, topk, quant="mxfp4_mma") == cfg
    gen = torch.Generator(device="cuda").manual_seed(cfg.gemm1.block_n + cfg.gemm2.block_n + cfg.block_m)
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    q1, t1, q2, t2 = _prepared(w1, s1, w2, s2)
    g, ids = _routing(M, E, topk, True, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = fused_experts_triton(x, q1, q2, g, ids, act, w1_bias=b1, w2_bias=b2, quant="mxfp4_mma", w1_scale=t1,
                               w2_scale=t2, config=cfg)
    assert rel_err(out, _fused_reference(x, w1, s1, w2, s2, g, ids, act, w1_bias=b1, w2_bias=b2)) <= TOL
    h = expert_gemm1_triton(x, q1, ids, quant="mxfp4_mma", w1_scale=t1, config=cfg)
    assert _per_column_rel_err(h, expert_gemm1_torch(x.float(), w1, ids, quant="mxfp4", w1_scale=s1)) <= TOL
    a = torch.randn(M, topk, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = expert_gemm2_triton(a, q2, ids, topk_weights=g, quant="mxfp4_mma", w2_scale=t2, config=cfg)
    ref_y = expert_gemm2_torch(a.float(), w2, ids, topk_weights=g, quant="mxfp4", w2_scale=s2)
    assert rel_err(y, ref_y) <= TOL


@cuda
def test_deterministic_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(9)
    E, K, N = 32, 2048, 768
    w1, s1, w2, s2, b1, b2 = _experts(E, K, N, gen, bias=True)
    q1, t1, q2, t2 = _prepared(w1, s1, w2, s2)
    for M in (1, 1000):
        g, ids = _routing(M, E, 4, True, gen)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        first, second = (torch.ops.moe_ext.fused_experts(x, q1, q2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2,
                                                         quant="mxfp4_mma", w1_scale=t1, w2_scale=t2)
                         for _ in range(2))
        assert first.isfinite().all() and torch.equal(first, second)
