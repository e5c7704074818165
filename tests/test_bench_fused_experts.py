"""benchmarks/bench_fused_experts.py and plot_fused_experts.py without a GPU: the options, the MXFP4 summary and
its targets, and whole runs of both quants on tiny models on the CPU through a fake harness (timings faked; the
correctness checks, floors and JSON files real), then the chart of a result."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_extension.backends import triton_kernels as tk_backend
from moe_extension.ops import fused_experts_torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_fused_experts as bench  # noqa: E402
import harness  # noqa: E402
import plot_fused_experts as plot  # noqa: E402

FAKE_US = 7.0


def test_quant_option_picks_the_model_table():
    args = bench.parse_args([])
    assert (args.quant, args.models, args.bias) == ("none", list(bench.MODELS), False)
    args = bench.parse_args(["--quant", "mxfp4"])
    assert args.models == ["gpt-oss-120b", "gpt-oss-20b"] and not args.bias
    args = bench.parse_args(["--quant", "mxfp4", "--models", "gpt-oss-20b", "--bias", "--tokens", "1", "4096"])
    assert (args.models, args.bias, args.tokens) == (["gpt-oss-20b"], True, [1, 4096])
    args = bench.parse_args(["--quant", "mxfp4", "--models", "gpt-oss-120b-tp4", "gpt-oss-120b-tp8"])
    assert args.models == ["gpt-oss-120b-tp4", "gpt-oss-120b-tp8"]  # the shards: on request only
    for argv in (["--models", "gpt-oss-20b"], ["--quant", "mxfp4", "--models", "qwen3-30b-a3b"], ["--bias"],
                 ["--quant", "int4"], ["--models", "gpt-oss-120b-tp4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def _row(model, m, ours, tk, floor=10.0):
    return dict(model=model, M=m, floor_us=floor, ours_us=ours, triton_kernels_us=tk, ours_bf16_us=20.0)


def test_mxfp4_summary_and_targets():
    rows = [_row("a", 1, 15.0, 16.0), _row("a", 64, 11.0, 11.0), _row("b", 1, 17.0, 30.0), _row("b", 64, 11.0, 14.0)]
    s = bench.summarize_mxfp4(rows)
    assert (s["cells"], s["ours_timed"], s["ours_le_triton_kernels"], s["compared_with_triton_kernels"]) == (4, 4, 4, 4)
    assert s["geomean_ours_over_floor"] == pytest.approx(math.prod([1.5, 1.1, 1.7, 1.1]) ** 0.25)  # 1.325
    assert s["m1_ours_over_floor"] == {"a": 1.5, "b": 1.7} and s["max_m1_ours_over_floor"] == 1.7
    assert s["geomean_ours_bf16_over_floor"] == pytest.approx(2.0)
    assert s["targets_met"] == dict(ours_le_triton_kernels=True, geomean_ours_over_floor=True, m1_ours_over_floor=True)
    # a lost cell, a null cell and an M = 1 cell above 1.8x: no target is met by default
    rows = [_row("a", 1, 19.0, 16.0), _row("a", 64, None, 12.0), _row("b", 1, 11.0, None)]
    s = bench.summarize_mxfp4(rows)
    assert s["ours_le_triton_kernels"] == 0 and s["compared_with_triton_kernels"] == 1
    assert s["targets_met"] == dict(ours_le_triton_kernels=False, geomean_ours_over_floor=False,
                                    m1_ours_over_floor=False)
    assert bench.summarize_mxfp4([_row("a", 16, 11.0, 12.0)])["targets_met"]["m1_ours_over_floor"] is None


def test_summary_compares_a_faster_triton_kernels_round_by_round():
    lost, won = _row("a", 64, 12.0, 11.0), _row("a", 256, 11.0, 12.0)
    lost["rounds_us"] = {"ours": [12.0, 10.0, 12.0], "triton_kernels": [11.0, 11.0, 12.0]}
    won["rounds_us"] = {"ours": [11.0] * 3, "triton_kernels": [12.0] * 3}
    s = bench.summarize([lost, won, _row("b", 64, 12.0, 11.0)])  # the last without rounds: not compared
    assert s["triton_kernels_rounds"] == {"a M=64": dict(min=10.0 / 11.0, median=1.0, max=12.0 / 11.0, faster=1,
                                                         rounds=3)}


@pytest.fixture
def fake_gpu(monkeypatch):
    """The benchmark on the CPU: tiny models, a harness that calls each function but fakes its timings."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "ROUTINGS", 2)
    monkeypatch.setattr(bench, "MODELS", {"tiny": dict(E=4, topk=2, K=64, N=32)})
    monkeypatch.setattr(bench, "MXFP4_MODELS", {"tiny-oss": dict(E=5, topk=2, K=64, N=64),
                                                "tiny-oss-b": dict(E=8, topk=4, K=128, N=64)})
    monkeypatch.setattr(bench, "MXFP4_QUANTIZE_CHUNK", 3)  # 5 and 8 experts: uneven chunks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(tk_backend, "is_available", lambda: False)
    monkeypatch.setattr(tk_backend, "unavailable_reason", lambda: "fake: no GPU")

    def time_interleaved_us(fns, n_sets, rounds):
        for fn in fns.values():
            for i in range(n_sets):
                fn(i)
        return {name: [FAKE_US] * rounds for name in fns}, {}

    fake = SimpleNamespace(
        device_info=lambda: {"device": "Fake GPU", "torch": torch.__version__, "triton": "0", "command": "fake"},
        copy_bandwidth=lambda: 2e12, gemm_peak=lambda dtype: 5e14, time_interleaved_us=time_interleaved_us,
        record_rounds=harness.record_rounds, round_ratios=harness.round_ratios,
        interleaved_timing=harness.interleaved_timing,
        write_json=harness.write_json, gpu_slug=lambda: "fake", random_mxfp4_stack=harness.random_mxfp4_stack,
    )
    monkeypatch.setitem(sys.modules, "harness", fake)


