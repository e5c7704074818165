"""``fused_experts`` through OpenAI's ``triton_kernels.matmul_ogs`` (optional; CUDA, bf16/fp16, swigluoai).

Computes exactly the ``moe_ext::fused_experts`` contract (DESIGN.md), for ``activation="swigluoai"``:

    hidden_states [M, K] bf16/fp16, w1 [E, 2N, K] (rows gate/up interleaved), w2 [E, K, N] (any strides),
    topk_weights [M, topk] fp32, topk_ids [M, topk] int32/int64, w1_bias [E, 2N] / w2_bias [E, K] fp32,
    expert_map [E_global] int32  ->  out [M, K] in hidden_states.dtype
    out[t] = sum_j g[t,j] * (W2[e] swigluoai(W1[e] x[t] + b1[e]) + b2[e])   (g on x instead with
    apply_router_weight_on_input); invalid slots (id < 0, id >= E_global, expert_map[id] < 0, e >= E)
    contribute 0.

How it maps onto triton_kernels (the generation vendored by vLLM 0.33: ``matmul_ogs`` + ``routing``; it
imports under triton 3.6 and 3.9):

- Routing, on the device, no host sync: one small Triton kernel of ours (``_pack_routing_kernel``) turns
  ``topk_ids``/``topk_weights`` (+ ``expert_map``) into what ``routing.routing_from_bitmatrix`` needs: local
  expert ids [M, P] int32 (-1 = dropped slot), router weights [M, P] fp32 and the bitmatrix
  [M, ceil(E/32)] uint32 (bit e of row t set iff token t uses local expert e); its kernels then build
  ``RoutingData`` (per-expert histogram, tile maps), ``GatherIndx`` and ``ScatterIndx``. What that routing
  requires (P a power of two, an expert at most once per token) is in the NOTE of ``_routing``.
- First GEMM: ``matmul_ogs(x, w1ᵀ, b1, gather_indx)`` with swiglu fused (``FusedActivation``, reduction 2:
  gate/up interleaved, the same clamps and formula as ours) -> [M * P, N] in expert-sorted order.
- Second GEMM: ``matmul_ogs(h, w2ᵀ, b2, scatter_indx, gammas=router weights)``: ``(W2 a + b2) g`` per slot,
  then triton_kernels' grouped reduction over the P slots of a token (fp32 sum, dropped slots skipped).
- ``apply_router_weight_on_input``: the slots become M * topk single-slot rows of ``g x`` (see the NOTE in
  ``fused_experts``).
- Weights: ``matmul_ogs`` multiplies ``x [rows, K] @ w [E, K, 2N]``; ``w1.transpose(1, 2)`` is that view of
  our ``[E, 2N, K]`` weight, K-major for nn.Linear storage and N-major for transposed views of
  ``[E, K, 2N]`` storage, both read directly: no copy (``_weight_view``). Copies happen only where a NOTE
  says so (a weight or bias without a unit stride, hidden_states with a strided last dim, the ``g x`` rows);
  nothing is cached between calls.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

SUPPORTED_ACTIVATIONS = ("swigluoai",)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_TOPK = 64

_NAME = "fused_experts(backend='triton_kernels')"


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    """Import the parts of triton_kernels this glue uses: ``(namespace, None)`` or ``(None, reason)``."""
    try:
        from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, matmul_ogs
        from triton_kernels.matmul_ogs_details import opt_flags
        from triton_kernels.routing import routing_from_bitmatrix
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import Bitmatrix
    except Exception as exc:  # noqa: BLE001
        # Import-time failures depend on the triton it meets (ImportError for a missing module or an API
        # generation without matmul_ogs/routing, AttributeError/NameError from a triton it was not written
        # for): every one of them means "not usable here", with the reason kept for the error message.
        return None, f"cannot import triton_kernels' matmul_ogs/routing API ({type(exc).__name__}: {exc})"
    tk = SimpleNamespace(
        FnSpecs=FnSpecs,
        FusedActivation=FusedActivation,
        matmul_ogs=matmul_ogs,
        opt_flags=opt_flags,
        routing_from_bitmatrix=routing_from_bitmatrix,
        swiglu_fn=swiglu_fn,
        Bitmatrix=Bitmatrix,
    )
    if not torch.cuda.is_available():
        return tk, "no CUDA device (triton_kernels' matmul_ogs runs on CUDA GPUs only)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return tk, f"CUDA capability {major}.{minor} < 8.0 (matmul_ogs needs Ampere or newer)"
    return tk, None


def unavailable_reason() -> str | None:
    """Why this backend cannot run here, or None when it can."""
    return _load()[1]


def is_available() -> bool:
    """True when triton_kernels imports (with the matmul_ogs/routing API) and a capable CUDA GPU is present."""
    return _load()[1] is None


def _require() -> SimpleNamespace:
    tk, reason = _load()
    if reason is not None:
        raise RuntimeError(
            f"{_NAME}: triton_kernels is not available: {reason}. It is optional: put OpenAI's "
            "triton_kernels package (triton-lang/triton python/triton_kernels, or the copy vendored in the vllm "
            "wheel) on PYTHONPATH, or use backend='triton' / 'torch'."
        )
    return tk


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _pack_routing_kernel(
    ids_ptr, stride_ids_m, stride_ids_k,
    gates_ptr, stride_gates_m, stride_gates_k,
    map_ptr, n_global,
    out_ids_ptr, out_gates_ptr, bits_ptr,
    n_rows, n_local,
    TOPK: tl.constexpr, P: tl.constexpr, N_WORDS: tl.constexpr,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Per token: local expert ids (-1 = invalid), merged router weights and the expert bitmatrix row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, P)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    in_ok = row_ok[:, None] & (slots < TOPK)[None, :]
    ids = tl.load(ids_ptr + rows64[:, None] * stride_ids_m + slots[None, :] * stride_ids_k, mask=in_ok, other=-1)
    gates = tl.load(gates_ptr + rows64[:, None] * stride_gates_m + slots[None, :] * stride_gates_k,
                    mask=in_ok, other=0.0).to(tl.float32)
    if HAS_MAP:
        in_range = (ids >= 0) & (ids < n_global)
        local = tl.load(map_ptr + tl.where(in_range, ids, 0), mask=in_ok & in_range, other=-1)
    else:
        local = ids
    valid = in_ok & (local >= 0) & (local < n_local)
    local = tl.where(valid, local, -1).to(tl.int32)
    # A repeated expert in one token keeps its first slot, which carries the summed weight of all its
    # slots (sum_j g_j FFN_e(x) = (sum_j g_j) FFN_e(x)); the repeats become invalid slots.
    same = (local[:, :, None] == local[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = slots[None, None, :] < slots[None, :, None]
    repeat = tl.max((same & earlier).to(tl.int32), axis=2) > 0
    merged = tl.sum(tl.where(same, gates[:, None, :], 0.0), axis=2)
    keep = valid & (repeat == 0)
    out_offs = rows64[:, None] * P + slots[None, :]
    tl.store(out_ids_ptr + out_offs, tl.where(keep, local, -1), mask=row_ok[:, None])
    tl.store(out_gates_ptr + out_offs, tl.where(keep, merged, 0.0), mask=row_ok[:, None])
    word_of = tl.where(keep, local >> 5, -1)
    bit = tl.full([BLOCK_M, P], 1, tl.uint32) << (local & 31).to(tl.uint32)
    for w in tl.static_range(N_WORDS):
        word = tl.reduce(tl.where(word_of == w, bit, 0), 1, _bit_or)
        tl.store(bits_ptr + rows64 * N_WORDS + w, word, mask=row_ok)


def _pack_routing(topk_ids, topk_weights, expert_map, n_local: int):
    """Launch ``_pack_routing_kernel``: ``(ids [M, P] int32, gates [M, P] fp32, bits [M, ceil(E/32)] uint32)``."""
    M, topk = topk_ids.shape
    P = triton.next_power_of_2(topk)
    n_words = triton.cdiv(n_local, 32)
    ids = torch.empty((M, P), dtype=torch.int32, device=topk_ids.device)
    gates = torch.empty((M, P), dtype=torch.float32, device=topk_ids.device)
    bits = torch.empty((M, n_words), dtype=torch.uint32, device=topk_ids.device)
    # NOTE: the repeat check is a [BLOCK_M, P, P] compare; 4096 elements per program keeps it in registers.
    block_m = max(1, min(32, 4096 // (P * P)))
    has_map = expert_map is not None
    _pack_routing_kernel[(triton.cdiv(M, block_m),)](
        topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1),
        expert_map if has_map else topk_ids, expert_map.shape[0] if has_map else 0,
        ids, gates, bits,
        M, n_local,
        TOPK=topk, P=P, N_WORDS=n_words, HAS_MAP=has_map, BLOCK_M=block_m,
    )
    return ids, gates, bits


def _routing(tk, topk_ids, topk_weights, expert_map, n_local: int):
    """``(RoutingData, GatherIndx, ScatterIndx)`` for matmul_ogs, built on the device.

    NOTE: what triton_kernels' routing (``routing_from_bitmatrix``) needs, and how we meet it:
    - expert ids as [M, n_expts_act] with -1 for slots to drop: ours after expert_map, out-of-range ids -> -1;
    - n_expts_act a power of two (its index kernel does ``tl.arange(0, n_expts_act * 32)``): topk is padded
      to P = next_power_of_2(topk) with -1 slots (topk 6 -> 8), which cost nothing in the GEMMs;
    - the bitmatrix must agree with the ids (its histogram comes from the bits, the sort from the ids), so
      an expert may appear at most once per token: repeats are merged into one slot by our pack kernel;
    - no host sync anywhere: every size comes from M, P and E; counts stay in device tensors.
    """
    ids, gates, bits = _pack_routing(topk_ids, topk_weights, expert_map, n_local)
    M, P = ids.shape
    bitmatrix = tk.Bitmatrix(bits, shape=[M, bits.shape[1] * 32], shape_max=[M, None], scratchpad=None)
    return tk.routing_from_bitmatrix(bitmatrix, gates, ids, n_local, P)


def _weight_view(w: torch.Tensor) -> torch.Tensor:
    """``[E, out, in]`` (our nn.Linear convention) -> the ``[E, in, out]`` operand matmul_ogs multiplies by.

    NOTE: returns the transposed view (no copy) whenever one of its two matrix dims has unit stride, which
    matmul_ogs reads either way (``W_TRANSPOSE`` / a transposed TMA descriptor): nn.Linear-contiguous
    ``[E, out, in]`` storage and transposed views of ``[E, in, out]`` storage both qualify. Only a weight
    with no unit stride in its matrix dims (e.g. a slice with a step) is copied, on every call: nothing is
    cached behind the caller's back.
    """
    view = w.transpose(1, 2)
    if view.stride(-1) == 1 or view.stride(-2) == 1:
        return view
    return view.contiguous()


def _bias(b: torch.Tensor | None) -> torch.Tensor | None:
    # NOTE: matmul_ogs indexes the bias as base + expert * stride(0) + column, so the column stride must be
    # 1; a bias [E, 2N] is small, so the rare strided one is copied (each call, not cached).
    if b is None or b.stride(-1) == 1:
        return b
    return b.contiguous()


def _tma_aligned(n: int, dtype: torch.dtype) -> bool:
    return n * dtype.itemsize % 16 == 0


def _intermediate(rows: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """The first GEMM's output ``[1, rows, n]`` (matmul_ogs' 3-D ``y``), rows padded to 16 bytes.

    NOTE: matmul_ogs picks its persistent TMA kernel from the strides of x and w only, then builds a TMA
    descriptor for its output too, which fails ("strides must be 16-byte aligned") when n * itemsize is not
    a multiple of 16 (N = 333). Padding the row stride of the buffer we hand it (a view, same shape) keeps
    every layout legal; for aligned N (all real models) the buffer is exact.
    """
    n_pad = n if _tma_aligned(n, like.dtype) else triton.cdiv(n * like.dtype.itemsize, 16) * 16 // like.dtype.itemsize
    return torch.empty((1, rows, n_pad), dtype=like.dtype, device=like.device)[:, :, :n]


@contextlib.contextmanager
def _no_persistent_kernel(tk, when: bool):
    """Run matmul_ogs with ``is_persistent=False`` when ``when`` (its constraints are module-global)."""
    if not when:
        yield
        return
    saved = dict(tk.opt_flags._opt_flags_constraints)
    tk.opt_flags.update_opt_flags_constraints({"is_persistent": False})
    try:
        yield
    finally:
        tk.opt_flags.reset_opt_flags_constraints()
        tk.opt_flags.update_opt_flags_constraints(saved)


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "swigluoai",
    *,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The ``moe_ext::fused_experts`` computation through ``matmul_ogs`` (arguments validated by the op).

    Raises NotImplementedError for what matmul_ogs does not fuse (activations other than swigluoai, dtypes
    other than bf16/fp16, topk > 64) and RuntimeError when triton_kernels is not usable here.
    """
    if activation not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(
            f"{_NAME}: activation={activation!r} is not supported; matmul_ogs fuses only "
            f"{', '.join(repr(a) for a in SUPPORTED_ACTIVATIONS)} (use backend='triton' or 'torch')"
        )
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"{_NAME}: hidden_states dtype {hidden_states.dtype} is not supported; expected torch.bfloat16 "
            "or torch.float16 (use backend='triton' or 'torch')"
        )
    if topk_ids.shape[-1] > MAX_TOPK:
        raise NotImplementedError(f"{_NAME}: topk={topk_ids.shape[-1]} is not supported; expected at most {MAX_TOPK}")
    tk = _require()
    if not hidden_states.is_cuda:
        raise RuntimeError(f"{_NAME} needs CUDA tensors, got hidden_states on {hidden_states.device}")
    M, K = hidden_states.shape
    E = w1.shape[0]
    if M == 0:
        return hidden_states.new_empty((0, K))
    act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit")), (float(alpha), float(limit)), 2)
    topk = topk_ids.shape[1]
    if apply_router_weight_on_input:
        # NOTE: matmul_ogs has no per-row input scale (its `gammas` multiply after the activation:
        # act(W1 x) g, not act(W1 (g x))), so the rows g[t,j] x[t] are materialised ([M * topk, K], one
        # copy) and routed as M * topk single-slot tokens: each slot is its own row through both GEMMs
        # (a repeated expert in a token stays two rows, as the contract wants), then the topk rows of a
        # token are summed in fp32. gpt-oss/Llama-4 style topk = 1 needs no sum.
        routing_data, gather_indx, scatter_indx = _routing(
            tk, topk_ids.reshape(M * topk, 1), topk_weights.reshape(M * topk, 1), expert_map, E
        )
        x = (hidden_states.float()[:, None, :] * topk_weights.float()[:, :, None]).to(hidden_states.dtype)
        x = x.view(M * topk, K)
        gammas = None
    else:
        routing_data, gather_indx, scatter_indx = _routing(tk, topk_ids, topk_weights, expert_map, E)
        # NOTE: triton_kernels' gather path reads rows through an index; a row-major [M, K] view is what its
        # tiles are laid out for, so the (rare) hidden_states with a strided last dim is copied.
        x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
        gammas = routing_data.gate_scal
    N = w2.shape[-1]
    intermediate = tk.matmul_ogs(
        x, _weight_view(w1), _bias(w1_bias), routing_data, gather_indx=gather_indx, fused_activation=act,
        y=_intermediate(gather_indx.src_indx.shape[0], N, hidden_states),
    )
    # NOTE: the second GEMM (topk > 1) writes per-slot rows into a [M * P, K] scratch of its own, through a
    # TMA descriptor when it picks its persistent kernel; with K * itemsize not a multiple of 16 that
    # descriptor is illegal, so such K (none of the real models) runs its non-persistent kernel instead.
    # NOTE: with topk > 1 matmul_ogs writes each slot's (W2 a + b2) g rounded to the output dtype, then sums
    # the slots in fp32 (its grouped reduction): one extra rounding per slot compared with our kernels,
    # far inside the bf16 tolerance; forcing fp32 slots would turn off its persistent TMA kernel.
    with _no_persistent_kernel(tk, not _tma_aligned(K, hidden_states.dtype)):
        out = tk.matmul_ogs(
            intermediate, _weight_view(w2), _bias(w2_bias), routing_data, scatter_indx=scatter_indx, gammas=gammas
        )
    if apply_router_weight_on_input and topk > 1:
        return out.view(M, topk, K).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)
    return out.view(M, K)
