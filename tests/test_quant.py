"""Weight/activation preparation helpers: fp8 block and per-token-group quantization, MXFP4 packing."""

import math

import pytest
import torch

from moe_extension.quant import (
    E2M1_VALUES,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    dequantize_mxfp4,
    e2m1_table,
    e8m0_to_float,
    fake_quantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
    quantize_mxfp4,
    ue8m0_scales,
    unpack_mxfp4,
)

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_POSITIVE = E4M3_VALUES[torch.isfinite(E4M3_VALUES) & (E4M3_VALUES > 0)].unique()


# ------------------------------------------------------------------------------------------- fp8 blocks


def _representable_blocks(shape, exponents):
    """A weight whose 128 x 128 block (i, j) holds e4m3 values times 2^exponents[.., i, j], with +-448 in it."""
    rows, cols = shape[-2:]
    picks = E4M3_POSITIVE[torch.randint(0, len(E4M3_POSITIVE), shape)]
    signs = torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    w = picks * signs
    scale = torch.pow(2.0, exponents.float())
    w = w * scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    for i in range(exponents.shape[-2]):
        for j in range(exponents.shape[-1]):
            w[..., i * 128, j * 128] = 448.0 * scale[..., i, j]
    return w, scale


@pytest.mark.parametrize("shape", [(2, 200, 300), (3, 128, 256), (1, 5, 7), (130, 129)])
def test_fp8_block_exact_on_representable_weights(shape):
    rb, cb = math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128)
    exponents = torch.randint(-8, 4, (*shape[:-2], rb, cb))
    w, scale = _representable_blocks(shape, exponents)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-2], rb, cb)
    assert torch.equal(s, scale)  # amax = 448 * 2^k
    assert torch.equal(dequantize_fp8_block(q, s), w)


def test_fp8_block_scale_rule_and_error_bound():
    w = torch.randn(3, 300, 200) * torch.logspace(-3, 2, 300)[:, None]
    q, s = quantize_fp8_block(w)
    padded = torch.nn.functional.pad(w, (0, 56, 0, 84)).reshape(3, 3, 128, 2, 128)
    assert torch.equal(s, torch.clamp(padded.abs().amax(dim=(2, 4)), min=1e-10) / 448.0)
    err = (dequantize_fp8_block(q, s) - w).abs()
    per_elem = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :300, :200]
    # round to nearest: half a step, 2^-4 relative for normals, 2^-10 * s for subnormals
    assert (err <= w.abs() * 2**-4 + per_elem * 2**-10).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_quantization_equal_on_cpu_and_cuda(dtype):
    """The scale is amax / 448 correctly rounded on every device: low-precision inputs land exactly on e4m3
    ties often, so a scale one ulp off (CUDA's reciprocal multiply for a scalar divisor) flips them."""
    x = (torch.randn(64, 1000) * torch.logspace(-2, 2, 64)[:, None]).to(dtype).float()
    for quantize in (quantize_fp8_per_token_group, quantize_fp8_block):
        q_cpu, s_cpu = quantize(x)
        q_gpu, s_gpu = quantize(x.cuda())
        assert torch.equal(s_gpu.cpu(), s_cpu), quantize.__name__
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), quantize.__name__


def test_fp8_block_zero_block_and_bad_scales():
    w = torch.zeros(1, 256, 128)
    w[0, 128:, :] = torch.randn(128, 128)
    q, s = quantize_fp8_block(w)
    assert float(s[0, 0, 0]) == pytest.approx(1e-10 / 448.0)
    assert torch.equal(dequantize_fp8_block(q, s)[0, :128], torch.zeros(128, 128))
    with pytest.raises(ValueError, match=r"dequantize_fp8_block: s must have shape \[1, 2, 1\], got \[1, 1, 1\]"):
        dequantize_fp8_block(q, s[:, :1])
    with pytest.raises(TypeError, match="quantize_fp8_block: w must be a floating tensor"):
        quantize_fp8_block(torch.ones(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 128), (1, 7)])
