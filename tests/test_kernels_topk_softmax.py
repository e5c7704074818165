"""The fused softmax + top-k Triton kernel (moe_extension.kernels.topk_softmax_triton) against the fp64 reference:
both routing modes, k from 1 to E (powers of two or not), E up to 512, ties to the lower expert id, strided
logits, every input dtype. Triton's interpreter on CPU tensors without CUDA, the GPU with it.
"""

import pytest
import torch

from moe_extension.kernels import topk_softmax_triton
from tests.reference import topk_softmax_reference
from tests.utils import DEVICES, INTERPRETED

DEVICE = "cuda" if "cuda" in DEVICES else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="needs CUDA or the Triton interpreter")

CASES = [
    # M, E, topk, dtype
    (1, 8, 2, torch.float32),
    (5, 33, 6, torch.float16),
    (3, 512, 16, torch.float32),
    (70, 64, 8, torch.bfloat16),
    (2, 7, 7, torch.float32),  # k = E, E not a power of two
    (4, 128, 1, torch.float16),
    (9, 60, 4, torch.bfloat16),
]


def _check(logits, topk, renormalize):
    weights, ids = topk_softmax_triton(logits, topk, renormalize)
    ref_w, ref_ids = topk_softmax_reference(logits, topk, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], topk)
    assert torch.equal(ids.cpu().long(), ref_ids), "ids (ties: lower expert id first)"
    torch.testing.assert_close(weights.cpu().double(), ref_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("M,E,topk,dtype", CASES)
def test_topk_softmax_matches_reference(M, E, topk, dtype, renormalize):
    torch.manual_seed(M * E + topk)
    logits = torch.randn(M, E, device=DEVICE).mul_(3).to(dtype)
    if E > 3:
        # exact ties at the top and inside the top-k: the lower id must come first
        logits[0, 3] = logits[0, 1] = logits[0].max() + 1
        logits[-1, 2] = logits[-1, E - 1]
    _check(logits, topk, renormalize)


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_strided_and_extremes(renormalize):
    base = torch.randn(12, 80, device=DEVICE)
    logits = base[1::2, ::2]  # [6, 40], both strides > 1
    logits[0] = 0.0  # all tied: ids 0..k-1
    logits[1, 5] = 1e4  # one dominant logit: weights 1, 0, ... without NaN
    logits[2, :] = -1e4
    _check(logits, 5, renormalize)


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_nan_row_selects_invalid_ids(renormalize):
    logits = torch.randn(3, 16, device=DEVICE)
    logits[1] = float("nan")
    weights, ids = topk_softmax_triton(logits, 4, renormalize)
    assert (ids[1] >= 16).all(), "a NaN row routes nowhere (ids >= E are invalid slots downstream)"
    ref_w, ref_ids = topk_softmax_reference(logits[::2], 4, renormalize)
    assert torch.equal(ids[::2].cpu().long(), ref_ids)


def test_topk_softmax_empty():
    weights, ids = topk_softmax_triton(torch.empty(0, 16, device=DEVICE), 4, True)
    assert weights.shape == ids.shape == (0, 4)
