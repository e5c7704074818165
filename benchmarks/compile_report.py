"""Compile the Triton kernels of one ``fused_experts`` call for sm_90 on any machine, no GPU needed, and report what
ptxas says of each: registers, spilled bytes, shared memory, and whether its wgmma instructions run serialized
(ptxas's C7515 "Potential Performance Loss" warning; in the SASS, a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` wait after
each wgmma instead of several in flight), and how many programs of it fit on one SM at once and what bounds that
(``programs_per_sm``: registers, shared memory or warps; a tile bound by its registers below what its shared memory
allows may take a register cap, ``GemmConfig.max_registers``, given by ``--variant``). A GPU session has 30 minutes;
this finds tiles whose code spills or serializes before one starts.

How: a child process runs the call in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, with TMA and
programmatic dependent launch on as on an H100 and every kernel launch recorded instead of run. A second child
compiles each recorded launch with ``JITFunction.warmup`` against a stand-in driver whose target is
``GPUTarget("cuda", 90, 32)``, so that the JIT's own specialization of the arguments (alignment, ints equal to 1)
applies, and runs the ptxas that Triton runs for sm_90 (with ``-v``) and the cuobjdump it ships. The call's config
is the one the ops would pick on ``--device`` for the model's shape (its tuned table, else the heuristic), with
``--variant`` overrides as in ``ab_fused_experts.py``; the weights are ``--experts`` of the model's experts (the
kernels' code does not depend on E), random, in ``--quant``'s format.

Each kernel's row is followed by the instruction mix of one iteration of its tensor-core loop (an innermost backward
branch whose body holds wgmma, else mma.sync; ``loop_mix``) by the pipe the SASS issues to: ``alu`` (the integer /
logic pipe: LOP3, SHF, PRMT, LEA, ISETP, SEL, IADD3, ...; half rate on Hopper), ``fma`` (IMAD and the float FMA /
MUL / ADD of fp32 and bf16x2 / fp16x2), ``mem`` (loads, stores, copies to shared memory, atomics), ``mma`` (wgmma,
mma.sync), ``uniform`` (the warp-uniform datapath) and ``other`` (moves, barriers, branches, waits). Where a k loop
is limited by instruction issue on one pipe (benchmarks/results/ab_decode_pipes_h200.txt: the MXFP4 decode on the
ALU), this is the number a change of the loop moves before any GPU runs it.

The report is of the Triton installed here. For the GPU machine's version: ``pip install --target DIR
triton==3.6.0``, then ``PYTHONPATH=DIR python benchmarks/compile_report.py ...``.

    python benchmarks/compile_report.py --model gpt-oss-120b --quant mxfp4_mma --tokens 4096 \\
        --variant '{"gemm2": {"tail_m": 0}}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
TARGET = ("cuda", 90, 32)
# The routed-expert kernels a report covers (the routing, quantization and slot-sum launches are recorded too, but
# they hold no tensor-core loop).
KERNELS = ("gemm1_sorted_kernel", "gemm2_sorted_kernel", "gemv1_dot_kernel", "gemv2_dot_kernel", "gemv1_kernel",
           "gemv2_kernel", "gemm2_persistent_kernel")


def parse_args(argv=None) -> argparse.Namespace:
    sys.path.insert(0, str(BENCH_DIR))
    from tune_fused_experts import MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, required=True, help="M")
    p.add_argument("--quant", choices=("none", "mxfp4_mma", "fp8_block"), default="none")
    p.add_argument("--variant", default="{}", help="JSON overrides of the config (as ab_fused_experts.py)")
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="whose tuned table picks the config")
    p.add_argument("--experts", type=int, default=8, help="experts held (default: %(default)s)")
    p.add_argument("--shard", action="store_true",
                   help="the experts held are an expert-parallel shard: an expert_map over the model's E, routing "
                        "over all E (the config chosen as the op chooses it for a shard)")
    p.add_argument("--all-kernels", action="store_true", help="also the routing, quantization and slot-sum launches")
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="also write each kernel's Triton GPU IR, PTX and SASS there (KERNEL.ttgir, KERNEL.ptx, "
                        "KERNEL.sass; a kernel launched twice in the call: its last launch)")
    # The two child processes: the interpreter's records the launches, the other compiles them.
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def record_launches(args) -> None:
    """Child process (interpreter): the call's launches -> ``args.record`` (module, kernel name, args, kwargs)."""
    import torch
    import triton.runtime.interpreter as interpreter

    import moe_extension.kernels.fused_experts as fe
    from moe_extension.kernels import _configs
    from moe_extension.quant import quantize_fp8_block, quantize_mxfp4
    from ab_fused_experts import apply
    from moe_extension.quant.mxfp4_mma import prepare_mxfp4_mma
    from tune_fused_experts import MODELS

    d = MODELS[args.model]
    E, topk, K, N, M = d["E"], d["topk"], d["K"], d["N"], args.tokens
    launches = []

    def record(self, *a, grid, warmup, **kw):
        launches.append((self.fn.__module__, self.fn.__name__, a, kw))

    interpreter.InterpretedFunction.run = record
    fe.tma_capable = fe.pdl_capable = fe._ptx = lambda device: True  # as on sm_90
    _configs._device_facts = lambda device: (args.device, 132)
    fe.sm_count = lambda device: 132  # the launches' grids as on the GPU (the direct GEMVs' work lists)
    L = min(max(args.experts, topk), E)
    emap = None
    if args.shard:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[:L] = torch.arange(L, dtype=torch.int32)
        cfg = _configs.get_config(fe.local_tokens(M, L, emap, args.quant, topk=topk), L, N, K, topk, torch.bfloat16,
                                  True, True, torch.device("cpu"), args.quant, fe.local_pairs(M, topk, L, emap))
    else:
        cfg = _configs.get_config(M, E, N, K, topk, torch.bfloat16, True, True, torch.device("cpu"), args.quant)
    cfg = apply(cfg, json.loads(args.variant))
    print(f"config: {cfg}", flush=True)
    gen = torch.Generator().manual_seed(0)
    stacks = [torch.randn(L, r, c, generator=gen) / c**0.5 for r, c in ((2 * N, K), (K, N))]
    kw = {}
    if args.quant == "mxfp4_mma":
        (w1, s1), (w2, s2) = (prepare_mxfp4_mma(*quantize_mxfp4(w)) for w in stacks)
        kw = dict(quant="mxfp4_mma", w1_scale=s1, w2_scale=s2)
    elif args.quant == "fp8_block":
        (w1, s1), (w2, s2) = (quantize_fp8_block(w) for w in stacks)
        kw = dict(quant="fp8_block", w1_scale=s1, w2_scale=s2)
    else:
        w1, w2 = (w.to(torch.bfloat16) for w in stacks)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E if args.shard else L, generator=gen)[:topk] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, topk, generator=gen)
    fe.fused_experts_triton(x, w1, w2, weights, ids, "swigluoai", config=cfg, expert_map=emap, **kw)
    torch.save(launches, args.record)


