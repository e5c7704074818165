"""benchmarks/tune_fused_experts.py: its options, the candidate lists of both weight formats, whole runs on tiny
shapes, and one sorted-path cell tuned on the GPU from a cut-down candidate list.

Anywhere: the options (``--quant``, the default models of each), the MXFP4 candidates (block_k 64 or 128, no
TMA weight tiles, TMA rows for gemm2 only, the H100's gpt-oss-120b tiles among them; each one as sanitize leaves
it), the MMA layout's candidates, the bf16 lists as before, the MXFP4 weights in both layouts, and whole runs of
``main`` on a tiny shape with the timings faked (the launches, the correctness check against the heuristic and the
table file real; on the GPU where there is one, else in Triton's interpreter): the MXFP4 runs (transposed views;
the MMA layout) write the ``,quant=mxfp4`` / ``,quant=mxfp4_mma`` keys and never ask about the persistent gemm2,
the dense run writes the key it always wrote; and the direct path's GEMVs on MXFP4 weights.

On the GPU only (the tuner times by CUDA-graph replay): the sorted path's search also times its second-GEMM
winner with TMA rows as the persistent kernel (sm_90+) and the heuristic's persistent tile, the cell's winner is a
config ``sanitize`` leaves as it is, and the winner computes the op (against the fp64 reference). Every timing must
be finite: the tuner reports a config that fails to compile or launch as inf and goes on.
"""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import moe_extension.kernels.fused_experts as fe
from moe_extension.kernels import fused_experts_triton
from moe_extension.kernels._configs import MXFP4_MMA_GEMM1_REGISTERS, GemmConfig, MoeConfig, sanitize, table_key
from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES
from moe_extension.kernels._weight_formats import WeightOperand
from moe_extension.ops import fused_experts_torch
from tests.reference import assert_close, fused_experts_reference, tolerance
from tests.utils import record_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tune_fused_experts as tune  # noqa: E402

