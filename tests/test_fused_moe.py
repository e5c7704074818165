"""fused_moe = topk_softmax (or, with any DeepSeek routing argument, grouped_topk) then fused_experts: against
the fp64 references, equal to the two ops composed, with an expert_map (logits over the global experts), M = 0,
opcheck, compile, bad routing arguments."""

import pytest
import torch

from moe_extension.ops import fused_experts, fused_moe, grouped_topk, topk_softmax
from tests.reference import (
    assert_close,
    fused_experts_reference,
    grouped_topk_reference,
    opcheck_utils,
    random_expert_map,
    random_experts,
    tolerance,
    topk_softmax_reference,
)
from tests.utils import DEVICES, rel_err

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
    # The routing fused_moe computes (topk_softmax) against its fp64 reference, then the experts against theirs from
    # those fp32 weights: with apply_router_weight_on_input a quantized format rounds g * x, so a weight 1 ulp off
    # its correctly rounded value (as fp32 softmax may be) can flip an fp8 rounding of the first GEMM's input.
    weights, ids = topk_softmax(logits, topk, renormalize)
    ref_w, ref_ids = topk_softmax_reference(logits, topk, renormalize)
    assert torch.equal(ids.long().cpu(), ref_ids) and rel_err(weights.cpu(), ref_w) <= 1e-6
    ref, bound = fused_experts_reference(x, w1, w2, weights, ids, activation, apply_router_weight_on_input=on_input,
                                         **kwargs, return_bound=True)
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


# ---------------------------------------------------------------------------------------------- DeepSeek routing

NUM_EXPERTS = 15  # with a map, 20 global experts: 5 groups of 3 or of 4
DEEPSEEK_ROUTINGS = {
    # renormalize, topk, routing keywords (the bias, when given, is drawn per case)
    "v3_style": (True, 3, {"num_expert_group": 5, "topk_group": 2, "scoring_func": "sigmoid", "bias": True,
                           "routed_scaling_factor": 2.5}),
    "v2_style": (False, 4, {"num_expert_group": 5, "topk_group": 3, "scoring_func": "softmax",
                            "routed_scaling_factor": 16.0}),
}


def deepseek_routing(name, num_global, device="cpu"):
    renormalize, topk, routing = DEEPSEEK_ROUTINGS[name]
    routing = dict(routing)
    if routing.pop("bias", False):
        routing["e_score_correction_bias"] = (torch.randn(num_global) * 0.1).to(device)
    return renormalize, topk, routing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("name", DEEPSEEK_ROUTINGS)
