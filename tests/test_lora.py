"""LoRA ops (``moe_ext::lora_shrink`` / ``lora_expand`` / ``add_lora``, moe_extension/ops/lora.py) and their Triton
kernels (moe_extension/kernels/lora.py) against the fp64 loop ``tests.reference.lora_reference``: both kernel
schedules (direct, grouped with every block size), ranks 1..64, per-token and per-slot inputs, expert_map with
invalid ids, router weights, mixed adapter mappings with -1 and out-of-range ids; inactive pairs bitwise
untouched; opcheck; compile with dynamic M. The kernels run in Triton's interpreter on CPU tensors and on CUDA.
CUDA only: the issue's matrix through the ops, CUDA-graph replays with changed adapters and mapping, compile
with Inductor, LoRA on MXFP4 and fp8 block base weights through UnfusedOAITritonExperts, the join of the side
stream that runs the shrink beside the GEMM.
"""

import contextlib

import pytest
import torch

from moe_extension.experts import LoRAWeights, UnfusedOAITritonExperts
from moe_extension.kernels import expert_gemm1_triton, expert_gemm2_triton
from moe_extension.kernels.lora import add_lora_triton, lora_block_m, lora_expand_triton, lora_shrink_triton
from moe_extension.ops import add_lora, expert_gemm1, expert_gemm2, lora_expand, lora_shrink
from tests.reference import (expert_gemm1_reference, expert_gemm2_reference, lora_reference, opcheck_utils,
                             random_expert_map, random_experts, random_routing, tolerance)
from tests.utils import DEVICES, INTERPRETED, assert_graph_replays_match_eager, rel_err

KERNEL_DEVICES = [d for d in DEVICES if d == "cuda" or INTERPRETED]
# fp32 LoRA math, one rounding into out: the error is out's rounding (plus fp32 sums).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_case(M, topk, L, E, r, K, n, dtype=torch.float32, *, per_slot=False, with_map=False, weights=True,
              device="cpu", seed=0, adapter_dtype=None):
    """Keyword arguments of add_lora: adapters of scale ~1/sqrt(fan-in), mapping in [-1, L] (L: out of range;
    token 0 has adapter 0 and a valid slot, token 1 none)."""
    torch.manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    num_global = E + 3 if with_map else E
    topk_weights, topk_ids = random_routing(M, num_global, topk)
    x = torch.randn(M, topk, K) if per_slot else torch.randn(M, K)
    mapping = torch.randint(-1, L + 1, (M,), dtype=torch.int32)
    mapping[:2] = torch.tensor([0, -1])[:M]  # token 0 with an adapter, token 1 without
    expert_map = random_expert_map(num_global, E) if with_map else None
    topk_ids[0, 0] = 0 if expert_map is None else int(torch.nonzero(expert_map >= 0)[0])
    case = {
        "out": torch.randn(M, topk, n).to(dtype),
        "x": x.to(dtype),
        "lora_a": (torch.randn(L, E, r, K) / K**0.5).to(adapter_dtype),
        "lora_b": (torch.randn(L, E, n, r) / r**0.5).to(adapter_dtype),
        "topk_ids": topk_ids,
        "token_lora_mapping": mapping,
        "expert_map": expert_map,
        "topk_weights": topk_weights if weights else None,
    }
    return {k: None if v is None else v.to(device) for k, v in case.items()}


def active_pairs(case) -> torch.Tensor:
    """[M, topk] bool: the pairs add_lora may write (valid slot, adapter in [0, L))."""
    ref = lora_reference(**dict(case, lora_b=torch.ones_like(case["lora_b"], device="cpu"),
                                lora_a=torch.ones_like(case["lora_a"], device="cpu"),
                                x=torch.ones_like(case["x"], device="cpu"), topk_weights=None))
    return (ref != case["out"].cpu().double()).any(-1)


def check_add(out, case, tol):
    """out (add_lora's result) against the reference: close on active pairs, bitwise the input elsewhere."""
    ref = lora_reference(**case)
    assert rel_err(out.cpu(), ref) < tol
    idle = ~active_pairs(case)
    assert torch.equal(out.cpu()[idle], case["out"].cpu()[idle])
    assert (~idle).any() and (idle.any() or len(idle) == 1), "the case must hold both kinds of pair"


