"""benchmarks/compile_report.py: the kernels of a fused_experts call compiled for sm_90 without a GPU, with what
ptxas says of each (registers, spills, serialized wgmma) and the instruction mix of its tensor-core loop."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_report  # noqa: E402


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:  # no NVIDIA backend, or no ptxas where Triton looks
        return False


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas for sm_90")
def test_report_of_the_mxfp4_sorted_kernels(tmp_path):
    """gpt-oss-20b with MXFP4 weights in the MMA layout at M = 16 (the sorted schedule): both GEMMs compiled for
    sm_90 with their tensor-core loops (wgmma) and a register count; the config line printed first; ``--dump``
    wrote each kernel's Triton GPU IR, its PTX and its SASS with the wgmma instructions the report counted."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--model", "gpt-oss-20b",
                          "--quant", "mxfp4_mma", "--tokens", "16", "--dump", str(tmp_path)], capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("config: MoeConfig(path='sorted'") for line in lines), out.stdout
    for kernel in ("gemm1_sorted_kernel", "gemm2_sorted_kernel"):
        row = next(line for line in lines if line.strip().startswith(kernel))
        registers = int(row.split("registers ")[1].split()[0])
        wgmma = int(row.split("wgmma ")[1].split()[0])
        assert 0 < registers <= 255 and wgmma > 0, row
        assert ".entry " + kernel in (tmp_path / f"{kernel}.ptx").read_text()
        assert f"tt.func public @{kernel}" in (tmp_path / f"{kernel}.ttgir").read_text()
        assert (tmp_path / f"{kernel}.sass").read_text().count("GMMA.") == wgmma
        mix = lines[lines.index(row) + 1]
        assert "k loop per iteration:" in mix and int(mix.split("mma ")[1].split(",")[0]) > 0, mix
        assert int(mix.split("alu ")[1].split(",")[0]) > 0, "the MXFP4 decode's integer work"
        bound = row.rsplit(" per SM (", 1)[1]
        assert bound.endswith(")") and set(bound[:-1].split(" and ")) <= {"registers", "shared", "warps"}, row


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas for sm_90")
def test_report_of_an_expert_parallel_shard():
    """``--shard``: DeepSeek-V3's 32 of 256 experts in fp8 block at M = 1 get the config the op picks for a shard (the
    direct GEMVs with their reductions split for the one pair expected here: gemv1 in 16), and both GEMVs compile."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--model", "deepseek-v3",
                          "--quant", "fp8_block", "--tokens", "1", "--experts", "32", "--shard"], capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr
    config = next(line for line in out.stdout.splitlines() if line.startswith("config: "))
    assert "path='direct'" in config and "split_k=16" in config, config
    for kernel in ("gemv1_dot_kernel", "gemv2_dot_kernel"):
        assert any(line.strip().startswith(kernel) for line in out.stdout.splitlines()), out.stdout


def unfused_flatten_loops(ttgir: str) -> int:
    """How many loops marked ``tt.flatten`` in Triton GPU IR still hold an ``scf.for`` (Triton's loop fusion left the
    nest a loop of loops); 0 when every such nest was fused into one loop. Regions are followed by the net count of
    braces per line (the ones inside types and attributes balance on their line)."""
    stack = []  # per open region: [is a for loop, holds a for loop]
    unfused = 0
    for line in ttgir.splitlines():
        net = line.count("{") - line.count("}")
        for _ in range(-net):
            is_for, holds_for = stack.pop()
            if is_for and holds_for and "tt.flatten" in line:
                unfused += 1
        for _ in range(net):
            is_for = "scf.for" in line
            if is_for:
                for entry in stack:
                    entry[1] = entry[1] or entry[0]
            stack.append([is_for, False])
    return unfused


def test_unfused_flatten_loops_reads_the_nest():
    """A ``tt.flatten`` loop around a k loop counts; a fused one (its k steps in a loop of their own beside it, as
    Triton leaves the nest's copy for an empty k range) and an unmarked nest do not."""
    nest = ("scf.for %tile = %a to %b step %c : i32 {\n"
            "  %x = tt.splat %y : f32 -> tensor<8xf32, #ttg.slice<{dim = 0}>>\n"
            "  scf.for %k = %a to %b step %c : i32 {\n    scf.yield\n  }\n  scf.if %p {\n  } else {\n  }\n")
    assert unfused_flatten_loops(nest + "} {tt.flatten}\n") == 1
    assert unfused_flatten_loops(nest + "}\n") == 0
    fused = ("scf.if %e {\n  scf.for %tile = %a to %b step %c : i32 {\n    scf.if %q {\n    }\n  } {tt.flatten}\n"
             "} else {\n"
             "  %r = scf.for %i = %a to %n step %c iter_args(%acc = %z) -> (tensor<128x256xf32, #mma>) : i32 {\n"
             "    scf.yield %acc : tensor<128x256xf32, #mma>\n  }\n}\n")
    assert unfused_flatten_loops(fused) == 0


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas for sm_90")
def test_persistent_gemm1_tile_loop_is_fused(tmp_path):
    """The persistent gemm1 (16-bit weights, blocks of 128 rows; qwen3-30b-a3b at M = 4096) compiles its tile loop and
    k loop into one loop: Triton fuses a ``tl.range(flatten=True)`` nest only when it holds a single inner loop, and
    a second one (a loop in a helper the tile calls) leaves each tile refilling its pipeline
    (benchmarks/results/ab_gemm1_fused_loop_h200.txt: 4-8% on the first GEMM)."""
    variant = '{"block_m": 128, "gemm1": {"persistent": true, "tail_m": 0, "tma_weights": true}}'
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--model", "qwen3-30b-a3b",
                          "--tokens", "4096", "--device", "NVIDIA H200", "--variant", variant, "--dump", str(tmp_path)],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.strip().startswith("gemm1_sorted_kernel"))
    assert "TAIL_M=0" in row, row
    ttgir = (tmp_path / "gemm1_sorted_kernel.ttgir").read_text()
    assert "tt.flatten" in ttgir, "the persistent kernel (its tile loop) was compiled"
    assert unfused_flatten_loops(ttgir) == 0


