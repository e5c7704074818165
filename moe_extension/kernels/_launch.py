"""Launch utilities of the Triton kernels: device facts (TMA, programmatic dependent launch, SM count), the
current-device guard, a side stream for work that can run beside the current stream's, the PDL launch
options and device-side wait, and the host arithmetic of grids and block sizes (``cdiv``, ``next_power_of_2``).

Programmatic dependent launch (PDL, sm_90+): a kernel launched with ``launch_pdl`` may start while its
predecessor in the stream drains; ``grid_dependency(PDL)`` at its start waits for the predecessor's
completion (its writes visible) and then lets the next kernel launch.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


# NOTE: triton.cdiv and triton.next_power_of_2 are ConstexprFunction objects (callable from kernels too): 4.5 and
# 3.0 us a host call on the 2-core CPU dev machine (triton 3.9), against 0.1 for these. An eager fused_experts
# call sizes its grids with about 17 of them. Same results for every int (next_power_of_2(0) is 0, as Triton's).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for grids and splits on the host."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for n <= 0), for block sizes on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def device_guard(device: torch.device):
    """Triton launches on the current device's current stream: make the tensors' device current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def tma_capable(device: torch.device) -> bool:
    """Whether the device has TMA (sm_90+); memoized, it is asked on every sorted-path call."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# Programmatic dependent launch needs sm_90+ as TMA does; a name of its own, so that the tests that force
# TMA on in the interpreter (patching ``fused_experts.tma_capable``) leave PDL off there.
pdl_capable = tma_capable


def tma_layout_ok(t: torch.Tensor, block_k: int) -> bool:
    """Whether TMA can load [.., block_k] tiles of t: not empty, 16-bit elements (or 1-byte fp8), last dim
    contiguous, base and outer strides 16-byte aligned, the reduction box within 256."""
    esize = t.element_size()
    return (t.numel() > 0 and (esize == 2 or t.dtype == torch.float8_e4m3fn) and t.stride(-1) == 1
            and t.data_ptr() % 16 == 0 and all(s * esize % 16 == 0 for s in t.stride()[:-1]) and block_k <= 256)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Programs of a persistent launch: the SMs of a GPU; 4 in the interpreter (several tiles each)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _side_stream_of(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Launches in the block go to a second stream (one per device and current stream) that starts after the
    current stream's work so far, and yields it (None off the GPU: the block runs on the current stream).
    ``join(device, side)`` makes the current stream wait for them before it uses their results. Memory allocated
    in the block belongs to the side stream: once freed it may serve the next block, whose start waits for all the
    work enqueued on the current stream before it, so the current stream's uses enqueued in between are safe.
    CUDA-graph capture (and torch.compile's "reduce-overhead") records the fork and the join."""
    if device.type != "cuda":
        yield None
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream_of(device, main.stream_id)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield side


def join(device: torch.device, side: torch.cuda.Stream | None) -> None:
    """The current stream waits for the work of a ``side_stream`` block."""
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """Programmatic dependent launch: wait until the previous kernel in the stream completed and its writes
    are visible, then let the next kernel's programs launch. A no-op when PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_options(pdl: bool, **options) -> dict:
    """Launch options of a kernel with a ``PDL`` constexpr: ``launch_pdl`` only when on (the interpreter and
    pre-sm_90 launches never see it)."""
    return dict(options, PDL=True, launch_pdl=True) if pdl else dict(options, PDL=False)
