"""Device routing for the grouped expert GEMMs: from ``topk_ids`` (and ``expert_map``) the expert-sorted,
block-padded order of the (token, slot) pairs, with no host sync.

Pairs are numbered ``p = t * topk + j`` (``P = M * topk`` of them). Slot ``(t, j)`` has global id
``i = topk_ids[t, j]`` and local expert ``e = expert_map[i]`` (or ``e = i`` without a map); it is dropped
(invalid) when ``i < 0``, ``i >= E_global`` (with a map), ``e < 0`` or ``e >= E``.

Outputs (int32, sized from shapes only: ``max_blocks = P // block_m + min(P, E)`` bounds the number of
non-empty padded blocks, because ``sum_e ceil(c_e / block_m) <= floor(P / block_m) + #non-empty experts``):

- ``sorted_pairs [max_blocks * block_m]``: the valid pairs grouped by expert (experts in increasing order,
  pairs in increasing ``p`` inside an expert: deterministic), each expert's group padded with ``P`` (the
  sentinel) to a multiple of ``block_m``. Entries past the used blocks are never written.
- ``block_expert [max_blocks]``: the local expert of each block of ``block_m`` sorted rows; -1 for the
  blocks past the used ones (the GEMM programs of those blocks exit at once).
- ``inverse [P]``: the sorted position of each pair, -1 for dropped pairs.
- ``expert_counts [E]``: valid pairs per local expert; ``expert_starts [E]``: first sorted position of
  each expert's group.
- ``tiles_done [E]``: zeroed counters for the fused path's gemm1 -> gemm2 handoff (``fused_experts``).

Two schedules: one program does everything for ``P <= SINGLE_PROGRAM_MAX_PAIRS`` (one launch: decode and
small batches; the pairs put in order by one sort of (expert, pair) keys), otherwise three launches: per-chunk
histograms; per-expert prefixes over the chunks (NB / 16 programs, independent columns); per-chunk scatter, whose
pairs also write the block -> expert map (each valid pair the owner of its block), its programs the rest of the plan
(padded starts, the padding, the -1 of the unused blocks), each a share of it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_extension.kernels._launch import cdiv, grid_dependency, next_power_of_2, pdl_options

# NOTE: pairs handled per loop step / per program. 128 = one element per thread at num_warps=4, so the
# histogram layout has no replication, and the [CHUNK, CHUNK] rank matrix is 16 K elements (cheap).
CHUNK = 128
# NOTE: up to this many pairs one program does all the routing (``_route_single_kernel``, one launch instead of
# three: at P 512 4.34 against 8.00 us on an H200, E 256, block_m 16; benchmarks/results/ab_routing_sort_h200.txt),
# on 8 warps from 257 pairs. At 1024 pairs it stopped beating the three launches (a probe on the H200, not kept).
SINGLE_PROGRAM_MAX_PAIRS = 512
# NOTE: the prefix over chunks runs one program per PREFIX_EXPERTS expert columns (independent scans, 8
# programs at E = 128) over tiles of up to PREFIX_ROWS chunks ([256, 16] = 4 K elements: one step up to
# 32 K pairs), and the scatter programs share the plan. It replaced one program that walked all the
# chunks and planned alone (22 us of the routing's 29 at qwen3 M = 4096). Routing on an H100, block_m
# 128, old -> new: qwen3 M = 4096 29.2 -> 12.5 us, M = 16384 83 -> 29 us, gpt-oss M = 4096 20.7 -> 11.4 us.
PREFIX_EXPERTS = 16
PREFIX_ROWS = 256
_NUM_WARPS = 4


class Routing(NamedTuple):
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    inverse: torch.Tensor
    expert_counts: torch.Tensor
    expert_starts: torch.Tensor
    block_m: int
    max_blocks: int
    tiles_done: torch.Tensor


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the non-empty padded blocks: floor(P / block_m) + min(P, E)."""
    return num_pairs // block_m + min(num_pairs, num_experts)


@triton.jit
def local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map):
    """Local expert of pairs ``p`` (any shape of int32 indices) and whether the slot is valid; -1 if not.

    NOTE: topk and has_map are runtime values (one division, one masked load): every kernel that routes
    compiles once for all models and both map settings, which keeps cold-start compiles (a bare GPU
    machine, the test suite, tuning) few.
    """
    in_range = p < P
    t = p // topk
    j = p - t * topk
    gid = tl.load(ids_ptr + t.to(tl.int64) * stride_im + j * stride_ik, mask=in_range, other=-1)
    ok = in_range & (gid >= 0) & (gid < tl.where(has_map != 0, E_global, 0))
    mapped = tl.load(map_ptr + tl.where(ok, gid, 0), mask=ok, other=-1)
    e = tl.where(has_map != 0, mapped, gid)
    # Validity is decided in the ids' own dtype (an int64 id >= 2^31 must not wrap into a valid int32).
    valid = in_range & (e >= 0) & (e < E)
    return tl.where(valid, e, -1).to(tl.int32), valid