class _StandInDriver:
    """What ``JITFunction.warmup`` asks of the active driver, for an sm_90 target and no device."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


# SASS opcodes (the part before the first '.') by the pipe they issue to on Hopper, as NVIDIA's instruction throughput
# tables give them (32-bit integer add / compare / logic / shift at half the fp32 rate); VIADD, new with sm_90, is
# counted with the FMA pipe without a measurement saying so. What is not listed counts as "other" (MOV, barriers,
# branches, waits, NOP).
PIPES = {
    "alu": ("LOP3", "LOP", "SHF", "SHL", "SHR", "PRMT", "LEA", "ISETP", "SEL", "FSEL", "IADD3", "IABS", "IMNMX",
            "VIMNMX", "FSETP", "FMNMX", "BMSK", "SGXT", "FLO", "POPC", "BREV", "PLOP3", "P2R", "R2P", "HSETP2",
            "HMNMX2"),
    "fma": ("IMAD", "IMUL", "FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "VIADD"),
    "mem": ("LDG", "LDS", "LDSM", "LD", "LDC", "STG", "STS", "ST", "LDGSTS", "ATOMG", "ATOMS", "ATOM", "RED", "CCTL",
            "UTMALDG", "UBLKCP", "SYNCS"),
    "mma": ("HGMMA", "QGMMA", "IGMMA", "HMMA", "IMMA"),
}
_PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\s*([^;]*);")


# sm_90's limits on the programs resident on one SM (CUDA's occupancy rules): 64 K registers, allocated per warp in
# units of 256; 228 KB of shared memory (``_configs.SM_SHARED_MEMORY``), of which the runtime reserves 1 KB per
# program (``_configs.BLOCK_RESERVED_SHARED_MEMORY``); 64 warps.
SM_REGISTERS, REGISTER_UNIT, SM_WARPS = 65536, 256, 64


def programs_per_sm(registers: int, num_warps: int, shared: int) -> tuple[int, str]:
    """How many programs of a kernel fit on one sm_90 SM at once, and what bounds it: "registers", "shared" or
    "warps", or those of them that bound it equally joined by " and "."""
    from moe_extension.kernels._configs import BLOCK_RESERVED_SHARED_MEMORY, SM_SHARED_MEMORY

    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    limits = {"registers": SM_REGISTERS // (per_warp * num_warps),
              "shared": SM_SHARED_MEMORY // (shared + BLOCK_RESERVED_SHARED_MEMORY),
              "warps": SM_WARPS // num_warps}
    least = min(limits.values())
    return least, " and ".join(name for name, n in limits.items() if n == least)


def pipe_of(opcode: str) -> str:
    """The pipe a SASS opcode (without its modifiers) issues to (``PIPES``)."""
    if opcode in _PIPE_OF:
        return _PIPE_OF[opcode]
    return "uniform" if opcode.startswith("U") and opcode not in ("UTMALDG", "UBLKCP") else "other"


def loop_mix(sass: str) -> dict:
    """Instructions per iteration of the tensor-core loop of a kernel's SASS, by pipe (``pipe_of``) and in all: of
    the loops (a backward ``BRA`` and its target) whose bodies hold tensor-core instructions, the innermost ones (a
    persistent kernel's tile loop holds its k loop), and of those the one with the most wgmma, then the most
    mma.sync (a kernel with tail tiles has a second k loop, whose small tiles may run mma.sync); {} without one."""
    code = [(int(addr, 16), op, rest) for addr, op, rest in _SASS_LINE.findall(sass)]
    loops = []
    for addr, op, rest in code:
        target = re.match(r"(0x[0-9a-f]+)", rest.strip()) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            body = [o for a, o, _ in code if start <= a <= addr]
            if any(pipe_of(o) == "mma" for o in body):
                loops.append((start, addr, body))
    inner = [(s, e, b) for s, e, b in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e)
                                                          for s2, e2, _ in loops)]
    if not inner:
        return {}
    body = max(inner, key=lambda loop: (sum(o.endswith("GMMA") for o in loop[2]),
                                        sum(pipe_of(o) == "mma" for o in loop[2])))[2]
    mix = {pipe: 0 for pipe in (*PIPES, "uniform", "other")}
    for o in body:
        mix[pipe_of(o)] += 1
    return dict(mix, total=len(body))


def sass_facts(ptxas: str, cuobjdump: str, ptx: str, folder: str, dump: str | None = None) -> dict:
    """ptxas -v of one kernel's PTX for sm_90a, and the wgmma waits of its SASS (written as ``dump``.ptx / .sass
    when given)."""
    src, obj = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.o")
    Path(src).write_text(ptx)
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", obj], capture_output=True, text=True).stderr
    sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True).stdout
    if dump:
        Path(dump + ".ptx").write_text(ptx)
        Path(dump + ".sass").write_text(sass)
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None,
            "wgmma_serialized_warning": "C7515" in info,
            "wgmma": len(re.findall(r"\b[HQI]GMMA\.", sass)),
            "wgmma_waits_for_all": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", sass)),
            "loop_mix": loop_mix(sass)}


def compile_launches(record: str, all_kernels: bool, dump: str | None = None) -> list[dict]:
    """Each recorded launch compiled for sm_90 (this process: no interpreter) -> its facts; ``dump``: a folder
    for each kernel's Triton GPU IR, PTX and SASS."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    importlib.import_module("triton.runtime.driver").driver.set_active(_StandInDriver(GPUTarget(*TARGET)))
    # The ptxas that Triton itself runs for sm_90 (its releases ship more than one), and its cuobjdump.
    ptxas, cuobjdump = get_ptxas(TARGET[1]).path, triton.knobs.nvidia.cuobjdump.path
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for module, name, args, kwargs in torch.load(record, weights_only=False):
            if not all_kernels and name not in KERNELS:
                continue
            kernel = getattr(importlib.import_module(module), name)
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            facts = sass_facts(ptxas, cuobjdump, compiled.asm["ptx"], folder,
                               os.path.join(dump, name) if dump else None)
            if dump:
                Path(os.path.join(dump, name + ".ttgir")).write_text(compiled.asm["ttgir"])
            rows.append(dict(kernel=name, num_warps=compiled.metadata.num_warps,
                             num_stages=compiled.metadata.num_stages, shared=compiled.metadata.shared,
                             **{k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (int, bool))},
                             **facts))
    return rows


