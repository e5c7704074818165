"""benchmarks/bench_zoo.py and model_zoo.py without a GPU: the zoo spans what the benchmark claims, the summary's
targets, a whole run on a tiny zoo on the CPU through a fake harness (timings faked; the checks, floors and JSON
real; an expert-parallel entry included), and the chart of a zoo result."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_extension.backends import triton_kernels as tk_backend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_fused_experts  # noqa: E402
import bench_zoo  # noqa: E402
import harness  # noqa: E402
import plot_fused_experts as plot  # noqa: E402
from model_zoo import ZOO  # noqa: E402

FAKE_US = 7.0


def test_zoo_spans_the_shapes_users_bring():
    assert len(ZOO) >= 12
    e_global = [s.get("E_global", s["E"]) for s in ZOO.values()]
    assert min(e_global) == 8 and max(e_global) == 512
    assert {s["topk"] for s in ZOO.values()} >= {1, 2, 4, 6, 8, 10}
    assert min(s["N"] for s in ZOO.values()) == 256 and max(s["N"] for s in ZOO.values()) == 14336
    assert {name.rsplit("-", 1)[1] for name in ZOO if "-tp" in name} >= {"tp2", "tp4", "tp8"}
    assert any("E_global" in s and s["E_global"] > s["E"] for s in ZOO.values())
    assert all(s["source"] and s["K"] % 64 == 0 for s in ZOO.values())
    # the tuner can tune every single-GPU zoo shape by name
    import tune_fused_experts

    assert {name for name, s in ZOO.items() if "E_global" not in s} <= set(tune_fused_experts.MODELS)


def _row(model, m, ours, floor=10.0, **peers):
    row = dict(model=model, M=m, floor_us=floor, ours_us=ours, ours_heuristic_us=peers.pop("heuristic", ours))
    row.update({f"{p}_us": peers.get(p) for p in bench_zoo.PEERS})
    return row


def test_summary_counts_cells_against_every_peer():
    rows = [_row("a", 1, 30.0, vllm=20.0), _row("a", 8, 11.0, vllm=12.0, vllm_gemms=10.0),
            _row("b", 8, 12.0, triton_kernels=13.0, heuristic=13.2), _row("b", 2048, 20.0, grouped_mm=25.0)]
    s = bench_zoo.summarize(rows)
    assert (s["cells"], s["cells_m_ge_8"], s["ours_le_every_peer_m_ge_8"]) == (4, 3, 2)  # M = 1 is not counted
    assert s["peers_faster"] == {"a M=8": ["vllm_gemms"]}
    assert s["max_ours_over_floor"] == 3.0 and s["max_heuristic_over_ours"] == pytest.approx(1.1)
    assert (s["heuristic_within_target"], s["heuristic_compared"]) == (3, 4)
    assert s["peer_rounds"] == {}  # rows without rounds: no round-by-round comparison


def test_summary_compares_a_faster_peer_round_by_round():
    row = _row("a", 512, 10.5, vllm_gemms=10.0, triton_kernels=11.0)
    row["rounds_us"] = {"ours": [10.0, 10.5, 12.0], "vllm_gemms": [10.5, 10.0, 10.0], "triton_kernels": [11.0] * 3}
    s = bench_zoo.summarize([row])
    assert s["peers_faster"] == {"a M=512": ["vllm_gemms"]}
    assert s["peer_rounds"] == {"a M=512": {"vllm_gemms": dict(min=10.0 / 10.5, median=1.05, max=1.2, faster=1,
                                                               rounds=3)}}
    assert harness.round_ratios(row, "ours", "grouped_mm") is None


@pytest.fixture
def fake_gpu(monkeypatch):
    """The benchmark on the CPU: a tiny zoo, a harness that calls each function but fakes its timings."""
    monkeypatch.setattr(bench_zoo, "DEVICE", "cpu")
    monkeypatch.setattr(bench_fused_experts, "DEVICE", "cpu")
    monkeypatch.setattr(bench_zoo, "ZOO", {"tiny": dict(E=4, topk=2, K=64, N=32, source="test"),
                                           "tiny-ep2": dict(E=3, E_global=6, topk=3, K=64, N=32, source="test")})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(tk_backend, "is_available", lambda: False)
    monkeypatch.setattr(tk_backend, "unavailable_reason", lambda: "fake: no GPU")

    def time_interleaved_us(fns, n_sets, rounds):
        for fn in fns.values():
            for i in range(n_sets):
                fn(i)
        return {name: [FAKE_US + r for r in range(rounds)] for name in fns}, {}

    fake = SimpleNamespace(
        device_info=lambda: {"device": "Fake GPU", "torch": torch.__version__, "triton": "0", "command": "fake"},
        copy_bandwidth=lambda: 2e12, gemm_peak=lambda dtype: 5e14, time_interleaved_us=time_interleaved_us,
        record_rounds=harness.record_rounds, round_ratios=harness.round_ratios,
        interleaved_timing=harness.interleaved_timing,
        write_json=harness.write_json, gpu_slug=lambda: "fake",
    )
    monkeypatch.setitem(sys.modules, "harness", fake)


def test_run_on_a_tiny_zoo(fake_gpu, tmp_path, capsys):
    argv = ["--models", "tiny", "tiny-ep2", "--tokens", "1", "9", "--vllm-deps", str(tmp_path / "no-vllm"),
            "--out", str(tmp_path)]
    assert bench_zoo.main(argv) == 0
    result = json.loads((tmp_path / "zoo_fake.json").read_text())
    assert result["kind"] == "zoo" and set(result["models"]) == {"tiny", "tiny-ep2"} and len(result["rows"]) == 4
    assert result["unavailable"]["triton_kernels"] == "fake: no GPU" and "vllm" in result["unavailable"]
    for row in result["rows"]:
        # a column's time: the median of its interleaved rounds, which the row keeps
        assert row["rounds_us"]["ours"] == [FAKE_US + r for r in range(bench_zoo.ROUNDS)]
        assert row["ours_us"] == FAKE_US + 2 and row["ours_rel_err"] == 0.0 and row["heuristic_is_table"]
        assert row["ours_heuristic_us"] == FAKE_US + 2 and row["vllm_us"] is None
        assert "ours_heuristic" not in row["rounds_us"]  # the same config as ours: not timed twice
        local = 4 if row["model"] == "tiny" else 3
        assert row["bytes"] == pytest.approx(row["experts_hit"] * 3 * 32 * 64 * 2 + 2 * row["M"] * 64 * 2)
        assert row["experts_hit"] <= local and row["local_experts"] == local
    ep = [r for r in result["rows"] if r["model"] == "tiny-ep2"]
    assert all(r["E"] == 6 and r["grouped_mm_us"] is None for r in ep)
    assert ep[1]["valid_pairs"] < 9 * 3  # slots of the other 3 experts are not this GPU's
    out = capsys.readouterr().out
    assert "ours <= every peer at M >= 8" in out and "vllm: column null" in out


def test_plot_charts_a_zoo_result(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot.series_for({"kind": "zoo"}) is plot.ZOO_SERIES
    rows = [dict(_row(model, m, 10.0 + m, vllm=12.0 + m), E=e, local_experts=e, topk=2, K=64, N=32)
            for model, e in (("a", 8), ("b", 16), ("c", 32), ("d", 64), ("e", 128)) for m in (1, 8)]
    path = tmp_path / "zoo_h100.json"
    path.write_text(json.dumps({"kind": "zoo", "device": "fake", "rows": rows}))
    assert plot.main([str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0
