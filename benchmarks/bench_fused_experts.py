"""Benchmark ``moe_ext::fused_experts`` (swigluoai; bf16 weights, MXFP4 with --quant mxfp4) against its peers
and the hardware floor, in one run.

For the expert shapes of gpt-oss-120b (E 128, topk 4, K 2880, N 2880), qwen3-30b-a3b (128, 8, 2048, 768)
and mixtral-8x7b (8, 2, 4096, 14336) and M tokens in {1, 16, 64, 256, 1024, 4096}, on random routing (each
token picks topk distinct experts uniformly, ``torch.rand(M, E).topk``), it times by CUDA-graph replay: each
column captured once (~25 ms of calls per graph), then 5 interleaved rounds that replay every column's graph once
(``harness.time_interleaved_us``); a column's time is the median of its rounds, the row keeps them (``rounds_us``):

- ``ours``: ``torch.ops.moe_ext.fused_experts`` with the default backend;
- ``triton_kernels``: OpenAI's ``matmul_ogs`` through ``moe_extension.backends.triton_kernels`` (optional);
- ``grouped_mm``: a ``torch._grouped_mm`` pipeline (sort the (token, slot) pairs by expert, gather,
  grouped GEMM, ``moe_ext.swigluoai_and_mul``, grouped GEMM, weighted sum over the slots).

Every implementation starts from the same inputs, ``hidden_states [M, K]`` bf16, ``topk_weights [M, topk]``
fp32 and ``topk_ids [M, topk]`` int32, and includes all of its routing work (sorting, histograms, index
maps); the router's top-k itself is outside for all three. The activation is swigluoai for all three models
(the one matmul_ogs fuses), so that every column computes the same function.

The floor of a cell is ``max(bytes / copy_BW, flops / gemm_peak)`` with both ceilings measured at the start
of the run (``harness.copy_bandwidth()``, ``harness.gemm_peak(bf16)``), ``bytes`` = the weights of the experts
the routing hits (counted on the host before timing, averaged over the rotated routings) + ``x`` in + ``out``
written, ``flops = 2 M topk (K 2N + N K)``. Before timing, ours is checked against the PyTorch backend and
each peer against ours (rel err <= 1e-2); an implementation that fails its check or raises is reported as
such and its column is null. Writes ``fused_experts_<gpu>.json`` under ``--out``. CUDA only (``--help`` works
anywhere).

``--quant mxfp4``: MXFP4 expert weights (gpt-oss: e2m1 + E8M0 per 32 elements, bf16 activations) for
gpt-oss-120b (E 128, topk 4, K = N = 2880) and gpt-oss-20b (E 32, same K, N), same token counts, routing,
activation and timing, biases only with ``--bias`` (like the bf16 run, which passes none). Columns:

- ``ours``: ``torch.ops.moe_ext.fused_experts(..., quant="mxfp4_mma", w1_scale, w2_scale)``, default backend, on
  the weights prepared once outside the timing (``moe_extension.quant.mxfp4_mma.prepare_mxfp4_mma``);
- ``triton_kernels``: matmul_ogs on the same MXFP4 weights, prepared once outside the timing
  (``moe_extension.backends.triton_kernels.prepare_mxfp4``: vLLM's gpt-oss layouts), routing in the timing;
- ``ours_checkpoint``: the op with ``quant="mxfp4"`` on the checkpoint layout (no preparation);
- ``ours_bf16``: the op (default backend) on the same weights dequantized once to bf16, for reference.

The weights are random normal / sqrt(cols), quantized on the GPU (in chunks of experts) with
``moe_extension.quant.quantize_mxfp4``. The floor counts weight bytes at 4.25 bits per weight (packed e2m1 +
E8M0 scales) for the experts hit, + x in + out written; flops and the bf16 GEMM peak as above. Before
timing, ours is checked against the PyTorch backend on the same quantized weights, the other two against
ours (rel err <= 1e-2). Summary: cells where ours <= triton_kernels, geomean(ours / floor) and ours / floor
at M = 1, against the targets (every cell, <= 1.35, <= 1.8). Writes ``fused_experts_mxfp4_<gpu>.json``.

Both modes' summaries compare ours with triton_kernels round by round where its median is lower
(``triton_kernels_rounds``: the least and largest ratio ours / triton_kernels and the rounds ours won).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

MODELS = {
    "gpt-oss-120b": dict(E=128, topk=4, K=2880, N=2880),
    "qwen3-30b-a3b": dict(E=128, topk=8, K=2048, N=768),
    "mixtral-8x7b": dict(E=8, topk=2, K=4096, N=14336),
}
# --quant mxfp4: the gpt-oss models, whose experts ship in MXFP4
MXFP4_MODELS = {
    "gpt-oss-120b": dict(E=128, topk=4, K=2880, N=2880),
    "gpt-oss-20b": dict(E=32, topk=4, K=2880, N=2880),
}
# --quant mxfp4 --models ...: tensor-parallel shards of gpt-oss-120b (not in the default run), N = 2880 / TP
# padded up to a multiple of 64 (the MMA layout's columns; 720 -> 768, 360 -> 384)
MXFP4_SHARDS = {
    "gpt-oss-120b-tp4": dict(E=128, topk=4, K=2880, N=768),
    "gpt-oss-120b-tp8": dict(E=128, topk=4, K=2880, N=384),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
ACTIVATION = "swigluoai"
TOLERANCE = 1e-2
IMPLS = ("ours", "triton_kernels", "grouped_mm")
MXFP4_IMPLS = ("ours", "triton_kernels", "ours_checkpoint", "ours_bf16")
TARGET_GEOMEAN, TARGET_MAX = 1.25, 2.0
MXFP4_TARGET_GEOMEAN, MXFP4_TARGET_M1 = 1.35, 1.8
MXFP4_WEIGHT_BITS = 4.25  # 4-bit e2m1 values + one 8-bit E8M0 scale per 32 weights
MXFP4_QUANTIZE_CHUNK = 8  # experts quantized at a time (fp32 temporaries of ~0.5 GB per 8 gpt-oss W1s)
DEVICE = "cuda"
# NOTE: the weights are one stack per model and cannot be rotated like inputs (gpt-oss: 6.4 GB); what keeps
# them coming from DRAM at small M (4-8 experts, 75-200 MB, touched per call) is that successive calls use
# different random routings and so touch different experts. harness.rotating sizes a rotation by bytes per
# set and would give small M 1-2 sets; every cell rotates among its cap, 8 input sets, instead (at most
# 8 x 32 MB of hidden states at M = 4096).
ROUTINGS = 8
ROUNDS = 5  # interleaved rounds per cell (harness.time_interleaved_us)


def mxfp4_shapes() -> dict:
    """The shapes --quant mxfp4 runs: the gpt-oss models and the shards."""
    return {**MXFP4_MODELS, **MXFP4_SHARDS}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", choices=("none", "mxfp4"), default="none",
                   help="expert weight format: 'none' = bf16 weights, the three models; 'mxfp4' = MXFP4 weights, "
                        "the gpt-oss models, columns ours / triton_kernels / ours_bf16 (default: %(default)s)")
    p.add_argument("--models", nargs="+", choices=list(dict.fromkeys([*MODELS, *mxfp4_shapes()])), default=None,
                   help=f"models to run (default: all of the quant's: {', '.join(MODELS)} for none; "
                        f"{', '.join(MXFP4_MODELS)} for mxfp4)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS),
                   help="token counts M (default: %(default)s)")
    p.add_argument("--out", default=str(BENCH_DIR / "results"),
                   help="directory for the JSON (default: %(default)s)")
    p.add_argument("--skip-peers", action="store_true",
                   help="time ours only (the other columns null: triton_kernels and grouped_mm; with --quant mxfp4 "
                        "triton_kernels and ours_bf16)")
    p.add_argument("--bias", action="store_true",
                   help="--quant mxfp4 only: random fp32 biases w1_bias [E, 2N], w2_bias [E, K] (gpt-oss has them) "
                        "for every column (default: none, like the bf16 run)")
    p.add_argument("--weight-layout", choices=("linear", "transposed"), default="linear",
                   help="storage of the expert weights: 'linear' = w1 [E, 2N, K] contiguous (nn.Linear, the op's "
                        "logical layout); 'transposed' = [E, K, 2N] storage passed as transposed views (vLLM's OAI "
                        "layout). Every implementation gets the same views; with --quant mxfp4 the packed weights, "
                        "their scales and the bf16 copies alike. (default: %(default)s)")
    args = p.parse_args(argv)
    table = MXFP4_MODELS if args.quant == "mxfp4" else MODELS
    if args.models is None:
        args.models = list(table)
    if args.quant == "mxfp4":
        table = mxfp4_shapes()
    wrong = [m for m in args.models if m not in table]
    if wrong:
        p.error(f"--quant {args.quant} runs {', '.join(table)}; not {', '.join(wrong)}")
    if args.bias and args.quant != "mxfp4":
        p.error("--bias is for --quant mxfp4 (the bf16 run's grouped_mm pipeline has no biases)")
    return args


def rel_err(out, ref) -> float:
    out64, ref64 = out.double(), ref.double()
    if not bool(out64.isfinite().all()):
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def make_weights(torch, e: int, k: int, n: int, layout: str):
    """Random bf16 expert weights as the op takes them: w1 [E, 2N, K], w2 [E, K, N] (views per ``layout``)."""
    def stack(rows: int, cols: int):
        shape = (e, rows, cols) if layout == "linear" else (e, cols, rows)
        w = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE).mul_(1.0 / math.sqrt(cols))
        return w if layout == "linear" else w.transpose(1, 2)

    return stack(2 * n, k), stack(k, n)


def make_mxfp4_weights(torch, e: int, k: int, n: int, layout: str, with_bf16: bool) -> dict:
    """Random MXFP4 expert weights as the op takes them, quantized on the GPU in chunks of experts.

    Returns ``{"w1", "w1_scale", "w2", "w2_scale"}`` (packed uint8 ``[E, 2N, K/2]`` + E8M0 ``[E, 2N, K/32]``,
    ``[E, K, N/2]`` + ``[E, K, N/32]``) and, with ``with_bf16``, ``"w1_bf16"`` / ``"w2_bf16"``: the same weights
    dequantized to bf16 (exact: an e2m1 value times a power of two fits bf16). ``layout`` as in make_weights,
    applied to every tensor of a stack.
    """
    import harness

    def as_layout(t):
        return t if layout == "linear" or t is None else t.transpose(1, 2).contiguous().transpose(1, 2)

    def stack(rows: int, cols: int):
        packed, scales, dense = harness.random_mxfp4_stack(e, rows, cols, DEVICE, MXFP4_QUANTIZE_CHUNK, with_bf16)
        return as_layout(packed), as_layout(scales), as_layout(dense)

    out = {}
    out["w1"], out["w1_scale"], out["w1_bf16"] = stack(2 * n, k)
    out["w2"], out["w2_scale"], out["w2_bf16"] = stack(k, n)
    torch.cuda.empty_cache()
    return out


def make_routing(torch, m: int, e: int, topk: int, k: int):
    """One input set: hidden states, router weights (softmax over the chosen) and topk distinct expert ids."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.rand(m, e, device=DEVICE).topk(topk, dim=1).indices.to(torch.int32)
    weights = torch.randn(m, topk, device=DEVICE).softmax(dim=-1)
    return x, weights, ids


