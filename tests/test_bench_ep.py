"""benchmarks/bench_ep.py runs end to end on 2 gloo ranks with a tiny layer and writes its JSON (the numbers
are not checked: they are CPU times; the GPU run is the benchmark)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ep  # noqa: E402

KEYS = {"dispatch", "experts", "combine", "total", "total_stream", "single_gpu", "single_gpu_stream", "weak_scaling",
        "weak_scaling_stream", "a2a_dispatch", "a2a_combine", "dispatch_bw", "combine_bw", "dispatch_vs_plain",
        "combine_vs_plain"}


def test_bench_ep_small_on_gloo(tmp_path):
    bench_ep.main(["--backend", "gloo", "--world", "2", "--small", "--tokens", "5", "--routing", "skewed",
                   "--dispatch", "auto", "fp8", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ep_w2_cpu_small.json").read_text())
    assert result["world_size"] == 2 and len(result["cells"]) == 4  # 2 dispatch dtypes x 2 modes
    for cell in result["cells"]:
        assert KEYS <= set(cell) and cell["total"] > 0 and cell["total_stream"] > 0
        assert cell["dispatch_bytes_off_rank"] > 0
