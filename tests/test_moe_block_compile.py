"""A small MoE block (router nn.Linear -> topk_softmax -> fused_experts) under
torch.compile(fullgraph=True, dynamic=True): one graph for every token count, no recompile, same result as
eager, for each weight format."""

import pytest
import torch
from torch._dynamo.utils import counters

from moe_extension.ops import fused_experts, topk_softmax
from tests.reference import random_experts, tolerance
from tests.utils import DEVICES

TOKEN_COUNTS = (2, 3, 17, 64, 257)
SIZES = {"none": (56, 40), "fp8_block": (136, 72), "mxfp4": (64, 32)}  # (K, N)


class MoEBlock(torch.nn.Module):
    def __init__(self, quant: str, num_experts: int = 8, topk: int = 3, activation: str = "swigluoai"):
        super().__init__()
        k, n = SIZES[quant]
        self.quant, self.topk, self.activation = quant, topk, activation
        self.router = torch.nn.Linear(k, num_experts)
        for name, t in random_experts(num_experts, k, n, quant, bias=True, transposed=True).items():
            self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = topk_softmax(self.router(x), self.topk, True)
        return fused_experts(x, self.w1, self.w2, topk_weights, topk_ids, self.activation, w1_bias=self.w1_bias,
                             w2_bias=self.w2_bias, quant=self.quant, w1_scale=self.w1_scale,
                             w2_scale=self.w2_scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["none", "fp8_block", "mxfp4"])
def test_one_graph_for_every_token_count(device, quant):
    torch._dynamo.reset()
    counters.clear()
    block = MoEBlock(quant).to(device)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    tol = tolerance(torch.float32, device, quant)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for m in TOKEN_COUNTS:
            x = torch.randn(m, SIZES[quant][0], device=device)
            torch._dynamo.mark_dynamic(x, 0)
            got, want = compiled(x), block(x)
            assert got.shape == (m, SIZES[quant][0])
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # NOTE: not CompileCounter.frame_count: Dynamo first traces the float defaults (alpha, limit) as
    # symbolic, restarts the analysis with them specialized and calls the backend twice for that one graph.
    assert counters["stats"]["unique_graphs"] == 1
