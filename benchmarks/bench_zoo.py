"""Benchmark ``moe_ext::fused_experts`` (bf16) over a zoo of public MoE expert shapes against vLLM's Triton
``fused_moe_kernel``, ``triton_kernels``, ``torch._grouped_mm`` and the floor, in one run.

For each shape of ``model_zoo.ZOO`` (14 models: E 8 to 512, topk 1 to 10, N 256 to 14336, tensor-parallel and
expert-parallel shards; sources listed there) and M tokens in {1, 8, 64, 512, 2048, 8192}, on random routing
(every token picks topk distinct experts of E_global uniformly, ``torch.rand(M, E_global).topk``), it times by
CUDA-graph replay: each column captured once (~25 ms of calls per graph), then 5 interleaved rounds that replay
every column's graph once (``harness.time_interleaved_us``); a column's time is the median of its rounds' times
per call, and the row keeps the rounds (``rounds_us``):

- ``ours``: ``torch.ops.moe_ext.fused_experts`` as users call it (default backend; the tuned table entry where
  this device's table has the shape, else the heuristic);
- ``ours_heuristic``: ``fused_experts_triton`` with the heuristic's config forced (what a shape without a table
  entry gets); timed only where it differs from the config ``ours`` runs (else the same number);
- ``vllm``: vLLM's Triton ``fused_moe_kernel`` through ``vllm_peer.VllmFusedMoE`` (``get_peers.sh vllm``):
  vLLM's shipped config for the GPU and the (E, N) where one exists (``vllm_config`` in the row), else vLLM's
  default config; its routing alignment, both GEMMs, the activation and the slot sum;
- ``vllm_gemms``: the same two ``fused_moe_kernel`` launches alone, on inputs aligned outside the timing (a bound
  in vLLM's favour);
- ``triton_kernels``: OpenAI's ``matmul_ogs`` through ``moe_extension.backends.triton_kernels``;
- ``grouped_mm``: ``bench_fused_experts.grouped_mm_pipeline`` (``torch._grouped_mm``), the baseline; not for the
  expert-parallel shard (it takes valid ids only).

The activation is ``--activation`` for every column: swigluoai by default, the one that ``matmul_ogs`` fuses, so
that every column computes the same function; ``--activation silu`` (the zoo models' own) drops triton_kernels.
Every implementation starts from ``hidden_states [M, K]`` bf16, ``topk_weights [M, topk]`` fp32 and
``topk_ids [M, topk]`` int32 (global ids; with an expert_map for the expert-parallel shard).

Floor of a cell: ``max(bytes / copy_BW, flops / gemm_peak)`` (ceilings measured at the start of the run), bytes =
weights of the local experts the routing hits + x + out, flops = ``2 * valid pairs * 3 N K``. Before timing,
every column is checked against the op's PyTorch backend (rel err <= 1e-2; ``vllm_gemms`` runs ``vllm``'s
checked launches on prepared inputs).

Summary: at M >= 8, the cells where ours <= every peer (vllm, vllm_gemms, triton_kernels, grouped_mm), and where a
peer's median is lower, the two compared round by round (``peer_rounds``: ours / peer per round, rounds ours won);
geomean and max of ours / floor; ours_heuristic / ours per cell (the untuned default against the tuned entry).
Targets: ours <= every peer at M >= 8, geomean <= 1.15, max <= 1.6, heuristic within 7% of the tuned entry.
Writes ``zoo_<gpu>.json`` under ``--out`` (``plot_fused_experts.py`` charts it). CUDA only (``--help`` works
anywhere).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import zlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from model_zoo import ZOO  # noqa: E402

TOKENS = (1, 8, 64, 512, 2048, 8192)
TOLERANCE = 1e-2
IMPLS = ("ours", "ours_heuristic", "vllm", "vllm_gemms", "triton_kernels", "grouped_mm")
PEERS = ("vllm", "vllm_gemms", "triton_kernels", "grouped_mm")
TARGET_GEOMEAN, TARGET_MAX, TARGET_HEURISTIC = 1.15, 1.6, 1.07
ROUTINGS = 4  # input sets rotated per cell (different routings touch different experts)
ROUNDS = 5  # interleaved rounds per cell (harness.time_interleaved_us)
DEVICE = "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO), metavar="MODEL",
                   help=f"zoo entries (default: all {len(ZOO)})")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--activation", default="swigluoai", choices=("swigluoai", "silu"))
    p.add_argument("--vllm-deps", default=str(BENCH_DIR.parent / ".deps" / "vllm"),
                   help="where get_peers.sh vllm put the kernel and configs")
    p.add_argument("--out", default=str(BENCH_DIR / "results"), help="directory of zoo_<gpu>.json")
    return p.parse_args(argv)


def make_sets(torch, m: int, shape: dict, gen) -> list:
    """Input sets: hidden states, router weights (softmax over the chosen), topk distinct ids of E_global."""
    e_global, topk, k = shape.get("E_global", shape["E"]), shape["topk"], shape["K"]
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        ids = torch.rand(m, e_global, device=DEVICE, generator=gen).topk(topk, dim=1).indices.to(torch.int32)
        weights = torch.randn(m, topk, device=DEVICE, generator=gen).softmax(dim=-1)
        sets.append((x, weights, ids))
    return sets


def cell_row(torch, model: str, shape: dict, m: int, sets: list, copy_bw: float, gemm_peak: float) -> dict:
    e, topk, k, n = shape["E"], shape["topk"], shape["K"], shape["N"]
    local = [s[2][s[2] < e] for s in sets]  # the contiguous map makes global ids < E the local ones
    hit = statistics.mean(int(torch.unique(ids.cpu()).numel()) for ids in local)
    pairs = statistics.mean(int(ids.numel()) for ids in local)
    nbytes = hit * 3 * n * k * 2 + 2 * m * k * 2
    flops = 2 * pairs * 3 * n * k
    return dict(model=model, M=m, E=shape.get("E_global", e), local_experts=e, topk=topk, K=k, N=n,
                floor_us=max(nbytes / copy_bw, flops / gemm_peak) * 1e6, experts_hit=hit, valid_pairs=pairs,
                bytes=nbytes, flops=flops, input_sets=len(sets), failures={})


def run_model(torch, harness, model: str, args, peers: dict, copy_bw: float, gemm_peak: float) -> list[dict]:
    """Every M of one zoo shape; returns its rows."""
    from bench_fused_experts import _describe, make_weights, rel_err

    from moe_extension.kernels import fused_experts_triton
    from moe_extension.parallel import contiguous_expert_map
    from moe_extension.kernels.fused_experts import local_pairs, local_tokens
    from moe_extension.kernels._configs import _device_facts, get_config, heuristic_config, sanitize

    shape = ZOO[model]
    e, topk, k, n = shape["E"], shape["topk"], shape["K"], shape["N"]
    # an expert-parallel shard: rank 0 of E_global / E, which holds the first E global experts
    emap = (contiguous_expert_map(shape["E_global"], shape["E_global"] // e, 0).to(DEVICE)
            if "E_global" in shape else None)
    w1, w2 = make_weights(torch, e, k, n, "linear")
    act = args.activation
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(model.encode()))  # the same inputs every run
    vllm = None
    if "vllm" in peers:
        vllm = peers["vllm"].VllmFusedMoE(peers["vllm_kernel"], w1, w2, topk=topk, max_tokens=max(args.tokens),
                                          activation=act, expert_map=emap,
                                          configs_dir=Path(args.vllm_deps) / "configs")
    sms = _device_facts(w1.device)[1]
    rows = []
    for m in args.tokens:
        sets = make_sets(torch, m, shape, gen)
        row = cell_row(torch, model, shape, m, sets, copy_bw, gemm_peak)
        m_cfg = local_tokens(m, e, emap, topk=topk)  # what the op chooses its config for (a shard: fewer)
        pairs = local_pairs(m, topk, e, emap)  # None but on a shard
        table_cfg = get_config(m_cfg, e, n, k, topk, torch.bfloat16, True, True, w1.device, local_pairs=pairs)
        heur_cfg = sanitize(heuristic_config(m_cfg, e, n, k, topk, torch.bfloat16, True, True, sms, local_pairs=pairs),
                            torch.bfloat16, n, k, topk)
        row["config"] = table_cfg.to_json()
        row["heuristic_is_table"] = heur_cfg == table_cfg
        prepared = [vllm.prepare(*s) for s in sets] if vllm is not None else None
        if vllm is not None:
            row["vllm_config"] = dict(vllm.config_for_tokens(m), source=vllm.config_source)

        def entry(i):
            return sets[i % ROUTINGS]

        impls = {
            "ours": lambda i: torch.ops.moe_ext.fused_experts(entry(i)[0], w1, w2, entry(i)[1], entry(i)[2], act,
                                                              expert_map=emap),
            "ours_heuristic": lambda i: fused_experts_triton(entry(i)[0], w1, w2, entry(i)[1], entry(i)[2], act,
                                                             expert_map=emap, config=heur_cfg),
            "vllm": lambda i: vllm.full(*entry(i)),
            "vllm_gemms": lambda i: vllm.gemms_only(prepared[i % ROUTINGS]),
            "triton_kernels": lambda i: peers["tk"].fused_experts(entry(i)[0], w1, w2, entry(i)[1], entry(i)[2], act,
                                                                   expert_map=emap),
            "grouped_mm": lambda i: peers["grouped_mm"](entry(i)[0], w1, w2, entry(i)[1], entry(i)[2]),
        }
        x, g, ids = sets[0]
        reference = torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, act, expert_map=emap, backend="torch")
        timed = {}
        for name, fn in impls.items():
            row[f"{name}_us"] = row[f"{name}_rel_err"] = None
            reason = peers["unavailable"].get(name)
            if name == "grouped_mm" and emap is not None:
                reason = "takes valid ids only (no expert_map)"
            if reason is not None or (name == "ours_heuristic" and row["heuristic_is_table"]):
                continue
            try:
                # vllm_gemms runs vllm's launches and configs (checked as vllm) on prepared inputs: not checked again
                if name != "vllm_gemms":
                    err = rel_err(fn(0), reference)
                    row[f"{name}_rel_err"] = err
                    if not err <= TOLERANCE:
                        row["failures"][name] = f"FAILED check: rel err {err:.2e} > {TOLERANCE:g}; not timed"
                        continue
                timed[name] = fn
            except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
                row["failures"][name] = _describe(exc)
            torch.cuda.synchronize()
        harness.record_rounds(row, *harness.time_interleaved_us(timed, ROUTINGS, ROUNDS), _describe)
        if row["heuristic_is_table"]:
            row["ours_heuristic_us"] = row["ours_us"]  # the same config: the same number
        print_row(row)
        rows.append(row)
    return rows


def _ratio(row, name) -> str:
    us = row.get(f"{name}_us")
    return f"{us:9.1f} ({us / row['floor_us']:4.2f})" if us is not None else f"{'-':>9} {'':6}"


def print_row(row) -> None:
    print(f"{row['model']:<24} M={row['M']:<5} floor {row['floor_us']:8.1f}  "
          + "  ".join(f"{name} {_ratio(row, name)}" for name in IMPLS), flush=True)
    for name, failure in row["failures"].items():
        print(f"    {name}: {failure}", flush=True)


def summarize(rows) -> dict:
    """The issue's targets over the cells; for each cell where a peer's median is below ours, ``peer_rounds``
    compares the two round by round (``harness.round_ratios``: ours / peer), which tells a loss from the
    clock's spread."""
    from harness import round_ratios

    timed = [r for r in rows if r["ours_us"] is not None]
    ratios = [r["ours_us"] / r["floor_us"] for r in timed]
    beaten, peer_rounds = {}, {}
    for r in timed:
        if r["M"] < 8:
            continue
        slower = [p for p in PEERS if r.get(f"{p}_us") is not None and r[f"{p}_us"] < r["ours_us"]]
        beaten[f"{r['model']} M={r['M']}"] = slower
        compared = {p: round_ratios(r, "ours", p) for p in slower}
        if any(v is not None for v in compared.values()):
            peer_rounds[f"{r['model']} M={r['M']}"] = {p: v for p, v in compared.items() if v is not None}
    heur = [r["ours_heuristic_us"] / r["ours_us"] for r in timed if r.get("ours_heuristic_us") is not None]
    geo = math.exp(statistics.mean(math.log(v) for v in ratios)) if ratios else None
    return dict(
        cells=len(rows), ours_timed=len(timed),
        cells_m_ge_8=len(beaten), ours_le_every_peer_m_ge_8=sum(not v for v in beaten.values()),
        peers_faster=({cell: v for cell, v in beaten.items() if v}), peer_rounds=peer_rounds,
        geomean_ours_over_floor=geo, max_ours_over_floor=max(ratios) if ratios else None,
        max_heuristic_over_ours=max(heur) if heur else None,
        heuristic_within_target=sum(v <= TARGET_HEURISTIC for v in heur), heuristic_compared=len(heur),
        geomean_over_floor={p: _geomean(rows, p) for p in IMPLS},
        targets=dict(ours_le_every_peer_m_ge_8="every cell", geomean_ours_over_floor=TARGET_GEOMEAN,
                     max_ours_over_floor=TARGET_MAX, heuristic_over_ours=TARGET_HEURISTIC),
    )


