"""LoRA on the routed experts, the two GEMMs of one LoRA term as ops: per (token, slot) pair ``(t, j)`` with the
token's adapter ``l = token_lora_mapping[t]`` and the slot's local expert ``e``,

``moe_ext::lora_shrink(x, lora_a [L, E, r, K], topk_ids [M, topk], token_lora_mapping [M], *, expert_map)``
    -> ``u [M, topk, r]`` fp32, ``u[t, j] = A[l, e] x[t]`` (``x [M, K]``: one input per token) or ``A[l, e] x[t, j]``
    (``x [M, topk, K]``: one per slot); rows of inactive pairs are 0.
``moe_ext::lora_expand(out [M, topk, n], u [M, topk, r], lora_b [L, E, n, r], topk_ids, token_lora_mapping, *,
    expert_map, topk_weights)`` -> None: ``out[t, j] = round(out[t, j] + g[t, j] B[l, e] u[t, j])`` in place, g the
    router weight when ``topk_weights`` is given, else 1.
``moe_ext::add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map, topk_weights)`` -> None:
    both in one call (on CUDA one grouping of the pairs serves both GEMMs): ``out += g B (A x)``.

A pair is active when its slot is valid (docs/ops.md: id in range, mapped to a local expert in [0, E)) and its
token's adapter is in [0, L) (-1, or any id outside, means none). Inactive pairs' ``out`` rows are never written:
tokens without an adapter keep the base output bit for bit. Adapters in any float dtype (their own, not the
activations'); math in fp32, one rounding into ``out`` (on CUDA, bf16 adapters multiply ``u`` as two bf16
parts: 16 bits of its mantissa, ``moe_extension/kernels/_lora.py``). ``token_lora_mapping`` and the adapters are
read on the device: changing them in place between CUDA-graph replays needs no recapture.

CUDA: Triton kernels grouped by (adapter, expert) (``moe_extension.kernels.lora``); elsewhere the PyTorch
implementation below (one adapter matrix gathered per pair).
"""

from __future__ import annotations

import torch

from moe_extension.ops.arg_checks import FLOAT_DTYPES, ID_DTYPES, ArgChecker, require
from moe_extension.ops.expert_gemm import slot_experts


def lora_slots(topk_ids, token_lora_mapping, num_adapters: int, num_experts: int, expert_map=None):
    """(adapter, local expert, active) of every pair, ``[M, topk]`` each (indices clamped in range, int64)."""
    expert, valid = slot_experts(topk_ids, expert_map, num_experts)
    adapter = token_lora_mapping.long().unsqueeze(1).expand_as(expert)
    active = valid & (adapter >= 0) & (adapter < num_adapters)
    return adapter.clamp(0, num_adapters - 1), expert, active


# ----------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------


def _check_x(c: ArgChecker, x: torch.Tensor) -> None:
    if x.dim() == 3:
        c.rank("x", x, FLOAT_DTYPES, "[M, topk, K]")
    else:
        c.rank("x", x, FLOAT_DTYPES, "[M, K]")


def _check_adapter(c: ArgChecker, arg: str, t: torch.Tensor, layout: str, **fixed) -> None:
    """A stack of adapter matrices ``[L, E, rows, cols]``: any float dtype, every size >= 1; ``fixed`` gives the
    dims (by name: L, E, rows, cols) that other arguments determine."""
    c.rank(arg, t, FLOAT_DTYPES, layout)
    require(t.numel() > 0, lambda: f"{c.op}: {arg} must have L, E, rows and cols >= 1, got shape {list(t.shape)}")
    shape = [fixed.get(name, size) for name, size in zip(("L", "E", "rows", "cols"), t.shape)]
    c.tensor(arg, t, FLOAT_DTYPES, layout, shape)


def _check_slots(c: ArgChecker, topk_ids, token_lora_mapping, expert_map, topk_weights, m, topk=None) -> None:
    c.routing(topk_ids, topk_weights, m, topk)
    c.tensor("token_lora_mapping", token_lora_mapping, ID_DTYPES, "[M]", (m,))
    c.expert_map(expert_map)


