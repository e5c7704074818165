"""The native op schemas, pinned: a change to any signature (names, defaults, aliasing annotations) shows
up as a diff of this file (regenerate with EXPECTTEST_ACCEPT=1 after an intended change)."""

import expecttest
import torch

import moe_extension  # noqa: F401  (registers the ops)


def schema(name: str) -> str:
    return str(getattr(torch.ops.moe_ext, name).default._schema)


class TestNativeSchemas(expecttest.TestCase):
    def test_moe_sum(self):
        self.assertExpectedInline(
            schema("moe_sum"),
            """moe_ext::moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()""",
        )

    def test_swigluoai_and_mul(self):
        self.assertExpectedInline(
            schema("swigluoai_and_mul"),
            """moe_ext::swigluoai_and_mul(Tensor(a!) out, Tensor input, float alpha=1.702, float limit=7.) -> ()""",
        )

    def test_silu_and_mul(self):
        self.assertExpectedInline(
            schema("silu_and_mul"),
            """moe_ext::silu_and_mul(Tensor(a!) out, Tensor input) -> ()""",
        )

    def test_gelu_and_mul(self):
        self.assertExpectedInline(
            schema("gelu_and_mul"),
            """moe_ext::gelu_and_mul(Tensor(a!) out, Tensor input) -> ()""",
        )

    def test_gelu_tanh_and_mul(self):
        self.assertExpectedInline(
            schema("gelu_tanh_and_mul"),
            """moe_ext::gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()""",
        )

    def test_swiglustep_and_mul(self):
        self.assertExpectedInline(
            schema("swiglustep_and_mul"),
            """moe_ext::swiglustep_and_mul(Tensor(a!) out, Tensor input, float limit=7.) -> ()""",
        )
