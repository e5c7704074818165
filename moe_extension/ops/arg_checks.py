"""Argument validation shared by the ops' fakes and real implementations: ``ArgChecker`` and the dtypes and
formats the routed-expert ops accept.

Every check goes through ``require*`` (``torch._check*`` for anything but a plain True) so that it also runs at
trace time (bad shapes fail while ``torch.compile`` traces, not only at run time), and every message starts
with the op's name and names the argument and what was expected: dtype errors raise TypeError, values
ValueError, shapes RuntimeError.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_extension.quant.fp8_block import FP8_BLOCK
from moe_extension.quant.mxfp4 import MXFP4_BLOCK
from moe_extension.quant.mxfp4_mma import MMA_COLS, MMA_ROWS

QUANT_FORMATS = ("none", "fp8_block", "mxfp4", "mxfp4_mma")
# Weight formats the Triton kernels run on CUDA (the others run the PyTorch implementation there).
TRITON_QUANT = ("none", "mxfp4", "fp8_block", "mxfp4_mma")
# MXFP4 in the checkpoint layout and in the MMA layout (moe_extension.quant.mxfp4_mma): same shapes and numbers.
MXFP4_QUANTS = ("mxfp4", "mxfp4_mma")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = {"fp8_block": (torch.float8_e4m3fn,), "mxfp4": (torch.uint8,), "mxfp4_mma": (torch.uint8,)}
SCALE_DTYPES = {"fp8_block": (torch.float32, torch.uint8), "mxfp4": (torch.uint8,), "mxfp4_mma": (torch.uint8,)}


# NOTE: torch._check* cost about 3 us a call even when the condition holds (it asks the symbolic-shapes module
# whether the condition is symbolic); fused_experts' checks make about 60 of them, so on the 2-core CPU dev
# machine ``check_fused_experts`` took 227 us per call for gpt-oss-120b MXFP4 (MMA layout) at M = 1 (its GPU
# time in a CUDA graph: 40 us). A plain True returns at once; False and symbolic conditions (tracing) go
# through torch._check*, which raises or records them as before. With the plain-int launch arithmetic
# (``_launch.cdiv``), that call's host time on the H100 machine went from 535 to 239-259 us
# (``benchmarks/results/ab_host_checks_h100.txt``; ``python benchmarks/bench_host.py --tokens 1 128``).
def require(cond, message) -> None:
    """``torch._check`` (RuntimeError) unless ``cond`` is a plain True."""
    if cond is not True:
        torch._check(cond, message)


def require_value(cond, message) -> None:
    """``torch._check_value`` (ValueError) unless ``cond`` is a plain True."""
    if cond is not True:
        torch._check_value(cond, message)


def require_type(cond, message) -> None:
    """``torch._check_type`` (TypeError) unless ``cond`` is a plain True."""
    if cond is not True:
        torch._check_type(cond, message)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _ceil_div(a, b: int):
    return (a + b - 1) // b


class ArgChecker:
    """Checks the arguments of one op call; every message starts with the op name and names the argument."""

    def __init__(self, op: str, ref_name: str, ref: torch.Tensor):
        self.op, self.ref_name, self.device = op, ref_name, ref.device

    def name(self, arg: str, value: str, allowed: Sequence[str]) -> None:
        require_value(
            value in allowed, lambda: f"{self.op}: {arg} must be one of {tuple(allowed)}, got {value!r}"
        )

    def _dtype_and_device(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
        require_type(
            t.dtype in dtypes, lambda: f"{self.op}: {arg} must have dtype {_dtype_names(dtypes)}, got {t.dtype}"
        )
        require(
            t.device == self.device,
            lambda: f"{self.op}: {arg} must be on the device of {self.ref_name} ({self.device}), got {t.device}",
        )

    def tensor(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], layout: str, shape) -> None:
        """dtype (TypeError), device and shape (RuntimeError); ``layout`` names the dims, e.g. '[E, 2N, K]'."""
        self._dtype_and_device(arg, t, dtypes)

        def message() -> str:
            want = ", ".join(str(s) for s in shape)
            return f"{self.op}: {arg} must have shape {layout} = [{want}], got {list(t.shape)}"

        require(t.dim() == len(shape), message)
        for have, want in zip(t.shape, shape):
            require(have == want, message)

    def rank(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], layout: str) -> None:
        """dtype, device and number of dims only (for the tensors the sizes are read from)."""
        self._dtype_and_device(arg, t, dtypes)
        ndim = layout.count(",") + 1
        require(t.dim() == ndim, lambda: f"{self.op}: {arg} must be {ndim}-D {layout}, got shape {list(t.shape)}")

    def mxfp4_dim(self, what: str, size) -> None:
        require_value(
            size % MXFP4_BLOCK == 0,
            lambda: f"{self.op}: quant='mxfp4' needs {what} to be a multiple of {MXFP4_BLOCK}, got {size}",
        )

    def _mma_layout(self, arg: str, t: torch.Tensor, rows, cols) -> None:
        """quant='mxfp4_mma': whole bands and chunks, contiguous (``moe_extension.quant.mxfp4_mma``)."""
        require_value(
            rows % MMA_ROWS == 0 and cols % MMA_COLS == 0,
            lambda: f"{self.op}: quant='mxfp4_mma' needs {arg}'s rows % {MMA_ROWS} == 0 and cols % {MMA_COLS} == 0, "
            f"got rows {rows}, cols {cols} (use quant='mxfp4' for this shape)",
        )
        require_value(
            t.is_contiguous(),
            lambda: f"{self.op}: quant='mxfp4_mma' needs {arg} contiguous (prepare_mxfp4_mma's output), got strides "
            f"{t.stride()}",
        )

    def weight(self, arg: str, w: torch.Tensor, quant: str, act_dtype: torch.dtype, layout: str, shape) -> None:
        """An expert weight stack of logical shape ``[E, rows, cols]`` (mxfp4: packed ``[E, rows, cols / 2]``)."""
        dtypes = WEIGHT_DTYPES.get(quant, (act_dtype,))
        if quant in MXFP4_QUANTS:
            e, rows, cols = shape
            self.tensor(arg, w, dtypes, layout.replace("]", "/2]"), (e, rows, cols // 2))
            if quant == "mxfp4_mma":
                self._mma_layout(arg, w, rows, cols)
        else:
            self.tensor(arg, w, dtypes, layout, shape)

    def scale(self, arg: str, s: torch.Tensor | None, quant: str, shape, weight_arg: str) -> None:
        """The scales of a weight stack of logical shape ``shape = (E, rows, cols)``, as ``quant`` lays them out."""
        if quant == "none":
            require_value(
                s is None,
                lambda: f"{self.op}: {arg} is only used with a quantized format (quant='fp8_block', 'mxfp4' or "
            "'mxfp4_mma'), got quant='none'",
            )
            return
        require_value(
            s is not None, lambda: f"{self.op}: quant={quant!r} needs {arg} (the {weight_arg} scales)"
        )
        e, rows, cols = shape
        if quant == "fp8_block":
            want = (e, _ceil_div(rows, FP8_BLOCK), _ceil_div(cols, FP8_BLOCK))
            layout = "[E, ceil(rows/128), ceil(cols/128)]"
        else:
            want, layout = (e, rows, cols // MXFP4_BLOCK), "[E, rows, cols/32]"
        self.tensor(arg, s, SCALE_DTYPES[quant], layout, want)
        if quant == "mxfp4_mma":
            self._mma_layout(arg, s, rows, cols)

    def bias(self, arg: str, b: torch.Tensor | None, layout: str, shape) -> None:
        if b is not None:
            self.tensor(arg, b, (torch.float32,), layout, shape)

    def routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, m, topk=None) -> None:
        """topk_ids [M, topk] int32/int64 (topk >= 1; ``topk`` fixed by another argument when given),
        topk_weights [M, topk] fp32 when given."""
        self.rank("topk_ids", topk_ids, ID_DTYPES, "[M, topk]")
        topk = topk_ids.shape[1] if topk is None else topk
        self.tensor("topk_ids", topk_ids, ID_DTYPES, "[M, topk]", (m, topk))
        require(topk >= 1, lambda: f"{self.op}: topk_ids must have topk >= 1 columns, got 0")
        if topk_weights is not None:
            self.tensor("topk_weights", topk_weights, (torch.float32,), "[M, topk] like topk_ids", (m, topk))

    def expert_map(self, expert_map: torch.Tensor | None) -> None:
        if expert_map is None:
            return
        self.rank("expert_map", expert_map, (torch.int32,), "[E_global]")
        require(
            expert_map.shape[0] >= 1, lambda: f"{self.op}: expert_map must have E_global >= 1 entries, got 0"
        )
