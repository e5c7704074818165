"""The routed experts in one op: ``moe_ext::fused_experts`` -> ``out [M, K]`` in ``hidden_states.dtype``.

``out[t] = sum_j g * (W2[e] act(W1[e] x + b1[e]) + b2[e])`` over the slots ``j`` of token ``t`` with local
expert ``e`` and router weight ``g = topk_weights[t, j]``; with ``apply_router_weight_on_input`` the
input is scaled instead: ``sum_j FFN_e(g * x)``. Shapes: ``hidden_states [M, K]`` fp32/fp16/bf16,
``w1 [E, 2N, K]``, ``w2 [E, K, N]`` (any strides; layouts per ``quant`` as in ``expert_gemm``),
``topk_weights [M, topk]`` fp32, ``topk_ids [M, topk]`` int32/int64, ``w1_bias [E, 2N]`` / ``w2_bias [E, K]``
fp32, ``expert_map [E_global]`` int32 (global id -> local id, -1 = not local). Invalid slots contribute
exactly 0. Math in fp32, one rounding at the end.

Backends (``cuda_route`` picks the CUDA implementation from shapes only; the CPU runs PyTorch):
- ``"auto"``: on CUDA our Triton kernels (every ``quant`` in ``TRITON_QUANT``), except that with
  ``quant="fp8_block"`` DeepGEMM's grouped GEMMs run where the device's stored crossover says they are faster
  for this shape and M and they are available and apply (``moe_extension.backends.deep_gemm.auto_prefers``;
  no crossover stored for the device: never);
- ``"torch"``: the PyTorch implementation; ``"triton"``: our Triton kernels (CUDA);
- ``"triton_kernels"``: OpenAI's matmul_ogs (CUDA, quant "none" or "mxfp4", optional);
- ``"deep_gemm"``: the DeepGEMM route (CUDA, quant "fp8_block", optional): RuntimeError with the reason where
  DeepGEMM is not available, ValueError naming the rule where it does not apply (``check_deep_gemm``).

``fused_experts_torch`` is the PyTorch implementation: slots grouped by expert, one GEMM pair per
active expert, only the active experts' weights dequantized.
"""

from __future__ import annotations

import torch

from moe_extension.backends import deep_gemm
from moe_extension.ops.activations import ACTIVATIONS, activation_torch
from moe_extension.ops.arg_checks import (FLOAT_DTYPES, MXFP4_QUANTS, QUANT_FORMATS, TRITON_QUANT, WEIGHT_DTYPES,
                                          ArgChecker, require, require_value)
from moe_extension.ops.expert_gemm import ExpertWeights, group_by_expert

BACKENDS = ("auto", "torch", "triton", "triton_kernels", "deep_gemm")


def check_experts(op, hidden_states, w1, w2, activation, w1_bias, w2_bias, expert_map, quant, w1_scale, w2_scale,
                  backend) -> tuple[ArgChecker, tuple]:
    """Validates everything but the routing tensors; returns the checker and (M, K, N, E)."""
    c = ArgChecker(op, "hidden_states", hidden_states)
    c.name("activation", activation, ACTIVATIONS)
    c.name("quant", quant, QUANT_FORMATS)
    c.name("backend", backend, BACKENDS)
    if backend not in ("auto", "torch"):
        supported = {"deep_gemm": ("fp8_block",), "triton_kernels": ("none", "mxfp4")}.get(backend, TRITON_QUANT)
        require_value(
            hidden_states.device.type == "cuda",
            lambda: f"{op}: backend={backend!r} needs CUDA tensors, got hidden_states on {hidden_states.device}",
        )
        require_value(
            quant in supported,
            lambda: f"{op}: backend={backend!r} supports quant in {supported}, got quant={quant!r} "
            "(use backend='auto' or 'torch')",
        )
    c.rank("hidden_states", hidden_states, FLOAT_DTYPES, "[M, K]")
    m, k = hidden_states.shape
    weight_dtypes = WEIGHT_DTYPES.get(quant, (hidden_states.dtype,))
    c.rank("w1", w1, weight_dtypes, "[E, 2N, K]")
    c.rank("w2", w2, weight_dtypes, "[E, K, N]")
    e = w1.shape[0]
    n = 2 * w2.shape[2] if quant in MXFP4_QUANTS else w2.shape[2]
    if quant in MXFP4_QUANTS:
        c.mxfp4_dim("K (hidden_states.shape[1])", k)
        c.mxfp4_dim("N (2 * w2.shape[2], w2 being packed [E, K, N/2])", n)
    c.weight("w1", w1, quant, hidden_states.dtype, "[E, 2N, K]", (e, 2 * n, k))
    c.weight("w2", w2, quant, hidden_states.dtype, "[E, K, N]", (e, k, n))
    c.scale("w1_scale", w1_scale, quant, (e, 2 * n, k), "w1")
    c.scale("w2_scale", w2_scale, quant, (e, k, n), "w2")
    if quant == "fp8_block":
        require_value(
            w1_scale.dtype == w2_scale.dtype,
            lambda: f"{op}: w1_scale and w2_scale must both be fp32 or both uint8 UE8M0 (the scale format also sets "
            f"how the activations are quantized), got {w1_scale.dtype} and {w2_scale.dtype}",
        )
    c.bias("w1_bias", w1_bias, "[E, 2N]", (e, 2 * n))
    c.bias("w2_bias", w2_bias, "[E, K]", (e, k))
    c.expert_map(expert_map)
    if backend == "deep_gemm":
        check_deep_gemm(op, w1, w2, w1_scale, w2_scale)
    return c, (m, k, n, e)


