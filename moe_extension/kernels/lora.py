"""Launchers of the LoRA kernels (``_lora``): the CUDA implementations of ``moe_ext::lora_shrink``,
``moe_ext::lora_expand`` and ``moe_ext::add_lora`` (arguments already validated by the op layer,
``moe_extension.ops.lora``).

Shapes: ``x [M, K]`` (one input per token) or ``[M, topk, K]`` (one per slot), ``lora_a [L, E, r, K]``,
``lora_b [L, E, n, r]``, ``u [M, topk, r]`` fp32, ``out [M, topk, n]``, ``topk_ids [M, topk]``,
``token_lora_mapping [M]`` int32/int64, ``expert_map [E_global]`` int32, ``topk_weights [M, topk]`` fp32; any
strides. Sizes come from shapes only, every launch goes to the current stream: capture-safe, no host sync.

Schedule (``lora_plan``), P = M * topk pairs: direct for P <= ``DIRECT_MAX_PAIRS`` (no grouping: 1 launch per
shrink or expand), grouped above (2 to 4 launches of grouping, then 1 per shrink or expand). ``add_lora``
groups once for its shrink and expand and keeps ``u`` in sorted order between them; its two halves
(``add_lora_shrink``: grouping and shrink, ``add_lora_expand``) let the GEMM ops run the first beside their GEMM
(``add_lora_shrink_beside``: on a side stream).
``FusedExpand``: a direct shrink's ``u`` handed to a base GEMV that adds the expand in its epilogue
(``expert_gemm1`` / ``expert_gemm2`` with LoRA at decode, ``fused_experts._fused_expand``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_extension.kernels import _lora as kern
from moe_extension.kernels._launch import cdiv, device_guard, next_power_of_2, side_stream, sm_count
from moe_extension.kernels._routing import Routing, route

# NOTE: up to this many pairs the direct schedule runs: it has no grouping launches, but reads the adapters once
# per pair. add_lora of gpt-oss-20b's w13 (E 32, 4 adapters), direct against grouped on the H100, us: rank 16
# M 16 8.4 / 23.9, M 64 (256 pairs) 20.4 / 36.6, M 256 59.0 / 45.5; rank 64 M 64 68.3 / 76.1, M 256 214.7 / 89.1
# (E 128: rank 64 M 64 90.1 / 115.9). Reproduce: python benchmarks/bench_lora.py --models gpt-oss-20b
# --tokens 16 64 256 --schedule direct (and grouped), column add_w13_us.
DIRECT_MAX_PAIRS = 256
_GROUP_IDS_BLOCK = 1024


class LoraPlan(NamedTuple):
    """The schedule of one call: ``routing`` (pairs sorted by group ``l * E + e``) for the grouped one, else None."""

    schedule: str  # "direct" | "grouped"
    routing: Routing | None
    slot_args: tuple  # the slot arguments of the kernels (``_lora.slot_group``)
    num_pairs: int
    topk: int
    num_experts: int


class FusedExpand(NamedTuple):
    """A LoRA expand that a base GEMV adds in its epilogue (``_lora.lora_rows_delta``): ``u [M, topk, r]`` fp32 from
    ``lora_shrink_triton``, ``lora_b [L, E, n, r]`` and ``token_lora_mapping [M]``."""

    u: torch.Tensor
    lora_b: torch.Tensor
    token_lora_mapping: torch.Tensor


def expand_epilogue_args(fused: FusedExpand | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The LoRA arguments of the GEMV kernels (from ``u_ptr`` on) and their constexprs; ``dummy`` fills the pointer
    slots when ``fused`` is None (LORA off)."""
    if fused is None:
        return (dummy, 0, dummy, 0, 0, 0, 0, dummy, 0, 0, 0), dict(LORA=False, BLOCK_R=1)
    u, b, mapping = fused
    R = b.shape[3]
    return ((u, u.stride(-2), b, *b.stride(), mapping, mapping.stride(0), b.shape[0], R),
            dict(LORA=True, BLOCK_R=next_power_of_2(R)))


