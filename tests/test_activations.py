"""Tests of the gated activation ops (silu/gelu/gelu_tanh/swiglustep on halves, swigluoai interleaved): the
native kernels (CPU, and CUDA when present) against the fp64 PyTorch reference for every dtype, odd
widths, several leading shapes and layouts (padded rows, misaligned, transposed leading dims, more
unmergeable leading dims than the kernels' row layout holds); extreme values and non-default
alpha/limit; opcheck; torch.compile; bad inputs (eager and fake); CUDA-graph capture on CUDA."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_extension import ops
from tests.utils import DEVICES, DTYPES, poison

# NOTE: relative (norm) tolerances; the output is rounded once, so bf16 sits near 2e-3 and fp16 near 3e-4.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
WIDTHS = [2, 6, 16, 130, 258, 1002, 5760]  # input widths 2d
# (leading shape, layout): padded rows keep 16-byte alignment (vector path; for swigluoai with a scalar
# tail when d is not a multiple of the vector width); offset shifts the base by one element;
# transposed reverses the leading dims (no two of them merge).
CASES = [
    ([], "contiguous"),
    ([], "offset"),
    ([5], "contiguous"),
    ([5], "padded"),
    ([5], "offset"),
    ([3, 4], "contiguous"),
    ([3, 4], "padded"),
    ([3, 4], "transposed"),
    ([2, 3, 5], "contiguous"),
    ([2, 3, 5], "transposed"),
]
CASE_IDS = [f"{'x'.join(map(str, lead)) or 'scalar'}-{layout}" for lead, layout in CASES]


def act_err(out, ref):
    """tests.utils.rel_err, with the norm in the denominator floored at an RMS of 1 (inputs have RMS 3, so typical
    outputs are larger): a tensor of one or two elements deep in a tail (gelu(-9) ~ 1e-19, or an fp16
    subnormal) is ill-conditioned for a purely relative error, and the fp64 reference itself loses digits
    there (1 + tanh, 1 + erf). A wrong element is still an O(1) error."""
    if not torch.isfinite(out).all():
        return float("inf")
    ref = ref.double()
    return (out.double() - ref).norm().item() / max(ref.norm().item(), out.numel() ** 0.5, 1e-30)


def call(activation, out, x, alpha=1.702, limit=7.0):
    if activation == "swigluoai":
        torch.ops.moe_ext.swigluoai_and_mul(out, x, alpha, limit)
    elif activation == "swiglustep":
        torch.ops.moe_ext.swiglustep_and_mul(out, x, limit)
    else:
        getattr(torch.ops.moe_ext, f"{activation}_and_mul")(out, x)


def wrapper(activation):
    return getattr(ops, f"{activation}_and_mul")


def _pad16(n):
    """A row length > n that is a multiple of 16 elements (rows stay 16-byte aligned for every dtype)."""
    return (n + 15) // 16 * 16 + 16


def make(lead, width, dtype, device, layout, scale=3.0):
    """input [*lead, width] (values ~ N(0, scale^2)) and a poisoned out [*lead, width // 2]."""
    kw = {"dtype": dtype, "device": device}
    d = width // 2
    if layout == "contiguous":
        x, out = torch.randn(*lead, width, **kw), torch.empty(*lead, d, **kw)
    elif layout == "padded":
        x = torch.randn(*lead, _pad16(width), **kw)[..., :width]
        out = torch.empty(*lead, _pad16(d), **kw)[..., :d]
    elif layout == "offset":
        x = torch.randn(*lead, width + 1, **kw)[..., 1:]
        out = torch.empty(*lead, d + 1, **kw)[..., 1:]
    else:
        perm = list(reversed(range(len(lead)))) + [len(lead)]
        x = torch.randn(*reversed(lead), width, **kw).permute(perm)
        out = torch.empty(*reversed(lead), d, **kw).permute(perm)
    x.mul_(scale)
    return x, poison(out)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference(device, activation, dtype, case):
    lead, layout = case
    for width in WIDTHS:
        x, out = make(lead, width, dtype, device, layout)
        call(activation, out, x)
        err = act_err(out, ops.activation_torch(x.double(), activation))
        assert err <= TOL[dtype], f"width {width}: error {err:.2e}"


@pytest.mark.parametrize("activation", ["swigluoai", "swiglustep"])
@pytest.mark.parametrize("device", DEVICES)
def test_alpha_and_limit(device, activation):
    """Non-default alpha/limit with most values beyond the limit (both clamps active)."""
    for dtype in DTYPES:
        x, out = make([33], 258, dtype, device, "contiguous", scale=4.0)
        call(activation, out, x, alpha=1.0, limit=1.5)
        ref = ops.activation_torch(x.double(), activation, alpha=1.0, limit=1.5)
        assert act_err(out, ref) <= TOL[dtype]
        default_ref = ops.activation_torch(x.double(), activation)
        assert act_err(out, default_ref) > 10 * TOL[dtype]  # the arguments are not ignored


@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_extreme_gates(device, activation):
    """Gates far in both tails (exp overflow in the sigmoid/tanh forms) stay finite and correct."""
    for dtype in DTYPES:
        gate = torch.tensor([-1000.0, -100.0, -30.0, -9.0, 0.0, 9.0, 30.0, 100.0, 1000.0], device=device)
        up = torch.linspace(-3, 3, gate.numel(), device=device)
        if activation == "swigluoai":
            x = torch.stack([gate, up], dim=-1).reshape(1, -1)
        else:
            x = torch.cat([gate, up]).reshape(1, -1)
        x = x.to(dtype)
        out = poison(torch.empty(1, gate.numel(), device=device, dtype=dtype))
        call(activation, out, x)
        assert act_err(out, ops.activation_torch(x.double(), activation)) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_many_unmergeable_leading_dims(device):
    """8 leading dims that no stride merges (more than the kernels' row layout holds): input read through a
    contiguous copy, out written through scratch, both invisible to the caller."""
    lead = [2] * 8
    perm = list(reversed(range(8))) + [8]
    x = torch.randn(*lead, 20, device=device).permute(perm)
    strided_out = poison(torch.empty(*lead, 10, device=device).permute(perm))
    for out in (strided_out, poison(torch.empty(*lead, 10, device=device))):
        call("silu", out, x)
        assert act_err(out, ops.activation_torch(x.double(), "silu")) <= TOL[torch.float32]
    contiguous_x = x.contiguous()
    poison(strided_out)
    call("gelu", strided_out, contiguous_x)
    assert act_err(strided_out, ops.activation_torch(contiguous_x.double(), "gelu")) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    for shape in [(0, 8), (3, 0), (2, 0, 6)]:
        x = torch.randn(*shape, device=device)
        for activation in ops.ACTIVATIONS:
            assert wrapper(activation)(x).shape == (*shape[:-1], shape[-1] // 2)


@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_functional_wrapper(device, activation):
    x = torch.randn(3, 4, 130, device=device, dtype=torch.bfloat16)
    y = wrapper(activation)(x)
    assert y.shape == (3, 4, 65) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert act_err(y, ops.activation_torch(x.double(), activation)) <= TOL[torch.bfloat16]


def test_reference_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.activation_torch(torch.randn(2, 4), "relu")


@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, activation):
    x, out = make([3, 4], 18, torch.float32, device, "padded")
    extra = {"swigluoai": (1.5, 6.0), "swiglustep": (6.0,)}.get(activation, ())
    op = getattr(torch.ops.moe_ext, f"{activation}_and_mul").default
    torch.library.opcheck(op, (out, x, *extra))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_matches_eager(device):
    def fn(x):
        return tuple(wrapper(a)(x) for a in ops.ACTIVATIONS) + (ops.swigluoai_and_mul(x, 1.0, 2.0),)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for i, rows in enumerate((5, 9, 17)):
        x = torch.randn(rows, 3, 258, device=device) * 3
        if i == 0:
            got = compiled(x)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled(x)
        for g, e in zip(got, fn(x)):
            assert torch.equal(g, e)


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


# (name, builder(device) -> (out, input), exception type, message regex without the op name)
BAD_INPUTS = [
    ("scalar_input", lambda d: (_t(1, device=d), torch.zeros((), device=d)), RuntimeError,
     r"input must have at least 1 dim \[\.\.\., 2d\], got 0 dims"),
    ("int_input", lambda d: (_t(4, 4, dtype=torch.int32, device=d), _t(4, 8, dtype=torch.int32, device=d)),
     TypeError, r"input must be float32, float16 or bfloat16, got torch.int32"),
    ("fp64_input", lambda d: (_t(4, 4, dtype=torch.float64, device=d), _t(4, 8, dtype=torch.float64, device=d)),
     TypeError, r"input must be float32, float16 or bfloat16, got torch.float64"),
    ("dtype_mismatch", lambda d: (_t(4, 4, dtype=torch.float16, device=d), _t(4, 8, device=d)), TypeError,
     r"out must have the dtype of input \(torch.float32\), got torch.float16"),
    ("odd_width", lambda d: (_t(4, 3, device=d), _t(4, 7, device=d)), RuntimeError,
     r"input width \(last dim\) must be even, got 7"),
    ("out_width", lambda d: (_t(4, 5, device=d), _t(4, 8, device=d)), RuntimeError,
     r"out width \(last dim\) must be half the input width = 4, got 5"),
    ("leading_shape", lambda d: (_t(3, 4, device=d), _t(4, 8, device=d)), RuntimeError,
     r"out must have the leading shape of input \[4\], got \[3, 4\]"),
    ("leading_rank", lambda d: (_t(4, device=d), _t(1, 8, device=d)), RuntimeError,
     r"out must have the leading shape of input \[1\], got \[4\]"),
    ("input_last_dim", lambda d: (_t(4, 4, device=d), _t(4, 16, device=d)[:, ::2]), RuntimeError,
     r"input must be contiguous in its last dim \(stride 1\), got stride 2"),
    ("out_last_dim", lambda d: (_t(4, 4, device=d).t(), _t(4, 8, device=d)), RuntimeError,
     r"out must be contiguous in its last dim \(stride 1\), got stride 4"),
]
BAD_IDS = [case[0] for case in BAD_INPUTS]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=BAD_IDS)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_eager(device, activation, case):
    _, build, exc, match = case
    with pytest.raises(exc, match=f"{activation}_and_mul: {match}"):
        call(activation, *build(device))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=BAD_IDS)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_bad_inputs_fake(activation, case):
    _, build, exc, match = case
    mode = FakeTensorMode()
    args = [mode.from_tensor(t) for t in build("cpu")]
    with mode, pytest.raises(exc, match=f"{activation}_and_mul: {match}"):
        call(activation, *args)


