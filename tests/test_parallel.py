"""Expert parallelism (moe_extension.parallel, moe_ext::ep_fused_experts).

Multi-process: 2, 4 and 8 gloo ranks on CPU (NCCL: 1, 2, 4 and 8 ranks, as many as there are GPUs) run the cases of
``tests/ep_worker.py`` against single-process ``fused_experts`` holding every expert. Single-process: the
row plan, the row packing and combining (PyTorch and Triton, bitwise), the placement, argument errors.
"""

from __future__ import annotations

import pytest
import torch

import moe_extension  # noqa: F401
from moe_extension.kernels._ep_rows import (
    combine_rows_triton,
    dequantize_rows_triton,
    pack_rows_triton,
    plan_rows_triton,
)
from moe_extension.parallel import ExpertPlacement, contiguous_expert_map
from moe_extension.parallel.rows import RowFormat, combine_rows_torch, pack_rows_torch, plan_rows, slot_ranks
from moe_extension.quant.fp8_block import dequantize_fp8_per_token_group
from tests.ep_worker import run_cases

# case -> (tolerance on err, extra checks). fp32 cases: the ranks' partial sums add in another order than the
# one-process slot sum (~1e-7); bf16: each rank's partial sum is rounded to bf16 once more (2^-8 relative).
CASES = {
    "random": 1e-5, "random_bf16": 1e-2, "random_fixed": 1e-5, "skewed": 1e-5, "skewed_fixed": 1e-5,
    "invalid_ids": 1e-5, "permuted_map": 1e-5, "empty_ranks": 1e-5, "empty_ranks_fixed": 1e-5,
    "on_input_bias_swigluoai": 1e-5, "fp8_dispatch": 1e-2, "quant_fp8_block": 1e-2, "quant_mxfp4": 1e-2,
    "logits": 1e-5, "compile": 1e-5,
}
SPECIAL = ["fixed_equals_exact", "deterministic", "overflow", "opcheck"]
GPU_CASES = ["random_bf16", "random_fixed", "skewed_fixed", "empty_ranks_fixed", "fp8_dispatch", "quant_fp8_block",
             "quant_mxfp4", "fixed_equals_exact", "deterministic", "overflow", "compile", "opcheck", "cuda_graph"]


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"gloo{w}")
def gloo_results(request):
    return request.param, run_cases(request.param, list(CASES) + SPECIAL)


def _ok(res: dict) -> dict:
    assert res["ok"], res.get("error")
    return res


def check_case(name: str, results: list[dict], world: int) -> None:
    if name in CASES:
        for r, res in enumerate(results):
            res = _ok(res)
            assert res["err"] <= CASES[name], (r, res)
            assert res.get("shape_ok", True), (r, res)
        if name.startswith("empty_ranks") and world > 1:
            assert [res["M"] for res in results][:2] == [6, 0]
    elif name == "fixed_equals_exact":
        # same rows in the same order: bitwise on CPU; on CUDA fused_experts may pick another tile config for the
        # padded row count, so there within the fp32 tolerance
        for res in results:
            res = _ok(res)
            assert res["equal"] if res["device"] == "cpu" else max(res["err"], res["err_fixed"]) <= 1e-5, res
    elif name in ("deterministic", "cuda_graph"):
        for res in results:
            assert _ok(res)["equal"], res
    elif name == "overflow":
        for res in results:
            assert not res["ok"], res
            assert res["error"].startswith("RuntimeError: ep_fused_experts: capacity=2 rows per (source, destination) "
                                           "rank pair is too small: rank 0 has 6 tokens with experts on rank 1"), res
    elif name == "opcheck":
        for res in results:
            _ok(res)


@pytest.mark.parametrize("name", list(CASES) + SPECIAL)
def test_gloo(gloo_results, name):
    world, results = gloo_results
    check_case(name, results[name], world)


def test_fp8_dispatch_quantizes(gloo_results):
    """The fp8 rows differ from the unquantized layer by fp8's rounding, not more and not less."""
    _, results = gloo_results
    for res in results["fp8_dispatch"]:
        assert 1e-3 < _ok(res)["err_vs_unquantized"] < 0.1, res


@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_cases(world, GPU_CASES, backend="nccl")
    for name in GPU_CASES:
        if world == 1 and name == "overflow":
            continue  # one rank never sends to another
        check_case(name, results[name], world)


# ------------------------------------------------------------------------------------------ single process

def _owner(*ranks):
    return torch.tensor(ranks, dtype=torch.int32)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: GPU, else the interpreter


