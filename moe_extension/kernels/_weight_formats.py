"""Weight formats of the routed-expert kernels: how a weight tile is addressed, loaded, decoded and multiplied.

The grouped GEMMs and the GEMVs of ``_grouped_gemm`` share their tile loops, epilogues, routing and
schedules; what differs between weight formats is only this plug, selected by the ``WFMT`` constexpr:

- ``WFMT_DENSE`` (0): weights in the activations' dtype, logical ``[E, rows, cols]``, any strides; a tile is
  one (masked) pointer load, multiplied as loaded.
- ``WFMT_MXFP4`` (1): ``quant="mxfp4"``. Packed e2m1 codes ``uint8 [E, rows, cols / 2]`` (two per byte along
  cols, low nibble first) with E8M0 scales ``uint8 [E, rows, cols / 32]`` (``2^(s - 127)``, 255 = NaN), any
  strides. A step of BLOCK_K columns loads BLOCK_K / 2 bytes and BLOCK_K / 32 scales per row and decodes the
  low nibbles (the even columns) and the high nibbles (the odd columns) into two bf16 tiles
  (``e2m1 * 2^(s - 127)`` is exact in bf16); the activations' even and odd columns, rounded to bf16 (the
  contract of ``quant="mxfp4"``), multiply them in two dots into the fp32 accumulator. Splitting by column
  parity keeps each decoded register pair (two bytes' low nibbles) in the dot's operand order: no
  interleaving shuffle.

- ``WFMT_FP8_BLOCK`` (2): ``quant="fp8_block"``. e4m3fn weights ``[E, rows, cols]`` with fp32 scales
  ``[E, ceil(rows / 128), ceil(cols / 128)]``, any strides; the activations are quantized per row per 128
  columns (``quantize_fp8_groups``: the rule of ``moe_extension.quant.fp8_block``) where the step loads them,
  unless the caller hands over rows quantized already (``A_Q``: gemm2 reads the fp8 rows and scales that
  gemm1's epilogue wrote). A tensor-core step is one 128-column scale block (BLOCK_K = 128):
  ``acc += (a_q @ W_q^T) * a_s * w_s``, the fp8 dot on sm_89+, in fp16 below (e4m3 values and their products
  are exact in fp16 / fp32), in fp32 in the interpreter. The direct schedule's GEMVs are tensor-core steps too
  (``dot_step_t``, ``_gemv_dot``). UE8M0: with uint8 scale bytes (``fp8_weight_scales``: ``2^(b - 127)``) every
  quantization of the activations rounds its scales up to powers of two; the kernels read that off the scale
  pointer's dtype (kernels without one take it as the ``UE8M0`` constexpr; host code asks ``WeightOperand.ue8m0``).

- ``WFMT_MXFP4_MMA`` (3): ``quant="mxfp4_mma"``, the same numbers in tensor-core fragment order
  (``moe_extension.quant.mxfp4_mma``: bands of 16 rows, chunks of 64 columns, contiguous stacks). A tile is
  whole bands: one 32-bit word per thread and k16 step decodes into the four bf16x2 registers of its
  ``wgmma`` A operand (``_mma_words``: rotates, masks and one multiply by the scale factors of ``_mma_scales``,
  which leaves the weights times 2^-MMA_EXCESS; ``acc_finish`` scales the accumulator back), and the dot runs
  transposed, ``acc^T += W a^T``: the decoded weights are the register
  operand, the activations the shared-memory one, so nothing decoded goes through shared memory and the
  tokens of a block are the MMA's N (16 rows suffice). Tensor-core steps only (the sorted schedule, and the
  direct schedule's GEMVs of ``_gemv_dot``, whose one activation row is row 0 of a 16-row tile).

Each format provides the device functions every kernel calls at the same places: ``tile_ptrs`` (the first k
step's pointers of a tile of weight rows, from the rows' indices; ``weight_ptrs`` from their offsets, and ``scale_rows``
the scale offsets of the rows, for the other formats),
``weight_advance`` (the next step's), ``dot_step`` (tensor-core step: ``acc [BM, R] += a [BM, BLOCK_K] @ W^T``;
``dot_tile`` is its second half, for a tile that TMA loaded), ``acc_finish`` (the accumulator after the last
tensor-core step), and for the direct schedule's GEMVs either ``dot_step_t`` (the transposed tensor-core step of
``_gemv_dot``: MXFP4 in the MMA layout, fp8 block, 16-bit dense) or ``fma_step`` (dense, MXFP4: elementwise products
into a ``[..., R, BLOCK_K]`` fp32 tile, ``[..., R, BLOCK_K / 2]`` for MXFP4, reduced over its last dim by the kernel
at the end). A new format adds a branch to each, its scale arguments and its tests.

``PTX`` (constexpr): True on the GPU: decode MXFP4 codes with inline PTX (``_E2M1X4_ASM``; sm_80+, bf16x2
FMAs) and apply the scales by a bf16 multiply; round to fp8 with the hardware conversion. False, for Triton's
interpreter (which runs no inline PTX, whose bf16 dot is wrong and whose fp32 -> fp8 conversion misrounds
values near a power of two): plain Triton integer ops, products in fp32. The decoded / quantized values and
their products are the same in both, subnormal scales (byte 0: 2^-127) included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq

from moe_extension.quant.mxfp4_mma import MMA_EXCESS, MMA_MASK, MMA_ROTATIONS, MMA_SPLIT

WFMT_DENSE = 0
WFMT_MXFP4 = 1
WFMT_FP8_BLOCK = 2
WFMT_MXFP4_MMA = 3
WEIGHT_FORMATS = {"none": WFMT_DENSE, "mxfp4": WFMT_MXFP4, "fp8_block": WFMT_FP8_BLOCK, "mxfp4_mma": WFMT_MXFP4_MMA}


@triton.jit
def _e8m0_bits(s):
    """uint8 E8M0 scales -> the bf16 bit patterns of 2^(s - 127) as uint16 (s = 0: the subnormal 2^-127,
    s = 255: NaN)."""
    s16 = s.to(tl.uint16)
    return tl.where(s16 == 255, 0x7FC0, tl.where(s16 == 0, 0x0040, s16 << 7)).to(tl.uint16)


# The low (even column) and the high (odd column) code of each of 4 bytes ($2) -> 4 bf16 values (e2m1 * 2^-126 by
# their bits, times 2^126 in one bf16x2 FMA). PRMT spreads bytes (0, 1) and (2, 3) to the two 16-bit lanes of a
# register; the magnitude bits (2 exponent bits, 1 mantissa bit) go to bits 6..8 of a lane (codes 0 and 1 become
# subnormals, which fma.rn.bf16x2 keeps), the sign to bit 15: shift LO for the magnitude, LO + 6 for the sign.
_E2M1X4_ASM = """
{
.reg .b32 t0, t1, m, g, bias, nz;
mov.b32 bias, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shl.b32 m, t0, SHIFT_MAG;
shl.b32 g, t0, SHIFT_SIGN;
and.b32 g, g, 0x80008000;
lop3.b32 m, m, 0x01C001C0, g, 0xEA;
fma.rn.bf16x2 $0, m, bias, nz;
shl.b32 m, t1, SHIFT_MAG;
shl.b32 g, t1, SHIFT_SIGN;
and.b32 g, g, 0x80008000;
lop3.b32 m, m, 0x01C001C0, g, 0xEA;
fma.rn.bf16x2 $1, m, bias, nz;
}
"""


_E2M1X4_LO_ASM = tl.constexpr(_E2M1X4_ASM.replace("SHIFT_MAG", "6").replace("SHIFT_SIGN", "12"))
_E2M1X4_HI_ASM = tl.constexpr(_E2M1X4_ASM.replace("SHIFT_MAG", "2").replace("SHIFT_SIGN", "8"))


@triton.jit
def _e2m1x4_lo_to_bf16(q):
    """The low code of each byte of ``q`` (uint8) as bf16 (see ``_E2M1X4_ASM``)."""
    return tl.inline_asm_elementwise(_E2M1X4_LO_ASM, "=r,=r,r", [q], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _e2m1x4_hi_to_bf16(q):
    """The high code of each byte of ``q`` (uint8) as bf16 (see ``_E2M1X4_ASM``)."""
    return tl.inline_asm_elementwise(_E2M1X4_HI_ASM, "=r,=r,r", [q], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _e2m1_to_f32(c):
    """uint16 e2m1 codes (0..15) -> fp32 values: the code's bits placed into an fp16 (sign at 15, magnitude at
    9..11) are e2m1 * 2^-14, exactly, subnormals included."""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _mxfp4_decode_2d(q, s, PTX: tl.constexpr):
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    G: tl.constexpr = C // 16
    if PTX:
        # Two single-output decodes (each PTX block one input, one output) and the scale applied by a bf16
        # multiply outside them: Triton then decodes straight into the dot operand's register layout.
        sb = _e8m0_bits(s).to(tl.bfloat16, bitcast=True)
        sb = tl.broadcast_to(tl.reshape(sb, (R, G, 1)), (R, G, 16)).reshape(R, C)
        lo = _e2m1x4_lo_to_bf16(q) * sb
        hi = _e2m1x4_hi_to_bf16(q) * sb
    else:
        q16 = q.to(tl.uint16)
        sf = (_e8m0_bits(s).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        sf = tl.broadcast_to(tl.reshape(sf, (R, G, 1)), (R, G, 16)).reshape(R, C)
        lo = _e2m1_to_f32(q16 & 15) * sf
        hi = _e2m1_to_f32(q16 >> 4) * sf
    return lo, hi


@triton.jit
def mxfp4_decode(q, s, PTX: tl.constexpr):
    """``q`` uint8 [..., C] (two e2m1 codes per byte, low nibble = even column; 2-D or 3-D) and ``s`` uint8
    [..., C / 16] (one E8M0 scale per 32 columns = 16 bytes) -> (even columns, odd columns), each [..., C]:
    bf16 with PTX, else fp32 (the same numbers)."""
    if len(q.shape) == 3:
        S: tl.constexpr = q.shape[0]
        R: tl.constexpr = q.shape[1]
        C: tl.constexpr = q.shape[2]
        lo, hi = _mxfp4_decode_2d(q.reshape(S * R, C), s.reshape(S * R, C // 16), PTX)
        lo, hi = lo.reshape(S, R, C), hi.reshape(S, R, C)
    else:
        lo, hi = _mxfp4_decode_2d(q, s, PTX)
    return lo, hi


def _aligned(dst: str, rot: int, mask: int) -> str:
    """PTX: ``dst`` = the MMA-layout word $4 rotated left by ``rot``, masked with ``mask``. Where no bit of the
    mask comes from the wrapped-around bits (those below ``rot``), the rotation is a left shift, written as a
    multiply by 2^rot: ptxas issues it as IMAD on the FMA pipe instead of SHF on the integer ALU pipe.
    NOTE: the decode's LOP3 / SHF instructions load the ALU pipe (ncu on the H200, gemv1 at gpt-oss-120b M = 1:
    ALU 46% of its peak, FMA 10%; math pipe throttle 0.54 of its 4.78 cycles per issued instruction, beside long
    scoreboard 0.70, not selected 0.70, wait 0.59); the two rotations written as multiplies took gpt-oss-120b M = 1
    from 30.2 to 28.7 us and gpt-oss-20b M = 256 from 259.4 to 249.8 us (M = 4096: 1798 against 1780, within the
    spread), outputs bitwise equal (benchmarks/results/ab_decode_pipes_h200.txt). The rotations by 10 and 14 keep
    mask bits from the wrapped bits; the one by 10 as a high and a low multiply (IMAD.HI + IMAD) was slower
    (gpt-oss-120b M = 1 29.8 us, gpt-oss-20b M = 256 266.7)."""
    if rot == 0:
        return f"and.b32 {dst}, $4, {mask:#x};"
    if mask & ((1 << rot) - 1) == 0:
        return f"mul.lo.u32 {dst}, $4, {1 << rot:#x};\nand.b32 {dst}, {dst}, {mask:#x};"
    return f"shf.l.wrap.b32 {dst}, $4, $4, {rot};\nand.b32 {dst}, {dst}, {mask:#x};"


def _mma_word_asm() -> str:
    """PTX of ``_mma_words``: the word $4 -> fragment registers $0..$3 (see ``_MMA_WORD_ASM``)."""
    (hi_rot, hi_mask), (lo_rot, lo_mask) = MMA_SPLIT
    lines = [".reg .b32 t, u, nz;", "mov.b32 nz, 0x80008000;"]
    for reg, (key, factor) in enumerate((((0, 0), "$5"), ((0, 1), "$6"), ((1, 0), "$5"))):
        lines += [_aligned("t", MMA_ROTATIONS[key], MMA_MASK), f"fma.rn.bf16x2 ${reg}, t, {factor}, nz;"]
    # register (1, 1): the piece of the low magnitude bit, masked; the other piece rotated, masked and merged
    # with it in one LOP3 ((u & mask) | t)
    lines += [_aligned("t", lo_rot, lo_mask), f"shf.l.wrap.b32 u, $4, $4, {hi_rot};",
              f"lop3.b32 t, u, {hi_mask:#x}, t, 0xEA;", "fma.rn.bf16x2 $3, t, $6, nz;"]
    return "{\n" + "\n".join(lines) + "\n}\n"


# The MMA layout's word and its two scale factors -> the 4 bf16x2 fragment registers (a, h) = (0, 0), (0, 1),
# (1, 0), (1, 1): rotate, mask (moe_extension.quant.mxfp4_mma: MMA_ROTATIONS, MMA_SPLIT, MMA_MASK; ``_aligned``),
# times the factor of row h (an FMA with -0: exact, and sm_80's bf16x2 arithmetic). Elements: byte b of the word's
# 4 -> register (a, b // 2), lane b % 2; the factors come as 4 bf16 per word, the factor of byte b's row (so $5
# holds row g's factor twice, $6 row g + 8's).
_MMA_WORD_ASM = tl.constexpr(_mma_word_asm())

# Scale bytes s of the MMA layout -> bf16 factors 2^(s - 21): exponent field s + 106 (126 - MMA_EXCESS), mantissa 0,
# one multiply-add per two bytes; the NaN byte MMA_NAN_SCALE gives +inf, which times the zero codes of a NaN group
# is NaN.
_MMA_FIELD = 126 - MMA_EXCESS  # added to a scale byte: the factor's bf16 exponent field
_MMA_SCALE_ASM = tl.constexpr(f"""
{{
.reg .b32 t;
prmt.b32 t, $2, 0, 0x4140;
mad.lo.u32 $0, t, 128, {(_MMA_FIELD << 7) * 0x10001:#x};
prmt.b32 t, $2, 0, 0x4342;
mad.lo.u32 $1, t, 128, {(_MMA_FIELD << 7) * 0x10001:#x};
}}
""")
_MMA_FIELD_C = tl.constexpr(_MMA_FIELD)
_MMA_ACC_FACTOR = tl.constexpr(float(2**MMA_EXCESS))


@triton.jit
def _rotl(w, r: tl.constexpr):
    if r == 0:
        out = w
    else:
        out = (w << r) | (w >> (32 - r))
    return out


@triton.jit
def _mma_lanes(reg):
    """A uint32 register of two bf16 lanes -> (lane 0, lane 1) as fp32 values times 2^126."""
    lo = ((reg & tl.full([], 0xFFFF, tl.uint32)) << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37
    hi = (reg & tl.full([], 0xFFFF0000, tl.uint32)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    return lo, hi


@triton.jit
def _mma_words(q, f, PTX: tl.constexpr):
    """uint8 [..., 4 W] bytes of MMA-layout words and the factor of each byte's row (``_mma_scales``, broadcast)
    -> (a = 0, a = 1) tiles of the same shape: element b of a word is lane b % 2 of fragment register (a, b // 2)
    times its factor: bf16 with PTX, else the same values in fp32."""
    if PTX:
        w0, w1 = tl.inline_asm_elementwise(_MMA_WORD_ASM, "=r,=r,=r,=r,r,r,r", [q, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        R: tl.constexpr = q.shape[0]
        C: tl.constexpr = q.shape[1]
        b = tl.reshape(q, (R, C // 4, 4)).to(tl.uint32) << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, :]
        w = tl.sum(b, axis=2).to(tl.uint32)
        mask = tl.full([], 0x81C081C0, tl.uint32)
        regs00 = w & mask
        regs01 = _rotl(w, 4) & mask
        regs10 = _rotl(w, 10) & mask
        regs11 = ((_rotl(w, 14) & tl.full([], 0x81808180, tl.uint32))
                  | (_rotl(w, 6) & tl.full([], 0x00400040, tl.uint32)))
        l00, h00 = _mma_lanes(regs00)
        l01, h01 = _mma_lanes(regs01)
        l10, h10 = _mma_lanes(regs10)
        l11, h11 = _mma_lanes(regs11)
        # byte b = 2 h + i
        w0 = tl.reshape(tl.join(tl.join(l00, h00), tl.join(l01, h01)).permute(0, 1, 3, 2), (R, C)) * f
        w1 = tl.reshape(tl.join(tl.join(l10, h10), tl.join(l11, h11)).permute(0, 1, 3, 2), (R, C)) * f
    return w0, w1


@triton.jit
def _mma_scales(s, PTX: tl.constexpr):
    """uint8 MMA-layout scale bytes s -> with PTX the bf16 factors 2^(s - 21) by which a decoded code (its value
    times 2^-126) becomes its weight times 2^-MMA_EXCESS; else the fp32 factors 2^(s - 147) of the exact code values
    (the same products). MMA_NAN_SCALE gives +inf."""
    if PTX:
        out = tl.inline_asm_elementwise(_MMA_SCALE_ASM, "=r,=r,r", [s], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        out = ((s.to(tl.uint32) + _MMA_FIELD_C) << 23).to(tl.float32, bitcast=True) * 1.1754943508222875e-38
    return out


@triton.jit
def _load_mxfp4_mma(ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    """The decoded tile [16 B, BLOCK_K] (natural row and column order) of one MMA-layout step whose codes /
    scales ``tile_ptrs`` gives as [B, BLOCK_K * 8] / [B, BLOCK_K / 2]: the weights times 2^-MMA_EXCESS
    (``acc_finish`` multiplies the accumulator back); chunks of 64 columns from ``k_left`` on read as 0."""
    B: tl.constexpr = ptrs.shape[0]
    C: tl.constexpr = BLOCK_K // 64
    if EVEN_K:
        q = tl.load(ptrs)
        s = tl.load(s_ptrs)
    else:
        nch = tl.cdiv(k_left, 64)
        q = tl.load(ptrs, mask=(tl.arange(0, C * 512) // 512 < nch)[None, :], other=0)
        # NOTE: masked scale bytes read as 0 (the copy's zero fill; the codes there are 0, and 0 times any finite
        # factor is 0): with another value each byte was selected and repacked, 43 more instructions per step of
        # gemv1 (430 against 387, ``compile_report.py --dump``), gpt-oss-120b M = 1 36.4 against 35.0 us on the H100
        # (benchmarks/results/ab_mxfp4_mma_h100.txt: ``ab_fused_experts.py --quant mxfp4_mma --model gpt-oss-120b
        # --tokens 1``, before and after).
        s = tl.load(s_ptrs, mask=(tl.arange(0, C * 32) // 32 < nch)[None, :], other=0)
    # scales [B, (chunk, g, h, group)] -> per code byte [B, (chunk, g, t, step = (group, k8), h, i)]
    f = tl.permute(tl.reshape(_mma_scales(s, PTX), (B, C, 8, 2, 2)), (0, 1, 2, 4, 3))
    f = tl.broadcast_to(tl.reshape(f, (B, C, 8, 1, 2, 1, 2, 1)), (B, C, 8, 4, 2, 2, 2, 2))
    w0, w1 = _mma_words(q, tl.reshape(f, (B, C * 512)), PTX)
    # [B, (chunk, g, t, step, h, i)] x a -> rows (band, h, g), columns (chunk, step, a, t, i)
    return tl.join(w0, w1).reshape(B, C, 8, 4, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 7, 3, 6).reshape(16 * B, BLOCK_K)


@triton.jit
def _bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), held in fp32; NaN stays NaN. Integer ops: the
    interpreter's fp32 -> bf16 cast truncates."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _as_bf16(a, PTX: tl.constexpr):
    """Activations rounded to bf16 (MXFP4's GEMM input): bf16 with PTX, else the same values in fp32."""
    if PTX:
        out = a.to(tl.bfloat16)
    else:
        out = _bf16_rne(a.to(tl.float32))
    return out


@triton.jit
def _even_odd(a):
    """The even and the odd columns of ``a [..., C]``, each [..., C / 2]."""
    if len(a.shape) == 2:
        ev, od = tl.split(tl.reshape(a, (a.shape[0], a.shape[1] // 2, 2)))
    else:
        ev, od = tl.split(tl.reshape(a, (a.shape[0] // 2, 2)))
    return ev, od


@triton.jit
def _e4m3_rne(v):
    """fp32 ``v`` in [-448, 448] -> the nearest e4m3fn value (ties to even), held in fp32: adding and
    subtracting 1.5 * 2^23 ulp rounds to a multiple of the ulp, which is 2^(exponent - 3) for normal values
    and 2^-9 for e4m3's subnormals (below 2^-6)."""
    e = tl.maximum((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF, 121)
    big = ((e - 3) << 23).to(tl.float32, bitcast=True) * 12582912.0
    return tl.where(v >= 0, (v + big) - big, -((big - v) - big))


@triton.jit
def _ue8m0_ceil(s, UE8M0: tl.constexpr):
    """Positive normal fp32 scales, with UE8M0 rounded up to powers of two (exponent field + 1 where any mantissa
    bit is set), else unchanged."""
    if UE8M0:
        bits = s.to(tl.int32, bitcast=True)
        exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exp << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def fp8_weight_scales(s):
    """fp8 block weight scales as loaded -> fp32: fp32 unchanged; uint8 UE8M0 bytes ``2^(b - 127)`` (0: 2^-127;
    255: NaN), as ``quant.e8m0_to_float``."""
    if s.dtype == tl.uint8:
        b = s.to(tl.int32)
        v = (b << 23).to(tl.float32, bitcast=True)
        v = tl.where(b == 0, 5.877471754111438e-39, v)
        s = tl.where(b == 255, float("nan"), v)
    return s


@triton.jit
def quantize_fp8_groups(x, PTX: tl.constexpr, UE8M0: tl.constexpr = False):
    """``x [C]`` or ``[R, C]`` (C a multiple of 128, any float dtype) -> ``(q, s)``: per row and 128-column
    group ``s = max(amax|x|, 1e-10) / 448`` (fp32, ``[G]`` or ``[R, G]``, G = C / 128; with UE8M0 rounded up to a
    power of two) and ``q = e4m3fn(clamp(x / s, -448, 448))`` (``[C]`` / ``[R, C]``; float8e4nv with PTX, else its
    values in fp32), divisions correctly rounded: the rule of ``moe_extension.quant.fp8_block``."""
    xf = x.to(tl.float32)
    if len(x.shape) == 2:
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
        xg = tl.reshape(xf, (R, C // 128, 128))
        s = _ue8m0_ceil(tl.math.div_rn(tl.maximum(tl.max(tl.abs(xg), axis=2), 1e-10), 448.0), UE8M0)
        v = tl.reshape(tl.clamp(tl.math.div_rn(xg, s[:, :, None]), -448.0, 448.0), (R, C))
    else:
        C1: tl.constexpr = x.shape[0]
        xg = tl.reshape(xf, (C1 // 128, 128))
        s = _ue8m0_ceil(tl.math.div_rn(tl.maximum(tl.max(tl.abs(xg), axis=1), 1e-10), 448.0), UE8M0)
        v = tl.reshape(tl.clamp(tl.math.div_rn(xg, s[:, None]), -448.0, 448.0), (C1,))
    if PTX:
        q = v.to(tl.float8e4nv)
    else:
        q = _e4m3_rne(v)
    return q, s


@triton.jit
def _fp8_dot(aq, w, PTX: tl.constexpr):
    """``aq [BM, K] @ w [K, R]`` of e4m3 values into a fresh fp32 tile: the fp8 tensor-core dot on sm_89+,
    fp16 below (e4m3 values are exact in fp16, their products in fp32), fp32 in the interpreter. The fp8 dot's
    instructions sum their products at less than fp32 precision on sm_90 (docs/formats.md: what that does to the
    agreement with the PyTorch implementation)."""
    if PTX:
        if cuda_capability_geq(8, 9):
            out = tl.dot(aq, w)
        else:
            out = tl.dot(aq.to(tl.float16), w.to(tl.float16))
    else:
        out = tl.dot(aq.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def scale_rows(e64, rows64, stride_se, stride_sn, WFMT: tl.constexpr):
    """Offsets (elements) of the scale rows of expert ``e64``'s weight rows ``rows64``: the rows themselves
    for MXFP4 (a scale row per weight row), their 128-row block for fp8 block (0 for dense: strides 0)."""
    if WFMT == 2:
        out = e64 * stride_se + (rows64 // 128) * stride_sn
    else:
        out = e64 * stride_se + rows64 * stride_sn
    return out


@triton.jit
def tile_ptrs(w_ptr, s_ptr, e64, rows, k0, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
              BLOCK_K: tl.constexpr, WFMT: tl.constexpr, TRANS: tl.constexpr):
    """``weight_ptrs`` of the weight rows ``rows`` (int32 [R]) of expert ``e64`` (int64). MXFP4 in the MMA layout
    (whole bands of 16 rows, each starting at a multiple of 16; ``k0`` a multiple of 64): per band the codes
    [B, BLOCK_K * 8] and the scales [B, BLOCK_K / 2] of the step, which the layout stores contiguously (``stride_wk``
    / ``stride_sk`` unused), from each band's first row (the int32 minimum of its 16).
    NOTE: from the rows' 64-bit offsets (their minimum per band, 16 64-bit products and compares per thread), gemv1
    ran 751 SASS instructions before its k loop at gpt-oss-120b M = 1, from the int32 rows 409 (``python
    benchmarks/compile_report.py --model gpt-oss-120b --quant mxfp4_mma --tokens 1 --dump DIR``); timed, no change
    beyond the spread (benchmarks/results/ab_tile_rows_h200.txt)."""
    if WFMT == 3:
        B: tl.constexpr = rows.shape[0] // 16
        first = tl.min(tl.reshape(rows, (B, 16)), axis=1).to(tl.int64)
        # A band's codes start at a multiple of 512 bytes and its scales at a multiple of 32 (16 rows of a
        # multiple of 32 / of 2 bytes): written as such, so that the loads are known to be 16-byte aligned.
        band = ((e64 * stride_we + first * stride_wn) // 512) * 512
        s_band = ((e64 * stride_se + first * stride_sn) // 32) * 32
        ptrs = w_ptr + band[:, None] + (k0 // 64) * 512 + tl.arange(0, BLOCK_K * 8)[None, :]
        s_ptrs = s_ptr + s_band[:, None] + (k0 // 64) * 32 + tl.arange(0, BLOCK_K // 2)[None, :]
    else:
        r64 = rows.to(tl.int64)
        ptrs, s_ptrs = weight_ptrs(w_ptr, s_ptr, e64 * stride_we + r64 * stride_wn,
                                   scale_rows(e64, r64, stride_se, stride_sn, WFMT), k0, stride_wk, stride_sk, BLOCK_K,
                                   WFMT, TRANS)
    return ptrs, s_ptrs


@triton.jit
def weight_ptrs(w_ptr, s_ptr, w_rows, s_rows, k0, stride_wk, stride_sk, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
                TRANS: tl.constexpr):
    """Pointers of the first k step (columns k0 .. k0 + BLOCK_K) of a tile of weight rows whose offsets (in
    elements, expert included) are ``w_rows`` (int64 [R] or [S, R]) and, for the scales, ``s_rows``; not for MXFP4 in
    the MMA layout (``tile_ptrs``).

    Dense: one tile of pointers, [BLOCK_K, R] with TRANS (the dot's B operand; 1-D rows) else [..., R,
    BLOCK_K], and ``s_ptr`` (unused). MXFP4: the bytes [..., R, BLOCK_K / 2] and the scales
    [..., R, BLOCK_K / 32]. fp8 block: the dense tile of pointers and the scales [R] with TRANS (one 128-column
    block per step), else [..., R, BLOCK_K / 128] (``k0`` a multiple of 128)."""
    tl.static_assert(WFMT != 3, "MXFP4 in the MMA layout: tile_ptrs")
    if WFMT == 1:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        if len(w_rows.shape) == 2:
            ptrs = w_ptr + w_rows[:, :, None] + kb[None, None, :] * stride_wk
            s_ptrs = s_ptr + s_rows[:, :, None] + ks[None, None, :] * stride_sk
        else:
            ptrs = w_ptr + w_rows[:, None] + kb[None, :] * stride_wk
            s_ptrs = s_ptr + s_rows[:, None] + ks[None, :] * stride_sk
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if TRANS:
            ptrs = w_ptr + w_rows[None, :] + offs_k[:, None] * stride_wk
        elif len(w_rows.shape) == 2:
            ptrs = w_ptr + w_rows[:, :, None] + offs_k[None, None, :] * stride_wk
        else:
            ptrs = w_ptr + w_rows[:, None] + offs_k[None, :] * stride_wk
        if WFMT == 2:
            kg = k0 // 128 + tl.arange(0, BLOCK_K // 128)
            if TRANS:
                s_ptrs = s_ptr + s_rows + (k0 // 128) * stride_sk
            elif len(w_rows.shape) == 2:
                s_ptrs = s_ptr + s_rows[:, :, None] + kg[None, None, :] * stride_sk
            else:
                s_ptrs = s_ptr + s_rows[:, None] + kg[None, :] * stride_sk
        else:
            s_ptrs = s_ptr  # unused: a scalar, so that the tile loops carry nothing extra
    return ptrs, s_ptrs


@triton.jit
def weight_advance(ptrs, s_ptrs, stride_wk, stride_sk, BLOCK_K: tl.constexpr, WFMT: tl.constexpr):
    """The pointers of the next k step."""
    if WFMT == 3:
        ptrs, s_ptrs = ptrs + BLOCK_K * 8, s_ptrs + BLOCK_K // 2
    elif WFMT == 1:
        ptrs, s_ptrs = ptrs + (BLOCK_K // 2) * stride_wk, s_ptrs + (BLOCK_K // 32) * stride_sk
    elif WFMT == 2:
        ptrs, s_ptrs = ptrs + BLOCK_K * stride_wk, s_ptrs + (BLOCK_K // 128) * stride_sk
    else:
        ptrs = ptrs + BLOCK_K * stride_wk
    return ptrs, s_ptrs


@triton.jit
def _load_mxfp4(ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    """The decoded (even, odd) column tiles of one MXFP4 step; columns past ``k_left`` read as 0."""
    if EVEN_K:
        q = tl.load(ptrs)
        s = tl.load(s_ptrs)
    else:
        q = tl.load(ptrs, mask=tl.arange(0, BLOCK_K // 2) < k_left // 2, other=0)
        s = tl.load(s_ptrs, mask=tl.arange(0, BLOCK_K // 32) < k_left // 32, other=0)
    return mxfp4_decode(q, s, PTX)


@triton.jit
def fp8_operand(a, a_scale, s_ptrs, PTX: tl.constexpr, A_Q: tl.constexpr):
    """fp8 block: ``(e4m3 values [BM, 128], scales [BM])`` of the activation tile ``a`` of a step: as given with
    A_Q (quantized already), else quantized here (power-of-two scales with UE8M0 weight scales)."""
    if A_Q:
        aq, a_s = a, a_scale
    else:
        aq, a_sg = quantize_fp8_groups(a, PTX, s_ptrs.dtype.element_ty == tl.uint8)
        a_s = tl.reshape(a_sg, (a.shape[0],))
    return aq, a_s


@triton.jit
def fp8_part_scales(s_ptr, e64, row0, stride_se, stride_sn):
    """fp8 block: the one scale pointer (first k step) of a part of 128 weight rows of expert ``e64`` from
    ``row0``, a multiple of 128: its rows share one scale block, so each step scales the part's product by one
    weight scale (``dot_tile``) instead of one per row.
    NOTE: a weight scale per row costs the accumulator's column layout a register per column a thread holds;
    with one per part, 128-row tiles fit (Triton 3.6, sm_90: see ``FP8_MAX_BLOCK_M`` in _configs.py)."""
    return s_ptr + e64 * stride_se + (row0 // 128).to(tl.int64) * stride_sn


@triton.jit
def dot_tile(acc, a, a_scale, w, s_ptrs, WFMT: tl.constexpr, PTX: tl.constexpr, DOT_PREC: tl.constexpr,
             A_Q: tl.constexpr):
    """``acc [BM, R] += a [BM, BLOCK_K] @ w [BLOCK_K, R]`` for a loaded tile ``w`` of a format whose tiles are
    plain element tiles (dense; fp8 block, whose tiles TMA loads too), ``s_ptrs`` as ``weight_ptrs`` gives them.

    fp8 block (BLOCK_K = 128): ``a`` is quantized here, or with A_Q it is quantized already (e4m3 values) and
    ``a_scale [BM]`` holds its scales; the block's product is scaled by both scales into acc. ``s_ptrs`` is
    one pointer when the tile's R rows share a scale block (``fp8_part_scales``), else one per row."""
    if WFMT == 2:
        aq, a_s = fp8_operand(a, a_scale, s_ptrs, PTX, A_Q)
        ws = fp8_weight_scales(tl.load(s_ptrs))
        if len(ws.shape) == 0:
            acc += _fp8_dot(aq, w, PTX) * (a_s * ws)[:, None]
        else:
            acc += _fp8_dot(aq, w, PTX) * a_s[:, None] * ws[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def acc_finish(acc, WFMT: tl.constexpr):
    """The accumulator of a finished reduction (tensor-core steps): the MMA layout's steps multiply weights
    times 2^-MMA_EXCESS (its scale factors stay bf16 numbers), so its accumulator is scaled back (exact)."""
    if WFMT == 3:
        acc = acc * _MMA_ACC_FACTOR
    return acc


@triton.jit
def dot_step(acc, a, a_scale, ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
             PTX: tl.constexpr, DOT_PREC: tl.constexpr, A_Q: tl.constexpr):
    """``acc [BM, R] += a [BM, BLOCK_K] @ W[rows, k step]^T`` for the tile at ``ptrs`` (``TRANS`` pointers of
    ``tile_ptrs``); ``k_left`` columns remain from this step's first one (past them W reads as 0).

    MXFP4: two dots, the activations' even columns with the decoded low nibbles and the odd columns with the
    high nibbles: each decoded tile stays in the register layout it was decoded in (no interleaving shuffle).
    MXFP4 in the MMA layout: the decoded tile [R, BLOCK_K] is the dot's register operand, ``acc^T += W a^T``.
    NOTE: at every block size, also where a block fills the MMA's M (64+ rows): the decoded tile staged in shared
    memory for ``a W^T`` took 1.65-1.76x the time on the H200 (gpt-oss-20b M = 4096 3300 against 1875 us, -120b
    M = 4096 3744 against 2176) and summed 64-row blocks on 4 warps wrong (Triton 3.6), though ptxas pipelines its
    wgmma where it serializes this one's (benchmarks/results/ab_mxfp4_mma_staged_h200.txt).
    Dense and fp8 block: the tile loaded, then ``dot_tile``.
    """
    if WFMT == 3:
        acc = tl.trans(dot_step_t(tl.trans(acc), a, a_scale, ptrs, s_ptrs, k_left, EVEN_K, BLOCK_K, WFMT, PTX, DOT_PREC,
                                  False))
    elif WFMT == 1:
        w_ev, w_od = _load_mxfp4(ptrs, s_ptrs, k_left, EVEN_K, BLOCK_K, PTX)
        a_ev, a_od = _even_odd(_as_bf16(a, PTX))
        acc = tl.dot(a_ev, w_ev.T, acc, input_precision=DOT_PREC)
        acc = tl.dot(a_od, w_od.T, acc, input_precision=DOT_PREC)
    else:
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(tl.arange(0, BLOCK_K) < k_left)[:, None], other=0.0)
        acc = dot_tile(acc, a, a_scale, w, s_ptrs, WFMT, PTX, DOT_PREC, A_Q)
    return acc


@triton.jit
def dot_step_t(acc_t, a, a_scale, ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
               WFMT: tl.constexpr, PTX: tl.constexpr, DOT_PREC: tl.constexpr, A_Q: tl.constexpr):
    """``acc_t [R, BM] += W[rows, k step] a^T``, ``a [BM, BLOCK_K]``: the transposed tensor-core step, the tile's R
    weight rows as the MMA's M and the BM tokens as its N (16 suffice), for the formats whose GEMVs run on tensor
    cores (``_gemv_dot``; ``tile_ptrs`` without ``TRANS``). 16-bit dense: the tile as loaded (from shared memory),
    ``a`` in the weights' dtype. MXFP4 in the MMA layout (every step of it): the decoded tile is the register operand.
    fp8 block (BLOCK_K = 128, a weight scale per row): ``a`` quantized here, or with A_Q e4m3 already with ``a_scale``
    its scale (one row: a scalar); the block's product scaled by the weight scale of its row and the activation
    scale of its token.
    NOTE: fp8 in the untransposed form (``dot_tile`` with 16 token rows) ran mma.sync in fp16 and spilled (Triton
    3.6, sm_90, ptxas -v: 255 registers, 764 B of spills at 128 weight rows); transposed it is a wgmma with the
    weights read from shared memory."""
    if WFMT == 3:
        w = _load_mxfp4_mma(ptrs, s_ptrs, k_left, EVEN_K, BLOCK_K, PTX)
        acc_t = tl.dot(w, tl.trans(_as_bf16(a, PTX)), acc_t, input_precision=DOT_PREC)
    elif WFMT == 0:
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(tl.arange(0, BLOCK_K) < k_left)[None, :], other=0.0)
        acc_t = tl.dot(w, tl.trans(a.to(w.dtype)), acc_t, input_precision=DOT_PREC)
    else:
        tl.static_assert(WFMT == 2 and BLOCK_K == 128, "transposed tensor-core steps: dense 16-bit weights, MXFP4 in "
                         "the MMA layout and fp8 block (one 128-column scale block per step)")
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(tl.arange(0, BLOCK_K) < k_left)[None, :], other=0.0)
        ws = fp8_weight_scales(tl.load(s_ptrs))
        if A_Q:
            acc_t += _fp8_dot(w, tl.trans(a), PTX) * (ws * a_scale)
        else:
            aq, a_s = fp8_operand(a, a_scale, s_ptrs, PTX, False)
            acc_t += _fp8_dot(w, tl.trans(aq), PTX) * ws * a_s[None, :]
    return acc_t


@triton.jit
def fma_step(acc, x, ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
             PTX: tl.constexpr):
    """GEMV step: ``acc [..., R, BLOCK_K] += W [..., R, k step] * x [..., 1, BLOCK_K]`` elementwise in fp32
    (MXFP4: the even and the odd columns into the same BLOCK_K / 2 columns of acc). ``x`` is [BLOCK_K] (one row
    for all the tile's rows) or [S, BLOCK_K] (one per leading index of a 3-D tile); ``k_left`` as in ``dot_step``
    (a scalar or per leading index, [S, 1, 1]). Dense and MXFP4 only: the formats of ``dot_step_t`` multiply in the
    tensor-core GEMVs of ``_gemv_dot``."""
    tl.static_assert(WFMT == 0 or WFMT == 1, "fp8 block and the MMA layout run the tensor-core GEMVs (_gemv_dot)")
    if WFMT == 1:
        w_ev, w_od = _load_mxfp4(ptrs, s_ptrs, k_left, EVEN_K, BLOCK_K, PTX)
        x_ev, x_od = _even_odd(_as_bf16(x, PTX).to(tl.float32))
        if len(x.shape) == 2:
            x_ev, x_od = x_ev[:, None, :], x_od[:, None, :]
        else:
            x_ev, x_od = x_ev[None, :], x_od[None, :]
        acc += w_ev.to(tl.float32) * x_ev + w_od.to(tl.float32) * x_od
    else:
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=tl.arange(0, BLOCK_K) < k_left, other=0.0)
        xf = x.to(tl.float32)
        if len(x.shape) == 2:
            xf = xf[:, None, :]
        else:
            xf = xf[None, :]
        acc += w.to(tl.float32) * xf
    return acc


# ----------------------------------------------------------------------------------------------------
# Host side: what a launch passes for one weight stack
# ----------------------------------------------------------------------------------------------------


class WeightOperand:
    """One expert weight stack as the kernels take it: the data tensor, its scales (or the data again, unused,
    for dense weights), the format's ``quant`` name and code and the logical ``[E, rows, cols]`` shape (MXFP4 stores
    cols / 2 bytes per row); ``strides`` = (data e, rows, cols; scales e, rows, cols), zeros for absent scales."""

    def __init__(self, w, scale, quant: str):
        self.quant = quant
        self.fmt = WEIGHT_FORMATS[quant]
        self.w = w
        self.scale = w if scale is None else scale
        E, rows, cols = w.shape
        self.shape = (E, rows, 2 * cols if self.fmt in (WFMT_MXFP4, WFMT_MXFP4_MMA) else cols)
        s = (0, 0, 0) if scale is None else tuple(scale.stride())
        self.strides = (*w.stride(), *s)

    @property
    def dense(self) -> bool:
        return self.fmt == WFMT_DENSE

    @property
    def ue8m0(self) -> bool:
        """fp8 block with UE8M0 byte scales: the activations it multiplies are quantized with power-of-two scales
        (the kernels read that off the scale pointer's dtype; host code that quantizes asks here)."""
        return self.fmt == WFMT_FP8_BLOCK and self.scale.dtype == torch.uint8

    @property
    def dot_gemvs(self) -> bool:
        """Whether the direct schedule multiplies in tensor-core GEMVs (``_gemv_dot``): MXFP4 in the MMA layout
        (tensor-core steps only) and fp8 block (its FMA GEMVs would dequantize every weight in fp32)."""
        return self.fmt in (WFMT_MXFP4_MMA, WFMT_FP8_BLOCK)

    @property
    def element_tiles(self) -> bool:
        """Whether a weight tile is a plain tile of elements (dense, fp8 block): TMA can load it (``dot_tile``)."""
        return self.fmt in (WFMT_DENSE, WFMT_FP8_BLOCK)

    @staticmethod
    def of(w) -> "WeightOperand":
        """``w`` itself if it is one, else the dense operand of the tensor ``w``."""
        return w if isinstance(w, WeightOperand) else WeightOperand(w, None, "none")
