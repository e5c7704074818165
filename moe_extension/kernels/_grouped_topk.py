"""DeepSeek routing (grouped top-k) in one kernel: gating logits [M, E] (fp32/fp16/bf16, any strides) and an
optional fp32 correction bias [E] (any stride) -> topk_weights fp32 [M, topk] and topk_ids int32 [M, topk].

Scores ``s`` (softmax over E or elementwise sigmoid), choice scores ``c = s + bias`` (``c = s`` without a
bias); group scores over G contiguous groups of E / G experts (the sum of the two largest ``c`` with a bias,
else the largest ``c``); the ``topk_group`` best groups kept (ties to the lower group); the topk experts of
the largest ``c`` among them picked in decreasing ``c`` order (ties to the lower expert id); weights = their
``s``, renormalized to sum 1 when asked, then times ``routed_scaling_factor``. Math in fp32. The full contract
is in ``moe_extension/ops/grouped_topk.py``; the caller validates the arguments.

One program handles BLOCK_R rows, each held as a [G_P2, GS_P2] tile (groups x experts of a group, padded to
powers of two), so that the group reductions are reductions over the last axis. With the op's E <= 512 the
padded tile holds at most 1024 scores (each of G and E / G pads to less than twice itself). The group
choice takes topk_group passes and the expert choice topk passes, each a max and a min-index reduction over
the tile. A NaN row selects nothing valid: its ids are >= E (invalid slots downstream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_extension.kernels._launch import cdiv, device_guard, next_power_of_2


@triton.jit(do_not_specialize=["M"])
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, M, G, GS, scale,
    stride_lm, stride_le, stride_b, stride_wm, stride_wk, stride_im, stride_ik,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr, G_P2: tl.constexpr,
    GS_P2: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.arange(0, G_P2)
    members = tl.arange(0, GS_P2)
    row_ok = rows < M
    # [BLOCK_R, G_P2, GS_P2]: expert id = group * GS + member; padding (group >= G or member >= GS) is not an
    # expert and gets an id that no expert has.
    valid = (groups[None, :, None] < G) & (members[None, None, :] < GS) & (rows[:, None, None] >= 0)
    no_id = G_P2 * GS_P2  # >= E
    eid = tl.where(valid, groups[None, :, None] * GS + members[None, None, :], no_id)
    r64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + r64[:, None, None] * stride_lm + eid.to(tl.int64) * stride_le,
                mask=row_ok[:, None, None] & valid, other=0.0).to(tl.float32)
    if SIGMOID:
        s = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        x = tl.where(valid, x, float("-inf"))
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        num = tl.where(valid, tl.exp(x - row_max[:, None, None]), 0.0)
        s = num / tl.sum(tl.sum(num, axis=2), axis=1)[:, None, None]
    if HAS_BIAS:
        b = tl.load(bias_ptr + eid.to(tl.int64) * stride_b, mask=valid, other=0.0)
        c = tl.where(valid, s + b, float("-inf"))
    else:
        c = tl.where(valid, s, float("-inf"))

    # Group scores [BLOCK_R, G_P2]: the largest c, plus with a bias the second largest (the largest with its
    # first occurrence, the lowest member holding it, taken out: equal top two both count).
    group_score = tl.max(c, axis=2)
    if HAS_BIAS:
        first = tl.min(tl.where(c == group_score[:, :, None], members[None, None, :], GS_P2), axis=2)
        rest = tl.where(members[None, None, :] == first[:, :, None], float("-inf"), c)
        group_score = group_score + tl.max(rest, axis=2)
    group_taken = tl.broadcast_to(groups[None, :] >= G, (BLOCK_R, G_P2))
    for _ in range(0, TOPK_GROUP):
        cand = tl.where(group_taken, float("-inf"), group_score)
        best = tl.max(cand, axis=1)
        # Lowest group holding the maximum among the groups not kept yet (ties -> lower group).
        idx = tl.min(tl.where((cand == best[:, None]) & ~group_taken, groups[None, :], G_P2), axis=1)
        group_taken = group_taken | (groups[None, :] == idx[:, None])
    # The kept groups are the real groups taken above; the experts outside them (and padding) count as taken.
    taken = ~(valid & group_taken[:, :, None])

    kcols = tl.arange(0, TOPK_P2)
    sel_w = tl.zeros([BLOCK_R, TOPK_P2], dtype=tl.float32)
    sel_id = tl.zeros([BLOCK_R, TOPK_P2], dtype=tl.int32)
    for i in range(0, TOPK):
        cand = tl.where(taken, float("-inf"), c)
        best = tl.max(tl.max(cand, axis=2), axis=1)
        # Lowest expert id holding the maximum among the experts not taken yet (ties -> lower expert id).
        hit = (cand == best[:, None, None]) & ~taken
        idx = tl.min(tl.min(tl.where(hit, eid, no_id), axis=2), axis=1)
        picked = eid == idx[:, None, None]
        taken = taken | picked
        w = tl.sum(tl.sum(tl.where(picked, s, 0.0), axis=2), axis=1)  # the picked expert's s (c only chooses)
        sel_w = tl.where(kcols[None, :] == i, w[:, None], sel_w)
        sel_id = tl.where(kcols[None, :] == i, idx[:, None], sel_id)
    k_ok = kcols < TOPK
    if RENORMALIZE:
        sel_w = sel_w / tl.sum(tl.where(k_ok[None, :], sel_w, 0.0), axis=1)[:, None]
    sel_w = sel_w * scale
    mask = row_ok[:, None] & k_ok[None, :]
    tl.store(weights_ptr + r64[:, None] * stride_wm + kcols[None, :] * stride_wk, sel_w, mask=mask)
    tl.store(ids_ptr + r64[:, None] * stride_im + kcols[None, :] * stride_ik, sel_id, mask=mask)


def grouped_topk_triton(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int,
                        topk_group: int, scoring_func: str, e_score_correction_bias: torch.Tensor | None,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [M, topk], topk_ids int32 [M, topk]) of gating logits [M, E]."""
    M, E = gating_output.shape
    dev = gating_output.device
    weights = torch.empty((M, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((M, topk), dtype=torch.int32, device=dev)
    if M == 0:
        return weights, ids
    group_size = E // num_expert_group
    g_p2 = next_power_of_2(num_expert_group)
    gs_p2 = next_power_of_2(group_size)
    tile = g_p2 * gs_p2
    # NOTE: as in topk_softmax: ~4 K padded scores per program, one row per program from 4 K up, up to 64
    # rows at small E; fewer rows for tiny M. The k selection passes are reductions over each row's tile.
    block_r = max(1, min(64, 4096 // tile, next_power_of_2(M)))
    num_warps = 8 if tile >= 512 else 4
    bias = gating_output if e_score_correction_bias is None else e_score_correction_bias  # unread without a bias
    grid = (cdiv(M, block_r),)
    with device_guard(dev):
        _grouped_topk_kernel[grid](
            gating_output, bias, weights, ids, M, num_expert_group, group_size, float(routed_scaling_factor),
            gating_output.stride(0), gating_output.stride(1),
            0 if e_score_correction_bias is None else e_score_correction_bias.stride(0),
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
            TOPK=topk, TOPK_P2=max(2, next_power_of_2(topk)), TOPK_GROUP=topk_group,
            SIGMOID=scoring_func == "sigmoid", HAS_BIAS=e_score_correction_bias is not None,
            RENORMALIZE=bool(renormalize), BLOCK_R=block_r, G_P2=g_p2, GS_P2=gs_p2, num_warps=num_warps,
        )
    return weights, ids
