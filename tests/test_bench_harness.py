"""benchmarks/harness.py's interleaved timing without a GPU: graphs and event timing faked, the rounds' order, the
per-call arithmetic and the failures per implementation real."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import harness  # noqa: E402


class FakeGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Captures that record which implementation a replay belongs to; every replay 'takes' 10 ms."""
    log, reps = [], {"a": 40, "b": 8, "c": 400}

    def capture(fn, n):
        name = fn(0)
        if name == "broken":
            raise RuntimeError("capture failed")
        return FakeGraph(name, log)

    def events_time_ms(fn, iters):
        out = []
        for _ in range(iters):
            fn()
            out.append(10.0)
        return out

    monkeypatch.setattr(harness, "_capture", capture)
    monkeypatch.setattr(harness, "_budget_reps", lambda fn, n_sets, budget_us: reps.get(fn(0), n_sets))
    monkeypatch.setattr(harness, "_events_time_ms", events_time_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return log


def test_interleaved_rounds_rotate_and_time_per_call(fake_cuda):
    fns = {name: (lambda i, name=name: name) for name in ("a", "b", "c")}
    times, errors = harness.time_interleaved_us(fns, n_sets=4, rounds=4)
    assert errors == {}
    # every round replays each graph once; the first of a round moves on by one each round
    assert fake_cuda == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # 10 ms per replay over the graph's calls
    assert times == {"a": [250.0] * 4, "b": [1250.0] * 4, "c": [25.0] * 4}


def test_a_failing_capture_is_reported_and_the_rest_timed(fake_cuda):
    fns = {"a": lambda i: "a", "x": lambda i: "broken", "b": lambda i: "b"}
    times, errors = harness.time_interleaved_us(fns, n_sets=4, rounds=3)
    assert set(times) == {"a", "b"} and list(errors) == ["x"] and "capture failed" in str(errors["x"])
    assert fake_cuda == ["a", "b", "b", "a", "a", "b"]
    assert harness.time_interleaved_us({}, n_sets=4, rounds=3) == ({}, {})


def test_record_rounds_fills_a_row():
    row = {"failures": {}}
    harness.record_rounds(row, {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0]}, {"c": ValueError("no")},
                          lambda exc: f"raised {type(exc).__name__}")
    assert row == {"failures": {"c": "raised ValueError"}, "rounds_us": {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0]},
                   "a_us": 2.0, "b_us": 4.5}
