"""Helpers shared by the tests: devices, error metric, output poisoning, reproducible random inputs."""

import torch

import moe_extension  # noqa: F401  (registers the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INTERPRETED = not torch.cuda.is_available()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere in ``out`` gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) so that any element a kernel fails to write shows up."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)


def assert_graph_replays_match_eager(call, static, make_inputs, replays: int = 12, finite: bool = False):
    """CUDA-graph check of ``call(inputs)``: compile its kernels on a side stream, run it once eagerly under
    ``set_sync_debug_mode("error")`` (no host sync inside), capture ``call(static)``, then ``replays`` times copy
    fresh inputs (``make_inputs()``, a sequence like ``static``) into ``static``, replay, and require the
    replay's output to equal an eager call on the fresh inputs bitwise (and, with ``finite``, to be finite)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels outside the capture
            call(static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(static)  # raises if anything in the op synchronizes with the host
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(static)
    for _ in range(replays):
        fresh = make_inputs()
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        graph.replay()
        expected = call(fresh)
        torch.cuda.synchronize()
        if finite:
            assert static_out.isfinite().all()
        assert torch.equal(static_out, expected), "replay must equal eager bitwise"