def check_deep_gemm(op: str, w1, w2, w1_scale, w2_scale) -> None:
    """``backend="deep_gemm"``: DeepGEMM available (else RuntimeError with its reason) and its route applicable
    to these weights (else ValueError naming the rules that fail); at trace time too, by the fake."""
    reason = deep_gemm.unavailable_reason()
    require(
        reason is None,
        lambda: f"{op}: backend='deep_gemm' needs DeepGEMM, which is not available here: {reason} "
        "(backend='auto' runs our Triton kernels without it)",
    )
    rules = deep_gemm.inapplicable_reasons(w1, w2, w1_scale, w2_scale)
    require_value(
        not rules,
        lambda: f"{op}: backend='deep_gemm' does not apply to these weights: {'; '.join(rules)} "
        "(backend='auto' picks an implementation that does)",
    )


def cuda_route(backend: str, quant: str, M: int, topk: int, num_global_experts: int | None, w1, w2, w1_scale,
               w2_scale) -> str:
    """The implementation a CUDA call of fused_experts runs for ``M`` tokens, ``topk`` slots and
    ``num_global_experts`` (the expert_map's length; None without one): "triton", "torch", "triton_kernels" or
    "deep_gemm" (the module docstring's backends). Shapes, dtypes and the cached crossover only: no host sync."""
    if backend in ("torch", "triton_kernels", "deep_gemm"):
        return backend
    if backend == "auto" and quant == "fp8_block" and deep_gemm.auto_prefers(M, topk, num_global_experts, w1, w2,
                                                                             w1_scale, w2_scale):
        return "deep_gemm"
    return "triton" if quant in TRITON_QUANT else "torch"


def check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias, expert_map,
                        quant, w1_scale, w2_scale, backend):
    """Validates fused_experts' arguments (fake and real implementations alike); returns (M, K)."""
    c, (m, k, _, _) = check_experts("fused_experts", hidden_states, w1, w2, activation, w1_bias, w2_bias, expert_map,
                                    quant, w1_scale, w2_scale, backend)
    c.routing(topk_ids, topk_weights, m)
    return m, k


def _fused_experts_compute(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias, expert_map,
                           apply_router_weight_on_input, quant, w1_scale, w2_scale, alpha, limit):
    # NOTE: measured on the 2-core CPU dev machine, gpt-oss-20b-sized (E 32, topk 4, K = N = 2880, bf16,
    # biases, swigluoai, weights as transposed views), M = 64, all 32 experts active: 0.5 to 2.7 s per call
    # across runs (the VM's memory bandwidth varies: the bf16 -> fp32 copy of one W1 took 5 to 20 ms). It is
    # memory-bound: per active expert one bf16 -> fp32 copy of W1/W2 and a skinny fp32 GEMM reading it
    # (~45 % each); converting and multiplying in row chunks was slower (small strided GEMMs).
    m, k = hidden_states.shape
    topk = topk_ids.shape[1]
    # Per-slot results, summed over topk at the end (fixed order: deterministic); invalid slots stay 0.
    out = torch.zeros((m * topk, k), dtype=torch.float32, device=hidden_states.device)
    gemm1 = ExpertWeights(w1, w1_scale, w1_bias, quant)
    gemm2 = ExpertWeights(w2, w2_scale, w2_bias, quant)
    x = hidden_states.float()
    g = topk_weights.reshape(-1)
    for e, slots in group_by_expert(topk_ids, expert_map, w1.shape[0]):
        xe = x[slots // topk]
        if apply_router_weight_on_input:
            xe = xe * g[slots, None]
        h = gemm1.linear(e, gemm1.gemm_input(xe))
        a = activation_torch(h, activation, alpha, limit)  # fp32, as h is
        y = gemm2.linear(e, gemm2.gemm_input(a))
        out[slots] = y if apply_router_weight_on_input else y * g[slots, None]
    return out.view(m, topk, k).sum(dim=1).to(hidden_states.dtype)


def fused_experts_torch(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None,
                        w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none",
                        w1_scale=None, w2_scale=None, alpha=1.702, limit=7.0) -> torch.Tensor:
    """The PyTorch implementation of fused_experts (any device): ``[M, K]`` in ``hidden_states.dtype``."""
    check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias, expert_map,
                        quant, w1_scale, w2_scale, "torch")
    return _fused_experts_compute(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias,
                                  expert_map, apply_router_weight_on_input, quant, w1_scale, w2_scale, alpha, limit)