@triton.jit
def _chunk_histogram(e, valid, NB: tl.constexpr):
    """Valid pairs per expert bin [NB] of one chunk (tl.histogram needs every value inside [0, NB))."""
    hist = tl.histogram(tl.where(valid, e, 0), NB)
    n_invalid = tl.sum((~valid).to(tl.int32), axis=0)
    return hist - tl.where(tl.arange(0, NB) == 0, n_invalid, 0)


@triton.jit
def _rank_in_chunk(e, valid, CHUNK: tl.constexpr):
    """For each pair of a chunk: how many earlier valid pairs of the chunk have the same expert."""
    i = tl.arange(0, CHUNK)
    same = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _padded_starts(counts, BLOCK_M: tl.constexpr):
    """Per-expert padded group starts and the total of blocks from the counts [NB]."""
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    return (tl.cumsum(nblk, axis=0) - nblk) * BLOCK_M, tl.sum(nblk, axis=0)


@triton.jit
def _write_padding(counts, starts, sorted_ptr, P, e_lo, e_hi, BLOCK_M: tl.constexpr, EB: tl.constexpr):
    """The sentinel P in the padding rows [start + count, padded end) of the experts in [e_lo, e_hi)."""
    r = tl.arange(0, BLOCK_M)
    for e0 in range(e_lo, e_hi, EB):
        ex = e0 + tl.arange(0, EB)
        ok = ex < e_hi
        c = tl.gather(counts, tl.where(ok, ex, 0), 0)
        s = tl.gather(starts, tl.where(ok, ex, 0), 0)
        pad_end = ((c + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        slot = c[:, None] + r[None, :]
        tl.store(sorted_ptr + s[:, None] + slot, tl.full([EB, BLOCK_M], 0, tl.int32) + P,
                 mask=ok[:, None] & (slot < pad_end[:, None]))


@triton.jit(do_not_specialize=["stride_im", "stride_ik", "E_global", "E", "P", "topk", "has_map", "max_blocks"])
def _route_single_kernel(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map,
                         sorted_ptr, block_expert_ptr, inverse_ptr, meta_ptr, max_blocks, BLOCK_M: tl.constexpr,
                         NB: tl.constexpr, PB: tl.constexpr, PDL: tl.constexpr):
    """Routing of P <= PB pairs in one program: the ids read once, the plan from their histogram, and the pairs
    in sorted order by one sort of the keys ``expert * PB + p`` (invalid pairs last): the i-th valid key's pair goes
    to its expert's padded start plus i minus the expert's first index in the sorted keys. Every used sorted row
    gets the sentinel first, then (after a barrier: the same rows, other threads) the valid pairs overwrite theirs;
    a used block holds a valid pair, so its pairs store its owner.
    NOTE: against one chunk ordered by a [128, 128] rank matrix, its blocks' owners stored per expert from a
    [NB, blocks per expert] tile (three launches above 128 pairs), ``route()`` alone under
    CUDA-graph replay on an H200, block_m 16: E 512 P 80 3.62 against 6.83 us, P 160 4.26 against 10.62 (three
    launches), E 256 P 128 2.79 against 5.30, P 512 4.34 against 8.00, E 8 P 32 1.88 against 3.86
    (``python benchmarks/bench_routing.py``, benchmarks/results/ab_routing_sort_h200.txt)."""
    grid_dependency(PDL)
    nb = tl.arange(0, NB)
    p = tl.arange(0, PB)
    e, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    counts = _chunk_histogram(e, valid, NB)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    starts = (tl.cumsum(nblk, axis=0) - nblk) * BLOCK_M
    first = tl.cumsum(counts, axis=0) - counts  # each expert's first index among the sorted valid keys
    total_blocks = tl.sum(nblk, axis=0)
    rows = total_blocks * BLOCK_M
    for r0 in range(0, rows, PB):
        r = r0 + p
        tl.store(sorted_ptr + r, tl.full([PB], 0, tl.int32) + P, mask=r < rows)
    for b0 in range(total_blocks, max_blocks, PB):
        b = b0 + p
        tl.store(block_expert_ptr + b, tl.full([PB], -1, tl.int32), mask=b < max_blocks)
    tl.store(meta_ptr + nb, counts)
    tl.store(meta_ptr + NB + nb, starts)
    tl.store(meta_ptr + 2 * NB + nb, tl.zeros([NB], dtype=tl.int32))
    keys = tl.sort(tl.where(valid, e, NB) * PB + p)
    e_sorted = keys // PB
    p_sorted = keys - e_sorted * PB
    ok = e_sorted < NB
    e_safe = tl.where(ok, e_sorted, 0)
    pos = tl.gather(starts, e_safe, 0) + p - tl.gather(first, e_safe, 0)
    tl.store(inverse_ptr + p, tl.full([PB], -1, tl.int32), mask=(p < P) & ~valid)
    tl.store(inverse_ptr + p_sorted, pos, mask=ok)
    tl.store(block_expert_ptr + pos // BLOCK_M, e_sorted, mask=ok)
    tl.debug_barrier()
    tl.store(sorted_ptr + pos, p_sorted, mask=ok)


@triton.jit(do_not_specialize=["stride_im", "stride_ik", "E_global", "E", "P", "topk", "has_map"])
def _route_count_kernel(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, chunk_counts_ptr,
                        meta_ptr, NB: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Per-chunk expert histogram: chunk_counts[c, :] (int32 [num_chunks, NB]); program 0 also zeroes the
    tiles_done counters (meta[2 NB, 3 NB))."""
    grid_dependency(PDL)
    c = tl.program_id(0)
    if c == 0:
        tl.store(meta_ptr + 2 * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))
    p = c * CHUNK + tl.arange(0, CHUNK)
    e, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    tl.store(chunk_counts_ptr + c * NB + tl.arange(0, NB), _chunk_histogram(e, valid, NB))


@triton.jit(do_not_specialize=["num_chunks"])
def _route_prefix_kernel(chunk_counts_ptr, num_chunks, meta_ptr, NB: tl.constexpr, EC: tl.constexpr,
                         CB: tl.constexpr, PDL: tl.constexpr):
    """Per column of EC experts: chunk_counts becomes the exclusive prefix over the chunks (in place), and
    the column totals (the expert counts) go to meta[0, NB). Columns are independent: NB / EC programs."""
    grid_dependency(PDL)
    ex = tl.program_id(0) * EC + tl.arange(0, EC)
    cb = tl.arange(0, CB)
    running = tl.zeros([EC], dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        ptrs = chunk_counts_ptr + (c0 + cb)[:, None] * NB + ex[None, :]
        ok = (c0 + cb < num_chunks)[:, None]
        rows = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(rows, axis=0) - rows + running[None, :], mask=ok)
        running += tl.sum(rows, axis=0)
    tl.store(meta_ptr + ex, running)


@triton.jit(do_not_specialize=["stride_im", "stride_ik", "E_global", "E", "P", "topk", "has_map", "max_blocks",
                               "blocks_per_program", "experts_per_program"])
def _route_scatter_kernel(ids_ptr, stride_im, stride_ik, map_ptr, E_global, E, P, topk, has_map, chunk_counts_ptr,
                          sorted_ptr, block_expert_ptr, inverse_ptr, meta_ptr, max_blocks, blocks_per_program,
                          experts_per_program, BLOCK_M: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr,
                          EB: tl.constexpr, PDL: tl.constexpr):
    """Per chunk: position = padded expert start + pairs of the expert in earlier chunks + rank inside the
    chunk. Each valid pair also stores its expert as the owner of its block (a used block holds a valid pair;
    pairs of one block store the same value); program 0 stores the padded starts, and each program writes its
    share of the rest of the plan: the padding of experts_per_program experts and the -1 of its share
    (blocks_per_program) of the blocks past the used ones.
    PDL: the ids (the call's input, which the count kernel two launches back read after its own wait) are read
    and ranked before the wait for the prefix kernel.
    NOTE: against programs that found each block's owner by comparing it with every expert's block range
    ([8192 / NB, NB] tiles) and padded in tiles of up to 8 K elements whatever their share, route() alone on an
    H200 (block_m the heuristic's) was faster in 39 of 39 cells above 512 pairs: E 512 P 20480 9.99 against 21.18
    us, P 640 6.83 against 11.29; E 64 P 4096 5.85 against 9.24; E 16 P 1024 5.40 against 5.93; end to end
    qwen3-next-80b-a3b-tp2 M = 64 288.7 against 293.2, qwen3-30b-a3b M = 2048 461.1 against 468.3
    (benchmarks/results/ab_routing_scatter_h200.txt: ``python benchmarks/bench_routing.py --tokens 64 512 2048 8192
    --against routing_8f53892.py``, the file from ``git show 8f53892:moe_extension/kernels/_routing.py``)."""
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e, valid = local_expert(ids_ptr, p, P, stride_im, stride_ik, map_ptr, E_global, E, topk, has_map)
    rank = _rank_in_chunk(e, valid, CHUNK)
    grid_dependency(PDL)
    counts = tl.load(meta_ptr + tl.arange(0, NB))
    starts, total_blocks = _padded_starts(counts, BLOCK_M)
    e_safe = tl.where(valid, e, 0)
    start_e = tl.gather(starts, e_safe, 0)
    pos = start_e + tl.load(chunk_counts_ptr + c * NB + e_safe) + rank
    tl.store(sorted_ptr + pos, p, mask=valid)
    tl.store(inverse_ptr + p, tl.where(valid, pos, -1), mask=p < P)
    tl.store(block_expert_ptr + pos // BLOCK_M, e, mask=valid)
    e_lo = c * experts_per_program
    _write_padding(counts, starts, sorted_ptr, P, e_lo, tl.minimum(e_lo + experts_per_program, E), BLOCK_M, EB)
    if c == 0:
        tl.store(meta_ptr + NB + tl.arange(0, NB), starts)
    b_hi = tl.minimum((c + 1) * blocks_per_program, max_blocks)
    for b0 in range(tl.maximum(c * blocks_per_program, total_blocks), b_hi, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + b, tl.full([CHUNK], -1, tl.int32), mask=b < b_hi)


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
          single_program_max_pairs: int = SINGLE_PROGRAM_MAX_PAIRS, prefix_rows: int = PREFIX_ROWS,
          pdl: bool = False) -> Routing:
    """Expert-sorted, ``block_m``-padded order of the pairs of ``topk_ids [M, topk]`` (int32/int64, any
    strides) over ``num_experts`` local experts; ``expert_map [E_global]`` int32 maps global to local ids.

    Schedule knobs (the tests set them to reach both schedules and multi-step prefixes; the results do not
    depend on them): ``single_program_max_pairs``, the largest P routed by one program (at most
    SINGLE_PROGRAM_MAX_PAIRS);
    ``prefix_rows`` (a power of two), the chunks per step of the prefix kernel. ``pdl``: launch every kernel
    with programmatic dependent launch (sm_90+; each waits for its predecessor before touching memory).
    """
    M, topk = topk_ids.shape
    P = M * topk
    E = num_experts
    dev = topk_ids.device
    max_blocks = max_blocks_for(P, E, block_m)
    NB = max(32, next_power_of_2(E))
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    inverse = torch.empty(P, dtype=torch.int32, device=dev)
    # meta: counts [0, NB), padded starts [NB, 2 NB), tiles_done [2 NB, 3 NB) (zeroed by the first kernel)
    meta = torch.empty(3 * NB, dtype=torch.int32, device=dev)
    routing = Routing(sorted_pairs, block_expert, inverse, meta[:E], meta[NB:NB + E], block_m, max_blocks,
                      meta[2 * NB:2 * NB + E])
    if P == 0:
        return routing
    has_map = expert_map is not None
    map_arg = expert_map if has_map else topk_ids
    e_global = expert_map.numel() if has_map else E
    ids_args = (topk_ids, topk_ids.stride(0), topk_ids.stride(1), map_arg, e_global, E, P, topk, int(has_map))
    if P <= min(single_program_max_pairs, SINGLE_PROGRAM_MAX_PAIRS):
        PB = max(CHUNK, next_power_of_2(P))
        _route_single_kernel[(1,)](
            *ids_args, sorted_pairs, block_expert, inverse, meta, max_blocks, BLOCK_M=block_m, NB=NB, PB=PB,
            **pdl_options(pdl, num_warps=_NUM_WARPS if PB <= 256 else 2 * _NUM_WARPS))
        return routing
    launch = pdl_options(pdl, num_warps=_NUM_WARPS)
    num_chunks = cdiv(P, CHUNK)
    # the padding tile of a scatter program: its experts (up to 8 K elements a step)
    experts_per_program = cdiv(E, num_chunks)
    EB = min(next_power_of_2(experts_per_program), max(1, 8192 // block_m))
    chunk_counts = torch.empty(num_chunks * NB, dtype=torch.int32, device=dev)
    _route_count_kernel[(num_chunks,)](*ids_args, chunk_counts, meta, NB=NB, CHUNK=CHUNK, **launch)
    _route_prefix_kernel[(NB // PREFIX_EXPERTS,)](
        chunk_counts, num_chunks, meta, NB=NB, EC=PREFIX_EXPERTS,
        CB=min(next_power_of_2(num_chunks), prefix_rows), **launch)
    _route_scatter_kernel[(num_chunks,)](
        *ids_args, chunk_counts, sorted_pairs, block_expert, inverse, meta, max_blocks, cdiv(max_blocks, num_chunks),
        experts_per_program, BLOCK_M=block_m, NB=NB, CHUNK=CHUNK, EB=EB, **launch)
    return routing
