"""Public MoE expert shapes (the model zoo of ``bench_zoo.py`` and ``tune_fused_experts.py --models``).

Each entry is one MoE layer's routed experts as one GPU holds them: ``E`` experts, ``topk`` per token, hidden size
``K`` (gemm1's reduction, gemm2's output) and intermediate size ``N`` per expert (w1 ``[E, 2N, K]``, w2
``[E, K, N]``), read off the model's published configuration (``source``: the Hugging Face repository and the
config fields). A ``-tpT`` entry is a tensor-parallel shard over T GPUs (``N`` = the intermediate size / T,
every expert on every GPU); an ``-epW`` entry an expert-parallel shard (``E`` local experts of ``E_global``,
tokens routed over all ``E_global``, the others' slots invalid on this GPU, through an ``expert_map``).

Chosen to span what users bring: E from 8 to 512 (E_global 256 for the shard), topk 1 to 10 (2, 4, 6, 8, 10),
N from 256 to 14336 (multiples of 128 and not of 256: 1344, 1408, 6400), shards N / 2, N / 4 and N / 8 of large
models, one expert-parallel shard. Seven (E, N) pairs have a vLLM-shipped H100 config for its Triton
``fused_moe_kernel`` (the files ``E=..,N=..,device_name=NVIDIA_H100_80GB_HBM3.json`` of vLLM 0.33.0).
The three models of ``bench_fused_experts.py`` (gpt-oss-120b, qwen3-30b-a3b, mixtral-8x7b) are not repeated.
"""

from __future__ import annotations

ZOO = {
    "jamba-v0.1": dict(E=16, topk=2, K=4096, N=14336,
                       source="ai21labs/Jamba-v0.1: num_experts 16, num_experts_per_tok 2, hidden_size 4096, "
                              "intermediate_size 14336"),
    "llama-4-scout": dict(E=16, topk=1, K=5120, N=8192,
                          source="meta-llama/Llama-4-Scout-17B-16E: num_local_experts 16, num_experts_per_tok 1, "
                                 "hidden_size 5120, intermediate_size 8192 (routed experts only)"),
    "mixtral-8x7b-tp2": dict(E=8, topk=2, K=4096, N=7168,
                             source="mistralai/Mixtral-8x7B-v0.1: intermediate_size 14336 / 2"),
    "phi-3.5-moe": dict(E=16, topk=2, K=4096, N=6400,
                        source="microsoft/Phi-3.5-MoE-instruct: num_local_experts 16, num_experts_per_tok 2, "
                               "hidden_size 4096, intermediate_size 6400"),
    "mixtral-8x22b-tp4": dict(E=8, topk=2, K=6144, N=4096,
                              source="mistralai/Mixtral-8x22B-v0.1: hidden_size 6144, intermediate_size 16384 / 4"),
    "dbrx-tp8": dict(E=16, topk=4, K=6144, N=1344,
                     source="databricks/dbrx-base: moe_num_experts 16, moe_top_k 4, d_model 6144, "
                            "ffn_hidden_size 10752 / 8"),
    "qwen1.5-moe-a2.7b": dict(E=60, topk=4, K=2048, N=1408,
                              source="Qwen/Qwen1.5-MoE-A2.7B: num_experts 60, num_experts_per_tok 4, hidden_size "
                                     "2048, moe_intermediate_size 1408"),
    "deepseek-v2-lite": dict(E=64, topk=6, K=2048, N=1408,
                             source="deepseek-ai/DeepSeek-V2-Lite: n_routed_experts 64, num_experts_per_tok 6, "
                                    "hidden_size 2048, moe_intermediate_size 1408"),
    "qwen2-57b-a14b-tp2": dict(E=64, topk=8, K=3584, N=1280,
                               source="Qwen/Qwen2-57B-A14B: num_experts 64, num_experts_per_tok 8, hidden_size "
                                      "3584, moe_intermediate_size 2560 / 2"),
    "qwen3-235b-a22b-tp4": dict(E=128, topk=8, K=4096, N=384,
                                source="Qwen/Qwen3-235B-A22B: num_experts 128, num_experts_per_tok 8, hidden_size "
                                       "4096, moe_intermediate_size 1536 / 4"),
    "deepseek-v2": dict(E=160, topk=6, K=5120, N=1536,
                        source="deepseek-ai/DeepSeek-V2: n_routed_experts 160, num_experts_per_tok 6, hidden_size "
                               "5120, moe_intermediate_size 1536"),
    "deepseek-v3-tp4": dict(E=256, topk=8, K=7168, N=512,
                            source="deepseek-ai/DeepSeek-V3: n_routed_experts 256, num_experts_per_tok 8, "
                                   "hidden_size 7168, moe_intermediate_size 2048 / 4"),
    "deepseek-v3-ep8": dict(E=32, E_global=256, topk=8, K=7168, N=2048,
                            source="deepseek-ai/DeepSeek-V3: 256 routed experts over 8 GPUs (32 local), "
                                   "moe_intermediate_size 2048"),
    "qwen3-next-80b-a3b-tp2": dict(E=512, topk=10, K=2048, N=256,
                                   source="Qwen/Qwen3-Next-80B-A3B-Instruct: num_experts 512, num_experts_per_tok "
                                          "10, hidden_size 2048, moe_intermediate_size 512 / 2"),
}
