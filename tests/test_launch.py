"""The host arithmetic of the launches (``moe_extension.kernels._launch.cdiv`` / ``next_power_of_2``) against
Triton's own functions, which they replace on the launch path."""

import pytest
import triton

from moe_extension.kernels._launch import cdiv, next_power_of_2

VALUES = [*range(-3, 70), 127, 128, 129, 1023, 1024, 1025, 2880, 7168, 2**20 + 1, 2**31 - 1, 2**31, 2**40 + 3]


@pytest.mark.parametrize("n", VALUES)
def test_next_power_of_2_matches_triton(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@pytest.mark.parametrize("b", [1, 2, 3, 7, 16, 64, 128, 1000])
def test_cdiv_matches_triton(b):
    assert [cdiv(a, b) for a in VALUES] == [triton.cdiv(a, b) for a in VALUES]
