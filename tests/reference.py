"""Independent fp64 references for the routed-expert ops, written from the semantics in docs/ops.md as a plain loop
over tokens and slots (no grouping, nothing shared with the implementation under test).

- ``topk_softmax_reference(gating_output, topk, renormalize=False)`` -> ``(weights fp64 [M, topk],
  ids int64 [M, topk])``.
- ``grouped_topk_reference(gating_output, topk, renormalize=False, *, <the grouped_topk keywords>)`` -> the same.
- ``fused_experts_reference(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, <the
  fused_experts keywords>, return_bound=False)`` -> ``out fp64 [M, K]`` (``backend`` is accepted and ignored).
- ``expert_gemm1_reference`` / ``expert_gemm2_reference`` (the expert_gemm1/2 keywords) -> fp64
  ``[M, topk, 2N]`` / ``[M, topk, K]``, invalid slots 0.
- ``activation_reference(h, activation, alpha, limit)``: the five gated activations in fp64.
- ``lora_reference(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None)``
  -> fp64 ``[M, topk, n]``: ``out + g B[l, e] (A[l, e] x)`` on the active pairs, ``out`` elsewhere (add_lora).
- Test helpers: ``random_experts`` / ``random_routing`` / ``random_expert_map`` (inputs in each storage
  format, invalid ids planted), ``tolerance``, ``assert_close``, ``opcheck_utils``.

Quantized formats: the weights are decoded here from the storage layout (fp8 block scales, packed e2m1 +
E8M0). GEMM inputs are quantized as the spec says, from their fp32 value: fp8_block per row per 128
columns (``s = max(amax, 1e-10) / 448`` in fp32, ``q = e4m3fn(clamp(x / s, +-448))``), mxfp4 rounded to bf16;
with ``apply_router_weight_on_input`` the quantized value is the fp32 product ``g * x``.

The second GEMM's input is computed (fp64 here, fp32 in an implementation), so an element lying within
rounding noise of a quantization boundary may legitimately round the other way. ``return_bound=True``
also returns ``bound fp64 [M, K]``: an upper bound on ``|out - reference|`` from such near-ties (elements
within ``NEAR_TIE`` of the row scale from a boundary may round either way; each contributes one
quantization step times ``|W2[e][:, i]|``). Compare with ``rel_err(out, ref) <= tol + ||bound|| / ||ref||``.
"""

from __future__ import annotations

import math

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX = 448.0
NEAR_TIE = 2e-6


# ---------------------------------------------------------------------------------------------- routing


def topk_softmax_reference(gating_output: torch.Tensor, topk: int, renormalize: bool = False):
    logits = gating_output.detach().double().cpu().tolist()
    weights, ids = [], []
    for row in logits:
        if renormalize:
            chosen = sorted(range(len(row)), key=lambda i: (-row[i], i))[:topk]
            top = max(row[i] for i in chosen)
            exps = [math.exp(row[i] - top) for i in chosen]
            weights.append([v / sum(exps) for v in exps])
        else:
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            probs = [v / sum(exps) for v in exps]
            chosen = sorted(range(len(row)), key=lambda i: (-probs[i], i))[:topk]
            weights.append([probs[i] for i in chosen])
        ids.append(chosen)
    m = len(logits)
    return (
        torch.tensor(weights, dtype=torch.float64).reshape(m, topk),
        torch.tensor(ids, dtype=torch.int64).reshape(m, topk),
    )


