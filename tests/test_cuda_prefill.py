"""ops.cuda_prefill without a GPU: argument validation says what is wrong and what
is accepted; the csrc kernel compiles for sm_90a where nvcc exists."""

import dataclasses
import types

import pytest
from csrc_signature import c_signature
import torch

from dhp_backend.ops import cuda_build
from dhp_backend.ops.cuda_prefill import prefill_sm90, validate


def cpu_step(H=32, Hkv=8, D=128, bs=16, dtype=torch.bfloat16):
    q = torch.zeros(10, H, D, dtype=dtype)
    kc = torch.zeros(4, Hkv, bs, D, dtype=dtype)
    return (q, kc, kc.clone(), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32),
            torch.tensor([10], dtype=torch.int32), torch.zeros_like(q))


def test_cpu_tensors_refused_with_the_accepted_device():
    with pytest.raises(ValueError, match=r"query's device is cpu; accepted: a CUDA device"):
        prefill_sm90(*cpu_step(), scale=0.1)


@pytest.mark.parametrize("kw,pattern", [
    (dict(D=64), r"query's shape is \(10, 32, 64\); accepted: \[num_tokens, num_heads, 128\]"),
    (dict(bs=8), r"the block size is 8; accepted: 16, 32, 64, 128"),
    (dict(dtype=torch.float32), r"query's dtype is torch.float32; accepted: torch.bfloat16 or torch.float16"),
    (dict(Hkv=5), r"the number of KV heads is 5 for 32 query heads"),
    (dict(H=256, Hkv=1), r"the number of KV heads is 1 for 256 query heads; accepted: .*ratio <= 128"),
])
def test_shapes_refused(monkeypatch, kw, pattern):
    # Validation past the device check: pretend the tensors are on CUDA.
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=pattern):
        validate(*cpu_step(**kw), num_tokens=10)


def test_num_tokens_must_fit_the_query(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"num_tokens is 11; accepted: an int in \[0, query.shape\[0\] = 10\]"):
        validate(*cpu_step(), num_tokens=11)


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc not found"):
        cuda_build.build("x", "prefill_sm90.cu")


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="no nvcc on this machine (CI): built on the GPU machine")
def test_kernel_builds_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("DHP_CUDA_CACHE", str(tmp_path))
    built = cuda_build.build(*cuda_build.PREFILL_LIBRARY)
    assert built.state == "built" and built.path.is_file() and built.path.stat().st_size > 100_000
    again = cuda_build.build(*cuda_build.PREFILL_LIBRARY)
    assert (again.state, again.path) == ("cached", built.path)  # cached, not rebuilt


def test_build_key_follows_every_source_and_header(tmp_path):
    """A change to any .cu/.cuh/.h beside the kernels (tma_maps.h is a .h) makes a new
    cache entry; prose beside them does not."""
    for name, text in (("k.cu", "kernel"), ("p.cuh", "device"), ("maps.h", "host"), ("README.md", "prose")):
        (tmp_path / name).write_text(text)
    key = cuda_build.build_key(tmp_path, ("-O3",), "nvcc 13.0")
    assert key == cuda_build.build_key(tmp_path, ("-O3",), "nvcc 13.0")
    (tmp_path / "README.md").write_text("other prose")
    assert cuda_build.build_key(tmp_path, ("-O3",), "nvcc 13.0") == key
    seen = {key}
    for name in ("k.cu", "p.cuh", "maps.h"):
        (tmp_path / name).write_text("changed " + name)
        seen.add(cuda_build.build_key(tmp_path, ("-O3",), "nvcc 13.0"))
    seen.add(cuda_build.build_key(tmp_path, ("-O2",), "nvcc 13.0"))
    seen.add(cuda_build.build_key(tmp_path, ("-O2",), "nvcc 12.8"))
    assert len(seen) == 6


def _on_cuda(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))


