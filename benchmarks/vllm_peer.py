"""Peer harness for vLLM's Triton ``fused_moe_kernel``: the expert half of an MoE layer run the way vLLM runs it.

Used only by the benchmarks, never by the library. vLLM's kernel is not vendored: ``get_peers.sh vllm`` (vLLM
0.33.0 by default) extracts ``fused_moe_kernel`` (+ the ``write_zeros_to_output`` helper it calls) into
``.deps/vllm/vllm_fused_moe_kernel.py`` and vLLM's tuned configs into ``.deps/vllm/configs/``; ``load()``
imports that file at runtime. Everything else here (routing alignment, config lookup, buffers, launches) is
our own code, written to reproduce what vLLM 0.33.0's ``fused_experts_impl`` does on a CUDA device.

What it computes (``VllmFusedMoE.full``), for ``hidden_states x [M, K]`` (bf16; fp16/fp32 accepted),
``w1 [E, 2N, K]``, ``w2 [E, K, N]`` (last dim contiguous), ``topk_weights [M, topk]`` fp32 contiguous and
``topk_ids [M, topk]`` int32 (int64 accepted)::

    out[t] = sum_j topk_weights[t, j] * W2[e] act(W1[e] x[t] + b1[e]) + b2[e]     (e = expert of slot j)

as five steps, like vLLM: routing alignment (``align_block_size``; or vLLM's "naive" one-block-per-slot
assignment when ``M * topk * 4 <= E`` and there is no expert_map) -> GEMM1 (``fused_moe_kernel``, into
``cache1 [M, topk, 2N]``) -> activation (``torch.ops.moe_ext.silu_and_mul``, or ``swigluoai_and_mul`` for
gpt-oss's interleaved gate/up, into ``cache2 [M * topk, N]``) -> GEMM2 with ``MUL_ROUTED_WEIGHT`` (into
``cache3 [M, topk, K]``, sharing memory with cache1 as in vLLM) -> ``torch.ops.moe_ext.moe_sum`` over the slots.
The caches and the output are allocated once, for ``max_tokens`` tokens.

Quantization: ``quant="none"`` (activations and weights in the dtype of ``x``) or ``quant="fp8_block"`` (w8a8,
128 x 128 blocks, the DeepSeek-V3 recipe of docs/formats.md: ``w1``/``w2`` float8_e4m3fn with fp32 scales
``w1_scale [E, ceil(2N/128), ceil(K/128)]``, ``w2_scale [E, ceil(K/128), ceil(N/128)]``; the input of each GEMM
quantized per token per 128 columns before it). The activation quantizer is
``moe_extension.kernels._quantize_fp8.quantize_fp8_rows`` on CUDA (one Triton launch, like vLLM's
``per_token_group_quant_fp8``) and ``moe_extension.quant.quantize_fp8_per_token_group`` (plain torch, the same
values) elsewhere; ``act_quant="torch"`` forces the latter; ``act_quant_impl`` names
the one in use.

Timing entry points: ``full(x, topk_weights, topk_ids)`` (alignment + quantization + both GEMMs + activation +
sum) and ``gemms_only(prepared)`` (the two ``fused_moe_kernel`` launches alone, on inputs that
``prepare(x, topk_weights, topk_ids)`` built outside the timing). Both are free of host syncs (CUDA-graph
capturable); the launch config is picked on the host from M (a shape) through vLLM's tables
(``shipped_config`` / ``config_for``) or vLLM's default heuristic (``default_config``).

Expert parallelism: with ``expert_map [E_global]`` (global id -> local id, -1 elsewhere) the weights hold the
local experts only; like vLLM, alignment skips the slots of non-local experts
(``ignore_invalid_experts=True``) and ``cache3`` is zeroed before GEMM2 so that those slots sum as 0. vLLM picks
its config file by the local expert count (``w2.size(0)``). Without an expert_map, ids must be valid
(``0 <= id < E``): like vLLM, the sorted path leaves the slots of other ids unwritten and sums whatever they hold.

Module API: ``load``, ``device_file_name``, ``config_file_name``, ``shipped_config``, ``config_for``,
``default_config``, ``align_block_size``, ``VllmFusedMoE`` (``prepare``, ``full``, ``gemms_only``,
``config_for_tokens``), ``KERNEL_VERSION``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
import triton

import moe_extension  # noqa: F401  (registers torch.ops.moe_ext)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEPS = ".deps/vllm"
KERNEL_FILE = "vllm_fused_moe_kernel.py"
KERNEL_VERSION = "vLLM 0.33.0 (get_peers.sh vllm; VLLM=<version> picks another)"
ACTIVATIONS = ("silu", "swigluoai")
QUANTS = ("none", "fp8_block")
FP8_BLOCK_SHAPE = (128, 128)
# Launch options a config entry may carry for NVIDIA; AMD/XPU-only keys (waves_per_eu, kpack, ...) are dropped.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# Kernel parameters that older/newer kernel versions may lack, with the value that means "feature off".
NEUTRAL = dict(b_bias_ptr=None, stride_bbe=0, stride_bbn=0, HAS_BIAS=False, naive_block_assignment=False,
               SWAP_AB=False, USE_TD=False, SPLIT_K=1, use_int8_w8a8=False, use_int8_w8a16=False,
               per_channel_quant=False)

_LOADED: dict[str, ModuleType] = {}


# ------------------------------------------------------------------------------------------------- loading


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


def load(deps_dir: str | Path = DEFAULT_DEPS) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` with vLLM's ``fused_moe_kernel`` imported from ``deps_dir``, or ``(None, reason)``.

    A relative ``deps_dir`` is tried against the working directory, then the repository root.
    """
    root = _resolve(deps_dir)
    src = root / KERNEL_FILE
    if not root.is_dir():
        return None, f"{root} is missing (run ../shared/tools/get_peers.sh vllm from the repo root)"
    if not src.is_file():
        return None, f"{src} is missing (run ../shared/tools/get_peers.sh vllm from the repo root)"
    key = str(src.resolve())
    if key in _LOADED:
        return _LOADED[key], None
    name = "vllm_fused_moe_kernel"
    try:
        spec = importlib.util.spec_from_file_location(name, src)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton's JIT looks functions up through their module
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001  (any import failure is a reason, reported to the caller)
        sys.modules.pop(name, None)
        return None, f"importing {src} failed: {type(exc).__name__}: {exc}"
    if not hasattr(module, "fused_moe_kernel"):
        return None, f"{src} defines no fused_moe_kernel"
    _LOADED[key] = module
    return module, None


