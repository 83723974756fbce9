"""The vLLM adapter, driven the way vLLM's own backend tests drive a backend.

Metadata is built as vLLM's runner builds it (CommonAttentionMetadata with
randomly permuted blocks starting at 1, realistic slot mappings, padded
slots -1), new K/V go through ``do_kv_cache_update``, and DHP's output is
compared with the float64 oracle and with vLLM's CPU_ATTN on the same cache.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dhp_backend.config import Policy  # noqa: E402
from dhp_backend.ops import FallbackRefused  # noqa: E402
from dhp_backend.vllm import compat  # noqa: E402
from dhp_backend.vllm.backend import DHPAttentionBackend  # noqa: E402
from paged_batch import Request, assert_close_to_oracle, oracle  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
MAX_MODEL_LEN = 512


class MockLayer:
    """What forward/do_kv_cache_update read from vLLM's Attention layer."""

    def __init__(self):
        for name in ("_q_scale", "_k_scale", "_v_scale"):
            setattr(self, name, torch.tensor(1.0))
            setattr(self, name + "_float", 1.0)
        self.layer_name = "model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from integration.tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny-llama"), num_heads=NUM_HEADS,
                 num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)


def make_vllm_config(model_dir, block_size, policy="off", allow_fallback=False, **dhp):
    mc = ModelConfig(model=str(model_dir), dtype=torch.float32, max_model_len=MAX_MODEL_LEN,
                     skip_tokenizer_init=True)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size),
                      device_config=DeviceConfig(device="cpu"),
                      additional_config={"dhp": {"policy": policy, "allow_fallback": allow_fallback, **dhp}})


def make_impl(backend_cls, vllm_config, **overrides):
    args = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE ** -0.5,
                num_kv_heads=NUM_KV_HEADS, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None)
    extra = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    with set_current_vllm_config(vllm_config):
        # vLLM passes these positionally, in this order
        return backend_cls.get_impl_cls()(*args.values(), **extra)