@pytest.mark.parametrize("plan_fn", [plan_rows, plan_rows_triton], ids=["torch", "triton"])
def test_plan_rows_exact_and_capacity(plan_fn):
    # experts 0,1 on rank 0, 2 on rank 1, 3 on rank 2, expert 4 held by nobody
    owner = _owner(0, 0, 1, 2, -1).to(DEV)
    ids = torch.tensor([[0, 2], [1, 1], [3, -1], [2, 0], [4, 5]], dtype=torch.int32, device=DEV)
    assert slot_ranks(ids, owner, 3).tolist() == [[0, 1], [0, 0], [2, -1], [1, 0], [-1, -1]]
    plan = plan_fn(ids, owner, 3, None)
    assert plan.counts.tolist() == [3, 2, 1] and plan.demand.tolist() == [3, 2, 1]
    assert plan.slot.tolist() == [[0, 3, -1], [1, -1, -1], [-1, -1, 5], [2, 4, -1], [-1, -1, -1]]
    assert not plan.overflow.any() and plan.rows == 15
    fixed = plan_fn(ids, owner, 3, 2)
    assert fixed.slot.tolist() == [[0, 2, -1], [1, -1, -1], [-1, -1, 4], [-1, 3, -1], [-1, -1, -1]]
    assert fixed.overflow.tolist() == [False, False, False, True, False]
    assert fixed.counts.tolist() == [2, 2, 1] and fixed.demand.tolist() == [3, 2, 1] and fixed.rows == 6
    if plan_fn is plan_rows_triton:  # t * W + r of each used row
        assert plan.source[:6].tolist() == [0, 3, 9, 1, 10, 8]
        assert fixed.source[[0, 1, 2, 3, 4]].tolist() == [0, 3, 1, 10, 8]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("capacity", [None, 3])
def test_pack_and_combine_triton_match_torch(fp8, capacity):
    torch.manual_seed(0)
    M, K, topk, W = 7, 200, 3, 3
    x = torch.randn(M, 2 * K, dtype=torch.bfloat16, device=DEV)[:, ::2]  # strided rows
    weights = torch.rand(M, topk, device=DEV)
    ids = torch.randint(-1, 7, (M, topk), dtype=torch.int32, device=DEV)
    owner = _owner(0, 1, 2, 0, 1, -1).to(DEV)
    plan = plan_rows_triton(ids, owner, W, capacity)
    ref_plan = plan_rows(ids, owner, W, capacity)
    for field in ("slot", "counts", "demand", "overflow"):
        assert torch.equal(getattr(plan, field), getattr(ref_plan, field)), field
    fmt = RowFormat(K, topk, torch.bfloat16, fp8)
    assert fmt.row_bytes % 16 == 0 and fmt.meta % 16 == 0
    ref, got = pack_rows_torch(x, weights, ids, owner, plan, fmt), pack_rows_triton(x, weights, ids, owner, plan, fmt)
    used = plan.slot[plan.slot >= 0]
    sent = slice(None) if capacity else slice(0, int(plan.counts.sum()))  # exact sizes: the rest is not sent
    assert torch.equal(fmt.ids(got)[sent], fmt.ids(ref)[sent])  # padding rows: all -1
    data = (lambda b: tuple(v[used] for v in fmt.fp8_data(b))) if fp8 else (lambda b: (fmt.data(b)[used],))
    for have, want in zip(data(got) + (fmt.weights(got)[used],), data(ref) + (fmt.weights(ref)[used],)):
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))  # bitwise; padding bytes aside
    if not fp8:
        assert torch.equal(fmt.hidden_states(ref)[plan.slot[:, 1][plan.slot[:, 1] >= 0]],
                           x[plan.slot[:, 1] >= 0])
    # fp16: the interpreter's fp32 -> bf16 cast truncates (the GPU tests combine bf16)
    returned = torch.randn(plan.rows, K, dtype=torch.float16, device=DEV)
    out_ref, out = combine_rows_torch(returned, plan, torch.float16), combine_rows_triton(returned, plan, torch.float16)
    assert torch.equal(out.isnan(), out_ref.isnan()) and torch.equal(out.nan_to_num(), out_ref.nan_to_num())
    if capacity is not None:
        assert out_ref[plan.overflow].isnan().all() and not out_ref[~plan.overflow].isnan().any()


