"""Bandwidth benchmark of the native ops (CUDA only), side by side with the device-to-device copy
bandwidth and PyTorch eager, in one run.

Cases (bf16):
- moe_sum: input [M = 16384, topk, K] -> [M, K] for topk 4, 8 and K 2880, 7168; ours
  (torch.ops.moe_ext.moe_sum) vs eager ``x.sum(1)`` (written with ``out=``). One extra row per shape with
  topk_ids + expert_map (all slots valid, so the same bytes move) vs eager ``where(valid, x, 0).sum(1)``.
- the five gated activations: input [65536, 2N] -> [65536, N] for N 2880, 14336; ours vs the composed
  eager expression in bf16 (what a PyTorch model would write).

Achieved bandwidth = (bytes read + bytes written) / time, reported as a percentage of the copy bandwidth
(read + write) measured in the same run; speedup = eager time / ours. Times are medians of CUDA-graph
replays (harness.time_graph_us). Every buffer is far larger than L2 (50 MB on H100), so no rotation.
Prints a markdown table and writes native_ops_<gpu>.json (device/torch/triton/command at the top level).

Run: python benchmarks/bench_native_ops.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    RESULTS_DIR,
    copy_bandwidth,
    device_info,
    gpu_slug,
    time_graph_us,
    write_json,
)

MOE_SUM_M = 16384
MOE_SUM_SHAPES = [(4, 2880), (4, 7168), (8, 2880), (8, 7168)]  # (topk, K)
ACT_ROWS = 65536
ACT_WIDTHS = [2880, 14336]  # N: input [rows, 2N], output [rows, N]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "swigluoai", "swiglustep"]
ALPHA, LIMIT = 1.702, 7.0
# NOTE: each case moves 0.5-5.6 GB, i.e. 0.2-2 ms per call: 5 calls per captured graph keep launch gaps
# negligible and bound the eager expressions' temporaries held by the graph's memory pool.
REPS = 5
DTYPE = torch.bfloat16
ELEM = torch.tensor([], dtype=DTYPE).element_size()


def ours_activation(name: str, out: torch.Tensor, x: torch.Tensor) -> None:
    if name == "swigluoai":
        torch.ops.moe_ext.swigluoai_and_mul(out, x, ALPHA, LIMIT)
    elif name == "swiglustep":
        torch.ops.moe_ext.swiglustep_and_mul(out, x, LIMIT)
    else:
        getattr(torch.ops.moe_ext, f"{name}_and_mul")(out, x)


def eager_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation composed from PyTorch ops in x's dtype."""
    if name == "swigluoai":
        gate = x[..., 0::2].clamp(max=LIMIT)
        up = x[..., 1::2].clamp(-LIMIT, LIMIT)
        return gate * torch.sigmoid(ALPHA * gate) * (up + 1)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if name == "silu":
        return F.silu(gate) * up
    if name == "gelu":
        return F.gelu(gate) * up
    if name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate).clamp(max=LIMIT) * up.clamp(-LIMIT, LIMIT)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def row(op: str, shape: str, nbytes: int, ours_us: float, eager_us: float, copy_bps: float, err: float) -> dict:
    gbps = nbytes / (ours_us * 1e-6) / 1e9
    return {
        "op": op,
        "shape": shape,
        "bytes": nbytes,
        "ours_us": round(ours_us, 2),
        "eager_us": round(eager_us, 2),
        "ours_GBps": round(gbps, 1),
        "pct_of_copy": round(100 * gbps * 1e9 / copy_bps, 1),
        "speedup": round(eager_us / ours_us, 2),
        "rel_err_vs_eager": float(f"{err:.2e}"),
    }


