"""MXFP4 (OCP microscaling e2m1 + E8M0) packing, the weight format of ``quant="mxfp4"`` (gpt-oss).

Layout, for a logical float weight ``w [..., cols]`` with ``cols % 32 == 0`` (a stack ``[E, rows, cols]``):
- ``packed uint8 [..., cols / 2]``: two e2m1 codes per byte along ``cols``, low nibble = even element.
  An e2m1 code is sign (bit 3) and magnitude (bits 2..0) from ``E2M1_VALUES`` = {0, .5, 1, 1.5, 2, 3, 4, 6}.
- ``scales uint8 [..., cols / 32]``: E8M0, value ``2^(s - 127)`` for each 32 consecutive elements;
  ``s = 255`` is NaN.

``quantize_mxfp4(w)`` picks per group of 32 the smallest power of two ``2^k >= amax / 6`` (so no element
saturates, up to fp32 rounding of amax / 6), then rounds ``w / 2^k`` to the nearest e2m1 value (ties to the
even code), zero always as +0. Groups whose amax is not finite get scale 255 (NaN). Values that are already
``e2m1 * 2^k`` with ``amax = 6 * 2^k`` (or any group whose scaled values are representable) round-trip
exactly. ``unpack_mxfp4`` decodes codes to fp32 (no scale), ``dequantize_mxfp4`` applies the scales.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255

# Rounding boundaries between consecutive magnitude codes i and i + 1, and whether a value exactly on
# the boundary goes up (the upper code is even) or stays (the lower code is even).
_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [16]: the value of each 4-bit e2m1 code (codes 8..15 are the negatives of 0..7; 8 is -0.0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales -> fp32 ``2^(s - 127)`` (s = 0 is 2^-127, a subnormal; s = 255 is NaN). Exact."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float: scales must be uint8, got {scales.dtype}")
    s = scales.to(torch.int32)
    normal = (s << 23).view(torch.float32)
    smallest = torch.full_like(normal, 2.0**-127)
    nan = torch.full_like(normal, float("nan"))
    return torch.where(s == E8M0_NAN, nan, torch.where(s == 0, smallest, normal))


def _round_to_e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale -> uint8 e2m1 codes (saturating at +-6)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _BOUNDARIES:
        code += (mag >= bound if tie_up else mag > bound).to(torch.uint8)
    negative = (x < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``w [..., cols]`` (cols % 32 == 0) -> ``(packed uint8 [..., cols/2], scales uint8 [..., cols/32])``."""
    if not w.is_floating_point():
        raise TypeError(f"quantize_mxfp4: w must be a floating tensor, got {w.dtype}")
    cols = w.shape[-1]
    if cols % MXFP4_BLOCK != 0:
        raise ValueError(f"quantize_mxfp4: the last dim of w must be a multiple of {MXFP4_BLOCK}, got {cols}")
    groups = w.float().reshape(*w.shape[:-1], cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1)
    # ceil(log2(amax / 6)) from the fp32 exponent: amax / 6 = m * 2^e with m in [0.5, 1).
    mant, exp = torch.frexp(amax / E2M1_MAX)
    k = torch.where(mant == 0.5, exp - 1, exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    k = torch.where(amax > 0, k, torch.full_like(k, -E8M0_BIAS))
    scales = torch.where(torch.isfinite(amax), k + E8M0_BIAS, torch.full_like(k, E8M0_NAN)).to(torch.uint8)
    scaled = groups / e8m0_to_float(scales)[..., None]
    codes = _round_to_e2m1_code(scaled.nan_to_num(0.0)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scales.contiguous()


def unpack_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., c]`` -> fp32 e2m1 values ``[..., 2c]`` (low nibble first), without scales."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_mxfp4: packed must be uint8, got {packed.dtype}")
    table = e2m1_table(packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return table[codes.long()]


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed uint8 [..., cols/2]`` and ``scales uint8 [..., cols/32]`` -> fp32 ``[..., cols]``. Exact."""
    cols = 2 * packed.shape[-1]
    expected = (*packed.shape[:-1], cols // MXFP4_BLOCK)
    if cols % MXFP4_BLOCK != 0 or tuple(scales.shape) != expected:
        raise ValueError(
            f"dequantize_mxfp4: packed [..., {packed.shape[-1]}] needs a last dim that is a multiple of "
            f"{MXFP4_BLOCK // 2} and scales of shape {list(expected)}, got {list(scales.shape)}"
        )
    values = unpack_mxfp4(packed).reshape(*expected, MXFP4_BLOCK)
    return (values * e8m0_to_float(scales)[..., None]).reshape(*packed.shape[:-1], cols)
