"""The optional triton_kernels backend: ``fused_experts(..., backend="triton_kernels")`` against the fp64
reference on the GPU (skipped when triton_kernels is not usable), CUDA-graph capture without host syncs, and,
on any device, the routing pack kernel, the weight views and the errors for unsupported or missing parts.

MXFP4 weights (``quant="mxfp4"``): on the GPU, prepared (``prepare_mxfp4``) and raw weights against the PyTorch
implementation on the same quantized weights, bitwise equality of the two, invalid slots, CUDA graphs; on any
device (with triton_kernels importable) the Hopper layouts of ``_prepare_with_layouts`` unswizzled back to our
bytes, and everywhere the argument errors, which come before anything needs a GPU."""

import math
import sys
from types import SimpleNamespace

import pytest
import torch

from moe_extension.backends import triton_kernels as tk_backend
from moe_extension.ops import fused_experts_torch
from moe_extension.quant import quantize_mxfp4
from tests.reference import (
    assert_close,
    fused_experts_reference,
    random_expert_map,
    random_experts,
    random_routing,
    tolerance,
)
from tests.utils import INTERPRETED, assert_graph_replays_match_eager, rel_err

needs_triton_kernels = pytest.mark.skipif(
    not tk_backend.is_available(), reason=f"triton_kernels backend unusable here: {tk_backend.unavailable_reason()}"
)

# (M, E, topk, K, N, options): gpt-oss / qwen3 dims, odd sizes with a padded topk (6 -> 8), K * 2 bytes not a
# multiple of 16, 512 experts, more tokens than experts, router weight on the input (topk 1, and topk 4 with
# repeated ids), fp16.
CASES = {
    "decode": (1, 8, 2, 256, 128, {}),
    "gpt-oss-dims": (33, 8, 4, 2880, 2880, {"bias": True}),
    "qwen3-dims": (64, 32, 8, 2048, 768, {"id_dtype": torch.int64}),
    "odd-sizes-map-topk6": (300, 64, 6, 1000, 333, {"bias": True, "e_global": 96, "transposed": True}),
    "k-unaligned": (45, 16, 4, 1001, 200, {"bias": True}),
    "512-experts": (64, 512, 8, 256, 128, {"e_global": 600}),
    "many-tokens": (1000, 8, 2, 512, 256, {"transposed": True}),
    "on-input-topk1": (77, 16, 1, 512, 256, {"on_input": True, "bias": True}),
    "on-input-topk4": (40, 8, 4, 512, 256, {"on_input": True, "e_global": 12}),
    "fp16": (50, 16, 4, 512, 256, {"dtype": torch.float16, "bias": True}),
}


def _poison_allocator():
    """Leave NaN bytes in freed CUDA blocks, so that output rows a kernel never writes show up as NaN."""
    sizes = [256 << 20] + [512 << 10] * 16  # the large and the small pool of the caching allocator
    blocks = [torch.empty(size, dtype=torch.uint8, device="cuda").fill_(0xFF) for size in sizes]
    del blocks


def _case(m, e, topk, k, n, opts):
    dtype = opts.get("dtype", torch.bfloat16)
    e_global = opts.get("e_global")
    x = torch.randn(m, k, device="cuda").to(dtype)
    experts = random_experts(e, k, n, dtype=dtype, device="cuda", bias=opts.get("bias", False),
                             transposed=opts.get("transposed", False))
    weights, ids = random_routing(m, e_global or e, topk, id_dtype=opts.get("id_dtype", torch.int32), device="cuda")
    kwargs = dict(w1_bias=experts["w1_bias"], w2_bias=experts["w2_bias"],
                  expert_map=random_expert_map(e_global, e, device="cuda") if e_global else None,
                  apply_router_weight_on_input=opts.get("on_input", False))
    return (x, experts["w1"], experts["w2"], weights, ids), kwargs, dtype


