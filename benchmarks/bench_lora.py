"""LoRA on the unfused expert path: ``UnfusedOAITritonExperts`` (bf16 weights with biases, swigluoai) with and
without adapters attached, CUDA-graph medians in one run.

    python benchmarks/bench_lora.py [--models gpt-oss-20b gpt-oss-120b] [--tokens 1 16 64 256 1024 4096]
                                    [--ranks 16 64] [--adapters 4] [--schedule direct|grouped] [--out DIR]

Per (model, M, rank, share of tokens with an adapter: all / half): ``base_us`` (apply without LoRA), ``lora_us``
(apply with ``token_lora_mapping``), their ratio against the issue's target (<= 1.15 at rank 16, <= 1.3 at rank
64), the two ``add_lora`` calls alone (``add_w13_us``: h [M, topk, 2N] += B13 (A13 x); ``add_w2_us``: y += g B2
(A2 a); ``--schedule`` forces the kernels' schedule there) and ``lora_floor_us``: the bytes the two LoRA terms
must move (x and a read, h and y read and written, the adapters of the (adapter, expert) groups hit read once)
over the copy bandwidth measured in the same run.
Correctness (M 1 and 64 per model and rank): the output with LoRA against the same class whose GEMM steps add
their LoRA terms with the PyTorch implementation (``add_lora_torch``), relative error <= 1e-2. Writes ``lora_<gpu>.json``;
``benchmarks/plot_lora.py`` charts it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {  # name: (E, topk, K hidden, N intermediate)
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
TARGETS = {16: 1.15, 64: 1.3}
CHECK_TOKENS = (1, 64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--schedule", choices=["direct", "grouped"], default=None,
                   help="force the LoRA kernels' schedule in the add_w13 / add_w2 timings (default: the rule)")
    p.add_argument("--out", default=None, help="directory of the JSON (default benchmarks/results)")
    return p.parse_args(argv)


def make_lora(torch, L, E, N, K, r, device):
    from moe_extension.experts import LoRAWeights

    def t(*shape, fan_in):
        return (torch.randn(*shape, device=device) / math.sqrt(fan_in)).to(torch.bfloat16)

    return LoRAWeights(t(L, E, r, K, fan_in=K), t(L, E, 2 * N, r, fan_in=r), t(L, E, r, N, fan_in=N),
                       t(L, E, K, r, fan_in=r))


def lora_floor_bytes(M, topk, E, K, N, r, L, mapping, ids) -> int:
    """Bytes the two LoRA terms must move: x [M, K] and a [P, N] read, h [P, 2N] and y [P, K] read and written
    (active pairs only), and each hit (adapter, expert) group's four matrices read once; 2-byte elements."""
    active = (mapping >= 0).unsqueeze(1).expand_as(ids)
    pairs = int(active.sum())
    groups = int((mapping.long().unsqueeze(1) * E + ids.long())[active].unique().numel())
    activations = (mapping >= 0).sum().item() * K + pairs * (N + 2 * 2 * N + 2 * K)
    adapters = groups * r * (K + 2 * N + N + K)
    return 2 * (activations + adapters)


