"""benchmarks/probe_sustained_power.py: its options, the parsing of nvidia-smi's samples and the phases' means, and a
clear exit where there is no CUDA device."""

import datetime
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import probe_sustained_power as probe  # noqa: E402


def test_options():
    args = probe.parse_args(["qwen3-30b-a3b:4096", "deepseek-v2-lite:2048"])
    assert args.cells == [("qwen3-30b-a3b", 4096), ("deepseek-v2-lite", 2048)]
    assert (args.seconds, args.alternations, args.calls) == (4.0, 2, 40)
    args = probe.parse_args(["mixtral-8x7b:1024", "--seconds", "2", "--alternations", "3", "--calls", "8"])
    assert (args.cells, args.seconds, args.alternations, args.calls) == ([("mixtral-8x7b", 1024)], 2.0, 3, 8)
    for bad in (["no-such-model:64"], ["qwen3-30b-a3b"], ["qwen3-30b-a3b:0"], ["qwen3-30b-a3b:x"], []):
        with pytest.raises(SystemExit):
            probe.parse_args(bad)


def test_samples_and_phase_means():
    text = "2026/11/30 03:30:00.000, 1500, 600.0\n2026/11/30 03:30:00.050, 1600, 650.5\n" \
           "2026/11/30 03:30:01.000, 1200, 700.0\n"
    samples = probe.parse_samples(text)
    t0 = datetime.datetime(2026, 11, 30, 3, 30, 0).timestamp()
    assert [s[0] - t0 for s in samples] == pytest.approx([0.0, 0.05, 1.0])
    assert [s[1:] for s in samples] == [(1500.0, 600.0), (1600.0, 650.5), (1200.0, 700.0)]
    assert probe.phase_means(samples, t0, t0 + 0.5) == (1550.0, 625.25, 2)
    clock, power, n = probe.phase_means(samples, t0 + 2, t0 + 3)
    assert math.isnan(clock) and math.isnan(power) and n == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only exit path")
def test_exits_with_2_without_cuda(capsys):
    assert probe.main(["qwen3-30b-a3b:64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
