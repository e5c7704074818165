"""benchmarks/bench_lora.py's correctness reference (``TorchLoRA``): the class it builds must add both LoRA terms
through the PyTorch implementation, so that the benchmark's check compares two implementations, not one with
itself. CPU, small shapes."""

import math
import sys
from pathlib import Path

import torch

from moe_extension.experts import UnfusedOAITritonExperts
from moe_extension.ops import lora as ops_lora

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_lora  # noqa: E402


def test_reference_class_adds_both_terms_through_pytorch(monkeypatch):
    torch.manual_seed(0)
    E, topk, K, N, M = 4, 2, 64, 32, 5
    w1 = (torch.randn(E, 2 * N, K) / math.sqrt(K)).to(torch.bfloat16).transpose(1, 2)
    w2 = (torch.randn(E, K, N) / math.sqrt(N)).to(torch.bfloat16).transpose(1, 2)

    class Reference(bench_lora.TorchLoRA, UnfusedOAITritonExperts):
        pass

    lora = bench_lora.make_lora(torch, 2, E, N, K, 4, "cpu")
    reference = Reference(w1, w2, activation="swigluoai", lora=lora)
    experts = UnfusedOAITritonExperts(w1, w2, activation="swigluoai", lora=lora)
    x = torch.randn(M, K).to(torch.bfloat16)
    ids = torch.rand(M, E).topk(topk, dim=1).indices.int()
    weights = torch.softmax(torch.randn(M, topk), dim=1)
    mapping = torch.tensor([0, 1, -1, 0, 1], dtype=torch.int32)
    calls, handed = [], []
    real_add, real_args = ops_lora.add_lora_torch, UnfusedOAITritonExperts._lora_args
    monkeypatch.setattr(ops_lora, "add_lora_torch", lambda *a, **k: calls.append(a[2].shape) or real_add(*a, **k))

    def lora_args(self, gemm, mapping):
        handed.append(mapping is not None)
        return real_args(self, gemm, mapping)

    monkeypatch.setattr(UnfusedOAITritonExperts, "_lora_args", lora_args)
    out = reference.apply(x, weights, ids, token_lora_mapping=mapping)
    assert handed == [False, False], "the GEMM ops of the reference get no adapters (on CUDA they run the kernels)"
    assert calls == [lora.a13.shape, lora.a2.shape], "both terms through add_lora_torch, once each"
    want = experts.apply(x, weights, ids, token_lora_mapping=mapping)  # on the CPU the ops' PyTorch path
    assert torch.equal(out, want)
    assert not torch.equal(out, experts.apply(x, weights, ids)), "the adapters must change the output"