class Step:
    """One engine step: context already cached, this step's K/V still to be written."""

    def __init__(self, requests, block_size, seed, pad_tokens=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.requests = requests
        blocks_per_req = [-(-r.seq_len // block_size) for r in requests]
        width = -(-MAX_MODEL_LEN // block_size)  # vLLM's table covers max_model_len
        # Every request owns distinct pages up to max_model_len, as vLLM reserves
        # them for DHP under strict (the address rule): valid for every policy.
        num_blocks = 1 + len(requests) * width + 4
        ids = list(range(1, num_blocks))
        rng.shuffle(ids)  # permuted blocks starting at 1 (0 is the null block)
        table = torch.zeros(len(requests), width, dtype=torch.int32)
        # stale K/V of earlier requests sit everywhere (blocks are reused unzeroed)
        self.kv_cache = torch.randn(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, generator=gen) * 30
        self.keys, self.values, queries, new_k, new_v, slots = [], [], [], [], [], []
        ctx_k, ctx_v, ctx_slots = [], [], []
        cursor = 0
        for r, req in enumerate(requests):
            table[r] = torch.tensor(ids[cursor:cursor + width], dtype=torch.int32)
            mine = ids[cursor:cursor + blocks_per_req[r]]
            cursor += width
            k = torch.randn(req.seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
            v = torch.randn(req.seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
            self.keys.append(k)
            self.values.append(v)
            for p in range(req.seq_len):
                slot = mine[p // block_size] * block_size + p % block_size
                if p < req.context:  # written by earlier steps
                    ctx_k.append(k[p])
                    ctx_v.append(v[p])
                    ctx_slots.append(slot)
                else:
                    new_k.append(k[p])
                    new_v.append(v[p])
                    slots.append(slot)
            queries.append(torch.randn(req.q_len, NUM_HEADS, HEAD_SIZE, generator=gen))
        for _ in range(pad_tokens):  # CUDA-graph style padding tokens
            new_k.append(torch.randn(NUM_KV_HEADS, HEAD_SIZE, generator=gen))
            new_v.append(torch.randn(NUM_KV_HEADS, HEAD_SIZE, generator=gen))
            slots.append(-1)
            queries.append(torch.randn(1, NUM_HEADS, HEAD_SIZE, generator=gen))
        self.context_kv = (torch.stack(ctx_k) if ctx_k else torch.empty(0, NUM_KV_HEADS, HEAD_SIZE),
                           torch.stack(ctx_v) if ctx_v else torch.empty(0, NUM_KV_HEADS, HEAD_SIZE),
                           torch.tensor(ctx_slots, dtype=torch.int64))
        self.query = torch.cat(queries)
        self.key = torch.stack(new_k)
        self.value = torch.stack(new_v)
        q_lens = [r.q_len for r in requests]
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int32)
        self.common = compat.make_common_attn_metadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
            num_reqs=len(requests), num_actual_tokens=self.query.shape[0],
            max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            causal=True, seq_lens_cpu_upper_bound=seq_lens.clone(),
        )

    def oracle(self, **features):
        from paged_batch import PagedBatch

        pb = PagedBatch(requests=self.requests, query=self.query, key_cache=None, value_cache=None,
                        block_table=None, query_start_loc=None, seq_lens=None, keys=self.keys,
                        values=self.values, num_tokens=self.query.shape[0], scale=HEAD_SIZE ** -0.5,
                        causal=True)
        return oracle(pb, **features)


def run_backend(backend_cls, vllm_config, step: Step, block_size: int, kv_cache: torch.Tensor, **impl_kw):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    builder = backend_cls.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"], vllm_config,
                                            torch.device("cpu"))
    md = builder.build(0, step.common)
    impl = make_impl(backend_cls, vllm_config, **impl_kw)
    layer = MockLayer()
    layer.isa = getattr(builder, "isa", None)  # CPU_ATTN reads it from the layer
    assert not backend_cls.forward_includes_kv_cache_update
    # earlier steps cached the context; this step writes its own tokens (slot -1 = padding).
    # Each backend writes through its own op: the cache bytes are the backend's business.
    ctx_key, ctx_value, ctx_slots = step.context_kv
    impl.do_kv_cache_update(layer, ctx_key, ctx_value, kv_cache, ctx_slots)
    impl.do_kv_cache_update(layer, step.key, step.value, kv_cache, step.common.slot_mapping)
    out = torch.full_like(step.query, float("nan"))
    impl.forward(layer, step.query, step.key, step.value, kv_cache, md, output=out)
    return out, md


STEPS = {
    "small_decode": [Request(31, 1), Request(39, 1)],
    "small_prefill": [Request(0, 8), Request(0, 40)],
    "mixed_small": [Request(31, 1), Request(39, 1), Request(43, 5), Request(51, 5)],
    "chunked_on_context": [Request(100, 37), Request(17, 64)],
    "long_mixed": [Request(300, 1), Request(0, 130), Request(200, 12), Request(5, 1)],
}


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("name", list(STEPS))
def test_dhp_matches_oracle_and_cpu_attn(model_dir, name, block_size):
    step = Step(STEPS[name], block_size, seed=hash(name) % 1000 + block_size)
    cfg = make_vllm_config(model_dir, block_size, policy="off")
    stale = step.kv_cache.clone()

    kv_dhp = step.kv_cache.clone()
    out_dhp, md = run_backend(DHPAttentionBackend, cfg, step, block_size, kv_dhp)
    assert md.policy is Policy.OFF and md.bucket is None
    assert_close_to_oracle(out_dhp, step.oracle(), torch.float32, what=f"DHP {name}")

    # the cache writes touched exactly the request slots (context + this step), nothing else
    nb, hkv = kv_dhp.shape[:2]
    pages = lambda kv: kv.view(nb, hkv, 2, block_size, HEAD_SIZE)  # noqa: E731  K page, V page
    changed = (pages(kv_dhp) != pages(stale)).any(dim=-1).any(dim=2)  # [blocks, heads, slots]
    written = torch.zeros_like(changed)
    for s in step.common.slot_mapping.tolist() + step.context_kv[2].tolist():
        if s >= 0:
            written[s // block_size, :, s % block_size] = True
    assert torch.equal(changed, written)

    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_class()
    if cpu_attn is DHPAttentionBackend:
        pytest.skip("CPU_ATTN is overridden in this process")
    kv_cpu = step.kv_cache.clone()
    out_cpu, _ = run_backend(cpu_attn, cfg, step, block_size, kv_cpu)
    # Same page split (K page, V page per block and head) but CPU_ATTN orders its
    # K page for its SIMD ISA, so the bytes differ only inside K pages of written slots.
    assert torch.equal(pages(kv_cpu)[:, :, 1], pages(kv_dhp)[:, :, 1])
    torch.testing.assert_close(out_dhp, out_cpu, rtol=1e-5, atol=1e-5)


def test_bad_soft_cap_rejected_naming_it(model_dir):
    with pytest.raises(ValueError, match=r"logits_soft_cap is -30.0; accepted: None \(or 0\) for no cap"):
        make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16), logits_soft_cap=-30.0)


@pytest.mark.parametrize("features", [dict(logits_soft_cap=1.0), dict(sinks=True),
                                      dict(logits_soft_cap=0.7, sinks=True)], ids=["cap", "sinks", "cap+sinks"])
def test_soft_cap_and_sinks_match_oracle_and_cpu_attn(model_dir, features):
    """vLLM hands the cap positionally and the sinks as ``sinks=`` (gpt-oss); DHP
    gives what the float64 oracle and vLLM's own CPU_ATTN give."""
    block_size = 16
    step = Step(STEPS["long_mixed"], block_size, seed=31, pad_tokens=2)
    kw = {}
    if features.get("logits_soft_cap"):
        kw["logits_soft_cap"] = features["logits_soft_cap"]
    if features.get("sinks"):
        kw["sinks"] = torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(3)) * 2
    cfg = make_vllm_config(model_dir, block_size, policy="off")
    out_dhp, _ = run_backend(DHPAttentionBackend, cfg, step, block_size, step.kv_cache.clone(), **kw)
    _matches_oracle_and_cpu_attn(out_dhp, cfg, step, block_size, kw, what=f"DHP {features}")


def _matches_oracle_and_cpu_attn(out_dhp, cfg, step, block_size, kw, *, what):
    """DHP's rows of a step with model features ``kw``: the float64 oracle's (the features change it on
    this step), zeros past the requests, and CPU_ATTN's on the same cache."""
    ref = step.oracle(**kw)
    assert (ref - step.oracle()).abs().max() > 1e-2  # the features matter on this step
    n = int(step.common.query_start_loc[-1])
    assert_close_to_oracle(out_dhp[:n], ref[:n], torch.float32, what=what)
    assert (out_dhp[n:] == 0).all()
    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_class()
    if cpu_attn is DHPAttentionBackend:
        pytest.skip("CPU_ATTN is overridden in this process")
    out_cpu, _ = run_backend(cpu_attn, cfg, step, block_size, step.kv_cache.clone(), **kw)
    torch.testing.assert_close(out_dhp[:n], out_cpu[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["off", "strict"])
def test_sliding_window_matches_oracle_and_cpu_attn(model_dir, policy):
    """vLLM hands the layer's window W positionally; DHP gives what the float64 oracle and CPU_ATTN
    give. Under off the table is the one vLLM's sliding-window manager hands (pages wholly below each
    request's window point at the null block, here full of NaN); under strict every page is the
    request's own (vLLM manages the layer as full attention, `compat.manage_windowed_kv_as_full`)."""
    block_size, window = 16, 40
    step = Step(STEPS["long_mixed"], block_size, seed=37, pad_tokens=2)
    if policy == "off":
        table = step.common.block_table_tensor
        step.kv_cache[0] = float("nan")
        for r, req in enumerate(step.requests):
            table[r, :max(0, req.context - window + 1) // block_size] = 0
        assert (table == 0).sum() > 10
    cfg = make_vllm_config(model_dir, block_size, policy=policy, allow_fallback=True)
    out_dhp, md = run_backend(DHPAttentionBackend, cfg, step, block_size, step.kv_cache.clone(),
                              sliding_window=window)
    _matches_oracle_and_cpu_attn(out_dhp, cfg, step, block_size, {"sliding_window": window},
                                 what=f"DHP window {window} {policy}")


@pytest.mark.parametrize("given, expected", [(None, None), (-1, None), (128, 128), (MAX_MODEL_LEN - 1, 511),
                                             (MAX_MODEL_LEN, None), (262_144, None)])
def test_sliding_window_values_vllm_hands(model_dir, given, expected):
    """vLLM 0.24 and 0.32 hand an int W or None; -1 and a W >= max_model_len (Phi-3.5's 262,144)
    are no window, decided by the seam's check: such a layer plans as a plain one."""
    impl = make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16), sliding_window=given)
    assert impl.sliding_window == expected and impl.spec.sliding_window == expected


@pytest.mark.parametrize("bad", [0, -2, 1.5, "128"])
def test_bad_sliding_window_rejected_naming_it(model_dir, bad):
    with pytest.raises(ValueError, match=r"sliding_window .*accepted: None \(or -1\) for no window"):
        make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16), sliding_window=bad)


