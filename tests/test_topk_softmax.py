"""topk_softmax: both routing modes against the fp64 reference, ties, any k, opcheck, compile."""

import pytest
import torch

from moe_extension.ops import topk_softmax, topk_softmax_torch
from tests.reference import topk_softmax_reference
from tests.utils import DEVICES, DTYPES, rel_err

CASES = [(1, 8, 1), (5, 10, 2), (17, 8, 6), (17, 10, 8), (7, 6, 6), (33, 64, 4), (9, 128, 8), (3, 5, 3), (0, 8, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("m,e,topk", CASES)
def test_matches_reference(device, dtype, renormalize, m, e, topk):
    logits = (torch.randn(m, e) * 2).to(dtype).to(device)
    weights, ids = topk_softmax(logits, topk, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (m, topk) and weights.is_contiguous() and ids.is_contiguous()
    ref_w, ref_ids = topk_softmax_reference(logits, topk, renormalize)
    assert torch.equal(ids.cpu().long(), ref_ids)
    assert rel_err(weights.cpu(), ref_w) <= 1e-6
    if renormalize and m:
        assert torch.allclose(weights.sum(-1).cpu(), torch.ones(m), atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_ties_go_to_the_lower_id(device, renormalize):
    logits = torch.tensor(
        [[0.0] * 8, [1.0, 3.0, 3.0, 2.0, 3.0, -1.0, 3.0, 0.5], [5.0, 5.0, 4.0, 4.0, 4.0, 4.0, 5.0, 4.0]], device=device
    )
    _, ids = topk_softmax(logits, 5, renormalize)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [1, 2, 4, 6, 3], [0, 1, 6, 2, 3]]


@pytest.mark.parametrize("device", DEVICES)
def test_k_equals_e_and_modes_differ(device):
    logits = torch.randn(6, 10, device=device)
    w_all, ids_all = topk_softmax(logits, 10, False)
    assert torch.allclose(w_all.sum(-1), torch.ones(6, device=device), atol=1e-6)
    w_top, ids_top = topk_softmax(logits, 3, False)
    w_ren, ids_ren = topk_softmax(logits, 3, True)
    assert torch.equal(ids_top, ids_ren) and torch.equal(ids_top, ids_all[:, :3])
    assert torch.allclose(w_ren, w_top / w_top.sum(-1, keepdim=True), atol=1e-6)
    assert (w_top.sum(-1) < 1).all()


def test_torch_reference_is_the_cpu_op():
    logits = torch.randn(11, 12, dtype=torch.bfloat16)
    for renormalize in (False, True):
        a, b = topk_softmax(logits, 4, renormalize), topk_softmax_torch(logits, 4, renormalize)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_opcheck(device, renormalize):
    logits = torch.randn(7, 10, device=device)
    torch.library.opcheck(torch.ops.moe_ext.topk_softmax.default, (logits, 6, renormalize))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_matches_eager(device):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: topk_softmax(x * 1.5, 6, True), fullgraph=True, dynamic=True)
    for m in (3, 17, 40):
        logits = torch.randn(m, 10, device=device)
        got, want = fn(logits), topk_softmax(logits * 1.5, 6, True)
        assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=1e-7, rtol=0)
