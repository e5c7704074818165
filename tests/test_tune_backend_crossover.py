"""benchmarks/tune_backend_crossover.py on the CPU: its options, the threshold it derives from measured points, the
merge of its section into a tuned-config file (kernel configs and other shapes kept, the default recomputed), where
it writes, and a whole run of ``main`` with the measurements faked, read back by ``moe_extension.backends.crossover``
as ``backend="auto"`` reads it."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import moe_extension.kernels._configs as kernel_configs
from moe_extension.backends import crossover, deep_gemm

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import tune_backend_crossover as tune  # noqa: E402


def point(rows, triton_us, accelerator_us, agree=True):
    return {"M": int(rows * 32), "topk": 8, "rows_per_expert": rows, "triton_us": triton_us,
            "accelerator_us": accelerator_us, "rel_err": 0.01 if agree else 0.5, "agree": agree}


def test_help_runs_from_anywhere():
    done = subprocess.run([sys.executable, str(BENCH / "tune_backend_crossover.py"), "--help"], capture_output=True,
                          text=True, cwd="/", check=True)
    assert "rows per expert" in done.stdout and "PYTHONPATH=.deps/dg" in done.stdout


def test_options():
    args = tune.parse_args([])
    assert (args.models, args.shape, args.tokens, args.margin, args.out) == (
        ["deepseek-v3", "deepseek-v2-lite"], [], list(tune.TOKENS), 0.02, None)
    assert tune.MODELS["deepseek-v3"] == dict(E=256, topk=8, K=7168, N=2048)
    args = tune.parse_args(["--shape", "128", "8", "2048", "768", "--tokens", "64", "4096", "--out", "x.json"])
    assert (args.models, args.shape, args.tokens, args.out) == ([], [[128, 8, 2048, 768]], [64, 4096], "x.json")
    for argv in (["--shape", "8", "2", "1000", "256"], ["--margin", "1"], ["--models", "llama"]):
        with pytest.raises(SystemExit):
            tune.parse_args(argv)


@pytest.mark.parametrize("points, margin, want", [
    ([point(1, 10, 12), point(8, 20, 19.8), point(64, 100, 80), point(256, 400, 300)], 0.02, 64),  # 1% < margin
    ([point(1, 10, 12), point(8, 20, 19.8), point(64, 100, 80), point(256, 400, 300)], 0.0, 8),
    ([point(64, 100, 80), point(1, 10, 12), point(256, 400, 300)], 0.02, 64),  # order of the points does not matter
    ([point(1, 10, 9), point(8, 20, 25), point(64, 100, 80)], 0.02, 64),  # a win below a loss does not count
    ([point(1, 10, 9), point(64, 100, 80)], 0.02, 1),
    ([point(1, 10, 12), point(64, 100, 120)], 0.02, None),  # never faster at the largest M
    ([point(1, 10, 9), point(64, 100, 80, agree=False)], 0.02, None),  # outputs disagree: not faster
    ([], 0.02, None),
])
def test_threshold(points, margin, want):
    assert tune.threshold(points, margin) == want


def test_merge_keeps_the_rest_and_recomputes_the_default():
    configs = {"E=8,N=14336,K=4096,topk=2,dtype=bfloat16,w1=row,w2=row": {"16": {"path": "sorted"}}}
    table = {"device": "Fake GPU", "torch": "t", "triton": "tr", "configs": json.loads(json.dumps(configs))}
    versions = {"deep_gemm": "2.8.1", "torch": "t", "triton": "tr"}
    tune.merge(table, {"E=256,N=2048,K=7168": {"min_rows_per_expert": 64.0, "measured": []}}, versions)
    section = table["backend"]["fp8_block"]["deep_gemm"]
    assert section["min_rows_per_expert"] == 64.0 and section["measured_with"] == versions
    tune.merge(table, {"E=64,N=1408,K=2048": {"min_rows_per_expert": 96.0, "measured": []}}, versions)
    assert set(section["shapes"]) == {"E=256,N=2048,K=7168", "E=64,N=1408,K=2048"}
    assert section["min_rows_per_expert"] == 96.0, "the largest threshold of the stored shapes"
    tune.merge(table, {"E=64,N=1408,K=2048": {"min_rows_per_expert": None, "measured": []}}, versions)
    assert section["min_rows_per_expert"] is None, "a shape where DeepGEMM never won: no default"
    tune.merge(table, {"E=64,N=1408,K=2048": {"min_rows_per_expert": 32.0, "measured": []}}, versions)
    assert section["min_rows_per_expert"] == 64.0
    assert section["shapes"]["E=64,N=1408,K=2048"]["min_rows_per_expert"] == 32.0
    assert table["configs"] == configs and (table["device"], table["torch"], table["triton"]) == ("Fake GPU", "t", "tr")


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """The package's tables in tmp_path/configs; crossover reads them for a "Fake GPU"."""
    configs = tmp_path / "configs"
    configs.mkdir()
    monkeypatch.setattr(kernel_configs, "CONFIG_DIR", configs)
    crossover.load_section.cache_clear()
    yield configs
    crossover.load_section.cache_clear()


