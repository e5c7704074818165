"""benchmarks/probe_gemm_schedules.py: its options, and a clear exit where there is no CUDA device."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import probe_gemm_schedules  # noqa: E402


def test_options():
    args = probe_gemm_schedules.parse_args([])
    assert args.shapes == [(8192, 2816, 2048), (8192, 8192, 8192)]
    assert args.variants == list(probe_gemm_schedules.VARIANTS)
    assert (args.timeout, args.budget, args.child) == (40.0, 250.0, None)
    args = probe_gemm_schedules.parse_args(["--shapes", "4096x1536x2048", "--variants", "p8_128", "cublas",
                                            "--timeout", "10", "--budget", "60"])
    assert args.shapes == [(4096, 1536, 2048)] and args.variants == ["p8_128", "cublas"]
    assert (args.timeout, args.budget) == (10.0, 60.0)
    with pytest.raises(SystemExit):
        probe_gemm_schedules.parse_args(["--shapes", "4096x1536"])
    with pytest.raises(SystemExit):
        probe_gemm_schedules.parse_args(["--variants", "p16_128"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only exit path")
def test_exits_with_2_without_cuda(capsys):
    assert probe_gemm_schedules.main(["--variants", "cublas"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