@pytest.mark.parametrize("kw,pattern", [
    (dict(variant="compat_ct"), r"bucket is missing; accepted: a bucket with variant 'compat_ct' and none"),
    (dict(variant="compat", bucket=64), r"bucket is given; accepted: a bucket with variant 'compat_ct'"),
    (dict(variant="compat_ct", bucket=65), r"bucket is 65; accepted: an int in \[1, block_table.shape\[1\] \* "
                                           r"block_size = 64\]"),
    (dict(variant="compat_ct", bucket=0), r"bucket is 0; accepted: an int in \[1, "),
    (dict(variant="compat_ct", bucket=True), r"bucket is True; accepted: an int in \[1, "),
    (dict(variant="compat_ct", bucket=torch.tensor([64], dtype=torch.int64)),
     r"bucket is a torch.int64 tensor of shape \(1,\) on cuda:0; accepted: an int, or an int32 tensor of 1 "),
    (dict(variant="compat_ct", bucket=torch.tensor([64, 64], dtype=torch.int32)),
     r"bucket is a torch.int32 tensor of shape \(2,\)"),
    (dict(variant="nope"), r"variant is 'nope'; accepted: compat, compat_ct$"),
])
def test_ct_bucket_refused(monkeypatch, kw, pattern):
    """The constant-time binary needs the policy's public bucket (an int up to the
    table's capacity, or int32 per-request buckets); the others refuse one."""
    _on_cuda(monkeypatch)
    with pytest.raises(ValueError, match=pattern):
        prefill_sm90(*cpu_step(), scale=0.1, check=False, **kw)


def test_prefill_steps_route_to_the_compat_binaries(monkeypatch):
    """ops.step_kernel: prefill steps of strict/request go to the csrc CT binary on
    an sm_90 GPU, policy off's to the compat binary; decode steps do not go to
    them; an older GPU keeps every step on Triton. The plan names the binary."""
    from dhp_backend.ops import dispatch, plan, step_kernel
    from dhp_backend.ops.cuda_prefill import COMPAT, COMPAT_CT, routes_prefill_ct

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    spec = dispatch.ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                                block_size=16, device_capability=(9, 0))
    plan.clear_caches()
    try:
        assert routes_prefill_ct(spec)[0]
        for policy in ("strict", "request"):
            assert step_kernel(spec, policy, 4096, 2) == plan.CUDA_PREFILL_CT
            assert step_kernel(spec, policy, 16, 16) != plan.CUDA_PREFILL_CT  # a decode step
        assert step_kernel(spec, "off", 4096, 2) == plan.CUDA_PREFILL
        strict = plan.plan_step(spec, "strict", num_tokens=4096, num_reqs=2, max_blocks=512, bucket_l=8192,
                                num_sms=132)
        assert (strict.kernel, strict.prefill_variant) == (plan.CUDA_PREFILL_CT, COMPAT_CT)
        off = plan.plan_step(spec, "off", num_tokens=4096, num_reqs=2, max_blocks=512, num_sms=132)
        assert (off.kernel, off.prefill_variant) == (plan.CUDA_PREFILL, COMPAT)
        assert "csrc/prefill_sm90.cu, compat_ct binary" in strict.describe()
        hopperless = dataclasses.replace(spec, device_capability=(8, 0))
        assert not routes_prefill_ct(hopperless)[0]
        assert step_kernel(hopperless, "strict", 4096, 2) == dispatch.TRITON
    finally:
        plan.clear_caches()


def test_entry_argtypes_follow_the_c_signature(monkeypatch):
    """The ctypes argument list of dhp_prefill_sm90 is the C entry point's, parameter for
    parameter (a stale list would pass wrong values to the kernel, not fail)."""
    from dhp_backend.ops import cuda_prefill

    fn = types.SimpleNamespace()
    monkeypatch.setattr(cuda_prefill, "load", lambda *a, **k: types.SimpleNamespace(dhp_prefill_sm90=fn))
    cuda_prefill._entry.cache_clear()
    try:
        assert cuda_prefill._entry() is fn
        assert fn.argtypes == c_signature("prefill_sm90.cu", "dhp_prefill_sm90")
    finally:
        cuda_prefill._entry.cache_clear()
