"""The DeepGEMM route behind ``fused_experts(quant="fp8_block")`` (moe_extension/backends/deep_gemm.py), the stored
crossover that ``backend="auto"`` reads (moe_extension/backends/crossover.py) and the op's choice of a backend.

Anywhere (CPU):
- ``contiguous_layout`` against a plain loop over the slots (segments, padding, trash row, expert_map, invalid
  ids, fewer slots than experts) and ``permuted_rows`` against the worst case;
- the route's data flow with DeepGEMM's GEMM emulated in PyTorch (rows it skips filled with NaN, which the route
  must never read back) against ``route_reference`` (rel err <= 1e-2) and the PyTorch implementation (<= 3e-2,
  see CROSS_TOL): activations, biases, expert_map, invalid ids, apply_router_weight_on_input, hidden dtypes; the
  GEMMs get the weights themselves (no copies) and the first GEMM's activation scales MN-major;
- the applicability rules and their messages; the crossover reader (shape entries, default, null, no table);
- ``backend="auto"``'s choice (``cuda_route`` on FakeTensorMode CUDA tensors): DeepGEMM only where a crossover is
  stored for the device and says so, DeepGEMM is available and the route applies; rows per expert over the
  global experts with an expert_map;
- ``backend="deep_gemm"``'s errors from the op and its fake: no CUDA, not fp8_block, DeepGEMM unavailable
  (RuntimeError with the reason), not applicable (ValueError naming the rules);
- TritonOrDeepGemmExperts: the ``backend`` argument, the layout it prepares once, the route it reports.

On an sm_90 GPU with deep_gemm importable (skipped otherwise): the route against ``route_reference`` (rel err <=
1e-2), the PyTorch implementation and our Triton kernels (<= 3e-2) for (K, N) in {(7168, 2048), (2048, 1408)} and
M in {1, 3, 77, 1000, 4096}, with expert_map (-1 entries), invalid ids, router weight on the input, biases; a
shape outside the rule (1000, 333) and transposed weights: Triton under "auto", ValueError under "deep_gemm";
"auto" switching route at the stored crossover; CUDA-graph capture of each route (and the class): 12 replays
with changed hidden states and routing, each bitwise equal to eager; torch.compile(fullgraph=True, dynamic=True):
one graph for M from 2 to 4096.
"""

from __future__ import annotations

import functools
import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_extension.kernels._configs as kernel_configs
from moe_extension.backends import crossover, deep_gemm
from moe_extension.ops.expert_gemm import slot_experts
from moe_extension.backends.deep_gemm import contiguous_layout, permuted_rows
from moe_extension.experts import TritonOrDeepGemmExperts
from moe_extension.experts.triton_or_deep_gemm import prepare_deep_gemm_layout
from moe_extension.ops import fused_experts_torch
from moe_extension.ops.fused_experts import cuda_route
from moe_extension.quant import dequantize_fp8_block, e8m0_to_float, quantize_fp8_block, ue8m0_scales
from tests.reference import random_expert_map, random_experts, random_routing
from tests.utils import assert_graph_replays_match_eager, rel_err

TOL = 1e-2
# NOTE: DeepGEMM's grouped GEMM writes bf16, so the route quantizes the activation of a bf16-rounded h while the
# PyTorch implementation and our Triton kernels quantize it from fp32 (docs/ops.md). A relative perturbation d of
# the values re-quantized to e4m3 moves about d / (fp8 step) of them by a whole step: measured on N(0, 1) rows,
# d = 2^-9 (bf16) gives 1.35e-2 of relative difference after quantization, d = 1e-4 gives 3e-3. The routes
# therefore differ by ~1.4e-2 (CPU emulation: 1.3e-2 to 2.3e-2 over seeds and M); the route's own arithmetic
# (route_reference) is held to TOL.
CROSS_TOL = 3e-2
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ layout