def _geomean(rows, name):
    v = [r[f"{name}_us"] / r["floor_us"] for r in rows if r.get(f"{name}_us") is not None]
    return math.exp(statistics.mean(math.log(x) for x in v)) if v else None


def print_summary(s) -> None:
    print()
    print(f"ours <= every peer at M >= 8: {s['ours_le_every_peer_m_ge_8']} of {s['cells_m_ge_8']} cells")
    for cell, slower in s["peers_faster"].items():
        rounds = s.get("peer_rounds", {}).get(cell, {})
        print(f"    {cell}: faster " + ", ".join(
            p + (f" (ours / it per round {rounds[p]['min']:.3f}-{rounds[p]['max']:.3f}, ours faster in "
                 f"{rounds[p]['faster']} of {rounds[p]['rounds']})" if p in rounds else "") for p in slower))
    geo, mx = s["geomean_ours_over_floor"], s["max_ours_over_floor"]
    print(f"geomean(ours / floor) {geo:.3f} (target <= {TARGET_GEOMEAN}), max {mx:.3f} (target <= {TARGET_MAX})")
    print("geomean / floor by column: " + ", ".join(f"{k} {v:.3f}" for k, v in s["geomean_over_floor"].items()
                                                    if v is not None))
    if s["heuristic_compared"]:
        print(f"heuristic / ours <= {TARGET_HEURISTIC}: {s['heuristic_within_target']} of {s['heuristic_compared']} "
              f"cells (max {s['max_heuristic_over_ours']:.3f})")


