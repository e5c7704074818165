"""Tests of moe_ext::moe_sum: the native kernels (CPU, and CUDA when present) against the PyTorch
reference (in fp64) for every dtype, many topk, odd sizes, contiguous/padded/misaligned/transposed layouts, with
and without topk_ids / expert_map (NaN and Inf planted in invalid slots); opcheck; torch.compile;
bad inputs (eager and fake); CUDA-graph capture on CUDA."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_extension.ops import moe_sum, moe_sum_torch
from tests.utils import DEVICES, DTYPES, poison

# NOTE: relative (norm) tolerances; the output is rounded once, so bf16 sits near 2e-3 and fp16 near 3e-4.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
TOPKS = [1, 2, 3, 4, 6, 8, 9, 16, 40, 64]
LAYOUTS = ["contiguous", "padded", "offset", "transposed"]
SIZES = [(1, 1), (7, 7), (33, 64), (5, 130), (3, 1000), (2, 2880)]  # (M, K)
ID_MODES = ["none", "int32", "int64", "int32+map", "int64+map"]
NUM_EXPERTS = 8


def make_input(m, topk, k, dtype, device, layout):
    """input [M, topk, K] and a poisoned output [M, K] in the given memory layout.

    padded: row and slot strides padded to a multiple of 16 bytes (vector path, scalar tail when K is not a
    multiple of the vector width); offset: base shifted by one element (scalar path); transposed: the
    slot stride larger than the row stride."""
    kw = {"dtype": dtype, "device": device}
    if layout == "contiguous":
        x, out = torch.randn(m, topk, k, **kw), torch.empty(m, k, **kw)
    elif layout == "padded":
        kp = (k + 7) // 8 * 8 + 8
        x = torch.randn(m, topk + 2, kp, **kw)[:, 1 : topk + 1, :k]
        out = torch.empty(m, kp, **kw)[:, :k]
    elif layout == "offset":
        x = torch.randn(m, topk, k + 3, **kw)[:, :, 1 : k + 1]
        out = torch.empty(m, k + 1, **kw)[:, 1:]
    else:
        x = torch.randn(topk, m, k, **kw).transpose(0, 1)
        out = torch.empty(m, k + 5, **kw)[:, :k]
    return x, poison(out)


def make_routing(m, topk, device, mode, x=None):
    """(topk_ids, expert_map) for an id mode; invalid ids are -1, E, E + 3 and a huge value. When x is
    given, NaN and +/-Inf are written into the input slots that must not contribute."""
    if mode == "none":
        return None, None
    id_dtype = torch.int64 if mode.startswith("int64") else torch.int32
    huge = 2**40 if id_dtype == torch.int64 else 2**31 - 1
    choices = torch.tensor([-1, NUM_EXPERTS, NUM_EXPERTS + 3, huge] + list(range(NUM_EXPERTS)), dtype=torch.int64)
    ids = choices[torch.randint(0, len(choices), (m, topk))].to(device=device, dtype=id_dtype)
    expert_map = None
    if mode.endswith("+map"):
        expert_map = torch.randint(0, 4, (NUM_EXPERTS,), dtype=torch.int32)
        expert_map[torch.randperm(NUM_EXPERTS)[:3]] = -1
        expert_map = expert_map.to(device)
    if x is not None:
        ref_valid = ids.long() >= 0
        if expert_map is not None:
            in_range = ids.long() < NUM_EXPERTS
            local = expert_map.long()[ids.long().clamp(0, NUM_EXPERTS - 1)]
            ref_valid &= in_range & (local >= 0)
        garbage = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=x.dtype, device=x.device)
        bad = (~ref_valid).nonzero()
        x[bad[:, 0], bad[:, 1]] = garbage[torch.arange(len(bad), device=x.device) % 3].unsqueeze(-1)
    return ids, expert_map


def sum_err(out, x, ids=None, expert_map=None):
    """rel_err against the fp64 reference, except that the norm in the denominator is that of the sums of
    |terms| (what bounds fp32 accumulation error): a plain rel_err of a few sums that cancel to near 0
    (M = K = 1) is ill-conditioned. A missing or extra slot still costs ~1/topk, far above TOL."""
    ref = moe_sum_torch(x.double(), ids, expert_map)
    magnitude = moe_sum_torch(x.double().abs(), ids, expert_map)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref).norm() / magnitude.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference(device, dtype, topk, layout):
    for m, k in SIZES:
        for mode in ID_MODES:
            x, out = make_input(m, topk, k, dtype, device, layout)
            ids, expert_map = make_routing(m, topk, device, mode, x)
            torch.ops.moe_ext.moe_sum(x, out, ids, expert_map)
            err = sum_err(out, x, ids, expert_map)
            assert err <= TOL[dtype], f"M={m} K={k} ids={mode}: error {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_invalid_slots_contribute_exact_zero(device):
    """All slots invalid -> exactly 0 (not NaN) even though every slot holds NaN/Inf; one valid slot ->
    exactly that slot's values."""
    m, topk, k = 5, 6, 72
    x = torch.full((m, topk, k), float("nan"), device=device, dtype=torch.bfloat16)
    x[:, 1::2] = float("inf")
    ids = torch.full((m, topk), -1, dtype=torch.int32, device=device)
    out = poison(torch.empty(m, k, device=device, dtype=torch.bfloat16))
    torch.ops.moe_ext.moe_sum(x, out, ids)
    assert torch.equal(out, torch.zeros_like(out))
    x[:, 3] = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ids[:, 3] = 7
    expert_map = torch.full((8,), -1, dtype=torch.int32, device=device)
    expert_map[7] = 0
    ids[:, 0] = 5  # valid id, but not local
    poison(out)
    torch.ops.moe_ext.moe_sum(x, out, ids, expert_map)
    assert torch.equal(out, x[:, 3])


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_sizes(device):
    """M = 0 and K = 0 are no-ops; topk = 0 gives zeros."""
    for m, topk, k in [(0, 4, 16), (3, 4, 0)]:
        torch.ops.moe_ext.moe_sum(torch.randn(m, topk, k, device=device), torch.empty(m, k, device=device))
    out = poison(torch.empty(3, 16, device=device))
    torch.ops.moe_ext.moe_sum(torch.randn(3, 0, 16, device=device), out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("device", DEVICES)
def test_functional_wrapper(device):
    x = torch.randn(9, 3, 130, device=device, dtype=torch.float16)
    ids, expert_map = make_routing(9, 3, device, "int64+map", x)
    y = moe_sum(x, ids, expert_map)
    assert y.shape == (9, 130) and y.dtype == torch.float16 and y.is_contiguous()
    assert sum_err(y, x, ids, expert_map) <= TOL[torch.float16]


@pytest.mark.parametrize("mode", ["none", "int32", "int64+map"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, mode):
    x, out = make_input(5, 3, 24, torch.float32, device, "padded")
    ids, expert_map = make_routing(5, 3, device, mode)
    torch.library.opcheck(torch.ops.moe_ext.moe_sum.default, (x, out, ids, expert_map))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_matches_eager(device):
    def fn(x, ids, expert_map):
        return moe_sum(x, ids, expert_map) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for i, m in enumerate((5, 9, 17)):
        x = torch.randn(m, 4, 40, device=device)
        ids, expert_map = make_routing(m, 4, device, "int32+map", x)
        if i == 0:
            y = compiled(x, ids, expert_map)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                y = compiled(x, ids, expert_map)
        assert torch.equal(y, fn(x, ids, expert_map))


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


# (name, builder(device) -> (input, output, topk_ids, expert_map), exception type, message regex)
BAD_INPUTS = [
    ("rank", lambda d: (_t(3, 64, device=d), _t(3, 64, device=d), None, None), RuntimeError,
     r"moe_sum: input must have 3 dims \[M, topk, K\], got 2 dims"),
    ("int_input", lambda d: (_t(3, 2, 64, dtype=torch.int32, device=d), _t(3, 64, dtype=torch.int32, device=d),
                             None, None), TypeError, r"moe_sum: input must be float32, float16 or bfloat16"),
    ("fp64_input", lambda d: (_t(3, 2, 64, dtype=torch.float64, device=d), _t(3, 64, dtype=torch.float64, device=d),
                              None, None), TypeError, r"moe_sum: input must be float32, float16 or bfloat16"),
    ("dtype_mismatch", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, dtype=torch.bfloat16, device=d), None, None),
     TypeError, r"moe_sum: output must have the dtype of input \(torch.float32\), got torch.bfloat16"),
    ("output_shape", lambda d: (_t(3, 2, 64, device=d), _t(3, 65, device=d), None, None), RuntimeError,
     r"moe_sum: output must have shape \[M, K\] = \[3, 64\], got \[3, 65\]"),
    ("output_rank", lambda d: (_t(3, 2, 64, device=d), _t(3, 1, 64, device=d), None, None), RuntimeError,
     r"moe_sum: output must have shape \[M, K\]"),
    ("input_last_dim", lambda d: (_t(3, 2, 128, device=d)[..., ::2], _t(3, 64, device=d), None, None), RuntimeError,
     r"moe_sum: input must be contiguous in its last dim \(stride 1\), got stride 2"),
    ("output_last_dim", lambda d: (_t(3, 2, 64, device=d), _t(64, 3, device=d).t(), None, None), RuntimeError,
     r"moe_sum: output must be contiguous in its last dim"),
    ("ids_dtype", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, device=d), _t(3, 2, device=d), None), TypeError,
     r"moe_sum: topk_ids must be int32 or int64, got torch.float32"),
    ("ids_shape", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, device=d), _t(3, 3, dtype=torch.int32, device=d),
                             None), RuntimeError,
     r"moe_sum: topk_ids must have shape \[M, topk\] = \[3, 2\], got \[3, 3\]"),
    ("map_dtype", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, device=d), _t(3, 2, dtype=torch.int32, device=d),
                             _t(8, dtype=torch.int64, device=d)), TypeError, r"moe_sum: expert_map must be int32"),
    ("map_rank", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, device=d), _t(3, 2, dtype=torch.int32, device=d),
                            _t(2, 4, dtype=torch.int32, device=d)), RuntimeError,
     r"moe_sum: expert_map must have 1 dim \[E_global\], got 2 dims"),
    ("map_without_ids", lambda d: (_t(3, 2, 64, device=d), _t(3, 64, device=d), None,
                                   _t(8, dtype=torch.int32, device=d)), RuntimeError,
     r"moe_sum: expert_map needs topk_ids"),
]
BAD_IDS = [case[0] for case in BAD_INPUTS]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=BAD_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_eager(device, case):
    _, build, exc, match = case
    with pytest.raises(exc, match=match):
        torch.ops.moe_ext.moe_sum(*build(device))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=BAD_IDS)
