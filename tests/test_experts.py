"""Tests of moe_extension.experts: each class against the independent fp64 reference (tests/reference.py),
the unfused path against the modular one, LoRA against a hand-written fp64 loop, TritonOrDeepGemmExperts'
DeepGEMM route through the op (on a GPU when deep_gemm is importable; the route itself is
tests/test_backend_deep_gemm.py), workspace shapes, problem sizes, the no-copy weight views, capability answers
and bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_extension.backends import deep_gemm
from moe_extension.experts import (
    LoRAWeights,
    OAITritonExperts,
    OAITritonMxfp4ExpertsMonolithic,
    TritonOrDeepGemmExperts,
    UnfusedOAITritonExperts,
    moe_problem_size,
    prepare_held_mxfp4_mma,
)
from moe_extension.experts.base import resize_workspace
from moe_extension.backends.deep_gemm import contiguous_layout, permuted_rows
from moe_extension.quant import quantize_fp8_block, quantize_mxfp4
from tests.reference import activation_reference, fused_experts_reference, topk_softmax_reference
from tests.utils import poison, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
MODULAR = (OAITritonExperts, UnfusedOAITritonExperts)


# ------------------------------------------------------------------------------------------------ inputs


def make_weights(E, N, K, quant="none", dtype=torch.float32, bias=False, seed=0, device="cpu"):
    """Op-layout weights (``w1 [E, 2N, K]``, ``w2 [E, K, N]``, scales, fp32 biases) as a dict."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * N, K, generator=g) * K**-0.5
    w2 = torch.randn(E, K, N, generator=g) * N**-0.5
    if quant == "none":
        op = {"w1": w1.to(dtype), "w2": w2.to(dtype), "w1_scale": None, "w2_scale": None}
    else:
        quantize = quantize_fp8_block if quant == "fp8_block" else quantize_mxfp4
        (q1, s1), (q2, s2) = quantize(w1), quantize(w2)
        op = {"w1": q1, "w2": q2, "w1_scale": s1, "w2_scale": s2}
    op["w1_bias"] = torch.randn(E, 2 * N, generator=g) * 0.3 if bias else None
    op["w2_bias"] = torch.randn(E, K, generator=g) * 0.3 if bias else None
    return {k: None if v is None else v.to(device) for k, v in op.items()}


def held(op):
    """What the classes hold: ``[E, in, out]`` transposed views of the op-layout tensors (no copy)."""
    t = lambda v: None if v is None else v.transpose(1, 2)  # noqa: E731
    return {"w1": t(op["w1"]), "w2": t(op["w2"]), "w1_scale": t(op["w1_scale"]), "w2_scale": t(op["w2_scale"]),
            "w1_bias": op["w1_bias"], "w2_bias": op["w2_bias"]}


def build(cls, op, quant="none", **kwargs):
    h = held(op)
    w1, w2 = h.pop("w1"), h.pop("w2")
    if cls is TritonOrDeepGemmExperts:
        return cls(w1, w2, **h, **kwargs)
    return cls(w1, w2, quant=quant, **h, **kwargs)


def make_routing(M, topk, E, seed=0, with_map=False, invalid=True, device="cpu"):
    """(x-independent) ``topk_weights fp32``, ``topk_ids int32`` with invalid slots, optional expert_map."""
    g = torch.Generator().manual_seed(seed + 1000)
    e_global = E + 3 if with_map else E
    ids = torch.randint(0, e_global, (M, topk), generator=g, dtype=torch.int32)
    if invalid and M * topk > 2:
        ids.view(-1)[1] = -1
        ids.view(-1)[-1] = 2**31 - 1
    weights = torch.rand(M, topk, generator=g)
    expert_map = None
    if with_map:
        expert_map = torch.full((e_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(e_global, generator=g)[:E]] = torch.arange(E, dtype=torch.int32)
        expert_map = expert_map.to(device)
    return weights.to(device), ids.to(device), expert_map


def make_x(M, K, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed + 2000)
    return torch.randn(M, K, generator=g).to(dtype).to(device)


def check_close(out, op, x, weights, ids, activation, quant, expert_map=None, on_input=False, tol=1e-5):
    ref, bound = fused_experts_reference(
        x.cpu(), op["w1"].cpu(), op["w2"].cpu(), weights.cpu(), ids.cpu(), activation,
        w1_bias=None if op["w1_bias"] is None else op["w1_bias"].cpu(),
        w2_bias=None if op["w2_bias"] is None else op["w2_bias"].cpu(),
        expert_map=None if expert_map is None else expert_map.cpu(), apply_router_weight_on_input=on_input,
        quant=quant, w1_scale=None if op["w1_scale"] is None else op["w1_scale"].cpu(),
        w2_scale=None if op["w2_scale"] is None else op["w2_scale"].cpu(), return_bound=True,
    )
    err = rel_err(out.cpu(), ref)
    allowed = tol + (bound.norm() / ref.norm()).item()
    assert err <= allowed, f"rel err {err:.3e} > {allowed:.3e}"
    return ref


# ------------------------------------------------------------------------------------------------ correctness

# (activation, quant, dtype, bias, expert_map, apply_router_weight_on_input, topk)
CASES = [
    ("silu", "none", torch.float32, False, False, False, 2),
    ("gelu", "none", torch.float16, True, True, False, 1),
    ("gelu_tanh", "none", torch.bfloat16, False, False, True, 6),
    ("swigluoai", "none", torch.float32, True, True, True, 8),
    ("swiglustep", "none", torch.float32, True, False, False, 3),
    ("swigluoai", "mxfp4", torch.bfloat16, True, False, False, 4),
    ("silu", "mxfp4", torch.float32, False, True, True, 2),
]


@pytest.mark.parametrize("cls", MODULAR, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).removeprefix("torch.") for v in c))
def test_modular_classes_match_reference(cls, case):
    activation, quant, dtype, bias, with_map, on_input, topk = case
    E, N, K, M = 7, 96, 64, 9
    op = make_weights(E, N, K, quant, dtype, bias, seed=topk)
    weights, ids, expert_map = make_routing(M, topk, E, seed=topk, with_map=with_map)
    x = make_x(M, K, dtype, seed=topk)
    experts = build(cls, op, quant, activation=activation)
    out = experts.apply(x, weights, ids, expert_map, on_input)
    assert out.shape == (M, K) and out.dtype == dtype
    check_close(out, op, x, weights, ids, activation, quant, expert_map, on_input, TOL[dtype])