class TorchLoRA:
    """Mixin: the GEMM steps without their LoRA terms, then ``add_lora_torch`` on their outputs (the PyTorch
    implementation: the benchmark's correctness reference)."""

    def gemm1(self, hidden_states, topk_ids, expert_map, input_weights, token_lora_mapping=None):
        from moe_extension.ops.lora import add_lora_torch

        h = super().gemm1(hidden_states, topk_ids, expert_map, input_weights)
        if token_lora_mapping is not None:
            add_lora_torch(h, hidden_states, self.lora.a13, self.lora.b13, topk_ids, token_lora_mapping,
                           expert_map=expert_map, topk_weights=input_weights)
        return h

    def gemm2(self, a, topk_ids, expert_map, output_weights, token_lora_mapping=None):
        from moe_extension.ops.lora import add_lora_torch

        y = super().gemm2(a, topk_ids, expert_map, output_weights)
        if token_lora_mapping is not None:
            add_lora_torch(y, a, self.lora.a2, self.lora.b2, topk_ids, token_lora_mapping, expert_map=expert_map,
                           topk_weights=output_weights)
        return y


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import harness
    from moe_extension.experts import UnfusedOAITritonExperts
    from moe_extension.kernels.lora import add_lora_triton

    class ReferenceExperts(TorchLoRA, UnfusedOAITritonExperts):
        pass

    dev = "cuda"
    torch.manual_seed(0)
    info = harness.device_info()
    copy_bw = harness.copy_bandwidth()
    rows, failures = [], []
    L = args.adapters
    for model in args.models:
        E, topk, K, N = MODELS[model]
        # held as the classes hold them: [E, in, out] views of [E, out, in] storage
        w1 = (torch.randn(E, 2 * N, K, device=dev) / math.sqrt(K)).to(torch.bfloat16).transpose(1, 2)
        w2 = (torch.randn(E, K, N, device=dev) / math.sqrt(N)).to(torch.bfloat16).transpose(1, 2)
        bias = dict(w1_bias=torch.randn(E, 2 * N, device=dev) * 0.1, w2_bias=torch.randn(E, K, device=dev) * 0.1)
        experts = UnfusedOAITritonExperts(w1, w2, activation="swigluoai", **bias)
        reference = ReferenceExperts(w1, w2, activation="swigluoai", **bias)
        for M in args.tokens:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            ids = torch.rand(M, E, device=dev).topk(topk, dim=1).indices.int()
            weights = torch.softmax(torch.randn(M, topk, device=dev), dim=1)
            experts.set_lora(None)
            base_us = harness.time_graph_us(lambda i: experts.apply(x, weights, ids))
            for r in args.ranks:
                lora = make_lora(torch, L, E, N, K, r, dev)
                experts.set_lora(lora)
                for share in ("all", "half"):
                    mapping = torch.randint(0, L, (M,), device=dev, dtype=torch.int32)
                    if share == "half":
                        mapping[torch.randperm(M, device=dev)[: M // 2]] = -1
                    row = {"model": model, "E": E, "topk": topk, "K": K, "N": N, "M": M, "rank": r, "adapters": L,
                           "with_adapter": share, "base_us": base_us, "target": TARGETS.get(r)}
                    row["lora_us"] = harness.time_graph_us(
                        lambda i: experts.apply(x, weights, ids, token_lora_mapping=mapping))
                    h = experts.gemm1(x, ids, None, None)
                    a = torch.randn(M, topk, N, device=dev).to(torch.bfloat16)
                    y = torch.zeros(M, topk, K, device=dev, dtype=torch.bfloat16)
                    row["add_w13_us"] = harness.time_graph_us(
                        lambda i: add_lora_triton(h, x, lora.a13, lora.b13, ids, mapping, schedule=args.schedule))
                    row["add_w2_us"] = harness.time_graph_us(
                        lambda i: add_lora_triton(y, a, lora.a2, lora.b2, ids, mapping, topk_weights=weights,
                                                  schedule=args.schedule))
                    row["lora_floor_us"] = lora_floor_bytes(M, topk, E, K, N, r, L, mapping, ids) / copy_bw * 1e6
                    row["ratio"] = row["lora_us"] / base_us
                    if M in CHECK_TOKENS:
                        reference.set_lora(lora)
                        got = experts.apply(x, weights, ids, token_lora_mapping=mapping).double()
                        want = reference.apply(x, weights, ids, token_lora_mapping=mapping).double()
                        row["rel_err"] = ((got - want).norm() / want.norm()).item()
                        if not row["rel_err"] <= 1e-2:
                            failures.append(f"{model} M {M} rank {r} {share}: rel_err {row['rel_err']:.2e}")
                    rows.append(row)
                    print(f"{model:13s} M {M:5d} r {r:3d} {share:4s}  base {base_us:8.1f}  lora {row['lora_us']:8.1f}"
                          f"  ratio {row['ratio']:.3f} (target {row['target']})  w13 {row['add_w13_us']:6.1f}"
                          f"  w2 {row['add_w2_us']:6.1f}  floor {row['lora_floor_us']:6.1f} us", flush=True)
        experts = reference = w1 = w2 = None  # free this model's weights before the next one
        torch.cuda.empty_cache()
    met = [r for r in rows if r["target"] is not None]
    summary = {"cells": len(met), "within_target": sum(r["ratio"] <= r["target"] for r in met),
               "worst_ratio_by_rank": {str(k): max((r["ratio"] for r in met if r["rank"] == k), default=None)
                                       for k in args.ranks},
               "failures": failures}
    print("summary:", summary)
    path = harness.write_json(f"lora_{harness.gpu_slug()}.json",
                              {**info, "copy_bandwidth_Bps": copy_bw, "summary": summary, "rows": rows},
                              args.out or harness.RESULTS_DIR)
    print("wrote", path)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
