"""Device routing (moe_extension.kernels._routing.route): expert-sorted, block-padded order of the (token, slot)
pairs, checked against a host computation. Runs in Triton's interpreter on CPU tensors (tiny shapes) and on
CUDA when available; both schedules (one program; three launches, the chunk prefix in one or
several steps), every kind of invalid slot.
"""

import pytest
import torch

from moe_extension.kernels._routing import max_blocks_for, route
from tests.utils import DEVICES, INTERPRETED

GPU_DEVICES = [d for d in DEVICES if d == "cuda" or INTERPRETED]


def _local_experts(ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert of every pair (flattened), -1 for invalid slots (docs/ops.md, semantics)."""
    flat = ids.reshape(-1).long().cpu()
    if expert_map is not None:
        emap = expert_map.long().cpu()
        ok = (flat >= 0) & (flat < emap.numel())
        flat = torch.where(ok, emap[flat.clamp(0, emap.numel() - 1)], torch.full_like(flat, -1))
    return torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, -1))


def _check(r, ids, num_experts, block_m, expert_map=None):
    P = ids.numel()
    local = _local_experts(ids, num_experts, expert_map)
    valid = local >= 0
    counts = torch.bincount(local[valid], minlength=num_experts)
    nblk = (counts + block_m - 1) // block_m
    total = int(nblk.sum())
    starts = (torch.cumsum(nblk, 0) - nblk) * block_m
    assert r.max_blocks == max_blocks_for(P, num_experts, block_m) >= total
    assert torch.equal(r.expert_counts.cpu().long(), counts)
    assert torch.equal(r.expert_starts.cpu().long(), starts)
    block_expert = r.block_expert.cpu().long()
    assert torch.equal(block_expert[:total], torch.repeat_interleave(torch.arange(num_experts), nblk))
    assert (block_expert[total:] == -1).all(), "blocks past the used ones must be -1"
    sorted_pairs = r.sorted_pairs.cpu().long()[: total * block_m]
    for e in torch.nonzero(counts).flatten().tolist():
        s, c, padded = int(starts[e]), int(counts[e]), int(nblk[e]) * block_m
        want = torch.nonzero(local == e).flatten()  # increasing pair index: a stable, deterministic order
        assert torch.equal(sorted_pairs[s : s + c], want), f"expert {e}"
        assert (sorted_pairs[s + c : s + padded] == P).all(), f"expert {e}: padding must hold the sentinel P"
    inverse = torch.full((P,), -1, dtype=torch.long)
    real = sorted_pairs < P
    inverse[sorted_pairs[real]] = torch.nonzero(real).flatten()
    assert torch.equal(r.inverse.cpu().long(), inverse)


CASES = [
    # M, topk, E, block_m, ids dtype, map, single-program limit (0 forces the three-launch schedule)
    (1, 1, 4, 16, torch.int32, False, 512),
    (3, 6, 33, 16, torch.int64, False, 512),
    (7, 16, 512, 16, torch.int32, False, 512),
    (77, 8, 64, 16, torch.int32, False, 512),  # 616 pairs: the three-launch schedule
    (16, 8, 4, 16, torch.int32, False, 512),  # P = 128 in one program, 2 blocks per expert
    (64, 2, 1, 16, torch.int64, True, 512),  # one local expert
    (128, 1, 300, 128, torch.int32, False, 512),  # ~100 experts of one 128-row block each
    (50, 8, 64, 16, torch.int32, True, 512),  # P = 400 in one program (keys sorted over 512)
    (64, 8, 300, 32, torch.int64, False, 512),  # P = 512, the most one program routes
    (50, 3, 8, 32, torch.int64, True, 0),
    (20, 4, 10, 16, torch.int32, True, 512),
    (100, 2, 5, 64, torch.int32, False, 0),
    (9, 2, 3, 128, torch.int32, True, 512),
]


@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("M,topk,E,block_m,id_dtype,with_map,single_max", CASES)
def test_route_matches_host(device, M, topk, E, block_m, id_dtype, with_map, single_max):
    g = torch.Generator().manual_seed(M * 1000 + topk * 10 + E)
    expert_map = None
    e_global = E
    if with_map:
        e_global = E + 7
        expert_map = torch.randint(-1, E + 2, (e_global,), generator=g, dtype=torch.int32)  # -1 and >= E entries
        expert_map = expert_map.to(device)
    # ids beyond both ends of the valid range: negative, >= E, >= E_global, a huge int64
    ids = torch.randint(-2, e_global + 3, (M, topk), generator=g).to(id_dtype)
    if id_dtype == torch.int64 and M * topk > 1:
        ids.view(-1)[1] = 2**32 + 1  # must not wrap into a valid int32 id
    r = route(ids.to(device), E, block_m, expert_map, single_program_max_pairs=single_max)
    _check(r, ids, E, block_m, expert_map)


@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("M,topk,E,block_m,prefix_rows", [
    (100, 8, 512, 16, 2),  # 7 chunks, prefix in 4 steps; each scatter program pads 74 experts and has 81 of the
    # 562 blocks to mark -1 where unused
    (333, 3, 3, 32, 4),  # 8 chunks, 2 steps; 3 experts for 8 programs: some pad none
])
def test_route_prefix_steps_and_plan_shares(device, M, topk, E, block_m, prefix_rows):
    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(-1, E + 1, (M, topk), generator=g, dtype=torch.int32)
    r = route(ids.to(device), E, block_m, single_program_max_pairs=0, prefix_rows=prefix_rows)
    _check(r, ids, E, block_m)


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_route_strided_ids_and_all_distinct(device):
    # Every pair a different expert: the block count reaches floor(P / block_m) + min(P, E) - 1 = 20 of 21.
    base = torch.randperm(64)[:40].to(torch.int32).reshape(20, 2).repeat_interleave(2, dim=1).to(device)
    ids = base[:, ::2]  # strided [20, 2] view of the [20, 4] base (each column twice)
    assert not ids.is_contiguous()
    r = route(ids, 64, 16)
    _check(r, ids, 64, 16)
    assert int((r.block_expert >= 0).sum()) == 40


@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_route_one_expert_takes_the_pairs(device, block_m):
    # All 512 pairs (the one-program schedule's most) but one on expert 5 of 9: 511 / block_m blocks of one owner.
    ids = torch.full((128, 4), 5, dtype=torch.int32, device=device)
    ids[3, 1] = -1
    r = route(ids, 9, block_m)
    _check(r, ids, 9, block_m)
    assert int((r.block_expert == 5).sum()) == -(-511 // block_m)


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_route_deterministic_and_empty(device):
    ids = torch.randint(0, 12, (31, 5), dtype=torch.int32, device=device)
    a, b = route(ids, 12, 16), route(ids, 12, 16)
    used = int((a.block_expert >= 0).sum()) * 16  # entries past the used blocks are never written
    for x, y in ((a.sorted_pairs[:used], b.sorted_pairs[:used]), (a.block_expert, b.block_expert),
                 (a.inverse, b.inverse)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    empty = route(torch.empty((0, 4), dtype=torch.int32, device=device), 8, 16)
    assert empty.max_blocks == 0 and empty.inverse.numel() == 0 and empty.sorted_pairs.numel() == 0
