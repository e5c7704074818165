"""Per-token-group fp8 quantization of activation rows (the fp8 block format's activation rule).

``quantize_fp8_rows(x [M, K] fp32/fp16/bf16, any strides) -> (q [M, K] float8_e4m3fn, s [M, ceil(K / 128)]
fp32)``: per row and 128-column group ``s = max(amax|x|, 1e-10) / 448``, ``q = e4m3fn(clamp(x / s, -448,
448))`` (``quantize_fp8_groups``; the same values as ``moe_extension.quant.quantize_fp8_per_token_group``).
The last group of a row whose K is not a multiple of 128 takes its scale over the columns that exist. One
launch on the current stream, grid (M, cdiv(K, BLOCK_K)); the fp8 gemm1 reads the result once per output
tile instead of quantizing its A tile in every tile (see ``fused_experts_triton``). ``zero`` (int32, optional): the
same launch also stores 0 in it (the direct schedule's GEMV counters: one launch fewer at decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from moe_extension.kernels._launch import cdiv, next_power_of_2
from moe_extension.kernels._weight_formats import quantize_fp8_groups


@triton.jit
def quantize_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, z_ptr, n_zero, K, stride_xm, stride_xk, stride_qm, stride_sm,
                             BLOCK_K: tl.constexpr, PTX: tl.constexpr, UE8M0: tl.constexpr, ZERO: tl.constexpr,
                             TRIGGER: tl.constexpr):
    """Row ``program_id(0)``, columns ``program_id(1) * BLOCK_K ..`` (BLOCK_K a multiple of 128); with ZERO the
    programs share the zeroing of ``z_ptr[:n_zero]``. TRIGGER: let a kernel launched after it with programmatic
    dependent launch start at once (it waits for this one's completion before reading what this one writes)."""
    if TRIGGER:
        gdc_launch_dependents()
    if ZERO:
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        step = tl.num_programs(0) * tl.num_programs(1) * 1024
        for z0 in range(pid * 1024, n_zero, step):
            offs_z = z0 + tl.arange(0, 1024)
            tl.store(z_ptr + offs_z, tl.zeros([1024], dtype=tl.int32), mask=offs_z < n_zero)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + m * stride_xm + offs * stride_xk, mask=offs < K, other=0.0)
    q, s = quantize_fp8_groups(x, PTX, UE8M0)
    tl.store(q_ptr + m * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    groups = tl.program_id(1) * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
    tl.store(s_ptr + m * stride_sm + groups, s, mask=groups < tl.cdiv(K, 128))


def quantize_fp8_rows(x: torch.Tensor, ue8m0: bool = False, zero: torch.Tensor | None = None,
                      trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] float8_e4m3fn, s [M, ceil(K / 128)] fp32)`` of ``x [M, K]`` (module docstring; ``ue8m0``: the
    scales rounded up to powers of two; ``zero``: a contiguous int32 tensor set to 0 by the same launch;
    ``trigger`` (sm_90+): the next kernel, if launched with programmatic dependent launch, may start at once)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, cdiv(K, 128)), dtype=torch.float32, device=x.device)
    if M == 0:
        if zero is not None:
            zero.zero_()
        return q, s
    block_k = next_power_of_2(min(1024, cdiv(K, 128) * 128))  # up to 8 groups per program
    quantize_fp8_rows_kernel[(M, cdiv(K, block_k))](
        x, q, s, zero if zero is not None else s, zero.numel() if zero is not None else 0, K, x.stride(0),
        x.stride(1), q.stride(0), s.stride(0), BLOCK_K=block_k, PTX=x.device.type == "cuda", UE8M0=ue8m0,
        ZERO=zero is not None, TRIGGER=trigger, num_warps=4,
    )
    return q, s
