"""Chart of a ``bench_fused_experts.py`` result: ``python benchmarks/plot_fused_experts.py JSON [-o PNG]``.

One panel per model; x = tokens M (log scale), y = µs per call (log scale); ours, triton_kernels and the
torch._grouped_mm pipeline as lines with markers, the hardware floor dashed. Null cells (a peer that is not
installed, failed its check or raised) are left out of their line. Needs matplotlib; runs without a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERIES = (  # (row key, label, style)
    ("ours_us", "ours (moe_ext)", dict(marker="o", linewidth=2.0, color="tab:blue")),
    ("triton_kernels_us", "triton_kernels matmul_ogs", dict(marker="s", color="tab:orange")),
    ("grouped_mm_us", "torch._grouped_mm pipeline", dict(marker="^", color="tab:green")),
    ("floor_us", "floor (bytes / copy BW, flops / GEMM peak)", dict(linestyle="--", color="black")),
)


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = sorted((r for r in result["rows"] if r["model"] == model), key=lambda r: r["M"])
        for key, label, style in SERIES:
            points = [(r["M"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label, **style)
        shape = rows[0]
        ax.set_title(f"{model}\nE {shape['E']}, topk {shape['topk']}, K {shape['K']}, N {shape['N']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["M"] for r in rows], [str(r["M"]) for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"fused_experts, bf16, {result.get('activation', 'swigluoai')}, CUDA-graph medians — "
                 f"{result.get('device', '')} (torch {result.get('torch', '?')}, triton {result.get('triton', '?')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="fused_experts_<gpu>.json written by bench_fused_experts.py")
    p.add_argument("-o", "--out", type=Path, help="PNG path (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    result = json.loads(args.json.read_text())
    path = plot(result, args.out or args.json.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