def test_fp8_per_token_group(shape):
    x = torch.randn(shape) * 3
    q, s = quantize_fp8_per_token_group(x)
    groups = math.ceil(shape[-1] / 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (*shape[:-1], groups)
    for g in range(groups):
        part = x[..., g * 128 : (g + 1) * 128]
        want_s = torch.clamp(part.abs().amax(-1), min=1e-10) / 448.0
        assert torch.equal(s[..., g], want_s)
        want_q = torch.clamp(part / want_s[..., None], -448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q[..., g * 128 : (g + 1) * 128].view(torch.uint8), want_q.view(torch.uint8))
    deq = dequantize_fp8_per_token_group(q, s)
    assert torch.equal(deq, fake_quantize_fp8_per_token_group(x))
    assert ((deq - x).abs() <= x.abs() * 2**-4 + s.repeat_interleave(128, -1)[..., : shape[-1]] * 2**-10).all()


def test_fp8_per_token_group_zero_row_and_exact_values():
    x = torch.zeros(2, 256)
    x[1, :128] = E4M3_POSITIVE[torch.randint(0, len(E4M3_POSITIVE), (128,))] * 0.25
    x[1, 0] = 448.0 * 0.25
    q, s = quantize_fp8_per_token_group(x)
    assert torch.equal(dequantize_fp8_per_token_group(q, s), x)
    assert float(s[1, 0]) == 0.25 and float(s[0, 0]) == pytest.approx(1e-10 / 448.0)


def test_ue8m0_scales():
    """fp32 scales -> E8M0 bytes of 2^ceil(log2 s): powers of two exact, others rounded up, NaN -> 255."""
    s = torch.tensor([1.0, 3.0, 0.25, 0.3, 2.0**-30, 1e-10 / 448.0, 2.0**40, float("nan")])
    b = ue8m0_scales(s)
    assert b.dtype == torch.uint8
    assert b.tolist() == [127, 129, 125, 126, 97, 85, 167, 255]
    assert torch.equal(e8m0_to_float(b)[:-1], torch.tensor([1.0, 4.0, 0.25, 0.5, 2.0**-30, 2.0**-42, 2.0**40]))


def test_fp8_block_ue8m0():
    """ue8m0=True: each block's scale is the plain one rounded up to a power of two (as a byte), q computed with it;
    dequantize takes the bytes; the error stays within half an e4m3 step."""
    w = torch.randn(2, 300, 200) * torch.logspace(-3, 2, 300)[:, None]
    q, s = quantize_fp8_block(w, ue8m0=True)
    _, plain = quantize_fp8_block(w)
    assert s.dtype == torch.uint8 and s.shape == plain.shape
    v = e8m0_to_float(s)
    assert (v >= plain).all() and (v < 2 * plain).all()
    deq = dequantize_fp8_block(q, s)
    per_elem = v.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :300, :200]
    assert (torch.clamp(w / per_elem, -448, 448).to(torch.float8_e4m3fn).float() * per_elem == deq).all()
    assert ((deq - w).abs() <= w.abs() * 2**-4 + per_elem * 2**-10).all()