@pytest.mark.cuda
@needs_triton_kernels
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    m, e, topk, k, n, opts = CASES[case]
    args, kwargs, dtype = _case(m, e, topk, k, n, opts)
    _poison_allocator()
    out = torch.ops.moe_ext.fused_experts(*args, "swigluoai", **kwargs, backend="triton_kernels")
    assert out.shape == (m, k) and out.dtype == dtype
    assert_close(out, fused_experts_reference(*args, "swigluoai", **kwargs), tolerance(dtype, "cuda"))


@pytest.mark.cuda
@needs_triton_kernels
def test_invalid_slots_and_repeats_are_exact():
    """All-invalid tokens give exact zeros; a token naming one expert twice counts it twice."""
    args, kwargs, _ = _case(48, 16, 4, 512, 256, {"bias": True})
    x, w1, w2, weights, ids = args
    ids[:8] = -1
    ids[8:16, 1:] = ids[8:16, :1]
    _poison_allocator()
    out = torch.ops.moe_ext.fused_experts(x, w1, w2, weights, ids, "swigluoai", **kwargs, backend="triton_kernels")
    assert torch.equal(out[:8], torch.zeros_like(out[:8]))
    assert_close(out, fused_experts_reference(*args, "swigluoai", **kwargs), tolerance(torch.bfloat16, "cuda"))


@pytest.mark.cuda
@needs_triton_kernels
def test_cuda_graph_replays_equal_eager_without_host_sync():
    m, e, topk, k, n = 64, 16, 4, 512, 256
    args, kwargs, _ = _case(m, e, topk, k, n, {"bias": True})
    x, w1, w2, weights, ids = args

    def call(inputs):
        return tk_backend.fused_experts(inputs[0], w1, w2, inputs[1], inputs[2], "swigluoai", **kwargs)

    def fresh():
        new_weights, new_ids = random_routing(m, e, topk, device="cuda")
        return torch.randn(m, k, device="cuda", dtype=x.dtype), new_weights, new_ids.to(ids.dtype)

    assert_graph_replays_match_eager(call, (x, weights, ids), fresh, replays=4)


