"""The optional triton_kernels backend: ``fused_experts(..., backend="triton_kernels")`` against the fp64
reference on the GPU (skipped when triton_kernels is not usable), CUDA-graph capture without host syncs, and,
on any device, the routing pack kernel, the weight views and the errors for unsupported or missing parts."""

import sys

import pytest
import torch

from moe_extension.backends import triton_kernels as tk_backend
from tests.reference import (
    assert_close,
    fused_experts_reference,
    random_expert_map,
    random_experts,
    random_routing,
    tolerance,
)
from tests.utils import INTERPRETED, DEVICES

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

    def run():
        return tk_backend.fused_experts(x, w1, w2, weights, ids, "swigluoai", **kwargs)

    run()  # compiles outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(4):
        new_weights, new_ids = random_routing(m, e, topk, device="cuda")
        x.copy_(torch.randn(m, k, device="cuda"))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(captured, run())


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
    yield
    tk_backend._load.cache_clear()


def test_missing_package_gives_clear_error(monkeypatch, fresh_availability):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)  # `import triton_kernels` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton_kernels.matmul_ogs", None)
    assert not tk_backend.is_available()
    assert "cannot import triton_kernels" in tk_backend.unavailable_reason()
    with pytest.raises(RuntimeError, match=r"triton_kernels is not available: cannot import triton_kernels"):
        tk_backend.fused_experts(*_small_args(), "swigluoai")