def test_grouped_routing_matches_reference(device, quant, use_map, name):
    x, w1, w2, logits, kwargs = make_case(9, quant, num_experts=NUM_EXPERTS, use_map=use_map, device=device)
    renormalize, topk, routing = deepseek_routing(name, logits.shape[1], device)
    out = fused_moe(x, w1, w2, logits, topk, renormalize, "silu", **routing, **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref_w, ref_ids = grouped_topk_reference(logits, topk, renormalize, **routing)
    ref, bound = fused_experts_reference(x, w1, w2, ref_w.float(), ref_ids.int(), "silu", **kwargs,
                                         return_bound=True)
    assert_close(out, ref, tolerance(torch.float32, device, quant), bound)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("name", DEEPSEEK_ROUTINGS)
def test_grouped_routing_equals_the_two_ops(quant, name):
    x, w1, w2, logits, kwargs = make_case(17, quant, num_experts=NUM_EXPERTS, use_map=True)
    renormalize, topk, routing = deepseek_routing(name, logits.shape[1])
    out = fused_moe(x, w1, w2, logits, topk, renormalize, "gelu", **routing, **kwargs)
    topk_weights, topk_ids = grouped_topk(logits, topk, renormalize, **routing)
    assert torch.equal(out, fused_experts(x, w1, w2, topk_weights, topk_ids, "gelu", **kwargs))


@pytest.mark.parametrize("routing", [
    {"num_expert_group": 5},
    {"num_expert_group": 5, "topk_group": 3},
    {"scoring_func": "sigmoid"},
    {"e_score_correction_bias": torch.zeros(NUM_EXPERTS)},
    {"routed_scaling_factor": 2.5},
], ids=["num_expert_group", "topk_group", "scoring_func", "e_score_correction_bias", "routed_scaling_factor"])
def test_any_deepseek_argument_routes_through_grouped_topk(routing):
    x, w1, w2, logits, kwargs = make_case(11, "none", num_experts=NUM_EXPERTS)
    out = fused_moe(x, w1, w2, logits, 2, False, **routing, **kwargs)
    assert torch.equal(out, fused_experts(x, w1, w2, *grouped_topk(logits, 2, False, **routing), **kwargs))
    if "scoring_func" in routing or "routed_scaling_factor" in routing:
        assert not torch.equal(out, fused_experts(x, w1, w2, *topk_softmax(logits, 2, False), **kwargs))


def test_default_deepseek_arguments_keep_topk_softmax():
    x, w1, w2, logits, kwargs = make_case(11, "none", num_experts=NUM_EXPERTS)
    out = fused_moe(x, w1, w2, logits, 9, True, num_expert_group=1, topk_group=1, scoring_func="softmax",
                    e_score_correction_bias=None, routed_scaling_factor=1.0, **kwargs)
    assert torch.equal(out, fused_experts(x, w1, w2, *topk_softmax(logits, 9, True), **kwargs))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_routing_zero_tokens(device):
    x, w1, w2, logits, kwargs = make_case(0, "none", num_experts=NUM_EXPERTS, device=device)
    _, topk, routing = deepseek_routing("v3_style", NUM_EXPERTS, device)
    assert fused_moe(x, w1, w2, logits, topk, True, **routing, **kwargs).shape == (0, x.shape[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_grouped_routing_opcheck(device, quant):
    x, w1, w2, logits, kwargs = make_case(5, quant, num_experts=NUM_EXPERTS, use_map=True, device=device)
    _, topk, routing = deepseek_routing("v3_style", logits.shape[1], device)
    kwargs.update(routing, activation="swiglustep")
    torch.library.opcheck(torch.ops.moe_ext.fused_moe.default, (x, w1, w2, logits, topk, True), kwargs,
                          test_utils=opcheck_utils(quant))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_routing_compiles_once(device):
    torch._dynamo.reset()
    _, w1, w2, _, kwargs = make_case(1, "none", num_experts=NUM_EXPERTS, device=device)
    _, topk, routing = deepseek_routing("v3_style", NUM_EXPERTS, device)

    def moe(x, logits):
        return fused_moe(x, w1, w2, logits, topk, True, "silu", **routing, **kwargs)

    compiled = torch.compile(moe, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in (2, 3, 17):
            x = torch.randn(m, w1.shape[2], device=device)
            logits = torch.randn(m, NUM_EXPERTS, device=device)
            torch.testing.assert_close(compiled(x, logits), moe(x, logits), rtol=1e-5, atol=1e-5)


BAD_ROUTING = {
    # routing keywords (topk 2), exception, message
    "groups_not_dividing_E": ({"num_expert_group": 4}, ValueError,
                              "fused_moe: num_expert_group must be >= 1 and divide E = 15, got 4"),
    "topk_group": ({"num_expert_group": 5, "topk_group": 6}, ValueError,
                   "fused_moe: topk_group must be in [1, num_expert_group] = [1, 5], got 6"),
    "topk": ({"num_expert_group": 5, "topk": 4}, ValueError,
             "fused_moe: topk must be in [1, topk_group * E / num_expert_group] = [1, 3], got 4"),
    "bias_shape": ({"e_score_correction_bias": torch.zeros(12)}, RuntimeError,
                   "fused_moe: e_score_correction_bias must have shape [E = gating_output.shape[1]] = [15], got [12]"),
    "bias_one_per_group": ({"num_expert_group": 15, "topk_group": 2, "e_score_correction_bias": torch.zeros(15)},
                           ValueError, "fused_moe: e_score_correction_bias needs E / num_expert_group >= 2"),
    "scoring_func": ({"scoring_func": "relu"}, ValueError,
                     "fused_moe: scoring_func must be one of ('softmax', 'sigmoid'), got 'relu'"),
}


@pytest.mark.parametrize("name", BAD_ROUTING)
def test_grouped_routing_bad_inputs_name_the_argument(name):
    routing, error, message = BAD_ROUTING[name]
    routing = dict(routing)
    topk = routing.pop("topk", 2)
    x, w1, w2, logits, kwargs = make_case(3, "none", num_experts=NUM_EXPERTS)
    with pytest.raises(error) as info:
        fused_moe(x, w1, w2, logits, topk, True, **routing, **kwargs)
    assert message in str(info.value)
