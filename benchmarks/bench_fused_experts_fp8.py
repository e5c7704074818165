"""Benchmark ``moe_ext::fused_experts`` with fp8 block weights (``quant="fp8_block"``, DeepSeek-V3's recipe) against
its peers and the hardware floor, in one run.

Cells: the DeepSeek-V3 MoE layer (E 256, topk 8, K 7168, N 2048, silu; fp8 expert weights ~11 GB) and an
expert-parallel shard of it (E_global 256 routed, 32 local experts through an ``expert_map``: the first 32 global
ids), M tokens in {1, 16, 64, 256, 1024, 4096, 8192}, random routing (each token picks topk distinct experts
uniformly among the 256, ``torch.rand(M, 256).topk``; drawn from a generator seeded per cell, ``cell_seed``, so
every run times the same inputs), bf16 hidden states. Timed by CUDA-graph replay: each column captured once (~25 ms
of calls per graph), then 5 interleaved rounds that replay every column's graph once (``harness.time_interleaved_us``;
a column's time is the median of its rounds, the row keeps them as ``rounds_us``), every column from the same
``hidden_states``, ``topk_weights``, ``topk_ids`` with all of its routing work and activation quantization included:

- ``ours_auto``: ``torch.ops.moe_ext.fused_experts(..., quant="fp8_block")`` with the default backend (DeepGEMM
  where the per-device crossover stored with the tuned table says so, our Triton kernels elsewhere);
- ``ours_triton``: the same op with ``backend="triton"``;
- ``deep_gemm``: the same op with ``backend="deep_gemm"`` (DeepGEMM's m-grouped contiguous fp8 GEMMs; null when
  DeepGEMM is not importable or the case is outside its rule);
- ``vllm``: vLLM's Triton ``fused_moe_kernel`` (w8a8 block fp8) through ``benchmarks/vllm_peer.py`` with vLLM's
  shipped H100 config for (E, N) where one exists (else vLLM's default config; the JSON says which), its routing
  alignment, activation quantization, ``moe_ext.silu_and_mul`` and ``moe_ext.moe_sum`` included.

The floor of a cell is ``max(bytes / copy_BW, flops / fp8_peak)``: bytes = fp8 weights (+ their fp32 block
scales) of the local experts the routing hits + x in + out written; flops = ``2 P (K 2N + N K)`` over the P
(token, slot) pairs routed to local experts; copy_BW and the dense fp8 GEMM rate (``torch._scaled_mm``, 8192^3)
measured at the start of the run. Before timing, ``ours_auto`` is checked against the PyTorch backend and every
other column against it (rel err <= 1e-2; 3e-2 for ``deep_gemm`` and ``vllm``, see TOLERANCES). Writes
``fused_experts_fp8_<gpu>.json`` under ``--out``. CUDA only (``--help`` works anywhere). Targets (summary):
ours_auto <= every peer in every cell; ours_auto <= 1.15x floor at M <= 64; the first GEMM of ours_triton >= 600
TFLOP/s at M = 8192 (``--gemm1``: times ``expert_gemm1`` alone on the full layer, whose flops are ``2 P K 2N``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import zlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

SHAPES = {
    "deepseek-v3": dict(E=256, topk=8, K=7168, N=2048, local=256),
    "deepseek-v3-ep32": dict(E=256, topk=8, K=7168, N=2048, local=32),
}
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
# ``--zoo``: other shapes that ship fp8 128 x 128 block weights (read off the models' published configs: hidden size
# K, moe_intermediate_size / tensor-parallel degree N, routed experts, experts per token; ``local`` experts of an
# expert-parallel rank), at the zoo's token counts. Not the benchmark: a check that the heuristic and kernels
# hold on shapes no table entry was tuned for.
ZOO_SHAPES = {
    "qwen3-30b-a3b": dict(E=128, topk=8, K=2048, N=768, local=128),  # Qwen/Qwen3-30B-A3B-FP8
    "qwen3-235b-a22b-tp4": dict(E=128, topk=8, K=4096, N=384, local=128),  # Qwen/Qwen3-235B-A22B-FP8, TP 4
    "qwen3-next-80b-a3b-tp2": dict(E=512, topk=10, K=2048, N=256, local=512),  # Qwen3-Next-80B-A3B-*-FP8, TP 2
    "deepseek-v3-tp16": dict(E=256, topk=8, K=7168, N=128, local=256),  # DeepSeek-V3 on two 8-GPU nodes, TP 16
    "kimi-k2-ep8": dict(E=384, topk=8, K=7168, N=2048, local=48),  # moonshotai/Kimi-K2-Instruct, EP 8
}
ZOO_TOKENS = (1, 8, 64, 512, 2048, 8192)
ALL_SHAPES = {**SHAPES, **ZOO_SHAPES}
ACTIVATION = "silu"
TOLERANCE = 1e-2
# The DeepGEMM route and vLLM write the first GEMM's output in bf16 and quantize that for the second (DeepGEMM's
# grouped GEMM has no fp8 or fp32 output; vLLM's cache is bf16), where ours and the PyTorch backend quantize the
# fp32 values: 1.5e-2 to 1.6e-2 apart on these shapes (the same inputs), so their columns are checked at this bound.
TOLERANCES = {"deep_gemm": 3e-2, "vllm": 3e-2}
IMPLS = ("ours_auto", "ours_triton", "deep_gemm", "vllm")
TARGET_SMALL_M, SMALL_M = 1.15, 64
TARGET_GEMM1_TFLOPS = 600.0
ROUTINGS = 8  # input sets rotated per cell (see bench_fused_experts.ROUTINGS)
ROUNDS = 5  # interleaved rounds per cell (harness.time_interleaved_us)
DEVICE = "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(ALL_SHAPES), default=None,
                   help=f"default: {' '.join(SHAPES)}; with --zoo {' '.join(ZOO_SHAPES)}")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help=f"token counts M (default: {' '.join(map(str, TOKENS))}; with --zoo "
                        f"{' '.join(map(str, ZOO_TOKENS))})")
    p.add_argument("--zoo", action="store_true",
                   help="the shapes of ZOO_SHAPES (other fp8 block models) instead; writes "
                        "fused_experts_fp8_zoo_<gpu>.json")
    p.add_argument("--out", default=str(BENCH_DIR / "results"), help="directory for the JSON (default: %(default)s)")
    p.add_argument("--skip-peers", action="store_true", help="time ours_auto and ours_triton only")
    p.add_argument("--gemm1", action="store_true",
                   help="also time our first GEMM alone (expert_gemm1, backend Triton) on the full layer at the "
                        "largest M, in TFLOP/s")
    p.add_argument("--vllm-deps", default=".deps/vllm", help="where get_peers.sh vllm put the kernel and configs")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = list(ZOO_SHAPES if args.zoo else SHAPES)
    if args.tokens is None:
        args.tokens = list(ZOO_TOKENS if args.zoo else TOKENS)
    return args


def fp8_gemm_peak(torch, harness, n: int = 8192) -> float:
    """Dense fp8 (e4m3) ``n x n x n`` GEMM rate in FLOP/s through ``torch._scaled_mm`` (bf16 out)."""
    a = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=DEVICE)

    def mm():
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    ms = statistics.median(harness._events_time_ms(mm, 20))
    return 2 * n**3 / (ms * 1e-3)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_fused_experts_fp8: needs a CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCH_DIR))
    import harness
    import vllm_peer
    from bench_fused_experts import _describe, rel_err

    import moe_extension  # noqa: F401  (registers the ops)
    from moe_extension.backends import deep_gemm

    info = harness.device_info()
    copy_bw, peak = harness.copy_bandwidth(), fp8_gemm_peak(torch, harness)
    print(f"{info['device']}: copy {copy_bw / 1e9:.0f} GB/s, fp8 GEMM {peak / 1e12:.0f} TFLOP/s")
    unavailable = {}
    if args.skip_peers:
        unavailable = {"deep_gemm": "skipped (--skip-peers)", "vllm": "skipped (--skip-peers)"}
    else:
        if not deep_gemm.is_available():
            unavailable["deep_gemm"] = deep_gemm.unavailable_reason()
        kernel, reason = vllm_peer.load(args.vllm_deps)
        if kernel is None:
            unavailable["vllm"] = reason
    for name, reason in unavailable.items():
        print(f"{name}: column null: {reason}")

    rows, gemm1 = [], None
    for shape_name in args.shapes:
        shape = ALL_SHAPES[shape_name]
        E, topk, K, N, local = shape["E"], shape["topk"], shape["K"], shape["N"], shape["local"]
        w1, s1 = harness.random_fp8_block_stack(local, 2 * N, K, DEVICE)
        w2, s2 = harness.random_fp8_block_stack(local, K, N, DEVICE)
        emap = None
        if local < E:
            emap = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
            emap[:local] = torch.arange(local, dtype=torch.int32, device=DEVICE)
        expert_bytes = 3 * N * K * (1 + 4 / 128**2)
        fp8 = dict(quant="fp8_block", w1_scale=s1, w2_scale=s2, expert_map=emap)

        def op(backend, x, g, ids, fp8=fp8, w1=w1, w2=w2):
            return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, ACTIVATION, backend=backend, **fp8)

        vllm_moe, vllm_source = None, None
        if "vllm" not in unavailable:
            try:
                vllm_moe = vllm_peer.VllmFusedMoE(kernel, w1, w2, topk=topk, max_tokens=max(args.tokens),
                                                  activation=ACTIVATION, quant="fp8_block", w1_scale=s1, w2_scale=s2,
                                                  expert_map=emap, global_num_experts=E,
                                                  configs_dir=Path(args.vllm_deps) / "configs")
                vllm_source = vllm_moe.config_source
            except Exception as exc:  # noqa: BLE001  (column null for this shape, said in the rows)
                vllm_source = f"VllmFusedMoE {_describe(exc)}"
            print(f"{shape_name}: vllm config: {vllm_source}")
        impls = {
            "ours_auto": lambda x, g, ids: op("auto", x, g, ids),
            "ours_triton": lambda x, g, ids: op("triton", x, g, ids),
            "deep_gemm": lambda x, g, ids: op("deep_gemm", x, g, ids),
            "vllm": (lambda x, g, ids, moe=vllm_moe: moe.full(x, g, ids)) if vllm_moe is not None else None,
        }
        for m in args.tokens:
            rows.append(run_cell(torch, harness, rel_err, _describe, impls, unavailable, shape_name, shape, m,
                                 expert_bytes, copy_bw, peak, lambda x, g, ids: op("torch", x, g, ids),
                                 vllm_source))
        if args.gemm1 and emap is None:
            gemm1 = time_gemm1(torch, harness, w1, s1, topk, K, N, E, max(args.tokens))
        del w1, w2, s1, s2, impls, vllm_moe
        torch.cuda.empty_cache()

    summary = summarize(rows, gemm1)
    print_table(rows, summary)
    payload = dict(info, copy_GBps=copy_bw / 1e9, fp8_gemm_TFLOPs=peak / 1e12, activation=ACTIVATION,
                   quant="fp8_block", shapes={n: ALL_SHAPES[n] for n in args.shapes},
                   unavailable=unavailable,
                   dtype="bf16 hidden states; fp8 e4m3 weights with fp32 128 x 128 block scales (random)",
                   columns={
                       "ours_auto": "torch.ops.moe_ext.fused_experts(..., quant='fp8_block'), default backend",
                       "ours_triton": "the same, backend='triton'",
                       "deep_gemm": "the same, backend='deep_gemm' (DeepGEMM m-grouped contiguous fp8 GEMMs)",
                       "vllm": "vLLM 0.33.0 Triton fused_moe_kernel (w8a8 block) via benchmarks/vllm_peer.py, "
                               "routing + quantization + silu_and_mul + moe_sum included",
                   },
                   routing="random: each token picks topk distinct experts among E_global uniformly; router "
                           "weights softmax of randn; rotated among input sets",
                   timing=harness.interleaved_timing(ROUNDS),
                   floor="max(bytes / copy_BW, flops / fp8 GEMM peak); bytes = fp8 weights + block scales of the "
                         "local experts hit + x + out; flops over the pairs routed to local experts",
                   gemm1=gemm1, summary=summary, rows=rows)
    stem = "fused_experts_fp8_zoo" if args.zoo else "fused_experts_fp8"
    path = harness.write_json(f"{stem}_{harness.gpu_slug()}.json", payload, args.out)
    print(f"wrote {path}")
    return 0


def cell_seed(shape_name: str, m: int) -> int:
    """The seed of one cell's inputs: the same hidden states and routings every run, whichever cells run with it."""
    return zlib.crc32(f"{shape_name} M={m}".encode())


