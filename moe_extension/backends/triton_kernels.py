"""``fused_experts`` through OpenAI's ``triton_kernels.matmul_ogs`` (optional; CUDA, swigluoai; bf16/fp16 weights,
or MXFP4 weights with bf16 activations).

Computes exactly the ``moe_ext::fused_experts`` contract (docs/ops.md), for ``activation="swigluoai"``:

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

MXFP4 weights (``quant="mxfp4"``, gpt-oss; hidden_states bf16), prepared the way vLLM's gpt-oss path prepares
them for matmul_ogs (``prepare_mxfp4``):

- Our packed ``w [E, out, in/2]`` uint8 (two e2m1 codes per byte along ``in``, low nibble first) and its E8M0
  scales ``[E, out, in/32]`` are transposed to matmul_ogs' ``[E, in, out]`` operand, so the packed (and the
  32-element scale group) axis is dim 1 (``mx_axis=1``); the packed bytes are wrapped as a triton_kernels
  ``Tensor`` of dtype ``FP4`` (logical shape ``[E, in, out]``) and converted to the device's default matmul
  MXFP4 value layout, the scales to its default scale layout (Hopper: ``HopperMXValueLayout`` /
  ``HopperMXScaleLayout(num_warps=8)``; Blackwell and pre-Hopper GPUs have their own defaults). Both go to
  matmul_ogs as the weight and ``PrecisionConfig(weight_scale=..., flex_ctx=FlexCtx(rhs_data=InFlexData()))``.
- ``fused_experts(..., quant="mxfp4")`` takes either ``PreparedMXFP4`` objects (``prepare_mxfp4``, once, at
  weight-load time; scales None) or the raw uint8 weights + scales, which are then prepared on every call
  (a full copy and re-layout of both weight stacks: correct but slow, not for timing).
- Like vLLM, the two MXFP4 matmuls run under its opt_flags constraints (Hopper: ``split_k=1``; Blackwell:
  persistent kernel, ``epilogue_subtile=1``), set for the duration of each call only (``_opt_flags_scope``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from moe_extension.kernels._launch import cdiv, next_power_of_2

SUPPORTED_ACTIVATIONS = ("swigluoai",)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_QUANTS = ("none", "mxfp4")
MAX_TOPK = 64
MXFP4_BLOCK = 32  # elements per E8M0 scale (moe_extension.quant.mxfp4.MXFP4_BLOCK)
# NOTE: the num_warps vLLM's gpt-oss path builds the Hopper scale layout for; matmul_ogs then launches its MXFP4
# kernels with exactly that many warps (opt_flags_nvidia.compute_num_warps reads it from the layout).
MXFP4_SCALE_NUM_WARPS = 8

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


@functools.cache
def _load_mxfp4() -> tuple[SimpleNamespace | None, str | None]:
    """The parts of triton_kernels the MXFP4 weights need (kept apart: the bf16 path does not need them)."""
    try:
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor import FP4, Tensor, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout
    except Exception as exc:  # noqa: BLE001  (as in _load: any import-time failure means "not usable here")
        return None, (f"cannot import triton_kernels' MXFP4 weight API (tensor.FP4/wrap_torch_tensor/"
                      f"convert_layout, tensor_details.layout, matmul_ogs.PrecisionConfig/FlexCtx, "
                      f"numerics.InFlexData) ({type(exc).__name__}: {exc})")
    for name in ("make_default_matmul_mxfp4_w_layout", "make_default_matmul_mxfp4_w_scale_layout"):
        if not hasattr(layout, name):
            return None, f"triton_kernels.tensor_details.layout has no {name}() (another triton_kernels generation)"
    mx = SimpleNamespace(FlexCtx=FlexCtx, PrecisionConfig=PrecisionConfig, InFlexData=InFlexData, FP4=FP4,
                         Tensor=Tensor, convert_layout=convert_layout, wrap_torch_tensor=wrap_torch_tensor,
                         layout=layout)
    return mx, None


def _require_mxfp4() -> tuple[SimpleNamespace, SimpleNamespace]:
    """``(tk, mx)``: both namespaces, or RuntimeError with the reason."""
    tk = _require()
    mx, reason = _load_mxfp4()
    if reason is not None:
        raise RuntimeError(f"{_NAME}: quant='mxfp4' is not available: {reason}")
    return tk, mx


@dataclass(frozen=True, eq=False)
class PreparedMXFP4:
    """One MXFP4 expert weight stack prepared for matmul_ogs (``prepare_mxfp4``); pass it as ``w1`` / ``w2`` of
    ``fused_experts(..., quant="mxfp4")`` with the matching scale argument None.

    ``value``: triton_kernels ``Tensor`` of dtype ``FP4``, logical shape ``[E, in, out]`` (matmul_ogs' ``x @ w``
    operand), in the device's default matmul MXFP4 value layout; ``scale``: triton_kernels ``Tensor`` of the E8M0
    bytes, logical ``[E, in/32, out]``, in the default scale layout. ``shape`` is the logical (unpacked) weight
    shape in the op's convention, ``[E, out, in]``. The prepared data is a copy (a swizzled layout), except on
    GPUs whose default layout is the plain strided one, where it may share the caller's contiguous storage.
    """

    value: object
    scale: object
    num_experts: int
    out_features: int
    in_features: int
    device: torch.device

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)


def _check_raw_mxfp4(op: str, arg: str, w, scale_arg: str, scale) -> tuple[int, int, int]:
    """Checks a raw MXFP4 weight (packed uint8 ``[E, out, in/2]``) and its E8M0 scales ``[E, out, in/32]``;
    returns the logical ``(E, out, in)``. Pure shape/dtype checks: they run (and fail) without a GPU."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a packed MXFP4 uint8 tensor [E, out, in/2] or a PreparedMXFP4 "
                        f"(prepare_mxfp4), got {type(w).__name__}")
    if w.dtype != torch.uint8 or w.dim() != 3:
        raise TypeError(f"{op}: {arg} must be packed MXFP4, uint8 [E, out, in/2] (two e2m1 codes per byte), or a "
                        f"PreparedMXFP4, got {w.dtype} of shape {list(w.shape)}")
    e, out, half = w.shape
    if (2 * half) % MXFP4_BLOCK != 0:
        raise ValueError(f"{op}: {arg} [E, out, in/2] = {list(w.shape)} has in = {2 * half}, which is not a "
                         f"multiple of {MXFP4_BLOCK}")
    if scale is None:
        raise ValueError(f"{op}: raw uint8 {arg} needs {scale_arg} (its uint8 E8M0 scales [E, out, in/32]); "
                         f"only a PreparedMXFP4 {arg} carries its own scales")
    want = [e, out, 2 * half // MXFP4_BLOCK]
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 or list(scale.shape) != want:
        got = f"{scale.dtype} of shape {list(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{op}: {scale_arg} must be uint8 E8M0 [E, out, in/32] = {want} for {arg} of shape "
                         f"{list(w.shape)}, got {got}")
    if scale.device != w.device:
        raise ValueError(f"{op}: {scale_arg} must be on the device of {arg} ({w.device}), got {scale.device}")
    return e, out, 2 * half


