"""TritonOrDeepGemmExperts: fp8 block-quantized experts through ``torch.ops.moe_ext.fused_experts(quant="fp8_block")``,
which runs DeepGEMM's grouped GEMMs or our Triton kernels.

``apply(hidden_states [M, K], topk_weights fp32 [M, topk], topk_ids int [M, topk]) -> [M, K]`` in the dtype of
``hidden_states``, with weights held ``[E, in, out]`` float8_e4m3fn and fp32 scales per 128 x 128 block
(see ``moe_extension.experts.base``); activations are quantized per token per 128 columns (docs/formats.md).

Every call is one call of the op, so the class captures in a CUDA graph and compiles as the op does; the
DeepGEMM route lives behind the op (``moe_extension.backends.deep_gemm``) and the class shares it and its
choice (``moe_extension.ops.fused_experts.cuda_route``):
- ``backend="auto"`` (default): on CUDA DeepGEMM where the device's stored crossover says it is faster for the
  shape and M (and it is available and applies), our Triton kernels elsewhere; PyTorch on CPU;
- ``backend="deep_gemm"``: always DeepGEMM (the op's errors where it is unavailable or does not apply);
- ``"triton"``, ``"torch"``, ``"triton_kernels"``: that backend; ``allow_deep_gemm=False``: never DeepGEMM.

DeepGEMM reads K-major contiguous weights: ``[E, out, in]`` storage, the ops' layout. When the route may run
for these weights (DeepGEMM available, weights on CUDA, N and K multiples of its alignment, and
``backend="deep_gemm"`` or a crossover stored for the shape), the constructor prepares that storage once
(``prepare_deep_gemm_layout``): held stacks and scales that are not ``[E, in, out]`` views of it are copied
into it and held as the same views, so no call copies a weight. The Triton kernels read either layout.
"""

from __future__ import annotations

import torch

from moe_extension.backends import crossover, deep_gemm
from moe_extension.experts.base import BACKENDS, ExpertsBase, Shape
from moe_extension.ops.fused_experts import cuda_route

_BACKENDS = (*BACKENDS, deep_gemm.NAME)


def prepare_deep_gemm_layout(t: torch.Tensor) -> torch.Tensor:
    """A held stack ``[E, in, out]`` as a view of contiguous ``[E, out, in]`` storage (DeepGEMM's K-major
    layout): ``t`` itself when it already is one, else one copy, returned as the same view."""
    if t.transpose(1, 2).is_contiguous():
        return t
    return t.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


class TritonOrDeepGemmExperts(ExpertsBase):
    """fp8 block experts: one ``fused_experts`` call, DeepGEMM or our Triton kernels behind it."""

    _QUANT_SCHEMES = ("fp8_block",)
    _DEFAULT_ACTIVATION = "silu"

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        w1_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        w1_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: str | None = None,
        alpha: float = 1.702,
        limit: float = 7.0,
        backend: str = "auto",
        allow_deep_gemm: bool = True,
    ) -> None:
        name = type(self).__name__
        if not isinstance(backend, str) or backend not in _BACKENDS:
            raise ValueError(f"{name}: backend must be one of {_BACKENDS}, got {backend!r}")
        if not isinstance(allow_deep_gemm, bool):
            raise TypeError(f"{name}: allow_deep_gemm must be a bool, got {type(allow_deep_gemm).__name__}")
        if backend == deep_gemm.NAME and not allow_deep_gemm:
            raise ValueError(f"{name}: backend='deep_gemm' and allow_deep_gemm=False contradict each other")
        super().__init__(
            w1, w2, w1_bias=w1_bias, w2_bias=w2_bias, quant="fp8_block", w1_scale=w1_scale, w2_scale=w2_scale,
            activation=activation, alpha=alpha, limit=limit, backend="auto" if backend == deep_gemm.NAME else backend,
        )
        self.backend = backend
        # Availability and the weight layout are settled here, outside any traced or captured call.
        self.allow_deep_gemm = allow_deep_gemm and deep_gemm.is_available()
        if self._deep_gemm_may_run():
            self.w1, self.w2, self.w1_scale, self.w2_scale = (
                prepare_deep_gemm_layout(t) for t in (self.w1, self.w2, self.w1_scale, self.w2_scale)
            )

    def _deep_gemm_may_run(self) -> bool:
        """Whether any call may take the DeepGEMM route (module docstring): then its layout is prepared."""
        if not (self.allow_deep_gemm and self.w1.is_cuda and self.backend in ("auto", deep_gemm.NAME)):
            return False
        E, N, K = self.num_experts, self.intermediate_size, self.hidden_size
        if N % deep_gemm.granule() or K % deep_gemm.granule():
            return False
        return self.backend == deep_gemm.NAME or crossover.min_rows_per_expert(
            crossover.device_name(self.w1.device), "fp8_block", deep_gemm.NAME, E, N, K) is not None

    def _op_backend(self, on_cuda: bool) -> str:
        """The ``backend`` the class passes to the op: its own, or "triton" for "auto" when DeepGEMM is not
        allowed on CUDA (the op's "auto" minus DeepGEMM)."""
        if self.backend == "auto" and on_cuda and not self.allow_deep_gemm:
            return "triton"
        return self.backend

    def _route(self, M: int, topk: int, num_global_experts: int | None) -> str:
        """The implementation the op runs for a call of this shape: ``cuda_route``'s answer, "torch" for
        weights off CUDA."""
        if not self.w1.is_cuda:
            return "torch"
        w = self.op_weights()
        return cuda_route(self._op_backend(True), "fp8_block", M, topk, num_global_experts, w["w1"], w["w2"],
                          w["w1_scale"], w["w2_scale"])

    def uses_deep_gemm(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       expert_map: torch.Tensor | None = None) -> bool:
        """Whether ``apply(hidden_states, ..., topk_ids, expert_map)`` takes the DeepGEMM route."""
        num_global = None if expert_map is None else expert_map.shape[0]
        return self._route(hidden_states.shape[0], topk_ids.shape[1], num_global) == deep_gemm.NAME

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, E: int) -> dict[str, Shape]:
        """``{"output": (M, K)}``; where M tokens take the DeepGEMM route (weights on CUDA, no expert_map), also
        the row buffers the route allocates for itself: ``h (R, 2N)``, ``a (R, N)``, ``y (R, K)`` with
        ``R = deep_gemm.permuted_rows(M * topk, E, alignment)``."""
        if self._route(M, topk, None) != deep_gemm.NAME:
            return {"output": (M, K)}
        R = deep_gemm.permuted_rows(M * topk, E, deep_gemm.alignment())
        return {"h": (R, 2 * N), "a": (R, N), "y": (R, K), "output": (M, K)}

    def apply(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(hidden_states[t])``, fp8 block weights."""
        self._check_call(hidden_states, topk_weights, self._routing_shape(topk_weights, topk_ids), expert_map)
        weights = self.op_weights()
        kwargs = self._op_kwargs(expert_map, apply_router_weight_on_input)
        kwargs["backend"] = self._op_backend(hidden_states.is_cuda)
        result = torch.ops.moe_ext.fused_experts(
            hidden_states, weights["w1"], weights["w2"], topk_weights, topk_ids, self.activation, **kwargs
        )
        return self._into(result, output)
