"""MXFP4 weights prepared in tensor-core fragment order: the layout of ``quant="mxfp4_mma"``.

The same numbers as ``quant="mxfp4"`` (``moe_extension.quant.mxfp4``: e2m1 codes, E8M0 scales per 32 columns),
stored so that the kernels load each thread's part of a 16 x 16 tensor-core A operand (``mma.m16n8k16`` /
``wgmma`` with A in registers) with one 32-bit word and decode it into the four bf16x2 registers of that
fragment with a few rotates, masks and multiplies: no shared-memory round trip, no shuffles.

Shapes are those of the checkpoint layout: ``q uint8 [..., rows, cols / 2]`` and ``s uint8 [..., rows,
cols / 32]``, contiguous, with ``rows % 16 == 0`` and ``cols % 64 == 0``; only the order of the bits
inside each 16-row band differs. Per band of 16 rows and per 64 columns (a chunk: 512 bytes of codes,
32 bytes of scales):

- codes: 32 lanes x 4 k16 steps x one 32-bit word (lane ``4 g + t`` at byte ``16 lane + 4 step``). The word
  of (lane, step) holds the 8 codes of rows ``g`` and ``g + 8`` of the band and columns ``2t, 2t + 1,
  2t + 8, 2t + 9`` of the step; register ``(a, h)`` of the fragment (``h``: row g + 8, ``a``: column + 8)
  holds in its two bf16 lanes ``i`` the columns ``2t + i``. Each code is placed so that rotating the word
  left by ``MMA_ROTATIONS[(a, h)]`` and masking with ``0x81C081C0`` leaves its sign at bit 15 and its
  magnitude (exponent bits, mantissa bit) at bits 8..6 of lane ``i``: the bf16 ``e2m1 * 2^-126`` (codes 0
  and 0.5 land on bf16 subnormals), which one multiply by its group's factor (below) scales. Register (1, 1)
  takes two pieces: sign and two magnitude bits by a rotation of 14 (mask ``0x81808180``), the low magnitude bit by 6
  (mask ``0x00400040``).
- scales: per chunk, ``[8 (g), 2 (h), 2 (32-column group)]`` bytes: lane group ``g`` reads its four scales
  with one 4-byte load. A byte is the E8M0 scale ``s`` (``2^(s - 127)``) of the checkpoint, for ``s`` from 0 to
  ``MMA_MAX_SCALE`` (148: scales up to 2^21); ``prepare_mxfp4_mma`` refuses larger finite scales (use
  ``quant="mxfp4"`` for such weights). The kernels turn a byte into the bf16 factor ``2^(s - 21)`` (exponent
  field ``s + 106``), and one FMA multiplies the decoded code (``e2m1 * 2^-126``) by it, so each weight comes out
  as ``e2m1 * 2^(s - 127) * 2^-MMA_EXCESS``; the accumulator is multiplied by ``2^MMA_EXCESS`` once
  after the reduction (both exact, for scales from 2^-105 on; below that the products are bf16 subnormals).
- NaN groups (E8M0 255) store the byte ``MMA_NAN_SCALE`` (149, whose factor is +inf) and zero codes: 0 * inf is
  the NaN the group must give.

``unprepare_mxfp4_mma`` returns the checkpoint layout (codes of NaN groups 0, their scales 255);
``dequantize_mxfp4_mma`` the fp32 weights. Scale bytes 150..255 are not part of the layout.
"""

from __future__ import annotations

import math

import torch

from moe_extension.quant.mxfp4 import E8M0_NAN, dequantize_mxfp4

MMA_ROWS = 16  # rows per band
MMA_COLS = 64  # columns per chunk
MMA_MASK = 0x81C081C0
MMA_MAX_SCALE = 148  # the largest finite E8M0 byte the layout holds (2^21)
MMA_NAN_SCALE = 149  # the layout's byte of NaN groups (factor exponent field 255: +inf)
MMA_EXCESS = 20  # decoded weights are 2^-MMA_EXCESS times their value; the kernels scale the accumulator back
# Rotation (left) of the word that aligns fragment register (a, h)'s codes with MMA_MASK; (1, 1) is split.
MMA_ROTATIONS = {(0, 0): 0, (0, 1): 4, (1, 0): 10}
MMA_SPLIT = ((14, 0x81808180), (6, 0x00400040))
# Code bit -> bf16 bit of its lane: sign 3 -> 15, magnitude 2..0 -> 8..6.
_TARGET = {3: 15, 2: 8, 1: 7, 0: 6}


def _source_bit(a: int, h: int, lane: int, bit: int) -> int:
    """The bit of the word that holds code bit ``bit`` of register (a, h)'s bf16 lane ``lane``."""
    target = _TARGET[bit] + 16 * lane
    if (a, h) in MMA_ROTATIONS:
        rot = MMA_ROTATIONS[(a, h)]
    else:
        rot = MMA_SPLIT[1][0] if bit == 0 else MMA_SPLIT[0][0]
    return (target - rot) % 32


_PLANES = [(a, h, i) for a in (0, 1) for h in (0, 1) for i in (0, 1)]


