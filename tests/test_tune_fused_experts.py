"""benchmarks/tune_fused_experts.py: one sorted-path cell tuned on the GPU from a cut-down candidate list.

The tuner times by CUDA-graph replay, so this runs on the GPU only. It checks that the sorted path's search
also times its second-GEMM winner with TMA rows as the persistent kernel (sm_90+), that the cell's winner is
a config ``sanitize`` leaves as it is, and that the winner computes the op (against the fp64 reference). Every
timing must be finite: the tuner reports a config that fails to compile or launch as inf and goes on.
"""

import sys
from pathlib import Path

import pytest
import torch

import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import fused_experts_triton
from moe_extension.kernels._configs import GemmConfig, sanitize
from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES
from tests.reference import assert_close, fused_experts_reference, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tune_fused_experts as tune  # noqa: E402


@pytest.mark.cuda
def test_sorted_cell_times_the_persistent_gemm2(monkeypatch):
    if not fe.tma_capable(torch.device("cuda")):
        pytest.skip("the persistent gemm2 needs sm_90+")
    E, topk, K, N, M = 8, 2, 256, 128, 512
    dtype = torch.bfloat16
    # One tile per GEMM; gemm2's already loads its rows by TMA, so every variant of it qualifies.
    monkeypatch.setattr(tune, "block_m_candidates", lambda M, E, topk: [64])
    monkeypatch.setattr(tune, "gemm1_candidates", lambda block_m: [GemmConfig(64, 64, 4, 3)])
    monkeypatch.setattr(tune, "gemm2_candidates",
                        lambda block_m, small: [GemmConfig(128, 64, 4, 3, tma_weights=True, tma_a=True)])
    launched = []
    real = fe._gemm2_persistent

    def spy(*args, **kwargs):
        launched.append(args[7])
        return real(*args, **kwargs)

    monkeypatch.setattr(fe, "_gemm2_persistent", spy)
    times = []
    time_us = tune.time_us
    monkeypatch.setattr(tune, "time_us", lambda fn, n: times.append(time_us(fn, n)) or times[-1])
    torch.manual_seed(0)
    w1, w2 = tune.make_weights(E, K, N, dtype, "linear")
    sets = tune.make_sets(E, topk, K, M, dtype, 2)
    t, cfg = tune.tune_cell(w1, w2, sets, E, topk, K, N, M, ACTIVATION_CODES[tune.ACTIVATION], True, True)
    assert launched and all(g.persistent and g.tail_m == 0 for g in launched)
    assert times and all(us < float("inf") for us in times), "time_us returns inf for a config that fails"
    assert t < float("inf") and sanitize(cfg, dtype, N, K, topk) == cfg
    x, g, ids = sets[0]
    out = fused_experts_triton(x, w1, w2, g, ids, tune.ACTIVATION, config=cfg)
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, tune.ACTIVATION), tolerance(dtype, "cuda"))
