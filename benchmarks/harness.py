"""Shared benchmark harness: the two ceilings of the device and CUDA-graph replay timing.

- ``copy_bandwidth()``: device-to-device copy rate in bytes/s, counting bytes read + written.
- ``gemm_peak(dtype)``: dense matmul rate in FLOP/s for an 8192^3 product of random data.
- ``time_graph_us(fn)``: median time of one call of ``fn`` in microseconds, measured by replaying a
  CUDA graph that holds ``reps`` calls of it (launch gaps shrink to what a captured decode loop sees);
  ``time_graph_budget_us(fn, n_sets)``: the same with ``reps`` sized to a time budget per replay;
  ``time_interleaved_us(fns, n_sets)``: several implementations of one cell, each captured once as
  ``time_graph_budget_us`` sizes it, then timed in interleaved rounds (what comparisons between them use);
  ``record_rounds(row, ...)`` puts its answer into a results row, ``round_ratios(row, a, b)`` compares two of its
  columns round by round, ``interleaved_timing(rounds)`` says so in the results file.
- ``rotating(make, nbytes)``: enough independent input sets that consecutive calls miss L2.
- ``device_info()``: the device/torch/triton fields every results file carries at its top level.
- ``load_module(path)``: the Python module in a file (another version of one of ours, for a side-by-side A/B).
- ``random_mxfp4_stack(e, rows, cols, device)``: random MXFP4 expert weights, quantized a few experts at a time.

CUDA only: every benchmark here is meant for the GPU machine.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _events_time_ms(fn: Callable[[], object], iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy rate (bytes read + bytes written per second) of one large buffer."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(_events_time_ms(lambda: dst.copy_(src), iters))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def gemm_peak(dtype: torch.dtype = torch.bfloat16, n: int = 8192, iters: int = 20) -> float:
    """Dense ``n x n x n`` matmul rate in FLOP/s on random data (the compute ceiling)."""
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    for _ in range(3):
        a @ b
    ms = statistics.median(_events_time_ms(lambda: a @ b, iters))
    return 2 * n**3 / (ms * 1e-3)


def _capture(fn: Callable[[int], object], reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn(0) .. fn(reps - 1)``, after a warm-up on a side stream, replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up: compiles kernels and fills caches outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph_us(fn: Callable[[int], object], reps: int = 20, replays: int = 15) -> float:
    """Median microseconds per call of ``fn(i)``, timed by replaying a CUDA graph of ``reps`` calls.

    ``fn`` receives the call index so that it can rotate among input sets; it must be capture-safe.
    """
    graph = _capture(fn, reps)
    ms = statistics.median(_events_time_ms(graph.replay, replays))
    return ms * 1e3 / reps


def _budget_reps(fn: Callable[[int], object], n_sets: int, budget_us: float) -> int:
    """Calls per graph for ``time_graph_budget_us``: a multiple of ``n_sets``, 4 to 400, that fills about
    ``budget_us`` of GPU time, estimated from one eager pass over the input sets."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    (est_ms,) = _events_time_ms(lambda: [fn(i) for i in range(n_sets)], 1)
    return max(n_sets, min(400, int(budget_us / max(est_ms * 1e3 / n_sets, 1.0)) // n_sets * n_sets))


def time_graph_budget_us(fn: Callable[[int], object], n_sets: int, budget_us: float = 25000.0,
                         replays: int = 5) -> float:
    """``time_graph_us`` with as many calls per graph (a multiple of ``n_sets``, 4 to 400) as fill about
    ``budget_us`` of GPU time, estimated from one eager pass over the input sets: short cells get enough calls to
    be timed, long ones (prefill) do not take seconds per cell.

    NOTE: ~25 ms of work per replay, 5 replays: long enough to run at the power-capped clock that sustained
    prefill sees. With 2 ms bursts the H100 stayed near 1.98 GHz and the tuner's phases summed to 4517 us at
    mixtral M = 4096, where the same kernels took 4895-5110 us in the benchmark's timing (~1.4 GHz).
    """
    return time_graph_us(fn, reps=_budget_reps(fn, n_sets, budget_us), replays=replays)


def time_interleaved_us(fns: dict[str, Callable[[int], object]], n_sets: int, rounds: int = 5,
                        budget_us: float = 25000.0) -> tuple[dict[str, list[float]], dict[str, Exception]]:
    """Several implementations of one cell: each ``fn(i)`` captured once in a graph of as many calls as
    ``time_graph_budget_us`` gives it, then ``rounds`` rounds that replay every graph once, the order rotated by
    one per round. Returns (name -> its microseconds per call in each round, name -> the exception that stopped
    its warm-up or capture); compare the rounds' medians, or round by round.

    NOTE: under the power cap the SM clock follows the load: in the zoo's M 512-8192 run on an H200 one graph's
    rounds differ by up to 32% (deepseek-v2 M = 8192), median 4.1%, and where two columns' medians differ by 0-3% the
    round-by-round ratio spans both sides (ours / triton_kernels 0.92-1.02 at phi-3.5-moe M = 8192); timed one
    after the other, columns compared clocks as much as kernels (benchmarks/results/zoo_h200.json, ``rounds_us``;
    ``python benchmarks/bench_zoo.py --tokens 512 2048 8192``). At M 1-64 rounds agree within 0.4% (median).
    """
    graphs, errors = {}, {}
    for name, fn in fns.items():
        try:
            reps = _budget_reps(fn, n_sets, budget_us)
            graphs[name] = (_capture(fn, reps), reps)
        except Exception as exc:  # noqa: BLE001  (one failing implementation must not stop the others)
            errors[name] = exc
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    order = list(graphs)
    for r in range(rounds if order else 0):
        first = r % len(order)
        for name in order[first:] + order[:first]:
            graph, reps = graphs[name]
            (ms,) = _events_time_ms(graph.replay, 1)
            times[name].append(ms * 1e3 / reps)
    return times, errors


def interleaved_timing(rounds: int) -> str:
    """The ``timing`` line of a results file whose columns ``time_interleaved_us`` timed in ``rounds`` rounds."""
    return (f"CUDA-graph replay per call, ~25 ms of calls per graph; median of {rounds} interleaved rounds, each "
            "replaying every column's graph once (harness.time_interleaved_us; rows: rounds_us)")


def record_rounds(row: dict, rounds: dict[str, list[float]], errors: dict[str, Exception],
                  describe: Callable[[Exception], str]) -> None:
    """A results row from ``time_interleaved_us``'s answer: ``row[name + "_us"]`` the median of a column's rounds,
    ``row["rounds_us"]`` the rounds, ``row["failures"][name]`` what stopped a column (``describe(exc)``)."""
    row["rounds_us"] = rounds
    for name, v in rounds.items():
        row[f"{name}_us"] = statistics.median(v)
    for name, exc in errors.items():
        row["failures"][name] = describe(exc)


def round_ratios(row: dict, a: str, b: str) -> dict | None:
    """Columns ``a`` and ``b`` of a row compared round by round (their ``rounds_us`` from one
    ``time_interleaved_us``): the least, median and largest ratio a / b and in how many rounds a was faster; None
    where either column has no rounds."""
    rounds = row.get("rounds_us", {})
    if a not in rounds or b not in rounds:
        return None
    ratios = [x / y for x, y in zip(rounds[a], rounds[b])]
    return dict(min=min(ratios), median=statistics.median(ratios), max=max(ratios),
                faster=sum(x < y for x, y in zip(rounds[a], rounds[b])), rounds=len(ratios))


def rotating(make: Callable[[], object], nbytes_per_set: int, l2_bytes: int | None = None) -> list:
    """Input sets to rotate among so that each call reads from DRAM, not from L2 (at most 8 sets)."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    count = max(1, min(8, -(-2 * l2_bytes // max(nbytes_per_set, 1))))
    return [make() for _ in range(count)]


def device_info(command: str | None = None) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": command if command is not None else "python " + " ".join(sys.argv),
    }


def load_module(path: str | Path):
    """The Python module in the file ``path`` (another version of one of ours, for a side-by-side A/B: its Triton
    kernels compile from that file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json(name: str, payload: dict, out_dir: str | Path = RESULTS_DIR) -> Path:
    """Write ``payload`` as ``out_dir/name`` (benchmarks take ``--out``: on the GPU machine, ``$OUT``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def gpu_slug() -> str:
    """Short device name for result files, e.g. 'h100' for 'NVIDIA H100 80GB HBM3'."""
    name = torch.cuda.get_device_name(0).lower()
    for tag in ("h200", "h100", "b200", "a100", "l40s"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().split()[0]


def random_mxfp4_stack(e: int, rows: int, cols: int, device, chunk: int = 8, with_bf16: bool = False):
    """``(packed uint8 [e, rows, cols/2], scales uint8 [e, rows, cols/32], bf16 [e, rows, cols] or None)``: random
    normal / sqrt(cols) weights quantized by ``quantize_mxfp4`` on ``device``, ``chunk`` experts at a time (fp32
    temporaries of ~0.5 GB per 8 gpt-oss W1s), and with ``with_bf16`` the same weights dequantized to bf16
    (exact: an e2m1 value times a power of two fits bf16)."""
    import math

    from moe_extension.quant import dequantize_mxfp4, quantize_mxfp4

    packed = torch.empty((e, rows, cols // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((e, rows, cols // 32), dtype=torch.uint8, device=device)
    dense = torch.empty((e, rows, cols), dtype=torch.bfloat16, device=device) if with_bf16 else None
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        w = torch.randn((hi - lo, rows, cols), device=device).mul_(1.0 / math.sqrt(cols))
        packed[lo:hi], scales[lo:hi] = quantize_mxfp4(w)
        del w
        if dense is not None:
            dense[lo:hi] = dequantize_mxfp4(packed[lo:hi], scales[lo:hi]).to(torch.bfloat16)
    return packed, scales, dense


def random_fp8_block_stack(e: int, rows: int, cols: int, device, seed: int | None = None, chunk: int = 16):
    """``(q float8_e4m3fn [e, rows, cols], s fp32 [e, ceil(rows/128), ceil(cols/128)])``, an fp8 block weight
    stack for benchmarks: e4m3 values of about N(0, 16) (bf16 normals times 16, converted ``chunk`` experts at a
    time) and per 128 x 128 block a scale of 1 / (16 sqrt(cols)) times 2^U(-1, 1), so that the weights are about
    N(0, 1 / cols) and the blocks' scales differ; drawn from a generator seeded with ``seed`` (default
    ``rows * 7 + cols``)."""
    import math

    gen = torch.Generator(device=device).manual_seed(rows * 7 + cols if seed is None else seed)
    q = torch.empty((e, rows, cols), dtype=torch.float8_e4m3fn, device=device)
    for lo in range(0, e, chunk):
        q[lo:lo + chunk] = (torch.randn((min(chunk, e - lo), rows, cols), dtype=torch.bfloat16, device=device,
                                        generator=gen) * 16).to(torch.float8_e4m3fn)
    s = 2.0 ** (torch.rand((e, -(-rows // 128), -(-cols // 128)), device=device, generator=gen) * 2 - 1)
    return q, s / (16 * math.sqrt(cols))