def grouped_mm_pipeline(torch, swigluoai_and_mul):
    """``fn(x, w1, w2, topk_weights, topk_ids)`` through ``torch._grouped_mm``, capture-safe (no host sync).

    NOTE: a baseline for valid routing only (ids in [0, E)), as in the benchmark: pairs sorted by expert id,
    ``offs`` = cumulative per-expert counts (int32, from searchsorted on the sorted ids: no bincount, no
    sync); ``torch._grouped_mm`` (bf16, 2-D x 3-D with offsets) reads ``w1ᵀ`` / ``w2ᵀ`` as views; the weighted
    sum over the slots is one bmm (fp32 accumulation) on the un-sorted rows.
    """

    def run(x, w1, w2, topk_weights, topk_ids):
        m, topk = topk_ids.shape
        flat = topk_ids.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)
        experts = torch.arange(w1.shape[0], dtype=sorted_ids.dtype, device=x.device)
        offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
        h = torch._grouped_mm(x.index_select(0, order // topk), w1.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(swigluoai_and_mul(h), w2.transpose(1, 2), offs=offs)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        y = y.index_select(0, inverse).view(m, topk, -1)
        return torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_fused_experts: needs a CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCH_DIR))
    import harness

    import moe_extension  # noqa: F401  (registers torch.ops.moe_ext)
    from moe_extension.backends import triton_kernels as tk_backend
    from moe_extension.ops import swigluoai_and_mul

    info = harness.device_info()
    copy_bw = harness.copy_bandwidth()
    gemm_peak = harness.gemm_peak(torch.bfloat16)
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}")
    print(f"ceilings: copy {copy_bw / 1e9:.0f} GB/s (read + write), bf16 GEMM {gemm_peak / 1e12:.0f} TFLOP/s")
    if args.quant == "mxfp4":
        return main_mxfp4(args, torch, harness, tk_backend, info, copy_bw, gemm_peak)
    print(f"activation {ACTIVATION} for every model and implementation; bf16; random routing (rand(M, E).topk); "
          f"weights {args.weight_layout}; CUDA-graph replay medians")

    unavailable = {}
    if args.skip_peers:
        unavailable = {"triton_kernels": "skipped (--skip-peers)", "grouped_mm": "skipped (--skip-peers)"}
    else:
        if not tk_backend.is_available():
            unavailable["triton_kernels"] = tk_backend.unavailable_reason()
        if not hasattr(torch, "_grouped_mm"):
            unavailable["grouped_mm"] = f"torch {torch.__version__} has no torch._grouped_mm"
    for name, reason in unavailable.items():
        print(f"{name}: column null: {reason}")

    grouped_mm = grouped_mm_pipeline(torch, swigluoai_and_mul)
    rows = []
    for model in args.models:
        shape = MODELS[model]
        e, k, n = shape["E"], shape["K"], shape["N"]
        w1, w2 = make_weights(torch, e, k, n, args.weight_layout)
        expert_bytes = (2 * n * k + k * n) * w1.element_size()
        impls = {
            "ours": lambda x, weights, ids: torch.ops.moe_ext.fused_experts(x, w1, w2, weights, ids, ACTIVATION),
            "triton_kernels": lambda x, weights, ids: tk_backend.fused_experts(x, w1, w2, weights, ids, ACTIVATION),
            "grouped_mm": lambda x, weights, ids: grouped_mm(x, w1, w2, weights, ids),
        }

        def reference(x, weights, ids):
            return torch.ops.moe_ext.fused_experts(x, w1, w2, weights, ids, ACTIVATION, backend="torch")

        for m in args.tokens:
            rows.append(run_cell(torch, harness, impls, reference, unavailable, model, shape, m, expert_bytes,
                                 copy_bw, gemm_peak))
        del w1, w2, impls, reference
        torch.cuda.empty_cache()

    summary = summarize(rows)
    print_table(rows, summary)
    payload = dict(info, copy_GBps=copy_bw / 1e9, gemm_TFLOPs=gemm_peak / 1e12, activation=ACTIVATION,
                   dtype="bfloat16", weight_layout=args.weight_layout,
                   routing="random: each token picks topk distinct experts uniformly (torch.rand(M, E).topk); "
                           "router weights softmax of randn over the chosen; rotated among input sets",
                   timing=harness.interleaved_timing(ROUNDS) + "; every implementation starts from hidden_states, "
                          "topk_weights, topk_ids (its routing work included)",
                   floor="max(bytes / copy_BW, flops / gemm_peak); bytes = weights of the experts hit + x + out",
                   unavailable=unavailable, summary=summary, rows=rows)
    path = harness.write_json(f"fused_experts_{harness.gpu_slug()}.json", payload, args.out)
    print(f"wrote {path}")
    return 0