def split(case):
    """(shrink keywords, expand keywords) of an add_lora case."""
    slots = {k: case[k] for k in ("topk_ids", "token_lora_mapping", "expert_map")}
    return dict(x=case["x"], lora_a=case["lora_a"], **slots), dict(lora_b=case["lora_b"], **slots,
                                                                    topk_weights=case["topk_weights"])


# ------------------------------------------------------------------------------------------------------ the ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_slot,with_map,weights", [(False, False, True), (True, True, False), (False, True, True)])
def test_add_lora_matches_reference(device, dtype, per_slot, with_map, weights):
    case = make_case(13, 3, 3, 5, 4, 48, 40, dtype, per_slot=per_slot, with_map=with_map, weights=weights,
                     device=device, seed=1)
    out = case["out"].clone()
    assert add_lora(out, **{k: v for k, v in case.items() if k != "out"}) is out
    check_add(out, case, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_shrink_then_expand_equals_add_lora(device):
    case = make_case(11, 2, 2, 4, 6, 40, 24, per_slot=True, with_map=True, device=device, seed=2)
    shrink_kw, expand_kw = split(case)
    u = lora_shrink(**shrink_kw)
    assert u.shape == (11, 2, 6) and u.dtype == torch.float32
    idle = ~active_pairs(case)
    assert (u.cpu()[idle] == 0).all(), "inactive pairs' rows of u are 0"
    out = lora_expand(case["out"].clone(), u, **expand_kw)
    check_add(out, case, TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["lora_shrink", "lora_expand", "add_lora"])
def test_opcheck(device, op):
    case = make_case(7, 2, 2, 3, 4, 32, 24, with_map=True, device=device, seed=3)
    shrink_kw, expand_kw = split(case)
    slots = (case["topk_ids"], case["token_lora_mapping"])
    if op == "lora_shrink":
        args, kwargs = (case["x"], case["lora_a"], *slots), {"expert_map": case["expert_map"]}
    elif op == "lora_expand":
        u = lora_shrink(**shrink_kw)
        args = (case["out"].clone(), u, case["lora_b"], *slots)
        kwargs = {"expert_map": case["expert_map"], "topk_weights": case["topk_weights"]}
    else:
        args = (case["out"].clone(), case["x"], case["lora_a"], case["lora_b"], *slots)
        kwargs = {"expert_map": case["expert_map"], "topk_weights": case["topk_weights"]}
    torch.library.opcheck(getattr(torch.ops.moe_ext, op).default, args, kwargs, test_utils=opcheck_utils("none"))


# ------------------------------------------------------------------------- the LoRA terms of the expert GEMMs


def gemm_lora_case(gemm, M, quant, device, seed=0, L=3, r=5, E=6, topk=3, dtype=torch.float32, num_global=None):
    """(call, kwargs of the op, LoRA kwargs, fp64 expected output, active pairs) of expert_gemm1 (gemm 1: x
    [M, K]) or expert_gemm2 (gemm 2: x [M, topk, N]) with biases, an expert_map over ``num_global`` ids (default
    E + 2) with invalid ids, router weights and a mapping in [-1, L] (token 0 has adapter 1 and a valid first
    slot); x, weights and adapters in ``dtype``."""
    torch.manual_seed(seed)
    K, N = (40, 27) if quant == "none" else (96, 64)
    w = random_experts(E, K, N, quant, dtype, device, bias=True)
    num_global = num_global or E + 2
    weights, ids = random_routing(M, num_global, topk, device=device)
    emap = random_expert_map(num_global, E, device)
    ids[0, 0] = int(torch.nonzero(emap >= 0)[0])
    mapping = torch.randint(-1, L + 1, (M,), dtype=torch.int32).to(device)
    mapping[0] = 1
    x = (torch.randn(M, K) if gemm == 1 else torch.randn(M, topk, N)).to(device, dtype)
    rows = 2 * N if gemm == 1 else K
    lora = {"lora_a": (torch.randn(L, E, r, x.shape[-1]) / x.shape[-1] ** 0.5).to(device, dtype),
            "lora_b": (torch.randn(L, E, rows, r) / r**0.5).to(device, dtype), "token_lora_mapping": mapping}
    n = str(gemm)
    kwargs = {f"w{n}_bias": w[f"w{n}_bias"], "expert_map": emap, "topk_weights": weights, "quant": quant,
              f"w{n}_scale": w[f"w{n}_scale"]}
    base = (expert_gemm1_reference if gemm == 1 else expert_gemm2_reference)(x, w[f"w{n}"], ids, **kwargs)
    case = dict(out=base, x=x, **lora, topk_ids=ids, expert_map=emap, topk_weights=weights)
    return (x, w[f"w{n}"], ids), kwargs, lora, lora_reference(**case), active_pairs(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gemm,M,quant", [(g, m, q) for g in (1, 2) for m in (1, 6) for q in ("none", "mxfp4")]
                         + [(g, m, q) for g in (1, 2) for m, q in ((6, "fp8_block"), (90, "none"))])
def test_expert_gemm_lora_term(device, gemm, M, quant):
    """The ops and, where the kernels run, their launchers: M = 1 takes the direct schedule (the expand in the
    GEMV's epilogue), M >= 6 the sorted one (add_lora after the GEMM; at M = 90 its 270 pairs take the grouped
    schedule); pairs without an adapter bit for bit as without LoRA."""
    args, kwargs, lora, ref, active = gemm_lora_case(gemm, M, quant, device, seed=M + 10 * gemm)
    calls = [expert_gemm1 if gemm == 1 else expert_gemm2]
    if device == "cuda" or INTERPRETED:
        calls.append(expert_gemm1_triton if gemm == 1 else expert_gemm2_triton)
    for call in calls:
        out = call(*args, **kwargs, **lora)
        assert rel_err(out.cpu(), ref) < tolerance(torch.float32, device, quant), call.__name__
        base = call(*args, **kwargs)
        assert torch.equal(out.cpu()[~active], base.cpu()[~active]), call.__name__
        assert active.any() and (~active).any()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("gemm", [1, 2])
def test_expert_gemm_lora_term_on_tensor_core_gemvs(monkeypatch, device, gemm):
    """16-bit weights on an expert-parallel shard (6 of 24 experts) at M = 1: the heuristic runs the direct
    schedule's tensor-core GEMVs, the LoRA expand in their epilogue (fp16 in the interpreter, bf16 on the GPU)."""
    import moe_extension.kernels.fused_experts as fe

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    args, kwargs, lora, ref, active = gemm_lora_case(gemm, 1, "none", device, seed=3 + gemm, dtype=dtype,
                                                     num_global=24)
    name, launched = f"gemv{gemm}_dot_kernel", []
    kernel = getattr(fe, name)

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fe, name, Spy())
    call = expert_gemm1_triton if gemm == 1 else expert_gemm2_triton
    out = call(*args, **kwargs, **lora)
    assert launched, "the tensor-core GEMV ran"
    assert rel_err(out.cpu(), ref) < tolerance(dtype, device)
    base = call(*args, **kwargs)
    assert torch.equal(out.cpu()[~active], base.cpu()[~active])
    assert active.any() and (~active).any()


