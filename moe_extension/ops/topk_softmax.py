"""Routing: ``moe_ext::topk_softmax(gating_output [M, E], topk, renormalize=False)`` ->
``(topk_weights fp32 [M, topk], topk_ids int32 [M, topk])``.

- ``renormalize=True``: the top-k of the raw logits, then a softmax over the k chosen values.
- ``renormalize=False``: a softmax over all E, then the top-k of the probabilities (not renormalized).

Any ``1 <= topk <= E``; slots in decreasing weight order, ties to the lower expert id. Logits are
fp32/fp16/bf16, math in fp32. On CUDA the Triton kernel runs (``moe_extension.kernels``); elsewhere
``topk_softmax_torch``.
"""

from __future__ import annotations

import torch

from moe_extension.ops.arg_checks import FLOAT_DTYPES, ArgChecker, require_value


def check_topk_softmax(gating_output: torch.Tensor, topk: int, op: str = "topk_softmax"):
    """Validates the routing arguments; returns (M, E)."""
    c = ArgChecker(op, "gating_output", gating_output)
    c.rank("gating_output", gating_output, FLOAT_DTYPES, "[M, E]")
    m, e = gating_output.shape
    require_value(topk >= 1, lambda: f"{op}: topk must be in [1, E] = [1, {e}], got {topk}")
    require_value(topk <= e, lambda: f"{op}: topk must be in [1, E] = [1, {e}], got {topk}")
    return m, e


def topk_softmax_torch(gating_output: torch.Tensor, topk: int, renormalize: bool = False):
    """PyTorch implementation of topk_softmax (any device)."""
    check_topk_softmax(gating_output, topk)
    logits = gating_output.float()
    # NOTE: a stable descending sort instead of torch.topk: topk does not promise the lower id first
    # among equal values. E <= a few hundred, so the full sort costs little next to the experts.
    if renormalize:
        values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        weights = torch.softmax(values[:, :topk], dim=-1)
    else:
        probs, ids = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True, stable=True)
        weights = probs[:, :topk]
    return weights.contiguous(), ids[:, :topk].to(torch.int32).contiguous()


torch.library.define(
    "moe_ext::topk_softmax", "(Tensor gating_output, int topk, bool renormalize=False) -> (Tensor, Tensor)"
)


@torch.library.register_fake("moe_ext::topk_softmax")
def _topk_softmax_fake(gating_output, topk, renormalize=False):
    m, _ = check_topk_softmax(gating_output, topk)
    return (
        gating_output.new_empty((m, topk), dtype=torch.float32),
        gating_output.new_empty((m, topk), dtype=torch.int32),
    )


torch.library.impl("moe_ext::topk_softmax", "cpu")(topk_softmax_torch)


@torch.library.impl("moe_ext::topk_softmax", "cuda")
def _topk_softmax_cuda(gating_output, topk, renormalize=False):
    check_topk_softmax(gating_output, topk)
    from moe_extension.kernels import topk_softmax_triton

    return topk_softmax_triton(gating_output, topk, renormalize)


def topk_softmax(gating_output: torch.Tensor, topk: int, renormalize: bool = False):
    """``torch.ops.moe_ext.topk_softmax``: ``(topk_weights fp32 [M, topk], topk_ids int32 [M, topk])``."""
    return torch.ops.moe_ext.topk_softmax(gating_output, topk, renormalize)
