"""benchmarks/vllm_peer.py: the harness that runs vLLM's Triton fused_moe_kernel as a benchmark peer.

Without .deps/vllm (fresh clones, CI) only the pure torch/JSON parts run: the routing alignment against a
brute-force loop, the config file names / tables / nearest-M lookup on synthetic JSON in tmp_path, ``load``'s
reasons and the kernel-signature fitting. With it (``../shared/tools/get_peers.sh vllm``) the whole layer runs
against ``torch.ops.moe_ext.fused_experts`` (PyTorch backend, CPU): in Triton's interpreter on CPU tensors
(tiny shapes, fp16/fp32 since the interpreter's bf16 tl.dot is wrong; TRITON_INTERPRET is set by conftest.py
before triton is imported), or on the GPU when there is one.
"""

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import random_expert_map, random_experts, random_routing
from tests.utils import INTERPRETED, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vllm_peer as vp  # noqa: E402

KERNEL, WHY = vp.load()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"vLLM kernel not available: {WHY}")
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="needs CUDA or the Triton interpreter")
# Dtypes of the unquantized cases: the interpreter's bf16 tl.dot is wrong.
DTYPES = (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16, torch.float32)
TINY = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
TOL = 1e-2


# ----------------------------------------------------------------------------------------- alignment


def _align_reference(topk_ids, block_m, num_experts, expert_map=None, ignore_invalid=False):
    """Brute force: per expert in order, its slots ascending, padded with numel to a multiple of block_m."""
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    emap = None if expert_map is None else expert_map.tolist()
    sorted_ids, experts = [], []
    for e in range(num_experts):
        if ignore_invalid and emap is not None and emap[e] < 0:
            continue
        slots = [i for i, v in enumerate(flat) if v == e]
        if not slots:
            continue
        nblocks = -(-len(slots) // block_m)
        sorted_ids += slots + [numel] * (nblocks * block_m - len(slots))
        experts += [e if emap is None else emap[e]] * nblocks
    return sorted_ids, experts, len(sorted_ids)


ALIGN_CASES = [  # (M, topk, E, block_m, invalid fraction, expert_map local count or None, ignore_invalid)
    (1, 1, 4, 16, 0.0, None, False),
    (5, 3, 8, 4, 0.2, None, False),
    (37, 2, 6, 16, 0.1, None, False),
    (64, 8, 16, 8, 0.0, None, False),
    (3, 2, 40, 16, 0.0, None, False),  # numel < num_experts: the smaller worst case
    (20, 4, 12, 4, 0.15, 5, False),  # expert_map: blocks of non-local experts carry -1
    (20, 4, 12, 4, 0.15, 5, True),  # ... or are left out (vLLM's fused_experts)
    (9, 6, 32, 16, 0.0, 8, True),
]


@pytest.mark.parametrize("case", ALIGN_CASES, ids=[str(i) for i in range(len(ALIGN_CASES))])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_align_block_size_matches_brute_force(case, id_dtype):
    M, topk, E, bm, invalid, local, ignore = case
    torch.manual_seed(M * 100 + E)
    _, ids = random_routing(M, E, topk, invalid=invalid, id_dtype=id_dtype)
    emap = random_expert_map(E, local) if local else None
    sorted_ids, expert_ids, post = vp.align_block_size(ids, bm, E, emap, ignore_invalid_experts=ignore)

    numel = M * topk
    cap = numel + E * (bm - 1)
    cap = min(numel * bm, cap) if numel < E else cap
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == torch.int32
    assert tuple(sorted_ids.shape) == (cap,) and tuple(expert_ids.shape) == (-(-cap // bm),)
    assert tuple(post.shape) == (1,)

    ref_sorted, ref_experts, ref_post = _align_reference(ids, bm, E, emap, ignore)
    assert int(post) == ref_post and ref_post % bm == 0
    assert sorted_ids[:ref_post].tolist() == ref_sorted
    assert (sorted_ids[ref_post:] == numel).all()
    assert expert_ids[: ref_post // bm].tolist() == ref_experts
    assert (expert_ids[ref_post // bm:] == -1).all()
    if emap is not None and ignore:
        assert (expert_ids[: ref_post // bm] >= 0).all()


def test_align_block_size_no_tokens():
    sorted_ids, expert_ids, post = vp.align_block_size(torch.empty(0, 2, dtype=torch.int32), 16, 8)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(post) == 0


# --------------------------------------------------------------------------------------------- configs


def _write(path: Path, table: dict) -> None:
    path.write_text(json.dumps(table))


def test_config_file_names_follow_vllm():
    h100 = "NVIDIA_H100_80GB_HBM3"
    assert vp.config_file_name(128, 768, h100) == "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json"
    assert (vp.config_file_name(256, 256, "NVIDIA_H200", "fp8_w8a8", [128, 128])
            == "E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    assert vp.config_file_name(8, 64, "X", "fp8_w8a8") == "E=8,N=64,device_name=X,dtype=fp8_w8a8.json"
    assert vp.device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert vp.device_file_name("NVIDIA H200 NVL") == "NVIDIA_H200"
    with pytest.raises(ValueError):
        vp.config_file_name(8, 64, "X", "int4")


def test_shipped_config_and_nearest_m(tmp_path):
    cfg = {k: dict(TINY, BLOCK_SIZE_M=v) for k, v in (("1", 16), ("16", 32), ("64", 64), ("256", 128))}
    _write(tmp_path / "E=4,N=32,device_name=Fake_GPU.json", dict(cfg, triton_version="3.9.0"))
    _write(tmp_path / "E=4,N=32,device_name=Fake_GPU,dtype=fp8_w8a8,block_shape=[128,128].json", {"8": TINY})

    table = vp.shipped_config(tmp_path, 4, 32, "Fake_GPU", "bf16")
    assert list(table) == [1, 16, 64, 256]
    pick = {m: vp.config_for(table, m)["BLOCK_SIZE_M"] for m in (1, 2, 8, 9, 40, 41, 100, 160, 161, 10**6)}
    # nearest key by |key - M|; on a tie (M = 40 between 16 and 64; 160 between 64 and 256) the first key
    assert pick == {1: 16, 2: 16, 8: 16, 9: 32, 40: 32, 41: 64, 100: 64, 160: 64, 161: 128, 10**6: 128}
    assert vp.shipped_config(tmp_path, 4, 32, "Fake_GPU", "fp8_w8a8", [128, 128]) == {8: TINY}
    assert vp.shipped_config(tmp_path, 4, 32, "Fake_GPU", "fp8_w8a8") is None
    assert vp.shipped_config(tmp_path, 8, 32, "Fake_GPU") is None
    assert vp.shipped_config(tmp_path / "absent", 4, 32, "Fake_GPU") is None
    with pytest.raises(ValueError):
        vp.config_for({}, 4)


def test_default_config_is_a_launchable_config():
    for m in (1, 4, 8, 16, 64, 65, 512, 4096):
        for dtype, bs in (("bf16", None), ("fp8_w8a8", [128, 128])):
            cfg = vp.default_config(m, 128, 768, 2048, 8, dtype, bs)
            assert {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps"} <= set(cfg)
    assert vp.default_config(1, 256, 2048, 7168, 8, "fp8_w8a8", [128, 128])["BLOCK_SIZE_N"] == 64
    assert vp.default_config(4096, 8, 14336, 4096, 2, "bf16")["GROUP_SIZE_M"] == 16


@pytest.mark.skipif(KERNEL is None, reason=f"vLLM kernel not available: {WHY}")
def test_shipped_tables_parse():
    """vLLM 0.33.0 ships H100 tables for gpt-oss-120b (E 128, N 2880, bf16) and E 256, N 384 fp8 block."""
    found = [vp.shipped_config(".deps/vllm/configs", 128, 2880, "NVIDIA_H100_80GB_HBM3"),
             vp.shipped_config(".deps/vllm/configs", 256, 384, "NVIDIA_H100_80GB_HBM3", "fp8_w8a8", [128, 128])]
    found = [t for t in found if t is not None]
    if not found:
        pytest.skip("this vLLM version ships neither table")
    for table in found:
        assert all(isinstance(m, int) for m in table) and "BLOCK_SIZE_M" in vp.config_for(table, 64)


# ------------------------------------------------------------------------------------ loading, signature


def test_load_reports_why_not(tmp_path):
    module, why = vp.load(tmp_path / "absent")
    assert module is None and "missing" in why
    module, why = vp.load(tmp_path)
    assert module is None and "vllm_fused_moe_kernel.py" in why
    (tmp_path / "vllm_fused_moe_kernel.py").write_text("import not_a_module_anywhere_12345\n")
    module, why = vp.load(tmp_path)
    assert module is None and "ModuleNotFoundError" in why
    other = tmp_path / "other"
    other.mkdir()
    (other / "vllm_fused_moe_kernel.py").write_text("x = 1\n")
    module, why = vp.load(other)
    assert module is None and "no fused_moe_kernel" in why


def test_signature_fitting():
    def kernel(a_ptr, N, BLOCK: int, SWAP_AB: bool = False, NEW_FLAG: bool = False):
        pass

    params = inspect.signature(kernel).parameters
    got = vp._fit_signature(params, dict(a_ptr=1, N=2, BLOCK=16, SWAP_AB=True, USE_TD=False, HAS_BIAS=False))
    assert got == dict(a_ptr=1, N=2, BLOCK=16, SWAP_AB=True)  # neutral extras dropped, defaults left alone
    with pytest.raises(TypeError, match="USE_TD"):
        vp._fit_signature(params, dict(a_ptr=1, N=2, BLOCK=16, USE_TD=True))  # a feature the kernel lacks
    with pytest.raises(TypeError, match="BLOCK"):
        vp._fit_signature(params, dict(a_ptr=1, N=2))  # a required parameter we do not supply


# ----------------------------------------------------------------------------------- the layer vs ours


def _layer(ex, topk, dtype, **kw):
    return vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"], topk=topk, max_tokens=32, dtype=dtype, w1_scale=ex["w1_scale"],
                           w2_scale=ex["w2_scale"], w1_bias=ex["w1_bias"], w2_bias=ex["w2_bias"], **kw)


def _ours(x, ex, g, ids, activation="silu", quant="none", **kw):
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return torch.ops.moe_ext.fused_experts(
        x.cpu(), cpu(ex["w1"]), cpu(ex["w2"]), g.cpu(), ids.cpu(), activation, w1_bias=cpu(ex["w1_bias"]),
        w2_bias=cpu(ex["w2_bias"]), quant=quant, w1_scale=cpu(ex["w1_scale"]), w2_scale=cpu(ex["w2_scale"]),
        expert_map=cpu(kw.pop("expert_map", None)), backend="torch", **kw)


LAYER_CASES = [  # (name, M, topk, E, K, N, activation, bias, layer options)
    ("sorted", 9, 2, 4, 48, 32, "silu", False, {}),
    ("sorted_tail_k", 21, 3, 6, 40, 24, "silu", False, {}),  # K not a multiple of BLOCK_SIZE_K
    ("naive_auto", 2, 2, 16, 48, 32, "silu", False, {}),  # M * topk * 4 <= E: one block per slot
    ("swigluoai_bias", 7, 2, 5, 32, 32, "swigluoai", True, {}),
    ("on_input", 6, 1, 4, 32, 32, "silu", False, dict(apply_router_weight_on_input=True)),
]


@needs_kernel
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_full_matches_fused_experts(case, dtype):
    name, M, topk, E, K, N, activation, bias, opts = case
    torch.manual_seed(len(name))
    ex = random_experts(E, K, N, dtype=dtype, device=DEVICE, bias=bias)
    g, ids = random_routing(M, E, topk, invalid=0.0, device=DEVICE)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    layer = _layer(ex, topk, dtype, activation=activation, config=TINY, **opts)
    assert layer._use_naive(M) == (name == "naive_auto")
    out = layer.full(x, g, ids)
    ref = _ours(x, ex, g, ids, activation, apply_router_weight_on_input=opts.get("apply_router_weight_on_input", False))
    assert out.shape == (M, K) and out.dtype == dtype
    assert rel_err(out.cpu(), ref) <= TOL

    # gemms_only on prepare's inputs: the two launches give the slots that full sums
    prepared = layer.prepare(x, g, ids)
    slots = layer.gemms_only(prepared)
    assert rel_err(slots.float().sum(1).cpu(), ref) <= TOL


@needs_kernel
@needs_triton
@pytest.mark.parametrize("with_table", [False, True])
def test_expert_map_shard(with_table):
    """The EP-shard cell in small: E_global 12, 4 local experts; slots of other experts (and invalid ids)
    contribute 0. Also a config table, picked by nearest M."""
    torch.manual_seed(3)
    dtype = DTYPES[0]
    E_global, E, M, topk, K, N = 12, 4, 11, 3, 32, 32
    ex = random_experts(E, K, N, dtype=dtype, device=DEVICE)
    g, ids = random_routing(M, E_global, topk, invalid=0.1, device=DEVICE)
    emap = random_expert_map(E_global, E, device=DEVICE)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    table = {1: dict(TINY, BLOCK_SIZE_M=32), 16: TINY}  # M = 11 is nearer 16
    layer = _layer(ex, topk, dtype, expert_map=emap, config=table if with_table else TINY)
    assert layer.global_num_experts == E_global and not layer._use_naive(1)
    assert layer.config_for_tokens(M) is TINY
    out = layer.full(x, g, ids)
    ref = _ours(x, ex, g, ids, expert_map=emap)
    assert rel_err(out.cpu(), ref) <= TOL


@needs_kernel
@needs_triton
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fp8_block(swap_ab):
    """w8a8 block 128 x 128, activations quantized per token per 128 columns (fp32 activations so that the
    intermediate is not rounded to 16 bits before its quantization, which the reference does not do)."""
    torch.manual_seed(5)
    M, topk, E, K, N = 6, 2, 4, 256, 192  # N not a multiple of 128: a partial scale block
    ex = random_experts(E, K, N, quant="fp8_block", device=DEVICE)
    g, ids = random_routing(M, E, topk, invalid=0.0, device=DEVICE)
    x = torch.randn(M, K, device=DEVICE)
    cfg = dict(TINY, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128)
    layer = _layer(ex, topk, torch.float32, quant="fp8_block", config=cfg, swap_ab=swap_ab)
    out = layer.full(x, g, ids)
    ref = _ours(x, ex, g, ids, quant="fp8_block")
    assert rel_err(out.cpu(), ref) <= TOL
    slots = layer.gemms_only(layer.prepare(x, g, ids))
    assert rel_err(slots.sum(1).cpu(), ref) <= TOL


@needs_kernel
def test_rejects_bad_inputs():
    ex = random_experts(4, 32, 16)
    with pytest.raises(ValueError):
        vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"][:, :, :8], topk=2, max_tokens=4)
    with pytest.raises(ValueError):
        vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"], topk=2, max_tokens=4, activation="gelu")
    with pytest.raises(ValueError):
        vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"], topk=2, max_tokens=4, quant="fp8_block")
    layer = vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"], topk=2, max_tokens=4, dtype=torch.float32, config=TINY)
    g, ids = random_routing(5, 4, 2, invalid=0.0)
    with pytest.raises(ValueError):
        layer.full(torch.randn(5, 32), g, ids)  # more tokens than max_tokens


@needs_kernel
@pytest.mark.cuda
def test_cuda_graph_and_no_host_sync():
    """On the GPU: full() in bf16 with vLLM's own table (or default), no host sync, capturable."""
    torch.manual_seed(0)
    M, topk, E, K, N = 64, 8, 128, 256, 128
    ex = random_experts(E, K, N, dtype=torch.bfloat16, device="cuda")
    g, ids = random_routing(M, E, topk, invalid=0.0, device="cuda")
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    layer = vp.VllmFusedMoE(KERNEL, ex["w1"], ex["w2"], topk=topk, max_tokens=M)
    layer.full(x, g, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.full(x, g, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.full(x, g, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out.cpu(), _ours(x, ex, g, ids)) <= TOL
