"""benchmarks/ab_fused_experts.py: the variant overrides it applies to a table config."""

import sys
from pathlib import Path

import pytest

from moe_extension.kernels._configs import GemmConfig, MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ab_fused_experts  # noqa: E402
import harness  # noqa: E402


def test_variant_overrides_only_the_named_fields():
    cfg = MoeConfig("sorted", 128, GemmConfig(128, 64, 8, 4, tma_weights=True), GemmConfig(256, 64, 8, 3))
    out = ab_fused_experts.apply(cfg, {"gemm1": {"tma_a": True}, "gemm2": {"tma_a": True, "num_stages": 4}})
    assert out.gemm1 == GemmConfig(128, 64, 8, 4, tma_weights=True, tma_a=True)
    assert out.gemm2 == GemmConfig(256, 64, 8, 4, tma_a=True)
    assert ab_fused_experts.apply(cfg, {"block_m": 64}) == MoeConfig("sorted", 64, cfg.gemm1, cfg.gemm2)
    with pytest.raises(TypeError):
        ab_fused_experts.apply(cfg, {"gemm1": {"no_such_field": 1}})


def test_activation_and_profile_options():
    args = ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64"])
    assert args.activation == "swigluoai" and not args.profile and not args.no_pdl and not args.persistent_pdl
    args = ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--activation", "silu",
                                        "--profile", "--no-pdl", "--persistent-pdl"])
    assert args.activation == "silu" and args.profile and args.no_pdl and args.persistent_pdl
    with pytest.raises(SystemExit):
        ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--activation", "relu"])


def test_op_option():
    assert ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64"]).op == "fused_experts"
    args = ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--op", "expert_gemm2"])
    assert args.op == "expert_gemm2"
    with pytest.raises(SystemExit):
        ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--op", "expert_gemm2",
                                     "--no-pdl"])
    with pytest.raises(SystemExit):
        ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--op", "expert_gemm2",
                                     "--persistent-pdl"])
    with pytest.raises(SystemExit):
        ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--op", "expert_gemm1"])


def test_quant_local_experts_and_direct_pdl_options():
    args = ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1"])
    assert args.quant == "none" and args.local_experts is None and not args.direct_pdl
    args = ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", "--quant", "fp8_block",
                                        "--local-experts", "32", "--direct-pdl"])
    assert args.quant == "fp8_block" and args.local_experts == 32 and args.direct_pdl
    for bad in (["--quant", "int4"], ["--local-experts", "0"], ["--op", "expert_gemm2", "--direct-pdl"]):
        with pytest.raises(SystemExit):
            ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", *bad])


def test_local_pairs_option():
    """--local-pairs K: every set's routing has exactly K slots on the first L experts, ids distinct per token."""
    import torch

    args = ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "2", "--local-experts", "32",
                                        "--local-pairs", "0"])
    assert args.local_pairs == 0
    for bad in (["--local-pairs", "1"], ["--local-experts", "32", "--local-pairs", "-1"]):
        with pytest.raises(SystemExit):
            ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", *bad])
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(256)[:8] for _ in range(3)]).to(torch.int32)
    for k in (0, 1, 3, 24):
        out = ab_fused_experts.with_local_pairs(ids, 32, 256, k, gen)
        assert out.dtype == ids.dtype and out.shape == ids.shape and int((out < 32).sum()) == k
        assert all(len(set(row.tolist())) == 8 for row in out) and (out >= 0).all() and (out < 256).all()
    with pytest.raises(ValueError):
        ab_fused_experts.with_local_pairs(ids, 2, 256, 7, gen)  # 3 tokens hold at most 6 of 2 experts


def test_cell_weights_of_a_shard(monkeypatch):
    """--quant / --local-experts: the first L experts' stacks in the format, and the map of the E ids onto them."""
    import torch
    import tune_fused_experts as tune

    monkeypatch.setattr(tune, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    w1, w2, expert_map = ab_fused_experts.cell_weights("deepseek-v2-lite", "fp8_block", 3)
    assert (w1.w.shape, w2.w.shape, w1.w.dtype) == ((3, 2816, 2048), (3, 2048, 1408), torch.float8_e4m3fn)
    assert w1.scale.shape == (3, 22, 16) and w2.scale.shape == (3, 16, 11)
    assert expert_map.tolist() == [0, 1, 2] + [-1] * 61
    w1, w2, expert_map = ab_fused_experts.cell_weights("deepseek-v2-lite", "none", None)
    assert (w1.shape, w2.shape, w1.dtype, expert_map) == ((64, 2816, 2048), (64, 2048, 1408), torch.bfloat16, None)


def test_routing_from_option(tmp_path):
    routing_py = Path(__file__).resolve().parent.parent / "moe_extension" / "kernels" / "_routing.py"
    args = ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", "--routing-from",
                                        str(routing_py)])
    assert args.routing_from == str(routing_py)
    for bad in (["--routing-from", str(tmp_path / "missing.py")],
                ["--routing-from", str(routing_py), "--op", "expert_gemm2"]):
        with pytest.raises(SystemExit):
            ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "64", *bad])
    # the file's own module (the kernels compiled from it), not the installed one
    from moe_extension.kernels import _routing

    copy = tmp_path / "other_routing.py"
    copy.write_text(routing_py.read_text().replace("SINGLE_PROGRAM_MAX_PAIRS = 512", "SINGLE_PROGRAM_MAX_PAIRS = 7"))
    other = harness.load_module(str(copy))
    assert other.SINGLE_PROGRAM_MAX_PAIRS == 7 and _routing.SINGLE_PROGRAM_MAX_PAIRS == 512
    assert other.route is not _routing.route and other.route.__module__ == "other_routing"


