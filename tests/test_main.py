"""Tests of the main job, ``python -m moe_extension``, run in a subprocess on the CPU with tiny shapes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_extension.__main__ import parse_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--model", "custom", "--experts", "6", "--topk", "2", "--hidden", "64",
        "--intermediate", "32", "--tokens", "1,3", "--repeat", "1"]


def run_main(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "moe_extension", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_main_runs_and_prints_the_table():
    proc = run_main(*TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "WITH_CUDA=" in out and "CUDA_ARCHS=" in out and "torch " in out and "device: cpu" in out
    for op in ("moe_sum", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "swigluoai_and_mul",
               "swiglustep_and_mul"):
        assert re.search(rf"^\s+{op}\s+OK\b", out, re.M), op
    assert "copy bandwidth" in out and "TFLOP/s" in out
    assert "[1/4] fused_moe eager M=1" in out and "[4/4] fused_moe compiled M=3" in out  # progress lines
    header = next(line for line in out.splitlines() if line.startswith("path"))
    for col in ("M", "time ms", "GB/s", "TFLOP/s", "floor ms", "x floor", "rel err"):
        assert col in header
    rows = [line.split() for line in out.splitlines() if line.startswith("fused_moe ")]
    assert [(r[1], r[2]) for r in rows] == [("eager", "1"), ("compiled", "1"), ("eager", "3"), ("compiled", "3")]
    for r in rows:
        time_ms, gbs, tflops, floor_ms, ratio, err = map(float, r[3:9])
        assert time_ms > 0 and gbs > 0 and tflops > 0 and floor_ms > 0 and ratio > 0 and err < 2e-2
        assert r[9] == "OK"
    assert "all checks passed" in out


@pytest.mark.parametrize("quant", ["mxfp4", "mxfp4_mma"])
def test_main_quantized_without_compile(quant):
    tiny = [*TINY[:TINY.index("--intermediate") + 1], "64", *TINY[TINY.index("--intermediate") + 2:]]
    proc = run_main(*tiny, "--quant", quant, "--no-compile", "--activation", "swigluoai")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"quant={quant} " in proc.stdout and "compiled" not in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith("fused_moe eager")]) == 2


def test_main_help():
    proc = run_main("--help", timeout=60)
    assert proc.returncode == 0
    for opt in ("--model", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "custom", "--experts", "--topk",
                "--hidden", "--intermediate", "--tokens", "--quant", "fp8_block", "--device", "--no-compile",
                "--repeat"):
        assert opt in proc.stdout, opt


@pytest.mark.parametrize("args,message", [
    (["--model", "custom", "--experts", "4"], "--model custom needs --experts, --topk, --hidden and --intermediate"),
    (["--tokens", "1,x"], "--tokens must be comma-separated integers"),
    (["--tokens", "0"], "each >= 1"),
    (["--quant", "mxfp4", "--dtype", "fp16"], "--quant mxfp4 runs with bf16 activations"),
    (["--quant", "mxfp4_mma", "--model", "custom", "--experts", "4", "--topk", "2", "--hidden", "64",
      "--intermediate", "96"], "--quant mxfp4_mma needs hidden and intermediate sizes divisible by 64"),
    (["--experts", "2", "--topk", "3"], r"topk \(3\) must be <= the number of experts \(2\)"),
    (["--model", "llama"], "invalid choice: 'llama'"),
])
def test_main_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cpu_scales_the_model_down():
    args = parse_args(["--device", "cpu"])
    assert args.sizes == {"experts": 32, "topk": 4, "hidden": 512, "intermediate": 512}
    assert args.activation == "swigluoai" and args.tokens == [1, 16, 64] and args.repeat == 3
    args = parse_args(["--device", "cpu", "--model", "mixtral-8x7b", "--hidden", "1024"])
    assert args.sizes == {"experts": 8, "topk": 2, "hidden": 1024, "intermediate": 512}