def test_fp8_per_token_group_ue8m0():
    x = torch.randn(4, 300) * 5
    q, s = quantize_fp8_per_token_group(x, ue8m0=True)
    _, plain = quantize_fp8_per_token_group(x)
    assert s.dtype == torch.float32 and (s.view(torch.int32) & 0x7FFFFF == 0).all()
    assert (s >= plain).all() and (s < 2 * plain).all()
    want_q = torch.clamp(x / s.repeat_interleave(128, -1)[:, :300], -448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(fake_quantize_fp8_per_token_group(x, ue8m0=True), dequantize_fp8_per_token_group(q, s))


# ------------------------------------------------------------------------------------------- mxfp4


def test_e2m1_table():
    table = e2m1_table()
    assert table.tolist()[:8] == list(E2M1_VALUES) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert table[8:].tolist() == [-v for v in E2M1_VALUES]
    assert math.copysign(1.0, float(table[8])) == -1.0  # code 8 is -0.0


def test_e8m0_decoding():
    s = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = e8m0_to_float(s)
    assert values.dtype == torch.float32
    for code in range(255):
        assert float(values[code]) == math.ldexp(1.0, code - 127), code
    assert math.isnan(float(values[255]))
    with pytest.raises(TypeError, match="e8m0_to_float: scales must be uint8"):
        e8m0_to_float(s.int())


def test_unpack_nibble_order():
    packed = torch.tensor([[0x21, 0xF8, 0x7C]], dtype=torch.uint8)
    # 0x21: low code 1 (0.5), high code 2 (1.0); 0xF8: low 8 (-0), high 15 (-6); 0x7C: low 12 (-2), high 7 (6)
    assert unpack_mxfp4(packed).tolist() == [[0.5, 1.0, -0.0, -6.0, -2.0, 6.0]]
    scales = torch.tensor([[129]], dtype=torch.uint8)
    full = torch.zeros(1, 16, dtype=torch.uint8)
    full[0, :3] = packed
    assert dequantize_mxfp4(full, scales)[0, :6].tolist() == [2.0, 4.0, -0.0, -24.0, -8.0, 24.0]


@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 96), (1, 1, 32)])
def test_mxfp4_pack_unpack_exact_on_representable(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    groups = shape[-1] // 32
    exponents = torch.randint(-20, 20, (*shape[:-1], groups))
    # one element per group at +-6 or +-4 (amax in (3, 6] * 2^k) makes the encoding unique
    largest = torch.tensor([7, 6, 15, 14], dtype=torch.uint8)
    codes.view(*shape[:-1], groups, 32)[..., 0] = largest[torch.randint(0, 4, exponents.shape)]
    codes[codes == 8] = 0  # -0 is stored as +0
    scale = torch.pow(2.0, exponents.double()).float().repeat_interleave(32, -1)
    w = e2m1_table()[codes.long()] * scale
    packed, s = quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert s.dtype == torch.uint8 and s.shape == (*shape[:-1], groups)
    assert torch.equal(s, (exponents + 127).to(torch.uint8))
    assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(unpack_mxfp4(packed), e2m1_table()[codes.long()])
    assert torch.equal(dequantize_mxfp4(packed, s), w)


def test_mxfp4_round_to_nearest_ties_to_even():
    w = torch.zeros(1, 32)
    w[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 5.1, -0.1, -2.6, 0.7, 4.9, 1.3, -1.76])
    packed, s = quantize_mxfp4(w)
    assert int(s[0, 0]) == 127
    got = dequantize_mxfp4(packed, s)[0, :16].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 0.0, -3.0, 0.5, 4.0, 1.5, -2.0]
    assert math.copysign(1.0, got[10]) == 1.0  # rounds to +0, not -0


def test_mxfp4_random_is_nearest_and_unsaturated():
    w = torch.randn(4, 7, 128) * torch.logspace(-6, 6, 7)[:, None]
    packed, s = quantize_mxfp4(w)
    scale = e8m0_to_float(s).repeat_interleave(32, -1)
    scaled = w / scale
    assert scaled.abs().max() <= 6.0
    nearest = (scaled[..., None] - e2m1_table()[:8] * scaled.sign()[..., None]).abs().min(-1).values
    assert torch.allclose((dequantize_mxfp4(packed, s) / scale - scaled).abs(), nearest, atol=0, rtol=0)
    # the scale is the smallest power of two with amax / scale <= 6
    amax = w.reshape(4, 7, 4, 32).abs().amax(-1)
    assert ((amax / e8m0_to_float(s) > 3.0) & (amax / e8m0_to_float(s) <= 6.0)).all()


def test_mxfp4_zero_and_nan_groups():
    w = torch.randn(2, 64)
    w[0, :32] = 0
    w[1, 32:40] = float("nan")
    packed, s = quantize_mxfp4(w)
    assert int(s[0, 0]) == 0 and int(s[1, 1]) == 255
    deq = dequantize_mxfp4(packed, s)
    assert torch.equal(deq[0, :32], torch.zeros(32))
    assert deq[1, 32:].isnan().all() and deq[1, :32].isfinite().all() and deq[0].isfinite().all()


def test_mxfp4_bad_inputs():
    with pytest.raises(ValueError, match="quantize_mxfp4: the last dim of w must be a multiple of 32, got 48"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(TypeError, match="quantize_mxfp4: w must be a floating tensor"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dequantize_mxfp4: .* scales of shape \\[2, 2\\], got \\[2, 1\\]"):
        dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="unpack_mxfp4: packed must be uint8"):
        unpack_mxfp4(torch.zeros(2, 16))