def main_mxfp4(args, torch, harness, tk_backend, info, copy_bw, gemm_peak) -> int:
    """``--quant mxfp4``: ours (MMA layout), triton_kernels (prepared MXFP4 weights), ours on the checkpoint layout
    and on bf16 copies; see the docstring."""
    from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma

    bias_note = "fp32 biases" if args.bias else "no biases"
    print(f"activation {ACTIVATION} for every model and implementation; MXFP4 weights, bf16 activations, "
          f"{bias_note}; random routing (rand(M, E).topk); weights {args.weight_layout}; CUDA-graph replay medians")

    unavailable = {}
    if args.skip_peers:
        unavailable = {"triton_kernels": "skipped (--skip-peers)", "ours_bf16": "skipped (--skip-peers)"}
    elif not tk_backend.is_available():
        unavailable["triton_kernels"] = tk_backend.unavailable_reason()
    for name, reason in unavailable.items():
        print(f"{name}: column null: {reason}")

    rows = []
    for model in args.models:
        shape = mxfp4_shapes()[model]
        e, k, n = shape["E"], shape["K"], shape["N"]
        w = make_mxfp4_weights(torch, e, k, n, args.weight_layout, with_bf16="ours_bf16" not in unavailable)
        biases = {"w1_bias": None, "w2_bias": None}
        if args.bias:
            biases = {"w1_bias": torch.randn(e, 2 * n, device=DEVICE) * 0.1,
                      "w2_bias": torch.randn(e, k, device=DEVICE) * 0.1}
        mx = dict(quant="mxfp4", w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], **biases)
        q1, t1 = prepare_mxfp4_mma(w["w1"], w["w1_scale"])  # once, outside the timing (weight-load time)
        q2, t2 = prepare_mxfp4_mma(w["w2"], w["w2_scale"])
        mma = dict(quant="mxfp4_mma", w1_scale=t1, w2_scale=t2, **biases)
        expert_bytes = (2 * n * k + k * n) * MXFP4_WEIGHT_BITS / 8
        prepared, prepare_error = None, None
        if "triton_kernels" not in unavailable:
            # prepared once, outside the timing (vLLM does this at weight-load time)
            try:
                prepared = (tk_backend.prepare_mxfp4(w["w1"], w["w1_scale"]),
                            tk_backend.prepare_mxfp4(w["w2"], w["w2_scale"]))
            except Exception as exc:  # noqa: BLE001  (reported in every row of the model, column null)
                prepare_error = f"prepare_mxfp4 {_describe(exc)}"
                print(f"triton_kernels: {prepare_error}")

        def peer_tk(x, weights, ids, prepared=prepared, prepare_error=prepare_error, biases=biases):
            if prepared is None:
                raise RuntimeError(prepare_error)
            return tk_backend.fused_experts(x, *prepared, weights, ids, ACTIVATION, quant="mxfp4", **biases)

        impls = {
            "ours": lambda x, weights, ids: torch.ops.moe_ext.fused_experts(x, q1, q2, weights, ids, ACTIVATION,
                                                                            **mma),
            "triton_kernels": peer_tk,
            "ours_checkpoint": lambda x, weights, ids: torch.ops.moe_ext.fused_experts(x, w["w1"], w["w2"], weights,
                                                                                       ids, ACTIVATION, **mx),
            "ours_bf16": lambda x, weights, ids: torch.ops.moe_ext.fused_experts(x, w["w1_bf16"], w["w2_bf16"],
                                                                                 weights, ids, ACTIVATION, **biases),
        }

        def reference(x, weights, ids):
            return torch.ops.moe_ext.fused_experts(x, w["w1"], w["w2"], weights, ids, ACTIVATION, backend="torch",
                                                   **mx)

        for m in args.tokens:
            rows.append(run_cell(torch, harness, impls, reference, unavailable, model, shape, m, expert_bytes,
                                 copy_bw, gemm_peak))
        del w, biases, mx, mma, q1, q2, t1, t2, prepared, impls, reference, peer_tk
        torch.cuda.empty_cache()

    summary = summarize_mxfp4(rows)
    print_table(rows, summary, MXFP4_IMPLS, caption="MXFP4 weights, bf16 activations")
    print_mxfp4_targets(summary)
    try:
        import triton_kernels

        tk_location = str(Path(triton_kernels.__file__).resolve().parent)
    except Exception:  # noqa: BLE001
        tk_location = None
    payload = dict(info, pythonpath=os.environ.get("PYTHONPATH"), triton_kernels_location=tk_location,
                   copy_GBps=copy_bw / 1e9, gemm_TFLOPs=gemm_peak / 1e12, activation=ACTIVATION, quant="mxfp4",
                   dtype="bfloat16 activations; MXFP4 weights (e2m1 + E8M0 per 32, quantize_mxfp4 of randn/sqrt(cols))",
                   biases=bool(args.bias), weight_layout=args.weight_layout, weight_bits=MXFP4_WEIGHT_BITS,
                   columns={
                       "ours": "torch.ops.moe_ext.fused_experts(..., quant='mxfp4_mma') on weights prepared once "
                               "(prepare_mxfp4_mma), default backend",
                       "ours_checkpoint": "torch.ops.moe_ext.fused_experts(..., quant='mxfp4') on the checkpoint "
                                          "layout, default backend",
                       "triton_kernels": "matmul_ogs on MXFP4 weights prepared once (prepare_mxfp4, vLLM's gpt-oss "
                                         "layouts), routing included",
                       "ours_bf16": "torch.ops.moe_ext.fused_experts on the same weights dequantized to bf16, "
                                    "default backend (reference)",
                   },
                   routing="random: each token picks topk distinct experts uniformly (torch.rand(M, E).topk); "
                           "router weights softmax of randn over the chosen; rotated among input sets",
                   timing=harness.interleaved_timing(ROUNDS) + "; every implementation starts from hidden_states, "
                          "topk_weights, topk_ids (its routing work included)",
                   floor="max(bytes / copy_BW, flops / bf16 gemm_peak); bytes = weights of the experts hit at "
                         f"{MXFP4_WEIGHT_BITS} bits per weight (packed e2m1 + E8M0 scales) + x + out",
                   unavailable=unavailable, summary=summary, rows=rows)
    path = harness.write_json(f"fused_experts_mxfp4_{harness.gpu_slug()}.json", payload, args.out)
    print(f"wrote {path}")
    return 0


