"""The two routed expert GEMMs of the unfused path, plus the validation and grouped-by-expert machinery
that ``fused_experts`` shares with them.

``moe_ext::expert_gemm1(hidden_states [M, K], w1 [E, 2N, K], topk_ids [M, topk], *, w1_bias [E, 2N] fp32,
expert_map [E_global] int32, topk_weights [M, topk] fp32, quant, w1_scale)`` -> ``h [M, topk, 2N]`` in
``hidden_states.dtype``: ``h[t, j] = W1[e] x' + b1[e]`` with ``x' = g * x`` when ``topk_weights`` is given
(apply_router_weight_on_input), else ``x``.

``moe_ext::expert_gemm2(intermediate [M, topk, N], w2 [E, K, N], topk_ids, *, w2_bias [E, K] fp32,
expert_map, topk_weights, quant, w2_scale)`` -> ``y [M, topk, K]`` in ``intermediate.dtype``:
``y[t, j] = W2[e] a[t, j] + b2[e]``, times ``g`` when ``topk_weights`` is given.

Both: ``e`` is the local expert of slot ``(t, j)`` (through ``expert_map`` when given); invalid slots give
rows of exactly 0; math in fp32, one rounding at the end. Weight layouts per ``quant``:
``"none"``: same dtype as the activations; ``"fp8_block"``: e4m3fn + fp32 scales per 128 x 128 block, the
GEMM input quantized per row per 128 columns; ``"mxfp4"``: uint8 packed e2m1 ``[E, rows, cols / 2]`` +
E8M0 scales ``[E, rows, cols / 32]``, the GEMM input rounded to bf16. Any weight strides.

On CUDA with ``quant="none"`` the Triton kernels run (``moe_extension.kernels``); everywhere else the
PyTorch implementation below (``expert_gemm1_torch`` / ``expert_gemm2_torch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_extension.quant.fp8_block import FP8_BLOCK, dequantize_fp8_block, fake_quantize_fp8_per_token_group
from moe_extension.quant.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4

QUANT_FORMATS = ("none", "fp8_block", "mxfp4")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = {"fp8_block": (torch.float8_e4m3fn,), "mxfp4": (torch.uint8,)}
SCALE_DTYPES = {"fp8_block": (torch.float32,), "mxfp4": (torch.uint8,)}


# ----------------------------------------------------------------------------------------------------
# Validation (shared by the fakes and the real implementations; torch._check so it runs at trace time)
# ----------------------------------------------------------------------------------------------------


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _ceil_div(a, b: int):
    return (a + b - 1) // b


class ArgChecker:
    """Checks the arguments of one op call; every message starts with the op name and names the argument."""

    def __init__(self, op: str, ref_name: str, ref: torch.Tensor):
        self.op, self.ref_name, self.device = op, ref_name, ref.device

    def name(self, arg: str, value: str, allowed: Sequence[str]) -> None:
        torch._check_value(
            value in allowed, lambda: f"{self.op}: {arg} must be one of {tuple(allowed)}, got {value!r}"
        )

    def _dtype_and_device(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
        torch._check_type(
            t.dtype in dtypes, lambda: f"{self.op}: {arg} must have dtype {_dtype_names(dtypes)}, got {t.dtype}"
        )
        torch._check(
            t.device == self.device,
            lambda: f"{self.op}: {arg} must be on the device of {self.ref_name} ({self.device}), got {t.device}",
        )

    def tensor(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], layout: str, shape) -> None:
        """dtype (TypeError), device and shape (RuntimeError); ``layout`` names the dims, e.g. '[E, 2N, K]'."""
        self._dtype_and_device(arg, t, dtypes)

        def message() -> str:
            want = ", ".join(str(s) for s in shape)
            return f"{self.op}: {arg} must have shape {layout} = [{want}], got {list(t.shape)}"

        torch._check(t.dim() == len(shape), message)
        for have, want in zip(t.shape, shape):
            torch._check(have == want, message)

    def rank(self, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], layout: str) -> None:
        """dtype, device and number of dims only (for the tensors the sizes are read from)."""
        self._dtype_and_device(arg, t, dtypes)
        ndim = layout.count(",") + 1
        torch._check(t.dim() == ndim, lambda: f"{self.op}: {arg} must be {ndim}-D {layout}, got shape {list(t.shape)}")

    def mxfp4_dim(self, what: str, size) -> None:
        torch._check_value(
            size % MXFP4_BLOCK == 0,
            lambda: f"{self.op}: quant='mxfp4' needs {what} to be a multiple of {MXFP4_BLOCK}, got {size}",
        )

    def weight(self, arg: str, w: torch.Tensor, quant: str, act_dtype: torch.dtype, layout: str, shape) -> None:
        """An expert weight stack of logical shape ``[E, rows, cols]`` (mxfp4: packed ``[E, rows, cols / 2]``)."""
        dtypes = WEIGHT_DTYPES.get(quant, (act_dtype,))
        if quant == "mxfp4":
            e, rows, cols = shape
            self.tensor(arg, w, dtypes, layout.replace("]", "/2]"), (e, rows, cols // 2))
        else:
            self.tensor(arg, w, dtypes, layout, shape)

    def scale(self, arg: str, s: torch.Tensor | None, quant: str, shape, weight_arg: str) -> None:
        """The scales of a weight stack of logical shape ``shape = (E, rows, cols)``, as ``quant`` lays them out."""
        if quant == "none":
            torch._check_value(
                s is None,
                lambda: f"{self.op}: {arg} is only used with quant='fp8_block' or 'mxfp4', got quant='none'",
            )
            return
        torch._check_value(
            s is not None, lambda: f"{self.op}: quant={quant!r} needs {arg} (the {weight_arg} scales)"
        )
        e, rows, cols = shape
        if quant == "fp8_block":
            want = (e, _ceil_div(rows, FP8_BLOCK), _ceil_div(cols, FP8_BLOCK))
            layout = "[E, ceil(rows/128), ceil(cols/128)]"
        else:
            want, layout = (e, rows, cols // MXFP4_BLOCK), "[E, rows, cols/32]"
        self.tensor(arg, s, SCALE_DTYPES[quant], layout, want)

    def bias(self, arg: str, b: torch.Tensor | None, layout: str, shape) -> None:
        if b is not None:
            self.tensor(arg, b, (torch.float32,), layout, shape)

    def routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, m, topk=None) -> None:
        """topk_ids [M, topk] int32/int64 (topk >= 1; ``topk`` fixed by another argument when given),
        topk_weights [M, topk] fp32 when given."""
        self.rank("topk_ids", topk_ids, ID_DTYPES, "[M, topk]")
        topk = topk_ids.shape[1] if topk is None else topk
        self.tensor("topk_ids", topk_ids, ID_DTYPES, "[M, topk]", (m, topk))
        torch._check(topk >= 1, lambda: f"{self.op}: topk_ids must have topk >= 1 columns, got 0")
        if topk_weights is not None:
            self.tensor("topk_weights", topk_weights, (torch.float32,), "[M, topk] like topk_ids", (m, topk))

    def expert_map(self, expert_map: torch.Tensor | None) -> None:
        if expert_map is None:
            return
        self.rank("expert_map", expert_map, (torch.int32,), "[E_global]")
        torch._check(
            expert_map.shape[0] >= 1, lambda: f"{self.op}: expert_map must have E_global >= 1 entries, got 0"
        )


def check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale):
    """Validates expert_gemm1's arguments; returns (M, topk, 2N)."""
    c = ArgChecker("expert_gemm1", "hidden_states", hidden_states)
    c.name("quant", quant, QUANT_FORMATS)
    c.rank("hidden_states", hidden_states, FLOAT_DTYPES, "[M, K]")
    m, k = hidden_states.shape
    if quant == "mxfp4":
        c.mxfp4_dim("K (hidden_states.shape[1])", k)
    c.rank("w1", w1, WEIGHT_DTYPES.get(quant, (hidden_states.dtype,)), "[E, 2N, K]")
    e, rows = w1.shape[0], w1.shape[1]
    c.weight("w1", w1, quant, hidden_states.dtype, "[E, 2N, K]", (e, rows, k))
    c.scale("w1_scale", w1_scale, quant, (e, rows, k), "w1")
    c.bias("w1_bias", w1_bias, "[E, 2N]", (e, rows))
    c.expert_map(expert_map)
    c.routing(topk_ids, topk_weights, m)
    return m, topk_ids.shape[1], rows