def _check_adapter_pair(c: ArgChecker, x, lora_a, lora_b, rows: int, **a_fixed) -> None:
    """``lora_a [L, E, r, x's last dim]`` and ``lora_b [L, E, rows, r]`` of the same L, E and r."""
    _check_adapter(c, "lora_a", lora_a, "[L, E, r, K]", cols=x.shape[-1], **a_fixed)
    L, E, r = lora_a.shape[:3]
    _check_adapter(c, "lora_b", lora_b, "[L, E, n, r]", L=L, E=E, rows=rows, cols=r)


def check_lora_term(c: ArgChecker, x, lora_a, lora_b, token_lora_mapping, num_experts: int, rows: int, m: int) -> None:
    """The LoRA term of ``expert_gemm1`` / ``expert_gemm2`` (``x``: the GEMM's input, ``rows``: its output columns):
    the adapter pair over the GEMM's E local experts and ``token_lora_mapping [M]``."""
    _check_adapter_pair(c, x, lora_a, lora_b, rows, E=num_experts)
    c.tensor("token_lora_mapping", token_lora_mapping, ID_DTYPES, "[M]", (m,))


def check_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map):
    """Validates lora_shrink's arguments; returns (M, topk, r)."""
    c = ArgChecker("lora_shrink", "x", x)
    _check_x(c, x)
    _check_adapter(c, "lora_a", lora_a, "[L, E, r, K]", cols=x.shape[-1])
    _check_slots(c, topk_ids, token_lora_mapping, expert_map, None, x.shape[0], x.shape[1] if x.dim() == 3 else None)
    return x.shape[0], topk_ids.shape[1], lora_a.shape[2]


def check_lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights) -> None:
    c = ArgChecker("lora_expand", "out", out)
    c.rank("out", out, FLOAT_DTYPES, "[M, topk, n]")
    m, topk, n = out.shape
    _check_adapter(c, "lora_b", lora_b, "[L, E, n, r]", rows=n)
    c.tensor("u", u, (torch.float32,), "[M, topk, r]", (m, topk, lora_b.shape[3]))
    _check_slots(c, topk_ids, token_lora_mapping, expert_map, topk_weights, m, topk)


def check_add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights) -> None:
    c = ArgChecker("add_lora", "out", out)
    c.rank("out", out, FLOAT_DTYPES, "[M, topk, n]")
    m, topk, n = out.shape
    _check_x(c, x)
    if x.dim() == 3:
        c.tensor("x", x, FLOAT_DTYPES, "[M, topk, K]", (m, topk, x.shape[2]))
    else:
        c.tensor("x", x, FLOAT_DTYPES, "[M, K]", (m, x.shape[1]))
    _check_adapter_pair(c, x, lora_a, lora_b, n)
    _check_slots(c, topk_ids, token_lora_mapping, expert_map, topk_weights, m, topk)


# ----------------------------------------------------------------------------------------------------
# The PyTorch implementation (any device; fp32 math, one adapter matrix gathered per pair)
# ----------------------------------------------------------------------------------------------------


def _shrink(x, lora_a, slots) -> torch.Tensor:
    adapter, expert, active = slots
    a = lora_a[adapter, expert].float()  # [M, topk, r, K]
    if x.dim() == 2:
        u = torch.einsum("mjrk,mk->mjr", a, x.float())
    else:
        u = torch.einsum("mjrk,mjk->mjr", a, x.float())
    return torch.where(active.unsqueeze(-1), u, 0.0)


def _expand(out, u, lora_b, slots, topk_weights) -> None:
    adapter, expert, active = slots
    delta = torch.einsum("mjnr,mjr->mjn", lora_b[adapter, expert].float(), u)
    if topk_weights is not None:
        delta = delta * topk_weights.unsqueeze(-1)
    out.copy_(torch.where(active.unsqueeze(-1), (out.float() + delta).to(out.dtype), out))


def _slots(stack, topk_ids, token_lora_mapping, expert_map):
    """``lora_slots`` for an adapter stack [L, E, rows, cols]."""
    return lora_slots(topk_ids, token_lora_mapping, stack.shape[0], stack.shape[1], expert_map)


def lora_shrink_torch(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None) -> torch.Tensor:
    """PyTorch implementation of lora_shrink: ``u [M, topk, r]`` fp32."""
    check_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map)
    return _shrink(x, lora_a, _slots(lora_a, topk_ids, token_lora_mapping, expert_map))