def run_cell(torch, harness, impls, reference, unavailable, model, shape, m, expert_bytes, copy_bw,
             gemm_peak) -> dict:
    """Check, then time, every implementation on one (model, M) cell; returns its JSON row.

    ``impls``: name -> ``fn(x, topk_weights, topk_ids)`` (the weights are bound in); ``reference``: the op's
    PyTorch backend on the same weights, what ours is checked against."""
    e, topk, k, n = shape["E"], shape["topk"], shape["K"], shape["N"]

    def set_bytes(input_set):
        return int(torch.unique(input_set[2].cpu()).numel()) * expert_bytes + 2 * m * k * 2

    sets = [make_routing(torch, m, e, topk, k) for _ in range(ROUTINGS)]
    nbytes = statistics.mean(set_bytes(s) for s in sets)
    flops = 2 * m * topk * (k * 2 * n + n * k)
    row = dict(model=model, M=m, E=e, topk=topk, K=k, N=n,
               floor_us=max(nbytes / copy_bw, flops / gemm_peak) * 1e6,
               experts_hit=statistics.mean(int(torch.unique(s[2].cpu()).numel()) for s in sets), bytes=nbytes,
               flops=flops, input_sets=len(sets), failures={})
    x, weights, ids = sets[0]
    references, timed = {}, {}
    try:
        references["the PyTorch backend"] = reference(x, weights, ids)
    except Exception as exc:  # noqa: BLE001  (ours is then checked against nothing; said in the row)
        row["failures"]["torch_backend"] = _describe(exc)
    for name, fn in impls.items():
        row[f"{name}_us"] = row[f"{name}_rel_err"] = None
        if name in unavailable:
            continue
        # ours is checked against the PyTorch backend, each peer against ours (the PyTorch backend if ours failed)
        against = next((ref for ref in ("ours", "the PyTorch backend") if ref in references and ref != name), None)
        try:
            out = fn(x, weights, ids)
            if against is not None:
                err = rel_err(out, references[against])
                row[f"{name}_rel_err"] = err
                if not err <= TOLERANCE:
                    row["failures"][name] = f"FAILED check: rel err {err:.2e} vs {against} > {TOLERANCE:g}; not timed"
                    continue
            elif name != "ours":
                row["failures"][name] = "no reference to check against (ours and the PyTorch backend failed); not timed"
                continue
            if name == "ours":
                references["ours"] = out
            timed[name] = lambda i, fn=fn: fn(*sets[i % len(sets)])
        except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
            row["failures"][name] = _describe(exc)
            references.pop(name, None)
        torch.cuda.synchronize()
    harness.record_rounds(row, *harness.time_interleaved_us(timed, len(sets), ROUNDS), _describe)
    print_row(row, tuple(impls))
    return row