def test_bad_inputs_fake(case):
    _, build, exc, match = case
    mode = FakeTensorMode()
    args = [None if t is None else mode.from_tensor(t) for t in build("cpu")]
    with mode, pytest.raises(exc, match=match):
        torch.ops.moe_ext.moe_sum(*args)


def test_device_mismatch_fake():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(3, 2, 64, device="cuda")
        with pytest.raises(RuntimeError, match=r"moe_sum: output must be on the device of input \(cuda:0\), got cpu"):
            torch.ops.moe_ext.moe_sum(x, torch.empty(3, 64))
        ids = torch.zeros(3, 2, dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"moe_sum: topk_ids must be on the device of input"):
            torch.ops.moe_ext.moe_sum(x, torch.empty(3, 64, device="cuda"), ids)


@pytest.mark.cuda
def test_device_mismatch_eager():
    x = torch.zeros(3, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"moe_sum: output must be on the device of input"):
        torch.ops.moe_ext.moe_sum(x, torch.empty(3, 64))
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"moe_sum: topk_ids must be on the device of input"):
        torch.ops.moe_ext.moe_sum(x, torch.empty(3, 64, device="cuda"), ids)
    emap = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"moe_sum: expert_map must be on the device of input"):
        torch.ops.moe_ext.moe_sum(x, torch.empty(3, 64, device="cuda"), ids.cuda(), emap)


