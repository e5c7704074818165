"""The rows expert parallelism moves between ranks: their byte layout, where each goes, and the PyTorch
implementations of packing them and of summing the results that come back.

One row per (token, destination rank), not per (token, slot): a token whose topk experts sit on two ranks
sends two rows, each carrying the token's hidden state once and the token's routing restricted to that rank
(the other slots' ids set to -1). The owner computes every slot it holds for the token and sums them
(``fused_experts`` with the row's routing); the token's rank adds up the partial sums of the ranks in rank
order. With topk 8 over 2 ranks that is 2 rows per token instead of 8.

Row layout (``RowFormat``), ``row_bytes`` bytes, a multiple of 16, in a ``uint8 [rows, row_bytes]`` buffer:
- data at byte 0: the hidden state ``K`` elements in its dtype (fp32/fp16/bf16), or with ``fp8`` the e4m3fn
  values ``K`` bytes and, from byte ``round_up(K, 16)``, their fp32 scales per 128 columns (``ceil(K / 128)``),
  quantized as the fp8 block format quantizes activations (``moe_extension.quant.fp8_block``);
- at byte ``meta``: ``int32 ids [topk]`` (global expert ids, -1 for slots of other ranks; a padding row has all
  -1), then ``fp32 weights [topk]`` (the router weights).

``RowPlan`` (``plan_rows``; on CUDA ``moe_extension.kernels._ep_rows.plan_rows_triton``): for ``topk_ids
[M, topk]`` and ``expert_owner [E_global]`` (the rank holding each global expert; anything outside ``[0, W)``
means nobody), ``slot [M, W]``: the row of the send buffer that holds token t's row for rank r (-1: none),
rows grouped by destination in token order. Without a capacity the groups are packed back to back
(``counts`` rows each); with a capacity C the buffer is ``W * C`` rows, group r starting at ``r * C``, and a
token that would be row C or later of a group does not fit (``overflow [M]``; its output is NaN, see
``combine_rows_torch``). Device tensors only: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_extension.quant.fp8_block import FP8_BLOCK, dequantize_fp8_per_token_group, quantize_fp8_per_token_group


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one row (module docstring): ``K`` hidden columns of ``dtype``, ``topk`` slots, e4m3 data with
    per-128-column scales when ``fp8``."""

    K: int
    topk: int
    dtype: torch.dtype
    fp8: bool = False

    @property
    def scale_offset(self) -> int:
        return _round16(self.K)

    @property
    def groups(self) -> int:
        return (self.K + FP8_BLOCK - 1) // FP8_BLOCK

    @property
    def meta(self) -> int:
        data = self.scale_offset + 4 * self.groups if self.fp8 else self.K * torch.finfo(self.dtype).bits // 8
        return _round16(data)

    @property
    def row_bytes(self) -> int:
        return self.meta + _round16(8 * self.topk)

    def data(self, buf: torch.Tensor) -> torch.Tensor:
        """The hidden states ``[rows, K]`` of ``dtype`` (not fp8), a strided view of ``buf``."""
        return buf[:, : self.meta].view(self.dtype)[:, : self.K]

    def fp8_data(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [rows, K] float8_e4m3fn, s [rows, ceil(K / 128)] fp32)``, strided views of ``buf`` (fp8 rows)."""
        q = buf[:, : self.K].view(torch.float8_e4m3fn)
        s = buf[:, self.scale_offset: self.scale_offset + 4 * self.groups].view(torch.float32)
        return q, s

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        """``int32 [rows, topk]`` view of ``buf``."""
        return buf[:, self.meta: self.meta + 4 * self.topk].view(torch.int32)

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        """``fp32 [rows, topk]`` view of ``buf``."""
        return buf[:, self.meta + 4 * self.topk: self.meta + 8 * self.topk].view(torch.float32)

    def hidden_states(self, buf: torch.Tensor) -> torch.Tensor:
        """The rows' hidden states ``[rows, K]`` in ``dtype``: a view, or with fp8 ``q * s`` rounded once (on CUDA
        in one Triton pass, ``dequantize_rows_triton``)."""
        if not self.fp8:
            return self.data(buf)
        if buf.is_cuda:
            from moe_extension.kernels._ep_rows import dequantize_rows_triton

            return dequantize_rows_triton(*self.fp8_data(buf), self.dtype)
        return dequantize_fp8_per_token_group(*self.fp8_data(buf)).to(self.dtype)


@dataclass
class RowPlan:
    """Where each token's rows go (module docstring). ``slot [M, W]`` int64, ``counts [W]`` int64 (rows per
    destination that are sent), ``demand [W]`` int64 (rows per destination wanted: above ``counts`` where the
    capacity is too small), ``overflow [M]`` bool, ``capacity`` (None: exact sizes), and from the Triton plan
    ``source [rows]`` int32 (``t * W + r`` for the row of token t for rank r; unused rows unwritten)."""

    slot: torch.Tensor
    counts: torch.Tensor
    demand: torch.Tensor
    overflow: torch.Tensor
    capacity: int | None
    source: torch.Tensor | None = None

    @staticmethod
    def num_rows(M: int, world_size: int, capacity: int | None) -> int:
        """The send buffer's length: ``W * capacity``, or ``M * W`` (of which ``counts.sum()`` are used)."""
        return M * world_size if capacity is None else world_size * capacity

    @property
    def rows(self) -> int:
        return self.num_rows(self.slot.shape[0], self.slot.shape[1], self.capacity)


