"""grouped_topk (DeepSeek routing) against the fp64 reference written from the spec (tests/reference.py):

- the op (PyTorch on CPU, the Triton kernel on CUDA) over E in {8, 64, 160, 256, 512} x every group count in
  {1, 2, 4, 8, 16} that divides E x topk_group (one, half, all groups) x topk (1, 6, 8, ...) x softmax/sigmoid
  x with/without a correction bias x renormalize x routed_scaling_factor;
- the Triton kernel itself (Triton's interpreter on CPU tensors without CUDA, the GPU with it) at small sizes,
  the DeepSeek-V2/V2-Lite/V3 settings among them, strided inputs, half-precision logits, NaN rows, M = 0;
- ties (many equal logits) to the lower group and the lower expert id; the bias moves the choice, never the
  weights; G = g = 1, no bias, softmax is topk_softmax; opcheck; torch.compile(fullgraph=True) without
  recompiles; bad inputs raise errors naming the argument, eagerly and at trace time.
"""

import itertools

import pytest
import torch

from moe_extension.kernels import grouped_topk_triton
from moe_extension.ops import grouped_topk, grouped_topk_torch, topk_softmax
from tests.reference import grouped_topk_reference
from tests.utils import DEVICES, INTERPRETED

KERNEL_DEVICE = "cuda" if "cuda" in DEVICES else "cpu"
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE == "cpu" and not INTERPRETED,
                                  reason="needs CUDA or the Triton interpreter")

NUM_EXPERTS = (8, 64, 160, 256, 512)
GROUP_COUNTS = (1, 2, 4, 8, 16)
EXPERTS_AND_GROUPS = [(e, g) for e in NUM_EXPERTS for g in GROUP_COUNTS if e % g == 0]
# Weights against the fp64 reference: fp32 math; on the H100 the Triton kernel's softmax over E = 512 (exp2-based
# exponentials) was 1.3e-6 off in one of 72 weights, the CPU path within 1e-6.
WEIGHT_RTOL = 4e-6


def routing_kwargs(num_expert_group=1, topk_group=1, scoring_func="softmax", bias=None, scale=1.0):
    return {"num_expert_group": num_expert_group, "topk_group": topk_group, "scoring_func": scoring_func,
            "e_score_correction_bias": bias, "routed_scaling_factor": scale}


def random_bias(num_experts: int, scoring_func: str, device="cpu") -> torch.Tensor:
    """fp32 [E] of the magnitude of the scores' spread (softmax scores are ~1/E), so that it moves the choice."""
    spread = 2.0 / num_experts if scoring_func == "softmax" else 0.1
    return (torch.randn(num_experts) * spread).to(device)