def check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale):
    """Validates expert_gemm2's arguments; returns (M, topk, K)."""
    c = ArgChecker("expert_gemm2", "intermediate", intermediate)
    c.name("quant", quant, QUANT_FORMATS)
    c.rank("intermediate", intermediate, FLOAT_DTYPES, "[M, topk, N]")
    m, topk, n = intermediate.shape
    if quant == "mxfp4":
        c.mxfp4_dim("N (intermediate.shape[2])", n)
    c.rank("w2", w2, WEIGHT_DTYPES.get(quant, (intermediate.dtype,)), "[E, K, N]")
    e, k = w2.shape[0], w2.shape[1]
    c.weight("w2", w2, quant, intermediate.dtype, "[E, K, N]", (e, k, n))
    c.scale("w2_scale", w2_scale, quant, (e, k, n), "w2")
    c.bias("w2_bias", w2_bias, "[E, K]", (e, k))
    c.expert_map(expert_map)
    c.routing(topk_ids, topk_weights, m, topk)
    return m, topk, k


# ----------------------------------------------------------------------------------------------------
# The grouped PyTorch implementation (device-agnostic; fp32 math)
# ----------------------------------------------------------------------------------------------------


def group_by_expert(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int
) -> list[tuple[int, torch.Tensor]]:
    """``[(e, slots)]`` for every local expert ``e`` that at least one valid slot routes to, where ``slots``
    (int64) are the flat slot indices ``t * topk + j`` routed to ``e``, in increasing order.

    A slot is invalid (and dropped) when its id is < 0, >= E_global (with a map) or maps to a local id
    outside [0, E): such slots go to a sentinel bucket ``E`` that is never computed.
    """
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        local = ids
    else:
        e_global = expert_map.shape[0]
        inside = (ids >= 0) & (ids < e_global)
        local = torch.where(inside, expert_map.long()[ids.clamp(0, e_global - 1)], -1)
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    sorted_key, slots = torch.sort(key, stable=True)
    # NOTE: one device-to-host copy of E + 1 group starts per call: the per-expert loop needs the group
    # sizes on the host. This path is the CPU implementation and the CUDA fallback for quantized
    # formats; it is not CUDA-graph capturable (the Triton path is).
    starts = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=key.device)).tolist()
    return [(e, slots[starts[e] : starts[e + 1]]) for e in range(num_experts) if starts[e + 1] > starts[e]]