def test_bf16_run_keeps_its_file_and_fields(fake_gpu, tmp_path, capsys):
    assert bench.main(["--tokens", "1", "5", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fused_experts_fake.json").read_text())
    assert "quant" not in result and result["dtype"] == "bfloat16"
    assert set(result["summary"]) == {"cells", "ours_timed", "ours_le_triton_kernels", "compared_with_triton_kernels",
                                      "triton_kernels_rounds", "geomean_ours_over_floor", "max_ours_over_floor"}
    for row in result["rows"]:
        assert row["ours_us"] == FAKE_US and row["ours_rel_err"] == 0.0 and row["triton_kernels_us"] is None
        assert "grouped_mm_us" in row and "ours_bf16_us" not in row
        assert row["bytes"] == pytest.approx(row["experts_hit"] * 3 * 32 * 64 * 2 + 2 * row["M"] * 64 * 2)
    out = capsys.readouterr().out
    assert f"{'model':<14} {'M':>5} {'floor':>9} {'ours':>16} {'triton_kernels':>16} {'grouped_mm':>16}" in out
    assert "max(ours / floor)" in out and "triton_kernels: column null: fake: no GPU" in out


def _fake_peer(monkeypatch, prepare_fails=False):
    """triton_kernels' MXFP4 entry points faked on the CPU (the PyTorch implementation behind them)."""
    prepared = []

    def prepare_mxfp4(w, w_scale):
        if prepare_fails:
            raise ValueError("fake layout failure")
        prepared.append(w)
        return ("prepared", w, w_scale)

    def fused_experts(x, w1, w2, weights, ids, activation, *, quant, **biases):
        assert quant == "mxfp4" and w1[0] == w2[0] == "prepared"
        return fused_experts_torch(x, w1[1], w2[1], weights, ids, activation, quant="mxfp4", w1_scale=w1[2],
                                   w2_scale=w2[2], **biases)

    monkeypatch.setattr(tk_backend, "is_available", lambda: True)
    monkeypatch.setattr(tk_backend, "prepare_mxfp4", prepare_mxfp4)
    monkeypatch.setattr(tk_backend, "fused_experts", fused_experts)
    return prepared


@pytest.mark.parametrize("layout,bias", [("linear", False), ("transposed", True)])
def test_mxfp4_run(fake_gpu, monkeypatch, tmp_path, capsys, layout, bias):
    prepared = _fake_peer(monkeypatch)
    argv = ["--quant", "mxfp4", "--tokens", "1", "6", "--weight-layout", layout, "--out", str(tmp_path)]
    assert bench.main(argv + (["--bias"] if bias else [])) == 0
    assert len(prepared) == 4  # once per weight stack and model, outside the timed calls
    assert not (tmp_path / "fused_experts_fake.json").exists()
    result = json.loads((tmp_path / "fused_experts_mxfp4_fake.json").read_text())
    assert (result["quant"], result["biases"], result["weight_layout"], result["weight_bits"]) == (
        "mxfp4", bias, layout, 4.25)
    assert [(r["model"], r["M"]) for r in result["rows"]] == [
        ("tiny-oss", 1), ("tiny-oss", 6), ("tiny-oss-b", 1), ("tiny-oss-b", 6)]
    for row in result["rows"]:
        assert row["failures"] == {}
        for name in ("ours", "triton_kernels", "ours_checkpoint", "ours_bf16"):
            assert row[f"{name}_us"] == FAKE_US and row[f"{name}_rel_err"] <= bench.TOLERANCE
        k, n = row["K"], row["N"]
        assert row["bytes"] == pytest.approx(row["experts_hit"] * 3 * n * k * 4.25 / 8 + 2 * row["M"] * k * 2)
        assert row["flops"] == 2 * row["M"] * row["topk"] * 3 * n * k
        assert row["floor_us"] == pytest.approx(max(row["bytes"] / 2e12, row["flops"] / 5e14) * 1e6)
    summary = result["summary"]
    assert summary["ours_le_triton_kernels"] == summary["compared_with_triton_kernels"] == 4
    assert set(summary["m1_ours_over_floor"]) == {"tiny-oss", "tiny-oss-b"}
    out = capsys.readouterr().out
    assert f"{'ours':>16} {'triton_kernels':>16} {'ours_checkpoint':>16} {'ours_bf16':>16}" in out
    assert "MXFP4 weights, bf16 activations" in out and "M = 1: ours / floor = tiny-oss" in out


def test_mxfp4_run_reports_a_failed_preparation(fake_gpu, monkeypatch, tmp_path, capsys):
    _fake_peer(monkeypatch, prepare_fails=True)
    assert bench.main(["--quant", "mxfp4", "--models", "tiny-oss", "--tokens", "2", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "fused_experts_mxfp4_fake.json").read_text())["rows"]
    assert row["triton_kernels_us"] is None and row["ours_us"] == row["ours_bf16_us"] == FAKE_US
    assert row["failures"] == {"triton_kernels": "raised RuntimeError: prepare_mxfp4 raised ValueError: fake layout "
                                                 "failure"}
    assert "targets met: ours_le_triton_kernels NO" in capsys.readouterr().out


def test_mxfp4_skip_peers(fake_gpu, tmp_path):
    assert bench.main(["--quant", "mxfp4", "--models", "tiny-oss-b", "--tokens", "3", "--skip-peers",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fused_experts_mxfp4_fake.json").read_text())
    assert set(result["unavailable"]) == {"triton_kernels", "ours_bf16"}
    (row,) = result["rows"]
    assert row["ours_us"] == FAKE_US and row["triton_kernels_us"] is None and row["ours_bf16_us"] is None


def test_plot_picks_the_series_of_the_run():
    assert plot.series_for({"rows": []}) is plot.SERIES
    assert [key for key, _, _ in plot.series_for({"quant": "mxfp4"})] == [
        "ours_us", "triton_kernels_us", "ours_checkpoint_us", "ours_bf16_us", "floor_us"]
    assert plot.weights_caption({"quant": "mxfp4"}) == "MXFP4 weights, bf16 activations"
    assert plot.weights_caption({}) == "bf16"


def test_plot_charts_an_mxfp4_result(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(_row(model, m, 10.0 + m, None if m == 1 else 12.0 + m), E=e, topk=4, K=2880, N=2880)
            for model, e in (("gpt-oss-120b", 128), ("gpt-oss-20b", 32)) for m in (1, 16, 64)]
    path = tmp_path / "fused_experts_mxfp4_h100.json"
    path.write_text(json.dumps({"quant": "mxfp4", "device": "fake", "rows": rows}))
    assert plot.main([str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0
