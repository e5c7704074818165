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