def grouped_topk_reference(gating_output: torch.Tensor, topk: int, renormalize: bool = False, *,
                           num_expert_group: int = 1, topk_group: int = 1, scoring_func: str = "softmax",
                           e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0):
    """DeepSeek routing, per token: scores s (softmax over E or elementwise sigmoid), choice scores c = s + bias
    (c = s without one); G contiguous groups, a group scored by the sum of its two largest c with a bias, else
    its largest c; the topk_group best groups kept (ties: lower group); the topk largest c among their experts
    (ties: lower id); weights = s of those, divided by their sum with renormalize, times the scaling factor."""
    logits = gating_output.detach().double().cpu().tolist()
    bias = None if e_score_correction_bias is None else e_score_correction_bias.detach().double().cpu().tolist()
    weights, ids = [], []
    for row in logits:
        if scoring_func == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            total = sum(exps)
            scores = [v / total for v in exps]
        elif scoring_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v)) for v in row]
        else:
            raise ValueError(f"unknown scoring_func {scoring_func!r}")
        choice = scores if bias is None else [v + b for v, b in zip(scores, bias)]
        size = len(row) // num_expert_group
        members = [list(range(grp * size, (grp + 1) * size)) for grp in range(num_expert_group)]
        group_scores = []
        for grp in range(num_expert_group):
            best = sorted((choice[i] for i in members[grp]), reverse=True)
            group_scores.append(best[0] + best[1] if bias is not None else best[0])
        kept = sorted(range(num_expert_group), key=lambda grp: (-group_scores[grp], grp))[:topk_group]
        candidates = [i for grp in kept for i in members[grp]]
        chosen = sorted(candidates, key=lambda i: (-choice[i], i))[:topk]
        picked = [scores[i] for i in chosen]
        if renormalize:
            total = sum(picked)
            picked = [v / total for v in picked]
        weights.append([v * routed_scaling_factor for v in picked])
        ids.append(chosen)
    m = len(logits)
    return (
        torch.tensor(weights, dtype=torch.float64).reshape(m, topk),
        torch.tensor(ids, dtype=torch.int64).reshape(m, topk),
    )


# ---------------------------------------------------------------------------------------------- activations


def activation_reference(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    h = h.double()
    if activation == "swigluoai":
        gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    d = h.shape[-1] // 2
    gate, up = h[..., :d], h[..., d:]
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu":
        return 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))) * up
    if activation == "gelu_tanh":
        return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
    if activation == "swiglustep":
        return (gate * torch.sigmoid(gate)).clamp(max=limit) * up.clamp(-limit, limit)
    raise ValueError(f"unknown activation {activation!r}")


# ---------------------------------------------------------------------------------------------- weights


def _decode_weight(w: torch.Tensor, scale: torch.Tensor | None, quant: str, e: int) -> torch.Tensor:
    """fp64 ``W[e]`` [rows, cols] from the storage layout of ``quant``."""
    if quant == "none":
        return w[e].double()
    if quant == "fp8_block":
        q, s = w[e].double(), scale[e].double()
        out = torch.empty_like(q)
        for rb in range(s.shape[0]):
            for cb in range(s.shape[1]):
                blk = (slice(rb * 128, (rb + 1) * 128), slice(cb * 128, (cb + 1) * 128))
                out[blk] = q[blk] * s[rb, cb]
        return out
    if quant == "mxfp4":
        packed = w[e].long()
        rows, half = packed.shape
        codes = torch.empty(rows, 2 * half, dtype=torch.long)
        codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4
        values = torch.tensor(E2M1, dtype=torch.float64)[codes & 7] * (1 - 2 * (codes >> 3))
        s = scale[e].long()
        factor = torch.where(s == 255, torch.tensor(math.nan, dtype=torch.float64), torch.pow(2.0, (s - 127).double()))
        return values * factor.repeat_interleave(32, dim=1)
    raise ValueError(f"unknown quant {quant!r}")


