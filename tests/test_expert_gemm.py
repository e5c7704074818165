"""expert_gemm1 / expert_gemm2 against the fp64 reference for every quant x bias x expert_map x router-weight
combination; invalid rows exactly 0; the unfused chain (gemm1 -> activation op -> gemm2 -> moe_sum) equals
fused_experts; opcheck; compile."""

import itertools

import pytest
import torch

from moe_extension import ops
from moe_extension.ops import ACTIVATIONS, expert_gemm1, expert_gemm2, fused_experts
from tests.reference import (
    assert_close,
    expert_gemm1_reference,
    expert_gemm2_reference,
    fused_experts_reference,
    opcheck_utils,
    random_expert_map,
    random_experts,
    random_routing,
    tolerance,
)
from tests.utils import DEVICES

QUANTS = ("none", "fp8_block", "mxfp4")
SIZES = {"none": (40, 27), "fp8_block": (136, 144), "mxfp4": (96, 64)}  # (K, N)
COMBOS = list(itertools.product(QUANTS, (False, True), (False, True), (False, True)))
M_TOPK = [(1, 1), (5, 2), (17, 6), (17, 8), (6, 3)]


def make_case(m, topk, quant, *, device="cpu", dtype=torch.float32, bias=False, use_map=False, routed=False,
              transposed=False):
    """(x [M, K], intermediate [M, topk, N], weights dict, kwargs shared by both GEMMs)."""
    k, n = SIZES[quant]
    num_experts = 10
    weights = random_experts(num_experts, k, n, quant, dtype, device, bias=bias, transposed=transposed)
    num_ids = num_experts + 3 if use_map else num_experts
    topk_weights, topk_ids = random_routing(m, num_ids, topk, device=device)
    shared = {"expert_map": random_expert_map(num_ids, num_experts, device) if use_map else None,
              "topk_weights": topk_weights if routed else None, "quant": quant}
    x = torch.randn(m, k).to(dtype).to(device)
    intermediate = torch.randn(m, topk, n).to(dtype).to(device)
    return x, intermediate, topk_ids, weights, shared


