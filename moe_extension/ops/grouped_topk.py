"""DeepSeek routing (grouped top-k): ``moe_ext::grouped_topk(gating_output [M, E], topk, renormalize=False, *,
num_expert_group=1, topk_group=1, scoring_func="softmax", e_score_correction_bias=None,
routed_scaling_factor=1.0)`` -> ``(topk_weights fp32 [M, topk], topk_ids int32 [M, topk])``.

With ``G = num_expert_group`` and ``g = topk_group``, per row:

- scores ``s``: ``scoring_func="softmax"`` a softmax over the E logits, ``"sigmoid"`` an elementwise sigmoid;
- choice scores ``c = s + e_score_correction_bias`` (fp32 ``[E]``) when a bias is given, else ``c = s``;
- the experts form G contiguous groups of ``E / G``. A group's score is the sum of its two largest ``c`` with
  a bias (so a bias needs ``E / G >= 2``), else its largest ``c``. The g best groups are kept (ties: the
  lower group);
- the topk experts with the largest ``c`` among the kept groups are picked (ties: the lower expert id), in
  decreasing ``c`` order. Their weights are their ``s`` (never ``c``); ``renormalize`` divides them by
  their sum; then they are multiplied by ``routed_scaling_factor``.

``G = g = 1`` without a bias and with softmax is ``topk_softmax`` with the same ``renormalize``: the same
ids (unless two different logits round to the same fp32 score, which ties here), and weights equal up to
fp32 rounding (with ``renormalize=True``, ``topk_softmax``'s softmax over the k chosen logits is
``p_i / sum_j p_j`` of the softmax probabilities ``p``). Requires ``E <= MAX_EXPERTS`` (512, the Triton
kernel's tile, checked on every device so that a model fails alike everywhere), ``E % G == 0``,
``1 <= g <= G`` and ``1 <= topk <= g * E / G``. Logits are fp32/fp16/bf16, math in fp32. On CUDA the Triton
kernel runs (``moe_extension.kernels``); elsewhere ``grouped_topk_torch``.
"""

from __future__ import annotations

import torch

from moe_extension.ops.arg_checks import FLOAT_DTYPES, ArgChecker, require_value

SCORING_FUNCS = ("softmax", "sigmoid")
MAX_EXPERTS = 512


def check_grouped_topk(gating_output: torch.Tensor, topk: int, num_expert_group: int, topk_group: int,
                       scoring_func: str, e_score_correction_bias: torch.Tensor | None, op: str = "grouped_topk"):
    """Validates the routing arguments; returns (M, E)."""
    c = ArgChecker(op, "gating_output", gating_output)
    c.rank("gating_output", gating_output, FLOAT_DTYPES, "[M, E]")
    m, e = gating_output.shape
    require_value(e <= MAX_EXPERTS, lambda: f"{op}: gating_output must have E <= {MAX_EXPERTS} experts "
                                            f"(columns), got {e}")
    groups = num_expert_group
    require_value(groups >= 1 and e % groups == 0,
                  lambda: f"{op}: num_expert_group must be >= 1 and divide E = {e}, got {groups}")
    require_value(1 <= topk_group <= groups, lambda: f"{op}: topk_group must be in [1, num_expert_group] = "
                                                     f"[1, {groups}], got {topk_group}")
    group_size = e // groups
    most = topk_group * group_size
    require_value(1 <= topk <= most, lambda: f"{op}: topk must be in [1, topk_group * E / num_expert_group] "
                                             f"= [1, {most}], got {topk}")
    c.name("scoring_func", scoring_func, SCORING_FUNCS)
    if e_score_correction_bias is not None:
        c.tensor("e_score_correction_bias", e_score_correction_bias, (torch.float32,),
                 "[E = gating_output.shape[1]]", (e,))
        require_value(
            group_size >= 2,
            lambda: f"{op}: e_score_correction_bias needs E / num_expert_group >= 2 experts per group (a group's "
                    f"score is then the sum of its two largest choice scores), got {e} / {groups} = {group_size}",
        )
    return m, e


def grouped_topk_torch(gating_output: torch.Tensor, topk: int, renormalize: bool = False, *,
                       num_expert_group: int = 1, topk_group: int = 1, scoring_func: str = "softmax",
                       e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0):
    """PyTorch implementation of grouped_topk (any device)."""
    m, e = check_grouped_topk(gating_output, topk, num_expert_group, topk_group, scoring_func,
                              e_score_correction_bias)
    logits = gating_output.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    by_group = choice.view(m, num_expert_group, e // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = by_group.amax(dim=-1)
    else:
        group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
    # NOTE: stable descending sorts instead of torch.topk, which does not promise the lower index first among
    # equal values (E <= 512: the sorts cost little next to the experts).
    kept_groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    candidates = choice.masked_fill(~kept.repeat_interleave(e // num_expert_group, dim=1), float("-inf"))
    ids = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


torch.library.define(
    "moe_ext::grouped_topk",
    "(Tensor gating_output, int topk, bool renormalize=False, *, int num_expert_group=1, int topk_group=1, "
    'str scoring_func="softmax", Tensor? e_score_correction_bias=None, float routed_scaling_factor=1.0) '
    "-> (Tensor, Tensor)",
)


@torch.library.register_fake("moe_ext::grouped_topk")
def _grouped_topk_fake(gating_output, topk, renormalize=False, *, num_expert_group=1, topk_group=1,
                       scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0):
    m, _ = check_grouped_topk(gating_output, topk, num_expert_group, topk_group, scoring_func,
                              e_score_correction_bias)
    return (
        gating_output.new_empty((m, topk), dtype=torch.float32),
        gating_output.new_empty((m, topk), dtype=torch.int32),
    )


torch.library.impl("moe_ext::grouped_topk", "cpu")(grouped_topk_torch)


@torch.library.impl("moe_ext::grouped_topk", "cuda")
def _grouped_topk_cuda(gating_output, topk, renormalize=False, *, num_expert_group=1, topk_group=1,
                       scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0):
    check_grouped_topk(gating_output, topk, num_expert_group, topk_group, scoring_func, e_score_correction_bias)
    from moe_extension.kernels import grouped_topk_triton

    return grouped_topk_triton(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                               e_score_correction_bias, routed_scaling_factor)


def grouped_topk(gating_output: torch.Tensor, topk: int, renormalize: bool = False, *, num_expert_group: int = 1,
                 topk_group: int = 1, scoring_func: str = "softmax",
                 e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0):
    """``torch.ops.moe_ext.grouped_topk``: ``(topk_weights fp32 [M, topk], topk_ids int32 [M, topk])``."""
    return torch.ops.moe_ext.grouped_topk(
        gating_output, topk, renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
        scoring_func=scoring_func, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
