"""Bad inputs to the routed-expert ops: each raises a clear error naming the argument, with the exception type
and message asserted, eagerly and (a subset) under torch.compile(fullgraph=True), where the fake runs the
same checks at trace time."""

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from moe_extension.ops import (add_lora, expert_gemm1, expert_gemm2, fused_experts, fused_moe, lora_expand,
                               lora_shrink, topk_softmax)
from tests.reference import random_experts, random_routing

E, K, N, M, TOPK = 4, 64, 32, 3, 2
OPS = {"fused_experts": fused_experts, "fused_moe": fused_moe, "topk_softmax": topk_softmax,
       "expert_gemm1": expert_gemm1, "expert_gemm2": expert_gemm2, "lora_shrink": lora_shrink,
       "lora_expand": lora_expand, "add_lora": add_lora}
LORA_OPS = ("lora_shrink", "lora_expand", "add_lora")
L, R = 2, 3  # adapters, rank


def valid_args(op: str, quant: str = "none") -> dict[str, Any]:
    """Valid keyword arguments for ``op`` (E 4, K 64, N 32, M 3, topk 2)."""
    w = random_experts(E, K, N, quant, bias=True)
    topk_weights, topk_ids = random_routing(M, E, TOPK, invalid=0.0)
    x = torch.randn(M, K)
    if op == "topk_softmax":
        return {"gating_output": torch.randn(M, E), "topk": TOPK, "renormalize": True}
    if op in LORA_OPS:
        slots = {"topk_ids": topk_ids, "token_lora_mapping": torch.tensor([0, -1, 1], dtype=torch.int32)}
        a, b = torch.randn(L, E, R, K), torch.randn(L, E, 2 * N, R)
        if op == "lora_shrink":
            return dict(x=x, lora_a=a, **slots)
        out = torch.randn(M, TOPK, 2 * N)
        if op == "lora_expand":
            return dict(out=out, u=torch.randn(M, TOPK, R), lora_b=b, **slots, topk_weights=topk_weights)
        return dict(out=out, x=x, lora_a=a, lora_b=b, **slots, topk_weights=topk_weights)
    if op == "expert_gemm1":
        return {"hidden_states": x, "w1": w["w1"], "topk_ids": topk_ids, "w1_bias": w["w1_bias"],
                "topk_weights": topk_weights, "quant": quant, "w1_scale": w["w1_scale"]}
    if op == "expert_gemm2":
        return {"intermediate": torch.randn(M, TOPK, N), "w2": w["w2"], "topk_ids": topk_ids,
                "w2_bias": w["w2_bias"], "topk_weights": topk_weights, "quant": quant, "w2_scale": w["w2_scale"]}
    common = {"hidden_states": x, "w1": w["w1"], "w2": w["w2"], "activation": "silu", "w1_bias": w["w1_bias"],
              "w2_bias": w["w2_bias"], "quant": quant, "w1_scale": w["w1_scale"], "w2_scale": w["w2_scale"]}
    if op == "fused_moe":
        return dict(common, gating_output=torch.randn(M, E), topk=TOPK, renormalize=False)
    return dict(common, topk_weights=topk_weights, topk_ids=topk_ids)


class Case(NamedTuple):
    op: str
    quant: str
    changes: dict[str, Callable[[dict], Any]]  # argument -> new value computed from the valid arguments
    error: type
    message: str
    compiled: bool = False  # also checked under torch.compile


def _meta(name):
    return lambda a: a[name].to("meta")


