"""benchmarks/profile_fused_experts.py: its options, and a clear exit where there is no CUDA device."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_fused_experts  # noqa: E402


def test_options():
    args = profile_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "4096"])
    assert (args.model, args.tokens, args.calls, args.no_peer) == ("qwen3-30b-a3b", 4096, 1, False)
    args = profile_fused_experts.parse_args(["--model", "mixtral-8x7b", "--tokens", "8", "--calls", "3",
                                             "--no-peer"])
    assert (args.calls, args.no_peer) == (3, True)
    assert (args.quant, args.variant) == ("none", None)
    args = profile_fused_experts.parse_args(["--model", "gpt-oss-120b", "--tokens", "1", "--quant", "mxfp4_mma",
                                             "--variant", '{"gemm2": {"split_k": 2}}'])
    assert (args.quant, args.variant) == ("mxfp4_mma", '{"gemm2": {"split_k": 2}}')
    assert (args.activation, args.local_experts, args.local_pairs) == (None, None, None)
    args = profile_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", "--quant", "fp8_block",
                                             "--activation", "silu", "--local-experts", "32", "--local-pairs", "1"])
    assert (args.activation, args.local_experts, args.local_pairs) == ("silu", 32, 1)
    for bad in (["--local-pairs", "1"], ["--local-experts", "0"], ["--local-experts", "32", "--local-pairs", "-1"],
                ["--activation", "relu"]):
        with pytest.raises(SystemExit):
            profile_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", *bad])
    with pytest.raises(SystemExit):
        profile_fused_experts.parse_args(["--model", "gpt-oss-120b", "--tokens", "1", "--quant", "int4"])
    with pytest.raises(SystemExit):
        profile_fused_experts.parse_args(["--model", "qwen3-30b-a3b"])
    with pytest.raises(SystemExit):
        profile_fused_experts.parse_args(["--model", "no-such-model", "--tokens", "8"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only exit path")
def test_exits_with_2_without_cuda(capsys):
    assert profile_fused_experts.main(["--model", "qwen3-30b-a3b", "--tokens", "4"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
