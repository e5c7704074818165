"""``python -m moe_extension``: check the build and run a MoE layer against its reference and the roofline.

1. Prints the build (``WITH_CUDA``, ``CUDA_ARCHS``), torch/triton versions and the device.
2. Runs each native op (``moe_sum`` and the five gated activations) once on the device against its
   PyTorch reference: OK, or FAIL with the error.
3. Builds a MoE layer of the chosen model's shape (random weights, router linear in fp32; full size on a
   GPU, scaled down on a CPU unless sizes are given), runs it through ``torch.ops.moe_ext.fused_moe``
   eagerly and ``torch.compile``'d, checks every result against the PyTorch reference (``backend="torch"``
   in fp32; MXFP4 weights dequantized exactly, fp8 weights kept with fp32 activations), and prints a
   table: time, achieved bandwidth and FLOP rate, and the ratio to the device floor (measured copy
   bandwidth and matmul rate, see ``moe_extension._roofline``).

The exit code is 1 when any check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback

import torch

import moe_extension
from moe_extension import _roofline, ops
from moe_extension.quant import dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma

# (experts, topk, hidden K, intermediate N, activation, biases)
MODELS = {
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai", True),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swigluoai", True),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", False),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu", False),
}
CPU_LIMITS = {"experts": 32, "hidden": 512, "intermediate": 512}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# rel_err bound of the layer output against the fp32 reference, per quant scheme and output dtype.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 2e-2}
FP8_TOLERANCE = 6e-2


def say(msg: str = "") -> None:
    print(msg, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m moe_extension",
        description="Check the build: run each native op against its reference, then a MoE layer through "
        "fused_moe (eager and torch.compile'd) against the fp32 PyTorch reference, with a table of time, "
        "achieved GB/s and TFLOP/s and the ratio to the device's floor (max of bytes / measured copy bandwidth "
        "and FLOPs / measured matmul rate). Exit code 1 if any check fails.",
    )
    p.add_argument("--model", choices=[*MODELS, "custom"], default="gpt-oss-120b",
                   help="layer shape to run (default gpt-oss-120b). On a CPU the shape is scaled down to at most "
                   f"{CPU_LIMITS['experts']} experts and K, N <= {CPU_LIMITS['hidden']}, except for sizes given "
                   "explicitly. 'custom' needs --experts, --topk, --hidden and --intermediate.")
    p.add_argument("--experts", type=int, help="number of experts E (overrides the model's)")
    p.add_argument("--topk", type=int, help="experts per token (overrides the model's)")
    p.add_argument("--hidden", type=int, help="hidden size K (overrides the model's)")
    p.add_argument("--intermediate", type=int, help="intermediate size N per expert (overrides the model's)")
    p.add_argument("--activation", choices=list(ops.ACTIVATIONS), help="gated activation (default: the model's)")
    p.add_argument("--tokens", default="1,16,64", help="comma-separated token counts M to run (default 1,16,64)")
    p.add_argument("--quant", choices=["none", "fp8_block", "mxfp4", "mxfp4_mma"], default="none",
                   help="weight format: none (weights in --dtype), fp8_block (e4m3fn, 128x128 block scales), "
                   "mxfp4 (e2m1 + E8M0 per 32; needs --dtype bf16), mxfp4_mma (the same weights prepared for the "
                   "tensor cores with prepare_mxfp4_mma; hidden and intermediate sizes multiples of 64). Default none.")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="activation dtype (default bf16)")
    p.add_argument("--device", help="cpu or cuda (default cuda when available)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd path")
    p.add_argument("--repeat", type=int, help="timed calls per case, median reported (default 20 on GPU, 3 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens needs at least one count, each >= 1")
    explicit = {k: getattr(args, k) for k in ("experts", "topk", "hidden", "intermediate")}
    for key, value in explicit.items():
        if value is not None and value < 1:
            p.error(f"--{key} must be >= 1, got {value}")
    if args.model == "custom" and None in explicit.values():
        p.error("--model custom needs --experts, --topk, --hidden and --intermediate")
    if args.quant.startswith("mxfp4") and args.dtype != "bf16":
        p.error(f"--quant {args.quant} runs with bf16 activations: use --dtype bf16")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    if args.repeat is None:
        args.repeat = 20 if args.device.type == "cuda" else 3
    base = MODELS.get(args.model, (None, None, None, None, "swigluoai", True))
    scaled = args.device.type == "cpu" and args.model != "custom"
    sizes = {}
    for i, key in enumerate(("experts", "topk", "hidden", "intermediate")):
        value = explicit[key] if explicit[key] is not None else base[i]
        if explicit[key] is None and scaled and key in CPU_LIMITS:
            value = min(value, CPU_LIMITS[key])
        sizes[key] = value
    if sizes["topk"] > sizes["experts"]:
        p.error(f"topk ({sizes['topk']}) must be <= the number of experts ({sizes['experts']})")
    group = {"mxfp4": 32, "mxfp4_mma": 64}.get(args.quant)
    if group and (sizes["hidden"] % group or sizes["intermediate"] % group):
        p.error(f"--quant {args.quant} needs hidden and intermediate sizes divisible by {group}")
    args.sizes = sizes
    args.activation = args.activation or base[4]
    args.bias = base[5]
    return args


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def check_native_ops(device: torch.device) -> int:
    """Run moe_sum and the activations once against their references; return the number of failures."""
    say("native ops (fp32, against the PyTorch references):")
    g = torch.Generator(device="cpu").manual_seed(1)
    failures = 0

    def report(name: str, run) -> None:
        nonlocal failures
        try:
            err = run()
            ok = err <= 1e-5
        except Exception as exc:  # noqa: BLE001  (any failure is reported, then the job goes on)
            ok, err = False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        detail = f"rel err {err:.1e}" if isinstance(err, float) else err
        say(f"  {name:<20} {'OK' if ok else 'FAIL'}  ({detail})")

    def run_moe_sum() -> float:
        inp = torch.randn(7, 3, 96, generator=g).to(device)
        ids = torch.randint(-1, 5, (7, 3), generator=g, dtype=torch.int32).to(device)
        out = torch.full((7, 96), float("nan"), device=device)
        torch.ops.moe_ext.moe_sum(inp, out, ids, None)
        return rel_err(out, ops.moe_sum_torch(inp, ids))

    report("moe_sum", run_moe_sum)
    for act in ops.ACTIVATIONS:
        def run_act(act: str = act) -> float:
            x = (4 * torch.randn(9, 2 * 80, generator=g)).to(device)  # x4: past the limit-7 clamps
            out = torch.full((9, 80), float("nan"), device=device)
            getattr(torch.ops.moe_ext, f"{act}_and_mul")(out, x)
            return rel_err(out, ops.activation_torch(x, act))

        report(f"{act}_and_mul", run_act)
    return failures


def make_layer(args: argparse.Namespace) -> dict:
    """Random gpt-oss-style weights in the ops' layout, plus the fp32 reference weights."""
    s, device, dtype = args.sizes, args.device, DTYPES[args.dtype]
    E, K, N = s["experts"], s["hidden"], s["intermediate"]
    g = torch.Generator(device=device).manual_seed(args.seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale

    w1 = randn(E, 2 * N, K, scale=K**-0.5)
    w2 = randn(E, K, N, scale=N**-0.5)
    layer = {
        "w1_bias": randn(E, 2 * N, scale=0.1) if args.bias else None,
        "w2_bias": randn(E, K, scale=0.1) if args.bias else None,
        "router": randn(E, K, scale=K**-0.5),
    }
    if args.quant == "none":
        layer.update(w1=w1.to(dtype), w2=w2.to(dtype), w1_scale=None, w2_scale=None)
        # The fp32 buffers become the reference weights: the same values as the layer's, no third copy.
        layer.update(ref_w1=w1.copy_(layer["w1"]), ref_w2=w2.copy_(layer["w2"]), ref_quant="none")
    elif args.quant == "fp8_block":
        (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
        layer.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2, ref_w1=q1, ref_w2=q2, ref_quant="fp8_block")
    else:
        (q1, s1), (q2, s2) = quantize_mxfp4(w1), quantize_mxfp4(w2)
        layer.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2, ref_quant="none")
        layer.update(ref_w1=dequantize_mxfp4(q1, s1), ref_w2=dequantize_mxfp4(q2, s2))
        if args.quant == "mxfp4_mma":
            (q1, s1), (q2, s2) = prepare_mxfp4_mma(q1, s1), prepare_mxfp4_mma(q2, s2)
            layer.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2)
    del w1, w2
    layer["weight_bytes"] = sum(
        t.numel() * t.element_size()
        for t in (layer[k] for k in ("w1", "w2", "w1_scale", "w2_scale", "w1_bias", "w2_bias"))
        if t is not None
    )
    return layer