class _Weights:
    def __init__(self, w, scale, bias, quant):
        self.w, self.scale, self.bias, self.quant, self._cache = w, scale, bias, quant, {}

    def __call__(self, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if e not in self._cache:
            self._cache[e] = _decode_weight(self.w, self.scale, self.quant, e)
        return self._cache[e], None if self.bias is None else self.bias[e].double()


# ---------------------------------------------------------------------------------------------- GEMM inputs


def _quantize_input(v32: torch.Tensor, quant: str, exact: torch.Tensor | None = None):
    """A GEMM input row (fp32 value ``v32``) -> (the fp64 values multiplied, per-element rounding ambiguity).

    ``exact`` is the fp64 value the row approximates; its elements within ``NEAR_TIE * max|exact|`` of a
    rounding boundary get an ambiguity of one quantization step, the others 0."""
    step = torch.zeros(v32.shape, dtype=torch.float64)
    if quant == "none":
        return v32.double() if exact is None else exact, step
    delta = 0.0 if exact is None else NEAR_TIE * float(exact.abs().max())
    if quant == "mxfp4":
        out = v32.to(torch.bfloat16).double()
        if exact is not None:
            hi, lo = (exact + delta).float().to(torch.bfloat16), (exact - delta).float().to(torch.bfloat16)
            step = hi.double() - lo.double()
        return out, step
    out = torch.empty(v32.shape, dtype=torch.float64)
    for start in range(0, v32.shape[0], 128):
        grp = slice(start, start + 128)
        s = torch.clamp(v32[grp].abs().max(), min=1e-10) / FP8_MAX
        q = torch.clamp(v32[grp] / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[grp] = q.double() * s.double()
        if exact is not None:
            hi, lo = ((exact[grp] + sign * delta) / s.double() for sign in (1, -1))
            hi, lo = (torch.clamp(r, -FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn) for r in (hi, lo))
            step[grp] = (hi.double() - lo.double()) * s.double()
    return out, step


def _first_input(x_row: torch.Tensor, g: float | None, quant: str) -> torch.Tensor:
    """x (or g * x) as the first GEMM multiplies it (fp64)."""
    if quant == "none":
        return x_row.double() * (1.0 if g is None else g)
    v32 = x_row.float() if g is None else x_row.float() * torch.tensor(g, dtype=torch.float32)
    return _quantize_input(v32, quant)[0]


def _cpu(*tensors):
    """Inputs may live on any device; the reference runs on the CPU."""
    return [None if t is None else t.detach().cpu() for t in tensors]


def _local_expert(i: int, expert_map: list[int] | None, num_experts: int) -> int | None:
    """The local expert of global id ``i``, or None when the slot is invalid."""
    if expert_map is not None:
        if i < 0 or i >= len(expert_map):
            return None
        i = expert_map[i]
    return i if 0 <= i < num_experts else None


# ---------------------------------------------------------------------------------------------- the ops


def fused_experts_reference(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", *, w1_bias=None,
                            w2_bias=None, expert_map=None, apply_router_weight_on_input=False, quant="none",
                            w1_scale=None, w2_scale=None, alpha=1.702, limit=7.0, backend=None,
                            return_bound=False):
    hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, expert_map, w1_scale, w2_scale = _cpu(
        hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, expert_map, w1_scale, w2_scale
    )
    m, k = hidden_states.shape
    num_experts = w1.shape[0]
    emap = None if expert_map is None else expert_map.tolist()
    ids, gs = topk_ids.tolist(), topk_weights.double().tolist()
    first, second = _Weights(w1, w1_scale, w1_bias, quant), _Weights(w2, w2_scale, w2_bias, quant)
    out = torch.zeros(m, k, dtype=torch.float64)
    bound = torch.zeros(m, k, dtype=torch.float64)
    for t in range(m):
        for j, i in enumerate(ids[t]):
            e = _local_expert(i, emap, num_experts)
            if e is None:
                continue
            g = gs[t][j]
            x = _first_input(hidden_states[t], g if apply_router_weight_on_input else None, quant)
            W1, b1 = first(e)
            h = W1 @ x + (0 if b1 is None else b1)
            a_exact = activation_reference(h, activation, alpha, limit)
            a, step = _quantize_input(a_exact.float(), quant, exact=a_exact)
            W2, b2 = second(e)
            y = W2 @ a + (0 if b2 is None else b2)
            scale = 1.0 if apply_router_weight_on_input else g
            out[t] += scale * y
            bound[t] += abs(scale) * (W2.abs() @ step)
    return (out, bound) if return_bound else out


def expert_gemm1_reference(hidden_states, w1, topk_ids, *, w1_bias=None, expert_map=None, topk_weights=None,
                           quant="none", w1_scale=None):
    hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, w1_scale = _cpu(
        hidden_states, w1, topk_ids, w1_bias, expert_map, topk_weights, w1_scale
    )
    m, topk = topk_ids.shape
    emap = None if expert_map is None else expert_map.tolist()
    weights = _Weights(w1, w1_scale, w1_bias, quant)
    out = torch.zeros(m, topk, w1.shape[1], dtype=torch.float64)
    for t in range(m):
        for j, i in enumerate(topk_ids[t].tolist()):
            e = _local_expert(i, emap, w1.shape[0])
            if e is None:
                continue
            g = None if topk_weights is None else float(topk_weights[t, j])
            W, b = weights(e)
            out[t, j] = W @ _first_input(hidden_states[t], g, quant) + (0 if b is None else b)
    return out


def expert_gemm2_reference(intermediate, w2, topk_ids, *, w2_bias=None, expert_map=None, topk_weights=None,
                           quant="none", w2_scale=None):
    intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, w2_scale = _cpu(
        intermediate, w2, topk_ids, w2_bias, expert_map, topk_weights, w2_scale
    )
    m, topk = topk_ids.shape
    emap = None if expert_map is None else expert_map.tolist()
    weights = _Weights(w2, w2_scale, w2_bias, quant)
    out = torch.zeros(m, topk, w2.shape[1], dtype=torch.float64)
    for t in range(m):
        for j, i in enumerate(topk_ids[t].tolist()):
            e = _local_expert(i, emap, w2.shape[0])
            if e is None:
                continue
            a = _quantize_input(intermediate[t, j].float(), quant)[0]
            W, b = weights(e)
            y = W @ a + (0 if b is None else b)
            out[t, j] = y if topk_weights is None else float(topk_weights[t, j]) * y
    return out


# ---------------------------------------------------------------------------------------------- random inputs

def lora_reference(out, x, lora_a, lora_b, topk_ids, token_lora_mapping, *, expert_map=None, topk_weights=None):
    """``moe_ext::add_lora`` in fp64 (moe_extension/ops/lora.py's docstring): a pair is active when its slot is
    valid and its token's adapter is in [0, L); x is [M, K] (per token) or [M, topk, K] (per slot)."""
    out, x, lora_a, lora_b, topk_ids, mapping, expert_map, topk_weights = _cpu(
        out, x, lora_a, lora_b, topk_ids, token_lora_mapping, expert_map, topk_weights)
    L, E = lora_a.shape[:2]
    emap = None if expert_map is None else expert_map.tolist()
    ref = out.double().clone()
    for t, (row, adapter) in enumerate(zip(topk_ids.tolist(), mapping.tolist())):
        for j, i in enumerate(row):
            e = _local_expert(i, emap, E)
            if e is None or not 0 <= adapter < L:
                continue
            xin = (x[t] if x.dim() == 2 else x[t, j]).double()
            delta = lora_b[adapter, e].double() @ (lora_a[adapter, e].double() @ xin)
            ref[t, j] += delta * (1.0 if topk_weights is None else float(topk_weights[t, j]))
    return ref


INVALID_IDS = (-1, None, 2**31 - 1)  # None stands for E_global (one past the last expert)


def random_experts(num_experts: int, k: int, n: int, quant: str = "none", dtype=torch.float32, device="cpu",
                   bias: bool = False, transposed: bool = False) -> dict:
    """Random expert weights as the ops take them: ``{"w1", "w2", "w1_scale", "w2_scale", "w1_bias",
    "w2_bias"}`` (absent ones None), ``w1`` logically ``[E, 2N, K]``, ``w2`` ``[E, K, N]`` in the storage
    layout of ``quant`` (fp8: e4m3fn + block scales; mxfp4: packed uint8 + E8M0). ``transposed`` hands the
    weights as transposed views of ``[E, cols, rows]`` storage (the OAI path's layout)."""
    from moe_extension.quant import quantize_fp8_block, quantize_mxfp4

    w1 = torch.randn(num_experts, 2 * n, k) / math.sqrt(k)
    w2 = torch.randn(num_experts, k, n) / math.sqrt(n)
    scales = (None, None)
    if quant == "fp8_block":
        (w1, s1), (w2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
        scales = (s1, s2)
    elif quant == "mxfp4":
        (w1, s1), (w2, s2) = quantize_mxfp4(w1), quantize_mxfp4(w2)
        scales = (s1, s2)
    else:
        w1, w2 = w1.to(dtype), w2.to(dtype)
    if transposed:
        w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    out = {"w1": w1, "w2": w2, "w1_scale": scales[0], "w2_scale": scales[1], "w1_bias": None, "w2_bias": None}
    if bias:
        out["w1_bias"] = torch.randn(num_experts, 2 * n) * 0.5
        out["w2_bias"] = torch.randn(num_experts, k) * 0.5
    return {name: None if t is None else t.to(device) for name, t in out.items()}


def random_routing(m: int, num_ids: int, topk: int, *, invalid: float = 0.15, id_dtype=torch.int32, device="cpu"):
    """``(topk_weights fp32 [M, topk], topk_ids [M, topk])``: ids uniform in [0, num_ids) (repeats allowed),
    a fraction ``invalid`` of them replaced by -1, num_ids or 2^31 - 1."""
    ids = torch.randint(0, num_ids, (m, topk), dtype=torch.int64)
    choice = torch.randint(0, len(INVALID_IDS), (m, topk))
    bad = torch.tensor([num_ids if v is None else v for v in INVALID_IDS])[choice]
    ids = torch.where(torch.rand(m, topk) < invalid, bad, ids)
    weights = torch.rand(m, topk, dtype=torch.float32) + 0.05
    return weights.to(device), ids.to(id_dtype).to(device)


def random_expert_map(num_global: int, num_local: int, device="cpu") -> torch.Tensor:
    """int32 [E_global]: ``num_local`` randomly chosen global ids map to the local ids 0..E-1 (shuffled), the
    rest to -1."""
    emap = torch.full((num_global,), -1, dtype=torch.int32)
    emap[torch.randperm(num_global)[:num_local]] = torch.randperm(num_local, dtype=torch.int32)
    return emap.to(device)


def tolerance(dtype: torch.dtype, device="cpu", quant: str = "none") -> float:
    """rel_err tolerance against the fp64 reference: one rounding of the output (fp16/bf16); in fp32, the
    Triton kernels (CUDA, quant none) may use TF32 GEMMs, and their fp8 block products (CUDA) are summed by
    the tensor cores, whose fp8 MMA keeps fewer bits than fp32 within each 128-column block (1.1e-4 to 1.2e-4
    measured on the H100 in tests/test_expert_gemm.py's M = 1 cases, hence 1e-3); the PyTorch implementation
    (CPU, or any device for the other quantized formats) is fp32 throughout."""
    if dtype == torch.float32:
        if torch.device(device).type == "cuda" and quant in ("none", "fp8_block"):
            return 5e-3 if quant == "none" else 1e-3
        return 1e-5
    return 2e-3 if dtype == torch.float16 else 1e-2


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, bound: torch.Tensor | None = None) -> None:
    """``rel_err(out, ref) <= tol`` (+ ``||bound|| / ||ref||`` for the near-tie bound of the reference)."""
    from tests.utils import rel_err

    allowed = tol
    if bound is not None and ref.norm() > 0:
        allowed += float(bound.norm() / ref.double().norm())
    err = rel_err(out.cpu(), ref)
    assert err <= allowed, f"rel_err {err:.3e} > allowed {allowed:.3e}"


def opcheck_utils(quant: str) -> tuple[str, ...]:
    """The opcheck tests to run for ``quant``: all four, but test_schema cannot take float8 inputs (its
    SchemaCheckMode compares every input before/after with allclose, which float8 does not implement)."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return utils[1:] if quant == "fp8_block" else utils
