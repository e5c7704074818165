"""Triton kernels of the routed experts (fp32/fp16/bf16 activations; weights dense, MXFP4 or fp8 block): the entry
points that the op layer dispatches CUDA calls to. They also run on CPU tensors under ``TRITON_INTERPRET=1`` (tests).

- ``fused_experts_triton``: the whole expert computation, [M, K] out.
- ``expert_gemm1_triton`` / ``expert_gemm2_triton``: the unfused path's two GEMMs, per-slot rows.
- ``topk_softmax_triton``: fused softmax + top-k routing.
- ``grouped_topk_triton``: DeepSeek grouped top-k routing (softmax or sigmoid scores, correction bias).
- ``moe_extension.kernels.lora``: ``lora_shrink_triton`` / ``lora_expand_triton`` / ``add_lora_triton``, the LoRA
  terms of the unfused path (pairs grouped by adapter and expert).
"""

from moe_extension.kernels._topk_softmax import topk_softmax_triton  # noqa: F401
from moe_extension.kernels._grouped_topk import grouped_topk_triton  # noqa: F401
from moe_extension.kernels.fused_experts import (  # noqa: F401
    expert_gemm1_triton,
    expert_gemm2_triton,
    fused_experts_triton,
)

__all__ = ["fused_experts_triton", "expert_gemm1_triton", "expert_gemm2_triton", "topk_softmax_triton",
           "grouped_topk_triton"]
