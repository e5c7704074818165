"""DeepGEMM's m-grouped fp8 GEMM, contiguous layout (optional; CUDA Hopper/Blackwell).

``m_grouped_fp8_gemm(a, a_scale, b, b_scale, out, m_indices)`` computes, for every row r with
``e = m_indices[r] >= 0``,

    out[r, :] = (a[r, :] * a_scale[r, k // 128]) @ (b[e] * b_scale[e, n // 128, k // 128]).T

with ``a [R, K]`` float8_e4m3fn (one row per (token, slot), grouped by expert, each expert's segment
padded to ``alignment()`` rows), ``a_scale [R, K/128]`` fp32, ``b [E, N, K]`` float8_e4m3fn (K-major),
``b_scale [E, N/128, K/128]`` fp32, ``out [R, N]`` bf16, ``m_indices [R]`` int32 (-1: rows not computed).
Rows of ``out`` with ``m_indices < 0`` are left as they were.

``is_applicable`` is the rule under which the experts use it (docs/experts.md): tokens >= its alignment, N and
K multiples of the alignment, both weights float8_e4m3fn, inputs contiguous (plus bf16 hidden states:
DeepGEMM writes bf16). Importing this module does not import ``deep_gemm``; the first ``is_available()``
does, and a missing or unusable package is reported with its reason, never required.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

DEFAULT_ALIGNMENT = 128  # DeepGEMM's m alignment of the contiguous layout on SM90/SM100

_NAME = "deep_gemm backend"


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    """``(namespace, None)`` when DeepGEMM can run here, else ``(namespace or None, reason)``."""
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001  (any import failure means "not usable here")
        return None, f"cannot import deep_gemm ({type(exc).__name__}: {exc})"
    # DeepGEMM 2.x names first, then the 1.x names of the same functions.
    gemm = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None)
    legacy = gemm is None
    if legacy:
        gemm = getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", None)
    align = getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout", None) or getattr(
        deep_gemm, "get_m_alignment_for_contiguous_layout", None
    )
    if gemm is None or align is None:
        return None, "deep_gemm has no m-grouped contiguous fp8 GEMM / alignment query"
    dg = SimpleNamespace(gemm=gemm, legacy=legacy, align=align)
    if not torch.cuda.is_available():
        return dg, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return dg, f"CUDA capability {major}.{minor} (DeepGEMM runs on 9.x and 10.x)"
    return dg, None


def unavailable_reason() -> str | None:
    """Why DeepGEMM cannot run here, or None when it can."""
    return _load()[1]


def is_available() -> bool:
    """True when deep_gemm imports with the grouped GEMM API and a Hopper/Blackwell GPU is present."""
    return _load()[1] is None


@functools.cache
def alignment() -> int:
    """Rows per expert segment of the contiguous layout (``DEFAULT_ALIGNMENT`` when DeepGEMM is absent)."""
    dg, reason = _load()
    if reason is not None:
        return DEFAULT_ALIGNMENT
    value = dg.align()
    # Some releases answer [m, k]; the m alignment is what the layout needs.
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def is_applicable(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """The shape/dtype/layout rule for ``hidden_states [M, K]``, ``w1 [E, 2N, K]``, ``w2 [E, K, N]``
    (the ops' layout). Says nothing about availability: see ``is_available``."""
    align = alignment()
    M, K = hidden_states.shape
    N = w2.size(2)
    return (
        M >= align
        and N % align == 0
        and K % align == 0
        and w1.dtype == torch.float8_e4m3fn
        and w2.dtype == torch.float8_e4m3fn
        and hidden_states.dtype == torch.bfloat16
        and hidden_states.is_contiguous()
        and w1.is_contiguous()
        and w2.is_contiguous()
    )


def m_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """DeepGEMM's grouped GEMM (module docstring); fills ``out`` and returns it."""
    dg, reason = _load()
    if reason is not None:
        raise RuntimeError(
            f"{_NAME}: DeepGEMM is not available: {reason}. It is optional (docs/benchmarks.md "
            "says how to put the copy vendored in the vllm wheel on PYTHONPATH); the experts fall back to fused_experts(quant='fp8_block')."
        )
    if dg.legacy:
        dg.gemm((a, a_scale), (b, b_scale), out, m_indices)
    else:
        # NOTE: our scales are plain fp32 (no UE8M0 rounding): keep DeepGEMM from casting them.
        dg.gemm((a, a_scale), (b, b_scale), out, m_indices, disable_ue8m0_cast=True)
    return out