torch.library.define(
    "moe_ext::fused_experts",
    "(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    'str activation="silu", *, Tensor? w1_bias=None, Tensor? w2_bias=None, Tensor? expert_map=None, '
    'bool apply_router_weight_on_input=False, str quant="none", Tensor? w1_scale=None, Tensor? w2_scale=None, '
    'float alpha=1.702, float limit=7.0, str backend="auto") -> Tensor',
)


@torch.library.register_fake("moe_ext::fused_experts")
def _fused_experts_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None,
                        w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none",
                        w1_scale=None, w2_scale=None, alpha=1.702, limit=7.0, backend="auto"):
    m, k = check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias,
                               expert_map, quant, w1_scale, w2_scale, backend)
    return hidden_states.new_empty((m, k))


@torch.library.impl("moe_ext::fused_experts", "cpu")
def _fused_experts_cpu(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None,
                       w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none",
                       w1_scale=None, w2_scale=None, alpha=1.702, limit=7.0, backend="auto"):
    check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias, expert_map,
                        quant, w1_scale, w2_scale, backend)
    return _fused_experts_compute(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias,
                                  expert_map, apply_router_weight_on_input, quant, w1_scale, w2_scale, alpha, limit)


@torch.library.impl("moe_ext::fused_experts", "cuda")
def _fused_experts_cuda(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None,
                        w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none",
                        w1_scale=None, w2_scale=None, alpha=1.702, limit=7.0, backend="auto"):
    check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias, expert_map,
                        quant, w1_scale, w2_scale, backend)
    common = {"w1_bias": w1_bias, "w2_bias": w2_bias, "expert_map": expert_map,
              "apply_router_weight_on_input": apply_router_weight_on_input, "alpha": alpha, "limit": limit}
    route = cuda_route(backend, quant, hidden_states.shape[0], topk_ids.shape[1],
                       None if expert_map is None else expert_map.shape[0], w1, w2, w1_scale, w2_scale)
    if route == "triton_kernels":
        from moe_extension.backends import triton_kernels

        if not triton_kernels.is_available():
            raise RuntimeError(
                "fused_experts: backend='triton_kernels' needs the triton_kernels package (OpenAI); "
                "it is not importable"
            )
        if quant != "none":
            common.update(quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
        return triton_kernels.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, **common)
    if route == "deep_gemm":
        return deep_gemm.fused_experts_deep_gemm(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                                 w1_scale=w1_scale, w2_scale=w2_scale, **common)
    if route == "torch":
        return _fused_experts_compute(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias,
                                      expert_map, apply_router_weight_on_input, quant, w1_scale, w2_scale, alpha,
                                      limit)
    from moe_extension.kernels import fused_experts_triton

    return fused_experts_triton(hidden_states, w1, w2, topk_weights, topk_ids, activation, quant=quant,
                                w1_scale=w1_scale, w2_scale=w2_scale, **common)


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None, w2_bias=None,
                  expert_map=None, apply_router_weight_on_input=False, quant="none", w1_scale=None, w2_scale=None,
                  alpha=1.702, limit=7.0, backend="auto") -> torch.Tensor:
    """``torch.ops.moe_ext.fused_experts``: ``out [M, K]`` in ``hidden_states.dtype`` (see the module docstring)."""
    return torch.ops.moe_ext.fused_experts(
        hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=w1_bias, w2_bias=w2_bias,
        expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input, quant=quant,
        w1_scale=w1_scale, w2_scale=w2_scale, alpha=alpha, limit=limit, backend=backend,
    )
