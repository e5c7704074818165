"""Shared base of the expert classes: held weight layout, validation, problem size, capabilities, workspaces.

The classes hold the expert weights the way vLLM's OAI Triton path holds them: every tensor of a
weight (data and scale) laid out ``[E, in, out]``. N is the intermediate size (w1 produces 2N values,
gate and up), K the hidden size, E the number of local experts.

============  ===================================  =======================================
quant         w1 ; w1_scale                        w2 ; w2_scale
============  ===================================  =======================================
"none"        [E, K, 2N] fp32/fp16/bf16            [E, N, K], same dtype as w1
"fp8_block"   [E, K, 2N] float8_e4m3fn ;           [E, N, K] float8_e4m3fn ;
              [E, ceil(K/128), ceil(2N/128)] fp32  [E, ceil(N/128), ceil(K/128)] fp32
"mxfp4"       [E, K/2, 2N] uint8 (e2m1 pairs) ;    [E, N/2, K] uint8 ;
              [E, K/32, 2N] uint8 (E8M0)           [E, N/32, K] uint8
============  ===================================  =======================================

Biases are fp32 ``w1_bias [E, 2N]`` and ``w2_bias [E, K]``. The ops use the nn.Linear convention
``[E, out, in]`` (docs/ops.md); the classes hand them ``transpose(1, 2)`` views of what they hold, never
copies. Quantized data and scales are transposed alike, so packing stays along the ops' K axis.

MXFP4 weights are prepared once, at construction: a stack whose packed ``in`` axis is not the contiguous one
(``[E, in/2, out]`` storage, the layout vLLM's gpt-oss path keeps) is copied into ``in``-contiguous storage
(``prepare_mxfp4_layout``), held as the same ``[E, in/2, out]`` view of it; the ops then read each weight
row's bytes contiguously. Stacks that already have that storage are held as given. On CUDA, with the backend
"auto" or "triton", stacks that the tensor-core layout takes (``prepare_held_mxfp4_mma``: K and N multiples of
64, finite scales up to 2^21) are held in that layout instead (``op_quant == "mxfp4_mma"``, same shapes, the
bytes reordered; the checkpoint tensors are not kept): the ops' kernels for it are the faster ones at every
batch size of gpt-oss (benchmarks/results/README.md).
"""

from __future__ import annotations

import math

import torch

from moe_extension.ops import ACTIVATIONS
from moe_extension.quant.mxfp4_mma import MMA_COLS, prepare_mxfp4_mma, scales_beyond_mma_layout

BACKENDS = ("auto", "torch", "triton", "triton_kernels")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_BLOCK = 128
_MXFP4_GROUP = 32

Shape = tuple[int, ...]


