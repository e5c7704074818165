"""Chart of a ``bench_fused_experts.py`` result: ``python benchmarks/plot_fused_experts.py JSON [-o PNG]``.

One panel per model; x = tokens M (log scale), y = µs per call (log scale); ours, triton_kernels and the
torch._grouped_mm pipeline as lines with markers, the hardware floor dashed. Null cells (a peer that is not
installed, failed its check or raised) are left out of their line. A ``--quant mxfp4`` result
(``fused_experts_mxfp4_<gpu>.json``, ``"quant": "mxfp4"``) is charted the same way with its columns: ours and
triton_kernels on MXFP4 weights, ours on the bf16 copies, and its floor (4.25-bit weights); a
``bench_fused_experts_fp8.py`` result (``"quant": "fp8_block"``, panels per shape) with ours (auto and Triton), the
DeepGEMM route, vLLM's Triton kernel and its floor; a ``bench_zoo.py`` result (``"kind": "zoo"``, a grid of panels,
four per row) with ours, vLLM's kernel (whole and its two GEMMs alone), triton_kernels, torch._grouped_mm and the
floor. Needs matplotlib; runs without a GPU.
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
MXFP4_SERIES = (
    ("ours_us", "ours (moe_ext), MXFP4 weights (MMA layout, prepared)", dict(marker="o", linewidth=2.0,
                                                                             color="tab:blue")),
    ("triton_kernels_us", "triton_kernels matmul_ogs, MXFP4 weights (prepared)", dict(marker="s", color="tab:orange")),
    ("ours_checkpoint_us", "ours, MXFP4 checkpoint layout", dict(marker="D", color="tab:cyan")),
    ("ours_bf16_us", "ours on the weights in bf16 (reference)", dict(marker="v", color="tab:gray")),
    ("floor_us", "floor (4.25-bit weights / copy BW, flops / bf16 GEMM peak)", dict(linestyle="--", color="black")),
)

FP8_SERIES = (
    ("ours_auto_us", "ours (moe_ext), default backend", dict(marker="o", linewidth=2.0, color="tab:blue")),
    ("ours_triton_us", "ours, Triton kernels", dict(marker="x", color="tab:cyan")),
    ("deep_gemm_us", "DeepGEMM route (backend='deep_gemm')", dict(marker="s", color="tab:red")),
    ("vllm_us", "vLLM Triton fused_moe_kernel (w8a8 block)", dict(marker="^", color="tab:green")),
    ("floor_us", "floor (fp8 bytes / copy BW, flops / fp8 GEMM peak)", dict(linestyle="--", color="black")),
)

ZOO_SERIES = (
    ("ours_us", "ours (moe_ext)", dict(marker="o", linewidth=2.0, color="tab:blue")),
    ("vllm_us", "vLLM Triton fused_moe_kernel (routing included)", dict(marker="^", color="tab:green")),
    ("vllm_gemms_us", "vLLM's two GEMM launches alone", dict(marker="v", linestyle=":", color="tab:green")),
    ("triton_kernels_us", "triton_kernels matmul_ogs", dict(marker="s", color="tab:orange")),
    ("grouped_mm_us", "torch._grouped_mm pipeline", dict(marker="x", color="tab:gray")),
    ("floor_us", "floor (bytes / copy BW, flops / GEMM peak)", dict(linestyle="--", color="black")),
)
PANELS_PER_ROW = 4  # the zoo's 14 shapes: 4 rows


def series_for(result: dict) -> tuple:
    """The lines to draw for a result file (the bf16 run's, the ``--quant mxfp4`` run's, the fp8 run's or the
    zoo's)."""
    if result.get("kind") == "zoo":
        return ZOO_SERIES
    return {"mxfp4": MXFP4_SERIES, "fp8_block": FP8_SERIES}.get(result.get("quant"), SERIES)


def weights_caption(result: dict) -> str:
    return {"mxfp4": "MXFP4 weights, bf16 activations",
            "fp8_block": "fp8 block weights, bf16 activations"}.get(result.get("quant"), "bf16")


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panel = "shape" if result.get("quant") == "fp8_block" else "model"
    models = list(dict.fromkeys(row[panel] for row in result["rows"]))
    cols = min(len(models), PANELS_PER_ROW)
    grid = -(-len(models) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(5.2 * cols, 4.4 * grid), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        rows = sorted((r for r in result["rows"] if r[panel] == model), key=lambda r: r["M"])
        for key, label, style in series_for(result):
            points = [(r["M"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label, **style)
        shape = rows[0]
        local = f" ({shape['local_experts']} local)" if shape.get("local_experts", shape["E"]) != shape["E"] else ""
        ax.set_title(f"{model}\nE {shape['E']}{local}, topk {shape['topk']}, K {shape['K']}, N {shape['N']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["M"] for r in rows], [str(r["M"]) for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    title = "fused_experts on the model zoo" if result.get("kind") == "zoo" else "fused_experts"
    return save_chart(fig, f"{title}, {weights_caption(result)}, {result.get('activation', 'swigluoai')}",
                      result, out)


def save_chart(fig, title: str, result: dict, out: Path) -> Path:
    """Title ``title`` + the run's device and versions, then write the PNG."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{title}, CUDA-graph medians — {result.get('device', '')} (torch {result.get('torch', '?')}, "
                 f"triton {result.get('triton', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def chart_main(plot_fn, doc: str, json_help: str, argv=None) -> int:
    """The command line of a chart script: ``JSON [-o PNG]`` (default: the JSON's path with .png)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("json", type=Path, help=json_help)
    p.add_argument("-o", "--out", type=Path, help="PNG path (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    path = plot_fn(json.loads(args.json.read_text()), args.out or args.json.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    return chart_main(plot, __doc__, "fused_experts_<gpu>.json or fused_experts_mxfp4_<gpu>.json written by "
                                     "bench_fused_experts.py", argv)


if __name__ == "__main__":
    raise SystemExit(main())
