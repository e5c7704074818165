"""Chart of a ``bench_lora.py`` result: ``python benchmarks/plot_lora.py JSON [-o PNG]``.

One panel per model; x = tokens M (log scale), y = (unfused + LoRA) / (unfused without LoRA); one line per (rank,
share of tokens with an adapter), each rank's target dashed in its colour. Needs matplotlib; runs without a GPU.
"""

from __future__ import annotations

from pathlib import Path

from plot_fused_experts import chart_main, save_chart

COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple")


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in result["rows"]))
    ranks = sorted({row["rank"] for row in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in result["rows"] if r["model"] == model]
        for rank, color in zip(ranks, COLORS):
            for share, marker, style in (("all", "o", "-"), ("half", "s", ":")):
                points = sorted((r["M"], r["ratio"]) for r in rows if r["rank"] == rank and r["with_adapter"] == share)
                if points:
                    ax.plot(*zip(*points, strict=True), marker=marker, linestyle=style, color=color,
                            label=f"rank {rank}, {share} tokens with an adapter")
            target = next((r["target"] for r in rows if r["rank"] == rank and r["target"]), None)
            if target:
                ax.axhline(target, color=color, linestyle="--", linewidth=0.8, label=f"target at rank {rank}")
        shape = rows[0]
        ax.set_title(f"{model}\nE {shape['E']}, topk {shape['topk']}, K {shape['K']}, N {shape['N']}, "
                     f"{shape['adapters']} adapters")
        ms = sorted({r["M"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("tokens M")
        ax.set_ylabel("unfused + LoRA / unfused without")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_chart(fig, "UnfusedOAITritonExperts with LoRA, bf16", result, out)


def main(argv=None) -> int:
    return chart_main(plot, __doc__, "lora_<gpu>.json written by bench_lora.py", argv)


if __name__ == "__main__":
    raise SystemExit(main())