def group_and_k_choices(num_experts: int, groups: int):
    """(topk_group, topk): one, half and all of the groups; topk 1, 6, 8 and min(9, kept experts), where they fit
    (so topk = every kept expert when the groups are small)."""
    size = num_experts // groups
    for kept in sorted({1, max(1, groups // 2), groups}):
        for topk in sorted({1, 6, 8, min(kept * size, 9)}):
            if topk <= kept * size:
                yield kept, topk


def assert_matches_reference(weights, ids, logits, topk, renormalize, kwargs):
    ref_w, ref_ids = grouped_topk_reference(logits, topk, renormalize, **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], topk)
    assert torch.equal(ids.cpu().long(), ref_ids), f"ids {ids.tolist()} != reference {ref_ids.tolist()}"
    torch.testing.assert_close(weights.cpu().double(), ref_w, rtol=WEIGHT_RTOL, atol=1e-12)


# ---------------------------------------------------------------------------------------------- the op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts,groups,with_bias", [
    (e, g, with_bias) for e, g in EXPERTS_AND_GROUPS for with_bias in (False, True) if not with_bias or e // g >= 2
])
def test_op_matches_reference(device, num_experts, groups, with_bias, scoring_func):
    torch.manual_seed(num_experts * 31 + groups)
    logits = (torch.randn(12, num_experts) * 2).to(device)
    bias = random_bias(num_experts, scoring_func, device) if with_bias else None
    for (kept, topk), renormalize, scale in itertools.product(
        group_and_k_choices(num_experts, groups), (False, True), (1.0, 2.5)
    ):
        kwargs = routing_kwargs(groups, kept, scoring_func, bias, scale)
        weights, ids = grouped_topk(logits, topk, renormalize, **kwargs)
        assert weights.is_contiguous() and ids.is_contiguous()
        assert_matches_reference(weights, ids, logits, topk, renormalize, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(device, dtype):
    logits = (torch.randn(9, 64) * 2).to(dtype).to(device)
    kwargs = routing_kwargs(8, 3, "sigmoid", random_bias(64, "sigmoid", device), 2.5)
    assert_matches_reference(*grouped_topk(logits, 6, True, **kwargs), logits, 6, True, kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits_and_bias(device):
    logits = torch.randn(160, 7, device=device).t()  # [7, 160], expert stride 7
    bias = (torch.randn(320, device=device) * 0.1)[::2]
    kwargs = routing_kwargs(8, 3, "sigmoid", bias, 2.5)
    assert_matches_reference(*grouped_topk(logits, 6, True, **kwargs), logits, 6, True, kwargs)


def tied_logits(m: int, num_experts: int, device="cpu") -> torch.Tensor:
    """Integer logits in [0, 3]: many equal scores inside and across groups. (Non-negative, so that no two
    different pairs have mathematically equal score sums, which fp32 and fp64 could round apart.)"""
    return torch.randint(0, 4, (m, num_experts)).float().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("num_experts,groups,kept,topk", [(16, 4, 2, 3), (64, 8, 4, 8), (256, 8, 4, 8),
                                                          (160, 16, 3, 6), (512, 16, 16, 8)])
def test_ties_go_to_the_lower_group_and_id(device, num_experts, groups, kept, topk, scoring_func, with_bias):
    torch.manual_seed(num_experts + topk)
    logits = tied_logits(24, num_experts, device)
    logits[0] = 0.0  # everything tied: the first `kept` groups, then ids 0..topk-1
    bias = torch.full((num_experts,), 0.125, device=device) if with_bias else None  # keeps equal scores equal
    kwargs = routing_kwargs(groups, kept, scoring_func, bias)
    weights, ids = grouped_topk(logits, topk, True, **kwargs)
    assert ids[0].tolist() == list(range(topk))
    assert_matches_reference(weights, ids, logits, topk, True, kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_by_hand(device):
    # 4 groups of 2. Group maxima 1, 1, 1, 0: groups 0 and 1 kept (lower groups win the tie); experts 0 and 3
    # tie at the top (lower id first), then 1 and 2.
    logits = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], device=device)
    _, ids = grouped_topk(logits, 4, False, **routing_kwargs(4, 2, "sigmoid"))
    assert ids.tolist() == [[0, 3, 1, 2]]
    # With a bias, the top-two sums: groups 0, 1 and 2 tie, group 3 is lower; groups 0 and 1 kept.
    logits = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 1.0, -1.0, -1.0]], device=device)
    _, ids = grouped_topk(logits, 3, False, **routing_kwargs(4, 2, "sigmoid", torch.zeros(8, device=device)))
    assert ids.tolist() == [[0, 3, 1]]


