"""benchmarks/bench_fused_experts_fp8.py without a GPU: the options, the summary against the targets, the chart of
a result (plot_fused_experts.py, fp8 mode), and the committed H100 result file's consistency."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_fused_experts_fp8 as bench  # noqa: E402
import plot_fused_experts as plot  # noqa: E402

RESULT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "fused_experts_fp8_h100.json"
ZOO_RESULT = RESULT.with_name("fused_experts_fp8_zoo_h100.json")


def test_options():
    args = bench.parse_args([])
    assert args.shapes == list(bench.SHAPES) and args.tokens == list(bench.TOKENS) and not args.gemm1
    args = bench.parse_args(["--shapes", "deepseek-v3-ep32", "--tokens", "1", "64", "--skip-peers", "--gemm1"])
    assert (args.shapes, args.tokens, args.skip_peers, args.gemm1) == (["deepseek-v3-ep32"], [1, 64], True, True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "mixtral"])
    zoo = bench.parse_args(["--zoo"])
    assert (zoo.shapes, zoo.tokens) == (list(bench.ZOO_SHAPES), list(bench.ZOO_TOKENS))


def _row(m, auto, peers, floor=100.0):
    row = dict(shape="deepseek-v3", M=m, floor_us=floor, ours_auto_us=auto)
    row.update({f"{name}_us": us for name, us in zip(("ours_triton", "deep_gemm", "vllm"), peers, strict=True)})
    return row


def test_summary_counts_cells_and_targets():
    rows = [_row(1, 150.0, (150.0, 300.0, 140.0)),  # behind vllm
            _row(64, 110.0, (100.0, None, 120.0)),  # a null peer is not compared; ours_triton is not a peer
            _row(4096, 500.0, (None, None, None), floor=400.0),
            _row(16, None, (100.0, 100.0, 100.0))]  # ours not timed: not counted
    s = bench.summarize(rows, dict(TFLOPs=412.0))
    assert (s["cells"], s["ours_auto_timed"], s["ours_auto_le_every_peer"]) == (4, 3, 2)
    assert s["max_small_m_ours_auto_over_floor"] == pytest.approx(1.5)
    assert s["geomean_ours_auto_over_floor"] == pytest.approx((1.5 * 1.1 * 1.25) ** (1 / 3))
    assert s["gemm1_TFLOPs"] == 412.0 and s["targets"]["gemm1_TFLOPs"] == bench.TARGET_GEMM1_TFLOPS


def test_cell_seed_is_fixed_per_cell():
    """Each cell draws its inputs from its own seed (a function of the cell alone), different between cells."""
    seeds = {bench.cell_seed(s, m) for s in bench.SHAPES for m in bench.TOKENS}
    assert len(seeds) == len(bench.SHAPES) * len(bench.TOKENS)


def test_committed_result_is_consistent():
    """The committed H100 file: every cell of both shapes, ours timed everywhere, the summary recomputable from
    its rows, and the DeepGEMM route never faster than our Triton kernels (which is why the stored crossover
    keeps ``auto`` on them)."""
    result = json.loads(RESULT.read_text())
    rows = result["rows"]
    assert {(r["shape"], r["M"]) for r in rows} == {(s, m) for s in bench.SHAPES for m in bench.TOKENS}
    assert all(r["ours_auto_us"] is not None for r in rows)
    assert bench.summarize(rows, result["gemm1"]) == result["summary"]
    assert all(r["deep_gemm_us"] > r["ours_triton_us"] for r in rows if r["deep_gemm_us"] is not None)


def test_committed_zoo_result_is_consistent():
    """The committed H100 file of --zoo: every cell of ZOO_SHAPES x ZOO_TOKENS, its summary recomputable from its
    rows, and every untimed cell of ours explained by a failure in the row."""
    result = json.loads(ZOO_RESULT.read_text())
    rows = result["rows"]
    assert {(r["shape"], r["M"]) for r in rows} == {(s, m) for s in bench.ZOO_SHAPES for m in bench.ZOO_TOKENS}
    assert bench.summarize(rows, result["gemm1"]) == result["summary"]
    assert all(r["ours_auto_us"] is not None or "ours_auto" in r["failures"] for r in rows)


def test_chart_of_the_result(tmp_path):
    pytest.importorskip("matplotlib")
    result = json.loads(RESULT.read_text())
    assert plot.series_for(result) is plot.FP8_SERIES
    out = plot.plot(result, tmp_path / "fp8.png")
    assert out.stat().st_size > 10_000
