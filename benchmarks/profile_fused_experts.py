"""Eager calls of the routed-expert implementations at one benchmark cell, for an external profiler.

For one (model, M) cell of the benchmark's shapes (bf16, swigluoai, random routing; ``tune_fused_experts``)
it warms up (compiles) ``fused_experts_triton`` with the table config and, when importable,
``triton_kernels``, then makes ``--calls`` eager calls of each inside the NVTX range ``profiled`` (nested
ranges ``ours`` / ``triton_kernels``), so a profiler can skip the warm-up. ``--quant`` profiles MXFP4 or fp8 block
weights (``ab_fused_experts.cell_weights``: the tuner's random stacks; triton_kernels then left out) and
``--variant`` a config override as in ``ab_fused_experts.py``; ``--activation`` another activation than
swigluoai, and ``--local-experts L`` (``--local-pairs K``) the cell as an expert-parallel shard as there
(triton_kernels left out of both). The L2 traffic of the GEMMs, for instance
(``benchmarks/results/l2_traffic_h100.txt``):

    ncu --clock-control none --nvtx --nvtx-include "profiled/" \\
        --kernel-name "regex:gemm[12]_sorted_kernel|_p_matmul_ogs" --metrics "$METRICS" \\
        python benchmarks/profile_fused_experts.py --model qwen3-30b-a3b --tokens 4096

with METRICS = gpu__time_duration.sum,dram__bytes_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum,
lrc__xbar2gpc_sectors_op_read.sum,lrc__lts2lrc_sectors_op_read.sum (no spaces): bytes the SMs read from
L2, and the sectors the L2 request coalescer delivered to the SMs vs read from the L2 slices (their ratio
is how often one L2 read served several SMs' identical requests).

CUDA only (``--help`` works anywhere).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from ab_fused_experts import add_shard_arguments, check_shard_arguments  # noqa: E402
from tune_fused_experts import add_cell_arguments  # noqa: E402

from moe_extension.kernels._grouped_gemm import ACTIVATION_CODES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_cell_arguments(p)
    p.add_argument("--calls", type=int, default=1, help="profiled calls of each implementation")
    p.add_argument("--no-peer", action="store_true", help="leave triton_kernels out")
    p.add_argument("--quant", choices=("none", "mxfp4", "mxfp4_mma", "fp8_block"), default="none",
                   help="expert weight format (default: bf16 weights)")
    p.add_argument("--variant", default=None, help="JSON overrides of the table config (ab_fused_experts.py)")
    p.add_argument("--activation", default=None, choices=sorted(ACTIVATION_CODES),
                   help="default: the benchmark's (another one leaves triton_kernels out)")
    add_shard_arguments(p)
    args = p.parse_args(argv)
    check_shard_arguments(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import ab_fused_experts as AB
    import tune_fused_experts as T

    import moe_extension.kernels.fused_experts as fe
    from moe_extension.backends import triton_kernels as tk
    from moe_extension.kernels import fused_experts_triton

    if not torch.cuda.is_available():
        print("profile_fused_experts: needs a CUDA device", file=sys.stderr)
        return 2
    d = T.MODELS[args.model]
    act = args.activation or T.ACTIVATION
    w1_ops, w2_ops, expert_map = AB.cell_weights(args.model, args.quant, args.local_experts)
    w1, w2, quant_args = T.fused_call_args(w1_ops, w2_ops)
    ((x, weights, ids),) = AB.shard_sets(T.make_sets(d["E"], d["topk"], d["K"], args.tokens, torch.bfloat16, 1),
                                         args.local_experts, args.local_pairs, d["E"])
    config = None
    if args.variant is not None:
        table = fe.select_config(args.tokens, x, fe.WeightOperand.of(w1_ops), fe.WeightOperand.of(w2_ops), d["topk"],
                                 None, args.quant, expert_map)
        config = AB.apply(table, json.loads(args.variant))
    runs = {"ours": lambda: fused_experts_triton(x, w1, w2, weights, ids, act, expert_map=expert_map, config=config,
                                                 **quant_args)}
    if (tk.is_available() and not args.no_peer and args.quant == "none" and act == T.ACTIVATION
            and args.local_experts is None):
        runs["triton_kernels"] = lambda: tk.fused_experts(x, w1, w2, weights, ids, T.ACTIVATION)
    for fn in runs.values():
        fn()
        fn()
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("profiled"):
        for name, fn in runs.items():
            with torch.cuda.nvtx.range(name):
                for _ in range(args.calls):
                    fn()
            torch.cuda.synchronize()
    print(f"profile_fused_experts: {args.model} M={args.tokens}, {args.calls} call(s) of {', '.join(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
