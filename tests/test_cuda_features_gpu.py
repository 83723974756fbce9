"""The csrc Hopper kernels with a layer's model features (issue 31): sliding windows, logits
soft-caps and attention sinks, on their feature libraries (`cuda_build.feature_library`,
csrc/v2_arith.cuh DHP_WINDOW / DHP_SOFTCAP / DHP_SINKS; docs/kernels.md section 7, "Features"),
on an sm_90 GPU.

- accuracy against the reference over random packed steps (prompts and chunks on cached
  context, windows below, at and above a block, a 128-position step and a 512-position split,
  and past every length; soft-cap 50 and 30; sinks (one head's -inf), in float32 and bf16; GQA 4
  and 7; fp16 and bf16; block sizes 16-128);
- every prefill row's bits equal the decode kernel's for the same position (split and fold
  mode), chunked prefill = whole prefill, the constant-time walks (v2_ct, the decode CT
  binaries, one bucket and per-request buckets, on tables that obey the address rule) give
  policy off's bits;
- under policy off the pages below the window may be vLLM's null block full of NaN/inf
  (its sliding-window manager frees them): the same bits as with the real pages;
- a window past every length gives the plain library's bits;
- ops.paged_attention routes a head-128 layer with any of the features to the csrc kernels under
  every policy.

Needs nvcc (the feature libraries are built on first use). Run:
``pytest -m gpu tests/test_cuda_features_gpu.py``.
"""

import dataclasses
import random

import pytest
import torch

from triton_steps import (Request, assemble, bits, csrc_decode, csrc_prefill, drop_pages_below_window,
                          feature_tensors, make_request, next_pow2, random_requests, reference, rel_err, reserved_step)

from dhp_backend.ops import paged_attention
from dhp_backend.ops.cuda_build import find_nvcc
from dhp_backend.ops.cuda_prefill import V2, V2_CT, unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or unavailable_reason() is not None,
                       reason="needs an sm_90 GPU"),
    pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc to build csrc/"),
]

SCALE = 0.0883
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (name, features): Mistral-7B-v0.1's window, Gemma-2's cap, both, and windows at the edges
FEATURES = [
    ("W4096", dict(sliding_window=4096)),
    ("W100", dict(sliding_window=100)),
    ("W129", dict(sliding_window=129)),
    ("W512", dict(sliding_window=512)),
    ("W1", dict(sliding_window=1)),
    ("cap50", dict(logits_soft_cap=50.0)),
    ("cap30+W700", dict(logits_soft_cap=30.0, sliding_window=700)),
    ("sinks", dict(sinks="f32")),
    ("W128+sinks", dict(sliding_window=128, sinks="model")),  # gpt-oss's local layers (sinks in the model dtype)
    ("cap50+W300+sinks", dict(logits_soft_cap=50.0, sliding_window=300, sinks="f32")),
]


def materialize(feats, H, seed, dtype=torch.bfloat16):
    return feature_tensors(feats, H, seed, dtype)


def prefill(step, feats, *, variant=V2, bucket=None):
    return csrc_prefill(step, feats, scale=SCALE, variant=variant, bucket=bucket)


def decode(step, feats, *, mode=None, bucket=None):
    return csrc_decode(step, feats, scale=SCALE, mode=mode, bucket=bucket)


def random_reqs(rng, gen, n, H, Hkv, dtype, max_len=1400):
    return random_requests(rng, gen, n, H, Hkv, dtype, max_len=max_len)


@pytest.mark.parametrize("name,feats", FEATURES, ids=[n for n, _ in FEATURES])
@pytest.mark.parametrize("H,Hkv,dtype,bs", [(32, 8, torch.bfloat16, 16), (28, 4, torch.float16, 64),
                                             (16, 16, torch.bfloat16, 128)], ids=["gqa4", "gqa7", "mha"])