def _describe(exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}: {first_line}"


def _ratio(row, name) -> str:
    us = row[f"{name}_us"]
    return f"{us:9.1f} ({us / row['floor_us']:4.2f})" if us is not None else f"{'-':>9} {'':6}"


def print_row(row, names=IMPLS) -> None:
    errs = "  ".join(f"{name} {row[f'{name}_rel_err']:.1e}" for name in names if row[f"{name}_rel_err"] is not None)
    cells = "  ".join(f"{name} {_ratio(row, name)}" for name in names)
    print(f"{row['model']:<14} M={row['M']:<5} floor {row['floor_us']:8.1f} us  {cells}  rel err: {errs}")
    for name, failure in row["failures"].items():
        print(f"    {name}: {failure}")


def summarize(rows) -> dict:
    """The issue's targets over the cells: ours <= triton_kernels, geomean and max of ours / floor; where
    triton_kernels' median is below ours, the two round by round (``triton_kernels_rounds``,
    ``harness.round_ratios``: ours / triton_kernels per round, rounds ours won)."""
    from harness import round_ratios

    ratios = [r["ours_us"] / r["floor_us"] for r in rows if r["ours_us"] is not None]
    both = [r for r in rows if r["ours_us"] is not None and r["triton_kernels_us"] is not None]
    lost = {f"{r['model']} M={r['M']}": round_ratios(r, "ours", "triton_kernels") for r in both
            if r["ours_us"] > r["triton_kernels_us"]}
    return dict(
        cells=len(rows),
        ours_timed=len(ratios),
        ours_le_triton_kernels=sum(r["ours_us"] <= r["triton_kernels_us"] for r in both),
        compared_with_triton_kernels=len(both),
        triton_kernels_rounds={cell: v for cell, v in lost.items() if v is not None},
        geomean_ours_over_floor=math.exp(statistics.mean(math.log(v) for v in ratios)) if ratios else None,
        max_ours_over_floor=max(ratios) if ratios else None,
    )


