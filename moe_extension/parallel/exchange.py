"""Expert parallelism's three phases on one rank of a torch.distributed group: dispatch, experts, combine.

- ``dispatch``: plan and pack this rank's rows (``moe_extension.parallel.rows``), then ``all_to_all_single``
  them. Without a capacity (exact sizes) the row counts are exchanged on the device first and read on the host
  for the split sizes (one sync: eager and prefill; the host reads them while the GPU packs the rows); with a
  capacity every rank sends ``capacity`` rows to every rank (padding rows have ids -1), sizes come from
  shapes, no host sync: CUDA-graph capturable.
- ``experts``: ``fused_experts`` on the received rows, with their routing and this rank's ``expert_map``: each
  row's output is the sum over the token's slots on this rank (in the token's dtype).
- ``combine``: the outputs go back by the reverse ``all_to_all_single``; each token sums its rows in rank
  order in fp32 (``combine_rows``): deterministic.

A token that does not fit its capacity: its output is NaN, and outside CUDA-graph capture every rank raises
the same RuntimeError after the collectives (the ranks' row demands are max-reduced first, so no rank is left
waiting in a collective). Collectives run through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_extension.parallel.rows import RowFormat, RowPlan, combine_rows_torch, pack_rows_torch, plan_rows

OP = "ep_fused_experts"


def resolve_group(group_name: str):
    """The process group called ``group_name`` (``ProcessGroup.group_name``); ValueError naming it if none."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001  (the message names the cause)
        raise ValueError(
            f"{OP}: group_name={group_name!r} names no process group of this process "
            f"(pass ProcessGroup.group_name of an initialized torch.distributed group): {e}"
        ) from e


def plan(topk_ids, expert_owner, world: int, capacity: int | None) -> RowPlan:
    """The row plan: on CUDA one Triton launch, elsewhere PyTorch."""
    if topk_ids.is_cuda:
        from moe_extension.kernels._ep_rows import plan_rows_triton

        return plan_rows_triton(topk_ids, expert_owner, world, capacity)
    return plan_rows(topk_ids, expert_owner, world, capacity)


def pack(hidden_states, topk_weights, topk_ids, expert_owner, row_plan: RowPlan, fmt: RowFormat) -> torch.Tensor:
    """The send buffer: on CUDA one Triton launch, elsewhere PyTorch."""
    if hidden_states.is_cuda:
        from moe_extension.kernels._ep_rows import pack_rows_triton

        return pack_rows_triton(hidden_states, topk_weights, topk_ids, expert_owner, row_plan, fmt)
    return pack_rows_torch(hidden_states, topk_weights, topk_ids, expert_owner, row_plan, fmt)


def combine_rows(returned: torch.Tensor, plan: RowPlan, dtype: torch.dtype) -> torch.Tensor:
    if returned.is_cuda:
        from moe_extension.kernels._ep_rows import combine_rows_triton

        return combine_rows_triton(returned, plan, dtype)
    return combine_rows_torch(returned, plan, dtype)


@dataclass
class Dispatched:
    """One dispatch: the plan of this rank's rows, the received rows ``recv [R, row_bytes]`` and, without a
    capacity, the host split sizes (rows sent to / received from each rank)."""

    plan: RowPlan
    fmt: RowFormat
    recv: torch.Tensor
    send_counts: list[int] | None
    recv_counts: list[int] | None


def dispatch(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             expert_owner: torch.Tensor, group, capacity: int | None, fp8: bool) -> Dispatched:
    """Sends each token's rows to the ranks owning its experts (module docstring)."""
    world = dist.get_world_size(group)
    fmt = RowFormat(hidden_states.shape[1], topk_ids.shape[1], hidden_states.dtype, fp8)
    row_plan = plan(topk_ids, expert_owner, world, capacity)
    if capacity is not None:
        send = pack(hidden_states, topk_weights, topk_ids, expert_owner, row_plan, fmt)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return Dispatched(row_plan, fmt, recv, None, None)
    # exact sizes: the counts go to the host while the GPU packs the rows (the host waits for the plan and the
    # counts' exchange only)
    recv_counts = torch.empty_like(row_plan.counts)
    dist.all_to_all_single(recv_counts, row_plan.counts, group=group)
    counts = torch.stack((row_plan.counts, recv_counts)).to("cpu", non_blocking=True)
    counted = torch.cuda.Event() if row_plan.counts.is_cuda else None
    if counted is not None:
        counted.record(torch.cuda.current_stream(row_plan.counts.device))
    send = pack(hidden_states, topk_weights, topk_ids, expert_owner, row_plan, fmt)
    if counted is not None:
        counted.synchronize()
    send_counts, recv_counts = counts.tolist()
    recv = send.new_empty((sum(recv_counts), fmt.row_bytes))
    dist.all_to_all_single(recv, send[: sum(send_counts)], recv_counts, send_counts, group=group)
    return Dispatched(row_plan, fmt, recv, send_counts, recv_counts)


def combine(d: Dispatched, y: torch.Tensor, group, dtype: torch.dtype) -> torch.Tensor:
    """Returns the rows' outputs ``y [R, K]`` to their tokens' ranks and sums them per token: ``[M, K]``."""
    returned = y.new_empty((d.plan.rows if d.send_counts is None else sum(d.send_counts), y.shape[1]))
    if d.send_counts is None:
        dist.all_to_all_single(returned, y, group=group)
    else:
        dist.all_to_all_single(returned, y, d.send_counts, d.recv_counts, group=group)
    return combine_rows(returned, d.plan, dtype)


def check_capacity(d: Dispatched, capacity: int, group) -> None:
    """Every rank raises the same RuntimeError if any rank's rows did not fit ``capacity`` (one max-reduce of
    the ranks' row demands and a host sync; not callable during CUDA-graph capture)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    demand = torch.zeros((world, world), dtype=torch.int64, device=d.plan.counts.device)
    demand[rank] = d.plan.demand
    dist.all_reduce(demand, op=dist.ReduceOp.MAX, group=group)
    need = int(demand.max())
    if need > capacity:
        src, dst = divmod(int(demand.argmax()), world)
        raise RuntimeError(
            f"{OP}: capacity={capacity} rows per (source, destination) rank pair is too small: rank {src} has "
            f"{need} tokens with experts on rank {dst}; the tokens that did not fit have NaN outputs. Pass "
            f"capacity >= {need} (the worst case is the most tokens a rank passes in one call)"
        )


def ep_fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, expert_owner, group_name,
                          activation, capacity, dispatch_dtype, **experts_kwargs) -> torch.Tensor:
    """The body of ``moe_ext::ep_fused_experts`` on any device (arguments checked by the caller)."""
    group = resolve_group(group_name)
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    if capacity is None and capturing:
        raise RuntimeError(
            f"{OP}: capacity=None exchanges exact row counts, which needs a host sync: it cannot run during "
            "CUDA-graph capture. Pass a capacity (rows per rank pair; the most tokens a rank passes is enough)"
        )
    d = dispatch(hidden_states, topk_weights, topk_ids, expert_owner, group, capacity, dispatch_dtype == "fp8")
    fmt = d.fmt
    y = torch.ops.moe_ext.fused_experts(
        fmt.hidden_states(d.recv), w1, w2, fmt.weights(d.recv).contiguous(), fmt.ids(d.recv).contiguous(),
        activation, expert_map=expert_map, **experts_kwargs,
    )
    out = combine(d, y, group, hidden_states.dtype)
    if capacity is not None and not capturing:
        check_capacity(d, capacity, group)
    return out
