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
    (dict(D=112), r"query's shape is \(10, 32, 112\); accepted: \[num_tokens, num_heads, D\] with D in \{64, 80, 96, 128, 256\}"),
    (dict(bs=8), r"the block size is 8; accepted: 16, 32, 64, 128"),
    (dict(dtype=torch.float32), r"query's dtype is torch.float32; accepted: torch.bfloat16 or torch.float16"),
    (dict(Hkv=5), r"the number of KV heads is 5 for 32 query heads"),
    (dict(H=32, Hkv=1), r"the number of KV heads is 1 for 32 query heads; accepted: .*ratio <= 16"),
])
def test_shapes_refused(monkeypatch, kw, pattern):
    # Validation past the device check: pretend the tensors are on CUDA.
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=pattern):
        validate(*cpu_step(**kw), num_tokens=10)


def test_tile_tokens_follow_the_constant_time_tile_of_the_head_size(monkeypatch):
    """The constant-time tile is 128 rows (64 at head 256: one consumer warpgroup, csrc kRows) of GROUP
    rounded up to a power of two; the tile count that bounds the grid follows it."""
    from dhp_backend.ops.cuda_prefill import tile_tokens

    assert [tile_tokens(g) for g in (1, 2, 4, 7, 8, 16)] == [128, 64, 32, 16, 16, 8]
    assert [tile_tokens(g, 256) for g in (1, 2, 4, 7, 8, 16)] == [64, 32, 16, 8, 8, 4]
    assert tile_tokens(4, 64) == tile_tokens(4, 96) == tile_tokens(4, 128) == 32
    # 2,097,152 tokens at GQA 2: 65,536 tiles of 32 tokens at head 256 (of 64, 32,768, at head 128): past the limit
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    q = torch.empty(1, 16, 256, dtype=torch.bfloat16).expand(2_097_152, 16, 256)  # (no 2 M rows allocated)
    kc = torch.zeros(4, 8, 16, 256, dtype=torch.bfloat16)
    step = (q, kc, kc.clone(), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32),
            torch.tensor([10], dtype=torch.int32), q)
    with pytest.raises(ValueError, match=r"num_tokens / 32 \+ num_seqs \+ 1 <= 65535 tiles"):
        validate(*step, num_tokens=2_097_152)


def test_head_256_running_states_have_a_slot_for_every_sm90_sm_id():
    """Head 256's policy-off prefill keeps each SM's running states (2 warpgroups x 64 rows x 256 fp32)
    in slot %smid of the workspace's split area: enough slots for sm_90's 144 SM ids; no other head
    size takes any."""
    from dhp_backend.ops.cuda_prefill import RUN_SLOT_BYTES, run_state

    cpu = torch.device("cpu")
    ptr, slots = run_state(cpu, dict(head=256))
    assert ptr is not None and RUN_SLOT_BYTES == 2 * 64 * 256 * 4
    assert slots >= 144
    for head in (64, 80, 96, 128):
        assert run_state(cpu, dict(head=head)) == (None, 0)


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
    (dict(variant="v2_ct"), r"bucket is missing; accepted: a bucket with variant 'v2_ct' and none"),
    (dict(variant="v2", bucket=64), r"bucket is given; accepted: a bucket with variant 'v2_ct'"),
    (dict(variant="v2_ct", bucket=65), r"bucket is 65; accepted: an int in \[1, block_table.shape\[1\] \* "
                                           r"block_size = 64\]"),
    (dict(variant="v2_ct", bucket=0), r"bucket is 0; accepted: an int in \[1, "),
    (dict(variant="v2_ct", bucket=True), r"bucket is True; accepted: an int in \[1, "),
    (dict(variant="v2_ct", bucket=torch.tensor([64], dtype=torch.int64)),
     r"bucket is a torch.int64 tensor of shape \(1,\) on cuda:0; accepted: an int, or an int32 tensor of 1 "),
    (dict(variant="v2_ct", bucket=torch.tensor([64, 64], dtype=torch.int32)),
     r"bucket is a torch.int32 tensor of shape \(2,\)"),
    (dict(variant="nope"), r"variant is 'nope'; accepted: v2, v2_ct$"),
])
def test_ct_bucket_refused(monkeypatch, kw, pattern):
    """The constant-time binary needs the policy's public bucket (an int up to the
    table's capacity, or int32 per-request buckets); the others refuse one."""
    _on_cuda(monkeypatch)
    with pytest.raises(ValueError, match=pattern):
        prefill_sm90(*cpu_step(), scale=0.1, check=False, **kw)


