"""Tests of the built extension module itself: it runs on the libstdc++ torch runs on.

A compiler that only ships libstdc++.a (the GPU machine's CXX) copied libstdc++'s stream code into _C,
and every native error message that printed an integer crashed there. setup.py now links the shared
libstdc++ of the building process; these tests fail if _C defines libstdc++'s code itself again.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

import moe_extension
from moe_extension import _C

# std::ostream::_M_insert<long>: what `stream << int64_t` calls (defined in libstdc++.so, not in headers).
OSTREAM_INSERT_LONG = "_ZNSo9_M_insertIlEERSoT_"


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[-1]) == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_libstdcxx_code_is_not_inside_the_module():
    so_path = Path(_C.__file__).resolve()
    ranges = mapped_ranges(so_path)
    assert ranges, f"{so_path} is not mapped in this process"
    handle = ctypes.CDLL(str(so_path))
    address = ctypes.cast(getattr(handle, OSTREAM_INSERT_LONG), ctypes.c_void_p).value
    inside = [r for r in ranges if r[0] <= address < r[1]]
    assert not inside, f"{so_path.name} carries its own copy of libstdc++ ({OSTREAM_INSERT_LONG} at {address:#x})"


CUDA_BUILT = torch.cuda.is_available() and moe_extension.WITH_CUDA


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA_BUILT else []))
def test_native_error_message_with_integers(device):
    x = torch.zeros(3, 7, device=device)
    out = torch.empty(3, 3, device=device)
    with pytest.raises(RuntimeError, match=r"silu_and_mul: input.*even.*7"):
        torch.ops.moe_ext.silu_and_mul(out, x)