# The pack kernel runs on CPU tensors only in Triton's interpreter (no CUDA), else on CUDA.
@pytest.mark.parametrize("device", ["cpu"] if INTERPRETED else ["cuda"])
@pytest.mark.parametrize("m,topk,e,e_global,id_dtype", [
    (5, 6, 40, None, torch.int32), (37, 4, 128, 200, torch.int64), (3, 1, 8, None, torch.int64),
    (9, 16, 512, None, torch.int32), (6, 3, 33, 50, torch.int32),
])
def test_pack_routing(device, m, topk, e, e_global, id_dtype):
    """Local ids (-1 = dropped), merged weights of repeated experts, and the expert bitmatrix, per token."""
    weights, ids = random_routing(m, e_global or e, topk, invalid=0.2, id_dtype=id_dtype)
    emap = random_expert_map(e_global, e) if e_global else None
    ids[0] = 0 if emap is None else int(emap.argmax())  # token 0 names one valid expert in every slot
    ids_t = ids.t().contiguous().t()  # strided topk_ids
    out_ids, out_gates, bits = tk_backend._pack_routing(
        ids_t.to(device), weights.to(device), None if emap is None else emap.to(device), e
    )
    p = out_ids.shape[1]
    assert p == 1 << (topk - 1).bit_length()
    exp_ids = torch.full((m, p), -1, dtype=torch.int32)
    exp_gates = torch.zeros(m, p)
    exp_bits = torch.zeros(m, (e + 31) // 32, dtype=torch.int64)
    for t in range(m):
        first = {}
        for j in range(topk):
            i = int(ids[t, j])
            local = (int(emap[i]) if 0 <= i < e_global else -1) if emap is not None else i
            if not 0 <= local < e:
                continue
            if local in first:
                exp_gates[t, first[local]] += weights[t, j]
                continue
            first[local] = j
            exp_ids[t, j], exp_gates[t, j] = local, weights[t, j]
            exp_bits[t, local // 32] |= 1 << (local % 32)
    assert torch.equal(out_ids.cpu(), exp_ids)
    torch.testing.assert_close(out_gates.cpu(), exp_gates)
    assert torch.equal(bits.cpu().view(torch.int32).long() & 0xFFFFFFFF, exp_bits)


def test_weights_are_passed_as_views():
    w = torch.randn(4, 6, 8)
    for weight in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
        view = tk_backend._weight_view(weight)
        assert view.shape == (4, 8, 6) and view.data_ptr() == weight.data_ptr()
    stepped = torch.randn(4, 12, 16)[:, ::2, ::2]
    copied = tk_backend._weight_view(stepped)
    assert copied.is_contiguous() and torch.equal(copied, stepped.transpose(1, 2))


def test_intermediate_rows_are_16_byte_aligned():
    like = torch.empty(0, dtype=torch.bfloat16)
    assert tk_backend._intermediate(5, 2880, like).stride() == (5 * 2880, 2880, 1)
    padded = tk_backend._intermediate(5, 333, like)
    assert padded.shape == (1, 5, 333) and padded.stride(1) == 336


def _small_args(dtype=torch.bfloat16):
    x = torch.randn(3, 16).to(dtype)
    w1, w2 = torch.randn(4, 16, 16).to(dtype), torch.randn(4, 16, 8).to(dtype)
    weights, ids = random_routing(3, 4, 2)
    return x, w1, w2, weights, ids


def test_unsupported_activation_is_named():
    with pytest.raises(NotImplementedError, match=r"activation='silu' is not supported; matmul_ogs fuses only"):
        tk_backend.fused_experts(*_small_args(), "silu")


def test_unsupported_dtype_is_named():
    with pytest.raises(NotImplementedError, match=r"dtype torch.float32 is not supported; expected torch.bfloat16"):
        tk_backend.fused_experts(*_small_args(torch.float32), "swigluoai")


@pytest.fixture
def fresh_availability():
    tk_backend._load.cache_clear()
    tk_backend._load_mxfp4.cache_clear()
    yield
    tk_backend._load.cache_clear()
    tk_backend._load_mxfp4.cache_clear()


def test_missing_package_gives_clear_error(monkeypatch, fresh_availability):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)  # `import triton_kernels` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton_kernels.matmul_ogs", None)
    assert not tk_backend.is_available()
    assert "cannot import triton_kernels" in tk_backend.unavailable_reason()
    with pytest.raises(RuntimeError, match=r"triton_kernels is not available: cannot import triton_kernels"):
        tk_backend.fused_experts(*_small_args(), "swigluoai")


# ---------------------------------------------------------------------------------------------- MXFP4 weights

MXFP4_TOLERANCE = 1e-2  # rel err against the PyTorch implementation on the same quantized weights

# (M, E, topk, K = N, options): decode, topk 1 and 4, 8 and 32 experts, gpt-oss dims (K = N = 2880, E small),
# biases, an expert_map with -1 entries (plus the invalid ids random_routing plants), int64 ids, weights as
# transposed views, router weight on the input.
MXFP4_CASES = {
    "m1-topk1": (1, 8, 1, 256, {}),
    "m1-topk4-bias": (1, 32, 4, 256, {"bias": True}),
    "m7-map": (7, 32, 4, 256, {"bias": True, "e_global": 48}),
    "m300-topk4": (300, 8, 4, 256, {"bias": True, "transposed": True, "id_dtype": torch.int64}),
    "m300-topk1-map": (300, 32, 1, 256, {"e_global": 40}),
    "gpt-oss-dims-m1": (1, 8, 4, 2880, {"bias": True}),
    "gpt-oss-dims-m7-topk1": (7, 8, 1, 2880, {"bias": True}),
    "gpt-oss-dims-m300": (300, 8, 4, 2880, {"bias": True, "e_global": 12}),
    "on-input-topk4": (40, 8, 4, 256, {"on_input": True, "bias": True}),
    "on-input-topk1": (77, 32, 1, 256, {"on_input": True}),
}


def _mxfp4_case(m, e, topk, k, opts):
    """Inputs on the GPU: bf16 x, MXFP4 weights (quantized there), routing, and the keyword arguments."""
    n = k
    e_global = opts.get("e_global")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w1, s1 = quantize_mxfp4(torch.randn(e, 2 * n, k, device="cuda") / math.sqrt(k))
    w2, s2 = quantize_mxfp4(torch.randn(e, k, n, device="cuda") / math.sqrt(n))
    if opts.get("transposed"):  # transposed views of [E, cols/2, rows] storage (any strides are allowed)
        w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    weights, ids = random_routing(m, e_global or e, topk, id_dtype=opts.get("id_dtype", torch.int32), device="cuda")
    bias = opts.get("bias", False)
    kwargs = dict(w1_bias=torch.randn(e, 2 * n, device="cuda") * 0.5 if bias else None,
                  w2_bias=torch.randn(e, k, device="cuda") * 0.5 if bias else None,
                  expert_map=random_expert_map(e_global, e, device="cuda") if e_global else None,
                  apply_router_weight_on_input=opts.get("on_input", False))
    return (x, w1, w2, weights, ids), (s1, s2), kwargs


def _mxfp4_reference(args, scales, kwargs):
    return fused_experts_torch(*args, "swigluoai", quant="mxfp4", w1_scale=scales[0], w2_scale=scales[1], **kwargs)


@pytest.mark.cuda
@needs_triton_kernels
@pytest.mark.parametrize("case", MXFP4_CASES)
def test_mxfp4_matches_torch(case):
    m, e, topk, k, opts = MXFP4_CASES[case]
    args, (s1, s2), kwargs = _mxfp4_case(m, e, topk, k, opts)
    x, w1, w2, weights, ids = args
    w1p, w2p = tk_backend.prepare_mxfp4(w1, s1), tk_backend.prepare_mxfp4(w2, s2)
    assert w1p.shape == (e, 2 * k, k) and w2p.shape == (e, k, k)
    constraints = dict(tk_backend._load()[0].opt_flags._opt_flags_constraints)
    _poison_allocator()
    out = tk_backend.fused_experts(x, w1p, w2p, weights, ids, "swigluoai", quant="mxfp4", **kwargs)
    assert out.shape == (m, k) and out.dtype == torch.bfloat16
    # the per-call opt_flags constraints (vLLM's split_k=1 on Hopper) are restored after the call
    assert tk_backend._load()[0].opt_flags._opt_flags_constraints == constraints
    ref = _mxfp4_reference(args, (s1, s2), kwargs)
    err = rel_err(out, ref)
    assert err <= MXFP4_TOLERANCE, f"rel err {err:.3e} against the PyTorch implementation"


@pytest.mark.cuda
@needs_triton_kernels
@pytest.mark.parametrize("case", ["m300-topk4", "gpt-oss-dims-m7-topk1", "on-input-topk4"])
def test_mxfp4_prepared_equals_raw(case):
    """Raw uint8 weights + scales (prepared inside every call) give bitwise the output of prepared ones."""
    m, e, topk, k, opts = MXFP4_CASES[case]
    args, (s1, s2), kwargs = _mxfp4_case(m, e, topk, k, opts)
    x, w1, w2, weights, ids = args
    prepared = tk_backend.fused_experts(x, tk_backend.prepare_mxfp4(w1, s1), tk_backend.prepare_mxfp4(w2, s2),
                                        weights, ids, "swigluoai", quant="mxfp4", **kwargs)
    raw = tk_backend.fused_experts(x, w1, w2, weights, ids, "swigluoai", quant="mxfp4", w1_scale=s1, w2_scale=s2,
                                   **kwargs)
    mixed = tk_backend.fused_experts(x, tk_backend.prepare_mxfp4(w1, s1), w2, weights, ids, "swigluoai",
                                     quant="mxfp4", w2_scale=s2, **kwargs)
    assert torch.equal(prepared, raw) and torch.equal(prepared, mixed)


@pytest.mark.cuda
@needs_triton_kernels
def test_mxfp4_invalid_slots_are_exact_zeros():
    """Tokens whose slots are all invalid (-1, >= E_global, mapped to -1) give exact zeros, biases or not."""
    args, (s1, s2), kwargs = _mxfp4_case(48, 16, 4, 256, {"bias": True, "e_global": 24})
    x, w1, w2, weights, ids = args
    unmapped = int((kwargs["expert_map"] == -1).nonzero()[0])
    ids[:4] = -1
    ids[4:8] = 24
    ids[8:12] = unmapped
    _poison_allocator()
    out = tk_backend.fused_experts(x, tk_backend.prepare_mxfp4(w1, s1), tk_backend.prepare_mxfp4(w2, s2),
                                   weights, ids, "swigluoai", quant="mxfp4", **kwargs)
    assert torch.equal(out[:12], torch.zeros_like(out[:12]))
    assert rel_err(out, _mxfp4_reference(args, (s1, s2), kwargs)) <= MXFP4_TOLERANCE


@pytest.mark.cuda
@needs_triton_kernels
def test_mxfp4_cuda_graph_replays_equal_eager_without_host_sync():
    m, e, topk, k = 64, 32, 4, 256
    args, (s1, s2), kwargs = _mxfp4_case(m, e, topk, k, {"bias": True})
    x, w1, w2, weights, ids = args
    w1p, w2p = tk_backend.prepare_mxfp4(w1, s1), tk_backend.prepare_mxfp4(w2, s2)

    def call(inputs):
        return tk_backend.fused_experts(inputs[0], w1p, w2p, inputs[1], inputs[2], "swigluoai", quant="mxfp4",
                                        **kwargs)

    def fresh():
        new_weights, new_ids = random_routing(m, e, topk, device="cuda")
        return torch.randn(m, k, device="cuda", dtype=x.dtype), new_weights, new_ids.to(ids.dtype)

    assert_graph_replays_match_eager(call, (x, weights, ids), fresh, replays=3)


# The layouts are plain torch code: with triton_kernels importable they run on CPU tensors too. This checks our
# side of the contract (transposes, mx_axis, logical shapes): the Hopper layouts, unswizzled, give back our
# packed bytes and scales as matmul_ogs' [E, in, out] operand.
needs_mxfp4_api = pytest.mark.skipif(
    tk_backend._load_mxfp4()[1] is not None, reason=f"triton_kernels not importable: {tk_backend._load_mxfp4()[1]}"
)


def _hopper_layouts():
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    return HopperMXValueLayout, {"mx_axis": 1}, HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8}