def lora_block_m(num_pairs: int, num_groups: int) -> int:
    """Pairs per block of the grouped schedule, from the mean pairs per (adapter, expert) group."""
    per_group = num_pairs / num_groups
    return 16 if per_group < 24 else 32 if per_group < 48 else 64


def expand_tiles(nout: int) -> tuple[int, int, int]:
    """(BLOCK_N, TILES, num_warps) of the grouped expand: 128-column tiles, a row's tiles in up to 5 runs of TILES
    (one program per block and run), 4 warps.

    NOTE: H100, add_lora (shrink + expand) of gpt-oss-20b (E 32, 4 adapters), us, one program per column tile (the
    rule this replaced: 128 columns, 256 at rank 64) against runs of 128-column tiles in 1 / 3 / 5 programs per row:
    w13 rank 16 M 1024 80.4 against 95.1 / 84.3 / 77.1, M 4096 237.1 against 232.8 / 204.5 / 203.8; rank 64 M 4096
    329.9 against 292.5 / 247.8 / 248.9; w2 rank 16 M 1024 68.4 against 70.5 / 64.1 / 61.2, M 4096 173.3 against
    166.2 / 154.4 / 156.5; rank 64 M 4096 224.2 against 200.6 / 183.5 / 186.9. 64- and 256-column tiles in 3 runs:
    w13 rank 64 M 4096 281.9 / 329.8, w2 rank 16 M 4096 148.2 / 167.7; one tile per program in launch order along
    the row: 270.0 (w13 rank 16 M 4096). Measured by a sweep of kernel variants around CUDA-graph timings of the
    call (harness.time_graph_us); the product has no switch for it (its figures: python benchmarks/bench_lora.py,
    columns add_w13_us and add_w2_us)."""
    block_n = 128
    tiles = cdiv(nout, block_n)
    return block_n, cdiv(tiles, min(5, tiles)), 4


def _slot_args(topk_ids, expert_map, mapping, num_experts, num_adapters) -> tuple:
    has_map = expert_map is not None
    return (topk_ids, topk_ids.stride(0), topk_ids.stride(1), expert_map if has_map else topk_ids,
            expert_map.numel() if has_map else num_experts, num_experts, topk_ids.numel(), topk_ids.shape[1],
            int(has_map), mapping, mapping.stride(0), num_adapters)


def lora_plan(topk_ids, token_lora_mapping, num_adapters: int, num_experts: int, expert_map=None,
              schedule: str | None = None) -> LoraPlan:
    """Group the pairs for the grouped schedule (``schedule`` None: the rule above; tests force either)."""
    P = topk_ids.numel()
    slot_args = _slot_args(topk_ids, expert_map, token_lora_mapping, num_experts, num_adapters)
    schedule = schedule or ("direct" if P <= DIRECT_MAX_PAIRS else "grouped")
    sizes = (P, topk_ids.shape[1], num_experts)
    if schedule == "direct" or P == 0:
        return LoraPlan("direct", None, slot_args, *sizes)
    groups = torch.empty_like(topk_ids, dtype=torch.int32, memory_format=torch.contiguous_format)
    kern.lora_group_ids_kernel[(cdiv(P, _GROUP_IDS_BLOCK),)](*slot_args, groups, BLOCK=_GROUP_IDS_BLOCK)
    num_groups = num_adapters * num_experts
    routing = route(groups, num_groups, lora_block_m(P, num_groups))
    return LoraPlan("grouped", routing, slot_args, *sizes)


def _x_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(token, slot, column) strides: slot stride 0 for one input per token."""
    if x.dim() == 2:
        return x.stride(0), 0, x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _programs(routing: Routing) -> int:
    # Grid-stride over the blocks: enough programs to fill the GPU, not one per worst-case block.
    return min(routing.max_blocks, 4 * sm_count(routing.sorted_pairs.device))


def _native_dot(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the shrink multiplies x by A on tensor cores in their own dtype (see ``_lora``)."""
    return x.device.type == "cuda" and x.dtype == a.dtype and x.dtype in (torch.bfloat16, torch.float16)