def load_peers(torch, args) -> dict:
    """What is available of the peers: modules and the reason for each missing column."""
    from bench_fused_experts import grouped_mm_pipeline

    from moe_extension.backends import triton_kernels as tk
    from moe_extension.ops import silu_and_mul, swigluoai_and_mul

    peers: dict = {"unavailable": {}, "tk": tk}
    if args.activation != "swigluoai":
        peers["unavailable"]["triton_kernels"] = "fuses swigluoai only"
    elif not tk.is_available():
        peers["unavailable"]["triton_kernels"] = tk.unavailable_reason()
    import vllm_peer

    kernel, reason = vllm_peer.load(args.vllm_deps)
    if kernel is None:
        peers["unavailable"]["vllm"] = peers["unavailable"]["vllm_gemms"] = reason
    else:
        peers["vllm"], peers["vllm_kernel"] = vllm_peer, kernel
    peers["grouped_mm"] = grouped_mm_pipeline(torch, swigluoai_and_mul if args.activation == "swigluoai"
                                              else silu_and_mul)
    if not hasattr(torch, "_grouped_mm"):
        peers["unavailable"]["grouped_mm"] = f"torch {torch.__version__} has no torch._grouped_mm"
    return peers


def write_result(harness, info, args, peers, copy_bw, gemm_peak, rows) -> Path:
    payload = dict(info, kind="zoo", copy_GBps=copy_bw / 1e9, gemm_TFLOPs=gemm_peak / 1e12,
                   activation=args.activation, dtype="bfloat16", models={m: ZOO[m] for m in args.models},
                   columns={"ours": "torch.ops.moe_ext.fused_experts (table entry, else heuristic)",
                            "ours_heuristic": "fused_experts_triton with the heuristic config forced",
                            "vllm": "vLLM 0.33.0 fused_moe_kernel via benchmarks/vllm_peer.py, routing included",
                            "vllm_gemms": "its two fused_moe_kernel launches alone",
                            "triton_kernels": "matmul_ogs via moe_extension.backends.triton_kernels",
                            "grouped_mm": "torch._grouped_mm pipeline (bench_fused_experts.grouped_mm_pipeline)"},
                   routing="random: each token picks topk distinct experts of E_global uniformly; router weights "
                           "softmax of randn over the chosen; rotated among input sets",
                   timing=harness.interleaved_timing(ROUNDS),
                   floor="max(bytes / copy_BW, flops / gemm_peak); bytes = local experts hit + x + out; flops = "
                         "2 valid pairs 3 N K",
                   unavailable=peers["unavailable"], summary=summarize(rows), rows=rows)
    return harness.write_json(f"zoo_{harness.gpu_slug()}.json", payload, args.out)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_zoo: needs a CUDA device", file=sys.stderr)
        return 2
    import harness

    import moe_extension  # noqa: F401  (registers torch.ops.moe_ext)

    info = harness.device_info()
    copy_bw = harness.copy_bandwidth()
    gemm_peak = harness.gemm_peak(torch.bfloat16)
    peers = load_peers(torch, args)
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}")
    print(f"ceilings: copy {copy_bw / 1e9:.0f} GB/s (read + write), bf16 GEMM {gemm_peak / 1e12:.0f} TFLOP/s; "
          f"activation {args.activation}")
    for name, reason in peers["unavailable"].items():
        print(f"{name}: column null: {reason}")
    rows = []
    for model in args.models:
        rows.extend(run_model(torch, harness, model, args, peers, copy_bw, gemm_peak))
        torch.cuda.empty_cache()  # the model's weights and vLLM's buffers went with run_model
        # written after every model, so that a run stopped by a time limit keeps what it measured
        path = write_result(harness, info, args, peers, copy_bw, gemm_peak, rows)
    print_summary(summarize(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