# ------------------------------------------------------------------------------------------------- configs


def device_file_name(name: str | None = None) -> str:
    """vLLM's device part of a config file name: the CUDA device name with spaces as ``_``; any H200 variant
    maps to ``NVIDIA_H200``. ``name=None`` asks the current CUDA device (``"cpu"`` without one)."""
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def _dtype_selector(dtype: str) -> str:
    if dtype in ("bf16", "fp16", "none", None):
        return ""  # vLLM looks up 16-bit activations without a dtype part (its "dtype=bf16" files go unread)
    if dtype == "fp8_w8a8":
        return ",dtype=fp8_w8a8"
    raise ValueError(f"dtype must be 'bf16' or 'fp8_w8a8', got {dtype!r}")


def config_file_name(E: int, N: int, device_name: str, dtype: str = "bf16",
                     block_shape: list[int] | tuple[int, int] | None = None) -> str:
    """``E=..,N=..,device_name=..[,dtype=fp8_w8a8][,block_shape=[128,128]].json`` (vLLM's naming)."""
    blocks = "" if not block_shape or not all(block_shape) else f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return f"E={E},N={N},device_name={device_name}{_dtype_selector(dtype)}{blocks}.json"


def shipped_config(configs_dir: str | Path, E: int, N: int, device_name: str, dtype: str = "bf16",
                   block_shape: list[int] | tuple[int, int] | None = None) -> dict[int, dict] | None:
    """vLLM's tuned table ``{M: config}`` for ``E`` experts (local ones, ``w2.size(0)``) and intermediate size
    ``N`` (``w2.size(2)``; ``w1`` is ``[E, 2N, K]``), or None when vLLM ships no file for it. Keys keep the
    file's order (``config_for`` breaks ties by it, as vLLM does)."""
    path = _resolve(configs_dir) / config_file_name(E, N, device_name, dtype, block_shape)
    if not path.is_file():
        return None
    with open(path) as f:
        raw = json.load(f)
    raw.pop("triton_version", None)
    return {int(m): dict(cfg) for m, cfg in raw.items()}


