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


def test_block_m_follows_the_heuristic():
    assert bench_routing.block_m_for(1, 128, 4) == 16  # the direct schedule: no routing of its own
    assert bench_routing.block_m_for(64, 128, 8) == 16  # 4 rows per expert
    assert bench_routing.block_m_for(2048, 512, 10) == 64  # 40 rows per expert
    assert bench_routing.block_m_for(8192, 64, 8) == 128


def test_same_routing_ignores_unwritten_rows_only():
    from moe_extension.kernels._routing import Routing

    def routing(sorted_pairs, block_expert):
        t = torch.tensor
        return Routing(t(sorted_pairs), t(block_expert), t([0, 1, -1]), t([2, 0]), t([0, 4]), 2, 3, t([0, 0]))

    a = routing([0, 1, 3, 3, 9, 9], [0, -1, -1])
    assert bench_routing.same_routing(a, routing([0, 1, 3, 3, 7, 7], [0, -1, -1]))  # past the used block
    assert not bench_routing.same_routing(a, routing([1, 0, 3, 3, 9, 9], [0, -1, -1]))
    assert not bench_routing.same_routing(a, routing([0, 1, 3, 3, 9, 9], [0, 0, -1]))