@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_device_mismatch_fake(activation):
    with FakeTensorMode():
        match = rf"{activation}_and_mul: out must be on the device of input \(cuda:0\), got cpu"
        with pytest.raises(RuntimeError, match=match):
            call(activation, torch.empty(4, 4), torch.empty(4, 8, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_device_mismatch_eager(activation):
    with pytest.raises(RuntimeError, match=rf"{activation}_and_mul: out must be on the device of input"):
        call(activation, torch.empty(4, 4), torch.zeros(4, 8, device="cuda"))


def test_bad_inputs_under_compile():
    """The fakes' checks fire at trace time (dynamo wraps them in a RuntimeError subclass)."""
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"silu_and_mul: input width \(last dim\) must be even, got 7"):
        torch.compile(ops.silu_and_mul, fullgraph=True)(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match=r"swigluoai_and_mul: input must be contiguous in its last dim"):
        torch.compile(ops.swigluoai_and_mul, fullgraph=True)(torch.randn(3, 16)[:, ::2])

    def into(out, x):
        torch.ops.moe_ext.gelu_and_mul(out, x)
        return out

    with pytest.raises(RuntimeError, match=r"gelu_and_mul: out must have the leading shape of input \[3\]"):
        torch.compile(into, fullgraph=True)(torch.empty(4, 4), torch.randn(3, 8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_cuda_large_rows(activation, dtype):
    """Benchmark-like widths: one 384-thread chunk (N = 2880), four chunks (N = 14336)."""
    for rows, width in [(1000, 5760), (64, 28672)]:
        x, out = make([rows], width, dtype, "cuda", "contiguous")
        call(activation, out, x)
        assert act_err(out, ops.activation_torch(x.double(), activation)) <= TOL[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_cuda_graph_replay(activation):
    x, out = make([37], 5760, torch.bfloat16, "cuda", "padded")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(activation, out, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(activation, out, x)
    for _ in range(3):
        x.copy_(torch.randn_like(x) * 3)
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        assert act_err(out, ops.activation_torch(x.double(), activation)) <= TOL[torch.bfloat16]