@pytest.mark.parametrize("device", DEVICES)
def test_expert_gemm_lora_opcheck(device):
    for gemm in (1, 2):
        args, kwargs, lora, _, _ = gemm_lora_case(gemm, 5, "none", device, seed=gemm)
        op = torch.ops.moe_ext.expert_gemm1 if gemm == 1 else torch.ops.moe_ext.expert_gemm2
        torch.library.opcheck(op.default, args, dict(kwargs, **lora), test_utils=opcheck_utils("none"))


def test_expert_gemm_lora_bad_arguments():
    (x, w1, ids), kwargs, lora, _, _ = gemm_lora_case(1, 4, "none", "cpu")
    with pytest.raises(RuntimeError, match="expert_gemm1: lora_a, lora_b and token_lora_mapping go together "
                                           r"\(all three or none\), got lora_a=a tensor, lora_b=None"):
        expert_gemm1(x, w1, ids, **kwargs, lora_a=lora["lora_a"])
    bad = dict(lora, lora_b=lora["lora_b"][:, :, :-1])
    with pytest.raises(RuntimeError, match=r"expert_gemm1: lora_b must have shape \[L, E, n, r\] = \[3, 6, 54, 5\]"):
        expert_gemm1(x, w1, ids, **kwargs, **bad)
    bad = dict(lora, lora_a=lora["lora_a"][:, :-1])
    with pytest.raises(RuntimeError, match=r"expert_gemm1: lora_a must have shape \[L, E, r, K\] = \[3, 6, 5, 40\]"):
        expert_gemm1(x, w1, ids, **kwargs, **bad)