def test_a_layer_runs_every_step_on_one_family(monkeypatch):
    """ops.step_kernel: on an sm_90 GPU a layer the csrc kernels take runs prefill and
    mixed steps on the csrc prefill kernel (v2 / v2_ct binary) and decode steps on the
    csrc decode kernel, under every policy; a layer they do not take (an older GPU, a
    group over 16, a soft-cap) runs every step, decode steps included, on Triton: the
    two families' bits differ, so a layer never mixes them. The plan names the binary."""
    from dhp_backend.ops import dispatch, plan, step_kernel
    from dhp_backend.ops.cuda_prefill import V2, V2_CT, routes_prefill_ct

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    spec = dispatch.ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                                block_size=16, device_capability=(9, 0))
    plan.clear_caches()
    steps = {"prefill": (4096, 2), "mixed": (2048 + 63, 64), "decode": (16, 16)}
    try:
        assert routes_prefill_ct(spec)[0]
        for policy, pre, dec in (("strict", plan.CUDA_PREFILL_CT, plan.CUDA_DECODE_CT),
                                 ("request", plan.CUDA_PREFILL_CT, plan.CUDA_DECODE_CT),
                                 ("off", plan.CUDA_PREFILL, plan.CUDA_DECODE)):
            got = {kind: step_kernel(spec, policy, *nr) for kind, nr in steps.items()}
            assert got == {"prefill": pre, "mixed": pre, "decode": dec}, (policy, got)
        strict = plan.plan_step(spec, "strict", num_tokens=4096, num_reqs=2, max_blocks=512, bucket_l=8192,
                                num_sms=132)
        assert (strict.kernel, strict.prefill_variant) == (plan.CUDA_PREFILL_CT, V2_CT)
        off = plan.plan_step(spec, "off", num_tokens=4096, num_reqs=2, max_blocks=512, num_sms=132)
        assert (off.kernel, off.prefill_variant) == (plan.CUDA_PREFILL, V2)
        assert "csrc/prefill_sm90.cu, v2_ct binary" in strict.describe()
        others = {"an older GPU": dataclasses.replace(spec, device_capability=(8, 0)),
                  "group 32": dataclasses.replace(spec, num_heads=64, num_kv_heads=2),
                  "head size 112 with sinks": dataclasses.replace(spec, head_size=112, sinks=True)}
        for what, other in others.items():
            assert not plan.layer_family(other)[0], what
            for policy in ("strict", "request", "off"):
                for kind, nr in steps.items():
                    assert step_kernel(other, policy, *nr) == dispatch.TRITON, (what, policy, kind)
        assert "at most 16" in plan.step_route(others["group 32"], "off", 16, 16)[1]
    finally:
        plan.clear_caches()


def test_a_failed_build_refuses_both_csrc_kernels(monkeypatch):
    """One csrc library failing to build sends every step of the layer to Triton, the
    other kernel's steps included (a layer never mixes the two arithmetics)."""
    from dhp_backend.ops import cuda_common, dispatch, plan, step_kernel

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(cuda_common, "_BUILD_FAILED", {"prefill_sm90.cu": "nvcc: error"})
    spec = dispatch.ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                                block_size=16, device_capability=(9, 0))
    plan.clear_caches()
    try:
        assert step_kernel(spec, "off", 16, 16) == dispatch.TRITON  # a decode step
        assert "prefill_sm90.cu failed to build" in plan.step_route(spec, "off", 16, 16)[1]
    finally:
        plan.clear_caches()


def test_entry_argtypes_follow_the_c_signature(monkeypatch):
    """The ctypes argument list of dhp_prefill_sm90 is the C entry point's, parameter for
    parameter (a stale list would pass wrong values to the kernel, not fail)."""
    from dhp_backend.ops import cuda_prefill

    fn = types.SimpleNamespace()
    monkeypatch.setattr(cuda_prefill, "load", lambda *a, **k: types.SimpleNamespace(dhp_prefill_sm90=fn,
                                                                       dhp_prefill_sm90_head_size=lambda: 128))
    cuda_prefill._entry.cache_clear()
    try:
        assert cuda_prefill._entry() is fn
        assert fn.argtypes == c_signature("prefill_sm90.cu", "dhp_prefill_sm90")
    finally:
        cuda_prefill._entry.cache_clear()