def _default_mxfp4_layouts(mx):
    """``(value_layout, value_opts, scale_layout, scale_opts)``: this GPU's default matmul MXFP4 layouts, with
    the packed axis (and the scale groups) along dim 1 of the ``[E, in, out]`` operand, as vLLM builds them."""
    value_layout, value_opts = mx.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = mx.layout.make_default_matmul_mxfp4_w_scale_layout(
        mx_axis=1, num_warps=MXFP4_SCALE_NUM_WARPS
    )
    return value_layout, value_opts, scale_layout, scale_opts


def _prepare_with_layouts(mx, op: str, arg: str, w: torch.Tensor, w_scale: torch.Tensor,
                          value_layout, value_opts: dict, scale_layout, scale_opts: dict) -> PreparedMXFP4:
    """Wrap and re-lay-out a checked raw MXFP4 weight (any device: the layouts are plain torch code)."""
    e, out, half = w.shape
    inn = 2 * half
    if getattr(scale_layout, "name", None) == "HOPPER_SCALE" and out <= 128:
        # NOTE: matmul_ogs' Hopper MXFP4 kernel static-asserts BLOCK_N % (2 * num_warps * 2 * 8) == 0, i.e.
        # BLOCK_N = 256 with 8 warps, and its opt_flags pick BLOCK_N = 256 only for N > 128.
        raise NotImplementedError(
            f"{op}: {arg} has {out} output features; matmul_ogs' Hopper MXFP4 layout (num_warps="
            f"{MXFP4_SCALE_NUM_WARPS}) needs more than 128 (its kernel tiles N by 256)"
        )
    # NOTE: matmul_ogs multiplies x [rows, in] @ W [E, in, out]. Our [E, out, in/2] stack transposed is that
    # operand with the packed bytes along dim 1, hence mx_axis=1. wrap_torch_tensor takes the first unit-stride
    # dim as the packed one (and doubles it: logical [E, in, out]), so the bytes must be contiguous along `in`:
    # any other storage (e.g. a transposed view of [E, in/2, out]) is copied first; the scales likewise.
    packed = w.contiguous().transpose(1, 2)
    scales = w_scale.contiguous().transpose(1, 2)
    value = mx.convert_layout(mx.wrap_torch_tensor(packed, dtype=mx.FP4), value_layout, **value_opts)
    scale = mx.convert_layout(mx.wrap_torch_tensor(scales), scale_layout, **scale_opts)
    if list(value.shape) != [e, inn, out] or value.dtype != mx.FP4:
        raise RuntimeError(f"{op}: preparing {arg}: expected an FP4 triton_kernels Tensor of logical shape "
                           f"{[e, inn, out]}, got {value.dtype} {list(value.shape)} (triton_kernels API changed?)")
    if list(scale.shape) != [e, inn // MXFP4_BLOCK, out]:
        raise RuntimeError(f"{op}: preparing {arg}: expected scales of logical shape {[e, inn // MXFP4_BLOCK, out]}, "
                           f"got {list(scale.shape)} (triton_kernels API changed?)")
    return PreparedMXFP4(value=value, scale=scale, num_experts=e, out_features=out, in_features=inn, device=w.device)


def prepare_mxfp4(w: torch.Tensor, w_scale: torch.Tensor) -> PreparedMXFP4:
    """Prepare one MXFP4 expert weight stack for ``fused_experts(..., quant="mxfp4")``, once (weight-load time).

    ``w``: packed uint8 ``[E, out, in/2]`` (the op's layout, any strides), ``w_scale``: uint8 E8M0
    ``[E, out, in/32]``; e.g. ``prepare_mxfp4(w1, w1_scale)`` and ``prepare_mxfp4(w2, w2_scale)``. Returns a
    ``PreparedMXFP4`` holding both in the layouts matmul_ogs reads on this GPU (module docstring). Argument
    errors raise TypeError/ValueError (also without a GPU), shapes the GPU's layout cannot run raise
    NotImplementedError, a missing triton_kernels or GPU RuntimeError.
    """
    op = "prepare_mxfp4"
    _check_raw_mxfp4(op, "w", w, "w_scale", w_scale)
    _, mx = _require_mxfp4()
    if not w.is_cuda:
        raise RuntimeError(f"{op} needs CUDA tensors (the layouts are the GPU's), got w on {w.device}")
    return _prepare_with_layouts(mx, op, "w", w, w_scale, *_default_mxfp4_layouts(mx))


def _mxfp4_operand(arg: str, w, scale_arg: str, scale, device: torch.device) -> tuple[int, int, int]:
    """The logical ``(E, out, in)`` of a fused_experts MXFP4 weight argument, raw or prepared (checked)."""
    if isinstance(w, PreparedMXFP4):
        if scale is not None:
            raise ValueError(f"{_NAME}: {arg} is a PreparedMXFP4, which carries its own scales; {scale_arg} must "
                             f"be None, got a {type(scale).__name__}")
        if w.device != device:
            raise ValueError(f"{_NAME}: {arg} (PreparedMXFP4) is on {w.device}, hidden_states on {device}")
        return w.shape
    dims = _check_raw_mxfp4(_NAME, arg, w, scale_arg, scale)
    if w.device != device:
        raise ValueError(f"{_NAME}: {arg} is on {w.device}, hidden_states on {device}")
    return dims


def _mxfp4_constraints(device: torch.device) -> dict:
    """vLLM's opt_flags constraints for matmul_ogs with MXFP4 weights on this GPU (set in its ``_swizzle_mxfp4``)."""
    major = torch.cuda.get_device_capability(device)[0]
    if major == 9:
        return {"split_k": 1}
    if major >= 10:
        return {"is_persistent": True, "epilogue_subtile": 1}
    return {}


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
    P = next_power_of_2(topk)
    n_words = cdiv(n_local, 32)
    ids = torch.empty((M, P), dtype=torch.int32, device=topk_ids.device)
    gates = torch.empty((M, P), dtype=torch.float32, device=topk_ids.device)
    bits = torch.empty((M, n_words), dtype=torch.uint32, device=topk_ids.device)
    # NOTE: the repeat check is a [BLOCK_M, P, P] compare; 4096 elements per program keeps it in registers.
    block_m = max(1, min(32, 4096 // (P * P)))
    has_map = expert_map is not None
    _pack_routing_kernel[(cdiv(M, block_m),)](
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
    n_pad = n if _tma_aligned(n, like.dtype) else cdiv(n * like.dtype.itemsize, 16) * 16 // like.dtype.itemsize
    return torch.empty((1, rows, n_pad), dtype=like.dtype, device=like.device)[:, :, :n]


@contextlib.contextmanager
def _opt_flags_scope(tk, constraints: dict):
    """Run matmul_ogs under extra opt_flags ``constraints`` (module-global in triton_kernels), restored after."""
    if not constraints:
        yield
        return
    saved = dict(tk.opt_flags._opt_flags_constraints)
    tk.opt_flags.update_opt_flags_constraints(constraints)
    try:
        yield
    finally:
        tk.opt_flags.reset_opt_flags_constraints()
        tk.opt_flags.update_opt_flags_constraints(saved)


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor | PreparedMXFP4,
    w2: torch.Tensor | PreparedMXFP4,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "swigluoai",
    *,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    quant: str = "none",
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The ``moe_ext::fused_experts`` computation through ``matmul_ogs`` (arguments validated by the op).

    ``quant="none"``: ``w1``/``w2`` in hidden_states' dtype (bf16/fp16), scales None. ``quant="mxfp4"``
    (hidden_states bf16): each of ``w1``/``w2`` is either a ``PreparedMXFP4`` (``prepare_mxfp4``; its scale
    argument None) or the raw packed uint8 weight with its uint8 E8M0 scales (``w1 [E, 2N, K/2]`` +
    ``w1_scale [E, 2N, K/32]``, ``w2 [E, K, N/2]`` + ``w2_scale [E, K, N/32]``), which is then prepared on
    every call: a full copy and re-layout of the weights, slow, not for timing.

    Raises NotImplementedError for what this path does not support (activations other than swigluoai, dtypes
    other than bf16/fp16, quant other than none/mxfp4, mxfp4 with non-bf16 hidden_states, topk > 64),
    TypeError/ValueError for inconsistent weight/scale arguments (checked before anything needs a GPU) and
    RuntimeError when triton_kernels is not usable here.
    """
    if activation not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(
            f"{_NAME}: activation={activation!r} is not supported; matmul_ogs fuses only "
            f"{', '.join(repr(a) for a in SUPPORTED_ACTIVATIONS)} (use backend='triton' or 'torch')"
        )
    if quant not in SUPPORTED_QUANTS:
        raise NotImplementedError(
            f"{_NAME}: quant={quant!r} is not supported; expected one of "
            f"{', '.join(repr(q) for q in SUPPORTED_QUANTS)} (use backend='torch')"
        )
    M, K = hidden_states.shape
    if quant == "mxfp4":
        if hidden_states.dtype != torch.bfloat16:
            raise NotImplementedError(
                f"{_NAME}: hidden_states dtype {hidden_states.dtype} is not supported with quant='mxfp4'; "
                "expected torch.bfloat16 (matmul_ogs multiplies MXFP4 weights with bf16 activations)"
            )
        e1, rows1, k1 = _mxfp4_operand("w1", w1, "w1_scale", w1_scale, hidden_states.device)
        e2, k2, N = _mxfp4_operand("w2", w2, "w2_scale", w2_scale, hidden_states.device)
        if (e1, rows1, k1, k2) != (e2, 2 * N, K, K):
            raise ValueError(
                f"{_NAME}: MXFP4 weights of logical shapes w1 [E, 2N, K] = {[e1, rows1, k1]} and w2 [E, K, N] = "
                f"{[e2, k2, N]} do not match each other or hidden_states [M, K] = {[M, K]}"
            )
    else:
        for arg, w in (("w1", w1), ("w2", w2)):
            if isinstance(w, PreparedMXFP4):
                raise ValueError(f"{_NAME}: {arg} is a PreparedMXFP4 (prepare_mxfp4); pass quant='mxfp4'")
        for arg, scale in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if scale is not None:
                raise ValueError(f"{_NAME}: {arg} is only used with quant='mxfp4', got quant={quant!r}")
        if hidden_states.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(
                f"{_NAME}: hidden_states dtype {hidden_states.dtype} is not supported; expected torch.bfloat16 "
                "or torch.float16 (use backend='triton' or 'torch')"
            )
        N = w2.shape[-1]
    if topk_ids.shape[-1] > MAX_TOPK:
        raise NotImplementedError(f"{_NAME}: topk={topk_ids.shape[-1]} is not supported; expected at most {MAX_TOPK}")
    if quant == "mxfp4":
        tk, mx = _require_mxfp4()
    else:
        tk = _require()
    if not hidden_states.is_cuda:
        raise RuntimeError(f"{_NAME} needs CUDA tensors, got hidden_states on {hidden_states.device}")
    E = w1.shape[0]
    if M == 0:
        return hidden_states.new_empty((0, K))
    if quant == "mxfp4":
        # NOTE: raw uint8 weights are prepared here, on every call (a copy and re-layout of both stacks);
        # PreparedMXFP4 ones (prepare_mxfp4, once) go to matmul_ogs as they are.
        layouts = _default_mxfp4_layouts(mx)
        w1p = w1 if isinstance(w1, PreparedMXFP4) else _prepare_with_layouts(mx, _NAME, "w1", w1, w1_scale, *layouts)
        w2p = w2 if isinstance(w2, PreparedMXFP4) else _prepare_with_layouts(mx, _NAME, "w2", w2, w2_scale, *layouts)
        w1_op, w2_op = w1p.value, w2p.value
        precision1 = mx.PrecisionConfig(weight_scale=w1p.scale, flex_ctx=mx.FlexCtx(rhs_data=mx.InFlexData()))
        precision2 = mx.PrecisionConfig(weight_scale=w2p.scale, flex_ctx=mx.FlexCtx(rhs_data=mx.InFlexData()))
        constraints = _mxfp4_constraints(hidden_states.device)
    else:
        w1_op, w2_op = _weight_view(w1), _weight_view(w2)
        precision1 = precision2 = None
        constraints = {}
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
    with _opt_flags_scope(tk, constraints):
        intermediate = tk.matmul_ogs(
            x, w1_op, _bias(w1_bias), routing_data, gather_indx=gather_indx, precision_config=precision1,
            fused_activation=act, y=_intermediate(gather_indx.src_indx.shape[0], N, hidden_states),
        )
    # NOTE: the second GEMM (topk > 1) writes per-slot rows into a [M * P, K] scratch of its own, through a
    # TMA descriptor when it picks its persistent kernel; with K * itemsize not a multiple of 16 that
    # descriptor is illegal, so such K (none of the real models) runs its non-persistent kernel instead.
    # NOTE: with topk > 1 matmul_ogs writes each slot's (W2 a + b2) g rounded to the output dtype, then sums
    # the slots in fp32 (its grouped reduction): one extra rounding per slot compared with our kernels,
    # far inside the bf16 tolerance; forcing fp32 slots would turn off its persistent TMA kernel.
    if not _tma_aligned(K, hidden_states.dtype):
        constraints = {**constraints, "is_persistent": False}
    with _opt_flags_scope(tk, constraints):
        out = tk.matmul_ogs(
            intermediate, w2_op, _bias(w2_bias), routing_data, scatter_indx=scatter_indx,
            precision_config=precision2, gammas=gammas,
        )
    if apply_router_weight_on_input and topk > 1:
        return out.view(M, topk, K).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)
    return out.view(M, K)