@pytest.mark.parametrize("device", DEVICES)
def test_bias_moves_the_choice_not_the_weights(device):
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0], device=device)
    # 4 groups of 2, topk_group 1: the bias makes group 3 the best group, and expert 6 (higher score) first.
    weights, ids = grouped_topk(logits, 2, False, **routing_kwargs(4, 1, "sigmoid", bias, 2.0))
    assert ids.tolist() == [[6, 7]]
    torch.testing.assert_close(weights, 2.0 * torch.sigmoid(logits[:, 6:8]), rtol=1e-6, atol=0)
    # Without the bias, group 0.
    _, ids = grouped_topk(logits, 2, False, **routing_kwargs(4, 1, "sigmoid"))
    assert ids.tolist() == [[0, 1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_one_group_softmax_without_bias_is_topk_softmax(device, renormalize):
    for num_experts, topk in ((8, 2), (64, 6), (160, 6), (256, 8), (512, 8)):
        logits = (torch.randn(17, num_experts) * 2).to(device)
        weights, ids = grouped_topk(logits, topk, renormalize, **routing_kwargs(1, 1, "softmax"))
        want_w, want_ids = topk_softmax(logits, topk, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_cpu_op_is_the_torch_implementation():
    logits = torch.randn(11, 64, dtype=torch.bfloat16)
    kwargs = routing_kwargs(8, 4, "sigmoid", random_bias(64, "sigmoid"), 2.5)
    got, want = grouped_topk(logits, 6, True, **kwargs), grouped_topk_torch(logits, 6, True, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    logits = torch.empty(0, 256, device=device)
    weights, ids = grouped_topk(logits, 8, True, **routing_kwargs(8, 4, "sigmoid", torch.zeros(256, device=device)))
    assert weights.shape == ids.shape == (0, 8) and weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_opcheck(device, with_bias):
    logits = torch.randn(7, 64, device=device)
    bias = torch.randn(64, device=device) * 0.1 if with_bias else None
    kwargs = routing_kwargs(8, 3, "sigmoid" if with_bias else "softmax", bias, 2.5)
    torch.library.opcheck(torch.ops.moe_ext.grouped_topk.default, (logits, 6, True), kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_one_graph_matches_eager(device):
    torch._dynamo.reset()
    bias = torch.randn(256, device=device) * 0.1

    def route(x, b):
        return grouped_topk(x * 1.5, 8, True, num_expert_group=8, topk_group=4, scoring_func="sigmoid",
                            e_score_correction_bias=b, routed_scaling_factor=2.5)

    fn = torch.compile(route, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in (3, 17, 40):
            logits = torch.randn(m, 256, device=device)
            (got_w, got_ids), (want_w, want_ids) = fn(logits, bias), route(logits, bias)
            assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-7, rtol=0)


# ---------------------------------------------------------------------------------------------- bad inputs

E_BAD = 16
BAD_INPUTS = {
    # argument changes (from topk 2, G 4, g 2, sigmoid, bias [16] fp32), exception, message
    "groups_not_dividing_E": ({"num_expert_group": 3}, ValueError,
                              "grouped_topk: num_expert_group must be >= 1 and divide E = 16, got 3"),
    "zero_groups": ({"num_expert_group": 0}, ValueError,
                    "grouped_topk: num_expert_group must be >= 1 and divide E = 16, got 0"),
    "topk_group_above_groups": ({"topk_group": 5}, ValueError,
                                "grouped_topk: topk_group must be in [1, num_expert_group] = [1, 4], got 5"),
    "topk_group_zero": ({"topk_group": 0}, ValueError,
                        "grouped_topk: topk_group must be in [1, num_expert_group] = [1, 4], got 0"),
    "topk_above_kept_experts": ({"topk": 9}, ValueError,
                                "grouped_topk: topk must be in [1, topk_group * E / num_expert_group] = [1, 8], got 9"),
    "topk_zero": ({"topk": 0}, ValueError,
                  "grouped_topk: topk must be in [1, topk_group * E / num_expert_group] = [1, 8], got 0"),
    "bias_one_expert_per_group": ({"num_expert_group": 16, "topk_group": 4}, ValueError,
                                  "grouped_topk: e_score_correction_bias needs E / num_expert_group >= 2 experts per "
                                  "group"),
    "bias_shape": ({"e_score_correction_bias": torch.zeros(15)}, RuntimeError,
                   "grouped_topk: e_score_correction_bias must have shape [E = gating_output.shape[1]] = [16], "
                   "got [15]"),
    "bias_2d": ({"e_score_correction_bias": torch.zeros(1, 16)}, RuntimeError,
                "grouped_topk: e_score_correction_bias must have shape [E = gating_output.shape[1]] = [16], "
                "got [1, 16]"),
    "bias_dtype": ({"e_score_correction_bias": torch.zeros(16, dtype=torch.bfloat16)}, TypeError,
                   "grouped_topk: e_score_correction_bias must have dtype float32, got torch.bfloat16"),
    "bias_device": ({"e_score_correction_bias": torch.zeros(16, device="meta")}, RuntimeError,
                    "grouped_topk: e_score_correction_bias must be on the device of gating_output (cpu), got meta"),
    "scoring_func": ({"scoring_func": "tanh"}, ValueError,
                     "grouped_topk: scoring_func must be one of ('softmax', 'sigmoid'), got 'tanh'"),
    "logits_dtype": ({"gating_output": torch.zeros(3, 16, dtype=torch.int32)}, TypeError,
                     "grouped_topk: gating_output must have dtype float32 or float16 or bfloat16, got torch.int32"),
    "logits_1d": ({"gating_output": torch.zeros(16)}, RuntimeError,
                  "grouped_topk: gating_output must be 2-D [M, E], got shape [16]"),
    "too_many_experts": ({"gating_output": torch.zeros(3, 1024), "e_score_correction_bias": None}, ValueError,
                         "grouped_topk: gating_output must have E <= 512 experts (columns), got 1024"),
}


def bad_call_args(changes):
    args = {"gating_output": torch.randn(3, E_BAD), "topk": 2, "renormalize": True, "num_expert_group": 4,
            "topk_group": 2, "scoring_func": "sigmoid", "e_score_correction_bias": torch.zeros(E_BAD),
            "routed_scaling_factor": 2.5}
    args.update(changes)
    return args


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_name_the_argument(name):
    changes, error, message = BAD_INPUTS[name]
    with pytest.raises(error) as info:
        grouped_topk(**bad_call_args(changes))
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["groups_not_dividing_E", "topk_above_kept_experts", "bias_shape", "scoring_func"])
def test_bad_inputs_fail_at_trace_time(name):
    changes, error, message = BAD_INPUTS[name]
    args = bad_call_args(changes)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, b: grouped_topk(x, args["topk"], True, num_expert_group=args["num_expert_group"],
                                                 topk_group=args["topk_group"], scoring_func=args["scoring_func"],
                                                 e_score_correction_bias=b), fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(args["gating_output"], args["e_score_correction_bias"])
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------- the Triton kernel

KERNEL_CASES = {
    # M, E, G, topk_group, topk, scoring_func, bias, logits dtype
    "deepseek_v3": (5, 256, 8, 4, 8, "sigmoid", True, torch.float32),
    "deepseek_v2": (4, 160, 8, 3, 6, "softmax", False, torch.float32),
    "deepseek_v2_lite": (6, 64, 1, 1, 6, "softmax", False, torch.bfloat16),
    "e8_all_groups": (70, 8, 4, 4, 8, "sigmoid", True, torch.float32),  # two programs of 64 rows
    "e512_g16": (3, 512, 16, 4, 8, "softmax", True, torch.float32),
    "e512_g1": (2, 512, 1, 1, 8, "sigmoid", False, torch.float16),
    "groups_3_of_20": (5, 60, 3, 2, 5, "sigmoid", True, torch.float32),  # G and E / G not powers of two
    "groups_of_one": (4, 16, 16, 5, 5, "softmax", False, torch.float32),
    "e160_g16": (3, 160, 16, 16, 7, "sigmoid", True, torch.bfloat16),
}


@needs_kernel
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_reference(name):
    m, num_experts, groups, kept, topk, scoring_func, with_bias, dtype = KERNEL_CASES[name]
    torch.manual_seed(num_experts + groups + topk)
    logits = (torch.randn(m, num_experts) * 2).to(dtype).to(KERNEL_DEVICE)
    bias = random_bias(num_experts, scoring_func, KERNEL_DEVICE) if with_bias else None
    for renormalize, scale in ((False, 1.0), (True, 2.5)):
        kwargs = routing_kwargs(groups, kept, scoring_func, bias, scale)
        weights, ids = grouped_topk_triton(logits, topk, renormalize, groups, kept, scoring_func, bias, scale)
        assert_matches_reference(weights, ids, logits, topk, renormalize, kwargs)


@needs_kernel
@pytest.mark.parametrize("num_experts,groups", EXPERTS_AND_GROUPS)
def test_kernel_every_group_count(num_experts, groups):
    """One call per (E, G), the other choices rotating: half the groups kept, up to 8 of their experts."""
    case = EXPERTS_AND_GROUPS.index((num_experts, groups))
    torch.manual_seed(case)
    kept = max(1, groups // 2)
    topk = min(8, kept * num_experts // groups)
    scoring_func = ("softmax", "sigmoid")[case % 2]
    bias = random_bias(num_experts, scoring_func, KERNEL_DEVICE) if num_experts // groups >= 2 else None
    renormalize, scale = ((False, 1.0), (True, 2.5), (True, 1.0))[case % 3]
    logits = (torch.randn(3, num_experts) * 2).to(KERNEL_DEVICE)
    weights, ids = grouped_topk_triton(logits, topk, renormalize, groups, kept, scoring_func, bias, scale)
    assert_matches_reference(weights, ids, logits, topk, renormalize,
                             routing_kwargs(groups, kept, scoring_func, bias, scale))


@needs_kernel
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_kernel_ties(scoring_func, with_bias):
    torch.manual_seed(7)
    logits = tied_logits(9, 64, KERNEL_DEVICE)
    logits[0] = 0.0
    bias = torch.full((64,), 0.125, device=KERNEL_DEVICE) if with_bias else None
    weights, ids = grouped_topk_triton(logits, 8, True, 8, 3, scoring_func, bias, 1.0)
    assert ids[0].tolist() == list(range(8))
    assert_matches_reference(weights, ids, logits, 8, True, routing_kwargs(8, 3, scoring_func, bias))


@needs_kernel
def test_kernel_strided_inputs():
    logits = torch.randn(10, 2 * 96, device=KERNEL_DEVICE)[1::2, ::2]  # [5, 96], both strides > 1
    bias = (torch.randn(2 * 96, device=KERNEL_DEVICE) * 0.1)[::2]
    kwargs = routing_kwargs(6, 2, "sigmoid", bias, 2.5)
    weights, ids = grouped_topk_triton(logits, 6, False, 6, 2, "sigmoid", bias, 2.5)
    assert_matches_reference(weights, ids, logits, 6, False, kwargs)


@needs_kernel
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_kernel_nan_row_selects_invalid_ids(scoring_func):
    logits = torch.randn(3, 32, device=KERNEL_DEVICE)
    logits[1] = float("nan")
    bias = torch.zeros(32, device=KERNEL_DEVICE)
    weights, ids = grouped_topk_triton(logits, 4, True, 4, 2, scoring_func, bias, 1.0)
    assert (ids[1] >= 32).all(), "a NaN row routes nowhere (ids >= E are invalid slots downstream)"
    kwargs = routing_kwargs(4, 2, scoring_func, bias)
    assert_matches_reference(weights[::2], ids[::2], logits[::2], 4, True, kwargs)


@needs_kernel
def test_kernel_zero_tokens():
    weights, ids = grouped_topk_triton(torch.empty(0, 64, device=KERNEL_DEVICE), 6, True, 8, 3, "softmax", None, 1.0)
    assert weights.shape == ids.shape == (0, 6)