# The runs of the tuner on tiny shapes: on the GPU where there is one, else in Triton's interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_MODELS = ["gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"]
# gpt-oss-120b's MXFP4 tiles that measured best on an H100 (GemmConfig(block_n, block_k, num_warps, num_stages))
H100_MXFP4_TILES = {
    16: ([(64, 64, 2, 4), (64, 64, 4, 4), (32, 64, 4, 4), (64, 128, 4, 3)],
         [(128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 2, 4)]),
    64: ([(64, 64, 4, 4), (128, 64, 4, 3), (64, 64, 8, 4), (128, 64, 8, 3)],
         [(128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 4, 3), (128, 64, 8, 4)]),
    128: ([(128, 64, 8, 3), (64, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 4)],
          [(256, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (256, 64, 4, 3)]),
}


def _tile(g):
    return g.block_n, g.block_k, g.num_warps, g.num_stages


def test_options_quant_and_default_models():
    args = tune.parse_args([])
    assert (args.quant, args.models, args.weight_layout, args.dtype) == ("none", BF16_MODELS, "linear", "bfloat16")
    assert tune.MODELS["gpt-oss-20b"] == dict(E=32, topk=4, K=2880, N=2880)
    args = tune.parse_args(["--quant", "mxfp4"])
    assert (args.quant, args.models) == ("mxfp4", ["gpt-oss-120b", "gpt-oss-20b"])
    args = tune.parse_args(["--quant", "mxfp4", "--models", "qwen3-30b-a3b", "--weight-layout", "transposed",
                            "--shape", "8", "2", "64", "96"])
    assert (args.models, args.weight_layout, args.shape) == (["qwen3-30b-a3b"], "transposed", [[8, 2, 64, 96]])
    assert tune.parse_args(["--models", "gpt-oss-20b"]).models == ["gpt-oss-20b"]
    assert tune.parse_args(["--quant", "fp8_block"]).models == ["deepseek-v3"]
    assert tune.parse_args(["--quant", "mxfp4_mma"]).models == ["gpt-oss-120b", "gpt-oss-20b"]
    assert tune.MODELS["deepseek-v3"] == dict(E=256, topk=8, K=7168, N=2048)
    for argv in (["--quant", "int4"], ["--quant", "mxfp4", "--shape", "8", "2", "64", "40"],
                 ["--models", "gpt-oss-7b"], ["--quant", "mxfp4_mma", "--shape", "8", "2", "64", "96"],
                 ["--quant", "mxfp4_mma", "--weight-layout", "transposed"]):
        with pytest.raises(SystemExit):
            tune.parse_args(argv)


@pytest.mark.parametrize("M, E, want", [
    (1024, 128, [16, 32, 64]),  # 32 rows per expert: the nearest block, the one below and the one above
    (2048, 512, [16, 32, 64]),  # 40 rows (qwen3-next's E 512, topk 10 below: the same rows)
    (4096, 32, [64, 128]),  # 512 rows: no block above 128
    (64, 128, [16]),  # a few rows per expert: the smallest block only
])
def test_block_m_candidates(M, E, want):
    assert tune.block_m_candidates(M, E, 4 if E != 512 else 10) == want


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("small", [False, True])
def test_mxfp4_candidates(block_m, small):
    g1s, g2s = tune.sorted_candidates(block_m, small, torch.bfloat16, 2880, 2880, "mxfp4")
    for gs, which in ((g1s, "gemm1"), (g2s, "gemm2")):
        assert gs and len(set(gs)) == len(gs)
        assert all(g.block_k in (64, 128) and not g.tma_weights and not g.persistent for g in gs)
        for g in gs:  # sanitize for MXFP4 keeps every candidate as it is
            cfg = MoeConfig("sorted", block_m, g, g)
            assert getattr(sanitize(cfg, torch.bfloat16, 2880, 2880, 4, "mxfp4"), which) == g
    for gs in (g1s, g2s):  # each tile with pointer-gathered and with TMA-loaded A rows
        assert {g for g in gs if g.tma_a} == {dataclasses.replace(g, tma_a=True) for g in gs if not g.tma_a}
    want1, want2 = H100_MXFP4_TILES[16 if block_m <= 32 else block_m]  # block_m 32 takes block_m 16's tiles
    assert set(want1) <= {_tile(g) for g in g1s} and set(want2) <= {_tile(g) for g in g2s}
    assert any(g.split_k > 1 for g in g2s) == (small and block_m <= 32)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("small", [False, True])
def test_mxfp4_mma_candidates(block_m, small):
    """The MMA layout: 128-column steps, at least 128 weight rows per tile (32 per warp), pointer loads of the
    weights; each candidate as sanitize leaves it."""
    g1s, g2s = tune.sorted_candidates(block_m, small, torch.bfloat16, 2880, 2880, "mxfp4_mma")
    for gs, which, rows in ((g1s, "gemm1", 2), (g2s, "gemm2", 1)):
        assert gs and len(set(gs)) == len(gs)
        assert all(g.block_k == 128 and rows * g.block_n >= 128 and not g.tma_weights and not g.persistent
                   and rows * g.block_n >= 32 * g.num_warps for g in gs)
        for g in gs:
            cfg = MoeConfig("sorted", block_m, g, g)
            assert getattr(sanitize(cfg, torch.bfloat16, 2880, 2880, 4, "mxfp4_mma"), which) == g
    for gs in (g1s, g2s):  # each tile with pointer-gathered and with TMA-loaded A rows
        assert {g for g in gs if g.tma_a} == {dataclasses.replace(g, tma_a=True) for g in gs if not g.tma_a}
    assert any(g.split_k > 1 for g in g2s) == (small and block_m <= 32)
    # the heuristic's register cap of the first GEMM at blocks of 64, with and without TMA rows, and only there
    capped = {(g.block_n, g.num_warps, g.max_registers) for g in g1s if g.max_registers}
    assert capped == ({(64, 4, MXFP4_MMA_GEMM1_REGISTERS)} if block_m == 64 else set())
    assert not any(g.max_registers for g in g2s)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("small", [False, True])
def test_fp8_candidates(block_m, small):
    """fp8 block: 128-column steps and outputs, at most 64 rows per block, every TMA combination; each candidate
    as sanitize leaves it (sanitize caps block_m 128 to 64: the tuner times 64 then)."""
    bm = min(block_m, 64)
    g1s, g2s = tune.sorted_candidates(bm, small, torch.bfloat16, 2048, 7168, "fp8_block")
    for gs, which in ((g1s, "gemm1"), (g2s, "gemm2")):
        assert gs and len(set(gs)) == len(gs)
        assert all(g.block_k == 128 and g.block_n % 128 == 0 and not g.persistent for g in gs)
        assert {(g.tma_weights, g.tma_a) for g in gs} == {(w, a) for w in (False, True) for a in (False, True)}
        for g in gs:
            cfg = MoeConfig("sorted", bm, g, g)
            assert getattr(sanitize(cfg, torch.bfloat16, 2048, 7168, 8, "fp8_block"), which) == g
    assert any(g.split_k > 1 for g in g2s) == small


@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_fp8_weights_layouts(monkeypatch, layout):
    from moe_extension.quant import dequantize_fp8_block

    monkeypatch.setattr(tune, "DEVICE", DEVICE)
    torch.manual_seed(0)
    w1, w2 = tune.make_fp8_weights(3, 300, 200, layout)  # scales of 2+ blocks each way: layouts tell apart
    for w, (rows, cols) in ((w1, (400, 300)), (w2, (300, 200))):
        assert isinstance(w, WeightOperand) and w.shape == (3, rows, cols) and tune.weight_quant(w) == "fp8_block"
        assert w.w.dtype == torch.float8_e4m3fn and w.scale.shape == (3, -(-rows // 128), -(-cols // 128))
        assert w.w.is_contiguous() == (layout == "linear")
        assert w.w.transpose(1, 2).is_contiguous() == w.scale.transpose(1, 2).is_contiguous() == (layout != "linear")
        values = dequantize_fp8_block(w.w, w.scale)
        assert bool(values.isfinite().all()) and 0.4 < float(values.std() * cols ** 0.5) < 2.5


def test_with_tma_of_mxfp4():
    tiles = [GemmConfig(64, 64, 4, 4), GemmConfig(128, 128, 8, 3)]
    want = [tiles[0], dataclasses.replace(tiles[0], tma_a=True), tiles[1], dataclasses.replace(tiles[1], tma_a=True)]
    for quant in ("mxfp4", "mxfp4_mma"):  # TMA rows only (the weights are decoded in registers), gemm1 too
        assert tune.with_tma(tiles, weights_only=True, quant=quant) == want
        assert tune.with_tma(tiles, quant=quant) == want


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_bf16_candidates_as_before(block_m):
    """The default run's lists: each tile with pointer and with TMA loads (gemm1 also TMA weights alone)."""
    def before(gs, which):
        return [getattr(sanitize(MoeConfig("sorted", block_m, g, g), torch.bfloat16, 768, 2048), which) for g in gs]

    g1s, g2s = tune.sorted_candidates(block_m, True, torch.bfloat16, 768, 2048)
    assert g1s == before(tune.with_tma(tune.gemm1_candidates(block_m), weights_only=True), "gemm1")
    assert g2s == before(tune.with_tma(tune.gemm2_candidates(block_m, True)), "gemm2")
    assert len(g1s) == 3 * len(tune.gemm1_candidates(block_m))
    assert len(g2s) == 2 * len(tune.gemm2_candidates(block_m, True))
    assert any(g.tma_weights and not g.tma_a for g in g1s)


@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_mxfp4_weights_layouts(monkeypatch, layout):
    from moe_extension.quant import dequantize_mxfp4

    monkeypatch.setattr(tune, "DEVICE", DEVICE)
    monkeypatch.setattr(tune, "MXFP4_QUANTIZE_CHUNK", 2)  # 3 experts: uneven chunks
    torch.manual_seed(0)
    w1, w2 = tune.make_mxfp4_weights(3, 64, 96, layout)
    for w, shape in ((w1, (3, 192, 64)), (w2, (3, 64, 96))):
        assert isinstance(w, WeightOperand) and w.shape == shape and tune.weight_quant(w) == "mxfp4"
        assert w.w.shape == (3, shape[1], shape[2] // 2) and w.scale.shape == (3, shape[1], shape[2] // 32)
        for t in (w.w, w.scale):
            assert t.dtype == torch.uint8
            # 'transposed': views of [E, cols, rows] storage, as the benchmark's vLLM layout
            assert t.is_contiguous() == (layout == "linear")
            assert t.transpose(1, 2).is_contiguous() == (layout == "transposed")
        values = dequantize_mxfp4(w.w, w.scale)
        assert bool(values.isfinite().all()) and 0.5 < float(values.std() * shape[2] ** 0.5) < 2.0
    x, g, ids = tune.make_sets(3, 2, 64, 5, torch.bfloat16, 1)[0]
    d1, d2, kw = tune.fused_call_args(w1, w2)
    assert (d1, d2) == (w1.w, w2.w) and kw == dict(quant="mxfp4", w1_scale=w1.scale, w2_scale=w2.scale)
    assert tune.fused_call_args(d1, d2) == (d1, d2, {}) and tune.weight_quant(d1) == "none"


@pytest.fixture
def fake_gpu(monkeypatch):
    """The tuner on DEVICE (on the CPU Triton's interpreter runs every launch); time_us calls fn and fakes the
    timing."""
    monkeypatch.setattr(tune, "DEVICE", DEVICE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    timed = []

    def time_us(fn, n):
        for i in range(2):
            fn(i)
        timed.append(fn)
        return 10.0

    monkeypatch.setattr(tune, "time_us", time_us)
    return timed


# One tile each: the interpreter takes 0.1-0.2 s per launch of these tiles (the GEMVs of the direct path take
# seconds, so the runs tune M = 16: the sorted path only).
ONE_TILE = dict(mxfp4_gemm1_candidates=lambda block_m: [GemmConfig(32, 64, 4, 3)],
                mxfp4_mma_gemm1_candidates=lambda block_m: [GemmConfig(64, 128, 4, 2)],
                mxfp4_mma_gemm2_candidates=lambda block_m, small: [GemmConfig(128, 128, 4, 2)],
                mxfp4_gemm2_candidates=lambda block_m, small: [GemmConfig(32, 64, 4, 3)],
                gemm1_candidates=lambda block_m: [GemmConfig(32, 32, 4, 3)],
                gemm2_candidates=lambda block_m, small: [GemmConfig(32, 32, 4, 3)],
                fp8_gemm1_candidates=lambda block_m: [GemmConfig(128, 128, 4, 2)],
                fp8_gemm2_candidates=lambda block_m, small: [GemmConfig(128, 128, 4, 2)])


@pytest.mark.parametrize("quant, layout", [("mxfp4", "transposed"), ("mxfp4_mma", "linear"), ("none", "linear"),
                                           ("fp8_block", "linear")])
def test_run_writes_the_key_of_the_format(fake_gpu, monkeypatch, tmp_path, capsys, quant, layout):
    # fp16 for the dense and fp8 runs: the interpreter's bf16 dot is wrong (MXFP4 multiplies in fp32 there)
    dtype = torch.bfloat16 if quant.startswith("mxfp4") else torch.float16
    for name, fn in ONE_TILE.items():
        monkeypatch.setattr(tune, name, fn)
    weights = []
    maker = {"mxfp4": "make_mxfp4_weights", "mxfp4_mma": "make_mxfp4_weights",
             "fp8_block": "make_fp8_weights"}.get(quant, "make_weights")
    make = getattr(tune, maker)
    monkeypatch.setattr(tune, maker, lambda *a: weights.append(make(*a)) or weights[-1])
    persistent_asked = []
    real_ok = fe._persistent_gemm2_ok
    monkeypatch.setattr(fe, "_persistent_gemm2_ok", lambda *a: persistent_asked.append(a) or real_ok(*a))
    E, topk, K, N = 4, 2, 64, 64
    monkeypatch.setattr(tune, "MODELS", {"tiny": dict(E=E, topk=topk, K=K, N=N)})
    argv = ["--quant", quant, "--models", "tiny", "--tokens", "16", "--weight-layout", layout, "--sets", "2",
            "--dtype", str(dtype).removeprefix("torch."), "--out", str(tmp_path)]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "REJECTED" not in out and "skipped" not in out
    linear = layout == "linear"
    key = table_key(E, N, K, topk, dtype, linear, linear, quant)
    assert key.endswith(f",quant={quant}") == (quant != "none")
    table = json.loads((tmp_path / "Fake_GPU.json").read_text())
    assert list(table["configs"]) == [key] and list(table["configs"][key]) == ["16"]
    cfg = MoeConfig.from_json(table["configs"][key]["16"])
    assert cfg.path == "sorted" and sanitize(cfg, dtype, N, K, topk, quant) == cfg
    ((w1, w2),) = weights
    if quant != "none":
        assert not persistent_asked, "the persistent gemm2 is not asked about quantized weights"
        assert isinstance(w1, WeightOperand) and w1.w.stride(2) == (1 if linear else 2 * N)
    else:
        assert persistent_asked
    # the tuned config computes the op on these weights
    torch.manual_seed(1)
    x, g, ids = tune.make_sets(E, topk, K, 16, dtype, 1)[0]
    d1, d2, kw = tune.fused_call_args(w1, w2)
    out = fused_experts_triton(x, d1, d2, g, ids, tune.ACTIVATION, config=cfg, **kw)
    ref = fused_experts_torch(x, d1, d2, g, ids, tune.ACTIVATION, **kw).cpu()
    assert_close(out, ref, tolerance(dtype, DEVICE))


@pytest.mark.parametrize("quant, tiles, K, N", [
    ("mxfp4", ([GemmConfig(64, 32, 4, 4)], [GemmConfig(8, 64, 4, 4)]), 64, 64),
    ("mxfp4_mma", ([GemmConfig(64, 128, 4, 2, group_m=0, split_k=2)],
                   [GemmConfig(128, 128, 4, 2, group_m=0, split_k=2)]), 256, 256),
    ("fp8_block", ([GemmConfig(128, 128, 4, 2, group_m=0, split_k=2)],
                   [GemmConfig(64, 128, 4, 2, group_m=0, split_k=2)]), 256, 256),
])
def test_quantized_direct_path(fake_gpu, monkeypatch, quant, tiles, K, N):
    """The GEMVs of the direct path on quantized operands (one wide tile each, sanitized for the format; the
    tensor-core GEMVs of the MMA layout and of fp8 block with split reductions), tuned and checked."""
    monkeypatch.setattr(tune, "direct_candidates", lambda heur, quant: tiles)
    E, topk, M = 4, 2, 1
    # fp16 for fp8 block: the interpreter's bf16 dot is wrong (MXFP4 multiplies in fp32 there)
    dtype = torch.float16 if quant == "fp8_block" else torch.bfloat16
    torch.manual_seed(0)
    if quant == "fp8_block":
        w1, w2 = tune.make_fp8_weights(E, K, N, "linear")
    else:
        w1, w2 = tune.make_mxfp4_weights(E, K, N, "linear", quant)
    sets = tune.make_sets(E, topk, K, M, dtype, 2)
    t, cfg = tune.tune_direct(w1, w2, sets, E, topk, K, N, M, ACTIVATION_CODES[tune.ACTIVATION], True, True)
    assert t == 20.0 and cfg.path == "direct" and len(fake_gpu) == 2
    assert sanitize(cfg, dtype, N, K, topk, quant) == cfg
    x, g, ids = sets[0]
    d1, d2, kw = tune.fused_call_args(w1, w2)
    out = fused_experts_triton(x, d1, d2, g, ids, tune.ACTIVATION, config=cfg, **kw)
    ref = fused_experts_torch(x, d1, d2, g, ids, tune.ACTIVATION, **kw).cpu()
    assert_close(out, ref, tolerance(dtype, DEVICE))


@pytest.mark.parametrize("quant, E, K, N, topk", [("mxfp4_mma", 128, 2880, 2880, 4), ("fp8_block", 256, 7168, 2048, 8)])
def test_tensor_core_direct_candidates(quant, E, K, N, topk):
    """The tensor-core GEMVs' direct candidates: the heuristic's GEMVs first, split reductions halved and doubled, one
    more stage, 256 weight rows on 8 warps; each as sanitize leaves it (the tiles the GPU suites check)."""
    from moe_extension.kernels._configs import heuristic_config

    heur = heuristic_config(1, E, N, K, topk, torch.bfloat16, True, True, 132, quant)
    assert heur.path == "direct"
    g1s, g2s = tune.direct_candidates(heur, quant)
    for gs, first, which in ((g1s, heur.gemm1, "gemm1"), (g2s, heur.gemm2, "gemm2")):
        assert gs[0] == first and len(set(gs)) == len(gs)
        assert {g.split_k for g in gs} >= {max(1, first.split_k // 2), first.split_k, 2 * first.split_k}
        rows_per_column = 2 if which == "gemm1" else 1  # gemm1's tiles hold gate and up rows
        assert any(g.num_warps == 8 and g.block_n * rows_per_column == 256 for g in gs)
        for g in gs:
            cfg = sanitize(MoeConfig("direct", 0, g, g), torch.bfloat16, N, K, topk, quant)
            assert getattr(cfg, which) == g


@pytest.mark.cuda
def test_sorted_cell_times_the_persistent_gemms(monkeypatch):
    """The tuner times its GEMM winners as persistent kernels too (gemm1's: TMA weight tiles), gemm2 also in the
    heuristic's persistent tile (256 output columns on 8 warps)."""
    if not fe.tma_capable(torch.device("cuda")):
        pytest.skip("the persistent gemm2 needs sm_90+")
    E, topk, K, N, M = 8, 2, 256, 128, 512
    dtype = torch.bfloat16
    # One tile per GEMM; gemm2's already loads its rows by TMA, so every variant of it qualifies.
    monkeypatch.setattr(tune, "block_m_candidates", lambda M, E, topk: [64])
    monkeypatch.setattr(tune, "gemm1_candidates", lambda block_m: [GemmConfig(64, 64, 4, 3, tma_weights=True)])
    gemm1_runs = record_results(monkeypatch, fe, "_persistent_gemm1_ok")
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
    assert {(g.block_n, g.num_warps) for g in launched} == {(128, 4), (256, 8)}, "the winner's tile and the wide one"
    assert any(gemm1_runs) and not all(gemm1_runs), "gemm1 timed tiled and persistent"
    assert times and all(us < float("inf") for us in times), "time_us returns inf for a config that fails"
    assert t < float("inf") and sanitize(cfg, dtype, N, K, topk) == cfg
    x, g, ids = sets[0]
    out = fused_experts_triton(x, w1, w2, g, ids, tune.ACTIVATION, config=cfg)
    assert_close(out, fused_experts_reference(x, w1, w2, g, ids, tune.ACTIVATION), tolerance(dtype, "cuda"))