def _child(argv: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.record:
        record_launches(args)
        return 0
    if args.compile:
        import triton

        print(json.dumps({"triton": triton.__version__}))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
        for row in compile_launches(args.compile, args.all_kernels, args.dump):
            print(json.dumps(row))
        return 0
    argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "launches.pt")
        recorded = _child([*argv, "--record", record], interpret=True)
        compiled = _child([*argv, "--compile", record], interpret=False) if recorded.returncode == 0 else recorded
    if compiled.returncode != 0:
        print(compiled.stdout + compiled.stderr, file=sys.stderr)
        return compiled.returncode
    lines = [json.loads(line) for line in compiled.stdout.splitlines() if line.startswith("{")]
    print(f"triton {lines[0]['triton']}, sm_90; {args.model} M={args.tokens} quant={args.quant}")
    print(recorded.stdout.strip())
    for r in lines[1:]:
        flags = " ".join(f"{k}={v}" for k, v in r.items() if k.isupper() and k in ("BM", "BLOCK_M", "BLOCK_N",
                                                                                  "BLOCK_K", "SPLIT", "TAIL_M"))
        serial = "SERIALIZED" if r["wgmma_serialized_warning"] else "pipelined" if r["wgmma"] else "no wgmma"
        fit = ("{} per SM ({})".format(*programs_per_sm(r["registers"], r["num_warps"], r["shared"]))
               if r["registers"] else "per SM unknown (no register count)")
        print(f"  {r['kernel']:24s} warps {r['num_warps']} stages {r['num_stages']} {flags:40s} registers "
              f"{r['registers']} spills {r['spill_stores']}/{r['spill_loads']} B  shared {r['shared']} B  wgmma "
              f"{r['wgmma']} ({serial}; {r['wgmma_waits_for_all']} waits for all)  {fit}")
        mix = r["loop_mix"]
        if mix:
            print(f"  {'':24s} k loop per iteration: {mix['total']} instructions, " +
                  ", ".join(f"{pipe} {mix[pipe]}" for pipe in (*PIPES, "uniform", "other")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