def run_layer(args: argparse.Namespace, bandwidth: float, rate: float) -> int:
    """Time fused_moe eager (and compiled) per token count, check against the reference; print the table."""
    s, device, dtype = args.sizes, args.device, DTYPES[args.dtype]
    E, topk, K, N = s["experts"], s["topk"], s["hidden"], s["intermediate"]
    say(f"MoE layer: {args.model}  E={E} topk={topk} K={K} N={N} activation={args.activation} "
        f"quant={args.quant} dtype={args.dtype} bias={args.bias}  tokens={args.tokens}")
    layer = make_layer(args)
    kwargs = dict(w1_bias=layer["w1_bias"], w2_bias=layer["w2_bias"], quant=args.quant,
                  w1_scale=layer["w1_scale"], w2_scale=layer["w2_scale"])

    def eager(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return torch.ops.moe_ext.fused_moe(x, layer["w1"], layer["w2"], logits, topk, True, args.activation, **kwargs)

    paths = [("fused_moe eager", eager)]
    if not args.no_compile:
        paths.append(("fused_moe compiled", torch.compile(eager, fullgraph=True, dynamic=True)))
    tol = FP8_TOLERANCE if args.quant == "fp8_block" else TOLERANCE[args.dtype]
    rows, failures = [], 0
    step, total = 0, len(args.tokens) * len(paths)
    for M in args.tokens:
        g = torch.Generator(device=device).manual_seed(args.seed + M)
        x = torch.randn(M, K, generator=g, device=device).to(dtype)
        logits = x.float() @ layer["router"].t()
        ref = torch.ops.moe_ext.fused_moe(
            x.float(), layer["ref_w1"], layer["ref_w2"], logits, topk, True, args.activation,
            w1_bias=layer["w1_bias"], w2_bias=layer["w2_bias"], quant=layer["ref_quant"],
            w1_scale=layer["w1_scale"] if layer["ref_quant"] != "none" else None,
            w2_scale=layer["w2_scale"] if layer["ref_quant"] != "none" else None, backend="torch",
        )
        _, ids = ops.topk_softmax_torch(logits, topk, True)
        hit = int(torch.unique(ids).numel())
        act_bytes = 2 * M * K * x.element_size() + logits.numel() * logits.element_size()
        nbytes, flops = _roofline.moe_traffic(
            tokens=M, topk=topk, hidden=K, intermediate=N, experts_hit=hit, num_experts=E,
            weight_bytes=layer["weight_bytes"], activation_bytes=act_bytes,
        )
        floor = _roofline.floor_seconds(nbytes, flops, bandwidth, rate)
        for name, fn in paths:
            step += 1
            say(f"[{step}/{total}] {name} M={M} ...")
            t0 = time.perf_counter()
            try:
                out = fn(x, logits)
                err = rel_err(out, ref)
                seconds = _roofline.median_seconds(lambda: fn(x, logits), device, args.repeat)
                ok = err <= tol
                status = "OK" if ok else f"FAIL (rel err > {tol:.0e})"
            except Exception as exc:  # noqa: BLE001  (reported in the table, the job goes on)
                ok, err, seconds = False, float("nan"), float("nan")
                status = f"FAIL ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                traceback.print_exc()
            failures += not ok
            say(f"      done in {time.perf_counter() - t0:.1f} s: rel err {err:.1e} {status}")
            rows.append((name, M, seconds, nbytes, flops, floor, err, status))
    say()
    say(f"{'path':<20} {'M':>5} {'time ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'floor ms':>9} "
        f"{'x floor':>8} {'rel err':>8}  check")
    for name, M, seconds, nbytes, flops, floor, err, status in rows:
        say(f"{name:<20} {M:>5} {seconds * 1e3:>9.4g} {nbytes / seconds / 1e9:>8.3g} "
            f"{flops / seconds / 1e12:>8.3g} {floor * 1e3:>9.4g} {seconds / floor:>8.3g} {err:>8.1e}  {status}")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    say(f"moe_extension {moe_extension.__version__}: WITH_CUDA={moe_extension.WITH_CUDA} "
        f"CUDA_ARCHS={moe_extension.CUDA_ARCHS or '-'}")
    say(f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")
    say(f"device: {args.device} ({device_name(args.device)})")
    failures = check_native_ops(args.device)
    say("device ceilings (measured now): ...")
    bandwidth, rate = _roofline.copy_bandwidth(args.device), _roofline.matmul_rate(args.device)
    kind = "bf16 8192^3" if args.device.type == "cuda" else "fp32 1024^3"
    say(f"  copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), matmul {rate / 1e12:.3f} TFLOP/s ({kind})")
    failures += run_layer(args, bandwidth, rate)
    say()
    say("all checks passed" if failures == 0 else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
