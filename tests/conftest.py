"""Test configuration: without CUDA, Triton kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported, so it is set here, before any test module
imports moe_extension. Tests marked ``cuda`` are skipped without a CUDA device.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