def test_matches_reference_and_the_decode_kernel_bits(name, feats, H, Hkv, dtype, bs):
    rng = random.Random(hash((name, H, bs)) & 0xFFFF)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    feats = materialize(feats, H, 1, dtype)
    for trial in range(3):
        reqs = random_reqs(rng, gen, rng.randint(1, 4), H, Hkv, dtype)
        step = assemble(reqs, block_size=bs, gen=gen, pad_tokens=rng.choice([0, 5]), extra_rows=3)
        n = int(step.query_start_loc[-1])
        what = f"{name} trial {trial} {[(r.q_len, r.seq_len) for r in reqs]}"
        ref = reference(step, scale=SCALE, causal=True, **{k: (v.float() if k == "sinks" else v)
                                                           for k, v in feats.items()})
        out = prefill(step, feats)
        assert rel_err(out, ref, n) < TOL[dtype], what
        assert (out[n: step.num_tokens] == 0).all(), f"padding rows must be zero: {what}"
        assert torch.isnan(out[step.num_tokens:].float()).all(), f"rows at/after num_tokens written: {what}"
        for mode in (None, "fold"):  # None: split mode where the launcher picks it (few tokens)
            assert torch.equal(bits(decode(step, feats, mode=mode)[: step.num_tokens]),
                               bits(out[: step.num_tokens])), f"decode/{mode} differs from the prefill: {what}"
        assert torch.equal(bits(prefill(step, feats)[:n]), bits(out[:n])), f"not repeatable: {what}"


@pytest.mark.parametrize("name,feats", [f for f in FEATURES if "sliding_window" in f[1]],
                         ids=[n for n, f in FEATURES if "sliding_window" in f])