def layout_reference(ids: torch.Tensor, expert_map: torch.Tensor | None, E: int, align: int):
    """(dest, m_indices, valid) by a loop over the slots: experts' segments in expert order, each aligned and
    padded to ``align``, slots in slot order within their expert's segment, invalid slots on the trash row."""
    flat = ids.reshape(-1).tolist()
    emap = None if expert_map is None else expert_map.tolist()
    local = []
    for i in flat:
        e = i if emap is None else (emap[i] if 0 <= i < len(emap) else -1)
        ok = 0 <= i < (E if emap is None else len(emap)) and 0 <= e < E
        local.append(e if ok else None)
    counts = [sum(1 for e in local if e == x) for x in range(E)]
    R = permuted_rows(len(flat), E, align)
    start, m_indices = [], [-1] * R
    row = 0
    for x in range(E):
        start.append(row)
        padded = -(-counts[x] // align) * align
        m_indices[row:row + padded] = [x] * padded
        row += padded
    seen = [0] * E
    dest = []
    for e in local:
        if e is None:
            dest.append(R - align)
        else:
            dest.append(start[e] + seen[e])
            seen[e] += 1
    return dest, m_indices, [e is not None for e in local]


@pytest.mark.parametrize("align", [4, 16, 128])
@pytest.mark.parametrize("M, topk, E, with_map", [(13, 3, 5, True), (1, 2, 8, False), (9, 4, 32, True),
                                                   (40, 6, 7, False)])
def test_contiguous_layout_matches_reference(align, M, topk, E, with_map):
    torch.manual_seed(M * 100 + align)
    emap = random_expert_map(E + 3, E) if with_map else None
    _, ids = random_routing(M, E + 3 if with_map else E, topk, invalid=0.2, id_dtype=torch.int64)
    dest, m_indices, local, valid = contiguous_layout(ids, emap, E, align)
    want_dest, want_labels, want_valid = layout_reference(ids, emap, E, align)
    assert dest.dtype == torch.int64 and m_indices.dtype == torch.int32
    assert dest.tolist() == want_dest and m_indices.tolist() == want_labels and valid.tolist() == want_valid
    assert local.dtype == torch.int64 and bool(((local >= 0) & (local < E)).all())
    assert (local[valid] == m_indices[dest[valid]].long()).all()
    R = m_indices.numel()
    assert R % align == 0 and R == permuted_rows(M * topk, E, align)


@pytest.mark.parametrize("S, E, align", [(8, 256, 128), (300, 4, 16), (5, 5, 4), (33, 8, 16)])
def test_permuted_rows_holds_the_worst_case(S, E, align):
    """The padded segments (at most S + min(E, S) * (align - 1) rows: each hit expert pads fewer than align rows)
    fit before the trash block; round-robin routing (every expert hit, most segments one row past a multiple
    for align > S / E) lays out within it."""
    R = permuted_rows(S, E, align)
    assert R % align == 0 and S + min(E, S) * (align - 1) <= R - align
    ids = torch.arange(S).remainder(E).view(S, 1)
    dest, m_indices, _, _ = contiguous_layout(ids, None, E, align)
    assert m_indices.numel() == R and (m_indices[R - align:] == -1).all() and int(dest.max()) < R - align


def test_all_slots_invalid():
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    dest, m_indices, _, valid = contiguous_layout(ids, None, 4, 16)
    assert not valid.any() and (dest == m_indices.numel() - 16).all() and (m_indices == -1).all()


# ------------------------------------------------------------------------------------------------ the route on CPU


def route_reference(x, w, g, ids, activation, expert_map=None, on_input=False, bias=True, alpha=1.702, limit=7.0,
                    ue8m0=False):
    """The route's arithmetic (docs of moe_extension/backends/deep_gemm.py) in plain PyTorch, one expert at a
    time: the input (g x on the input) quantized per 128 columns; h = x_q W1^T rounded to bf16 (DeepGEMM's
    output); with b1 the activation of h + b1 in fp32, else of h rounded to bf16; quantized; y = a_q W2^T rounded
    to bf16; + b2; times g unless on the input; invalid slots 0; summed over the slots in fp32. ``ue8m0``: the
    activations quantized with power-of-two scales."""
    from moe_extension.ops.activations import activation_torch
    from moe_extension.quant import fake_quantize_fp8_per_token_group as fake_quantize

    M, K = x.shape
    E, topk = w["w1"].shape[0], ids.shape[1]
    local, valid = slot_experts(ids, expert_map, E)
    out = torch.zeros(M, topk, K, device=x.device)
    for e in range(E):
        t, j = torch.nonzero((local == e) & valid, as_tuple=True)
        if t.numel() == 0:
            continue
        xe = x[t].float() * (g[t, j, None] if on_input else 1.0)
        h = (fake_quantize(xe, ue8m0=ue8m0) @ dequantize_fp8_block(w["w1"][e], w["w1_scale"][e]).T).bfloat16().float()
        if bias and w["w1_bias"] is not None:
            a = activation_torch(h + w["w1_bias"][e], activation, alpha, limit)
        else:
            a = activation_torch(h, activation, alpha, limit).bfloat16().float()
        y = (fake_quantize(a, ue8m0=ue8m0) @ dequantize_fp8_block(w["w2"][e], w["w2_scale"][e]).T).bfloat16().float()
        if bias and w["w2_bias"] is not None:
            y = y + w["w2_bias"][e]
        out[t, j] = y if on_input else y * g[t, j, None]
    return out.sum(dim=1).to(x.dtype)


def emulated_gemm(calls: list):
    """DeepGEMM's grouped GEMM contract in PyTorch; the rows it skips (m_indices < 0) become NaN, so a route that
    reads them back fails."""
    def gemm(a, a_scale, b, b_scale, out, m_indices):
        calls.append(SimpleNamespace(a=a, a_scale=a_scale, b=b, b_scale=b_scale, out=out, m_indices=m_indices))
        R, K = a.shape
        assert a.dtype == FP8 and b.dtype == FP8 and out.dtype == torch.bfloat16 and m_indices.dtype == torch.int32
        assert a_scale.shape == (R, K // 128) and out.shape == (R, b.shape[1]) and m_indices.shape == (R,)
        a_deq = a.float() * a_scale.repeat_interleave(128, dim=1)
        for e in range(b.shape[0]):
            rows = m_indices == e
            out[rows] = (a_deq[rows] @ dequantize_fp8_block(b[e], b_scale[e]).T).to(out.dtype)
        out[m_indices < 0] = float("nan")
        return out

    return gemm


ROUTE_CASES = [  # (activation, on_input, bias, expert_map, M, dtype)
    ("silu", False, False, False, 1, torch.bfloat16),
    ("swigluoai", True, True, True, 20, torch.bfloat16),
    ("gelu", False, True, True, 77, torch.float32),
    ("swiglustep", True, False, False, 3, torch.float16),
    ("gelu_tanh", False, False, True, 40, torch.bfloat16),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(str(v).removeprefix("torch.") for v in c))
def test_route_with_emulated_gemm(monkeypatch, case):
    activation, on_input, bias, with_map, M, dtype = case
    E, N, K, topk, align = 6, 128, 256, 3, 16
    torch.manual_seed(M)
    w = random_experts(E, K, N, "fp8_block", bias=bias)
    emap = random_expert_map(E + 2, E) if with_map else None
    g, ids = random_routing(M, E + 2 if with_map else E, topk)
    x = torch.randn(M, K).to(dtype)
    calls = []
    monkeypatch.setattr(deep_gemm, "m_grouped_fp8_gemm", emulated_gemm(calls))
    monkeypatch.setattr(deep_gemm, "alignment", lambda: align)
    kw = dict(w1_bias=w["w1_bias"], w2_bias=w["w2_bias"], expert_map=emap, apply_router_weight_on_input=on_input,
              w1_scale=w["w1_scale"], w2_scale=w["w2_scale"])
    out = deep_gemm.fused_experts_deep_gemm(x, w["w1"], w["w2"], g, ids, activation, **kw)
    assert out.dtype == dtype and out.shape == (M, K)
    assert rel_err(out, route_reference(x, w, g, ids, activation, emap, on_input)) <= TOL
    ref = fused_experts_torch(x, w["w1"], w["w2"], g, ids, activation, quant="fp8_block", **kw)
    assert rel_err(out, ref) <= CROSS_TOL
    assert len(calls) == 2
    R = permuted_rows(M * topk, E, align)
    for call, b, s in zip(calls, ("w1", "w2"), ("w1_scale", "w2_scale")):
        assert call.b is w[b] and call.b_scale is w[s], "the GEMMs get the weights as given (no copies)"
        assert call.a.shape[0] == R and call.m_indices.numel() == R
    assert calls[0].a_scale.stride() == (1, R), "the first GEMM's activation scales MN-major"


def test_route_with_ue8m0_scales(monkeypatch):
    """UE8M0 byte scales: the route quantizes the activations with power-of-two scales and hands DeepGEMM the bytes'
    fp32 values; it agrees with its own arithmetic and with the PyTorch implementation of the op."""
    E, N, K, topk, M = 6, 128, 256, 3, 20
    torch.manual_seed(3)
    w = random_experts(E, K, N, "fp8_block", bias=True)
    w["w1_scale"], w["w2_scale"] = ue8m0_scales(w["w1_scale"]), ue8m0_scales(w["w2_scale"])
    g, ids = random_routing(M, E, topk)
    x = torch.randn(M, K).bfloat16()
    calls = []
    monkeypatch.setattr(deep_gemm, "m_grouped_fp8_gemm", emulated_gemm(calls))
    monkeypatch.setattr(deep_gemm, "alignment", lambda: 16)
    kw = dict(w1_bias=w["w1_bias"], w2_bias=w["w2_bias"], w1_scale=w["w1_scale"], w2_scale=w["w2_scale"])
    out = deep_gemm.fused_experts_deep_gemm(x, w["w1"], w["w2"], g, ids, "silu", **kw)
    assert rel_err(out, route_reference(x, w, g, ids, "silu", ue8m0=True)) <= TOL
    assert rel_err(out, fused_experts_torch(x, w["w1"], w["w2"], g, ids, "silu", quant="fp8_block", **kw)) <= CROSS_TOL
    assert torch.equal(calls[1].b_scale, e8m0_to_float(w["w2_scale"]))
    dest, _, _, valid = contiguous_layout(ids, None, E, 16)
    for call in calls:
        used = call.a_scale[dest[valid]]  # the slots' rows (a segment's padding rows hold anything)
        assert (used.view(torch.int32) & 0x7FFFFF == 0).all(), "power-of-two activation scales"


def test_route_without_tokens(monkeypatch):
    w = random_experts(2, 128, 128, "fp8_block")
    monkeypatch.setattr(deep_gemm, "m_grouped_fp8_gemm", emulated_gemm([]))
    out = deep_gemm.fused_experts_deep_gemm(torch.zeros(0, 128, dtype=torch.bfloat16), w["w1"], w["w2"],
                                            torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32),
                                            w1_scale=w["w1_scale"], w2_scale=w["w2_scale"])
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ applicability


def fp8_weights(E=2, N=256, K=256, device="cpu"):
    """Zero fp8 weights and unit scales in the ops' contiguous layout."""
    return dict(w1=torch.zeros(E, 2 * N, K, dtype=FP8, device=device),
                w2=torch.zeros(E, K, N, dtype=FP8, device=device),
                w1_scale=torch.ones(E, -(-2 * N // 128), -(-K // 128), device=device),
                w2_scale=torch.ones(E, -(-K // 128), -(-N // 128), device=device))


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``[E, in, out]`` storage seen as ``[E, out, in]``: not K-major."""
    return t.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def test_applicability_rules(monkeypatch):
    monkeypatch.setattr(deep_gemm, "alignment", lambda: 128)
    w = fp8_weights()
    assert deep_gemm.is_applicable(**w) and deep_gemm.inapplicable_reasons(**w) == []
    assert deep_gemm.is_applicable(**fp8_weights(E=1, N=128, K=7168))
    rules = {
        "N = 192 must be a multiple of 128": fp8_weights(N=192),
        "K = 1000 must be a multiple of 128": fp8_weights(K=1000),
        "w1 must be float8_e4m3fn, got torch.uint8": {**w, "w1": w["w1"].view(torch.uint8)},
        r"w2 must be contiguous \[E, K, N\]": {**w, "w2": transposed(w["w2"])},
        r"w1 must be contiguous \[E, 2N, K\] \(DeepGEMM's K-major layout\), got strides \(131072, 1, 512\)":
            {**w, "w1": transposed(w["w1"])},
        r"w1_scale must be contiguous \[E, 2N/128, K/128\]": {**w, "w1_scale": transposed(w["w1_scale"])},
        "w2_scale must be float32": {**w, "w2_scale": w["w2_scale"].double()},
        "w2_scale is missing": {**w, "w2_scale": None},
    }
    for pattern, args in rules.items():
        reasons = deep_gemm.inapplicable_reasons(**args)
        assert len(reasons) == 1 and re.search(pattern, reasons[0]), (pattern, reasons)
        assert not deep_gemm.is_applicable(**args)
    both = deep_gemm.inapplicable_reasons(**fp8_weights(N=333, K=1000))
    assert [r.split(" =")[0] for r in both] == ["N", "K"]


def test_availability_is_reported():
    assert isinstance(deep_gemm.is_available(), bool)
    assert (deep_gemm.unavailable_reason() is None) == deep_gemm.is_available()
    if not deep_gemm.is_available():
        reason = re.escape(deep_gemm.unavailable_reason())
        with pytest.raises(RuntimeError, match=f"DeepGEMM is not available: {reason}"):
            deep_gemm.m_grouped_fp8_gemm(None, None, None, None, None, None)


# ------------------------------------------------------------------------------------------------ crossover


def write_table(directory, name="Fake GPU", section=None):
    """A tuned-config file with kernel configs and, if given, a "backend" section."""
    table = {"device": name, "configs": {"E=1,N=1,K=1,topk=1,dtype=bfloat16,w1=row,w2=row": {}}}
    if section is not None:
        table["backend"] = section
    (directory / f"{kernel_configs.device_slug(name)}.json").write_text(json.dumps(table))


def section(default=None, shapes=None):
    """A "backend" section: fp8_block -> deep_gemm with ``default`` and ``{shape key: threshold}`` entries."""
    entries = {key: {"min_rows_per_expert": v} for key, v in (shapes or {}).items()}
    return {"fp8_block": {"deep_gemm": {"min_rows_per_expert": default, "shapes": entries}}}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """Tables from tmp_path; every CUDA device is named "Fake GPU"; DeepGEMM available with alignment 128."""
    monkeypatch.setattr(kernel_configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(crossover, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(deep_gemm, "_load", lambda: (SimpleNamespace(), None))
    monkeypatch.setattr(deep_gemm, "alignment", lambda: 128)
    crossover.load_section.cache_clear()
    yield tmp_path
    crossover.load_section.cache_clear()


def test_crossover_reader(fake_gpu):
    assert crossover.load_section("Fake GPU") == {}  # no file
    write_table(fake_gpu)
    crossover.load_section.cache_clear()
    assert crossover.load_section("Fake GPU") == {}  # a file without the section
    assert crossover.min_rows_per_expert("Fake GPU", "fp8_block", "deep_gemm", 256, 2048, 7168) is None
    write_table(fake_gpu, section={"fp8_block": {"deep_gemm": {
        "min_rows_per_expert": 48, "shapes": {"E=256,N=2048,K=7168": {"min_rows_per_expert": 64.0, "measured": []},
                                              "E=64,N=1408,K=2048": {"min_rows_per_expert": None}}}}})
    crossover.load_section.cache_clear()
    read = functools.partial(crossover.min_rows_per_expert, "Fake GPU", "fp8_block", "deep_gemm")
    assert read(256, 2048, 7168) == 64.0 and read(64, 1408, 2048) is None and read(8, 128, 128) == 48.0
    assert crossover.min_rows_per_expert("Fake GPU", "mxfp4", "deep_gemm", 256, 2048, 7168) is None
    assert crossover.min_rows_per_expert("Other GPU", "fp8_block", "deep_gemm", 256, 2048, 7168) is None
    cuda = torch.device("cuda", 0)
    assert crossover.rows_per_expert(2048, 8, 256) == 64.0
    assert crossover.prefers("deep_gemm", "fp8_block", cuda, 2048, 256, 2048, 7168, 8)
    assert not crossover.prefers("deep_gemm", "fp8_block", cuda, 2047, 256, 2048, 7168, 8)
    assert not crossover.prefers("deep_gemm", "fp8_block", torch.device("cpu"), 4096, 256, 2048, 7168, 8)
    # expert parallelism: rows per local expert follow the global expert count
    assert not crossover.prefers("deep_gemm", "fp8_block", cuda, 2048, 256, 2048, 7168, 8, num_global_experts=512)


def fake_cuda_weights(E, N, K, layout="ops"):
    """FakeTensorMode CUDA weights (shapes, dtypes, strides only): the ops' layout or transposed views."""
    w = fp8_weights(E, N, K, device="cuda")
    return {k: transposed(v) for k, v in w.items()} if layout == "transposed" else w


def route(backend, M, topk, w, num_global=None, quant="fp8_block"):
    return cuda_route(backend, quant, M, topk, num_global, w["w1"], w["w2"], w["w1_scale"], w["w2_scale"])


def test_auto_follows_the_stored_crossover(fake_gpu):
    with FakeTensorMode():
        w = fake_cuda_weights(8, 256, 512)
        assert route("auto", 4096, 8, w) == "triton", "no table for the device: never DeepGEMM"
        write_table(fake_gpu, section=section(None, {"E=8,N=256,K=512": 16.0}))
        crossover.load_section.cache_clear()
        assert route("auto", 15, 8, w) == "triton" and route("auto", 16, 8, w) == "deep_gemm"
        assert route("auto", 16, 8, w, num_global=16) == "triton" and route("auto", 32, 8, w, 16) == "deep_gemm"
        assert route("auto", 4096, 8, fake_cuda_weights(8, 256, 512, "transposed")) == "triton", "not applicable"
        assert route("auto", 4096, 8, fake_cuda_weights(4, 256, 512)) == "triton", "no entry, null default"
        assert route("triton", 4096, 8, w) == "triton" and route("torch", 1, 8, w) == "torch"
        assert route("deep_gemm", 1, 8, w) == "deep_gemm"
        write_table(fake_gpu, section=section(2.0))
        crossover.load_section.cache_clear()
        assert route("auto", 1, 8, fake_cuda_weights(4, 256, 512)) == "deep_gemm", "the default: 2 rows per expert"
        assert route("auto", 1, 8, fake_cuda_weights(8, 256, 512)) == "triton"
        assert route("auto", 1000, 8, fake_cuda_weights(2, 333, 1024)) == "triton", "N outside the rule"
        assert route("auto", 1000, 8, fake_cuda_weights(2, 256, 512), quant="none") == "triton"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deep_gemm, "_load", lambda: (None, "not here"))
        with FakeTensorMode():
            assert route("auto", 1000, 8, fake_cuda_weights(2, 256, 512)) == "triton", "DeepGEMM unavailable"


# ------------------------------------------------------------------------------------------------ deep_gemm errors


def call_op(w, M=4, topk=2, quant="fp8_block", device="cpu", backend="deep_gemm", op="fused_experts"):
    E, K = w["w1"].shape[0], w["w1"].shape[2]
    x = torch.zeros(M, K, dtype=torch.bfloat16, device=device)
    scales = dict(w1_scale=w["w1_scale"], w2_scale=w["w2_scale"]) if quant != "none" else {}
    if op == "fused_moe":
        return torch.ops.moe_ext.fused_moe(x, w["w1"], w["w2"], torch.zeros(M, E, device=device), topk, True,
                                           quant=quant, backend=backend, **scales)
    g = torch.ones(M, topk, device=device)
    ids = torch.zeros(M, topk, dtype=torch.int32, device=device)
    return torch.ops.moe_ext.fused_experts(x, w["w1"], w["w2"], g, ids, quant=quant, backend=backend, **scales)


@pytest.mark.parametrize("op", ["fused_experts", "fused_moe"])
def test_deep_gemm_backend_errors(monkeypatch, op):
    with pytest.raises(ValueError, match=f"{op}: backend='deep_gemm' needs CUDA tensors, got hidden_states on cpu"):
        call_op(fp8_weights(), op=op)
    monkeypatch.setattr(deep_gemm, "_load", lambda: (None, "cannot import deep_gemm (test)"))
    monkeypatch.setattr(deep_gemm, "alignment", lambda: 128)
    with FakeTensorMode():  # CUDA tensors without a GPU: the fake runs the same checks
        dense = {"w1": torch.zeros(2, 512, 256, dtype=torch.bfloat16, device="cuda"),
                 "w2": torch.zeros(2, 256, 256, dtype=torch.bfloat16, device="cuda")}
        with pytest.raises(ValueError, match=r"backend='deep_gemm' supports quant in \('fp8_block',\), got "
                                             "quant='none'"):
            call_op(dense, quant="none", device="cuda", op=op)
        with pytest.raises(RuntimeError, match=f"{op}: backend='deep_gemm' needs DeepGEMM, which is not available "
                                               r"here: cannot import deep_gemm \(test\)"):
            call_op(fp8_weights(device="cuda"), device="cuda", op=op)
    monkeypatch.setattr(deep_gemm, "_load", lambda: (SimpleNamespace(), None))
    with FakeTensorMode():
        bad = {**fp8_weights(N=320, device="cuda")}
        bad["w1"] = transposed(bad["w1"])
        with pytest.raises(ValueError, match=r"backend='deep_gemm' does not apply to these weights: N = 320 must be "
                                             r"a multiple of 128 .*; w1 must be contiguous \[E, 2N, K\]"):
            call_op(bad, device="cuda", op=op)
        out = call_op(fp8_weights(device="cuda"), M=5, device="cuda", op=op)
        assert out.shape == (5, 256) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


# ------------------------------------------------------------------------------------------------ the class


def held(w):
    """The class's view of op-layout weights: ``[E, in, out]`` transposed views."""
    return {k: v.transpose(1, 2) for k, v in w.items() if v is not None and v.dim() == 3}


def test_class_backend_argument():
    h = held(random_experts(3, 128, 128, "fp8_block"))
    experts = TritonOrDeepGemmExperts(h["w1"], h["w2"], w1_scale=h["w1_scale"], w2_scale=h["w2_scale"],
                                      backend="deep_gemm")
    assert experts.backend == "deep_gemm"
    x, (g, ids) = torch.randn(4, 128), random_routing(4, 3, 2)
    assert not experts.uses_deep_gemm(x, ids) and experts.workspace_shapes(4, 128, 128, 2, 3) == {"output": (4, 128)}
    with pytest.raises(ValueError, match="backend='deep_gemm' needs CUDA tensors"):
        experts.apply(x, g, ids)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton', 'triton_kernels', "
                                         r"'deep_gemm'\), got 'cutlass'"):
        TritonOrDeepGemmExperts(h["w1"], h["w2"], w1_scale=h["w1_scale"], w2_scale=h["w2_scale"], backend="cutlass")
    with pytest.raises(ValueError, match="backend='deep_gemm' and allow_deep_gemm=False contradict"):
        TritonOrDeepGemmExperts(h["w1"], h["w2"], w1_scale=h["w1_scale"], w2_scale=h["w2_scale"],
                                backend="deep_gemm", allow_deep_gemm=False)


def test_prepare_deep_gemm_layout():
    w = random_experts(2, 128, 256, "fp8_block")["w1"]
    view = w.transpose(1, 2)  # [E, in, out] view of the ops' contiguous layout: kept
    assert prepare_deep_gemm_layout(view) is view
    storage = view.contiguous()  # [E, in, out] storage: copied once into the ops' layout, same view
    prepared = prepare_deep_gemm_layout(storage)
    assert prepared.shape == storage.shape and prepared.transpose(1, 2).is_contiguous()
    assert torch.equal(prepared.view(torch.uint8), storage.view(torch.uint8))


@pytest.mark.parametrize("backend, table, want", [
    ("auto", None, (False, False)),  # no crossover for the device: the Triton kernels, weights left as they are
    ("auto", 16.0, (True, True)),
    ("deep_gemm", None, (True, True)),
    ("triton", 16.0, (False, False)),
])
def test_class_prepares_the_layout_where_deep_gemm_may_run(fake_gpu, backend, table, want):
    """FakeTensorMode CUDA weights held as contiguous [E, in, out] storage: copied into the ops' layout at
    construction exactly when a call may take the DeepGEMM route; the class reports the op's route."""
    if table is not None:
        write_table(fake_gpu, section=section(None, {"E=8,N=256,K=512": table}))
    with FakeTensorMode():
        w = {k: v.transpose(1, 2).clone(memory_format=torch.contiguous_format)
             for k, v in fp8_weights(8, 256, 512, device="cuda").items()}
        experts = TritonOrDeepGemmExperts(w["w1"], w["w2"], w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                                          backend=backend)
        prepared = all(getattr(experts, k).transpose(1, 2).is_contiguous() for k in w)
        x, ids = torch.empty(64, 512, device="cuda"), torch.empty(64, 8, dtype=torch.int32, device="cuda")
        assert (prepared, experts.uses_deep_gemm(x, ids)) == want
        shapes = experts.workspace_shapes(64, 256, 512, 8, 8)
        assert ("h" in shapes) == want[1] and shapes["output"] == (64, 512)
        if want[1] and backend == "auto":
            few = torch.empty(15, 512, device="cuda"), torch.empty(15, 8, dtype=torch.int32, device="cuda")
            assert not experts.uses_deep_gemm(*few), "below the crossover"


# ------------------------------------------------------------------------------------------------ GPU

MS = (1, 3, 77, 1000, 4096)
SHAPES = ((7168, 2048, 16, 8), (2048, 1408, 64, 6))  # (K, N, E, topk): DeepSeek-V3's experts (16 of them), V2-Lite
ACTS = ("silu", "swigluoai", "gelu", "swiglustep", "gelu_tanh")


def gpu_cases() -> list[dict]:
    """Both shapes at every M; flags cycling so each is on and off for each shape."""
    cases = []
    for s, (K, N, E, topk) in enumerate(SHAPES):
        for i, M in enumerate(MS):
            cases.append(dict(K=K, N=N, E=E, topk=topk, M=M, act=ACTS[(i + s) % 5], emap=i % 2 == 0,
                              invalid=i != 2, on_input=(i + s) % 3 == 1, bias=(i + s) % 2 == 1,
                              dtype=torch.float16 if (i, s) == (3, 1) else torch.bfloat16, seed=10 * s + i))
    return cases


@functools.lru_cache(maxsize=2)
def gpu_weights(K, N, E):
    """fp8 block weights of normal / sqrt(cols) values in the ops' contiguous layout, fp32 biases; on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(K + N)

    def stack(rows, cols):
        parts = [quantize_fp8_block(torch.randn(min(8, E - lo), rows, cols, device="cuda", generator=gen)
                                    / cols**0.5) for lo in range(0, E, 8)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    (w1, s1), (w2, s2) = stack(2 * N, K), stack(K, N)
    b1 = torch.randn(E, 2 * N, device="cuda", generator=gen) * 0.3
    b2 = torch.randn(E, K, device="cuda", generator=gen) * 0.3
    return dict(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, w1_bias=b1, w2_bias=b2)


def gpu_inputs(M, K, E_ids, topk, invalid, gen, dtype=torch.bfloat16):
    from tests.test_fused_experts_cuda import _routing

    g, ids = _routing(M, E_ids, topk, invalid, gen)
    return torch.randn(M, K, device="cuda", dtype=dtype, generator=gen), g, ids


def op_call(w, x, g, ids, act="silu", backend="auto", bias=True, emap=None, on_input=False):
    bias_kw = dict(w1_bias=w["w1_bias"], w2_bias=w["w2_bias"]) if bias else {}
    return torch.ops.moe_ext.fused_experts(x, w["w1"], w["w2"], g, ids, act, expert_map=emap,
                                           apply_router_weight_on_input=on_input, quant="fp8_block",
                                           w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], backend=backend, **bias_kw)


def _needs_deep_gemm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not deep_gemm.is_available():
        pytest.skip(f"deep_gemm not usable: {deep_gemm.unavailable_reason()}")


@pytest.mark.cuda
@pytest.mark.parametrize("c", gpu_cases(), ids=lambda c: f"K{c['K']}-N{c['N']}-M{c['M']}-{c['act']}")
def test_route_matches_pytorch_and_triton(c):
    _needs_deep_gemm()
    w = gpu_weights(c["K"], c["N"], c["E"])
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    emap = random_expert_map(c["E"] + 4, c["E"], device="cuda") if c["emap"] else None
    x, g, ids = gpu_inputs(c["M"], c["K"], c["E"] + 4 if c["emap"] else c["E"], c["topk"], c["invalid"], gen,
                           c["dtype"])
    kw = dict(act=c["act"], bias=c["bias"], emap=emap, on_input=c["on_input"])
    out = op_call(w, x, g, ids, backend="deep_gemm", **kw)
    assert out.dtype == c["dtype"] and out.shape == x.shape
    ref = route_reference(x, w, g, ids, c["act"], emap, c["on_input"], c["bias"])
    assert rel_err(out, ref) <= TOL, "DeepGEMM route vs its arithmetic in PyTorch"
    torch_out = op_call(w, x, g, ids, backend="torch", **kw)
    assert rel_err(out, torch_out) <= CROSS_TOL, "DeepGEMM route vs the PyTorch implementation"
    assert rel_err(out, op_call(w, x, g, ids, backend="triton", **kw)) <= CROSS_TOL, "vs our Triton kernels"


@pytest.mark.cuda
@pytest.mark.parametrize("M", [5, 600])
def test_route_with_ue8m0_scales_on_gpu(M):
    """UE8M0 byte scales through DeepGEMM: within TOL of the route's arithmetic with power-of-two activation
    scales, within CROSS_TOL of our Triton kernels on the same bytes."""
    _needs_deep_gemm()
    w = dict(gpu_weights(2048, 1408, 16))
    w["w1_scale"], w["w2_scale"] = ue8m0_scales(w["w1_scale"]), ue8m0_scales(w["w2_scale"])
    gen = torch.Generator(device="cuda").manual_seed(M)
    x, g, ids = gpu_inputs(M, 2048, 16, 6, True, gen)
    out = op_call(w, x, g, ids, backend="deep_gemm")
    assert rel_err(out, route_reference(x, w, g, ids, "silu", ue8m0=True)) <= TOL
    assert rel_err(out, op_call(w, x, g, ids, backend="triton")) <= CROSS_TOL


@pytest.fixture
def crossover_everywhere(monkeypatch):
    """A stored crossover of 0 rows per expert for the current GPU: "auto" takes DeepGEMM wherever it applies."""
    monkeypatch.setattr(crossover, "load_section",
                        lambda name: {"fp8_block": {"deep_gemm": {"min_rows_per_expert": 0.0}}})


@pytest.mark.cuda
def test_outside_the_rule_auto_falls_back(crossover_everywhere):
    _needs_deep_gemm()
    gen = torch.Generator(device="cuda").manual_seed(5)
    (q1, s1), (q2, s2) = (quantize_fp8_block(torch.randn(8, r, c, device="cuda", generator=gen) / c**0.5)
                          for r, c in ((666, 1000), (1000, 333)))
    odd = dict(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2, w1_bias=None, w2_bias=None)
    w = gpu_weights(2048, 1408, 64)
    flipped = {**w, **{k: transposed(w[k]) for k in ("w1", "w2", "w1_scale", "w2_scale")}}
    for weights, K, E, rule in ((odd, 1000, 8, r"N = 333 must be a multiple of 128.*K = 1000"),
                                (flipped, 2048, 64, r"w1 must be contiguous \[E, 2N, K\]")):
        for M in (3, 300):
            x, g, ids = gpu_inputs(M, K, E, 2, True, gen)
            auto = op_call(weights, x, g, ids, bias=False)
            assert torch.equal(auto, op_call(weights, x, g, ids, backend="triton", bias=False))
            with pytest.raises(ValueError, match=rule):
                op_call(weights, x, g, ids, backend="deep_gemm", bias=False)


@pytest.mark.cuda
def test_auto_switches_at_the_stored_crossover(monkeypatch):
    _needs_deep_gemm()
    E, topk, K, N = 64, 6, 2048, 1408
    w = gpu_weights(K, N, E)
    monkeypatch.setattr(crossover, "load_section", lambda name: {"fp8_block": {"deep_gemm": {
        "min_rows_per_expert": None, "shapes": {crossover.shape_key(E, N, K): {"min_rows_per_expert": 24.0}}}}})
    gen = torch.Generator(device="cuda").manual_seed(9)
    for M, want in ((255, "triton"), (256, "deep_gemm"), (1000, "deep_gemm")):
        x, g, ids = gpu_inputs(M, K, E, topk, True, gen)
        assert cuda_route("auto", "fp8_block", M, topk, None, w["w1"], w["w2"], w["w1_scale"], w["w2_scale"]) == want
        assert torch.equal(op_call(w, x, g, ids), op_call(w, x, g, ids, backend=want))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["deep_gemm", "triton", "class"])
@pytest.mark.parametrize("M", [1, 77, 1000])
def test_cuda_graph_replays_match_eager(backend, M):
    _needs_deep_gemm()
    E, topk, K, N = 64, 6, 2048, 1408
    w = gpu_weights(K, N, E)
    emap = random_expert_map(E + 4, E, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(M)
    if backend == "class":  # the class holds [E, in, out] views of the ops' layout: nothing to prepare
        h = held({k: w[k] for k in ("w1", "w2", "w1_scale", "w2_scale")})
        experts = TritonOrDeepGemmExperts(h.pop("w1"), h.pop("w2"), **h, w1_bias=w["w1_bias"], w2_bias=w["w2_bias"],
                                          backend="deep_gemm")

    def call(inputs):
        x, g, ids = inputs
        if backend == "class":
            return experts.apply(x, g, ids, emap)
        return op_call(w, x, g, ids, backend=backend, emap=emap)

    def make():
        return gpu_inputs(M, K, E + 4, topk, True, gen)

    assert_graph_replays_match_eager(call, make(), make)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["deep_gemm", "auto"])
def test_compile_dynamic_one_graph(monkeypatch, backend):
    """One graph for M from 2 to 4096; with "auto" the stored crossover (24 rows per expert) switches the route
    inside the opaque op without a recompile."""
    _needs_deep_gemm()
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    E, topk, K, N = 64, 6, 2048, 1408
    w = gpu_weights(K, N, E)
    monkeypatch.setattr(crossover, "load_section",
                        lambda name: {"fp8_block": {"deep_gemm": {"min_rows_per_expert": 24.0}}})

    def layer(x, g, ids):
        return op_call(w, x, g, ids, backend=backend) * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (2, 3, 77, 255, 256, 1000, 4096):
            x, g, ids = gpu_inputs(M, K, E, topk, True, gen)
            assert torch.equal(compiled(x, g, ids), layer(x, g, ids))
    assert counter.frame_count == 1