def slot_ranks(topk_ids: torch.Tensor, expert_owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[M, topk]`` int64: the rank holding each slot's expert, -1 for an invalid id or an expert no rank holds."""
    e_global = expert_owner.shape[0]
    ids = topk_ids.long()
    known = (ids >= 0) & (ids < e_global)
    rank = torch.where(known, expert_owner.long()[ids.clamp(0, max(e_global - 1, 0))], -1)
    return torch.where((rank >= 0) & (rank < world_size), rank, -1)


def plan_rows(topk_ids: torch.Tensor, expert_owner: torch.Tensor, world_size: int,
              capacity: int | None) -> RowPlan:
    """The ``RowPlan`` of ``topk_ids [M, topk]`` over ``world_size`` ranks (``capacity``: rows per destination, or
    None for exact sizes); PyTorch (``plan_rows_triton`` is the CUDA one). Device tensors, no host sync."""
    M = topk_ids.shape[0]
    rank = slot_ranks(topk_ids, expert_owner, world_size)
    ranks = torch.arange(world_size, device=topk_ids.device)
    hit = (rank.unsqueeze(2) == ranks).any(dim=1)  # [M, W]
    position = hit.long().cumsum(dim=0) - 1  # the token's row index within its destination's group
    counts = hit.long().sum(dim=0)
    if capacity is None:
        start = counts.cumsum(dim=0) - counts
        slot = torch.where(hit, start + position, -1)
        return RowPlan(slot, counts, counts, torch.zeros(M, dtype=torch.bool, device=hit.device), None)
    fits = hit & (position < capacity)
    slot = torch.where(fits, ranks * capacity + position, -1)
    return RowPlan(slot, counts.clamp(max=capacity), counts, (hit & ~fits).any(dim=1), capacity)


def pack_rows_torch(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_owner: torch.Tensor, plan: RowPlan, fmt: RowFormat) -> torch.Tensor:
    """The send buffer ``uint8 [plan.rows, fmt.row_bytes]``: row ``plan.slot[t, r]`` holds token t's hidden state
    (fp8: quantized) with its ids on rank r and its weights; unused rows hold ids -1 and zeros."""
    M, W = plan.slot.shape
    buf = torch.zeros((plan.rows + 1, fmt.row_bytes), dtype=torch.uint8, device=hidden_states.device)
    fmt.ids(buf).fill_(-1)
    data = torch.zeros((M, fmt.meta), dtype=torch.uint8, device=buf.device)
    if fmt.fp8:
        q, s = quantize_fp8_per_token_group(hidden_states)
        data[:, : fmt.K] = q.view(torch.uint8)
        data[:, fmt.scale_offset: fmt.scale_offset + 4 * fmt.groups] = s.view(torch.uint8)
    else:
        data[:, : fmt.K * hidden_states.element_size()] = hidden_states.contiguous().view(torch.uint8)
    ranks = torch.arange(W, device=buf.device)
    rank = slot_ranks(topk_ids, expert_owner, W)
    ids = torch.where(rank.unsqueeze(1) == ranks[None, :, None], topk_ids.int().unsqueeze(1), -1)  # [M, W, topk]
    meta = torch.zeros((M, W, fmt.row_bytes - fmt.meta), dtype=torch.uint8, device=buf.device)
    meta[..., : 4 * fmt.topk] = ids.contiguous().view(torch.uint8)
    meta[..., 4 * fmt.topk: 8 * fmt.topk] = (topk_weights.float().unsqueeze(1).expand(M, W, fmt.topk)
                                             .contiguous().view(torch.uint8))
    rows = torch.cat((data.unsqueeze(1).expand(M, W, fmt.meta), meta), dim=2).reshape(M * W, fmt.row_bytes)
    slot = plan.slot.reshape(-1)
    buf.index_copy_(0, torch.where(slot >= 0, slot, plan.rows), rows)  # unsent rows land in the spare last row
    return buf[: plan.rows]


def combine_rows_torch(returned: torch.Tensor, plan: RowPlan, dtype: torch.dtype) -> torch.Tensor:
    """``out [M, K]`` in ``dtype``: per token the returned rows ``returned[plan.slot[t, r]]`` summed in fp32 in rank
    order r = 0 .. W-1 (a slot of -1 adds nothing), rounded once; NaN for a token with ``plan.overflow``."""
    M, W = plan.slot.shape
    out = torch.zeros((M, returned.shape[1]), dtype=torch.float32, device=returned.device)
    for r in range(W):
        s = plan.slot[:, r]
        rows = returned[s.clamp(min=0)].float() if returned.shape[0] else out
        out = out + torch.where((s >= 0).unsqueeze(1), rows, 0.0)
    out = torch.where(plan.overflow.unsqueeze(1), float("nan"), out)
    return out.to(dtype)
