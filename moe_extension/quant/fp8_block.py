"""fp8 (float8_e4m3fn) block quantization, the DeepSeek-V3 recipe used by ``quant="fp8_block"``.

Weights: 128 x 128 blocks. ``quantize_fp8_block(w)`` maps a float weight ``[..., rows, cols]`` (a stack
``[E, rows, cols]`` or a single matrix) to ``q`` e4m3fn of the same shape and fp32 scales
``s [..., ceil(rows/128), ceil(cols/128)]`` with ``w[.., n, k] ~= q[.., n, k] * s[.., n // 128, k // 128]``;
``dequantize_fp8_block(q, s)`` is the inverse (fp32). Edge blocks (rows or cols not multiples of 128) are
partial blocks; their scale comes from the elements that exist.

Activations: per token, 128 columns per group. ``quantize_fp8_per_token_group(x)`` maps ``x [..., cols]``
to ``q`` e4m3fn ``[..., cols]`` and fp32 ``s [..., ceil(cols/128)]``; ``dequantize_fp8_per_token_group``
inverts it.

Both use the same rule per block/group, computed in fp32:
``s = max(amax|block|, 1e-10) / 448``, ``q = e4m3fn(clamp(x / s, -448, 448))`` (round to nearest even).

UE8M0 scales (DeepGEMM's power-of-two recipe, ``ue8m0=True``): ``s`` is rounded up to a power of two,
``2^ceil(log2 s)``, before ``q`` is computed. Weight scales then travel as uint8 E8M0 bytes (``2^(byte - 127)``,
``e8m0_to_float``): ``quantize_fp8_block(w, ue8m0=True)`` returns them, ``dequantize_fp8_block`` and the ops take them,
and the ops quantize the activations with power-of-two scales too whenever the weight scales are bytes.
``ue8m0_scales(s)`` turns fp32 scales into such bytes (rounded up; exact for powers of two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_extension.quant.mxfp4 import e8m0_to_float

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
SCALE_EPS = 1e-10


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # The divisor is a tensor on amax's device, not the Python number: CUDA divides by a CPU scalar as a
    # multiply by its rounded reciprocal, which missed the correctly rounded amax / 448 in 53% of random
    # values on the H100. A scale one ulp off moves x / s off the exact e4m3 ties that fp16 / bf16 inputs
    # hit often: CPU and CUDA then quantized ~1000 of 2048 elements of one expert's rows differently
    # (a full fp8 step each), and test_half_precision's fp8 case failed on 9 of 80 GPU seeds.
    return torch.clamp(amax, min=SCALE_EPS) / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """fp32 ``s > 0`` rounded up to a power of two: the exponent field, plus one where any mantissa bit is set."""
    bits = s.float().view(torch.int32)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def ue8m0_scales(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales (positive, normal) -> uint8 E8M0 bytes of ``2^ceil(log2 s)``; NaN -> 255."""
    exp = _pow2_ceil(s).view(torch.int32) >> 23
    return torch.where(torch.isnan(s), 255, exp).to(torch.uint8)


def _to_fp8(x_over_s: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x_over_s, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK, ue8m0: bool = False) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """``w [..., rows, cols]`` float -> ``(q e4m3fn [..., rows, cols], s fp32 [..., ceil(rows/b), ceil(cols/b)])``;
    ``ue8m0``: power-of-two scales, returned as uint8 E8M0 bytes."""
    if not w.is_floating_point() or w.dim() < 2:
        raise TypeError(
            f"quantize_fp8_block: w must be a floating tensor with >= 2 dims, got {w.dtype} {list(w.shape)}"
        )
    rows, cols = w.shape[-2], w.shape[-1]
    rb, cb = _ceil_div(rows, block), _ceil_div(cols, block)
    padded = F.pad(w.float(), (0, cb * block - cols, 0, rb * block - rows))
    blocks = padded.reshape(*w.shape[:-2], rb, block, cb, block)
    s = _scale_of(blocks.abs().amax(dim=(-3, -1)))
    if ue8m0:
        s = _pow2_ceil(s)
    q = _to_fp8(blocks / s[..., :, None, :, None])
    q = q.reshape(padded.shape)[..., :rows, :cols].contiguous()
    return q, ue8m0_scales(s) if ue8m0 else s


def expand_block_scales(s: torch.Tensor, rows: int, cols: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """Scales ``[..., ceil(rows/b), ceil(cols/b)]`` (fp32, or uint8 UE8M0) -> one scale per element
    ``[..., rows, cols]`` (fp32)."""
    s = e8m0_to_float(s) if s.dtype == torch.uint8 else s.float()
    full = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8_block(q: torch.Tensor, s: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """``q [..., rows, cols]`` e4m3fn and ``s [..., ceil(rows/b), ceil(cols/b)]`` (fp32 or UE8M0 bytes) -> fp32
    ``q * s``."""
    rows, cols = q.shape[-2], q.shape[-1]
    expected = (*q.shape[:-2], _ceil_div(rows, block), _ceil_div(cols, block))
    if tuple(s.shape) != expected:
        raise ValueError(f"dequantize_fp8_block: s must have shape {list(expected)}, got {list(s.shape)}")
    return q.float() * expand_block_scales(s, rows, cols, block)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK,
                                 ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., cols]`` float -> ``(q e4m3fn [..., cols], s fp32 [..., ceil(cols/group)])``; ``ue8m0``: the scales
    rounded up to powers of two (still fp32)."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_fp8_per_token_group: x must be a floating tensor, got {x.dtype}")
    cols = x.shape[-1]
    ng = _ceil_div(cols, group)
    padded = F.pad(x.float(), (0, ng * group - cols))
    groups = padded.reshape(*x.shape[:-1], ng, group)
    s = _scale_of(groups.abs().amax(dim=-1))
    if ue8m0:
        s = _pow2_ceil(s)
    q = _to_fp8(groups / s[..., None]).reshape(padded.shape)[..., :cols]
    return q.contiguous(), s


def dequantize_fp8_per_token_group(q: torch.Tensor, s: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    """``q [..., cols]`` e4m3fn and ``s [..., ceil(cols/group)]`` -> fp32 ``q * s``."""
    cols = q.shape[-1]
    return q.float() * s.float().repeat_interleave(group, dim=-1)[..., :cols]


def fake_quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK, ue8m0: bool = False) -> torch.Tensor:
    """``x [..., cols]`` -> fp32 ``dequantize(quantize(x))``: the values an fp8 GEMM actually multiplies."""
    return dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(x, group, ue8m0), group)
