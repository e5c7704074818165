"""The moe_ext ops: functional wrappers, fakes and PyTorch references, one module per op family.

Importing this package registers the fakes of the native ops and defines the Python ops.
"""

from moe_extension.ops.moe_sum import moe_sum, moe_sum_torch  # noqa: F401
from moe_extension.ops.activations import (  # noqa: F401
    ACTIVATIONS,
    gelu_and_mul,
    gelu_tanh_and_mul,
    silu_and_mul,
    swiglustep_and_mul,
    swigluoai_and_mul,
    activation_torch,
)
from moe_extension.ops.topk_softmax import topk_softmax, topk_softmax_torch  # noqa: F401
from moe_extension.ops.grouped_topk import grouped_topk, grouped_topk_torch  # noqa: F401
from moe_extension.ops.expert_gemm import expert_gemm1, expert_gemm2  # noqa: F401
from moe_extension.ops.lora import add_lora, lora_expand, lora_shrink  # noqa: F401
from moe_extension.ops.fused_experts import fused_experts, fused_experts_torch  # noqa: F401
from moe_extension.ops.fused_moe import fused_moe  # noqa: F401
from moe_extension.ops.ep_fused_experts import ep_fused_experts  # noqa: F401
