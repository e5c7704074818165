"""Which rank holds which expert: ``ExpertPlacement``, from every rank's ``expert_map``.

``expert_map [E_global]`` int32 of rank r maps a global expert id to its local index on r (-1: another rank's
expert). ``ExpertPlacement.expert_owner [E_global]`` int32 is the rank holding each expert, -1 where no rank
does (those slots contribute 0, as invalid ids do). Each expert is held by at most one rank; a rank's local
ids are distinct and index its weight stacks. ``gather`` builds the placement from the ranks' maps with one
all_gather (call it on every rank, once, at construction: it reads the maps on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def contiguous_expert_map(num_experts: int, world_size: int, rank: int) -> torch.Tensor:
    """``expert_map [num_experts]`` int32 of ``rank`` when the experts are split into ``world_size`` contiguous
    ranges, as evenly as possible (the first ``num_experts % world_size`` ranks hold one more)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"contiguous_expert_map: rank must be in [0, world_size = {world_size}), got {rank}")
    if num_experts < world_size:
        raise ValueError(f"contiguous_expert_map: num_experts ({num_experts}) must be >= world_size ({world_size})")
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    count = base + (rank < extra)
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[start: start + count] = torch.arange(count, dtype=torch.int32)
    return m


@dataclass
class ExpertPlacement:
    """The ranks' ``expert_maps`` (host int32 tensors, one per rank) and ``expert_owner`` derived from them."""

    expert_maps: list[torch.Tensor]
    expert_owner: torch.Tensor

    @classmethod
    def from_expert_maps(cls, expert_maps: list[torch.Tensor],
                         num_local_experts: list[int] | None = None) -> ExpertPlacement:
        """Checks the maps (same length, each expert on at most one rank, local ids distinct and, with
        ``num_local_experts``, below each rank's count); ValueError naming the rank and expert otherwise."""
        maps = [torch.as_tensor(m).to(device="cpu", dtype=torch.int32) for m in expert_maps]
        e_global = maps[0].numel()
        owner = torch.full((e_global,), -1, dtype=torch.int32)
        for r, m in enumerate(maps):
            if m.dim() != 1 or m.numel() != e_global:
                raise ValueError(f"ExpertPlacement: rank {r}'s expert_map has shape {list(m.shape)}, rank 0's "
                                 f"[{e_global}]: every rank must map the same E_global experts")
            held = (m >= 0).nonzero().flatten()
            local = m[held]
            if local.unique().numel() != local.numel():
                raise ValueError(f"ExpertPlacement: rank {r}'s expert_map gives two experts the same local id")
            if num_local_experts is not None and local.numel() and int(local.max()) >= num_local_experts[r]:
                raise ValueError(f"ExpertPlacement: rank {r}'s expert_map has local id {int(local.max())}, but the "
                                 f"rank holds {num_local_experts[r]} experts (w1.shape[0])")
            twice = held[owner[held] >= 0]
            if twice.numel():
                e = int(twice[0])
                raise ValueError(f"ExpertPlacement: expert {e} is held by ranks {int(owner[e])} and {r}; each "
                                 "expert must be held by one rank")
            owner[held] = r
        return cls(maps, owner)

    @classmethod
    def gather(cls, expert_map: torch.Tensor, num_local_experts: int, group=None) -> ExpertPlacement:
        """The placement from every rank's ``expert_map`` and expert count (collective over ``group``)."""
        world = dist.get_world_size(group)
        device = expert_map.device
        mine = torch.cat((expert_map.to(torch.int32), torch.tensor([num_local_experts], dtype=torch.int32,
                                                                   device=device)))
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([mine.numel()], device=device), group=group)
        if len({int(n) for n in lengths}) != 1:
            raise ValueError(f"ExpertPlacement: the ranks' expert_maps have different lengths "
                             f"{[int(n) - 1 for n in lengths]}: every rank must map the same E_global experts")
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        parts = [p.cpu() for p in parts]
        return cls.from_expert_maps([p[:-1] for p in parts], [int(p[-1]) for p in parts])
