"""Expert parallelism: the experts spread over the ranks of a torch.distributed group (NCCL on GPUs, gloo on
CPUs), tokens moved to them and back with ``all_to_all_single``.

- ``ExpertParallelMoE``: the layer one rank constructs with its experts (``layer``).
- ``torch.ops.moe_ext.ep_fused_experts``: the op it calls (``moe_extension.ops.ep_fused_experts``).
- ``ExpertPlacement`` / ``contiguous_expert_map``: which rank holds which expert (``placement``).
- ``dispatch`` / ``combine``: the op's phases, for engines that interleave them with their own work
  (``exchange``); the row layout and its kernels: ``rows``, ``moe_extension.kernels._ep_rows``.
"""

from moe_extension.parallel.exchange import combine, dispatch  # noqa: F401
from moe_extension.parallel.layer import ExpertParallelMoE  # noqa: F401
from moe_extension.parallel.placement import ExpertPlacement, contiguous_expert_map  # noqa: F401