def _geomean_over_floor(rows, name):
    ratios = [r[f"{name}_us"] / r["floor_us"] for r in rows if r.get(f"{name}_us") is not None]
    return math.exp(statistics.mean(math.log(v) for v in ratios)) if ratios else None


def summarize_mxfp4(rows) -> dict:
    """``summarize`` plus the MXFP4 targets: ours / floor at M = 1 per model, and which targets are met.

    A target counts as met only when every cell it covers was timed (a null cell is not a pass)."""
    s = summarize(rows)
    m1_rows = [r for r in rows if r["M"] == 1]
    m1 = {r["model"]: r["ours_us"] / r["floor_us"] for r in m1_rows if r["ours_us"] is not None}
    s.update(
        geomean_triton_kernels_over_floor=_geomean_over_floor(rows, "triton_kernels"),
        geomean_ours_bf16_over_floor=_geomean_over_floor(rows, "ours_bf16"),
        geomean_ours_checkpoint_over_floor=_geomean_over_floor(rows, "ours_checkpoint"),
        m1_ours_over_floor=m1,
        max_m1_ours_over_floor=max(m1.values()) if m1 else None,
        targets=dict(ours_le_triton_kernels="every cell", geomean_ours_over_floor=MXFP4_TARGET_GEOMEAN,
                     m1_ours_over_floor=MXFP4_TARGET_M1),
    )
    geo = s["geomean_ours_over_floor"]
    s["targets_met"] = dict(
        ours_le_triton_kernels=s["compared_with_triton_kernels"] == s["cells"] > 0
        and s["ours_le_triton_kernels"] == s["cells"],
        geomean_ours_over_floor=s["ours_timed"] == s["cells"] > 0 and geo <= MXFP4_TARGET_GEOMEAN,
        m1_ours_over_floor=(None if not m1_rows else
                            len(m1) == len(m1_rows) and s["max_m1_ours_over_floor"] <= MXFP4_TARGET_M1),
    )
    return s