def gemm_input(x: torch.Tensor, quant: str) -> torch.Tensor:
    """fp32 rows ``[n, cols]`` -> the fp32 values the GEMM multiplies: fp8 quantize-dequantize per 128
    columns (fp8_block), rounded to bf16 (mxfp4), unchanged (none)."""
    if quant == "fp8_block":
        return fake_quantize_fp8_per_token_group(x)
    if quant == "mxfp4":
        return x.to(torch.bfloat16).float()
    return x


class ExpertWeights:
    """One expert weight stack (logical ``[E, rows, cols]``, any strides) with its scales and fp32 bias;
    ``linear(e, x)`` = ``x @ W[e]^T + b[e]`` in fp32 for ``x [n, cols]`` fp32."""

    def __init__(self, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, quant: str):
        self.w, self.scale, self.bias, self.quant = w, scale, bias, quant
        self._workspace: torch.Tensor | None = None

    def dense(self, e: int) -> torch.Tensor:
        """fp32 ``W[e]`` [rows, cols]; only this expert is dequantized."""
        if self.quant == "fp8_block":
            return dequantize_fp8_block(self.w[e], self.scale[e])
        if self.quant == "mxfp4":
            return dequantize_mxfp4(self.w[e], self.scale[e])
        if self.w.dtype == torch.float32:
            return self.w[e]
        if self._workspace is None:
            # NOTE: one fp32 buffer reused for every expert (same strides as W[e], so transposed storage
            # stays a cheap copy): a fresh 66 MB allocation per expert costs ~100 ms of page faults on this
            # 2-core machine against ~5 ms for the bf16 -> fp32 copy itself (gpt-oss-20b w1).
            self._workspace = torch.empty_like(self.w[e], dtype=torch.float32)
        return self._workspace.copy_(self.w[e])

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[e]
        return torch.nn.functional.linear(x, self.dense(e), bias)