def config_for(table: dict[int, dict], M: int) -> dict:
    """The entry of ``table`` whose key is nearest to ``M`` (abs difference; first such key on a tie)."""
    if not table:
        raise ValueError("config_for: empty table")
    return table[min(table, key=lambda m: abs(m - M))]


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str = "bf16",
                   block_shape: list[int] | tuple[int, int] | None = None) -> dict:
    """vLLM 0.33.0's fallback config on a CUDA device when no tuned file exists (``get_default_config``'s
    CUDA branches for 16-bit and fp8 block; ``N``, ``K``, ``topk`` do not enter them)."""
    del N, K, topk
    if dtype == "fp8_w8a8" and block_shape is not None:
        small = M <= 8 and block_shape[0] % 64 == 0
        return dict(BLOCK_SIZE_M=16 if M <= 64 else 64, BLOCK_SIZE_N=64 if small else block_shape[0],
                    BLOCK_SIZE_K=block_shape[1], GROUP_SIZE_M=1 if M <= 16 else 32, SPLIT_K=1, num_warps=4,
                    num_stages=(4 if M <= 4 else 3) if small else 3)
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=64 if M <= 64 else 128,
                BLOCK_SIZE_K=128 if dtype == "fp8_w8a8" or M <= 64 else 64,
                GROUP_SIZE_M=16 if M // max(E, 1) > 128 else 1, SPLIT_K=1,
                num_warps=4 if M <= 128 else 8, num_stages=4 if M <= 32 else 3)