def test_output_path(tables, tmp_path):
    installed = tables / "Fake_GPU.json"
    assert tune.output_path(None, "Fake GPU") == installed
    assert tune.output_path(str(tmp_path), "Fake GPU") == tmp_path / "Fake_GPU.json"
    assert tune.output_path(str(tmp_path / "new"), "Fake GPU") == tmp_path / "new" / "Fake_GPU.json"
    assert tune.output_path(str(tmp_path / "x.json"), "Fake GPU") == tmp_path / "x.json"


def test_main_writes_what_auto_reads(monkeypatch, tables, tmp_path, capsys):
    """A whole run with faked measurements: the section merged over a copy of the installed table (its kernel
    configs kept), and the crossover module reads it back: DeepGEMM from the stored rows per expert on."""
    installed = {"device": "Fake GPU", "configs": {"E=1,N=1,K=1,topk=1,dtype=bfloat16,w1=row,w2=row": {}}}
    (tables / "Fake_GPU.json").write_text(json.dumps(installed))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(deep_gemm, "_load", lambda: (SimpleNamespace(), None))
    measured = []

    def measure_shape(E, topk, K, N, tokens, n_sets, margin):
        measured.append((E, topk, K, N, tuple(tokens)))
        rows = [tokens[0] * topk / E, tokens[1] * topk / E]
        points = [point(rows[0], 10, 12), point(rows[1], 100, 50)]
        return {"min_rows_per_expert": tune.threshold(points, margin), "measured": points}

    monkeypatch.setattr(tune, "measure_shape", measure_shape)
    out = tmp_path / "out"
    argv = ["--models", "deepseek-v3", "--shape", "8", "2", "256", "128", "--tokens", "16", "1024", "--out", str(out)]
    assert tune.main(argv) == 0
    assert measured == [(256, 8, 7168, 2048, (16, 1024)), (8, 2, 256, 128, (16, 1024))]
    table = json.loads((out / "Fake_GPU.json").read_text())
    assert table["configs"] == installed["configs"], "the kernel configs are kept"
    section = table["backend"]["fp8_block"]["deep_gemm"]
    assert section["shapes"]["E=256,N=2048,K=7168"]["min_rows_per_expert"] == 32.0
    assert section["shapes"]["E=8,N=128,K=256"]["min_rows_per_expert"] == 256.0
    assert section["min_rows_per_expert"] == 256.0
    assert "wrote" in capsys.readouterr().out
    # installed: crossover reads the file back the way backend="auto" does
    (tables / "Fake_GPU.json").write_text((out / "Fake_GPU.json").read_text())
    crossover.load_section.cache_clear()
    monkeypatch.setattr(crossover, "device_name", lambda device: "Fake GPU")
    cuda = torch.device("cuda")
    assert crossover.prefers("deep_gemm", "fp8_block", cuda, 1024, 256, 2048, 7168, 8)
    assert not crossover.prefers("deep_gemm", "fp8_block", cuda, 1023, 256, 2048, 7168, 8)
    assert not crossover.prefers("deep_gemm", "fp8_block", cuda, 1023, 8, 2048, 7168, 2), "the default: 256 rows"
    assert crossover.prefers("deep_gemm", "fp8_block", cuda, 1024, 8, 4096, 7168, 2)


def test_main_needs_cuda_and_deep_gemm(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main([]) == 1 and "needs a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(deep_gemm, "_load", lambda: (None, "cannot import deep_gemm (test)"))
    assert tune.main([]) == 1 and "DeepGEMM is not available: cannot import deep_gemm (test)" in capsys.readouterr().err