def test_bad_inputs_under_compile():
    """The fake's checks fire at trace time (dynamo wraps them in a RuntimeError subclass)."""
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"moe_sum: input must have 3 dims"):
        torch.compile(moe_sum, fullgraph=True)(torch.randn(3, 64))
    with pytest.raises(RuntimeError, match=r"moe_sum: topk_ids must have shape \[M, topk\]"):
        torch.compile(moe_sum, fullgraph=True)(torch.randn(3, 2, 64), torch.zeros(3, 5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"moe_sum: expert_map must be int32"):
        torch.compile(moe_sum, fullgraph=True)(
            torch.randn(3, 2, 64), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
        )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_large_rows(dtype):
    """Shapes of the benchmark family (multi-pass rows at K = 7168, one pass at 2880), vector path."""
    for m, topk, k in [(300, 8, 7168), (1000, 4, 2880), (257, 6, 2048)]:
        x = torch.randn(m, topk, k, device="cuda", dtype=dtype)
        out = poison(torch.empty(m, k, device="cuda", dtype=dtype))
        torch.ops.moe_ext.moe_sum(x, out)
        assert sum_err(out, x, None, None) <= TOL[dtype]
        # make_routing writes NaN/Inf into the slots the ids invalidate: all slots count only above.
        ids, expert_map = make_routing(m, topk, "cuda", "int32+map", x)
        out = poison(torch.empty(m, k, device="cuda", dtype=dtype))
        torch.ops.moe_ext.moe_sum(x, out, ids, expert_map)
        assert sum_err(out, x, ids, expert_map) <= TOL[dtype]


@pytest.mark.cuda
def test_cuda_graph_replay():
    m, topk, k = 37, 6, 2880
    x = torch.randn(m, topk, k, device="cuda", dtype=torch.bfloat16)
    ids, expert_map = make_routing(m, topk, "cuda", "int64+map")
    out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.moe_ext.moe_sum(x, out, ids, expert_map)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.moe_ext.moe_sum(x, out, ids, expert_map)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        new_ids, new_map = make_routing(m, topk, "cuda", "int64+map", x)
        ids.copy_(new_ids)
        expert_map.copy_(new_map)
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        assert sum_err(out, x, ids, expert_map) <= TOL[torch.bfloat16]