def test_gemv_from_option(tmp_path):
    """--gemv-from FILE: another version's GEMV kernels through this version's launchers, which leave out the
    constexpr keywords the other kernels do not take (launch options stay)."""
    gemv_py = Path(__file__).resolve().parent.parent / "moe_extension" / "kernels" / "_gemv_dot.py"
    args = ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", "--gemv-from", str(gemv_py)])
    assert args.gemv_from == str(gemv_py)
    for bad in (["--gemv-from", str(tmp_path / "missing.py")], ["--gemv-from", str(gemv_py), "--op", "expert_gemm2"]):
        with pytest.raises(SystemExit):
            ab_fused_experts.parse_args(["--model", "deepseek-v3", "--tokens", "1", *bad])
    other = harness.load_module(str(gemv_py))
    assert ab_fused_experts.KernelFrom(other.gemv2_dot_kernel).takes("WORK_LIST")

    class Kernel:
        arg_names = ["x_ptr", "N", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *a, **kw: (grid, a, kw)

    shim = ab_fused_experts.KernelFrom(Kernel())
    assert not shim.takes("WORK_LIST")
    assert shim[(3,)](1, 2, BLOCK=4, WORK_LIST=True, num_warps=8) == ((3,), (1, 2), {"BLOCK": 4, "num_warps": 8})


def test_kernel_times_rotate_the_input_sets(monkeypatch):
    """--profile's per-kernel means come from one eager call per input set in turn (a shard's sets differ in their
    local pairs), after a warm-up call: faked profiler events, a kernel that only set 1 launches."""
    import torch

    launched = []

    class FakeEvent:
        def __init__(self, name, us):
            self.name, self.device_time_total = name, us
            self.device_type = torch.autograd.DeviceType.CUDA

    class FakeProfile:
        def __init__(self, activities):
            self.start = None

        def __enter__(self):
            self.start = len(launched)
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [FakeEvent(name, us) for name, us in launched[self.start:]]

    def fn(i):
        launched.append(("gemv", 10.0 + i))
        if i % 3 == 1:
            launched.append(("only_set_1", 6.0))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    times = ab_fused_experts.kernel_times_us(fn, 3)
    assert times == {"gemv": 11.0, "only_set_1": 2.0}
    assert launched[0] == ("gemv", 10.0), "a warm-up call on set 0 before the profiled ones"


def test_table_from_option(tmp_path):
    """--table-from: the other table's entry for the cell's key at the nearest M bucket; no entry -> None."""
    import json

    small = MoeConfig("sorted", 16, GemmConfig(64, 128, 4, 4), GemmConfig(128, 128, 4, 4))
    big = MoeConfig("sorted", 128, GemmConfig(128, 128, 8, 3, tail_m=16), GemmConfig(128, 128, 4, 3))
    path = tmp_path / "NVIDIA_X.json"
    path.write_text(json.dumps({"configs": {"KEY": {"16": small.to_json(), "1024": big.to_json()}}}))
    assert ab_fused_experts.table_entry(str(path), "KEY", 800) == big
    assert ab_fused_experts.table_entry(str(path), "KEY", 32) == small
    assert ab_fused_experts.table_entry(str(path), "OTHER", 800) is None
    args = ab_fused_experts.parse_args(["--model", "gpt-oss-120b", "--tokens", "1024", "--table-from", str(path)])
    assert args.table_from == str(path)
    with pytest.raises(SystemExit):
        ab_fused_experts.parse_args(["--model", "gpt-oss-120b", "--tokens", "64", "--table-from",
                                     str(tmp_path / "missing.json")])


def test_grouped_gemm_from_option(tmp_path):
    """``--grouped-gemm-from``: a copy of kernels/_grouped_gemm.py (its own kernels, compiled from the file) for the
    sorted schedule's launches; a missing file or the unfused op is a usage error."""
    gemm_py = Path(__file__).resolve().parent.parent / "moe_extension" / "kernels" / "_grouped_gemm.py"
    args = ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "4096", "--grouped-gemm-from",
                                        str(gemm_py)])
    assert args.grouped_gemm_from == str(gemm_py)
    for bad in (["--grouped-gemm-from", str(tmp_path / "missing.py")],
                ["--grouped-gemm-from", str(gemm_py), "--op", "expert_gemm2"]):
        with pytest.raises(SystemExit):
            ab_fused_experts.parse_args(["--model", "qwen3-30b-a3b", "--tokens", "4096", *bad])
    from moe_extension.kernels import _grouped_gemm

    copy = tmp_path / "other_grouped_gemm.py"
    copy.write_text(gemm_py.read_text())
    other = harness.load_module(str(copy))
    assert other.gemm1_sorted_kernel is not _grouped_gemm.gemm1_sorted_kernel
    assert other.ACTIVATION_CODES == _grouped_gemm.ACTIVATION_CODES