@pytest.mark.parametrize("K", [200, 1000, 2304])
def test_dequantize_rows_triton_matches_torch(K):
    # received fp8 rows (strided views of a row buffer) back to the tokens' dtype in one pass, bitwise as PyTorch;
    # bf16 only on CUDA (the interpreter's fp32 -> bf16 cast truncates)
    torch.manual_seed(K)
    R = 9
    fmt = RowFormat(K, 4, torch.bfloat16, True)
    buf = torch.randint(0, 256, (R, fmt.row_bytes), dtype=torch.uint8, device=DEV)
    q, s = fmt.fp8_data(buf)
    u = q.view(torch.uint8)
    u.copy_((u & 0x80) | ((u & 0x7F) % 0x7F))  # both signs, finite e4m3 (no NaN pattern 0x7f / 0xff)
    s.copy_(torch.logspace(-20, 20, s.numel(), base=2.0, device=DEV).reshape(s.shape))
    for dtype in (torch.float16, torch.float32) + ((torch.bfloat16,) if DEV == "cuda" else ()):
        got = dequantize_rows_triton(q, s, dtype)
        want = dequantize_fp8_per_token_group(q, s).to(dtype)
        assert got.shape == (R, K) and got.dtype == dtype
        assert torch.equal(got, want), dtype  # finite inputs: no NaN; fp16 overflow to inf must match too
    assert dequantize_rows_triton(q[:0], s[:0], torch.float16).shape == (0, K)


def test_combine_sums_in_rank_order_in_fp32():
    plan = plan_rows(torch.tensor([[0, 1]], dtype=torch.int32), _owner(0, 1), 2, None)
    returned = torch.tensor([[1.0], [2.0 ** -9]], dtype=torch.bfloat16)  # 1 + 2^-9 rounds back to 1 in bf16 ...
    out = combine_rows_torch(returned, plan, torch.float32)  # ... but not in fp32
    assert out.item() == 1.0 + 2.0 ** -9


def test_contiguous_expert_map():
    maps = [contiguous_expert_map(10, 4, r).tolist() for r in range(4)]
    assert maps[0] == [0, 1, 2] + [-1] * 7
    assert maps[3] == [-1] * 8 + [0, 1]
    assert ExpertPlacement.from_expert_maps([torch.tensor(m) for m in maps]).expert_owner.tolist() == \
        [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"contiguous_expert_map: num_experts \(2\) must be >= world_size \(4\)"):
        contiguous_expert_map(2, 4, 0)


def test_placement_errors():
    a, b = torch.tensor([0, -1, 1], dtype=torch.int32), torch.tensor([-1, 0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="ExpertPlacement: expert 2 is held by ranks 0 and 1"):
        ExpertPlacement.from_expert_maps([a, b])
    with pytest.raises(ValueError, match="rank 0's expert_map gives two experts the same local id"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, 0, -1], dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"rank 0's expert_map has local id 1, but the rank holds 1 experts"):
        ExpertPlacement.from_expert_maps([a], [1])
    with pytest.raises(ValueError, match=r"rank 1's expert_map has shape \[2\], rank 0's \[3\]"):
        ExpertPlacement.from_expert_maps([a, torch.tensor([-1, 0], dtype=torch.int32)])


def _op_args(**over):
    args = {"hidden_states": torch.randn(3, 64), "w1": torch.randn(2, 64, 64), "w2": torch.randn(2, 64, 32),
            "topk_weights": torch.rand(3, 2), "topk_ids": torch.zeros(3, 2, dtype=torch.int32),
            "expert_map": torch.tensor([0, 1, -1, -1], dtype=torch.int32),
            "expert_owner": torch.tensor([0, 0, 1, 1], dtype=torch.int32), "group_name": "no-such-group"}
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, message", [
    ({"expert_owner": torch.zeros(3, dtype=torch.int32)}, RuntimeError,
     "ep_fused_experts: expert_owner must have shape [E_global] like expert_map = [4], got [3]"),
    ({"expert_owner": torch.zeros(4, dtype=torch.int64)}, TypeError,
     "ep_fused_experts: expert_owner must have dtype int32, got torch.int64"),
    ({"capacity": 0}, ValueError,
     "ep_fused_experts: capacity must be None (exact row counts) or >= 1 rows per rank pair, got 0"),
    ({"dispatch_dtype": "fp4"}, ValueError,
     "ep_fused_experts: dispatch_dtype must be one of ('auto', 'fp8'), got 'fp4'"),
    ({"topk_ids": torch.zeros(3, 3, dtype=torch.int32)}, RuntimeError,
     "ep_fused_experts: topk_weights must have shape [M, topk] like topk_ids = [3, 3], got [3, 2]"),
    ({}, ValueError, "ep_fused_experts: group_name='no-such-group' names no process group of this process"),
])
def test_bad_arguments(over, exc, message):
    args = _op_args(**over)
    kwargs = {k: args.pop(k) for k in ("capacity", "dispatch_dtype") if k in args}
    with pytest.raises(exc) as info:
        torch.ops.moe_ext.ep_fused_experts(*args.values(), **kwargs)
    assert str(info.value).startswith(message), str(info.value)