def check_mxfp4_mma_shape(q: torch.Tensor, s: torch.Tensor, what: str = "prepare_mxfp4_mma") -> None:
    """ValueError / TypeError naming what does not fit the layout's rules."""
    if q.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise TypeError(f"{what}: codes and scales must be uint8, got {q.dtype} and {s.dtype}")
    if q.dim() < 2 or s.dim() != q.dim():
        raise ValueError(f"{what}: codes [..., rows, cols/2] and scales [..., rows, cols/32] expected, got shapes "
                         f"{list(q.shape)} and {list(s.shape)}")
    rows, cols = q.shape[-2], 2 * q.shape[-1]
    if rows % MMA_ROWS or cols % MMA_COLS:
        raise ValueError(f"{what}: the MMA layout needs rows % {MMA_ROWS} == 0 and cols % {MMA_COLS} == 0, got "
                         f"rows {rows}, cols {cols} (use quant='mxfp4' for this shape)")
    if tuple(s.shape) != (*q.shape[:-1], cols // 32):
        raise ValueError(f"{what}: scales must have shape [..., rows, cols/32] = {[*q.shape[:-1], cols // 32]}, "
                         f"got {list(s.shape)}")


def scales_beyond_mma_layout(scales: torch.Tensor) -> torch.Tensor:
    """Where E8M0 ``scales`` are finite and above what the layout holds (bytes ``MMA_MAX_SCALE`` + 1 .. 254)."""
    return (scales > MMA_MAX_SCALE) & (scales != E8M0_NAN)


def prepare_mxfp4_mma(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-layout MXFP4 (``packed [..., rows, cols/2]``, ``scales [..., rows, cols/32]``, any strides) ->
    ``(q, s)`` in the MMA layout, contiguous, same shapes and device. Once, at weight-load time: it builds
    the words per leading index (one expert's temporaries at a time)."""
    check_mxfp4_mma_shape(packed, scales)
    big = scales_beyond_mma_layout(scales)
    if bool(big.any()):
        raise ValueError(f"prepare_mxfp4_mma: scales must be at most 2^{MMA_MAX_SCALE - 127} (E8M0 byte <= "
                         f"{MMA_MAX_SCALE}) or NaN (255), got byte {int(scales[big].max())} (use quant='mxfp4' for "
                         f"these weights)")
    rows, cols = packed.shape[-2], 2 * packed.shape[-1]
    n = math.prod(packed.shape[:-2])  # explicit: empty weights (rows or cols 0) have no -1 to infer
    p2 = packed.reshape(n, rows, cols // 2)
    s2 = scales.reshape(n, rows, cols // 32)
    q_out = torch.empty((p2.shape[0], rows, cols // 2), dtype=torch.uint8, device=packed.device)
    bands, chunks = rows // MMA_ROWS, cols // MMA_COLS
    for e in range(p2.shape[0]):
        codes = torch.stack([p2[e] & 15, p2[e] >> 4], dim=-1).reshape(rows, cols).to(torch.int32)
        codes = codes.masked_fill((s2[e] == E8M0_NAN).repeat_interleave(32, dim=-1), 0)
        # row = 16 band + 8 h + g ; col = 64 chunk + 16 step + 8 a + 2 t + i
        planes = codes.reshape(bands, 2, 8, chunks, 4, 2, 4, 2)
        words = torch.zeros((bands, chunks, 8, 4, 4), dtype=torch.int32, device=packed.device)  # band c g t step
        for a, h, i in _PLANES:
            code = planes[:, h, :, :, :, a, :, i].permute(0, 2, 1, 4, 3)  # band, chunk, g, t, step
            for bit in range(4):
                words |= ((code >> bit) & 1) << _source_bit(a, h, i, bit)
        q_out[e] = words.view(torch.uint8).reshape(rows, cols // 2)
    s2 = torch.where(s2 == E8M0_NAN, MMA_NAN_SCALE, s2)
    s_out = s2.reshape(n, bands, 2, 8, chunks, 2).permute(0, 1, 4, 3, 2, 5).reshape(n, rows, cols // 32)
    return q_out.reshape(packed.shape), s_out.contiguous().reshape(scales.shape)


def unprepare_mxfp4_mma(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``prepare_mxfp4_mma``: checkpoint-layout ``(packed, scales)`` (codes of NaN groups 0, their
    scales 255)."""
    check_mxfp4_mma_shape(q, s, "unprepare_mxfp4_mma")
    lead = q.shape[:-2]
    rows, cols = q.shape[-2], 2 * q.shape[-1]
    bands, chunks = rows // MMA_ROWS, cols // MMA_COLS
    n = math.prod(lead)
    words = q.contiguous().reshape(n, bands, chunks, 8, 4, 4, 4).view(torch.int32).squeeze(-1)
    codes = torch.zeros((n, bands, 2, 8, chunks, 4, 2, 4, 2), dtype=torch.int32, device=q.device)
    for a, h, i in _PLANES:
        code = torch.zeros((n, bands, chunks, 8, 4, 4), dtype=torch.int32, device=q.device)
        for bit in range(4):
            code |= ((words >> _source_bit(a, h, i, bit)) & 1) << bit
        codes[:, :, h, :, :, :, a, :, i] = code.permute(0, 1, 3, 2, 5, 4)  # band, g, chunk, step, t
    codes = codes.reshape(n, rows, cols // 2, 2).to(torch.uint8)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    s = torch.where(s == MMA_NAN_SCALE, E8M0_NAN, s)
    scales = s.contiguous().reshape(n, bands, chunks, 8, 2, 2).permute(0, 1, 4, 3, 2, 5).reshape(n, rows, cols // 32)
    return packed.reshape(*lead, rows, cols // 2), scales.contiguous().reshape(*lead, rows, cols // 32)


def dequantize_mxfp4_mma(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., rows, cols]`` weights of MMA-layout MXFP4 (exact, as ``dequantize_mxfp4``)."""
    return dequantize_mxfp4(*unprepare_mxfp4_mma(q, s))