@pytest.mark.parametrize("policy, managed_as_full", [("strict", True), ("request", True), ("off", False)])
def test_windowed_kv_cache_spec_follows_the_policy(model_dir, policy, managed_as_full):
    """vLLM asks each layer ``Attention.get_kv_cache_spec``: a DHP windowed layer under a constant-time
    policy answers vLLM's ``FullAttentionSpec(sliding_window=W)`` (same page), under off vLLM's
    ``SlidingWindowSpec``; a layer of another backend is left alone."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cfg = make_vllm_config(model_dir, 16, policy=policy, allow_fallback=True)
    impl = make_impl(DHPAttentionBackend, cfg, sliding_window=64)

    def layer(backend, impl):
        return SimpleNamespace(attn_type=AttentionType.DECODER, sliding_window=64, kv_cache_dtype="auto",
                               num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, head_size_v=HEAD_SIZE,
                               kv_cache_torch_dtype=torch.float32, attn_backend=backend, impl=impl)

    with set_current_vllm_config(cfg):
        spec = Attention.get_kv_cache_spec(layer(DHPAttentionBackend, impl), cfg)
        cpu_attn = AttentionBackendEnum.CPU_ATTN.get_class()
        other = Attention.get_kv_cache_spec(layer(cpu_attn, SimpleNamespace()), cfg)
    assert type(spec) is (FullAttentionSpec if managed_as_full else SlidingWindowSpec)
    # the page a full layer of the model has: 16 slots of K and V, 2 KV heads, float32
    assert spec.sliding_window == 64 and spec.block_size == 16 and spec.page_size_bytes == 16 * 2 * 2 * 64 * 4
    assert type(other) is SlidingWindowSpec


def test_sinks_of_another_dtype_are_refused_at_the_first_forward(model_dir):
    step = Step(STEPS["small_decode"], 16, seed=4)
    cfg = make_vllm_config(model_dir, 16, policy="off")
    with pytest.raises(NotImplementedError, match=r"DHP: paged_attention: sinks is of dtype torch.float64"):
        run_backend(DHPAttentionBackend, cfg, step, 16, step.kv_cache.clone(),
                    sinks=torch.zeros(NUM_HEADS, dtype=torch.float64))


def test_model_dtype_sinks_are_converted_once_per_weight_version(model_dir):
    """gpt-oss's bf16 sinks reach the kernels as float32 (what the csrc launchers take), converted once and
    again only when the parameter is updated in place; float32 sinks go as they are."""
    cfg = make_vllm_config(model_dir, 16, policy="off")
    sinks = torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    impl = make_impl(DHPAttentionBackend, cfg, sinks=sinks)
    first = impl._sinks_for_kernels()
    assert first.dtype == torch.float32 and torch.equal(first, sinks.float())
    assert impl._sinks_for_kernels() is first  # no conversion per launch
    with torch.no_grad():
        sinks.copy_(sinks * 2)  # a weight update in place
    again = impl._sinks_for_kernels()
    assert again is not first and torch.equal(again, sinks.float())
    f32 = torch.zeros(NUM_HEADS)
    assert make_impl(DHPAttentionBackend, cfg, sinks=f32)._sinks_for_kernels() is f32
    assert make_impl(DHPAttentionBackend, cfg)._sinks_for_kernels() is None


@pytest.mark.parametrize("policy", ["strict", "request", "off"])
def test_each_policy_same_bits(model_dir, policy):
    step = Step(STEPS["long_mixed"], 16, seed=5, pad_tokens=3)
    cfg = make_vllm_config(model_dir, 16, policy=policy, allow_fallback=True)
    out, md = run_backend(DHPAttentionBackend, cfg, step, 16, step.kv_cache.clone())
    assert md.policy is Policy(policy)
    expected_bucket = {"strict": MAX_MODEL_LEN, "off": None}
    if policy == "request":
        assert md.bucket.tolist() == [512, 256, 256, 8]
    else:
        assert md.bucket == expected_bucket[policy]
    cfg_off = make_vllm_config(model_dir, 16, policy="off")
    ref, _ = run_backend(DHPAttentionBackend, cfg_off, step, 16, step.kv_cache.clone())
    assert torch.equal(out, ref)  # the policy changes timing promises, never the result
    n = step.common.query_start_loc[-1]
    assert (out[n:] == 0).all()  # padding rows are defined zeros


def test_batch_policy_is_retired_with_a_reason(model_dir):
    with pytest.raises(ValueError, match="'batch' was retired.*address rule.*'request'"):
        make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16, policy="batch"))


def test_profile_and_dummy_runs(model_dir):
    cfg = make_vllm_config(model_dir, 16)
    impl = make_impl(DHPAttentionBackend, cfg)
    q = torch.randn(5, NUM_HEADS, HEAD_SIZE)
    out = torch.full_like(q, float("nan"))
    impl.forward(MockLayer(), q, q[:, :2], q[:, :2], torch.tensor([]), None, output=out)
    assert (out == 0).all()
    impl.do_kv_cache_update(MockLayer(), q[:, :2], q[:, :2], torch.tensor([]), torch.zeros(5, dtype=torch.int64))


@pytest.mark.parametrize("overrides,needle", [
    ({"alibi_slopes": [1.0, 2.0, 3.0, 4.0]}, "ALiBi"),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type"),
    ({"kv_cache_dtype": "fp8"}, "KV-cache dtype"),
    ({"sinks": torch.zeros(3)}, r"attention sinks of Tensor \(3,\); accepted: a \[num_heads\] = \[4\] tensor"),
    ({"use_alibi_sqrt": True}, "use_alibi_sqrt=True"),
])
def test_unsupported_features_rejected(model_dir, overrides, needle):
    cfg = make_vllm_config(model_dir, 16)
    with pytest.raises(NotImplementedError, match=needle):
        make_impl(DHPAttentionBackend, cfg, **overrides)


def test_strict_without_kernel_refuses_at_startup(model_dir):
    cfg = make_vllm_config(model_dir, 16, policy="strict")
    with pytest.raises(FallbackRefused, match="allow_fallback"):
        make_impl(DHPAttentionBackend, cfg)


def test_bad_additional_config_is_explained(model_dir):
    with pytest.raises(ValueError, match="unknown DHP policy 'fast'.*accepted"):
        make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16, policy="fast"))
    with pytest.raises(ValueError, match="unknown key.*polcy.*accepted"):
        make_impl(DHPAttentionBackend, make_vllm_config(model_dir, 16, polcy="strict"))


def test_backend_declarations():
    b = DHPAttentionBackend
    assert b.supports_batch_invariance() is True
    assert b.forward_includes_kv_cache_update is False
    assert b.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 128)
    layouts = b.supported_kv_cache_layouts()
    assert layouts is not None and [layout.name for layout in layouts] == ["LBHNC"]
    assert b.supports_attn_type(AttentionType.DECODER)
    assert not b.supports_attn_type(AttentionType.ENCODER_ONLY)
    assert b.supports_sink() and b.supports_sliding_window()
    assert torch.float32 in b.supported_dtypes
    assert b.supports_dtype(torch.bfloat16) and b.supports_kv_cache_dtype("auto")
    assert not b.supports_kv_cache_dtype("fp8")


def test_registration_alias_and_name_resolution():
    from dhp_backend.plugin import register

    register()
    register()  # idempotent
    assert AttentionBackendEnum["DHP"] is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum[DHPAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_class() is DHPAttentionBackend
    # what vLLM's config validation does with --attention-backend DHP / CUSTOM
    from vllm.config import AttentionConfig

    assert AttentionConfig(backend="DHP").backend is AttentionBackendEnum.CUSTOM
    assert AttentionConfig(backend="custom").backend is AttentionBackendEnum.CUSTOM


def test_cpu_override_only_on_request(monkeypatch):
    from dhp_backend.plugin import register

    AttentionBackendEnum.CPU_ATTN.clear_override()
    monkeypatch.delenv("DHP_OVERRIDE_CPU_ATTN", raising=False)
    register()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is not DHPAttentionBackend
    monkeypatch.setenv("DHP_OVERRIDE_CPU_ATTN", "1")
    try:
        register()
        assert AttentionBackendEnum.CPU_ATTN.get_class() is DHPAttentionBackend
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()


def test_plugin_import_is_cheap():
    """Loading the plugin module and the package must not pull in Triton or build anything."""
    def loaded_after(code):
        code += "; import sys; print(sorted(m for m in ('triton', 'torch', 'vllm') if m in sys.modules))"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().splitlines()[-1]

    # the package, its config and the plugin module: nothing heavy at all
    assert loaded_after("import dhp_backend, dhp_backend.plugin, dhp_backend.config") == "[]"
    # the attention API needs torch, but deciding kernel coverage must not import Triton
    code = ("import dhp_backend.ops as o; o.choose_path(o.ProblemSpec('cuda', 'bfloat16', 128, 32, 8, 16, "
            "True, (9, 0)), 'off')")
    assert loaded_after(code) == "['torch']"


def test_cudagraph_support_follows_path_and_policy(model_dir):
    from vllm.v1.attention.backend import AttentionCGSupport

    spec = FullAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    builder_cls = DHPAttentionBackend.get_builder_cls()
    for policy in ("strict", "off"):
        # on this CPU the reference path runs: it reads lengths on the host -> never captured
        cfg = make_vllm_config(model_dir, 16, policy=policy, allow_fallback=True)
        assert builder_cls.get_cudagraph_support(cfg, spec) is AttentionCGSupport.NEVER


def test_request_buckets_reuse_one_buffer(model_dir):
    cfg = make_vllm_config(model_dir, 16, policy="request", allow_fallback=True)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    builder = DHPAttentionBackend.get_builder_cls()(spec, ["l0"], cfg, torch.device("cpu"))
    a = builder.build(0, Step([Request(60, 1), Request(0, 9)], 16, seed=1).common).bucket
    ptr, values_a = a.data_ptr(), a.tolist()
    b = builder.build(0, Step([Request(200, 1), Request(3, 2)], 16, seed=2).common).bucket
    assert values_a == [64, 16] and b.tolist() == [256, 8]
    assert b.data_ptr() == ptr  # refilled in place: what a captured graph reads on replay


def test_builder_plans_once_and_every_layer_runs_the_plan(model_dir, monkeypatch):
    """The metadata builder plans the step once (public geometry, no tensors in the
    plan: a captured graph replays it); each layer's forward runs that plan without
    planning again, with the oracle's result."""
    import dataclasses

    from dhp_backend.vllm import backend

    cfg = make_vllm_config(model_dir, 16, policy="off")
    step = Step(STEPS["mixed_small"], 16, seed=3)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    builder = DHPAttentionBackend.get_builder_cls()(spec, ["l0", "l1"], cfg, torch.device("cpu"))
    md = builder.build(0, step.common)
    plan = md.plan
    assert (plan.num_tokens, plan.num_reqs, plan.kernel) == (step.query.shape[0], 4, "reference")
    assert plan.capacity == step.common.block_table_tensor.shape[1] * 16
    assert not any(isinstance(getattr(plan, f.name), torch.Tensor) for f in dataclasses.fields(plan))
    impl = make_impl(DHPAttentionBackend, cfg)
    planned, ran = [], []
    monkeypatch.setattr(backend, "plan_step", lambda *a, **k: planned.append(a))
    real_run = backend.run
    monkeypatch.setattr(backend, "run", lambda p, *a, **k: (ran.append(p), real_run(p, *a, **k))[1])
    kv_cache = step.kv_cache.clone()
    layer = MockLayer()
    impl.do_kv_cache_update(layer, *step.context_kv[:2], kv_cache, step.context_kv[2])
    impl.do_kv_cache_update(layer, step.key, step.value, kv_cache, step.common.slot_mapping)
    for _ in range(2):  # two layers of the step
        out = torch.full_like(step.query, float("nan"))
        impl.forward(layer, step.query, step.key, step.value, kv_cache, md, output=out)
        assert_close_to_oracle(out, step.oracle(), torch.float32, "a layer of the step")
    assert planned == [] and ran == [plan, plan]


def test_worker_warmup_is_marked_while_it_runs(monkeypatch):
    """vLLM 0.24's worker warm-up (made-up requests the scheduler never reserved for) is known to the
    check_values step check while it runs, and only then; wrapping is idempotent; a vLLM without it says so."""
    import types

    from dhp_backend.vllm import compat

    seen = []
    fake = types.ModuleType("fake_gpu_worker")
    fake.warmup_kernels = lambda *a, **k: seen.append((compat.in_worker_warmup(), a, k)) or "done"
    monkeypatch.setitem(sys.modules, "fake_gpu_worker", fake)
    monkeypatch.setattr(compat, "WARMUP_MODULE", "fake_gpu_worker")
    assert compat.mark_worker_warmup() and compat.mark_worker_warmup()
    assert not compat.in_worker_warmup()
    assert fake.warmup_kernels(1, x=2) == "done"
    assert seen == [(True, (1,), {"x": 2})] and not compat.in_worker_warmup()
    del fake.warmup_kernels
    assert not compat.mark_worker_warmup()
