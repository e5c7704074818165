"""fused_moe = topk_softmax then fused_experts: against the fp64 references, equal to the two ops composed,
with an expert_map (logits over the global experts), M = 0, opcheck, compile."""

import pytest
import torch

from moe_extension.ops import fused_experts, fused_moe, topk_softmax
from tests.reference import (
    assert_close,
    fused_experts_reference,
    opcheck_utils,
    random_expert_map,
    random_experts,
    tolerance,
    topk_softmax_reference,
)
from tests.utils import DEVICES

QUANTS = ("none", "fp8_block", "mxfp4")
SIZES = {"none": (48, 40), "fp8_block": (136, 72), "mxfp4": (64, 32)}


def make_case(m, quant, *, num_experts=8, use_map=False, device="cpu", dtype=torch.float32):
    k, n = SIZES[quant]
    w = random_experts(num_experts, k, n, quant, dtype, device, bias=True)
    num_global = num_experts + 5 if use_map else num_experts
    kwargs = {name: w[name] for name in ("w1_bias", "w2_bias", "w1_scale", "w2_scale")}
    kwargs["quant"] = quant
    if use_map:
        kwargs["expert_map"] = random_expert_map(num_global, num_experts, device)
    x = torch.randn(m, k).to(dtype).to(device)
    logits = torch.randn(m, num_global, device=device)
    return x, w["w1"], w["w2"], logits, kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("renormalize,topk,activation,on_input",
                         [(True, 2, "swigluoai", False), (False, 6, "silu", True), (True, 8, "gelu", False)])
def test_matches_reference(device, quant, use_map, renormalize, topk, activation, on_input):
    x, w1, w2, logits, kwargs = make_case(9, quant, num_experts=10, use_map=use_map, device=device)
    out = fused_moe(x, w1, w2, logits, topk, renormalize, activation, apply_router_weight_on_input=on_input,
                    **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref_w, ref_ids = topk_softmax_reference(logits, topk, renormalize)
    ref, bound = fused_experts_reference(x, w1, w2, ref_w.float(), ref_ids.int(), activation,
                                         apply_router_weight_on_input=on_input, **kwargs, return_bound=True)
    assert_close(out, ref, tolerance(torch.float32, device, quant), bound)


@pytest.mark.parametrize("quant", QUANTS)
def test_equals_the_two_ops(quant):
    x, w1, w2, logits, kwargs = make_case(17, quant, use_map=True)
    out = fused_moe(x, w1, w2, logits, 3, True, "gelu_tanh", **kwargs)
    topk_weights, topk_ids = topk_softmax(logits, 3, True)
    assert torch.equal(out, fused_experts(x, w1, w2, topk_weights, topk_ids, "gelu_tanh", **kwargs))


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision(device):
    x, w1, w2, logits, kwargs = make_case(21, "none", dtype=torch.bfloat16, device=device)
    out = fused_moe(x, w1, w2, logits, 2, False, "swigluoai", **kwargs)
    ref_w, ref_ids = topk_softmax_reference(logits, 2, False)
    ref = fused_experts_reference(x, w1, w2, ref_w.float(), ref_ids.int(), "swigluoai", **kwargs)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, tolerance(torch.bfloat16, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_zero_tokens(device, quant):
    x, w1, w2, logits, kwargs = make_case(0, quant, device=device)
    assert fused_moe(x, w1, w2, logits, 2, True, **kwargs).shape == (0, x.shape[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_opcheck(device, quant):
    x, w1, w2, logits, kwargs = make_case(5, quant, use_map=True, device=device)
    kwargs.update(activation="swiglustep", apply_router_weight_on_input=True)
    torch.library.opcheck(torch.ops.moe_ext.fused_moe.default, (x, w1, w2, logits, 4, True), kwargs,
                          test_utils=opcheck_utils(quant))
