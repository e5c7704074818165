"""``ExpertParallelMoE``: an expert-parallel MoE layer (the routed experts) over a torch.distributed group.

Each rank constructs it with its own experts (``w1 [E, 2N, K]``, ``w2 [E, K, N]`` in the ops' layout, any
``quant`` with scales and biases) and its ``expert_map [E_global]`` (``contiguous_expert_map`` for the usual
split, or any map); construction all-gathers the maps once (``ExpertPlacement``), so every rank constructs it
at the same time. ``forward(hidden_states, topk_weights, topk_ids)`` takes this rank's tokens with their
routing (global ids); ``forward_logits(hidden_states, gating_output, topk, renormalize, ...)`` routes first
(the monolithic form: ``topk_softmax``, or DeepSeek's ``grouped_topk`` when its arguments are given). Both
return this rank's ``[M, K]`` through ``torch.ops.moe_ext.ep_fused_experts``: one op, so the layer traces
with ``torch.compile(fullgraph=True)`` and, with a ``capacity``, captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_extension.ops.fused_moe import route
from moe_extension.parallel.placement import ExpertPlacement


class ExpertParallelMoE(torch.nn.Module):
    """The routed experts of one rank of an expert-parallel layer (module docstring).

    ``capacity``: None exchanges exact row counts (a host sync per call); an int is the rows a rank sends to
    each rank per call (no host sync, capturable; the most tokens a rank passes never overflows).
    ``dispatch_dtype``: "auto" (rows in the tokens' dtype) or "fp8" (e4m3 rows with per-128-column scales).
    The other arguments are ``fused_experts``'."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, expert_map: torch.Tensor, group=None, *,
                 activation: str = "silu", w1_bias=None, w2_bias=None, quant: str = "none", w1_scale=None,
                 w2_scale=None, alpha: float = 1.702, limit: float = 7.0, capacity: int | None = None,
                 dispatch_dtype: str = "auto", backend: str = "auto"):
        super().__init__()
        group = dist.group.WORLD if group is None else group
        self.group_name = group.group_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        device = w1.device  # NCCL gathers CUDA tensors, gloo CPU ones: the weights' device is the group's
        expert_map = expert_map.to(device=device, dtype=torch.int32)
        self.placement = ExpertPlacement.gather(expert_map, w1.shape[0], group)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.register_buffer("expert_owner", self.placement.expert_owner.to(device), persistent=False)
        self.w1, self.w2, self.w1_bias, self.w2_bias = w1, w2, w1_bias, w2_bias
        self.w1_scale, self.w2_scale = w1_scale, w2_scale
        self.activation, self.quant, self.alpha, self.limit = activation, quant, alpha, limit
        self.capacity, self.dispatch_dtype, self.backend = capacity, dispatch_dtype, backend

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                apply_router_weight_on_input: bool = False) -> torch.Tensor:
        return torch.ops.moe_ext.ep_fused_experts(
            hidden_states, self.w1, self.w2, topk_weights, topk_ids, self.expert_map, self.expert_owner,
            self.group_name, self.activation, capacity=self.capacity, dispatch_dtype=self.dispatch_dtype,
            w1_bias=self.w1_bias, w2_bias=self.w2_bias, apply_router_weight_on_input=apply_router_weight_on_input,
            quant=self.quant, w1_scale=self.w1_scale, w2_scale=self.w2_scale, alpha=self.alpha, limit=self.limit,
            backend=self.backend,
        )

    def forward_logits(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                       renormalize: bool, *, num_expert_group: int = 1, topk_group: int = 1,
                       scoring_func: str = "softmax", e_score_correction_bias=None,
                       routed_scaling_factor: float = 1.0, apply_router_weight_on_input: bool = False) -> torch.Tensor:
        """Routes ``gating_output [M, E_global]`` as ``fused_moe`` does, then ``forward``."""
        topk_weights, topk_ids = route(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                                       e_score_correction_bias, routed_scaling_factor)
        return self.forward(hidden_states, topk_weights, topk_ids, apply_router_weight_on_input)
