"""Gated activations of the MoE intermediate: fakes of the native ops, functional wrappers and the
PyTorch reference.

Each op maps ``input [..., 2d]`` to ``out [..., d]`` (fp32/fp16/bf16, same dtype, same leading shape, last
dim contiguous, any leading strides), with math in fp32 and one rounding at the end:

- ``silu_and_mul``: ``silu(gate) * up``; ``gelu_and_mul``: erf-GELU(gate) * up; ``gelu_tanh_and_mul``:
  tanh-GELU(gate) * up; ``swiglustep_and_mul(limit)``: ``min(silu(gate), limit) * clamp(up, -limit, limit)``;
  all with gate = ``input[..., :d]``, up = ``input[..., d:]`` (halves).
- ``swigluoai_and_mul(alpha, limit)`` (gpt-oss), interleaved gate = ``input[..., 0::2]``, up =
  ``input[..., 1::2]``: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``out = gate * sigmoid(alpha * gate) * (up + 1)``.

``ACTIVATIONS`` names them as the ``activation=`` argument of the expert ops does; ``activation_torch``
is the reference for any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_extension.ops.arg_checks import require, require_type

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """csrc/checks.h last_dim_contiguous, for the fakes of the native ops (activations, moe_sum)."""
    require(
        t.shape[-1] <= 1 or t.stride(-1) == 1,
        lambda: f"{op}: {name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}",
    )


def _check_activation(op: str, out: torch.Tensor, input: torch.Tensor) -> None:
    """The checks of csrc/checks.h (activation_args), same order, types and messages."""
    require(input.dim() >= 1, lambda: f"{op}: input must have at least 1 dim [..., 2d], got 0 dims")
    require_type(
        input.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: input must be float32, float16 or bfloat16, got {input.dtype}",
    )
    require_type(
        out.dtype == input.dtype,
        lambda: f"{op}: out must have the dtype of input ({input.dtype}), got {out.dtype}",
    )
    require(
        out.device == input.device,
        lambda: f"{op}: out must be on the device of input ({input.device}), got {out.device}",
    )
    width = input.shape[-1]
    require(width % 2 == 0, lambda: f"{op}: input width (last dim) must be even, got {width}")
    lead = list(input.shape[:-1])
    require(
        out.dim() == input.dim() and list(out.shape[:-1]) == lead,
        lambda: f"{op}: out must have the leading shape of input {lead}, got {list(out.shape)}",
    )
    require(
        out.shape[-1] == width // 2,
        lambda: f"{op}: out width (last dim) must be half the input width = {width // 2}, got {out.shape[-1]}",
    )
    check_last_dim_contiguous(op, "input", input)
    check_last_dim_contiguous(op, "out", out)


@torch.library.register_fake("moe_ext::silu_and_mul")
def _silu_and_mul_fake(out, input) -> None:
    _check_activation("silu_and_mul", out, input)


@torch.library.register_fake("moe_ext::gelu_and_mul")
def _gelu_and_mul_fake(out, input) -> None:
    _check_activation("gelu_and_mul", out, input)


@torch.library.register_fake("moe_ext::gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(out, input) -> None:
    _check_activation("gelu_tanh_and_mul", out, input)


@torch.library.register_fake("moe_ext::swigluoai_and_mul")
def _swigluoai_and_mul_fake(out, input, alpha=1.702, limit=7.0) -> None:
    _check_activation("swigluoai_and_mul", out, input)


@torch.library.register_fake("moe_ext::swiglustep_and_mul")
def _swiglustep_and_mul_fake(out, input, limit=7.0) -> None:
    _check_activation("swiglustep_and_mul", out, input)


def _new_out(op: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:  # static under tracing; the op's own checks cover the rest
        raise RuntimeError(f"{op}: input must have at least 1 dim [..., 2d], got 0 dims")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` -> a new contiguous ``[..., d]`` tensor."""
    out = _new_out("silu_and_mul", x)
    torch.ops.moe_ext.silu_and_mul(out, x)
    return out


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """erf-GELU(``x[..., :d]``) * ``x[..., d:]`` -> a new contiguous ``[..., d]`` tensor."""
    out = _new_out("gelu_and_mul", x)
    torch.ops.moe_ext.gelu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(``x[..., :d]``) * ``x[..., d:]`` -> a new contiguous ``[..., d]`` tensor."""
    out = _new_out("gelu_tanh_and_mul", x)
    torch.ops.moe_ext.gelu_tanh_and_mul(out, x)
    return out


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss SwiGLU on interleaved gate/up -> a new contiguous ``[..., d]`` tensor."""
    out = _new_out("swigluoai_and_mul", x)
    torch.ops.moe_ext.swigluoai_and_mul(out, x, alpha, limit)
    return out


def swiglustep_and_mul(x: torch.Tensor, limit: float = 7.0) -> torch.Tensor:
    """``min(silu(gate), limit) * clamp(up, -limit, limit)`` on halves -> a new contiguous ``[..., d]`` tensor."""
    out = _new_out("swiglustep_and_mul", x)
    torch.ops.moe_ext.swiglustep_and_mul(out, x, limit)
    return out


def activation_torch(x: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """PyTorch reference for ``activation`` (a name in ``ACTIVATIONS``): computes in fp32 (fp64 for fp64
    ``x``) and returns ``x.dtype`` (pass fp32 ``x`` to get the unrounded fp32 result). ``alpha`` is used by
    swigluoai only, ``limit`` by swigluoai and swiglustep. Any device."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"activation_torch: x width (last dim) must be even, got {x.shape[-1]}")
    h = x if x.dtype == torch.float64 else x.float()
    if activation == "swigluoai":
        gate = h[..., 0::2].clamp(max=limit)
        up = h[..., 1::2].clamp(-limit, limit)
        out = gate * torch.sigmoid(alpha * gate) * (up + 1)
    else:
        d = h.shape[-1] // 2
        gate, up = h[..., :d], h[..., d:]
        if activation == "silu":
            out = F.silu(gate) * up
        elif activation == "gelu":
            out = F.gelu(gate) * up
        elif activation == "gelu_tanh":
            out = F.gelu(gate, approximate="tanh") * up
        else:
            out = F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    return out.to(x.dtype)
