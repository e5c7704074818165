"""The expert classes engines use, mirroring vLLM's OAI Triton path (same responsibilities, own API).

- ``OAITritonExperts``: modular (routing by the caller), activation fused: one ``fused_experts`` call.
- ``UnfusedOAITritonExperts``: gemm1 -> activation -> gemm2 -> moe_sum as separate, overridable steps,
  with LoRA adapters (``LoRAWeights``) injected between them.
- ``OAITritonMxfp4ExpertsMonolithic``: router logits in (``fused_moe``), MXFP4 or unquantized weights.
- ``TritonOrDeepGemmExperts``: fp8 block weights, DeepGEMM when it applies, ``fused_experts`` otherwise.

Each holds the weights as that path does (``w1 [E, K, 2N]``, ``w2 [E, N, K]``, layouts per quant scheme
in ``moe_extension.experts.base``), hands transposed views to the ops, answers what it supports
(``supports_device`` / ``supports_quant_scheme`` / ``supports_activation`` / ``supports_expert_map`` /
``supports_chunking``), its ``workspace_shapes(M, N, K, topk, E)`` and ``moe_problem_size(...)``.
"""

from moe_extension.experts.base import (  # noqa: F401
    ExpertsBase, moe_problem_size, prepare_held_mxfp4_mma, prepare_mxfp4_layout)
from moe_extension.experts.modular import OAITritonExperts  # noqa: F401
from moe_extension.experts.monolithic import OAITritonMxfp4ExpertsMonolithic  # noqa: F401
from moe_extension.experts.triton_or_deep_gemm import TritonOrDeepGemmExperts  # noqa: F401
from moe_extension.experts.unfused import LoRAWeights, UnfusedOAITritonExperts  # noqa: F401