def test_unfused_equals_modular():
    E, N, K, M, topk = 6, 80, 48, 11, 4
    op = make_weights(E, N, K, bias=True, seed=3)
    weights, ids, expert_map = make_routing(M, topk, E, seed=3, with_map=True)
    x = make_x(M, K, seed=3)
    for on_input in (False, True):
        fused = build(OAITritonExperts, op, activation="swigluoai").apply(x, weights, ids, expert_map, on_input)
        unfused = build(UnfusedOAITritonExperts, op, activation="swigluoai").apply(x, weights, ids, expert_map, on_input)
        assert rel_err(unfused, fused) < 1e-6


def test_zero_tokens():
    op = make_weights(4, 32, 64)
    weights, ids, _ = make_routing(0, 2, 4, invalid=False)
    for cls in MODULAR:
        out = build(cls, op, activation="silu").apply(make_x(0, 64), weights, ids)
        assert out.shape == (0, 64)


@pytest.mark.parametrize("quant", ["none", "mxfp4"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_monolithic_matches_reference(quant, renormalize):
    E, N, K, M, topk = 8, 64, 96, 7, 3
    dtype = torch.bfloat16 if quant == "mxfp4" else torch.float32
    op = make_weights(E, N, K, quant, dtype, bias=True, seed=5)
    with_map = renormalize  # one of the two runs with an expert_map
    _, _, expert_map = make_routing(M, topk, E, seed=5, with_map=with_map)
    e_global = E if expert_map is None else expert_map.numel()
    logits = torch.randn(M, e_global, generator=torch.Generator().manual_seed(9))
    x = make_x(M, K, dtype, seed=5)
    experts = build(OAITritonMxfp4ExpertsMonolithic, op, quant)
    out = poison(torch.empty(M, K, dtype=dtype))
    result = experts.apply(x, logits, topk, renormalize, expert_map, output=out)
    assert result is out
    ref_weights, ref_ids = topk_softmax_reference(logits, topk, renormalize)
    check_close(out, op, x, ref_weights.float(), ref_ids, "swigluoai", quant, expert_map, tol=TOL[dtype])


@pytest.mark.parametrize("on_input", [False, True])
def test_triton_or_deep_gemm_fallback_matches_reference(on_input):
    E, N, K, M, topk = 5, 96, 160, 8, 3  # partial 128-blocks on both weights
    op = make_weights(E, N, K, "fp8_block", bias=True, seed=7)
    weights, ids, expert_map = make_routing(M, topk, E, seed=7, with_map=on_input)
    x = make_x(M, K, seed=7)
    experts = build(TritonOrDeepGemmExperts, op)
    assert not experts.uses_deep_gemm(x, ids, expert_map)
    out = experts.apply(x, weights, ids, expert_map, on_input)
    check_close(out, op, x, weights, ids, "silu", "fp8_block", expert_map, on_input, tol=1e-5)


# ------------------------------------------------------------------------------------------------ DeepGEMM route


@pytest.mark.parametrize("align", [8, 16])
def test_contiguous_layout(align):
    M, topk, E = 13, 3, 5
    _, ids, expert_map = make_routing(M, topk, E, seed=align, with_map=True)
    dest, m_indices, local, valid = contiguous_layout(ids, expert_map, E, align)
    S, R = M * topk, permuted_rows(M * topk, E, align)
    assert m_indices.shape == (R,) and m_indices.dtype == torch.int32 and dest.shape == (S,)
    trash = R - align
    assert (dest[~valid] == trash).all() and (m_indices[trash:] == -1).all()
    assert dest[valid].unique().numel() == int(valid.sum())  # one row per valid slot
    assert (m_indices[dest[valid]].long() == local[valid]).all()  # each slot lands in its expert's segment
    # segments: contiguous runs of one expert, starting at multiples of align, in expert order
    labels = m_indices.tolist()
    for e in range(E):
        rows = [r for r, v in enumerate(labels) if v == e]
        count = int((local[valid] == e).sum())
        assert len(rows) == -(-count // align) * align
        if rows:
            assert rows[0] % align == 0 and rows == list(range(rows[0], rows[0] + len(rows)))
    assert valid.tolist() == [
        0 <= i < expert_map.numel() and expert_map[i] >= 0 for i in ids.view(-1).tolist()
    ]


@pytest.mark.cuda
def test_deep_gemm_route_on_gpu():
    if not deep_gemm.is_available():
        pytest.skip(f"deep_gemm not usable here: {deep_gemm.unavailable_reason()}")
    E, N, K, M, topk = 8, 256, 512, 192, 4
    op = make_weights(E, N, K, "fp8_block", bias=True, seed=13, device="cuda")
    weights, ids, expert_map = make_routing(M, topk, E, seed=13, with_map=True, device="cuda")
    x = make_x(M, K, torch.bfloat16, seed=13, device="cuda")
    experts = build(TritonOrDeepGemmExperts, op, backend="deep_gemm")
    assert experts.uses_deep_gemm(x, ids, expert_map)
    out = experts.apply(x, weights, ids, expert_map)
    check_close(out, op, x, weights, ids, "silu", "fp8_block", expert_map, tol=3e-2)
    fallback = build(TritonOrDeepGemmExperts, op, allow_deep_gemm=False)
    assert not fallback.uses_deep_gemm(x, ids, expert_map)
    assert rel_err(out, fallback.apply(x, weights, ids, expert_map)) < 3e-2


# ------------------------------------------------------------------------------------------------ LoRA


def make_lora(L, E, N, K, r=4, r2=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 3000)
    t = lambda *s: (torch.randn(*s, generator=g) * 0.2).to(dtype)  # noqa: E731
    return LoRAWeights(a13=t(L, E, r, K), b13=t(L, E, 2 * N, r), a2=t(L, E, r2, N), b2=t(L, E, K, r2))


def lora_reference(op, lora, x, weights, ids, mapping, activation, expert_map=None, on_input=False):
    """fp64 per (token, slot) loop of the LoRA math in the docstring of moe_extension/experts/unfused.py, quant none."""
    M, K = x.shape
    E = op["w1"].shape[0]
    out = torch.zeros(M, K, dtype=torch.float64)
    d = lambda t: t.double()  # noqa: E731
    for t in range(M):
        for j in range(ids.shape[1]):
            i = int(ids[t, j])
            if expert_map is not None:
                i = int(expert_map[i]) if 0 <= i < expert_map.numel() else -1
            if not 0 <= i < E:
                continue
            g = float(weights[t, j])
            xin = d(x[t]) * (g if on_input else 1.0)
            h = d(op["w1"][i]) @ xin
            if op["w1_bias"] is not None:
                h = h + d(op["w1_bias"][i])
            l = int(mapping[t])
            has = 0 <= l < lora.num_adapters
            if has:
                h = h + d(lora.b13[l, i]) @ (d(lora.a13[l, i]) @ xin)
            a = activation_reference(h, activation)
            y = d(op["w2"][i]) @ a
            if op["w2_bias"] is not None:
                y = y + d(op["w2_bias"][i])
            if has:
                y = y + d(lora.b2[l, i]) @ (d(lora.a2[l, i]) @ a)
            out[t] += y if on_input else g * y
    return out


@pytest.mark.parametrize("activation,with_map,on_input", [("swigluoai", False, False), ("silu", True, True)])
def test_lora_matches_fp64_reference(activation, with_map, on_input):
    E, N, K, M, topk, L = 5, 48, 64, 10, 3, 3
    op = make_weights(E, N, K, bias=True, seed=21)
    lora = make_lora(L, E, N, K, seed=21)
    weights, ids, expert_map = make_routing(M, topk, E, seed=21, with_map=with_map)
    x = make_x(M, K, seed=21)
    mapping = torch.tensor([0, 1, 2, -1, 1, 0, 7, 2, -1, 1], dtype=torch.int32)  # 7: out of range = none
    experts = build(UnfusedOAITritonExperts, op, activation=activation, lora=lora)
    out = experts.apply(x, weights, ids, expert_map, on_input, token_lora_mapping=mapping)
    ref = lora_reference(op, lora, x, weights, ids, mapping, activation, expert_map, on_input)
    assert rel_err(out, ref) < 1e-5
    base = experts.apply(x, weights, ids, expert_map, on_input)
    assert rel_err(base, ref) > 1e-2  # the adapters do change the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_tokens_without_adapter_get_exactly_base(dtype):
    E, N, K, M, topk, L = 4, 32, 64, 8, 2, 2
    op = make_weights(E, N, K, dtype=dtype, bias=True, seed=23)
    lora = make_lora(L, E, N, K, seed=23, dtype=dtype)
    weights, ids, _ = make_routing(M, topk, E, seed=23)
    x = make_x(M, K, dtype, seed=23)
    experts = build(UnfusedOAITritonExperts, op, activation="swigluoai", lora=lora)
    base = experts.apply(x, weights, ids)
    none = experts.apply(x, weights, ids, token_lora_mapping=torch.full((M,), -1, dtype=torch.int32))
    assert torch.equal(none, base)
    mapping = torch.tensor([-1, 0, 1, -1, -1, 1, 0, -1], dtype=torch.int64)
    mixed = experts.apply(x, weights, ids, token_lora_mapping=mapping)
    without = mapping < 0
    assert torch.equal(mixed[without], base[without])
    assert not torch.equal(mixed[~without], base[~without])
    detached = build(UnfusedOAITritonExperts, op, activation="swigluoai")
    assert torch.equal(detached.apply(x, weights, ids), base)


def _mark_tokens_dynamic(*tensors):
    # Only the token count varies (dynamic=True would also make the held weights' sizes symbolic).
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


def test_lora_compiles_without_recompiles():
    E, N, K, L = 4, 32, 64, 2
    op = make_weights(E, N, K, bias=True, seed=25)
    experts = build(UnfusedOAITritonExperts, op, activation="swigluoai", lora=make_lora(L, E, N, K, seed=25))

    def run(x, weights, ids, mapping):
        return experts.apply(x, weights, ids, token_lora_mapping=mapping)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (3, 5, 17):
            weights, ids, _ = make_routing(M, 2, E, seed=M)
            x = make_x(M, K, seed=M)
            mapping = torch.arange(M, dtype=torch.int32) % (L + 1) - 1
            _mark_tokens_dynamic(x, weights, ids, mapping)
            assert torch.allclose(compiled(x, weights, ids, mapping), run(x, weights, ids, mapping), atol=1e-6)


@pytest.mark.parametrize("cls", [OAITritonExperts, OAITritonMxfp4ExpertsMonolithic], ids=lambda c: c.__name__)
def test_compiles_without_recompiles(cls):
    E, N, K, topk = 4, 32, 64, 2
    experts = build(cls, make_weights(E, N, K, bias=True, seed=27), activation="swigluoai")
    if cls is OAITritonExperts:
        run = lambda x, w, ids, logits: experts.apply(x, w, ids)  # noqa: E731
    else:
        run = lambda x, w, ids, logits: experts.apply(x, logits, topk, True)  # noqa: E731
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (3, 5, 17):
            weights, ids, _ = make_routing(M, topk, E, seed=M)
            x, logits = make_x(M, K, seed=M), torch.randn(M, E)
            _mark_tokens_dynamic(x, weights, ids, logits)
            assert torch.allclose(compiled(x, weights, ids, logits), run(x, weights, ids, logits), atol=1e-6)


# ------------------------------------------------------------------------------------------------ sizes


def test_workspace_shapes():
    M, N, K, topk, E = 5, 48, 64, 3, 4
    op = make_weights(E, N, K)
    assert build(OAITritonExperts, op).workspace_shapes(M, N, K, topk, E) == {"output": (M, K)}
    assert build(OAITritonMxfp4ExpertsMonolithic, op).workspace_shapes(M, N, K, topk, E) == {"output": (M, K)}
    assert build(UnfusedOAITritonExperts, op).workspace_shapes(M, N, K, topk, E) == {
        "h": (M * topk, 2 * N), "a": (M * topk, N), "y": (M, topk, K), "output": (M, K)}
    fp8 = build(TritonOrDeepGemmExperts, make_weights(E, 128, 256, "fp8_block"))
    assert fp8.workspace_shapes(200, 128, 256, topk, E) == {"output": (200, 256)}  # CPU weights: PyTorch
    routes = []
    fp8._route = lambda M, topk, num_global: routes.append((M, topk, num_global)) or "deep_gemm"  # as on a GPU
    align = deep_gemm.alignment()
    R = permuted_rows(200 * topk, E, align)
    assert R % align == 0 and R >= 200 * topk + E * (align - 1) + align
    assert fp8.workspace_shapes(200, 128, 256, topk, E) == {
        "h": (R, 256), "a": (R, 128), "y": (R, 256), "output": (200, 256)}
    assert routes == [(200, topk, None)]
    ws = build(UnfusedOAITritonExperts, op).make_workspace(M, topk, torch.float16)
    assert {k: tuple(v.shape) for k, v in ws.items()} == {
        "h": (M * topk, 2 * N), "a": (M * topk, N), "y": (M, topk, K), "output": (M, K)}
    assert all(v.dtype == torch.float16 for v in ws.values())


def test_unfused_uses_the_workspace():
    E, N, K, M, topk = 4, 48, 64, 5, 3
    experts = build(UnfusedOAITritonExperts, make_weights(E, N, K, seed=29), activation="gelu")
    weights, ids, _ = make_routing(M, topk, E, seed=29)
    x = make_x(M, K, seed=29)
    expected = experts.apply(x, weights, ids)
    big = {"a": poison(torch.empty(10_000)), "output": poison(torch.empty(1_000))}  # sized for a larger M
    out = experts.apply(x, weights, ids, workspace=big)
    assert out.data_ptr() == big["output"].data_ptr() and out.shape == (M, K)
    assert torch.equal(out, expected)
    assert torch.isfinite(big["a"][: M * topk * N]).all() and big["a"][M * topk * N:].isnan().all()
    with pytest.raises(ValueError, match="at least 720 elements"):
        experts.apply(x, weights, ids, workspace={"a": torch.empty(100)})


def test_resize_workspace():
    buf = torch.arange(24.0)
    view = resize_workspace(buf, (2, 3, 4))
    assert view.shape == (2, 3, 4) and view.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="contiguous with at least 30 elements"):
        resize_workspace(buf, (5, 6))
    with pytest.raises(ValueError, match="contiguous"):
        resize_workspace(buf.view(4, 6).t(), (2, 2))


@pytest.mark.parametrize("quant", ["none", "fp8_block", "mxfp4"])
def test_moe_problem_size(quant):
    E, N, K, M, topk = 3, 96, 64, 7, 2
    h = held(make_weights(E, N, K, quant))
    x, ids = make_x(M, K), torch.zeros(M, topk, dtype=torch.int32)
    assert moe_problem_size(x, h["w1"], h["w2"], ids) == (E, M, N, K, topk)
    cls = TritonOrDeepGemmExperts if quant == "fp8_block" else OAITritonExperts
    experts = build(cls, make_weights(E, N, K, quant), quant)
    assert experts.moe_problem_size(x, experts.w1, experts.w2, ids) == (E, M, N, K, topk)
    assert (experts.num_experts, experts.intermediate_size, experts.hidden_size) == (E, N, K)


def test_moe_problem_size_errors():
    h = held(make_weights(3, 32, 64))
    x, ids = make_x(5, 64), torch.zeros(5, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden_states must be 2-D"):
        moe_problem_size(x[None], h["w1"], h["w2"], ids)
    with pytest.raises(ValueError, match=r"K = hidden_states.size\(1\) = 63"):
        moe_problem_size(x[:, :63], h["w1"], h["w2"], ids)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[M, topk\] with M = 5"):
        moe_problem_size(x, h["w1"], h["w2"], ids[:4])
    with pytest.raises(ValueError, match="w2 must hold E = 3 experts"):
        moe_problem_size(x, h["w1"], h["w2"][:2], ids)
    with pytest.raises(ValueError, match="even last dimension"):
        moe_problem_size(x, h["w1"][..., :63], h["w2"], ids)
    with pytest.raises(TypeError, match="topk_ids must be a Tensor"):
        moe_problem_size(x, h["w1"], h["w2"], [[0, 1]])


# ------------------------------------------------------------------------------------------------ views, capabilities


class _RecordOps(TorchDispatchMode):
    """Records the tensor arguments of every moe_ext op call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "moe_ext":
            self.calls.append((func.__name__.split(".")[0], args, kwargs))
        return func(*args, **kwargs)


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_held_mxfp4_mma_layout():
    """prepare_held_mxfp4_mma: the held stacks in the tensor-core layout, as [E, in, out] views whose ops views
    are contiguous; the ops give the checkpoint layout's output bit for bit on the CPU (which undoes the layout);
    None where the layout does not take the weights."""
    E, N, K, M, topk = 3, 64, 128, 6, 2
    op = make_weights(E, N, K, "mxfp4", bias=True, seed=5)
    h = held(op)
    got = prepare_held_mxfp4_mma(h["w1"], h["w2"], h["w1_scale"], h["w2_scale"])
    for name, t in zip(("w1", "w2", "w1_scale", "w2_scale"), got):
        assert t.shape == h[name].shape and t.transpose(1, 2).is_contiguous(), name
    assert not torch.equal(got[0], h["w1"]), "the codes are reordered"
    weights, ids, _ = make_routing(M, topk, E, seed=5)
    x = make_x(M, K, torch.bfloat16)
    mma = torch.ops.moe_ext.fused_experts(x, got[0].transpose(1, 2), got[1].transpose(1, 2), weights, ids,
                                          quant="mxfp4_mma", w1_scale=got[2].transpose(1, 2),
                                          w2_scale=got[3].transpose(1, 2), w1_bias=op["w1_bias"],
                                          w2_bias=op["w2_bias"])
    ref = torch.ops.moe_ext.fused_experts(x, op["w1"], op["w2"], weights, ids, quant="mxfp4", w1_scale=op["w1_scale"],
                                          w2_scale=op["w2_scale"], w1_bias=op["w1_bias"], w2_bias=op["w2_bias"])
    assert torch.equal(mma, ref)
    narrow = held(make_weights(E, 96, K, "mxfp4"))  # N % 64 != 0
    assert prepare_held_mxfp4_mma(narrow["w1"], narrow["w2"], narrow["w1_scale"], narrow["w2_scale"]) is None
    big = h["w2_scale"].clone()
    big[1, 0, 3] = 150  # 2^23: above the layout's 2^21
    assert prepare_held_mxfp4_mma(h["w1"], h["w2"], h["w1_scale"], big) is None


@pytest.mark.parametrize("cls", [*MODULAR, OAITritonMxfp4ExpertsMonolithic, TritonOrDeepGemmExperts],
                         ids=lambda c: c.__name__)
def test_ops_get_transposed_views_not_copies(cls):
    E, N, K, M, topk = 4, 64, 128, 3, 2
    quant = "fp8_block" if cls is TritonOrDeepGemmExperts else "mxfp4"
    op = make_weights(E, N, K, quant)
    experts = build(cls, op, quant)
    for name in ("w1", "w2", "w1_scale", "w2_scale"):
        held_t, view = getattr(experts, name), experts.op_weights()[name]
        assert _storage(view) == _storage(held_t) == _storage(op[name]) and view.data_ptr() == held_t.data_ptr()
        assert view.shape == op[name].shape and view.stride() == op[name].stride()
    weights, ids, _ = make_routing(M, topk, E, seed=31)
    x = make_x(M, K, torch.bfloat16)
    with _RecordOps() as rec:
        if cls is OAITritonMxfp4ExpertsMonolithic:
            experts.apply(x, torch.randn(M, E), topk, True)
        else:
            experts.apply(x, weights, ids)
    seen = {}
    for name, args, kwargs in rec.calls:
        if name in ("fused_experts", "fused_moe"):
            seen["w1"], seen["w2"] = args[1], args[2]
            seen["w1_scale"], seen["w2_scale"] = kwargs["w1_scale"], kwargs["w2_scale"]
        elif name == "expert_gemm1":
            seen["w1"], seen["w1_scale"] = args[1], kwargs["w1_scale"]
        elif name == "expert_gemm2":
            seen["w2"], seen["w2_scale"] = args[1], kwargs["w2_scale"]
    assert set(seen) == {"w1", "w2", "w1_scale", "w2_scale"}, rec.calls
    for name, t in seen.items():
        assert t.data_ptr() == op[name].data_ptr() and t.stride() == op[name].stride(), name


def test_capabilities():
    acts = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep")
    for cls in (*MODULAR, OAITritonMxfp4ExpertsMonolithic, TritonOrDeepGemmExperts):
        assert cls.supported_devices() == ("cpu", "cuda")
        assert cls.supports_device("cpu") and cls.supports_device(torch.device("cuda", 0))
        assert not cls.supports_device("meta")
        assert cls.supports_expert_map() and cls.supports_chunking()
        assert set(cls.supported_activations()) == set(acts)
        assert all(cls.supports_activation(a) for a in acts) and not cls.supports_activation("relu")
    for cls in (OAITritonExperts, OAITritonMxfp4ExpertsMonolithic):
        assert cls.supported_quant_schemes() == ("none", "mxfp4")
        assert not cls.supports_quant_scheme("fp8_block")
    assert UnfusedOAITritonExperts.supported_quant_schemes() == ("none", "mxfp4", "fp8_block")
    assert TritonOrDeepGemmExperts.supported_quant_schemes() == ("fp8_block",)
    assert UnfusedOAITritonExperts.supports_lora()
    op = make_weights(2, 32, 64)
    assert build(OAITritonExperts, op).activation == "swigluoai"
    assert build(TritonOrDeepGemmExperts, make_weights(2, 32, 64, "fp8_block")).activation == "silu"


# ------------------------------------------------------------------------------------------------ bad arguments

_OP = make_weights(3, 32, 64)
_H = held(_OP)
_FP8 = held(make_weights(3, 32, 64, "fp8_block"))
_MX = held(make_weights(3, 32, 64, "mxfp4"))

BAD_CONSTRUCTOR = [
    (TypeError, "w1 must be a Tensor", lambda: OAITritonExperts(None, _H["w2"])),
    (ValueError, "w1 must be 3-D", lambda: OAITritonExperts(_H["w1"][0], _H["w2"])),
    (ValueError, "even last dimension", lambda: OAITritonExperts(_H["w1"][..., :63], _H["w2"])),
    (ValueError, r"w2 must have shape \[E, N, K\] = \[3, 32, 64\]", lambda: OAITritonExperts(_H["w1"], _H["w2"][:2])),
    (ValueError, r"w1 must have shape \[E, K, 2N\]", lambda: OAITritonExperts(_H["w1"][:, :60], _H["w2"])),
    (TypeError, "w2 must have the dtype of w1", lambda: OAITritonExperts(_H["w1"], _H["w2"].half())),
    (TypeError, "quant='none' needs w1 of dtype", lambda: OAITritonExperts(_H["w1"].int(), _H["w2"].int())),
    (ValueError, "quant must be one of", lambda: OAITritonExperts(_H["w1"], _H["w2"], quant="int4")),
    (ValueError, r"quant must be one of \('none', 'mxfp4'\), got 'fp8_block'",
     lambda: OAITritonExperts(_FP8["w1"], _FP8["w2"], quant="fp8_block")),
    (ValueError, "activation must be one of", lambda: OAITritonExperts(_H["w1"], _H["w2"], activation="relu")),
    (ValueError, "backend must be one of", lambda: OAITritonExperts(_H["w1"], _H["w2"], backend="cutlass")),
    (TypeError, "alpha must be a float", lambda: OAITritonExperts(_H["w1"], _H["w2"], alpha="1.7")),
    (TypeError, "limit must be a float", lambda: OAITritonExperts(_H["w1"], _H["w2"], limit=True)),
    (TypeError, "w1_bias must be fp32", lambda: OAITritonExperts(_H["w1"], _H["w2"], w1_bias=torch.zeros(3, 64).half())),
    (ValueError, r"w2_bias must have shape \[3, 64\]",
     lambda: OAITritonExperts(_H["w1"], _H["w2"], w2_bias=torch.zeros(3, 32))),
    (ValueError, "w1_scale must be None with quant='none'",
     lambda: OAITritonExperts(_H["w1"], _H["w2"], w1_scale=torch.ones(3, 1, 1))),
    (ValueError, "quant='fp8_block' needs w1_scale",
     lambda: TritonOrDeepGemmExperts(_FP8["w1"], _FP8["w2"], w1_scale=None, w2_scale=_FP8["w2_scale"])),
    (ValueError, r"w2_scale must have shape \[E, ceil\(in/128\), ceil\(out/128\)\] = \[3, 1, 1\]",
     lambda: TritonOrDeepGemmExperts(_FP8["w1"], _FP8["w2"], w1_scale=_FP8["w1_scale"], w2_scale=torch.ones(3, 2, 1))),
    (TypeError, "w2_scale must have dtype torch.float32",
     lambda: TritonOrDeepGemmExperts(_FP8["w1"], _FP8["w2"], w1_scale=_FP8["w1_scale"],
                                     w2_scale=_FP8["w2_scale"].double())),
    (TypeError, "needs w1 of dtype torch.float8_e4m3fn",
     lambda: TritonOrDeepGemmExperts(_H["w1"], _FP8["w2"], w1_scale=_FP8["w1_scale"], w2_scale=_FP8["w2_scale"])),
    (TypeError, "allow_deep_gemm must be a bool",
     lambda: TritonOrDeepGemmExperts(_FP8["w1"], _FP8["w2"], w1_scale=_FP8["w1_scale"], w2_scale=_FP8["w2_scale"],
                                     allow_deep_gemm=1)),
    (TypeError, "quant='mxfp4' needs w1 of dtype torch.uint8",
     lambda: OAITritonExperts(_MX["w1"].view(torch.int8), _MX["w2"], quant="mxfp4", w1_scale=_MX["w1_scale"],
                              w2_scale=_MX["w2_scale"])),
    (ValueError, "mxfp4 needs K divisible by 32, got K = 48",
     lambda: OAITritonExperts(_MX["w1"][:, :24], _MX["w2"][..., :48], quant="mxfp4", w1_scale=_MX["w1_scale"],
                              w2_scale=_MX["w2_scale"])),
    (ValueError, r"w1_scale must have shape \[E, in/32, out\] = \[3, 2, 64\]",
     lambda: OAITritonExperts(_MX["w1"], _MX["w2"], quant="mxfp4", w1_scale=_MX["w1_scale"][:, :1],
                              w2_scale=_MX["w2_scale"])),
    (TypeError, "lora must be a LoRAWeights", lambda: UnfusedOAITritonExperts(_H["w1"], _H["w2"], lora=(1, 2))),
    (ValueError, r"lora.b13 must have shape \[L, E, 2N, r\] = \[2, 3, 64, 4\]",
     lambda: UnfusedOAITritonExperts(_H["w1"], _H["w2"], lora=LoRAWeights(
         *[t if i != 1 else t[..., :32, :] for i, t in enumerate(vars(make_lora(2, 3, 32, 64)).values())]))),
    (ValueError, "lora.a2 must be 4-D",
     lambda: UnfusedOAITritonExperts(_H["w1"], _H["w2"], lora=LoRAWeights(
         *[t if i != 2 else t[0] for i, t in enumerate(vars(make_lora(2, 3, 32, 64)).values())]))),
]


@pytest.mark.parametrize("exc,match,make", BAD_CONSTRUCTOR, ids=[c[1][:40] for c in BAD_CONSTRUCTOR])
def test_bad_constructor_arguments(exc, match, make):
    with pytest.raises(exc, match=match):
        make()


def test_bad_apply_arguments():
    M, topk = 4, 2
    lora = make_lora(2, 3, 32, 64)
    modular = OAITritonExperts(_H["w1"], _H["w2"])
    unfused = UnfusedOAITritonExperts(_H["w1"], _H["w2"])
    mono = OAITritonMxfp4ExpertsMonolithic(_H["w1"], _H["w2"])
    weights, ids, _ = make_routing(M, topk, 3)
    x = make_x(M, 64)
    with pytest.raises(ValueError, match="hidden_states must be 2-D"):
        modular.apply(x[None], weights, ids)
    with pytest.raises(TypeError, match="hidden_states must be a Tensor"):
        modular.apply(x.tolist(), weights, ids)
    with pytest.raises(ValueError, match=r"K = hidden_states.size\(1\) = 32"):
        modular.apply(x[:, :32], weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[M, topk\] with M = 4"):
        unfused.apply(x, weights, ids[:3])
    with pytest.raises(ValueError, match=r"topk_weights must have the shape of topk_ids \[4, 2\], got \[4, 1\]"):
        unfused.apply(x, weights[:, :1], ids)
    with pytest.raises(TypeError, match="topk_ids must be a Tensor"):
        modular.apply(x, weights, None)
    with pytest.raises(ValueError, match="supported devices are"):
        modular.apply(x.to("meta"), weights, ids)
    with pytest.raises(ValueError, match=r"output must have shape \[4, 64\], got \[4, 63\]"):
        modular.apply(x, weights, ids, output=torch.empty(4, 63))
    with pytest.raises(ValueError, match="no LoRA adapters are attached"):
        unfused.apply(x, weights, ids, token_lora_mapping=torch.zeros(M, dtype=torch.int32))
    unfused.set_lora(lora)
    with pytest.raises(ValueError, match=r"token_lora_mapping must be an integer tensor of shape \[M\] = \[4\]"):
        unfused.apply(x, weights, ids, token_lora_mapping=torch.zeros(M + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_lora_mapping must be an integer tensor"):
        unfused.apply(x, weights, ids, token_lora_mapping=torch.zeros(M))
    with pytest.raises(ValueError, match=r"router_logits must have shape \[M, E_global\] with M = hidden_states.size"):
        mono.apply(x, torch.randn(M + 1, 3), topk, True)
    with pytest.raises(ValueError, match=r"topk must be in \[1, E_global = 3\], got 4"):
        mono.apply(x, torch.randn(M, 3), 4, True)
    with pytest.raises(TypeError, match="topk must be an int"):
        mono.apply(x, torch.randn(M, 3), 2.0, True)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [*MODULAR, OAITritonMxfp4ExpertsMonolithic], ids=lambda c: c.__name__)
@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_classes_on_gpu(cls, quant):
    E, N, K, M, topk = 8, 192, 256, 33, 4
    op = make_weights(E, N, K, quant, torch.bfloat16, bias=True, seed=41, device="cuda")
    weights, ids, expert_map = make_routing(M, topk, E, seed=41, with_map=True, device="cuda")
    x = make_x(M, K, torch.bfloat16, seed=41, device="cuda")
    experts = build(cls, op, quant)
    if cls is OAITritonMxfp4ExpertsMonolithic:
        logits = torch.randn(M, expert_map.numel(), device="cuda")
        out = experts.apply(x, logits, topk, True, expert_map)
        weights, ids = topk_softmax_reference(logits.cpu(), topk, True)
        weights = weights.float()
    else:
        out = experts.apply(x, weights, ids, expert_map)
    assert out.is_cuda
    check_close(out, op, x, weights, ids, "swigluoai", quant, expert_map, tol=TOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [*MODULAR, OAITritonMxfp4ExpertsMonolithic], ids=lambda c: c.__name__)
def test_mxfp4_held_in_the_mma_layout_on_gpu(cls):
    """On CUDA with the default backend the classes hold MXFP4 in the tensor-core layout and call the ops with
    quant="mxfp4_mma" (the same output as the op on weights prepared by hand, bit for bit); backend "torch" and
    shapes the layout does not take keep the checkpoint layout."""
    E, N, K, M, topk = 8, 128, 192, 40, 4
    op = make_weights(E, N, K, "mxfp4", bias=True, seed=47, device="cuda")
    experts = build(cls, op, "mxfp4")
    assert experts.op_quant == "mxfp4_mma" and experts.quant == "mxfp4"
    assert build(cls, op, "mxfp4", backend="torch").op_quant == "mxfp4"
    assert build(cls, make_weights(E, 96, K, "mxfp4", device="cuda"), "mxfp4").op_quant == "mxfp4"
    h = held(op)
    q1, q2, s1, s2 = (t.transpose(1, 2) for t in prepare_held_mxfp4_mma(h["w1"], h["w2"], h["w1_scale"],
                                                                         h["w2_scale"]))
    x = make_x(M, K, torch.bfloat16, seed=47, device="cuda")
    kwargs = dict(quant="mxfp4_mma", w1_scale=s1, w2_scale=s2, w1_bias=op["w1_bias"], w2_bias=op["w2_bias"])
    if cls is OAITritonMxfp4ExpertsMonolithic:
        logits = torch.randn(M, E, device="cuda")
        want = torch.ops.moe_ext.fused_moe(x, q1, q2, logits, topk, True, "swigluoai", **kwargs)
        assert torch.equal(experts.apply(x, logits, topk, True), want)
        return
    weights, ids, _ = make_routing(M, topk, E, seed=47, device="cuda")
    if cls is OAITritonExperts:
        want = torch.ops.moe_ext.fused_experts(x, q1, q2, weights, ids, "swigluoai", **kwargs)
        assert torch.equal(experts.apply(x, weights, ids), want)
    else:
        got = experts.apply(x, weights, ids)
        check_close(got, op, x, weights, ids, "swigluoai", "mxfp4", tol=TOL[torch.bfloat16])


@pytest.mark.cuda
def test_lora_on_gpu():
    E, N, K, M, topk, L = 6, 64, 128, 24, 3, 2
    op = make_weights(E, N, K, bias=True, seed=43, device="cuda")
    lora = make_lora(L, E, N, K, seed=43)
    lora = LoRAWeights(*[t.cuda() for t in vars(lora).values()])
    weights, ids, _ = make_routing(M, topk, E, seed=43, device="cuda")
    x = make_x(M, K, seed=43, device="cuda")
    mapping = (torch.arange(M, device="cuda") % (L + 1) - 1).int()
    experts = build(UnfusedOAITritonExperts, op, activation="swigluoai", lora=lora)
    out = experts.apply(x, weights, ids, token_lora_mapping=mapping)
    cpu = {k: None if v is None else v.cpu() for k, v in op.items()}
    cpu_lora = LoRAWeights(*[t.cpu() for t in vars(lora).values()])
    ref = lora_reference(cpu, cpu_lora, x.cpu(), weights.cpu(), ids.cpu(), mapping.cpu(), "swigluoai")
    assert rel_err(out.cpu(), ref) < 5e-3  # fp32 throughout: the Triton GEMMs multiply in exact fp32 ("ieee")


@pytest.mark.parametrize("cls", [*MODULAR, OAITritonMxfp4ExpertsMonolithic], ids=lambda c: c.__name__)
def test_mxfp4_storage_prepared_at_construction(cls):
    """[E, in/2, out]-contiguous MXFP4 storage (vLLM's) is copied once into in-contiguous storage, held as the
    same view; the ops then get row-major weights and the output does not change."""
    E, N, K, M, topk = 4, 64, 128, 5, 2
    op = make_weights(E, N, K, "mxfp4")
    vllm = {name: op[name].transpose(1, 2).contiguous() for name in ("w1", "w2", "w1_scale", "w2_scale")}
    experts = cls(vllm["w1"], vllm["w2"], quant="mxfp4", w1_scale=vllm["w1_scale"], w2_scale=vllm["w2_scale"],
                  w1_bias=op["w1_bias"], w2_bias=op["w2_bias"])
    reference = build(cls, op, "mxfp4")
    for name in ("w1", "w2", "w1_scale", "w2_scale"):
        held_t = getattr(experts, name)
        assert held_t.shape == vllm[name].shape and torch.equal(held_t, vllm[name])
        assert held_t.stride(1) == 1 and _storage(held_t) != _storage(vllm[name]), name
        assert experts.op_weights()[name].is_contiguous(), name
    weights, ids, _ = make_routing(M, topk, E, seed=7)
    x = make_x(M, K, torch.bfloat16)
    if cls is OAITritonMxfp4ExpertsMonolithic:
        logits = torch.randn(M, E)
        assert torch.equal(experts.apply(x, logits, topk, True), reference.apply(x, logits, topk, True))
    else:
        assert torch.equal(experts.apply(x, weights, ids), reference.apply(x, weights, ids))