def expert_gemm1_torch(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None) -> torch.Tensor:
    """PyTorch implementation of expert_gemm1 (any device): ``[M, topk, 2N]`` in ``hidden_states.dtype``."""
    m, topk, rows = check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale)
    out = torch.zeros((m * topk, rows), dtype=torch.float32, device=hidden_states.device)
    weights = ExpertWeights(w1, w1_scale, w1_bias, quant)
    x = hidden_states.float()
    g = None if topk_weights is None else topk_weights.reshape(-1)
    for e, slots in group_by_expert(topk_ids, expert_map, w1.shape[0]):
        xe = x[slots // topk]
        if g is not None:
            xe = xe * g[slots, None]
        out[slots] = weights.linear(e, gemm_input(xe, quant))
    return out.view(m, topk, rows).to(hidden_states.dtype)


def expert_gemm2_torch(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None) -> torch.Tensor:
    """PyTorch implementation of expert_gemm2 (any device): ``[M, topk, K]`` in ``intermediate.dtype``."""
    m, topk, k = check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale)
    out = torch.zeros((m * topk, k), dtype=torch.float32, device=intermediate.device)
    weights = ExpertWeights(w2, w2_scale, w2_bias, quant)
    a = intermediate.reshape(m * topk, intermediate.shape[2])
    g = None if topk_weights is None else topk_weights.reshape(-1)
    for e, slots in group_by_expert(topk_ids, expert_map, w2.shape[0]):
        y = weights.linear(e, gemm_input(a[slots].float(), quant))
        out[slots] = y if g is None else y * g[slots, None]
    return out.view(m, topk, k).to(intermediate.dtype)


# ----------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------

torch.library.define(
    "moe_ext::expert_gemm1",
    "(Tensor hidden_states, Tensor w1, Tensor topk_ids, *, Tensor? w1_bias=None, Tensor? expert_map=None, "
    'Tensor? topk_weights=None, str quant="none", Tensor? w1_scale=None) -> Tensor',
)
torch.library.define(
    "moe_ext::expert_gemm2",
    "(Tensor intermediate, Tensor w2, Tensor topk_ids, *, Tensor? w2_bias=None, Tensor? expert_map=None, "
    'Tensor? topk_weights=None, str quant="none", Tensor? w2_scale=None) -> Tensor',
)


@torch.library.register_fake("moe_ext::expert_gemm1")
def _expert_gemm1_fake(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None):
    m, topk, rows = check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale)
    return hidden_states.new_empty((m, topk, rows))


@torch.library.register_fake("moe_ext::expert_gemm2")
def _expert_gemm2_fake(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None):
    m, topk, k = check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale)
    return intermediate.new_empty((m, topk, k))


torch.library.impl("moe_ext::expert_gemm1", "cpu")(expert_gemm1_torch)
torch.library.impl("moe_ext::expert_gemm2", "cpu")(expert_gemm2_torch)


@torch.library.impl("moe_ext::expert_gemm1", "cuda")
def _expert_gemm1_cuda(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w1_scale=None):
    if quant != "none":
        return expert_gemm1_torch(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                                  topk_weights=topk_weights, quant=quant, w1_scale=w1_scale)
    check_expert_gemm1(hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, quant, w1_scale)
    from moe_extension.kernels import expert_gemm1_triton

    return expert_gemm1_triton(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                               topk_weights=topk_weights)


@torch.library.impl("moe_ext::expert_gemm2", "cuda")
def _expert_gemm2_cuda(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                       quant="none", w2_scale=None):
    if quant != "none":
        return expert_gemm2_torch(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                                  topk_weights=topk_weights, quant=quant, w2_scale=w2_scale)
    check_expert_gemm2(intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, quant, w2_scale)
    from moe_extension.kernels import expert_gemm2_triton

    return expert_gemm2_triton(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                               topk_weights=topk_weights)


def expert_gemm1(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                 quant="none", w1_scale=None) -> torch.Tensor:
    """``torch.ops.moe_ext.expert_gemm1``: ``h [M, topk, 2N]`` (see the module docstring)."""
    return torch.ops.moe_ext.expert_gemm1(hidden_states, w1, topk_ids, w1_bias=w1_bias, expert_map=expert_map,
                                          topk_weights=topk_weights, quant=quant, w1_scale=w1_scale)


def expert_gemm2(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                 quant="none", w2_scale=None) -> torch.Tensor:
    """``torch.ops.moe_ext.expert_gemm2``: ``y [M, topk, K]`` (see the module docstring)."""
    return torch.ops.moe_ext.expert_gemm2(intermediate, w2, topk_ids, w2_bias=w2_bias, expert_map=expert_map,
                                          topk_weights=topk_weights, quant=quant, w2_scale=w2_scale)