def test_sass_facts_reads_ptxas_and_the_waits(tmp_path, monkeypatch):
    """The parsing of ptxas -v and of the SASS: registers, spills, the C7515 warning, wgmma and full waits."""
    info = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
            "ptxas info    : 16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 251 registers, used 1 barriers\n")
    sass = ("  HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR16], R88, gsb0 ;\n  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
            "  HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0 ;\n  WARPGROUP.DEPBAR.LE gsb0, 0x7 ;\n")

    def fake_run(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 0, stdout=sass if "-sass" in cmd else "", stderr=info)

    monkeypatch.setattr(compile_report.subprocess, "run", fake_run)
    facts = compile_report.sass_facts("ptxas", "cuobjdump", "// ptx", str(tmp_path), str(tmp_path / "k"))
    assert (tmp_path / "k.ptx").read_text() == "// ptx" and (tmp_path / "k.sass").read_text() == sass
    assert facts == {"registers": 251, "spill_stores": 8, "spill_loads": 4, "wgmma_serialized_warning": True,
                     "wgmma": 2, "wgmma_waits_for_all": 1, "loop_mix": {}}


@pytest.mark.parametrize("registers, warps, shared, want", [
    (196, 4, 66584, (2, "registers")),  # the MXFP4 gemm1 at blocks of 64 as ptxas chooses
    (168, 4, 66584, (3, "registers and shared")),  # capped: both allow 3
    (118, 4, 42496, (4, "registers")),
    (64, 4, 61440, (3, "shared")),
    (255, 8, 133144, (1, "registers and shared")),
    (24, 16, 1024, (4, "warps")),
])
def test_programs_per_sm(registers, warps, shared, want):
    """sm_90's occupancy rules: registers per warp in units of 256 out of 64 K, shared memory plus 1 KB per program
    out of 228 KB, 64 warps; every limit that reaches the minimum is named."""
    assert compile_report.programs_per_sm(registers, warps, shared) == want


def test_loop_mix_counts_the_wgmma_loop_by_pipe():
    """``loop_mix``: of the backward branches, the innermost loop whose body holds wgmma is counted (from its target
    through the branch; not a loop without tensor-core instructions, nor an outer loop around it, nor a loop of more
    mma.sync but no wgmma), each opcode by its pipe whatever its modifiers and predicate; a dump without such a loop
    gives {}."""
    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;    /* 0x000000000000 */\n"

    sass = "".join([
        line(0x00, "MOV R1, c[0x0][0x28]"),
        line(0x10, "IADD3 R2, R2, 0x1, RZ"),
        line(0x20, "@P0 BRA 0x10"),  # a loop without wgmma
        line(0x30, "LDS.128 R4, [R8]"),
        line(0x40, "SHF.L.W.U32.HI R5, R4, 0x4, R4"),
        line(0x50, "LOP3.LUT R5, R5, 0x81c081c0, RZ, 0xc0, !PT"),
        line(0x60, "IMAD.SHL.U32 R6, R4, 0x10, RZ"),
        line(0x70, "HMUL2.BF16_V2 R7, R5, R9.H0_H0"),
        line(0x80, "HGMMA.64x16x16.F32.BF16 R24, R96, gdesc[UR16], R24, gsb0"),
        line(0x90, "UIADD3 UR5, UR5, 0x1, URZ"),
        line(0xa0, "BAR.SYNC.DEFER_BLOCKING 0x0"),
        line(0xb0, "@!P1 BRA 0x30"),
        line(0xc0, "STG.E [R2], R24"),
        line(0xc4, "HMMA.16816.F32.BF16 R40, R44, R48, R40"),  # a tail tile's loop on mma.sync: two of them
        line(0xc8, "HMMA.16816.F32.BF16 R40, R44, R48, R40"),
        line(0xcc, "@P3 BRA 0xc4"),
        line(0xd0, "@P2 BRA 0x0"),  # an outer loop around both
        line(0xe0, "EXIT"),
    ])
    assert compile_report.loop_mix(sass) == {"alu": 2, "fma": 2, "mem": 1, "mma": 1, "uniform": 1, "other": 2,
                                             "total": 9}
    assert compile_report.loop_mix(sass.replace("HGMMA", "HFMA2").replace("HMMA", "HFMA2")) == {}