def lora_expand_torch(out, u, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None) -> None:
    """PyTorch implementation of lora_expand (``out`` updated in place)."""
    check_lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)
    _expand(out, u, lora_b, _slots(lora_b, topk_ids, token_lora_mapping, expert_map), topk_weights)


def add_lora_torch(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None,
                   topk_weights=None) -> None:
    """PyTorch implementation of add_lora (``out`` updated in place)."""
    check_add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)
    slots = _slots(lora_a, topk_ids, token_lora_mapping, expert_map)  # computed once for both GEMMs
    _expand(out, _shrink(x, lora_a, slots), lora_b, slots, topk_weights)


# ----------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------

torch.library.define(
    "moe_ext::lora_shrink",
    "(Tensor x, Tensor lora_a, Tensor topk_ids, Tensor token_lora_mapping, *, Tensor? expert_map=None) -> Tensor",
)
torch.library.define(
    "moe_ext::lora_expand",
    "(Tensor(a!) out, Tensor u, Tensor lora_b, Tensor topk_ids, Tensor token_lora_mapping, *, "
    "Tensor? expert_map=None, Tensor? topk_weights=None) -> ()",
)
torch.library.define(
    "moe_ext::add_lora",
    "(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor topk_ids, Tensor token_lora_mapping, *, "
    "Tensor? expert_map=None, Tensor? topk_weights=None) -> ()",
)


@torch.library.register_fake("moe_ext::lora_shrink")
def _lora_shrink_fake(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None):
    m, topk, r = check_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map)
    return x.new_empty((m, topk, r), dtype=torch.float32)


@torch.library.register_fake("moe_ext::lora_expand")
def _lora_expand_fake(out, u, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None):
    check_lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)


@torch.library.register_fake("moe_ext::add_lora")
def _add_lora_fake(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None):
    check_add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)


torch.library.impl("moe_ext::lora_shrink", "cpu")(lora_shrink_torch)
torch.library.impl("moe_ext::lora_expand", "cpu")(lora_expand_torch)
torch.library.impl("moe_ext::add_lora", "cpu")(add_lora_torch)


@torch.library.impl("moe_ext::lora_shrink", "cuda")
def _lora_shrink_cuda(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None):
    check_lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map)
    from moe_extension.kernels.lora import lora_shrink_triton

    return lora_shrink_triton(x, lora_a, topk_ids, token_lora_mapping, expert_map=expert_map)


@torch.library.impl("moe_ext::lora_expand", "cuda")
def _lora_expand_cuda(out, u, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None):
    check_lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)
    from moe_extension.kernels.lora import lora_expand_triton

    lora_expand_triton(out, u, lora_b, topk_ids, token_lora_mapping, expert_map=expert_map, topk_weights=topk_weights)


@torch.library.impl("moe_ext::add_lora", "cuda")
def _add_lora_cuda(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None):
    check_add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)
    from moe_extension.kernels.lora import add_lora_triton

    add_lora_triton(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map=expert_map,
                    topk_weights=topk_weights)


def lora_shrink(x, lora_a, topk_ids, token_lora_mapping, *, expert_map=None) -> torch.Tensor:
    """``torch.ops.moe_ext.lora_shrink``: ``u [M, topk, r]`` fp32 (see the module docstring)."""
    return torch.ops.moe_ext.lora_shrink(x, lora_a, topk_ids, token_lora_mapping, expert_map=expert_map)


def lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None) -> torch.Tensor:
    """``torch.ops.moe_ext.lora_expand``: ``out += g B u`` in place on the active pairs; returns ``out``."""
    torch.ops.moe_ext.lora_expand(out, u, lora_b, topk_ids, token_lora_mapping, expert_map=expert_map,
                                  topk_weights=topk_weights)
    return out


def add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None,
             topk_weights=None) -> torch.Tensor:
    """``torch.ops.moe_ext.add_lora``: ``out += g B (A x)`` in place on the active pairs; returns ``out``."""
    torch.ops.moe_ext.add_lora(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map=expert_map,
                               topk_weights=topk_weights)
    return out
