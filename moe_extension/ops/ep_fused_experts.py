"""Expert parallelism in one op: ``moe_ext::ep_fused_experts`` -> ``out [M, K]`` in ``hidden_states.dtype``.

Called by every rank of a torch.distributed group (the same call on each: same ``capacity``, ``dispatch_dtype``
and weight format). Each rank passes its own tokens ``hidden_states [M, K]`` (M may differ between ranks and
be 0) with their routing ``topk_weights [M, topk]`` fp32 / ``topk_ids [M, topk]`` (global expert ids), its own
experts ``w1 [E, 2N, K]`` / ``w2 [E, K, N]`` (any ``quant`` of ``fused_experts``, with scales and biases) and
``expert_map [E_global]`` int32 (global -> local id, -1 for the other ranks' experts), and the group-wide
``expert_owner [E_global]`` int32 (the rank holding each global expert; a value outside ``[0, W)`` means no
rank holds it). The result equals ``fused_experts`` run on one device with every rank's experts, within the
rounding of each rank's partial sum to ``hidden_states.dtype``: a slot whose id is invalid or held by no rank
contributes exactly 0, the slot sum runs in a fixed order (deterministic).

- ``group_name``: ``ProcessGroup.group_name`` (NCCL with CUDA tensors, gloo with CPU tensors).
- ``capacity``: None exchanges exact row counts (a host sync; eager and prefill). An int C sends C rows to
  every rank (one row per token and destination rank): no host sync, CUDA-graph capturable; a token that
  does not fit gets NaN outputs and, outside capture, every rank raises RuntimeError. C = the most tokens any
  rank passes in one call never overflows.
- ``dispatch_dtype``: "auto" moves the rows in ``hidden_states.dtype``; "fp8" moves them as e4m3 values with
  fp32 scales per 128 columns (the fp8 block activation rule, about half the bytes of bf16); the receiving
  rank multiplies them out to ``hidden_states.dtype`` for its experts.

Phases and row layout: ``moe_extension.parallel`` (``exchange``, ``rows``). The other keyword arguments are
``fused_experts``' and apply to each rank's experts.
"""

from __future__ import annotations

import torch

from moe_extension.ops.arg_checks import require_value
from moe_extension.ops.fused_experts import check_experts

DISPATCH_DTYPES = ("auto", "fp8")
OP = "ep_fused_experts"


def check_ep_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, activation,
                           capacity, dispatch_dtype, w1_bias, w2_bias, quant, w1_scale, w2_scale, backend):
    """Validates the arguments (fake and real implementations alike); returns (M, K)."""
    c, (m, k, _, _) = check_experts(OP, hidden_states, w1, w2, activation, w1_bias, w2_bias, expert_map, quant,
                                    w1_scale, w2_scale, backend)
    c.routing(topk_ids, topk_weights, m)
    c.tensor("expert_owner", expert_owner, (torch.int32,), "[E_global] like expert_map", (expert_map.shape[0],))
    c.name("dispatch_dtype", dispatch_dtype, DISPATCH_DTYPES)
    require_value(
        capacity is None or capacity >= 1,
        lambda: f"{OP}: capacity must be None (exact row counts) or >= 1 rows per rank pair, got {capacity}",
    )
    return m, k


torch.library.define(
    "moe_ext::ep_fused_experts",
    "(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor expert_map, "
    'Tensor expert_owner, str group_name, str activation="silu", *, int? capacity=None, '
    'str dispatch_dtype="auto", Tensor? w1_bias=None, Tensor? w2_bias=None, '
    'bool apply_router_weight_on_input=False, str quant="none", Tensor? w1_scale=None, Tensor? w2_scale=None, '
    'float alpha=1.702, float limit=7.0, str backend="auto") -> Tensor',
)


@torch.library.register_fake("moe_ext::ep_fused_experts")
def _ep_fused_experts_fake(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name,
                           activation="silu", *, capacity=None, dispatch_dtype="auto", w1_bias=None, w2_bias=None,
                           apply_router_weight_on_input=False, quant="none", w1_scale=None, w2_scale=None,
                           alpha=1.702, limit=7.0, backend="auto"):
    m, k = check_ep_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner,
                                  activation, capacity, dispatch_dtype, w1_bias, w2_bias, quant, w1_scale, w2_scale,
                                  backend)
    return hidden_states.new_empty((m, k))


@torch.library.impl("moe_ext::ep_fused_experts", ("cpu", "cuda"))
def _ep_fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name,
                           activation="silu", *, capacity=None, dispatch_dtype="auto", w1_bias=None, w2_bias=None,
                           apply_router_weight_on_input=False, quant="none", w1_scale=None, w2_scale=None,
                           alpha=1.702, limit=7.0, backend="auto"):
    check_ep_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, activation,
                           capacity, dispatch_dtype, w1_bias, w2_bias, quant, w1_scale, w2_scale, backend)
    from moe_extension.parallel.exchange import ep_fused_experts_impl

    return ep_fused_experts_impl(
        hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name, activation, capacity,
        dispatch_dtype, w1_bias=w1_bias, w2_bias=w2_bias, apply_router_weight_on_input=apply_router_weight_on_input,
        quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, alpha=alpha, limit=limit, backend=backend,
    )


def ep_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name,
                     activation="silu", *, capacity=None, dispatch_dtype="auto", w1_bias=None, w2_bias=None,
                     apply_router_weight_on_input=False, quant="none", w1_scale=None, w2_scale=None, alpha=1.702,
                     limit=7.0, backend="auto") -> torch.Tensor:
    """``torch.ops.moe_ext.ep_fused_experts``: ``out [M, K]`` (see the module docstring)."""
    return torch.ops.moe_ext.ep_fused_experts(
        hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name, activation,
        capacity=capacity, dispatch_dtype=dispatch_dtype, w1_bias=w1_bias, w2_bias=w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input, quant=quant, w1_scale=w1_scale,
        w2_scale=w2_scale, alpha=alpha, limit=limit, backend=backend,
    )
