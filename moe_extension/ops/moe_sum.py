"""Sum of the top-k expert outputs of each token: ``moe_ext::moe_sum`` (C++/CUDA) with its fake, a
functional wrapper and the PyTorch reference.

``moe_sum(input [M, topk, K], output [M, K], topk_ids [M, topk]?, expert_map [E_global]?)`` writes
``output[m] = sum_j input[m, j]`` over the valid slots j, accumulated in fp32 and rounded once to the
dtype of ``input`` (fp32/fp16/bf16; ``output`` has the same dtype; the last dim of both is contiguous,
other strides are free). Without ``topk_ids`` every slot is valid; with ``topk_ids`` (int32/int64) a
slot with id < 0 is invalid; with ``expert_map`` (int32 [E_global]) too, a slot with id >= E_global or
``expert_map[id] < 0``. Invalid slots contribute exactly 0, even when they hold NaN or Inf.
"""

from __future__ import annotations

import torch

from moe_extension.ops.activations import check_last_dim_contiguous
from moe_extension.ops.arg_checks import require, require_type

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ID_DTYPES = (torch.int32, torch.int64)


def _dtype_check(cond: bool, message: str) -> None:
    require_type(cond, lambda: message)


def _check_moe_sum(input, output, topk_ids, expert_map) -> None:
    """The checks of csrc/checks.h (moe_sum_args), same order, types and messages."""
    op = "moe_sum"
    require(input.dim() == 3, lambda: f"{op}: input must have 3 dims [M, topk, K], got {input.dim()} dims")
    _dtype_check(input.dtype in _FLOAT_DTYPES, f"{op}: input must be float32, float16 or bfloat16, got {input.dtype}")
    _dtype_check(
        output.dtype == input.dtype,
        f"{op}: output must have the dtype of input ({input.dtype}), got {output.dtype}",
    )
    require(
        output.device == input.device,
        lambda: f"{op}: output must be on the device of input ({input.device}), got {output.device}",
    )
    m, topk, k = input.shape
    require(
        output.dim() == 2 and output.shape[0] == m and output.shape[1] == k,
        lambda: f"{op}: output must have shape [M, K] = [{m}, {k}], got {list(output.shape)}",
    )
    check_last_dim_contiguous(op, "input", input)
    check_last_dim_contiguous(op, "output", output)
    if topk_ids is not None:
        require(
            topk_ids.device == input.device,
            lambda: f"{op}: topk_ids must be on the device of input ({input.device}), got {topk_ids.device}",
        )
        _dtype_check(topk_ids.dtype in _ID_DTYPES, f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
        require(
            topk_ids.dim() == 2 and topk_ids.shape[0] == m and topk_ids.shape[1] == topk,
            lambda: f"{op}: topk_ids must have shape [M, topk] = [{m}, {topk}], got {list(topk_ids.shape)}",
        )
    if expert_map is not None:
        require(topk_ids is not None, lambda: f"{op}: expert_map needs topk_ids")
        require(
            expert_map.device == input.device,
            lambda: f"{op}: expert_map must be on the device of input ({input.device}), got {expert_map.device}",
        )
        _dtype_check(expert_map.dtype == torch.int32, f"{op}: expert_map must be int32, got {expert_map.dtype}")
        require(
            expert_map.dim() == 1,
            lambda: f"{op}: expert_map must have 1 dim [E_global], got {expert_map.dim()} dims",
        )


@torch.library.register_fake("moe_ext::moe_sum")
def _moe_sum_fake(input, output, topk_ids=None, expert_map=None) -> None:
    _check_moe_sum(input, output, topk_ids, expert_map)


def moe_sum(
    input: torch.Tensor, topk_ids: torch.Tensor | None = None, expert_map: torch.Tensor | None = None
) -> torch.Tensor:
    """``input [M, topk, K]`` summed over the valid slots -> a new contiguous ``[M, K]`` tensor."""
    if input.dim() != 3:  # static under tracing; the op's own checks cover the rest
        raise RuntimeError(f"moe_sum: input must have 3 dims [M, topk, K], got {input.dim()} dims")
    output = input.new_empty((input.shape[0], input.shape[2]))
    torch.ops.moe_ext.moe_sum(input, output, topk_ids, expert_map)
    return output


def _valid_slots(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[M, topk]``: which slots contribute (id >= 0; with a map also id < E_global, map[id] >= 0)."""
    ids = topk_ids.long()
    valid = ids >= 0
    if expert_map is not None:
        num_global = expert_map.shape[0]
        valid &= ids < num_global
        if num_global > 0:
            valid &= expert_map.long()[ids.clamp(0, num_global - 1)] >= 0
    return valid


def moe_sum_torch(
    input: torch.Tensor, topk_ids: torch.Tensor | None = None, expert_map: torch.Tensor | None = None
) -> torch.Tensor:
    """PyTorch reference: fp32 sum over the valid slots (invalid ones replaced by 0 with ``where``, so
    NaN/Inf there never leak), rounded once to ``input.dtype``. Any device."""
    x = input.float()
    if topk_ids is not None:
        valid = _valid_slots(topk_ids, expert_map)
        x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum(dim=1).to(input.dtype)