def test_null_pages_below_the_window_change_no_bit(name, feats):
    """Policy off with vLLM's sliding-window KV manager: the pages wholly below each request's first row's
    window hold the null block 0, full of NaN/inf here; prefill and decode give the bits of the full table."""
    rng = random.Random(len(name))
    feats = materialize(feats, 32, 2)
    gen = torch.Generator(device="cuda").manual_seed(17)
    for bs in (16, 64):
        reqs = [make_request(rng.randint(1, 300), rng.randint(1500, 3000), H=32, Hkv=8, D=128, dtype=torch.bfloat16,
                             gen=gen) for _ in range(4)]  # chunks on cached context
        step = assemble(reqs, block_size=bs, gen=gen)
        dropped = drop_pages_below_window(step, feats["sliding_window"], gen=gen)
        assert (dropped.block_table == 0).any() or feats["sliding_window"] >= 1500  # (W4096: nothing dropped)
        full = bits(prefill(step, feats)[: step.num_tokens])
        assert torch.equal(bits(prefill(dropped, feats)[: step.num_tokens]), full), f"prefill, {name}, bs {bs}"
        for mode in (None, "fold"):
            got = decode(dropped, feats, mode=mode)[: step.num_tokens]
            assert torch.equal(bits(got), full), f"decode/{mode}, {name}, bs {bs}"
        # decode steps (one token per request) in split mode: the split schedule and the merge start at the
        # window's first split
        dec = [make_request(1, rng.randint(1, 6000), H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
               for _ in range(5)]
        step = assemble(dec, block_size=bs, gen=gen)
        dropped = drop_pages_below_window(step, feats["sliding_window"], gen=gen)
        full = bits(prefill(step, feats)[: step.num_tokens])
        for mode in ("split", "fold"):
            got = decode(dropped, feats, mode=mode)[: step.num_tokens]
            assert torch.equal(bits(got), full), f"decode step/{mode}, {name}, bs {bs}"


def test_chunked_prefill_and_decode_give_the_whole_prefill_bits():
    """A windowed, capped request computed as one prefill, as chunks on their cached context (edges
    inside and on steps and splits, windows reaching across them) and token by token as decode steps."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    for feats in (dict(sliding_window=300), materialize(dict(sliding_window=1024, logits_soft_cap=50.0,
                                                             sinks="f32"), 32, 4)):
        full = make_request(2100, 2100, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
        whole = prefill(assemble([full], block_size=16, gen=gen), feats)[:2100]
        for a, b in ((0, 1), (127, 128), (128, 600), (511, 1024), (1024, 2100), (1700, 2100)):
            chunk = Request(q=full.q[a:b], k=full.k[:b], v=full.v[:b])
            got = prefill(assemble([chunk], block_size=16, gen=gen), feats)[: b - a]
            assert torch.equal(bits(got), bits(whole[a:b])), f"chunk [{a}, {b}) {feats}"
        positions = (0, 1, 299, 300, 301, 511, 512, 1023, 1024, 1025, 2099)  # (split mode: few tokens)
        step = assemble([Request(q=full.q[p: p + 1], k=full.k[: p + 1], v=full.v[: p + 1]) for p in positions],
                        block_size=16, gen=gen)
        for mode in ("split", "fold"):
            got = decode(step, feats, mode=mode)[: len(positions)]
            assert torch.equal(bits(got), bits(whole[list(positions)])), f"decode/{mode} {feats}"


CT_FEATURES = [f for f in FEATURES if f[0] in ("W100", "cap50", "cap30+W700", "W128+sinks", "cap50+W300+sinks")]


@pytest.mark.parametrize("name,feats", CT_FEATURES, ids=[n for n, _ in CT_FEATURES])
@pytest.mark.parametrize("H,Hkv,bs", [(32, 8, 16), (28, 4, 32)], ids=["gqa4", "gqa7"])
def test_constant_time_walks_have_the_policy_off_bits(name, feats, H, Hkv, bs):
    """v2_ct and the decode CT binaries, one bucket (strict) and per-request buckets (request), each on a
    table that obeys its address rule (NaN/inf in the reserved pages past the true lengths): policy off's
    bits, the whole bucket walked whatever the window."""
    rng = random.Random(hash((name, H)) & 0xFFFF)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    feats = materialize(feats, H, 3)
    for trial in range(2):
        reqs = random_reqs(rng, gen, rng.randint(1, 4), H, Hkv, torch.bfloat16, max_len=900)
        longest = max(r.seq_len for r in reqs)
        width = -(-max(longest, 1100) // bs) + 1
        for policy in ("strict", "request"):
            step = reserved_step(reqs, policy, block_size=bs, width=width, gen=gen, pad_tokens=5, extra_rows=3)
            off = bits(prefill(step, feats)[: step.num_tokens])
            bucket = step.capacity if policy == "strict" else torch.tensor(
                [min(step.capacity, next_pow2(r.seq_len)) for r in reqs], dtype=torch.int32, device="cuda")
            what = f"{name} {policy} {[(r.q_len, r.seq_len) for r in reqs]}"
            got = prefill(step, feats, variant=V2_CT, bucket=bucket)
            assert torch.equal(bits(got[: step.num_tokens]), off), f"v2_ct: {what}"
            for mode in (None, "fold"):
                dec = decode(step, feats, mode=mode, bucket=bucket)
                assert torch.equal(bits(dec[: step.num_tokens]), off), f"decode CT/{mode}: {what}"


def test_a_sink_of_minus_infinity_gives_the_plain_bits():
    """A head whose sink is -inf: its rows have the bits of a layer without sinks (the fold is an exact
    no-op); the other heads' rows differ."""
    gen = torch.Generator(device="cuda").manual_seed(37)
    rng = random.Random(37)
    step = assemble(random_reqs(rng, gen, 4, 32, 8, torch.bfloat16), block_size=16, gen=gen)
    sinks = torch.full((32,), float("-inf"), device="cuda")
    sinks[5] = 1.0
    plain = bits(prefill(step, {})[: step.num_tokens])
    for out in (prefill(step, dict(sinks=sinks)), decode(step, dict(sinks=sinks))):
        got = bits(out[: step.num_tokens])
        others = [h for h in range(32) if h != 5]
        assert torch.equal(got[:, others], plain[:, others])
        assert not torch.equal(got[:, 5], plain[:, 5])


def test_a_window_past_every_length_gives_the_plain_bits():
    gen = torch.Generator(device="cuda").manual_seed(29)
    rng = random.Random(29)
    step = assemble(random_reqs(rng, gen, 5, 32, 8, torch.bfloat16), block_size=16, gen=gen, pad_tokens=3)
    plain = bits(prefill(step, {})[: step.num_tokens])
    assert torch.equal(bits(prefill(step, dict(sliding_window=1 << 20))[: step.num_tokens]), plain)
    assert torch.equal(bits(decode(step, dict(sliding_window=1 << 20))[: step.num_tokens]), plain)


def test_paged_attention_routes_windowed_and_capped_layers_to_the_csrc_kernels(monkeypatch):
    """ops.paged_attention (path auto): a layer with a window, a soft-cap and sinks runs its prefill, mixed
    and decode steps on the csrc kernels under every policy (policy off's bits)."""
    from dhp_backend.ops import ProblemSpec, cuda_decode, cuda_prefill, plan_step

    calls = []
    for module, name in ((cuda_prefill, "prefill_sm90"), (cuda_decode, "decode_sm90")):
        real = getattr(module, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, k.get("sliding_window"), k.get("logits_soft_cap"), k.get("sinks") is not None))
            return _real(*a, **k)

        monkeypatch.setattr(module, name, spy)
    feats = materialize(dict(sliding_window=700, logits_soft_cap=50.0, sinks="model"), 32, 5)
    gen = torch.Generator(device="cuda").manual_seed(31)
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
            for q, s in ((600, 1500), (1, 900), (1, 2000))]
    decodes = [make_request(1, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for s in (17, 1200, 3000)]
    for batch, kernel in ((reqs, "prefill_sm90"), (decodes, "decode_sm90")):
        off = None
        for policy in ("off", "strict", "request"):
            step = reserved_step(batch, policy, block_size=16, width=256, gen=gen,
                                 pad_tokens=4 if kernel == "prefill_sm90" else 0)
            calls.clear()
            out = torch.full_like(step.query, float("nan"))
            paged_attention(*step.args(), out, scale=SCALE, causal=True, policy=policy, bucket=step.bucket(policy),
                            num_tokens=step.num_tokens, max_model_len=step.capacity, **feats)
            assert calls == [(kernel, 700, 50.0, True)], (policy, calls)
            got = bits(out[: step.num_tokens])
            off = got if off is None else off
            assert torch.equal(got, off), f"{policy} differs from off"
    spec = ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                       block_size=16, device_capability=torch.cuda.get_device_capability(), sliding_window=4096,
                       logits_soft_cap=50.0, sinks=True)
    for policy in ("off", "strict"):
        p = plan_step(spec, policy, num_tokens=64, num_reqs=64, max_blocks=512,
                      bucket_l=8192 if policy == "strict" else None)
        assert p.kernel.startswith("cuda_decode") and "sliding window 4096" in p.binary(), p.describe()
        assert "attention sinks" in p.binary(), p.describe()
        head64 = plan_step(dataclasses.replace(spec, head_size=64), policy, num_tokens=64, num_reqs=64,
                           max_blocks=512, bucket_l=8192 if policy == "strict" else None)
        assert head64.kernel == p.kernel, head64.describe()  # gpt-oss: the head-64 feature library
        head256 = plan_step(dataclasses.replace(spec, head_size=256), policy, num_tokens=64, num_reqs=64,
                            max_blocks=512, bucket_l=8192 if policy == "strict" else None)
        assert head256.kernel == p.kernel, head256.describe()  # Gemma-2: the head-256 feature library