CASES = {
    # dtypes
    "hidden_int": Case("fused_experts", "none", {"hidden_states": lambda a: a["hidden_states"].int()}, TypeError,
                       "fused_experts: hidden_states must have dtype float32 or float16 or bfloat16, got torch.int32",
                       True),
    "hidden_f64": Case("fused_experts", "none", {"hidden_states": lambda a: a["hidden_states"].double()}, TypeError,
                       "hidden_states must have dtype float32 or float16 or bfloat16, got torch.float64"),
    "w1_dtype": Case("fused_experts", "none", {"w1": lambda a: a["w1"].half()}, TypeError,
                     "fused_experts: w1 must have dtype float32, got torch.float16", True),
    "w2_dtype": Case("fused_experts", "none", {"w2": lambda a: a["w2"].bfloat16()}, TypeError,
                     "fused_experts: w2 must have dtype float32, got torch.bfloat16"),
    "topk_weights_dtype": Case("fused_experts", "none", {"topk_weights": lambda a: a["topk_weights"].half()},
                               TypeError, "fused_experts: topk_weights must have dtype float32, got torch.float16",
                               True),
    "topk_ids_dtype": Case("fused_experts", "none", {"topk_ids": lambda a: a["topk_ids"].float()}, TypeError,
                           "fused_experts: topk_ids must have dtype int32 or int64, got torch.float32"),
    "expert_map_dtype": Case("fused_experts", "none", {"expert_map": lambda a: torch.arange(E)}, TypeError,
                             "fused_experts: expert_map must have dtype int32, got torch.int64", True),
    "w1_bias_dtype": Case("fused_experts", "none", {"w1_bias": lambda a: a["w1_bias"].bfloat16()}, TypeError,
                          "fused_experts: w1_bias must have dtype float32, got torch.bfloat16"),
    "w2_bias_dtype": Case("fused_experts", "none", {"w2_bias": lambda a: a["w2_bias"].double()}, TypeError,
                          "fused_experts: w2_bias must have dtype float32, got torch.float64"),
    "fp8_w1_dtype": Case("fused_experts", "fp8_block", {"w1": lambda a: a["w1"].float()}, TypeError,
                         "fused_experts: w1 must have dtype float8_e4m3fn, got torch.float32"),
    "fp8_scale_dtype": Case("fused_experts", "fp8_block", {"w2_scale": lambda a: a["w2_scale"].bfloat16()},
                            TypeError, "fused_experts: w2_scale must have dtype float32 or uint8, got torch.bfloat16"),
    "fp8_scale_formats_mixed": Case("fused_experts", "fp8_block",
                                    {"w2_scale": lambda a: torch.full_like(a["w2_scale"], 127, dtype=torch.uint8)},
                                    ValueError, "fused_experts: w1_scale and w2_scale must both be fp32 or both "
                                    "uint8 UE8M0 (the scale format also sets how the activations are quantized), "
                                    "got torch.float32 and torch.uint8"),
    "mxfp4_w2_dtype": Case("fused_experts", "mxfp4", {"w2": lambda a: a["w2"].to(torch.int8)}, TypeError,
                           "fused_experts: w2 must have dtype uint8, got torch.int8"),
    "mxfp4_scale_dtype": Case("fused_experts", "mxfp4", {"w1_scale": lambda a: a["w1_scale"].float()}, TypeError,
                              "fused_experts: w1_scale must have dtype uint8, got torch.float32"),
    # E / K / N mismatches
    "hidden_3d": Case("fused_experts", "none", {"hidden_states": lambda a: a["hidden_states"][None]},
                      RuntimeError, "fused_experts: hidden_states must be 2-D [M, K], got shape [1, 3, 64]"),
    "w1_K": Case("fused_experts", "none", {"w1": lambda a: torch.randn(E, 2 * N, K + 1)}, RuntimeError,
                 "fused_experts: w1 must have shape [E, 2N, K] = [4, 64, 64], got [4, 64, 65]", True),
    "w1_2N": Case("fused_experts", "none", {"w1": lambda a: torch.randn(E, N, K)}, RuntimeError,
                  "fused_experts: w1 must have shape [E, 2N, K] = [4, 64, 64], got [4, 32, 64]"),
    "w2_E": Case("fused_experts", "none", {"w2": lambda a: torch.randn(E + 1, K, N)}, RuntimeError,
                 "fused_experts: w2 must have shape [E, K, N] = [4, 64, 32], got [5, 64, 32]", True),
    "w2_K": Case("fused_experts", "none", {"w2": lambda a: torch.randn(E, K - 1, N)}, RuntimeError,
                 "fused_experts: w2 must have shape [E, K, N] = [4, 64, 32], got [4, 63, 32]"),
    "w2_N": Case("fused_experts", "none", {"w2": lambda a: torch.randn(E, K, N + 1)}, RuntimeError,
                 "fused_experts: w1 must have shape [E, 2N, K] = [4, 66, 64], got [4, 64, 64]"),
    "w1_bias_shape": Case("fused_experts", "none", {"w1_bias": lambda a: torch.randn(E, N)}, RuntimeError,
                          "fused_experts: w1_bias must have shape [E, 2N] = [4, 64], got [4, 32]", True),
    "w2_bias_shape": Case("fused_experts", "none", {"w2_bias": lambda a: torch.randn(E + 1, K)}, RuntimeError,
                          "fused_experts: w2_bias must have shape [E, K] = [4, 64], got [5, 64]"),
    # routing tensors
    "topk_weights_shape": Case("fused_experts", "none", {"topk_weights": lambda a: torch.rand(M, TOPK + 1)},
                               RuntimeError,
                               "fused_experts: topk_weights must have shape [M, topk] like topk_ids = [3, 2], "
                               "got [3, 3]",
                               True),
    "topk_ids_M": Case("fused_experts", "none",
                       {"topk_ids": lambda a: torch.zeros(M + 1, TOPK, dtype=torch.int32)}, RuntimeError,
                       "fused_experts: topk_ids must have shape [M, topk] = [3, 2], got [4, 2]"),
    "topk_ids_1d": Case("fused_experts", "none", {"topk_ids": lambda a: a["topk_ids"][:, 0]}, RuntimeError,
                        "fused_experts: topk_ids must be 2-D [M, topk], got shape [3]"),
    "topk_zero": Case("fused_experts", "none", {"topk_ids": lambda a: a["topk_ids"][:, :0],
                                                "topk_weights": lambda a: a["topk_weights"][:, :0]},
                      RuntimeError, "fused_experts: topk_ids must have topk >= 1 columns, got 0"),
    "expert_map_2d": Case("fused_experts", "none", {"expert_map": lambda a: torch.zeros(2, E, dtype=torch.int32)},
                          RuntimeError, "fused_experts: expert_map must be 1-D [E_global], got shape [2, 4]"),
    "expert_map_empty": Case("fused_experts", "none", {"expert_map": lambda a: torch.zeros(0, dtype=torch.int32)},
                             RuntimeError, "fused_experts: expert_map must have E_global >= 1 entries, got 0"),
    # names
    "activation": Case("fused_experts", "none", {"activation": lambda a: "relu"}, ValueError,
                       "fused_experts: activation must be one of ('silu', 'gelu', 'gelu_tanh', 'swigluoai', "
                       "'swiglustep'), got 'relu'", True),
    "quant": Case("fused_experts", "none", {"quant": lambda a: "int4"}, ValueError,
                  "fused_experts: quant must be one of ('none', 'fp8_block', 'mxfp4', 'mxfp4_mma'), got 'int4'", True),
    "backend": Case("fused_experts", "none", {"backend": lambda a: "cutlass"}, ValueError,
                    "fused_experts: backend must be one of ('auto', 'torch', 'triton', 'triton_kernels', 'deep_gemm'), "
                    "got 'cutlass'"),
    "backend_triton_cpu": Case("fused_experts", "none", {"backend": lambda a: "triton"}, ValueError,
                               "fused_experts: backend='triton' needs CUDA tensors, got hidden_states on cpu", True),
    "backend_tk_cpu": Case("fused_experts", "none", {"backend": lambda a: "triton_kernels"}, ValueError,
                           "fused_experts: backend='triton_kernels' needs CUDA tensors, got hidden_states on cpu"),
    # scales and block layouts
    "fp8_scale_missing": Case("fused_experts", "fp8_block", {"w1_scale": lambda a: None}, ValueError,
                              "fused_experts: quant='fp8_block' needs w1_scale (the w1 scales)"),
    "fp8_scale_shape": Case("fused_experts", "fp8_block", {"w1_scale": lambda a: torch.ones(E, 2, 1)},
                            RuntimeError, "fused_experts: w1_scale must have shape [E, ceil(rows/128), "
                            "ceil(cols/128)] = [4, 1, 1], got [4, 2, 1]", True),
    "fp8_w2_scale_E": Case("fused_experts", "fp8_block", {"w2_scale": lambda a: torch.ones(E - 1, 1, 1)},
                           RuntimeError, "fused_experts: w2_scale must have shape [E, ceil(rows/128), "
                           "ceil(cols/128)] = [4, 1, 1], got [3, 1, 1]"),
    "scale_without_quant": Case("fused_experts", "none", {"w2_scale": lambda a: torch.ones(E, 1, 1)}, ValueError,
                                "fused_experts: w2_scale is only used with a quantized format (quant='fp8_block', "
                                "'mxfp4' or 'mxfp4_mma'), got quant='none'"),
    "mxfp4_K": Case("fused_experts", "mxfp4", {"hidden_states": lambda a: torch.randn(M, 48)}, ValueError,
                    "fused_experts: quant='mxfp4' needs K (hidden_states.shape[1]) to be a multiple of 32, got 48",
                    True),
    "mxfp4_N": Case("fused_experts", "mxfp4", {"w2": lambda a: a["w2"][:, :, :8]}, ValueError,
                    "fused_experts: quant='mxfp4' needs N (2 * w2.shape[2], w2 being packed [E, K, N/2]) to be a "
                    "multiple of 32, got 16"),
    "mxfp4_unpacked_w1": Case("fused_experts", "mxfp4", {"w1": lambda a: torch.zeros(E, 2 * N, K, dtype=torch.uint8)},
                              RuntimeError, "fused_experts: w1 must have shape [E, 2N, K/2] = [4, 64, 32], got "
                              "[4, 64, 64]"),
    "mxfp4_scale_shape": Case("fused_experts", "mxfp4",
                              {"w2_scale": lambda a: torch.zeros(E, K, N // 16, dtype=torch.uint8)}, RuntimeError,
                              "fused_experts: w2_scale must have shape [E, rows, cols/32] = [4, 64, 1], "
                              "got [4, 64, 2]"),
    # devices ("meta" stands in for a second device)
    "w1_device": Case("fused_experts", "none", {"w1": _meta("w1")}, RuntimeError,
                      "fused_experts: w1 must be on the device of hidden_states (cpu), got meta", True),
    "topk_ids_device": Case("fused_experts", "none", {"topk_ids": _meta("topk_ids")}, RuntimeError,
                            "fused_experts: topk_ids must be on the device of hidden_states (cpu), got meta"),
    "w2_bias_device": Case("fused_experts", "none", {"w2_bias": _meta("w2_bias")}, RuntimeError,
                           "fused_experts: w2_bias must be on the device of hidden_states (cpu), got meta"),
    "scale_device": Case("fused_experts", "fp8_block", {"w1_scale": _meta("w1_scale")}, RuntimeError,
                         "fused_experts: w1_scale must be on the device of hidden_states (cpu), got meta"),
    # topk_softmax
    "topk_0": Case("topk_softmax", "none", {"topk": lambda a: 0}, ValueError,
                   "topk_softmax: topk must be in [1, E] = [1, 4], got 0"),
    "topk_gt_E": Case("topk_softmax", "none", {"topk": lambda a: E + 1}, ValueError,
                      "topk_softmax: topk must be in [1, E] = [1, 4], got 5", True),
    "gating_dtype": Case("topk_softmax", "none", {"gating_output": lambda a: a["gating_output"].double()},
                         TypeError, "topk_softmax: gating_output must have dtype float32 or float16 or bfloat16, got "
                         "torch.float64"),
    "gating_1d": Case("topk_softmax", "none", {"gating_output": lambda a: a["gating_output"][0]}, RuntimeError,
                      "topk_softmax: gating_output must be 2-D [M, E], got shape [4]"),
    # fused_moe
    "moe_gating_E": Case("fused_moe", "none", {"gating_output": lambda a: torch.randn(M, E + 1)}, RuntimeError,
                         "fused_moe: gating_output must have shape [M, E_global = w1.shape[0]] = [3, 4], got [3, 5]",
                         True),
    "moe_gating_map": Case("fused_moe", "none", {"expert_map": lambda a: torch.arange(6, dtype=torch.int32)},
                           RuntimeError, "fused_moe: gating_output must have shape [M, E_global = "
                           "expert_map.shape[0]] = [3, 6], got [3, 4]"),
    "moe_gating_M": Case("fused_moe", "none", {"gating_output": lambda a: torch.randn(M + 2, E)}, RuntimeError,
                         "fused_moe: gating_output must have shape [M, E_global = w1.shape[0]] = [3, 4], got [5, 4]"),
    "moe_topk": Case("fused_moe", "none", {"topk": lambda a: 9}, ValueError,
                     "fused_moe: topk must be in [1, E] = [1, 4], got 9"),
    "moe_w2": Case("fused_moe", "fp8_block", {"w2": lambda a: a["w2"].float()}, TypeError,
                   "fused_moe: w2 must have dtype float8_e4m3fn, got torch.float32"),
    # expert_gemm1 / expert_gemm2
    "gemm1_K": Case("expert_gemm1", "none", {"w1": lambda a: torch.randn(E, 2 * N, K + 2)}, RuntimeError,
                    "expert_gemm1: w1 must have shape [E, 2N, K] = [4, 64, 64], got [4, 64, 66]", True),
    "gemm1_bias": Case("expert_gemm1", "none", {"w1_bias": lambda a: torch.randn(E, 2 * N + 1)}, RuntimeError,
                       "expert_gemm1: w1_bias must have shape [E, 2N] = [4, 64], got [4, 65]"),
    "gemm1_mxfp4_K": Case("expert_gemm1", "mxfp4", {"hidden_states": lambda a: torch.randn(M, 40)}, ValueError,
                          "expert_gemm1: quant='mxfp4' needs K (hidden_states.shape[1]) to be a multiple of 32, "
                          "got 40"),
    "gemm2_N": Case("expert_gemm2", "none", {"intermediate": lambda a: torch.randn(M, TOPK, N + 3)}, RuntimeError,
                    "expert_gemm2: w2 must have shape [E, K, N] = [4, 64, 35], got [4, 64, 32]", True),
    "gemm2_topk": Case("expert_gemm2", "none", {"intermediate": lambda a: torch.randn(M, TOPK + 1, N)},
                       RuntimeError, "expert_gemm2: topk_ids must have shape [M, topk] = [3, 3], got [3, 2]"),
    "gemm2_dtype": Case("expert_gemm2", "fp8_block", {"intermediate": lambda a: a["intermediate"].long()},
                        TypeError, "expert_gemm2: intermediate must have dtype float32 or float16 or bfloat16, got "
                        "torch.int64"),
    "gemm2_weights_shape": Case("expert_gemm2", "none", {"topk_weights": lambda a: torch.rand(M, 1)}, RuntimeError,
                                "expert_gemm2: topk_weights must have shape [M, topk] like topk_ids = [3, 2], got "
                                "[3, 1]"),
    # LoRA ops
    "lora_a_K": Case("add_lora", "none", {"lora_a": lambda a: torch.randn(L, E, R, K - 4)}, RuntimeError,
                     f"add_lora: lora_a must have shape [L, E, r, K] = [2, 4, 3, {K}], got [2, 4, 3, {K - 4}]", True),
    "lora_b_rank": Case("add_lora", "none", {"lora_b": lambda a: torch.randn(L, E, 2 * N, R + 2)}, RuntimeError,
                        "add_lora: lora_b must have shape [L, E, n, r] = [2, 4, 64, 3], got [2, 4, 64, 5]"),
    "lora_mapping_dtype": Case("lora_shrink", "none", {"token_lora_mapping": lambda a: torch.zeros(M)}, TypeError,
                               "lora_shrink: token_lora_mapping must have dtype int32 or int64, got torch.float32",
                               True),
    "lora_mapping_shape": Case("add_lora", "none",
                               {"token_lora_mapping": lambda a: torch.zeros(M + 1, dtype=torch.int32)}, RuntimeError,
                               "add_lora: token_lora_mapping must have shape [M] = [3], got [4]", True),
    "lora_u_dtype": Case("lora_expand", "none", {"u": lambda a: a["u"].bfloat16()}, TypeError,
                         "lora_expand: u must have dtype float32, got torch.bfloat16"),
    "lora_x_slots": Case("lora_shrink", "none", {"x": lambda a: torch.randn(M, TOPK + 1, K)}, RuntimeError,
                         "lora_shrink: topk_ids must have shape [M, topk] = [3, 3], got [3, 2]"),
    "lora_zero_rank": Case("lora_shrink", "none", {"lora_a": lambda a: torch.randn(L, E, 0, K)}, RuntimeError,
                           f"lora_shrink: lora_a must have L, E, rows and cols >= 1, got shape [2, 4, 0, {K}]"),
    "lora_weights_shape": Case("lora_expand", "none", {"topk_weights": lambda a: torch.rand(M, TOPK, 1)},
                               RuntimeError, "lora_expand: topk_weights must have shape [M, topk] like topk_ids"),
}


def _build(case: Case) -> dict[str, Any]:
    args = valid_args(case.op, case.quant)
    changed = {name: make(args) for name, make in case.changes.items()}
    return dict(args, **changed)


def test_enough_cases():
    assert len(CASES) >= 25 and sum(c.compiled for c in CASES.values()) >= 10


@pytest.mark.parametrize(
    "op,quant", [(op, q) for op in sorted(OPS) for q in ("none", "fp8_block", "mxfp4")
                 if op not in ("topk_softmax", *LORA_OPS)] + [(op, "none") for op in ("topk_softmax", *LORA_OPS)],
)
def test_valid_arguments_pass(op, quant):
    OPS[op](**valid_args(op, quant))


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager(name):
    case = CASES[name]
    with pytest.raises(case.error, match=re.escape(case.message)):
        OPS[case.op](**_build(case))


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.compiled))
def test_compiled(name):
    """The fake raises the same error at trace time; Dynamo wraps it (TorchRuntimeError, a RuntimeError)."""
    case = CASES[name]
    torch._dynamo.reset()
    op = OPS[case.op]
    compiled = torch.compile(lambda kwargs: op(**kwargs), fullgraph=True)
    with pytest.raises(RuntimeError) as info:
        compiled(_build(case))
    assert f"{case.error.__name__}(" in str(info.value)
    assert re.search(re.escape(case.message), str(info.value).replace("\\'", "'")), str(info.value)


@pytest.mark.parametrize("op", sorted(OPS))
def test_valid_arguments_take_the_fast_path(op, monkeypatch):
    """Valid eager arguments never reach torch._check* (about 3 us a call of host time each; ``arg_checks``' NOTE):
    ``require*`` returns on a plain True. Failing conditions still raise through them (``test_eager``)."""
    args = valid_args(op, "fp8_block" if op not in ("topk_softmax", *LORA_OPS) else "none")
    reached = []
    for name in ("_check", "_check_value", "_check_type", "_check_with"):
        real = getattr(torch, name)

        def counted(*a, _name=name, _real=real, **k):
            reached.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, counted)
    OPS[op](**args)
    assert reached == []