def moe_problem_size(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """``(E, M, N, K, topk)`` from hidden states ``[M, K]``, held weights ``w1 [E, *, 2N]`` and
    ``w2 [E, *, K]`` and ``topk_ids [M, topk]``.

    N and K are read from the unpacked axes (w1's output width and the hidden states), so the answer is
    the same for every quant scheme (MXFP4 halves the packed input axis of both weights).
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a Tensor, got {type(topk_ids).__name__}")
    return _problem_size(hidden_states, w1, w2, tuple(topk_ids.shape))


def _problem_size(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ids_shape: Shape
) -> tuple[int, int, int, int, int]:
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [M, K], got shape {list(hidden_states.shape)}")
    if w1.dim() != 3:
        raise ValueError(f"w1 must be 3-D [E, K, 2N], got shape {list(w1.shape)}")
    if w2.dim() != 3:
        raise ValueError(f"w2 must be 3-D [E, N, K], got shape {list(w2.shape)}")
    M, K = hidden_states.shape
    E, two_n = w1.size(0), w1.size(2)
    if two_n % 2 != 0:
        raise ValueError(f"w1 must be [E, K, 2N] with an even last dimension, got shape {list(w1.shape)}")
    if w2.size(0) != E:
        raise ValueError(f"w2 must hold E = {E} experts like w1, got shape {list(w2.shape)}")
    if w2.size(2) != K:
        raise ValueError(
            f"w2 must be [E, N, K] with K = hidden_states.size(1) = {K}, got shape {list(w2.shape)}"
        )
    if len(ids_shape) != 2 or ids_shape[0] != M:
        raise ValueError(f"topk_ids must have shape [M, topk] with M = {M}, got shape {list(ids_shape)}")
    return E, M, two_n // 2, K, ids_shape[1]


def resize_workspace(buffer: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A view of the first ``prod(shape)`` elements of a contiguous ``buffer``, shaped ``shape``.

    Engines allocate one buffer for the largest batch and reuse its prefix for smaller ones.
    """
    numel = math.prod(shape)
    if not buffer.is_contiguous() or buffer.numel() < numel:
        raise ValueError(
            f"workspace buffer must be contiguous with at least {numel} elements for shape {list(shape)}, "
            f"got shape {list(buffer.shape)} (contiguous: {buffer.is_contiguous()})"
        )
    return buffer.view(-1)[:numel].view(shape)


def gated_activation(activation: str, out: torch.Tensor, h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The native op of ``activation``: ``out [S, N] = act(h [S, 2N])`` (docs/ops.md, native ops); returns ``out``."""
    if activation == "swigluoai":
        torch.ops.moe_ext.swigluoai_and_mul(out, h, alpha, limit)
    elif activation == "swiglustep":
        torch.ops.moe_ext.swiglustep_and_mul(out, h, limit)
    else:
        getattr(torch.ops.moe_ext, f"{activation}_and_mul")(out, h)
    return out


def prepare_mxfp4_layout(t: torch.Tensor) -> torch.Tensor:
    """A held MXFP4 stack (packed values or scales, ``[E, in/2, out]`` / ``[E, in/32, out]``) in storage whose
    ``in`` axis is contiguous: ``t`` itself when it already is, else one copy, returned as the same view.

    The kernels read a weight row's packed bytes along ``in``; with ``out`` contiguous instead, every step
    first transposes its bytes in registers (about 40% more instructions in gpt-oss's first-GEMM loop).
    """
    if t.stride(1) == 1:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def prepare_held_mxfp4_mma(
    w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor, w2_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Held MXFP4 stacks (``[E, in/2, out]`` codes, ``[E, in/32, out]`` scales) in the tensor-core layout
    (``prepare_mxfp4_mma`` of the ops' ``[E, out, in]`` weights), returned as the same ``[E, in, out]`` views;
    None when the layout does not take them (K or N not a multiple of 64, a finite scale above 2^21)."""
    two_n, k = w1.size(2), w2.size(2)
    if two_n % (2 * MMA_COLS) or k % MMA_COLS:
        return None
    if any(bool(scales_beyond_mma_layout(s).any()) for s in (w1_scale, w2_scale)):
        return None
    out = []
    for q, s in ((w1, w1_scale), (w2, w2_scale)):
        q, s = prepare_mxfp4_mma(q.transpose(1, 2), s.transpose(1, 2))
        out += [q.transpose(1, 2), s.transpose(1, 2)]
    return out[0], out[2], out[1], out[3]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ExpertsBase:
    """Holds validated expert weights and answers what the class supports.

    Subclasses set the capability tables below and implement ``workspace_shapes`` and ``apply``.
    """

    _DEVICES: tuple[str, ...] = ("cpu", "cuda")
    _QUANT_SCHEMES: tuple[str, ...] = ("none", "mxfp4")
    _ACTIVATIONS: tuple[str, ...] = tuple(ACTIVATIONS)
    _DEFAULT_ACTIVATION = "swigluoai"

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        w1_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        quant: str = "none",
        w1_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        activation: str | None = None,
        alpha: float = 1.702,
        limit: float = 7.0,
        backend: str = "auto",
    ) -> None:
        name = type(self).__name__
        if not isinstance(quant, str) or quant not in self._QUANT_SCHEMES:
            raise ValueError(f"{name}: quant must be one of {self._QUANT_SCHEMES}, got {quant!r}")
        if activation is None:
            activation = self._DEFAULT_ACTIVATION
        if not isinstance(activation, str) or activation not in self._ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {self._ACTIVATIONS}, got {activation!r}")
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")
        for arg, value in (("alpha", alpha), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: {arg} must be a float, got {type(value).__name__}")
        E, N, K = _check_weights(name, quant, w1, w2, w1_scale, w2_scale)
        _check_bias(name, "w1_bias", w1_bias, (E, 2 * N), w1.device)
        _check_bias(name, "w2_bias", w2_bias, (E, K), w1.device)
        self.op_quant = quant  # the quant value the ops are called with
        if quant == "mxfp4":
            w1, w2, w1_scale, w2_scale = (prepare_mxfp4_layout(t) for t in (w1, w2, w1_scale, w2_scale))
            if w1.is_cuda and backend in ("auto", "triton"):
                held = prepare_held_mxfp4_mma(w1, w2, w1_scale, w2_scale)
                if held is not None:
                    w1, w2, w1_scale, w2_scale = held
                    self.op_quant = "mxfp4_mma"
        self.w1, self.w2 = w1, w2
        self.w1_bias, self.w2_bias = w1_bias, w2_bias
        self.w1_scale, self.w2_scale = w1_scale, w2_scale
        self.quant = quant
        self.activation = activation
        self.alpha, self.limit = float(alpha), float(limit)
        self.backend = backend
        self.num_experts, self.intermediate_size, self.hidden_size = E, N, K

    # -- capability queries -------------------------------------------------------------------------
    @classmethod
    def supported_devices(cls) -> tuple[str, ...]:
        return cls._DEVICES

    @classmethod
    def supports_device(cls, device: str | torch.device) -> bool:
        return torch.device(device).type in cls._DEVICES

    @classmethod
    def supported_quant_schemes(cls) -> tuple[str, ...]:
        return cls._QUANT_SCHEMES

    @classmethod
    def supports_quant_scheme(cls, quant: str) -> bool:
        return quant in cls._QUANT_SCHEMES

    @classmethod
    def supported_activations(cls) -> tuple[str, ...]:
        return cls._ACTIVATIONS

    @classmethod
    def supports_activation(cls, activation: str) -> bool:
        return activation in cls._ACTIVATIONS

    @classmethod
    def supports_expert_map(cls) -> bool:
        """Whether ``apply`` accepts an ``expert_map`` (global id -> local id, -1 = not local)."""
        return True

    @classmethod
    def supports_chunking(cls) -> bool:
        """Whether tokens may be split into chunks computed by separate calls (no cross-token state)."""
        return True

    # -- sizes and buffers --------------------------------------------------------------------------
    def moe_problem_size(
        self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[int, int, int, int, int]:
        """``(E, M, N, K, topk)`` of a call; see :func:`moe_problem_size`."""
        return moe_problem_size(hidden_states, w1, w2, topk_ids)

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        """Name -> shape of each buffer this path needs for ``M`` tokens (``output`` included)."""
        raise NotImplementedError

    def make_workspace(
        self, M: int, topk: int, dtype: torch.dtype, device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """Allocate the buffers of :meth:`workspace_shapes` for this instance's E, N, K."""
        device = self.w1.device if device is None else device
        shapes = self.workspace_shapes(M, self.intermediate_size, self.hidden_size, topk, self.num_experts)
        return {key: torch.empty(shape, dtype=dtype, device=device) for key, shape in shapes.items()}

    # -- helpers for subclasses ---------------------------------------------------------------------
    def op_weights(self) -> dict[str, torch.Tensor | None]:
        """The weights in the ops' ``[E, out, in]`` convention: transposed views, no copies."""
        return {
            "w1": self.w1.transpose(1, 2),
            "w2": self.w2.transpose(1, 2),
            "w1_scale": None if self.w1_scale is None else self.w1_scale.transpose(1, 2),
            "w2_scale": None if self.w2_scale is None else self.w2_scale.transpose(1, 2),
        }

    def _check_call(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor | None,
        ids_shape: Shape,
        expert_map: torch.Tensor | None,
    ) -> tuple[int, int, int, int, int]:
        """Device and shape checks of an ``apply`` call; ``ids_shape`` is the shape of ``topk_ids``."""
        name = type(self).__name__
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"{name}.apply: hidden_states must be a Tensor, got {type(hidden_states).__name__}")
        if not self.supports_device(hidden_states.device):
            raise ValueError(
                f"{name}.apply: hidden_states is on {hidden_states.device}, supported devices are {self._DEVICES}"
            )
        if hidden_states.device != self.w1.device:
            raise ValueError(
                f"{name}.apply: hidden_states is on {hidden_states.device} but the weights are on {self.w1.device}"
            )
        sizes = _problem_size(hidden_states, self.w1, self.w2, ids_shape)
        if topk_weights is not None and tuple(topk_weights.shape) != tuple(ids_shape):
            raise ValueError(
                f"{name}.apply: topk_weights must have the shape of topk_ids {list(ids_shape)}, "
                f"got {list(topk_weights.shape)}"
            )
        if expert_map is not None and not self.supports_expert_map():
            raise ValueError(f"{name}.apply: this class does not support expert_map")
        return sizes

    def _routing_shape(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Shape:
        """Type checks of the routing arguments; the shape of ``topk_ids``."""
        name = type(self).__name__
        for arg, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.apply: {arg} must be a Tensor, got {type(t).__name__}")
        return tuple(topk_ids.shape)

    def _op_kwargs(self, expert_map: torch.Tensor | None, apply_router_weight_on_input: bool) -> dict:
        weights = self.op_weights()
        return {
            "w1_bias": self.w1_bias,
            "w2_bias": self.w2_bias,
            "expert_map": expert_map,
            "apply_router_weight_on_input": bool(apply_router_weight_on_input),
            "quant": self.op_quant,
            "w1_scale": weights["w1_scale"],
            "w2_scale": weights["w2_scale"],
            "alpha": self.alpha,
            "limit": self.limit,
            "backend": self.backend,
        }

    @staticmethod
    def _into(result: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        if output is None:
            return result
        if output.shape != result.shape:
            raise ValueError(f"output must have shape {list(result.shape)}, got {list(output.shape)}")
        return output.copy_(result)


def _check_weights(
    name: str,
    quant: str,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate the held weights of ``quant`` (layout table in the module docstring); return E, N, K."""
    for arg, t in (("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: {arg} must be 3-D [E, in, out], got shape {list(t.shape)}")
    if w2.device != w1.device:
        raise ValueError(f"{name}: w2 is on {w2.device} but w1 is on {w1.device}")
    E, two_n, K = w1.size(0), w1.size(2), w2.size(2)
    if two_n % 2 != 0:
        raise ValueError(f"{name}: w1 must be [E, K, 2N] with an even last dimension, got shape {list(w1.shape)}")
    N = two_n // 2
    pack = 2 if quant == "mxfp4" else 1
    expect_w1, expect_w2 = (E, K // pack, two_n), (E, N // pack, K)
    if quant == "mxfp4":
        for arg, size in (("K", K), ("N", N)):
            if size % _MXFP4_GROUP != 0:
                raise ValueError(f"{name}: mxfp4 needs {arg} divisible by {_MXFP4_GROUP}, got {arg} = {size}")
    if tuple(w2.shape) != expect_w2:
        raise ValueError(
            f"{name}: w2 must have shape [E, N{'/2' * (pack - 1)}, K] = {list(expect_w2)} "
            f"(E and N from w1 {list(w1.shape)}), got {list(w2.shape)}"
        )
    if tuple(w1.shape) != expect_w1:
        raise ValueError(
            f"{name}: w1 must have shape [E, K{'/2' * (pack - 1)}, 2N] = {list(expect_w1)} "
            f"(K from w2 {list(w2.shape)}), got {list(w1.shape)}"
        )
    if quant == "none":
        if w1.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: quant='none' needs w1 of dtype fp32/fp16/bf16, got {w1.dtype}")
        if w2.dtype != w1.dtype:
            raise TypeError(f"{name}: w2 must have the dtype of w1 ({w1.dtype}), got {w2.dtype}")
        for arg, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if s is not None:
                raise ValueError(f"{name}: {arg} must be None with quant='none'")
        return E, N, K
    data_dtype, scale_dtype = (
        (torch.float8_e4m3fn, torch.float32) if quant == "fp8_block" else (torch.uint8, torch.uint8)
    )
    if quant == "fp8_block":
        b = _FP8_BLOCK
        expect_s1, expect_s2 = (E, _cdiv(K, b), _cdiv(two_n, b)), (E, _cdiv(N, b), _cdiv(K, b))
        layout = "[E, ceil(in/128), ceil(out/128)]"
    else:
        g = _MXFP4_GROUP
        expect_s1, expect_s2 = (E, K // g, two_n), (E, N // g, K)
        layout = "[E, in/32, out]"
    for arg, t, scale_arg, s, expect in (
        ("w1", w1, "w1_scale", w1_scale, expect_s1),
        ("w2", w2, "w2_scale", w2_scale, expect_s2),
    ):
        if t.dtype != data_dtype:
            raise TypeError(f"{name}: quant={quant!r} needs {arg} of dtype {data_dtype}, got {t.dtype}")
        if s is None:
            raise ValueError(f"{name}: quant={quant!r} needs {scale_arg}")
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name}: {scale_arg} must be a Tensor, got {type(s).__name__}")
        if s.dtype != scale_dtype:
            raise TypeError(f"{name}: {scale_arg} must have dtype {scale_dtype}, got {s.dtype}")
        if tuple(s.shape) != expect:
            raise ValueError(f"{name}: {scale_arg} must have shape {layout} = {list(expect)}, got {list(s.shape)}")
        if s.device != w1.device:
            raise ValueError(f"{name}: {scale_arg} is on {s.device} but w1 is on {w1.device}")
    return E, N, K


def _check_bias(name: str, arg: str, bias: torch.Tensor | None, shape: Shape, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a Tensor, got {type(bias).__name__}")
    if bias.dtype != torch.float32:
        raise TypeError(f"{name}: {arg} must be fp32, got {bias.dtype}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"{name}: {arg} must have shape {list(shape)}, got {list(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"{name}: {arg} is on {bias.device} but w1 is on {device}")