def run_cell(torch, harness, rel_err, describe, impls, unavailable, shape_name, shape, m, expert_bytes, copy_bw,
             peak, reference, vllm_source) -> dict:
    """Check, then time, every column on one (shape, M) cell; returns its JSON row."""
    E, topk, K, N, local = shape["E"], shape["topk"], shape["K"], shape["N"], shape["local"]
    gen = torch.Generator(device=DEVICE).manual_seed(cell_seed(shape_name, m))
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(m, K, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        ids = torch.rand(m, E, device=DEVICE, generator=gen).topk(topk, dim=1).indices.to(torch.int32)
        sets.append((x, torch.randn(m, topk, device=DEVICE, generator=gen).softmax(dim=-1), ids))
    hit = statistics.mean(int(torch.unique(s[2][s[2] < local]).numel()) for s in sets)
    pairs = statistics.mean(int((s[2] < local).sum()) for s in sets)
    nbytes = hit * expert_bytes + 2 * m * K * 2
    flops = 2 * pairs * (K * 2 * N + N * K)
    row = dict(shape=shape_name, M=m, E=E, local_experts=local, topk=topk, K=K, N=N, experts_hit=hit, pairs=pairs,
               bytes=nbytes, flops=flops, floor_us=max(nbytes / copy_bw, flops / peak) * 1e6,
               vllm_config=vllm_source, failures={})
    x, g, ids = sets[0]
    refs, timed = {}, {}
    try:
        refs["torch"] = reference(x, g, ids).float()
    except Exception as exc:  # noqa: BLE001
        row["failures"]["torch_backend"] = describe(exc)
    for name in IMPLS:
        fn = impls[name]
        row[f"{name}_us"] = row[f"{name}_rel_err"] = None
        if name in unavailable or fn is None:
            continue
        against = "torch" if name == "ours_auto" else ("ours_auto" if "ours_auto" in refs else "torch")
        try:
            out = fn(x, g, ids)
            if against in refs:
                err = rel_err(out, refs[against])
                row[f"{name}_rel_err"] = err
                tol = TOLERANCES.get(name, TOLERANCE)
                if not err <= tol:
                    row["failures"][name] = f"FAILED check: rel err {err:.2e} vs {against} > {tol:g}; not timed"
                    continue
            if name == "ours_auto":
                refs["ours_auto"] = out.float()
            timed[name] = lambda i, fn=fn: fn(*sets[i % len(sets)])
        except Exception as exc:  # noqa: BLE001  (one failing column must not end the run)
            row["failures"][name] = describe(exc)
        torch.cuda.synchronize()
    harness.record_rounds(row, *harness.time_interleaved_us(timed, len(sets), ROUNDS), describe)
    cells = "  ".join(f"{n} {_ratio(row, n)}" for n in IMPLS)
    print(f"{shape_name:<22} M={m:<5} floor {row['floor_us']:8.1f} us  {cells}")
    for name, failure in row["failures"].items():
        print(f"    {name}: {failure}")
    return row


def time_gemm1(torch, harness, w1, s1, topk, K, N, E, m) -> dict:
    """Our first GEMM alone (expert_gemm1, no activation: [M, topk, 2N] out) at M tokens, TFLOP/s."""
    gen = torch.Generator(device=DEVICE).manual_seed(cell_seed("gemm1", m))
    sets = []
    for _ in range(4):
        x = torch.randn(m, K, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        sets.append((x, torch.rand(m, E, device=DEVICE, generator=gen).topk(topk, dim=1).indices.to(torch.int32)))
    us = harness.time_graph_us(lambda i: torch.ops.moe_ext.expert_gemm1(
        sets[i % 4][0], w1, sets[i % 4][1], quant="fp8_block", w1_scale=s1))
    tflops = 2 * m * topk * K * 2 * N / (us * 1e-6) / 1e12
    print(f"gemm1 alone (expert_gemm1, fp8 block, Triton) M = {m}: {us:.1f} us, {tflops:.0f} TFLOP/s "
          f"(target >= {TARGET_GEMM1_TFLOPS:.0f})")
    return dict(M=m, us=us, TFLOPs=tflops, target_TFLOPs=TARGET_GEMM1_TFLOPS)


def _ratio(row, name) -> str:
    us = row[f"{name}_us"]
    return f"{us:9.1f} ({us / row['floor_us']:4.2f})" if us is not None else f"{'-':>9} {'':6}"


def summarize(rows, gemm1) -> dict:
    """The targets: ours_auto <= every timed peer (the DeepGEMM route, vLLM) per cell; ours_auto / floor at M <= 64;
    the gemm1 rate. ``ours_triton`` is ours, not a peer (where auto runs the Triton kernels the two differ by noise)."""
    peers = ("deep_gemm", "vllm")
    beaten = [all(r["ours_auto_us"] <= r[f"{p}_us"] for p in peers if r[f"{p}_us"] is not None)
              for r in rows if r["ours_auto_us"] is not None]
    small = [r["ours_auto_us"] / r["floor_us"] for r in rows if r["M"] <= SMALL_M and r["ours_auto_us"] is not None]
    ratios = [r["ours_auto_us"] / r["floor_us"] for r in rows if r["ours_auto_us"] is not None]
    return dict(
        cells=len(rows), ours_auto_timed=len(ratios), ours_auto_le_every_peer=sum(beaten),
        max_small_m_ours_auto_over_floor=max(small) if small else None,
        geomean_ours_auto_over_floor=math.exp(statistics.mean(math.log(v) for v in ratios)) if ratios else None,
        gemm1_TFLOPs=gemm1["TFLOPs"] if gemm1 else None,
        targets=dict(ours_auto_le_every_peer="every cell", small_m_ours_auto_over_floor=TARGET_SMALL_M,
                     gemm1_TFLOPs=TARGET_GEMM1_TFLOPS),
    )


def print_table(rows, s) -> None:
    print()
    print(f"µs per call (ratio to floor); fp8 block weights, bf16 activations, {ACTIVATION}; routing included")
    print(f"{'shape':<22} {'M':>5} {'floor':>9} " + " ".join(f"{n:>16}" for n in IMPLS))
    for r in rows:
        print(f"{r['shape']:<22} {r['M']:>5} {r['floor_us']:9.1f} " + " ".join(f"{_ratio(r, n):>16}" for n in IMPLS))
    print(f"\nours_auto <= every timed peer: {s['ours_auto_le_every_peer']} of {s['ours_auto_timed']} cells")
    small = s["max_small_m_ours_auto_over_floor"]
    print(f"max ours_auto / floor at M <= {SMALL_M}: {'n/a' if small is None else f'{small:.3f}'} "
          f"(target <= {TARGET_SMALL_M})")


if __name__ == "__main__":
    sys.exit(main())