def print_table(rows, summary, names=IMPLS, caption="bf16") -> None:
    print()
    print(f"µs per call (ratio to floor); activation swigluoai everywhere, {caption}, routing included for every "
          "column")
    print(f"{'model':<14} {'M':>5} {'floor':>9} " + " ".join(f"{name:>16}" for name in names))
    for r in rows:
        print(f"{r['model']:<14} {r['M']:>5} {r['floor_us']:9.1f} " + " ".join(f"{_ratio(r, name):>16}"
                                                                            for name in names))
    s = summary
    print()
    geo = "n/a" if s["geomean_ours_over_floor"] is None else f"{s['geomean_ours_over_floor']:.3f}"
    mx = "n/a" if s["max_ours_over_floor"] is None else f"{s['max_ours_over_floor']:.3f}"
    print(f"ours <= triton_kernels: {s['ours_le_triton_kernels']} of {s['compared_with_triton_kernels']} "
          f"compared cells (target: every cell of {s['cells']})")
    for cell, v in s.get("triton_kernels_rounds", {}).items():
        print(f"    {cell}: ours / triton_kernels per round {v['min']:.3f}-{v['max']:.3f}, ours faster in "
              f"{v['faster']} of {v['rounds']}")
    if names == IMPLS:
        print(f"geomean(ours / floor) = {geo} over {s['ours_timed']} cells (target <= {TARGET_GEOMEAN})")
        print(f"max(ours / floor) = {mx} (target <= {TARGET_MAX})")
    else:
        print(f"geomean(ours / floor) = {geo} over {s['ours_timed']} of {s['cells']} cells "
              f"(target <= {MXFP4_TARGET_GEOMEAN})")


def print_mxfp4_targets(s) -> None:
    m1 = ", ".join(f"{model} {ratio:.3f}" for model, ratio in s["m1_ours_over_floor"].items()) or "n/a"
    print(f"M = 1: ours / floor = {m1} (target <= {MXFP4_TARGET_M1})")
    for name in ("triton_kernels", "ours_checkpoint", "ours_bf16"):
        geo = s[f"geomean_{name}_over_floor"]
        print(f"geomean({name} / floor) = {'n/a' if geo is None else f'{geo:.3f}'} (for reference)")
    met = s["targets_met"]
    print("targets met: " + ", ".join(f"{key} {'n/a' if ok is None else ('yes' if ok else 'NO')}"
                                      for key, ok in met.items()))


if __name__ == "__main__":
    sys.exit(main())
