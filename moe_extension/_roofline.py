"""The device floor of a MoE layer call, from two ceilings measured on the spot (used by the main job).

- ``copy_bandwidth(device)``: bytes/s of copying one large buffer, counting bytes read + written
  (CPU: a 128 MiB fp32 copy, larger than the caches; CUDA: a 1 GiB bf16 device-to-device copy).
- ``matmul_rate(device)``: FLOP/s of a dense square matmul (CPU: fp32 1024^3; CUDA: bf16 8192^3).
- ``moe_traffic(...)``: bytes that must move (weights of the experts hit + activations) and FLOPs of
  the two expert GEMMs, ``2 * M * topk * (2N * K + K * N)``.
- ``floor_seconds(nbytes, flops, bandwidth, rate) = max(nbytes / bandwidth, flops / rate)``. The one
  matmul rate serves every weight format (fp8 GEMMs could run up to twice the bf16 rate on a GPU).
- ``median_seconds(fn, device, repeat)``: median wall time of one call (CUDA: events, synchronized).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device | str, repeat: int, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` calls, after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(max(repeat, 1)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str, repeat: int = 5) -> float:
    """Bytes/s (read + write) of one large buffer copy on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    else:
        src = torch.rand(1 << 25, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeat, warmup=2)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_rate(device: torch.device | str, repeat: int = 5) -> float:
    """FLOP/s of a dense square matmul: fp32 1024^3 on CPU, bf16 8192^3 on CUDA."""
    device = torch.device(device)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_seconds(lambda: a @ b, device, repeat, warmup=2)
    return 2 * n**3 / seconds


def moe_traffic(
    *,
    tokens: int,
    topk: int,
    hidden: int,
    intermediate: int,
    experts_hit: int,
    num_experts: int,
    weight_bytes: int,
    activation_bytes: int,
) -> tuple[int, int]:
    """``(bytes, flops)`` of one layer call.

    ``weight_bytes`` is the size of all experts' weights (data, scales, biases), so an expert costs
    ``weight_bytes / num_experts``; ``activation_bytes`` is what the call reads and writes besides the
    weights (hidden states in, output out, router logits).
    """
    nbytes = experts_hit * weight_bytes // num_experts + activation_bytes
    flops = 2 * tokens * topk * (2 * intermediate * hidden + hidden * intermediate)
    return nbytes, flops


def floor_seconds(nbytes: int, flops: int, bandwidth: float, rate: float) -> float:
    """The roofline floor: the slower of moving the bytes and doing the FLOPs."""
    return max(nbytes / bandwidth, flops / rate)
