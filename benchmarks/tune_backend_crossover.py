"""Measure where DeepGEMM's route beats our Triton kernels for fp8 block experts, and store that crossover in the
device's tuned-config JSON, where ``fused_experts(backend="auto")`` reads it.

For each shape (E, topk, K, N) and token count M it times, by CUDA-graph replay over rotated random routings
(``tune_fused_experts.time_us``: ``harness.time_graph_us`` medians; every token picks topk distinct experts,
``torch.rand(M, E).topk``), bf16 hidden states, silu, random fp8 block weights
(``harness.random_fp8_block_stack``, contiguous ``[E, 2N, K]`` / ``[E, K, N]``):

- ``torch.ops.moe_ext.fused_experts(..., quant="fp8_block", backend="triton")`` and
- the same with ``backend="deep_gemm"``,

each point checked first: the two outputs within 1e-2 relative of each other (a point where they are not is
reported and counts as DeepGEMM not faster). A shape's threshold, in rows per expert ``M * topk / E``, is the
smallest measured rows per expert from which on DeepGEMM was faster than the Triton kernels by more than
``--margin`` at every larger measured M; null when it was not faster at the largest M measured. The default for
shapes without an entry of their own is the largest threshold of the stored shapes (null when any is null).
``moe_extension/backends/crossover.py`` documents the stored format and how ``backend="auto"`` reads it.

The section ``"backend" -> "fp8_block" -> "deep_gemm"`` is merged into the JSON: this run's shapes replace their
entries, other shapes are kept, the default is recomputed over all of them; the rest of the file (the kernel
configs of ``tune_fused_experts.py``) is left as it is. ``--out`` is a ``.json`` file, or a directory for
``<device>.json``; by default the package's file for this device (``moe_extension/configs/<device>.json``), i.e.
the crossover is installed. Writing elsewhere starts from the installed file, so the result can replace it.

Needs an sm_90 GPU with deep_gemm importable (``--help`` works anywhere); on the H100, from the repo root:

    PYTHONPATH=.deps/dg python benchmarks/tune_backend_crossover.py
    PYTHONPATH=.deps/dg python benchmarks/tune_backend_crossover.py --models deepseek-v3 --tokens 256 1024 4096
    PYTHONPATH=.deps/dg python benchmarks/tune_backend_crossover.py --shape 128 8 2048 768 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

MODELS = {
    "deepseek-v3": dict(E=256, topk=8, K=7168, N=2048),
    "deepseek-v2-lite": dict(E=64, topk=6, K=2048, N=1408),
    "qwen3-30b-a3b": dict(E=128, topk=8, K=2048, N=768),
}
DEFAULT_MODELS = ("deepseek-v3", "deepseek-v2-lite")
TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192)
ACTIVATION = "silu"
QUANT = "fp8_block"
ACCELERATOR = "deep_gemm"
TOLERANCE = 1e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                   help=f"models to measure (default: {' '.join(DEFAULT_MODELS)}; none when --shape is given)")
    p.add_argument("--shape", nargs=4, type=int, action="append", metavar=("E", "TOPK", "K", "N"), default=[],
                   help="another expert shape (repeatable; K and N multiples of 128)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="the M sweep (default: %(default)s)")
    p.add_argument("--margin", type=float, default=0.02,
                   help="DeepGEMM counts as faster when its time is below (1 - margin) x ours (default: %(default)s)")
    p.add_argument("--sets", type=int, default=4, help="rotated routings per timing (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="a .json file, or a directory for <device>.json (default: the package's file for this device)")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = [] if args.shape else list(DEFAULT_MODELS)
    odd = [s for s in args.shape if s[2] % 128 or s[3] % 128]
    if odd:
        p.error(f"DeepGEMM needs K and N multiples of 128; --shape {odd}")
    if not 0 <= args.margin < 1:
        p.error(f"--margin must be in [0, 1), got {args.margin}")
    return args


# ---------------------------------------------------------------------------------------------------
# The crossover from the measured points, and the merge into the table
# ---------------------------------------------------------------------------------------------------


def deep_gemm_wins(point: dict, margin: float) -> bool:
    """A measured point where DeepGEMM agreed with our kernels and was faster by more than ``margin``."""
    return point["agree"] and point["accelerator_us"] < (1 - margin) * point["triton_us"]


def threshold(points: list[dict], margin: float) -> float | None:
    """The smallest rows per expert from which on DeepGEMM wins at every measured point (``deep_gemm_wins``);
    None when it does not win at the largest one (or there are no points)."""
    best = None
    for point in sorted(points, key=lambda p: p["rows_per_expert"], reverse=True):
        if not deep_gemm_wins(point, margin):
            break
        best = point["rows_per_expert"]
    return best


def default_threshold(shapes: dict) -> float | None:
    """The default for unmeasured shapes: the largest threshold of ``shapes``; None when any is None."""
    values = [entry["min_rows_per_expert"] for entry in shapes.values()]
    if not values or any(v is None for v in values):
        return None
    return max(values)


def merge(table: dict, entries: dict, measured_with: dict) -> dict:
    """``table`` (a tuned-config file's content) with ``entries`` (shape key -> ``{"min_rows_per_expert",
    "measured"}``) merged into its ``"backend" -> "fp8_block" -> "deep_gemm"`` section and the default
    recomputed over every stored shape; everything else in ``table`` is kept. Modifies and returns ``table``."""
    from moe_extension.backends.crossover import SECTION

    section = table.setdefault(SECTION, {}).setdefault(QUANT, {}).setdefault(ACCELERATOR, {})
    shapes = section.setdefault("shapes", {})
    shapes.update(entries)
    section["min_rows_per_expert"] = default_threshold(shapes)
    section["measured_with"] = measured_with
    return table


def output_path(out: str | None, device_name: str) -> Path:
    """Where the table goes: the package's file for the device (``out`` None), ``out`` itself when it names a
    ``.json`` file, else ``out/<device>.json``."""
    from moe_extension.kernels._configs import table_path

    installed = table_path(device_name)
    if out is None:
        return installed
    path = Path(out)
    return path if path.suffix == ".json" else path / installed.name


def write_table(path: Path, device_name: str, entries: dict, measured_with: dict) -> dict:
    """Merge ``entries`` into the table at ``path`` (or, where there is none yet, into a copy of the installed
    one for the device) and write it; returns the written table."""
    from moe_extension.kernels._configs import table_path

    installed = table_path(device_name)
    base = path if path.exists() else installed
    table = json.loads(base.read_text()) if base.exists() else {"device": device_name}
    merge(table, entries, measured_with)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


# ---------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------


def make_fp8_weights(E: int, K: int, N: int, device):
    """``(w1 [E, 2N, K], w2 [E, K, N])`` float8_e4m3fn contiguous and their fp32 block scales
    (``harness.random_fp8_block_stack``)."""
    import harness

    (w1, s1), (w2, s2) = (harness.random_fp8_block_stack(E, rows, cols, device) for rows, cols in ((2 * N, K), (K, N)))
    return w1, w2, s1, s2


def measure_point(weights, sets, E: int, topk: int, M: int) -> dict:
    """One point of the sweep: both routes checked against each other on the first set, then timed."""
    import torch
    from tune_fused_experts import time_us

    from moe_extension.backends.crossover import rows_per_expert

    w1, w2, s1, s2 = weights
    n = len(sets)

    def call(backend, i):
        x, g, ids = sets[i % n]
        return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, ACTIVATION, quant=QUANT, w1_scale=s1, w2_scale=s2,
                                               backend=backend)

    from bench_fused_experts import rel_err

    err = rel_err(call(ACCELERATOR, 0), call("triton", 0))
    triton_us = time_us(lambda i: call("triton", i), n)
    accelerator_us = time_us(lambda i: call(ACCELERATOR, i), n)
    return {"M": M, "topk": topk, "rows_per_expert": rows_per_expert(M, topk, E), "triton_us": round(triton_us, 2),
            "accelerator_us": round(accelerator_us, 2), "rel_err": err, "agree": err <= TOLERANCE}


def measure_shape(E: int, topk: int, K: int, N: int, tokens, n_sets: int, margin: float) -> dict:
    """The entry of one shape: its points over ``tokens`` and its threshold."""
    import torch
    from tune_fused_experts import make_sets

    weights = make_fp8_weights(E, K, N, "cuda")
    points = []
    for M in tokens:
        point = measure_point(weights, make_sets(E, topk, K, M, torch.bfloat16, n_sets), E, topk, M)
        verdict = "deep_gemm" if deep_gemm_wins(point, margin) else "triton"
        note = "" if point["agree"] else f"  DISAGREE (rel err {point['rel_err']:.2e}): counted as not faster"
        print(f"  M={M:5d} rows/expert {point['rows_per_expert']:8.2f}: triton {point['triton_us']:9.1f} us, "
              f"deep_gemm {point['accelerator_us']:9.1f} us -> {verdict}{note}", flush=True)
        points.append(point)
    del weights
    torch.cuda.empty_cache()
    return {"min_rows_per_expert": threshold(points, margin), "measured": points}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tune_backend_crossover: needs a CUDA device", file=sys.stderr)
        return 1
    import triton

    from moe_extension.backends import deep_gemm
    from moe_extension.backends.crossover import SECTION, shape_key

    if not deep_gemm.is_available():
        print(f"tune_backend_crossover: DeepGEMM is not available: {deep_gemm.unavailable_reason()}", file=sys.stderr)
        return 1
    t0 = time.time()
    device_name = torch.cuda.get_device_name(0)
    path = output_path(args.out, device_name)
    shapes = [MODELS[name] for name in args.models]
    shapes += [dict(E=e, topk=k, K=kk, N=n) for e, k, kk, n in args.shape]
    measured_with = {"deep_gemm": getattr(sys.modules.get("deep_gemm"), "__version__", "unknown"),
                     "torch": torch.__version__, "triton": triton.__version__}
    torch.manual_seed(0)
    for s in shapes:
        key = shape_key(s["E"], s["N"], s["K"])
        print(f"== {key}, topk {s['topk']} ({time.time() - t0:.0f} s)", flush=True)
        entry = measure_shape(s["E"], s["topk"], s["K"], s["N"], args.tokens, args.sets, args.margin)
        print(f"  min_rows_per_expert: {entry['min_rows_per_expert']}")
        # Written after every shape, so a run stopped by a time limit keeps what it measured.
        table = write_table(path, device_name, {key: entry}, measured_with)
    default = table[SECTION][QUANT][ACCELERATOR]["min_rows_per_expert"]
    print(f"default min_rows_per_expert: {default}; wrote {path} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