def test_compiles_with_dynamic_tokens_without_recompiles():
    def run(out, x, lora_a, lora_b, ids, mapping, weights):
        u = torch.ops.moe_ext.lora_shrink(x, lora_a, ids, mapping)
        torch.ops.moe_ext.lora_expand(out, u, lora_b, ids, mapping, topk_weights=weights)
        return out

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (3, 6, 17):
            case = make_case(M, 2, 2, 3, 4, 32, 24, seed=M)
            args = [case[k] for k in ("out", "x", "lora_a", "lora_b", "topk_ids", "token_lora_mapping",
                                      "topk_weights")]
            out = args[0].clone()
            for t in (out, *args[1:2], *args[4:]):
                torch._dynamo.mark_dynamic(t, 0)
            assert torch.equal(compiled(out, *args[1:]), run(args[0].clone(), *args[1:]))


# -------------------------------------------------------------------------------------------------- the kernels

KERNEL_CASES = [
    # M, topk, L, E, r, K, n, schedule
    (1, 4, 2, 6, 16, 64, 48, "direct"),
    (9, 3, 3, 4, 1, 40, 33, "direct"),
    (9, 3, 3, 4, 64, 40, 33, "direct"),
    (9, 3, 3, 4, 5, 40, 33, "grouped"),  # blocks of 16
    (40, 2, 1, 2, 16, 72, 24, "grouped"),  # 80 pairs over 2 groups: blocks of 32 (lora_block_m)
    (70, 2, 1, 2, 64, 72, 24, "grouped"),  # 140 over 2: blocks of 64, routing in three launches
    (23, 2, 16, 3, 8, 64, 48, "grouped"),  # L 16: 48 groups
    (5, 2, 2, 3, 128, 64, 40, "direct"),  # the largest rank
    (40, 2, 1, 2, 128, 72, 24, "grouped"),
    (12, 2, 2, 3, 8, 32, 300, "grouped"),  # 3 column tiles of the expand in 3 runs, the last tile partial
    (12, 3, 2, 3, 16, 32, 1100, "grouped"),  # 9 tiles in 5 runs of 2: the last run's second tile lies past n
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("M,topk,L,E,r,K,n,schedule", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_match_reference(device, M, topk, L, E, r, K, n, schedule, dtype):
    per_slot = (M + r) % 2 == 1
    case = make_case(M, topk, L, E, r, K, n, dtype, per_slot=per_slot, with_map=M % 3 == 0, weights=M % 2 == 1,
                     device=device, seed=M * 100 + r)
    kw = {k: v for k, v in case.items() if k != "out"}
    out = case["out"].clone()
    add_lora_triton(out, **kw, schedule=schedule)
    check_add(out, case, TOL[dtype])
    shrink_kw, expand_kw = split(case)
    u = lora_shrink_triton(**shrink_kw, schedule=schedule)
    assert (u.cpu()[~active_pairs(case)] == 0).all()
    two = case["out"].clone()
    lora_expand_triton(two, u, **expand_kw, schedule=schedule)
    check_add(two, case, TOL[dtype])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernels_adapters_in_their_own_dtype(device):
    """bf16 activations with fp32 adapters (and the reverse): the kernels multiply in fp32 then."""
    for dtype, adapter_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        for schedule in ("direct", "grouped"):
            case = make_case(10, 2, 2, 3, 8, 48, 40, dtype, adapter_dtype=adapter_dtype, device=device, seed=5)
            out = case["out"].clone()
            add_lora_triton(out, **{k: v for k, v in case.items() if k != "out"}, schedule=schedule)
            check_add(out, case, TOL[dtype])


def test_block_rule():
    assert [lora_block_m(p, 128) for p in (4, 1024, 3072, 8192, 16384)] == [16, 16, 32, 64, 64]


# ------------------------------------------------------------------------------------------------------ on CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 7, 300, 2048])
@pytest.mark.parametrize("r", [1, 8, 16, 64])
@pytest.mark.parametrize("L", [1, 4, 16])
def test_cuda_matrix(M, r, L):
    """The issue's matrix through the ops: gemm1's term (per-token x, 2N rows) and gemm2's (per-slot a)."""
    E, K, N, topk = 8, 256, 96, 4
    first = make_case(M, topk, L, E, r, K, 2 * N, torch.bfloat16, with_map=True, device="cuda", seed=M + r + L)
    out = first["out"].clone()
    add_lora(out, **{k: v for k, v in first.items() if k != "out"})
    check_add(out, first, TOL[torch.bfloat16])
    second = make_case(M, topk, L, E, r, N, K, torch.bfloat16, per_slot=True, device="cuda", seed=M * r + L)
    shrink_kw, expand_kw = split(second)
    out = lora_expand(second["out"].clone(), lora_shrink(**shrink_kw), **expand_kw)
    check_add(out, second, TOL[torch.bfloat16])


def _unfused_case(quant, M, device, L=4, r=16, r2=8, seed=0, E=8, N=128, K=256, topk=4):
    """UnfusedOAITritonExperts on ``quant`` weights with L adapters (ranks r and r2 for the two GEMMs) on a device
    (``experts_on(device)``), and its inputs (x, topk_weights, topk_ids, token_lora_mapping) on the CPU."""
    torch.manual_seed(seed)
    w = random_experts(E, K, N, quant, torch.bfloat16, "cpu", bias=True)
    lora = LoRAWeights(*[(torch.randn(*s) * 0.05).to(torch.bfloat16) for s in
                         ((L, E, r, K), (L, E, 2 * N, r), (L, E, r2, N), (L, E, K, r2))])
    weights, ids = random_routing(M, E, topk)
    mapping = torch.randint(-1, L, (M,), dtype=torch.int32)
    mapping[0] = 0  # at least one token with an adapter
    x = torch.randn(M, K).to(torch.bfloat16)

    def experts_on(dev):
        # the classes hold [E, in, out] views of the ops' [E, out, in] stacks
        moved = {k: None if v is None else v.to(dev).transpose(1, 2) if v.dim() == 3 else v.to(dev)
                 for k, v in w.items()}
        return UnfusedOAITritonExperts(moved["w1"], moved["w2"], quant=quant, w1_scale=moved["w1_scale"],
                                       w2_scale=moved["w2_scale"], w1_bias=moved["w1_bias"],
                                       w2_bias=moved["w2_bias"], activation="swigluoai",
                                       lora=LoRAWeights(*[t.to(dev) for t in vars(lora).values()]))

    return experts_on, (x, weights, ids, mapping)


# GPU against CPU per format. fp8 block: expert_gemm2 quantizes its bf16 input (the activation plus the LoRA term) to
# e4m3, so where the two devices' bf16 values differ by one rounding the e4m3 value moves a whole step (2^-4 to 2^-3
# relative); measured 1.12e-2 at M = 1 on the H100 (one token, 4 slots of 128 values). The adapters move the
# outputs by 18-28% (CPU, these cases): a missing or misapplied term is far outside either bound.
UNFUSED_LORA_TOL = {"none": 1e-2, "mxfp4": 1e-2, "fp8_block": 3e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ["none", "mxfp4", "fp8_block"])
@pytest.mark.parametrize("M", [1, 300])
def test_cuda_unfused_with_lora_on_every_format(quant, M):
    experts_on, inputs = _unfused_case(quant, M, "cuda", seed=M)
    x, weights, ids, mapping = inputs
    cpu = experts_on("cpu").apply(x, weights, ids, token_lora_mapping=mapping)
    gpu = experts_on("cuda").apply(*[t.cuda() for t in inputs[:3]], token_lora_mapping=mapping.cuda())
    err = rel_err(gpu.cpu(), cpu)
    assert err < UNFUSED_LORA_TOL[quant], f"rel_err {err:.3e} against the CPU path"
    base = experts_on("cuda").apply(*[t.cuda() for t in inputs[:3]])
    none = mapping < 0
    assert torch.equal(gpu.cpu()[none], base.cpu()[none])
    assert rel_err(gpu.cpu()[~none], base.cpu()[~none]) > 2e-2, "the adapters must change the tokens that have one"


@pytest.mark.cuda
def test_cuda_side_stream_shrink_is_joined(monkeypatch):
    """Above the direct schedule the LoRA grouping and shrink run on a side stream beside the GEMM: with the side
    stream held back (a GPU sleep at its start), the expand still waits for them, on the default stream and on a
    user stream, and the outputs are bitwise those of an undelayed call."""
    import moe_extension.kernels.lora as kl

    experts_on, inputs = _unfused_case("none", 300, "cuda", seed=11)
    experts = experts_on("cuda")
    x, weights, ids, mapping = (t.cuda() for t in inputs)
    expected = experts.apply(x, weights, ids, token_lora_mapping=mapping)
    real = kl.side_stream
    entered = []

    @contextlib.contextmanager
    def delayed(device):
        entered.append(device)
        with real(device) as side:
            torch.cuda._sleep(20_000_000)  # ~10 ms of the side stream before its launches
            yield side

    monkeypatch.setattr(kl, "side_stream", delayed)
    assert torch.equal(experts.apply(x, weights, ids, token_lora_mapping=mapping), expected)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        out = experts.apply(x, weights, ids, token_lora_mapping=mapping).clone()
    torch.cuda.current_stream().wait_stream(user)
    assert torch.equal(out, expected)
    assert len(entered) == 4, "both GEMMs of both calls must have forked through the delayed side stream"


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 300])
def test_cuda_graph_replays_with_changed_adapters_and_mapping(M):
    experts_on, inputs = _unfused_case("none", M, "cuda", seed=7 + M)
    experts = experts_on("cuda")
    lora = experts.lora
    static = [t.cuda() for t in inputs] + [t for t in vars(lora).values()]

    def call(s):
        return experts.apply(s[0], s[1], s[2], token_lora_mapping=s[3])

    def fresh():
        _, new = _unfused_case("none", M, "cpu", seed=int(torch.randint(0, 10**6, ())))
        x, weights, ids, mapping = (t.cuda() for t in new)
        adapters = [torch.randn_like(t) * 0.05 for t in vars(lora).values()]
        return [x, weights, ids, mapping, *adapters]

    assert_graph_replays_match_eager(call, static, fresh)


