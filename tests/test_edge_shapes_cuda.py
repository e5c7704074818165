"""GPU suite of edge shapes for every weight format through ``torch.ops.moe_ext.fused_experts`` (CUDA: the Triton
kernels; ``backend="triton"``) against the same op on CPU tensors (the PyTorch implementation):

- an empty intermediate (N = 0: each valid slot's w2 bias, weighted) or hidden dim (K = 0: an empty output), on
  the direct (M = 1) and the expert-sorted schedule (M = 64, 2048);
- a rank without experts (E = 0, every id mapped to -1 through an expert_map): the output is 0.

Formats: bf16 weights, fp8 block, MXFP4 (checkpoint layout) and MXFP4 in the MMA layout. The interpreter's view
of the same cases is in tests/test_kernels_grouped_gemm.py, test_kernels_fp8.py and test_kernels_mxfp4_mma.py.
"""

import pytest
import torch

from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma
from tests.reference import random_experts, random_routing
from tests.utils import rel_err

cuda = pytest.mark.cuda

QUANTS = ("none", "fp8_block", "mxfp4", "mxfp4_mma")
TOL = 1e-2  # the CPU path rounds the biases as the kernels do; fp8 / MXFP4 activations alike


def _weights(quant: str, E: int, K: int, N: int, seed: int) -> dict:
    """``random_experts``' stacks (CPU) with biases; ``mxfp4_mma``: its MXFP4 stacks in the MMA layout."""
    torch.manual_seed(seed)
    w = random_experts(E, K, N, "mxfp4" if quant == "mxfp4_mma" else quant, torch.bfloat16, bias=True)
    if quant == "mxfp4_mma":
        for i in (1, 2):
            w[f"w{i}"], w[f"w{i}_scale"] = prepare_mxfp4_mma(w[f"w{i}"], w[f"w{i}_scale"])
    return w


def _call(x, w, g, ids, quant, expert_map=None):
    return torch.ops.moe_ext.fused_experts(x, w["w1"], w["w2"], g, ids, "swigluoai", w1_bias=w["w1_bias"],
                                           w2_bias=w["w2_bias"], expert_map=expert_map, quant=quant,
                                           w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                                           backend="triton" if x.is_cuda else "auto")


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


def _cuda_weights(w: dict) -> dict:
    return {name: None if t is None else t.cuda() for name, t in w.items()}


@cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("K,N", [(256, 0), (0, 256)])
@pytest.mark.parametrize("M", [1, 64, 2048])
def test_empty_hidden_or_intermediate(quant, K, N, M):
    w = _weights(quant, 8, K, N, seed=M + K + N)
    x = torch.randn(M, K).to(torch.bfloat16)
    g, ids = random_routing(M, 8, 4, invalid=0.1)
    ref = _call(x, w, g, ids, quant)
    out = _call(*_cuda(x), _cuda_weights(w), *_cuda(g, ids), quant)
    assert out.shape == ref.shape == (M, K) and out.isfinite().all()
    if K:
        assert ref.abs().max() > 0 and rel_err(out.cpu(), ref) <= TOL


@cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("M", [1, 64, 2048])
def test_no_experts(quant, M):
    """E = 0: the ids name the 16 experts of other ranks; the op returns zeros on every schedule."""
    w = _weights(quant, 0, 256, 128, seed=M)
    x = torch.randn(M, 256).to(torch.bfloat16)
    g, ids = random_routing(M, 16, 4, invalid=0.0)
    emap = torch.full((16,), -1, dtype=torch.int32)
    ref = _call(x, w, g, ids, quant, expert_map=emap)
    out = _call(*_cuda(x), _cuda_weights(w), *_cuda(g, ids), quant, expert_map=emap.cuda())
    assert out.shape == ref.shape == (M, 256) and (out == 0).all() and (ref == 0).all()