# ----------------------------------------------------------------------------------------------- alignment


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                     expert_map: torch.Tensor | None = None, *, ignore_invalid_experts: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch routing alignment with the contract of vLLM's ``moe_align_block_size``.

    ``topk_ids [M, topk]`` (global ids in ``[0, num_experts)``; others are skipped), tile height ``block_m``.
    Returns, sized from the shapes only (no host sync, CUDA-graph safe):

    - ``sorted_token_ids`` int32 ``[P]``, ``P = numel + num_experts * (block_m - 1)`` (``min(numel * block_m, P)``
      when ``numel < num_experts``): the flat slot indices ``t * topk + j`` grouped by expert in ascending
      expert order, each expert's run padded to a multiple of ``block_m`` with ``numel`` (= M * topk), which
      also fills everything past the end;
    - ``expert_ids`` int32 ``[ceil(P / block_m)]``: the expert of each block, mapped through ``expert_map`` when
      given (``-1`` for blocks of non-local experts); ``-1`` for blocks past the end;
    - ``num_tokens_post_padded`` int32 ``[1]`` on the device: the padded length in use.

    ``ignore_invalid_experts=True`` (with ``expert_map``) leaves the slots of non-local experts out entirely, as
    vLLM's fused_experts does: no block then carries ``-1``. Within an expert slots keep ascending order.
    """
    device = topk_ids.device
    numel = topk_ids.numel()
    padded_max = numel + num_experts * (block_m - 1)
    if numel < num_experts:
        padded_max = min(numel * block_m, padded_max)
    num_blocks = -(-padded_max // block_m)

    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    if expert_map is not None and ignore_invalid_experts:
        valid = valid & (expert_map.long()[flat.clamp(0, num_experts - 1)] >= 0)
    key = torch.where(valid, flat, num_experts)  # invalid slots sort last, into a drop bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    raw_starts = torch.cumsum(counts, 0) - counts

    sorted_key, order = torch.sort(key, stable=True)
    pos = torch.arange(numel, device=device)
    e = sorted_key.clamp(max=num_experts - 1)
    dest = torch.where(sorted_key < num_experts, starts[e] + pos - raw_starts[e], padded_max)
    sorted_ids = torch.full((padded_max + 1,), numel, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:padded_max]

    total = ends[-1:] if num_experts > 0 else torch.zeros(1, dtype=torch.long, device=device)
    block_start = torch.arange(num_blocks, device=device) * block_m
    owner = torch.searchsorted(ends, block_start, right=True).clamp(max=max(num_experts - 1, 0))
    if expert_map is not None:
        owner = expert_map.long()[owner]
    expert_ids = torch.where(block_start < total, owner, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


# ---------------------------------------------------------------------------------------------- the layer


def _compute_type(dtype: torch.dtype):
    import triton.language as tl

    table = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    if dtype not in table:
        raise TypeError(f"hidden_states must be bf16, fp16 or fp32, got {dtype}")
    return table[dtype]


class VllmFusedMoE:
    """vLLM 0.33.0's Triton fused-MoE path over fixed expert weights (module docstring).

    ``kernel``: the module from ``load()`` (or anything with a ``fused_moe_kernel``). ``topk`` and
    ``max_tokens`` size the buffers. ``config``: None (vLLM's shipped table for this shape and device from
    ``configs_dir``, else ``default_config``), a table ``{M: config}``, or one config for every M.
    ``naive``: "auto" (vLLM's rule), True or False for the one-block-per-slot assignment. ``swap_ab``:
    "auto" (vLLM: fp8 on sm90 with BLOCK_SIZE_M < 64 <= BLOCK_SIZE_N), True or False.
    ``global_num_experts``: E_global with an ``expert_map`` (default ``expert_map.numel()``). ``dtype``: of
    ``hidden_states``, the caches and the output (default: the weights' dtype; bf16 for fp8_block).
    ``config_source`` says where the configs come from (a file path, "default_config" or "given").
    """

    def __init__(self, kernel, w1: torch.Tensor, w2: torch.Tensor, *, topk: int, max_tokens: int,
                 activation: str = "silu", quant: str = "none", w1_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None, w1_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                 global_num_experts: int | None = None, apply_router_weight_on_input: bool = False,
                 alpha: float = 1.702, limit: float = 7.0, dtype: torch.dtype | None = None,
                 config: dict | None = None, configs_dir: str | Path | None = None, device_name: str | None = None,
                 naive: bool | str = "auto", swap_ab: bool | str = "auto", act_quant: str = "auto"):
        self.fn = getattr(kernel, "fused_moe_kernel", kernel)
        self.params = inspect.signature(getattr(self.fn, "fn", self.fn)).parameters
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
        E, two_n, K = w1.shape
        if two_n % 2 or tuple(w2.shape) != (E, K, two_n // 2):
            raise ValueError(f"w1 [E, 2N, K] and w2 [E, K, N] do not match: {list(w1.shape)}, {list(w2.shape)}")
        if w1.stride(-1) != 1 or w2.stride(-1) != 1:
            raise ValueError("w1 and w2 need a contiguous last dimension (vLLM asserts it)")
        self.E, self.N, self.K, self.topk, self.max_tokens = E, two_n // 2, K, topk, max_tokens
        self.w1, self.w2, self.w1_bias, self.w2_bias = w1, w2, w1_bias, w2_bias
        self.activation, self.quant, self.alpha, self.limit = activation, quant, alpha, limit
        self.on_input = apply_router_weight_on_input
        self.fp8 = quant == "fp8_block"
        self.block_shape = list(FP8_BLOCK_SHAPE) if self.fp8 else None
        if self.fp8:
            for name, w, s, rows, cols in (("w1", w1, w1_scale, 2 * self.N, K), ("w2", w2, w2_scale, K, self.N)):
                want = (E, -(-rows // 128), -(-cols // 128))
                if w.dtype != torch.float8_e4m3fn or s is None or tuple(s.shape) != want:
                    raise ValueError(f"fp8_block: {name} must be float8_e4m3fn with {name}_scale {list(want)} fp32")
        self.w1_scale, self.w2_scale = w1_scale, w2_scale
        self.expert_map = expert_map
        self.global_num_experts = (global_num_experts or expert_map.numel()) if expert_map is not None else E
        if (w1_bias is not None or w2_bias is not None) and "HAS_BIAS" not in self.params:
            raise ValueError("this fused_moe_kernel has no bias support (no HAS_BIAS parameter)")

        self.dtype_str = "fp8_w8a8" if self.fp8 else "bf16"
        self.device_name = device_name or device_file_name()
        self.config_source = "given"
        if config is None:
            cdir = configs_dir if configs_dir is not None else Path(DEFAULT_DEPS) / "configs"
            config = shipped_config(cdir, E, self.N, self.device_name, self.dtype_str, self.block_shape)
            self.config_source = (str(_resolve(cdir) / config_file_name(E, self.N, self.device_name, self.dtype_str,
                                                                       self.block_shape))
                                  if config is not None else "default_config")
        self.table = None if config is None else ({0: config} if "BLOCK_SIZE_M" in config else config)
        self.naive, self.swap_ab = naive, swap_ab
        self.hopper = w1.is_cuda and torch.cuda.get_device_capability(w1.device) == (9, 0)
        self.act_quant = act_quant
        self.dtype = dtype = dtype or (torch.bfloat16 if self.fp8 else w1.dtype)
        self.quantizer, self.act_quant_impl = _activation_quantizer(w1.is_cuda and act_quant != "torch")

        device = w1.device
        slots = max_tokens * topk
        self.cache13 = torch.empty(slots * max(2 * self.N, K), dtype=dtype, device=device)
        self.cache2 = torch.empty(slots, self.N, dtype=dtype, device=device)
        self.out = torch.empty(max_tokens, K, dtype=dtype, device=device)
        self.act = (torch.ops.moe_ext.silu_and_mul if activation == "silu" else
                    lambda o, i: torch.ops.moe_ext.swigluoai_and_mul(o, i, self.alpha, self.limit))

    # -- host-side choices (from shapes only) ---------------------------------------------------------------

    def config_for_tokens(self, M: int) -> dict:
        """The config vLLM would launch both GEMMs with for ``M`` tokens."""
        if self.table is not None:
            return config_for(self.table, M)
        return default_config(M, self.E, self.N, self.K, self.topk, self.dtype_str, self.block_shape)

    def _use_naive(self, M: int) -> bool:
        if "naive_block_assignment" not in self.params:
            return False
        if self.naive != "auto":
            return bool(self.naive)
        return self.expert_map is None and M * self.topk * 4 <= self.global_num_experts

    def _use_swap_ab(self, cfg: dict) -> bool:
        if "SWAP_AB" not in self.params:
            return False
        if self.swap_ab != "auto":
            return bool(self.swap_ab)
        return self.fp8 and self.hopper and cfg["BLOCK_SIZE_M"] < 64 and cfg["BLOCK_SIZE_N"] >= 64

    # -- pieces ----------------------------------------------------------------------------------------------

    def _route(self, topk_ids: torch.Tensor, cfg: dict) -> SimpleNamespace:
        bm = cfg["BLOCK_SIZE_M"]
        if self._use_naive(topk_ids.size(0)):
            post = torch.full((1,), topk_ids.numel() * bm, dtype=torch.int32, device=topk_ids.device)
            return SimpleNamespace(sorted_ids=None, expert_ids=topk_ids.reshape(-1), post=post)
        sorted_ids, expert_ids, post = align_block_size(topk_ids, bm, self.global_num_experts, self.expert_map,
                                                        ignore_invalid_experts=True)
        return SimpleNamespace(sorted_ids=sorted_ids, expert_ids=expert_ids, post=post)

    def _quantize(self, a: torch.Tensor):
        if not self.fp8:
            return a, None
        return self.quantizer(a)

    def _buffers(self, M: int):
        slots = M * self.topk
        cache1 = self.cache13[: slots * 2 * self.N].view(M, self.topk, 2 * self.N)
        cache3 = self.cache13[: slots * self.K].view(M, self.topk, self.K)
        return cache1, self.cache2[:slots], cache3, self.out[:M]

    def _gemm(self, A, B, C, A_scale, B_scale, bias, topk_weights, route, mul_routed_weight, top_k, cfg):
        """One ``fused_moe_kernel`` launch, arguments by keyword as vLLM's launcher computes them."""
        bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
        bk = cfg["BLOCK_SIZE_K"] if self.block_shape is None else min(cfg["BLOCK_SIZE_K"], min(self.block_shape))
        rows = A.size(0)
        if route.sorted_ids is not None:
            em = route.sorted_ids.size(0)
            if rows < bm:
                em = min(em, rows * top_k * bm)
        else:
            em = rows * top_k * bm
        grid = (triton.cdiv(em, bm) * triton.cdiv(B.size(1), bn),)
        two_d_scale = A_scale is not None and A_scale.dim() == 2
        args = dict(
            a_ptr=A, b_ptr=B, c_ptr=C, b_bias_ptr=bias, a_scale_ptr=A_scale, b_scale_ptr=B_scale,
            topk_weights_ptr=topk_weights, sorted_token_ids_ptr=route.sorted_ids, expert_ids_ptr=route.expert_ids,
            num_tokens_post_padded_ptr=route.post,
            N=B.size(1), K=B.size(2), EM=em, num_valid_tokens=rows * top_k,
            stride_am=A.stride(0), stride_ak=A.stride(1),
            stride_be=B.stride(0), stride_bk=B.stride(2), stride_bn=B.stride(1),
            stride_cm=C.stride(1), stride_cn=C.stride(2),
            stride_asm=A_scale.stride(0) if two_d_scale else 0, stride_ask=A_scale.stride(1) if two_d_scale else 0,
            stride_bse=B_scale.stride(0) if B_scale is not None else 0,
            stride_bsk=B_scale.stride(2) if B_scale is not None and B_scale.dim() == 3 else 0,
            stride_bsn=B_scale.stride(1) if B_scale is not None and B_scale.dim() >= 2 and B_scale.size(1) > 1
            else 0,
            stride_bbe=bias.stride(0) if bias is not None else 0,
            stride_bbn=bias.stride(1) if bias is not None else 0,
            group_n=self.block_shape[0] if self.block_shape else 0,
            group_k=self.block_shape[1] if self.block_shape else 0,
            naive_block_assignment=route.sorted_ids is None,
            BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=cfg["GROUP_SIZE_M"], SPLIT_K=1,
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=_compute_type(C.dtype),
            use_fp8_w8a8=self.fp8, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            HAS_BIAS=bias is not None, SWAP_AB=self._use_swap_ab(cfg), USE_TD=False,
        )
        kwargs = _fit_signature(self.params, args)
        kwargs.update({k: cfg[k] for k in LAUNCH_OPTIONS if k in cfg})
        self.fn[grid](**kwargs)

    def _gemm1(self, a1, a1_scale, topk_weights, route, cache1, cfg):
        self._gemm(a1, self.w1, cache1, a1_scale, self.w1_scale, self.w1_bias, topk_weights, route,
                   self.on_input, self.topk, cfg)

    def _gemm2(self, a2, a2_scale, topk_weights, route, cache3, cfg):
        self._gemm(a2, self.w2, cache3, a2_scale, self.w2_scale, self.w2_bias, topk_weights, route,
                   not self.on_input, 1, cfg)

    def _check(self, x, topk_weights, topk_ids):
        M = x.size(0)
        if M > self.max_tokens:
            raise ValueError(f"{M} tokens > max_tokens {self.max_tokens}")
        if not x.is_contiguous() or x.size(1) != self.K or x.dtype != self.dtype:
            raise ValueError(f"hidden_states must be contiguous [M, {self.K}] {self.dtype} (the buffers' dtype), "
                             f"got {list(x.shape)} {x.dtype}")
        if tuple(topk_ids.shape) != (M, self.topk) or tuple(topk_weights.shape) != (M, self.topk):
            raise ValueError(f"topk_ids/topk_weights must be [{M}, {self.topk}]")
        if not topk_weights.is_contiguous():
            raise ValueError("topk_weights must be contiguous (the kernel indexes it by flat slot)")
        return M

    # -- timing entry points ---------------------------------------------------------------------------------

    def full(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The whole layer: ``out [M, K]`` (a view of a buffer that the next call overwrites)."""
        M = self._check(hidden_states, topk_weights, topk_ids)
        cfg = self.config_for_tokens(M)
        cache1, cache2, cache3, out = self._buffers(M)
        route = self._route(topk_ids, cfg)
        a1, a1_scale = self._quantize(hidden_states)
        self._gemm1(a1, a1_scale, topk_weights, route, cache1, cfg)
        self.act(cache2, cache1.view(-1, 2 * self.N))
        a2, a2_scale = self._quantize(cache2)
        if self.expert_map is not None:
            cache3.zero_()
        self._gemm2(a2, a2_scale, topk_weights, route, cache3, cfg)
        torch.ops.moe_ext.moe_sum(cache3, out)
        return out

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> SimpleNamespace:
        """Everything ``gemms_only`` reads: the config, the routing, GEMM1's (quantized) input and GEMM2's input
        (computed once here by GEMM1 + activation, so that GEMM2 runs on real data)."""
        M = self._check(hidden_states, topk_weights, topk_ids)
        cfg = self.config_for_tokens(M)
        cache1, cache2, cache3, _ = self._buffers(M)
        route = self._route(topk_ids, cfg)
        a1, a1_scale = self._quantize(hidden_states)
        self._gemm1(a1, a1_scale, topk_weights, route, cache1, cfg)
        a2 = torch.empty_like(cache2)
        self.act(a2, cache1.view(-1, 2 * self.N))
        a2, a2_scale = self._quantize(a2)
        return SimpleNamespace(M=M, cfg=cfg, route=route, a1=a1, a1_scale=a1_scale, a2=a2, a2_scale=a2_scale,
                               topk_weights=topk_weights)

    def gemms_only(self, p: SimpleNamespace) -> torch.Tensor:
        """The two ``fused_moe_kernel`` launches alone on ``prepare``'s inputs; returns ``cache3 [M, topk, K]``
        (with an expert_map, slots of non-local experts are left unwritten: ``full`` zeroes them first)."""
        cache1, _, cache3, _ = self._buffers(p.M)
        self._gemm1(p.a1, p.a1_scale, p.topk_weights, p.route, cache1, p.cfg)
        self._gemm2(p.a2, p.a2_scale, p.topk_weights, p.route, cache3, p.cfg)
        return cache3


def _activation_quantizer(on_gpu: bool):
    """``(fn, name)``: ``x [rows, cols] -> (q e4m3fn, s fp32 [rows, ceil(cols / 128)])``. On the GPU our one-launch
    Triton quantizer, else the plain-torch one (same values)."""
    if on_gpu:
        from moe_extension.kernels._quantize_fp8 import quantize_fp8_rows

        return quantize_fp8_rows, "moe_extension.kernels._quantize_fp8.quantize_fp8_rows"
    from moe_extension.quant import quantize_fp8_per_token_group

    return quantize_fp8_per_token_group, "moe_extension.quant.quantize_fp8_per_token_group"


def _fit_signature(params, args: dict) -> dict:
    """``args`` restricted to the kernel's parameters. A parameter we do not know must have a default; one we
    pass that the kernel lacks must hold its neutral value (the feature is off), else the call is refused."""
    unknown = [n for n, p in params.items() if n not in args and p.default is inspect.Parameter.empty]
    if unknown:
        raise TypeError(f"fused_moe_kernel wants arguments this harness does not know: {unknown}")
    missing = [n for n in args if n not in params and not (n in NEUTRAL and _same(args[n], NEUTRAL[n]))]
    if missing:
        raise TypeError(f"fused_moe_kernel lacks parameters this launch needs: {missing}")
    return {n: v for n, v in args.items() if n in params}


def _same(a, b) -> bool:
    return a is b if a is None or b is None else (not isinstance(a, torch.Tensor) and a == b)


__all__ = ["KERNEL_VERSION", "VllmFusedMoE", "align_block_size", "config_file_name", "config_for", "default_config",
           "device_file_name", "load", "shipped_config"]