@needs_mxfp4_api
@pytest.mark.parametrize("e,out,inn,transposed", [(2, 320, 96, False), (3, 256, 2880, True), (1, 5760, 64, False)])
def test_mxfp4_hopper_layouts_unswizzle_to_our_operand(e, out, inn, transposed):
    mx = tk_backend._load_mxfp4()[0]
    w, s = quantize_mxfp4(torch.randn(e, out, inn))
    if transposed:
        w, s = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w, s))
    prepared = tk_backend._prepare_with_layouts(mx, "test", "w1", w, s, *_hopper_layouts())
    assert prepared.shape == (e, out, inn)
    value, scale = prepared.value, prepared.scale
    assert value.dtype == mx.FP4 and list(value.shape) == [e, inn, out]
    assert list(scale.shape) == [e, inn // 32, out]
    assert value.storage.layout.name == "HOPPER_VALUE" and scale.storage.layout.name == "HOPPER_SCALE"
    # matmul_ogs reads W_TRANSPOSE (packed along `in`) from a unit stride in dim -2 of the value storage
    assert value.storage.data.stride(-2) == 1
    values = value.storage.layout.unswizzle_data(value.storage.data)
    scales = scale.storage.layout.unswizzle_data(scale.storage.data)[:, : inn // 32, :out]
    assert torch.equal(values, w.transpose(1, 2))
    assert torch.equal(scales, s.transpose(1, 2))


@needs_mxfp4_api
def test_mxfp4_strided_layout_is_our_transposed_bytes():
    from triton_kernels.tensor_details.layout import StridedLayout

    mx = tk_backend._load_mxfp4()[0]
    w, s = quantize_mxfp4(torch.randn(2, 64, 128))
    prepared = tk_backend._prepare_with_layouts(mx, "test", "w2", w, s, StridedLayout, {}, StridedLayout, {})
    assert list(prepared.value.shape) == [2, 128, 64]
    assert torch.equal(prepared.value.storage.data, w.transpose(1, 2))
    assert prepared.value.storage.data.stride(-2) == 1
    assert torch.equal(prepared.scale.storage.data, s.transpose(1, 2))


@needs_mxfp4_api
def test_mxfp4_hopper_layout_needs_more_than_128_outputs():
    mx = tk_backend._load_mxfp4()[0]
    w, s = quantize_mxfp4(torch.randn(2, 128, 256))
    with pytest.raises(NotImplementedError, match=r"w2 has 128 output features; matmul_ogs' Hopper MXFP4 layout"):
        tk_backend._prepare_with_layouts(mx, "test", "w2", w, s, *_hopper_layouts())


class _FakeOptFlags:
    """triton_kernels.matmul_ogs_details.opt_flags' module-global constraints and their two setters."""

    def __init__(self, constraints):
        self._opt_flags_constraints = dict(constraints)

    def update_opt_flags_constraints(self, constraints):
        self._opt_flags_constraints.update(constraints)

    def reset_opt_flags_constraints(self):
        self._opt_flags_constraints = dict()


def test_opt_flags_scope_restores_the_constraints():
    tk = SimpleNamespace(opt_flags=_FakeOptFlags({"idle_sms": 2}))
    with pytest.raises(KeyError):
        with tk_backend._opt_flags_scope(tk, {"split_k": 1}):
            assert tk.opt_flags._opt_flags_constraints == {"idle_sms": 2, "split_k": 1}
            raise KeyError("inside")
    assert tk.opt_flags._opt_flags_constraints == {"idle_sms": 2}
    with tk_backend._opt_flags_scope(tk, {}):
        assert tk.opt_flags._opt_flags_constraints == {"idle_sms": 2}


# ---- argument errors: all raised before triton_kernels or a GPU is needed (CPU tensors here)

def _mxfp4_small(e=4, k=64, n=64, m=3, topk=2):
    x = torch.randn(m, k).to(torch.bfloat16)
    (w1, s1), (w2, s2) = quantize_mxfp4(torch.randn(e, 2 * n, k)), quantize_mxfp4(torch.randn(e, k, n))
    weights, ids = random_routing(m, e, topk)
    return x, w1, s1, w2, s2, weights, ids


def _fake_prepared(e, out, inn, device="cpu"):
    return tk_backend.PreparedMXFP4(value=None, scale=None, num_experts=e, out_features=out, in_features=inn,
                                    device=torch.device(device))


def _call(x, w1, w2, weights, ids, **kwargs):
    return tk_backend.fused_experts(x, w1, w2, weights, ids, "swigluoai", **kwargs)


@pytest.mark.parametrize("what,exc,message", [
    ("fp8_block", NotImplementedError, r"quant='fp8_block' is not supported; expected one of 'none', 'mxfp4'"),
    ("fp16", NotImplementedError, r"hidden_states dtype torch.float16 is not supported with quant='mxfp4'"),
    ("no_w1_scale", ValueError, r"raw uint8 w1 needs w1_scale"),
    ("w2_scale_shape", ValueError, r"w2_scale must be uint8 E8M0 \[E, out, in/32\] = \[4, 64, 2\]"),
    ("w1_bf16", TypeError, r"w1 must be packed MXFP4, uint8 \[E, out, in/2\] \(two e2m1 codes per byte\)"),
    ("w1_list", TypeError, r"w1 must be a packed MXFP4 uint8 tensor \[E, out, in/2\] or a PreparedMXFP4"),
    ("prepared_with_scale", ValueError, r"w1 is a PreparedMXFP4, which carries its own scales; w1_scale must be None"),
    ("prepared_wrong_device", ValueError, r"w2 \(PreparedMXFP4\) is on meta, hidden_states on cpu"),
    ("shape_mismatch", ValueError, r"w1 \[E, 2N, K\] = \[4, 128, 64\] and w2 \[E, K, N\] = \[4, 64, 32\]"),
    ("prepared_quant_none", ValueError, r"w2 is a PreparedMXFP4 \(prepare_mxfp4\); pass quant='mxfp4'"),
    ("scale_quant_none", ValueError, r"w1_scale is only used with quant='mxfp4', got quant='none'"),
])
def test_mxfp4_argument_errors_name_the_argument(what, exc, message):
    x, w1, s1, w2, s2, weights, ids = _mxfp4_small()
    call = {
        "fp8_block": lambda: _call(x, w1, w2, weights, ids, quant="fp8_block", w1_scale=s1, w2_scale=s2),
        "fp16": lambda: _call(x.half(), w1, w2, weights, ids, quant="mxfp4", w1_scale=s1, w2_scale=s2),
        "no_w1_scale": lambda: _call(x, w1, w2, weights, ids, quant="mxfp4", w2_scale=s2),
        "w2_scale_shape": lambda: _call(x, w1, w2, weights, ids, quant="mxfp4", w1_scale=s1, w2_scale=s2[:, :, :1]),
        "w1_bf16": lambda: _call(x, torch.randn(4, 128, 64).bfloat16(), w2, weights, ids, quant="mxfp4",
                                 w1_scale=s1, w2_scale=s2),
        "w1_list": lambda: _call(x, [w1], w2, weights, ids, quant="mxfp4", w1_scale=s1, w2_scale=s2),
        "prepared_with_scale": lambda: _call(x, _fake_prepared(4, 128, 64), w2, weights, ids, quant="mxfp4",
                                             w1_scale=s1, w2_scale=s2),
        "prepared_wrong_device": lambda: _call(x, w1, _fake_prepared(4, 64, 64, "meta"), weights, ids,
                                               quant="mxfp4", w1_scale=s1),
        "shape_mismatch": lambda: _call(x, w1, w2[:, :, :16], weights, ids, quant="mxfp4", w1_scale=s1,
                                        w2_scale=s2[:, :, :1]),
        "prepared_quant_none": lambda: _call(x, x.new_empty(4, 128, 64), _fake_prepared(4, 64, 64), weights, ids),
        "scale_quant_none": lambda: _call(x, x.new_empty(4, 128, 64), x.new_empty(4, 64, 64), weights, ids,
                                          w1_scale=s1),
    }[what]
    with pytest.raises(exc, match=message):
        call()


def test_prepare_mxfp4_argument_errors():
    _, w1, s1, _, _, _, _ = _mxfp4_small()
    with pytest.raises(TypeError, match=r"prepare_mxfp4: w must be packed MXFP4, uint8"):
        tk_backend.prepare_mxfp4(w1.float(), s1)
    with pytest.raises(ValueError, match=r"prepare_mxfp4: raw uint8 w needs w_scale"):
        tk_backend.prepare_mxfp4(w1, None)
    message = r"prepare_mxfp4: w_scale must be uint8 E8M0 \[E, out, in/32\] = \[4, 128, 2\]"
    with pytest.raises(ValueError, match=message):
        tk_backend.prepare_mxfp4(w1, s1.transpose(1, 2))


@pytest.mark.skipif(tk_backend.is_available(), reason="the path without a usable triton_kernels")
def test_mxfp4_without_triton_kernels_is_a_clear_runtime_error():
    x, w1, s1, w2, s2, weights, ids = _mxfp4_small()
    with pytest.raises(RuntimeError, match=r"triton_kernels is not available"):
        tk_backend.prepare_mxfp4(w1, s1)
    with pytest.raises(RuntimeError, match=r"triton_kernels is not available"):
        _call(x, w1, w2, weights, ids, quant="mxfp4", w1_scale=s1, w2_scale=s2)
