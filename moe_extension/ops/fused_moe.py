"""The monolithic path: ``moe_ext::fused_moe(hidden_states [M, K], w1, w2, gating_output [M, E_g], topk,
renormalize, activation, *, <fused_experts' keyword arguments>, num_expert_group=1, topk_group=1,
scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0)`` -> ``[M, K]`` in
``hidden_states.dtype``.

It is the routing followed by ``fused_experts`` with the ``(topk_weights, topk_ids)`` it produced, both called
through ``torch.ops.moe_ext`` so that each dispatches by device. The routing is
``topk_softmax(gating_output, topk, renormalize)`` when the five DeepSeek routing arguments keep their
defaults, else ``grouped_topk`` with them (see ``moe_extension/ops/grouped_topk.py``: groups, softmax or
sigmoid scores, a correction bias for the choice only, a scaling factor on the weights). ``gating_output`` has
one logit per global expert: ``E_g = expert_map.shape[0]`` when an ``expert_map`` is given, else ``E``.
"""

from __future__ import annotations

import torch

from moe_extension.ops.fused_experts import check_experts
from moe_extension.ops.grouped_topk import check_grouped_topk
from moe_extension.ops.topk_softmax import check_topk_softmax


def uses_grouped_topk(num_expert_group, topk_group, scoring_func, e_score_correction_bias,
                      routed_scaling_factor) -> bool:
    """Whether any DeepSeek routing argument differs from its default (then ``grouped_topk`` routes)."""
    return e_score_correction_bias is not None or (num_expert_group, topk_group, scoring_func,
                                                   routed_scaling_factor) != (1, 1, "softmax", 1.0)


def route(gating_output, topk, renormalize, num_expert_group=1, topk_group=1, scoring_func="softmax",
          e_score_correction_bias=None, routed_scaling_factor=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` of the monolithic path: ``topk_softmax``, or ``grouped_topk`` when a DeepSeek
    routing argument is given (through ``torch.ops.moe_ext``, so each dispatches by device)."""
    if uses_grouped_topk(num_expert_group, topk_group, scoring_func, e_score_correction_bias, routed_scaling_factor):
        return torch.ops.moe_ext.grouped_topk(
            gating_output, topk, renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
            scoring_func=scoring_func, e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )
    return torch.ops.moe_ext.topk_softmax(gating_output, topk, renormalize)


def check_fused_moe(hidden_states, w1, w2, gating_output, topk, activation, w1_bias, w2_bias, expert_map, quant,
                    w1_scale, w2_scale, backend, num_expert_group, topk_group, scoring_func, e_score_correction_bias,
                    routed_scaling_factor):
    """Validates fused_moe's own arguments (the inner ops check theirs again)."""
    c, (m, _, _, e) = check_experts("fused_moe", hidden_states, w1, w2, activation, w1_bias, w2_bias, expert_map,
                                    quant, w1_scale, w2_scale, backend)
    if uses_grouped_topk(num_expert_group, topk_group, scoring_func, e_score_correction_bias, routed_scaling_factor):
        check_grouped_topk(gating_output, topk, num_expert_group, topk_group, scoring_func, e_score_correction_bias,
                           op="fused_moe")
    else:
        check_topk_softmax(gating_output, topk, op="fused_moe")
    e_global, what = (e, "w1.shape[0]") if expert_map is None else (expert_map.shape[0], "expert_map.shape[0]")
    c.tensor("gating_output", gating_output, (gating_output.dtype,), f"[M, E_global = {what}]", (m, e_global))


def _fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, activation="silu", *, w1_bias=None,
               w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none", w1_scale=None,
               w2_scale=None, alpha=1.702, limit=7.0, backend="auto", num_expert_group=1, topk_group=1,
               scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0):
    check_fused_moe(hidden_states, w1, w2, gating_output, topk, activation, w1_bias, w2_bias, expert_map, quant,
                    w1_scale, w2_scale, backend, num_expert_group, topk_group, scoring_func, e_score_correction_bias,
                    routed_scaling_factor)
    topk_weights, topk_ids = route(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                                   e_score_correction_bias, routed_scaling_factor)
    return torch.ops.moe_ext.fused_experts(
        hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=w1_bias, w2_bias=w2_bias,
        expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input, quant=quant,
        w1_scale=w1_scale, w2_scale=w2_scale, alpha=alpha, limit=limit, backend=backend,
    )


torch.library.define(
    "moe_ext::fused_moe",
    "(Tensor hidden_states, Tensor w1, Tensor w2, Tensor gating_output, int topk, bool renormalize, "
    'str activation="silu", *, Tensor? w1_bias=None, Tensor? w2_bias=None, Tensor? expert_map=None, '
    'bool apply_router_weight_on_input=False, str quant="none", Tensor? w1_scale=None, Tensor? w2_scale=None, '
    'float alpha=1.702, float limit=7.0, str backend="auto", int num_expert_group=1, int topk_group=1, '
    'str scoring_func="softmax", Tensor? e_score_correction_bias=None, float routed_scaling_factor=1.0) -> Tensor',
)
# The same composition serves every device and the fake: under FakeTensorMode the inner ops run their fakes.
torch.library.register_fake("moe_ext::fused_moe")(_fused_moe)
torch.library.impl("moe_ext::fused_moe", ("cpu", "cuda"))(_fused_moe)


def fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, activation="silu", *, w1_bias=None,
              w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none", w1_scale=None,
              w2_scale=None, alpha=1.702, limit=7.0, backend="auto", num_expert_group=1, topk_group=1,
              scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0) -> torch.Tensor:
    """``torch.ops.moe_ext.fused_moe``: routing + experts, ``[M, K]`` (see the module docstring)."""
    return torch.ops.moe_ext.fused_moe(
        hidden_states, w1, w2, gating_output, topk, renormalize, activation, w1_bias=w1_bias, w2_bias=w2_bias,
        expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input, quant=quant,
        w1_scale=w1_scale, w2_scale=w2_scale, alpha=alpha, limit=limit, backend=backend,
        num_expert_group=num_expert_group, topk_group=topk_group, scoring_func=scoring_func,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
    )
