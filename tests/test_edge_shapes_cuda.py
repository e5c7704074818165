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

from moe_extension.quant import quantize_mxfp4
from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma
from tests.utils import rel_err

cuda = pytest.mark.cuda

QUANTS = ("none", "fp8_block", "mxfp4", "mxfp4_mma")
TOL = 1e-2  # the CPU path rounds the biases as the kernels do; fp8 / MXFP4 activations alike


def _stack(quant: str, E: int, rows: int, cols: int, gen: torch.Generator):
    """(w, scale) of one weight stack [E, rows, cols] in ``quant`` (CPU tensors; scale None for bf16)."""
    w = torch.randn(E, rows, cols, generator=gen) / max(cols, 1) ** 0.5
    if quant == "none":
        return w.to(torch.bfloat16), None
    if quant == "fp8_block":
        scale = torch.rand(E, -(-rows // 128), -(-cols // 128), generator=gen) / 64 + 1 / 128
        return (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    packed, scales = quantize_mxfp4(w)
    return prepare_mxfp4_mma(packed, scales) if quant == "mxfp4_mma" else (packed, scales)


def _call(x, w1, s1, w2, s2, b1, b2, g, ids, quant, expert_map=None):
    return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, "swigluoai", w1_bias=b1, w2_bias=b2,
                                           expert_map=expert_map, quant=quant, w1_scale=s1, w2_scale=s2,
                                           backend="triton" if x.is_cuda else "auto")


def _on(t, device):
    return None if t is None else t.to(device)


@cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("K,N", [(256, 0), (0, 256)])
@pytest.mark.parametrize("M", [1, 64, 2048])
def test_empty_hidden_or_intermediate(quant, K, N, M):
    gen = torch.Generator().manual_seed(M + K + N)
    E, topk = 8, 4
    w1, s1 = _stack(quant, E, 2 * N, K, gen)
    w2, s2 = _stack(quant, E, K, N, gen)
    b1, b2 = torch.randn(E, 2 * N, generator=gen), torch.randn(E, K, generator=gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    ids = torch.rand(M, E, generator=gen).topk(topk, dim=1).indices.to(torch.int32)
    ids[0, 0] = -1  # an invalid slot contributes nothing
    g = torch.softmax(torch.randn(M, topk, generator=gen), -1)
    args = (x, w1, s1, w2, s2, b1, b2, g, ids)
    ref = _call(*args, quant)
    out = _call(*(_on(t, "cuda") for t in args), quant)
    assert out.shape == ref.shape == (M, K) and out.isfinite().all()
    if K:
        assert ref.abs().max() > 0 and rel_err(out.cpu(), ref) <= TOL


@cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("M", [1, 64, 2048])
def test_no_experts(quant, M):
    """E = 0: the ids name the 16 experts of other ranks; the op returns zeros on every schedule."""
    gen = torch.Generator().manual_seed(M)
    K, N, topk = 256, 128, 4
    w1, s1 = _stack(quant, 0, 2 * N, K, gen)
    w2, s2 = _stack(quant, 0, K, N, gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    ids = torch.rand(M, 16, generator=gen).topk(topk, dim=1).indices.to(torch.int32)
    g = torch.softmax(torch.randn(M, topk, generator=gen), -1)
    emap = torch.full((16,), -1, dtype=torch.int32)
    args = (x, w1, s1, w2, s2, torch.zeros(0, 2 * N), torch.zeros(0, K), g, ids)
    ref = _call(*args, quant, expert_map=emap)
    out = _call(*(_on(t, "cuda") for t in args), quant, expert_map=emap.cuda())
    assert out.shape == ref.shape == (M, K) and (out == 0).all() and (ref == 0).all()