def _expand_mode(b: torch.Tensor) -> int:
    split = b.device.type == "cuda" and b.dtype == torch.bfloat16
    return (kern.EXPAND_BF16_SPLIT if split else kern.EXPAND_F32).value


def _shrink(plan: LoraPlan, x, lora_a, u, sorted_out: bool) -> None:
    """u rows [.., r] (u's row stride u.stride(-2)) of every active pair, by pair or (sorted_out) by sorted row."""
    R, K = lora_a.shape[2], lora_a.shape[3]
    x_args = (x, *_x_strides(x), lora_a, *lora_a.stride(), u, u.stride(-2))
    if plan.schedule == "direct":
        # One row of A per program, in steps of up to 4096 columns: at decode a program loads its row in one step.
        # NOTE: H100, UnfusedOAITritonExperts on gpt-oss-20b (bf16) at M = 1 with 4 adapters, against the call
        # without LoRA: rank 16 1.166 -> 1.105, rank 64 1.201 -> 1.138 with one row per program instead of 4 (16
        # programs at rank 16); 2 rows 1.109; 1 warp or 1024-column steps 1.115-1.117. Measured
        # by a sweep that replaced this launch around CUDA-graph timings of the class (harness.time_graph_us); the
        # product has no switch for it (its figure: python benchmarks/bench_lora.py --tokens 1).
        kern.lora_shrink_direct_kernel[(plan.num_pairs, R)](
            *x_args, *plan.slot_args, R, K, BLOCK_R=1, BLOCK_K=min(4096, next_power_of_2(K)), num_warps=4)
        return
    routing = plan.routing
    block_r = max(16, next_power_of_2(R))
    kern.lora_shrink_grouped_kernel[(_programs(routing),)](
        *x_args, routing.sorted_pairs, routing.block_expert, routing.max_blocks, plan.num_pairs,
        plan.topk, plan.num_experts, R, K, SORTED_OUT=sorted_out, F32=not _native_dot(x, lora_a),
        BLOCK_M=routing.block_m, BLOCK_R=block_r, BLOCK_K=128 if block_r <= 32 else 64, num_warps=4, num_stages=3)


