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


def entry_point_call(op: str, quant: str, activation: str, topk: int, weights: tuple, expert_map, **fused_kw):
    """``call(inputs)`` of one routed-expert entry point on quantized weights ``weights = (w1, w1_scale, w2,
    w2_scale, w1_bias, w2_bias)``: ``"fused_moe"`` takes ``(x, logits)`` (renormalized top-k), ``"fused_experts"``
    and ``"expert_gemm1"`` ``(x, topk_weights, topk_ids)``, ``"expert_gemm2"`` ``(a, topk_weights, topk_ids)``
    (router weights on gemm1's input / gemm2's output); ``fused_kw`` goes to fused_experts only (``backend``)."""
    w1, s1, w2, s2, b1, b2 = weights
    q = dict(quant=quant)

    def call(inputs):
        if op == "fused_moe":
            x, logits = inputs
            return torch.ops.moe_ext.fused_moe(x, w1, w2, logits, topk, True, activation, w1_bias=b1, w2_bias=b2,
                                               expert_map=expert_map, w1_scale=s1, w2_scale=s2, **q)
        if op == "fused_experts":
            x, g, ids = inputs
            return torch.ops.moe_ext.fused_experts(x, w1, w2, g, ids, activation, w1_bias=b1, w2_bias=b2,
                                                   expert_map=expert_map, w1_scale=s1, w2_scale=s2, **q, **fused_kw)
        if op == "expert_gemm1":
            x, g, ids = inputs
            return torch.ops.moe_ext.expert_gemm1(x, w1, ids, w1_bias=b1, expert_map=expert_map, topk_weights=g,
                                                  w1_scale=s1, **q)
        a, g, ids = inputs
        return torch.ops.moe_ext.expert_gemm2(a, w2, ids, w2_bias=b2, expert_map=expert_map, topk_weights=g,
                                              w2_scale=s2, **q)

    return call


def entry_point_inputs(op: str, M: int, E: int, topk: int, K: int, N: int, routing, gen) -> list:
    """Fresh inputs of one ``entry_point_call``: bf16 hidden states (or gemm2's intermediate [M, topk, N]) and
    ``routing(M, E + 2, topk, True, gen)`` over E + 2 global ids (logits [M, E + 2] for fused_moe)."""
    if op == "fused_moe":
        return [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(M, E + 2, device="cuda", generator=gen)]
    g, ids = routing(M, E + 2, topk, True, gen)
    if op == "expert_gemm2":
        return [torch.randn(M, topk, N, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids]
    return [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids]


def record_results(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` (a function) by one that calls it and appends each result to the returned list."""
    real = getattr(owner, name)
    results = []

    def recorded(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(owner, name, recorded)
    return results