def _invalid_rows(topk_ids, expert_map, num_experts):
    ids = topk_ids.long().cpu()
    if expert_map is None:
        return (ids < 0) | (ids >= num_experts)
    emap = expert_map.long().cpu()
    inside = (ids >= 0) & (ids < emap.shape[0])
    local = torch.where(inside, emap[ids.clamp(0, emap.shape[0] - 1)], -1)
    return (local < 0) | (local >= num_experts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant,bias,use_map,routed", COMBOS)
def test_expert_gemm1_matches_reference(device, quant, bias, use_map, routed):
    m, topk = M_TOPK[COMBOS.index((quant, bias, use_map, routed)) % len(M_TOPK)]
    x, _, topk_ids, w, shared = make_case(m, topk, quant, device=device, bias=bias, use_map=use_map, routed=routed)
    kwargs = dict(shared, w1_bias=w["w1_bias"], w1_scale=w["w1_scale"])
    h = expert_gemm1(x, w["w1"], topk_ids, **kwargs)
    assert h.shape == (m, topk, 2 * SIZES[quant][1]) and h.dtype == x.dtype and h.is_contiguous()
    assert_close(h, expert_gemm1_reference(x, w["w1"], topk_ids, **kwargs),
                 tolerance(torch.float32, device, quant))
    invalid = _invalid_rows(topk_ids, shared["expert_map"], 10)
    assert torch.equal(h.cpu()[invalid], torch.zeros_like(h.cpu()[invalid]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant,bias,use_map,routed", COMBOS)
def test_expert_gemm2_matches_reference(device, quant, bias, use_map, routed):
    m, topk = M_TOPK[COMBOS.index((quant, bias, use_map, routed)) % len(M_TOPK)]
    _, a, topk_ids, w, shared = make_case(m, topk, quant, device=device, bias=bias, use_map=use_map, routed=routed)
    invalid = _invalid_rows(topk_ids, shared["expert_map"], 10)
    a[invalid.to(a.device)] = float("nan")  # rows of invalid slots are never read
    kwargs = dict(shared, w2_bias=w["w2_bias"], w2_scale=w["w2_scale"])
    y = expert_gemm2(a, w["w2"], topk_ids, **kwargs)
    assert y.shape == (m, topk, SIZES[quant][0]) and y.dtype == a.dtype and y.is_contiguous()
    assert_close(y, expert_gemm2_reference(a, w["w2"], topk_ids, **kwargs),
                 tolerance(torch.float32, device, quant))
    assert torch.equal(y.cpu()[invalid], torch.zeros_like(y.cpu()[invalid]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_half_precision_and_transposed_weights(device, quant):
    x, a, topk_ids, w, shared = make_case(13, 4, quant, device=device, dtype=torch.bfloat16, bias=True,
                                          use_map=True, routed=True, transposed=True)
    tol = tolerance(torch.bfloat16, device)
    k1 = dict(shared, w1_bias=w["w1_bias"], w1_scale=w["w1_scale"])
    assert_close(expert_gemm1(x, w["w1"], topk_ids, **k1), expert_gemm1_reference(x, w["w1"], topk_ids, **k1), tol)
    k2 = dict(shared, w2_bias=w["w2_bias"], w2_scale=w["w2_scale"])
    assert_close(expert_gemm2(a, w["w2"], topk_ids, **k2), expert_gemm2_reference(a, w["w2"], topk_ids, **k2), tol)


def _activation_op(activation, alpha, limit):
    return {
        "silu": ops.silu_and_mul,
        "gelu": ops.gelu_and_mul,
        "gelu_tanh": ops.gelu_tanh_and_mul,
        "swigluoai": lambda h: ops.swigluoai_and_mul(h, alpha, limit),
        "swiglustep": lambda h: ops.swiglustep_and_mul(h, limit),
    }[activation]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant,activation,on_input", list(itertools.product(QUANTS, ACTIVATIONS, (False, True))))
def test_unfused_chain_equals_fused(device, quant, activation, on_input):
    """expert_gemm1 -> activation op -> expert_gemm2 -> moe_sum is the same computation as fused_experts."""
    x, _, topk_ids, w, shared = make_case(11, 4, quant, device=device, bias=True, use_map=True, routed=True)
    emap, topk_weights, alpha, limit = shared["expert_map"], shared["topk_weights"], 1.5, 6.0
    h = expert_gemm1(x, w["w1"], topk_ids, w1_bias=w["w1_bias"], expert_map=emap, quant=quant,
                     w1_scale=w["w1_scale"], topk_weights=topk_weights if on_input else None)
    a = _activation_op(activation, alpha, limit)(h)
    y = expert_gemm2(a, w["w2"], topk_ids, w2_bias=w["w2_bias"], expert_map=emap, quant=quant,
                     w2_scale=w["w2_scale"], topk_weights=None if on_input else topk_weights)
    unfused = ops.moe_sum(y, topk_ids, emap)
    kwargs = {"w1_bias": w["w1_bias"], "w2_bias": w["w2_bias"], "expert_map": emap, "quant": quant,
              "w1_scale": w["w1_scale"], "w2_scale": w["w2_scale"], "apply_router_weight_on_input": on_input,
              "alpha": alpha, "limit": limit}
    fused = fused_experts(x, w["w1"], w["w2"], topk_weights, topk_ids, activation, **kwargs)
    ref, bound = fused_experts_reference(x, w["w1"], w["w2"], topk_weights, topk_ids, activation, **kwargs,
                                         return_bound=True)
    tol = tolerance(torch.float32, device, quant)
    assert_close(unfused, ref, tol, bound)
    assert_close(fused, ref, tol, bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_zero_tokens(device, quant):
    x, a, topk_ids, w, shared = make_case(0, 3, quant, device=device, bias=True, routed=True)
    h = expert_gemm1(x, w["w1"], topk_ids, **shared, w1_bias=w["w1_bias"], w1_scale=w["w1_scale"])
    y = expert_gemm2(a, w["w2"], topk_ids, **shared, w2_bias=w["w2_bias"], w2_scale=w["w2_scale"])
    assert h.shape == (0, 3, 2 * SIZES[quant][1]) and y.shape == (0, 3, SIZES[quant][0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_opcheck(device, quant):
    x, a, topk_ids, w, shared = make_case(5, 3, quant, device=device, bias=True, use_map=True, routed=True)
    utils = opcheck_utils(quant)
    torch.library.opcheck(torch.ops.moe_ext.expert_gemm1.default, (x, w["w1"], topk_ids),
                          dict(shared, w1_bias=w["w1_bias"], w1_scale=w["w1_scale"]), test_utils=utils)
    torch.library.opcheck(torch.ops.moe_ext.expert_gemm2.default, (a, w["w2"], topk_ids),
                          dict(shared, w2_bias=w["w2_bias"], w2_scale=w["w2_scale"]), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_matches_eager(device):
    torch._dynamo.reset()
    x, _, topk_ids, w, shared = make_case(17, 4, "none", device=device, bias=True, use_map=True, routed=True)

    def chain(x, topk_ids):
        h = expert_gemm1(x, w["w1"], topk_ids, w1_bias=w["w1_bias"], expert_map=shared["expert_map"])
        a = torch.nn.functional.silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2 :]
        return expert_gemm2(a, w["w2"], topk_ids, w2_bias=w["w2_bias"], expert_map=shared["expert_map"],
                            topk_weights=shared["topk_weights"]).sum(1)

    compiled = torch.compile(chain, fullgraph=True)
    tol = tolerance(torch.float32, device)
    torch.testing.assert_close(compiled(x, topk_ids), chain(x, topk_ids), rtol=tol, atol=tol)
