"""benchmarks/bench_routing.py without a GPU: the layers it times span the zoo's (E, topk) once each, and it
refuses to run without CUDA."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_routing  # noqa: E402
from model_zoo import ZOO  # noqa: E402


def test_layers_are_distinct_and_span_the_zoo():
    layers = bench_routing.layers()
    shapes = list(layers.values())
    assert len(shapes) == len(set(shapes)), "one row per (E, topk)"
    assert {(s["E"], s["topk"]) for s in ZOO.values()} <= set(shapes)
    assert set(bench_routing.BENCHMARK_MODELS.values()) <= set(shapes)
    assert min(e for e, _ in shapes) == 8 and max(e for e, _ in shapes) == 512
    assert {k for _, k in shapes} >= {1, 2, 4, 6, 8, 10}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_routing.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_routing.main()
