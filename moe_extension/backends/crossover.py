"""Measured crossovers between our Triton kernels and an optional accelerator, per device: the reader behind
``fused_experts(backend="auto")``'s choice of an accelerator.

The crossovers live in the tuned-config file of the device (``moe_extension/configs/<device>.json``, the file
``moe_extension/kernels/_configs.py`` reads its kernel configs from) under the top-level key ``"backend"``,
written by ``benchmarks/tune_backend_crossover.py``::

    "backend": {
      "fp8_block": {                                  # the weight format (``quant``)
        "deep_gemm": {                                # the accelerator
          "min_rows_per_expert": 64.0,                # default for shapes without an entry; null: never
          "shapes": {
            "E=256,N=2048,K=7168": {"min_rows_per_expert": 64.0, "measured": [...]},
            "E=64,N=1408,K=2048": {"min_rows_per_expert": null, "measured": [...]}
          },
          "measured_with": {"deep_gemm": "...", "torch": "...", "triton": "..."}
        }
      }
    }

The accelerator runs a call where ``rows_per_expert(M, topk, E) = M * topk / E`` (E: global experts, the
length of ``expert_map`` when one is given) is at least ``min_rows_per_expert``: the shape's own entry
(keyed by the weights' ``E``, ``N``, ``K``) when there is one, else the accelerator's default. Rows per expert
is what the two grouped GEMMs' efficiency follows (a weight tile is read once per expert either way; the
rows sharing it decide whether the GEMM is bound by weight bytes or by tensor cores), so one number carries
over between models and batch sizes. ``measured`` (the tuner's points: ``M``, ``topk``, ``rows_per_expert``,
``triton_us``, ``accelerator_us``, ``rel_err`` between the two outputs and ``agree``) is the record behind the
number; this module does not read it.

No file, no ``"backend"`` key, no entry for the format or accelerator, or a null threshold: the accelerator is
never chosen (``backend="auto"`` runs our kernels); nothing is guessed.
"""

from __future__ import annotations

import functools
import json

import torch

SECTION = "backend"


def shape_key(E: int, N: int, K: int) -> str:
    """The key of a shape's entry: ``"E=..,N=..,K=.."`` (local experts, intermediate size, hidden size)."""
    return f"E={E},N={N},K={K}"


def rows_per_expert(M: int, topk: int, num_experts: int) -> float:
    """``M * topk / num_experts``: the (token, slot) rows an expert gets on average under uniform routing."""
    return M * topk / max(num_experts, 1)


@functools.lru_cache(maxsize=None)
def load_section(name: str) -> dict:
    """The ``"backend"`` section of the tuned-config file of the device named ``name``, ``{}`` without one
    (cached per device)."""
    # NOTE: imported here: the kernels package imports Triton, which the op layer loads only on first use.
    from moe_extension.kernels._configs import table_path

    path = table_path(name)
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f).get(SECTION, {})


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The CUDA device's name, as the tuned-config file is named after it (cached per device)."""
    return torch.cuda.get_device_name(device)


def min_rows_per_expert(name: str, quant: str, accelerator: str, E: int, N: int, K: int) -> float | None:
    """The stored threshold of ``accelerator`` for weights ``quant`` of shape (E, N, K) on the device named
    ``name``: the shape's entry, else the default; None where there is none (never chosen)."""
    entry = load_section(name).get(quant, {}).get(accelerator)
    if not entry:
        return None
    source = entry.get("shapes", {}).get(shape_key(E, N, K), entry)
    value = source.get("min_rows_per_expert")
    return None if value is None else float(value)


def prefers(accelerator: str, quant: str, device: torch.device, M: int, E: int, N: int, K: int, topk: int,
            num_global_experts: int | None = None) -> bool:
    """Whether the stored crossover says ``accelerator`` is faster than our kernels for this call: a CUDA
    ``device``, ``M`` tokens, ``topk`` slots, weights of shape (E, N, K), ``num_global_experts`` (the
    ``expert_map`` length; E without one). Reads shapes and the cached table only: no host sync."""
    if device.type != "cuda":
        return False
    threshold = min_rows_per_expert(device_name(device), quant, accelerator, E, N, K)
    if threshold is None:
        return False
    return rows_per_expert(M, topk, num_global_experts or E) >= threshold