def bench_moe_sum_shape(topk: int, k: int, copy_bps: float) -> list[dict]:
    """Two rows for input [MOE_SUM_M, topk, k]: plain, and with topk_ids + expert_map."""
    x = torch.randn(MOE_SUM_M, topk, k, device="cuda", dtype=DTYPE)
    out = torch.empty(MOE_SUM_M, k, device="cuda", dtype=DTYPE)
    out_eager = torch.empty_like(out)
    nbytes = (x.numel() + out.numel()) * ELEM
    shape = f"[{MOE_SUM_M}, {topk}, {k}]"

    ours_us = time_graph_us(lambda i: torch.ops.moe_ext.moe_sum(x, out), reps=REPS)
    eager_us = time_graph_us(lambda i: torch.sum(x, dim=1, out=out_eager), reps=REPS)
    rows = [row("moe_sum", shape, nbytes, ours_us, eager_us, copy_bps, rel_err(out, out_eager))]

    ids = torch.randint(0, 128, (MOE_SUM_M, topk), device="cuda", dtype=torch.int32)
    expert_map = torch.arange(128, device="cuda", dtype=torch.int32)
    valid = (expert_map[ids.long()] >= 0).unsqueeze(-1)
    zero = torch.zeros((), device="cuda", dtype=DTYPE)
    nbytes += ids.numel() * ids.element_size()
    ours_us = time_graph_us(lambda i: torch.ops.moe_ext.moe_sum(x, out, ids, expert_map), reps=REPS)
    eager_us = time_graph_us(lambda i: torch.sum(torch.where(valid, x, zero), dim=1, out=out_eager), reps=REPS)
    rows.append(row("moe_sum(ids,map)", shape, nbytes, ours_us, eager_us, copy_bps, rel_err(out, out_eager)))
    return rows


def bench_activation(name: str, x: torch.Tensor, out: torch.Tensor, copy_bps: float) -> dict:
    nbytes = (x.numel() + out.numel()) * ELEM
    ours_us = time_graph_us(lambda i: ours_activation(name, out, x), reps=REPS)
    eager_us = time_graph_us(lambda i: eager_activation(name, x), reps=REPS)
    err = rel_err(out, eager_activation(name, x))
    return row(f"{name}_and_mul", f"[{x.shape[0]}, {x.shape[1]}]", nbytes, ours_us, eager_us, copy_bps, err)


def bench_activations(n: int, copy_bps: float) -> list[dict]:
    """One row per activation for input [ACT_ROWS, 2n]; the eager temporaries are released in between."""
    x = torch.randn(ACT_ROWS, 2 * n, device="cuda", dtype=DTYPE).mul_(3)
    out = torch.empty(ACT_ROWS, n, device="cuda", dtype=DTYPE)
    rows = []
    for name in ACTIVATIONS:
        rows.append(bench_activation(name, x, out, copy_bps))
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], copy_bps: float) -> str:
    lines = [
        f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)",
        "",
        "| op | input shape | MB moved | ours µs | eager µs | ours GB/s | % of copy | speedup | rel err vs eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['bytes'] / 1e6:.0f} | {r['ours_us']:.1f} | {r['eager_us']:.1f} | "
            f"{r['ours_GBps']:.0f} | {r['pct_of_copy']:.1f} | {r['speedup']:.2f} | {r['rel_err_vs_eager']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS_DIR), help="directory for the JSON result (default: %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_native_ops: needs a CUDA device")
    import moe_extension  # registers the ops

    if not moe_extension.WITH_CUDA:
        sys.exit("bench_native_ops: moe_extension was built without CUDA kernels")
    torch.manual_seed(0)
    copy_bps = copy_bandwidth()
    rows = []
    # NOTE: one function call per shape, so its multi-GB buffers are released before the next one.
    for topk, k in MOE_SUM_SHAPES:
        rows += bench_moe_sum_shape(topk, k, copy_bps)
        torch.cuda.empty_cache()
    for n in ACT_WIDTHS:
        rows += bench_activations(n, copy_bps)
        torch.cuda.empty_cache()
    print(markdown(rows, copy_bps))
    payload = {**device_info(), "copy_GBps": round(copy_bps / 1e9, 1), "rows": rows}
    path = write_json(f"native_ops_{gpu_slug()}.json", payload, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