def _expand(plan: LoraPlan, out, u, lora_b, topk_weights, sorted_in: bool) -> None:
    """out[p] += g[p] B[l, e] u[p] for the active pairs (u rows by pair or, sorted_in, by sorted row)."""
    NOUT, R = lora_b.shape[2], lora_b.shape[3]
    w = topk_weights if topk_weights is not None else u
    w_strides = (topk_weights.stride(0), topk_weights.stride(1)) if topk_weights is not None else (0, 0)
    args = (out, out.stride(0), out.stride(1), out.stride(2), u, u.stride(-2), lora_b, *lora_b.stride(), w, *w_strides)
    block_r = max(16, next_power_of_2(R))
    if plan.schedule == "direct":
        block_n = max(16, min(4096 // block_r, next_power_of_2(NOUT)))
        kern.lora_expand_direct_kernel[(plan.num_pairs, cdiv(NOUT, block_n))](
            *args, *plan.slot_args, R, NOUT, HAS_W=topk_weights is not None, BLOCK_N=block_n,
            BLOCK_R=next_power_of_2(R), num_warps=4)
        return
    routing = plan.routing
    block_n, tiles, num_warps = expand_tiles(NOUT)
    kern.lora_expand_grouped_kernel[(_programs(routing), cdiv(cdiv(NOUT, block_n), tiles))](
        *args, routing.sorted_pairs, routing.block_expert, routing.max_blocks, plan.num_pairs, plan.topk,
        plan.num_experts, R, NOUT, SORTED_IN=sorted_in, HAS_W=topk_weights is not None, MODE=_expand_mode(lora_b),
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_R=block_r, TILES=tiles, num_warps=num_warps, num_stages=3)


def lora_shrink_triton(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None, schedule=None) -> torch.Tensor:
    """u [M, topk, r] fp32 = A[l, e] x per pair; rows of inactive pairs 0."""
    M, topk = topk_ids.shape
    L, E, R, _ = lora_a.shape
    with device_guard(x.device):
        plan = lora_plan(topk_ids, token_lora_mapping, L, E, expert_map, schedule)
        # The direct shrink writes every pair's row (0 when inactive); the grouped one only the active pairs.
        alloc = torch.empty if plan.schedule == "direct" else torch.zeros
        u = alloc((M, topk, R), dtype=torch.float32, device=x.device)
        if M:
            _shrink(plan, x, lora_a, u, sorted_out=False)
    return u


def lora_expand_triton(out, u, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None,
                       schedule=None) -> None:
    """out [M, topk, n] += g B[l, e] u per active pair, in place."""
    L, E = lora_b.shape[:2]
    if topk_ids.numel() == 0:
        return
    with device_guard(out.device):
        plan = lora_plan(topk_ids, token_lora_mapping, L, E, expert_map, schedule)
        _expand(plan, out, u, lora_b, topk_weights, sorted_in=False)


class LoraShrunk(NamedTuple):
    """The first half of ``add_lora``: its plan and ``u`` (rows by pair, or by sorted row on the grouped schedule)."""

    plan: LoraPlan
    u: torch.Tensor


def add_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None, schedule=None) -> LoraShrunk:
    """The grouping and the shrink of ``add_lora_triton`` (launched on the current stream); ``add_lora_expand``
    completes it. Neither reads ``out``, so a caller may run this while the GEMM that writes ``out`` runs."""
    L, E, R, _ = lora_a.shape
    with device_guard(x.device):
        plan = lora_plan(topk_ids, token_lora_mapping, L, E, expert_map, schedule)
        if plan.schedule == "direct":
            u = torch.empty((topk_ids.numel(), R), dtype=torch.float32, device=x.device)
        else:
            u = torch.empty((plan.routing.max_blocks * plan.routing.block_m, R), dtype=torch.float32, device=x.device)
        if topk_ids.numel():
            _shrink(plan, x, lora_a, u, sorted_out=True)
    return LoraShrunk(plan, u)


def add_lora_shrink_beside(x, lora_a, topk_ids, token_lora_mapping, expert_map):
    """The LoRA term's grouping and shrink (``add_lora_shrink``) of a sorted-schedule GEMM, launched on a side
    stream (``_launch.side_stream``) so that they run beside the GEMM, which they do not depend on; (None, None)
    without adapters. The caller joins the side stream before ``add_lora_expand`` adds the term to the GEMM's output.
    NOTE: H100, ``UnfusedOAITritonExperts`` with 4 adapters over the same call without LoRA, against the same launches
    on the current stream (CUDA-graph medians of 3 interleaved rounds, bitwise equal outputs): gpt-oss-20b rank 16
    M 256 1.126 -> 1.086, M 1024 1.142 -> 1.097, M 4096 1.152 -> 1.134; rank 64 M 4096 1.175 -> 1.164; gpt-oss-120b
    rank 16 M 4096 1.126 -> 1.118. Measured by an A/B that replaced this function (the product has no switch for
    it; its figures: python benchmarks/bench_lora.py)."""
    if lora_a is None:
        return None, None
    with side_stream(x.device) as side:
        shrunk = add_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map=expert_map)
    return shrunk, side


def add_lora_expand(out, shrunk: LoraShrunk, lora_b, *, topk_weights=None) -> None:
    """out [M, topk, n] += g B[l, e] u per active pair, in place, for ``u`` of ``add_lora_shrink``."""
    if shrunk.plan.num_pairs == 0:
        return
    with device_guard(out.device):
        _expand(shrunk.plan, out, shrunk.u, lora_b, topk_weights, sorted_in=True)


def add_lora_triton(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None,
                    schedule=None) -> None:
    """out [M, topk, n] += g B[l, e] (A[l, e] x) per active pair, in place: one grouping for both GEMMs."""
    if topk_ids.numel() == 0:
        return
    shrunk = add_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map=expert_map, schedule=schedule)
    add_lora_expand(out, shrunk, lora_b, topk_weights=topk_weights)
