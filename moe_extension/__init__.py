"""moe_extension: PyTorch custom ops for the expert half of a Mixture-of-Experts layer.

``import moe_extension`` loads the native library (``moe_extension._C``, which registers the C++/CUDA
ops ``torch.ops.moe_ext.moe_sum`` and the gated activations) and then the Python-defined ops
(``fused_experts``, ``topk_softmax``, ``fused_moe``) with their fakes. Functional wrappers live in
``moe_extension.ops``.
"""

from moe_extension import _C  # noqa: F401  (registers the native ops with the dispatcher)
from moe_extension import ops  # noqa: F401  (registers the Python ops and all fakes)

__version__ = "0.1.0"
WITH_CUDA: bool = _C.WITH_CUDA
CUDA_ARCHS: str = _C.CUDA_ARCHS