@pytest.mark.cuda
def test_cuda_compiles_with_dynamic_tokens_without_recompiles():
    experts_on, _ = _unfused_case("none", 4, "cuda")
    experts = experts_on("cuda")

    def run(x, weights, ids, mapping):
        return experts.apply(x, weights, ids, token_lora_mapping=mapping)

    compiled = torch.compile(run, fullgraph=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (3, 70, 300):
            _, inputs = _unfused_case("none", M, "cpu", seed=M)
            args = [t.cuda() for t in inputs]
            for t in args:
                torch._dynamo.mark_dynamic(t, 0)
            assert torch.equal(compiled(*args), run(*args))


@pytest.mark.cuda
def test_cuda_reduce_overhead_records_the_side_stream():
    """torch.compile(mode="reduce-overhead") captures the LoRA term's side stream (fork and join) in its CUDA graph:
    replays with new inputs at M = 300 (the sorted schedule: the shrink beside the GEMM) equal eager bitwise."""
    experts_on, _ = _unfused_case("none", 300, "cuda")
    experts = experts_on("cuda")

    def run(x, weights, ids, mapping):
        return experts.apply(x, weights, ids, token_lora_mapping=mapping)

    torch._dynamo.reset()
    compiled = torch.compile(run, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        _, inputs = _unfused_case("none", 300, "cpu", seed=100 + seed)
        args = [t.cuda() for t in inputs]
        assert torch.equal(compiled(*args).clone(), run(*args))
