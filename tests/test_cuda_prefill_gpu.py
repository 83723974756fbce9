"""The csrc Hopper prefill kernel (ops.cuda_prefill) on an sm_90 GPU: accuracy
against the reference over random packed steps (GQA/MHA/MQA, fp16/bf16, block
sizes 16-128, causal and full, chunked prefill with cached context, NaN/inf
garbage in every cache slot and block-table entry no request owns), padding rows
zero and rows past num_tokens untouched, repeatable bits, batch invariance (a
request's rows alone = inside any batch), chunked prefill = whole prefill, and
every row's bits equal to the csrc decode kernel's for the same position (the
arithmetic contract, docs/kernels.md section 7: what lets ops.paged_attention run
a layer's prefill, mixed and decode steps on the two kernels).
The constant-time binary (``v2_ct``) runs on block tables that obey the address
rule (design.md section 2: each request owns distinct pages up to its bucket,
`testing.pages.reserved_table`), with NaN/inf garbage in the reserved pages past the
true lengths.

Needs nvcc (the kernel is built on first use). Run:
``pytest -m gpu tests/test_cuda_prefill_gpu.py``.
"""

import random

import pytest
import torch

from triton_steps import (Request, assemble, bits, make_request, random_requests, reference, rel_err,
                          reserved_step)

from dhp_backend.ops.cuda_build import find_nvcc
from dhp_backend.ops import paged_attention
from dhp_backend.ops.cuda_decode import decode_sm90
from dhp_backend.ops.cuda_prefill import V2, V2_CT, prefill_sm90, unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or unavailable_reason() is not None,
                       reason="needs an sm_90 GPU"),
    pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc to build csrc/"),
]

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def run(step, causal, variant=V2, out=None):
    out = torch.full_like(step.query, float("nan")) if out is None else out
    return prefill_sm90(*step.args(), out, scale=0.0883, causal=causal, num_tokens=step.num_tokens, variant=variant)


def run_decode(step, causal):
    """Every row of the step through the csrc decode kernel (token tiles: each query token
    its own CTA row with its causal limit): the bits every prefill row must have."""
    out = torch.full_like(step.query, float("nan"))
    return decode_sm90(*step.args(), out, scale=0.0883, causal=causal, num_tokens=step.num_tokens)


def random_reqs(rng, gen, n, H, Hkv, dtype, max_len=700):
    return random_requests(rng, gen, n, H, Hkv, dtype, max_len=max_len)


@pytest.mark.parametrize("H,Hkv,dtype,bs", [
    (32, 8, torch.bfloat16, 16), (32, 8, torch.float16, 16), (16, 16, torch.bfloat16, 32),
    (8, 1, torch.float16, 64), (32, 2, torch.bfloat16, 128),
    # GQA ratios that are not powers of two: Qwen2.5-7B's 7, Qwen3-14B's 5, and 3
    (28, 4, torch.bfloat16, 16), (40, 8, torch.bfloat16, 32), (6, 2, torch.float16, 64),
])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference(H, Hkv, dtype, bs, causal):
    rng = random.Random(H * 1000 + bs + causal)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    for trial in range(4):
        reqs = random_reqs(rng, gen, rng.randint(1, 5), H, Hkv, dtype)
        step = assemble(reqs, block_size=bs, gen=gen, pad_tokens=rng.choice([0, 5]), extra_rows=3)
        n = int(step.query_start_loc[-1])
        ref = reference(step, scale=0.0883, causal=causal)
        out = run(step, causal)
        err = rel_err(out, ref, n)
        assert err < TOL[dtype], f"trial {trial}: rel err {err:.2e} for {[(r.q_len, r.seq_len) for r in reqs]}"
        assert (out[n: step.num_tokens] == 0).all(), "padding rows must be zero"
        assert torch.isnan(out[step.num_tokens:].float()).all(), "rows at/after num_tokens were written"
        decode_bits = bits(run_decode(step, causal)[: step.num_tokens])
        assert torch.equal(bits(out[: step.num_tokens]), decode_bits), (
            f"differs from the decode kernel's bits for {[(r.q_len, r.seq_len) for r in reqs]}")
        again = run(step, causal)
        assert torch.equal(bits(again[:n]), bits(out[:n])), "not repeatable bit for bit"


def test_batch_invariant():
    rng = random.Random(7)
    gen = torch.Generator(device="cuda").manual_seed(7)
    target = make_request(300, 900, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
    alone = run(assemble([target], block_size=16, gen=gen), True)[:300]
    for n_other in (1, 3, 7):
        others = random_reqs(rng, gen, n_other, 32, 8, torch.bfloat16)
        pos = rng.randint(0, n_other)
        batch = others[:pos] + [target] + others[pos:]
        step = assemble(batch, block_size=16, gen=gen)
        q0 = int(step.query_start_loc[pos])
        got = run(step, True)[q0: q0 + 300]
        assert torch.equal(bits(got), bits(alone)), f"request's bits changed with {n_other} others at {pos}"


def test_chunked_prefill_and_decode_give_the_whole_prefill_bits():
    """prefill = chunked prefill = decode for every position: a request's rows computed
    as one prefill, as chunks on their cached context (chunk edges inside and on
    128-position steps and 512-position splits), and token by token as decode steps,
    at GQA 4 and 7, in fp16 and bf16."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    for H, Hkv, dtype in ((32, 8, torch.bfloat16), (28, 4, torch.float16)):
        full = make_request(1500, 1500, H=H, Hkv=Hkv, D=128, dtype=dtype, gen=gen)
        whole = run(assemble([full], block_size=16, gen=gen), True)[:1500]
        for a, b in ((0, 1), (0, 127), (127, 128), (128, 600), (511, 1024), (1024, 1500), (700, 1500)):
            chunk = Request(q=full.q[a:b], k=full.k[:b], v=full.v[:b])
            got = run(assemble([chunk], block_size=16, gen=gen), True)[: b - a]
            assert torch.equal(bits(got), bits(whole[a:b])), f"chunk [{a}, {b}) at {H}/{Hkv}"
        positions = (0, 1, 63, 64, 127, 128, 511, 512, 513, 1499)
        decodes = [Request(q=full.q[p: p + 1], k=full.k[: p + 1], v=full.v[: p + 1]) for p in positions]
        step = assemble(decodes, block_size=16, gen=gen)
        for mode in ("split", "fold"):
            out = torch.full_like(step.query, float("nan"))
            decode_sm90(*step.args(), out, scale=0.0883, causal=True, num_tokens=step.num_tokens, mode=mode)
            assert torch.equal(bits(out[: len(positions)]), bits(whole[list(positions)])), f"decode/{mode} {H}/{Hkv}"


def test_paged_attention_routes_off_prefill_and_mixed_steps(monkeypatch):
    """ops.paged_attention (path auto, policy off) runs a prefill step and a mixed step
    (a chunk and decodes) on the csrc v2 binary, a decode step on the decode kernel;
    every row has the bits of the other kernel for the same step."""
    from dhp_backend.ops import cuda_prefill

    calls = []  # the variant of each csrc prefill launch
    real = cuda_prefill.prefill_sm90

    def spy(*a, **k):
        calls.append(k.get("variant"))
        return real(*a, **k)

    monkeypatch.setattr(cuda_prefill, "prefill_sm90", spy)
    gen = torch.Generator(device="cuda").manual_seed(11)
    mixed = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for q, s in ((700, 900), (1, 300))]
    mixed += [make_request(1, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for s in (17, 2000, 513)]
    for reqs in (mixed[:1] + [make_request(300, 300, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)], mixed):
        calls.clear()
        step = assemble(reqs, block_size=16, gen=gen, pad_tokens=4)
        out = torch.full_like(step.query, float("nan"))
        paged_attention(*step.args(), out, scale=0.0883, causal=True, policy="off", num_tokens=step.num_tokens)
        assert calls == [cuda_prefill.V2], f"a policy-off prefill or mixed step did not run on the v2 binary: {calls}"
        assert torch.equal(bits(out[: step.num_tokens]), bits(run_decode(step, True)[: step.num_tokens]))
    calls.clear()
    decode = assemble([make_request(1, 500, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for _ in range(4)],
                      block_size=16, gen=gen)
    paged_attention(*decode.args(), torch.empty_like(decode.query), scale=0.0883, causal=True, policy="off")
    assert not calls, "a decode step was routed to the prefill kernel"


def test_interleaved_kv_cache_views():
    """vLLM's cache layout: K and V of a slot side by side ([blocks, Hkv, bs, 2, D]),
    so the K and V views have a slot stride of 2 * D, not D."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for q, s in ((300, 500), (64, 64))]
    step = assemble(reqs, block_size=16, gen=gen)
    kv = torch.stack([step.key_cache, step.value_cache], dim=3)  # [blocks, Hkv, bs, 2, D]
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    assert k.stride(2) == 256
    out = torch.full_like(step.query, float("nan"))
    prefill_sm90(step.query, k, v, step.block_table, step.query_start_loc, step.seq_lens, out, scale=0.0883,
                 causal=True, num_tokens=step.num_tokens, variant=V2)
    assert torch.equal(bits(out[: step.num_tokens]), bits(run(step, True)[: step.num_tokens]))


# ---- the constant-time walk (v2_ct) ------------------------------------------------

def next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


def run_ct(step, causal, bucket):
    out = torch.full_like(step.query, float("nan"))
    return prefill_sm90(*step.args(), out, scale=0.0883, causal=causal, num_tokens=step.num_tokens,
                        variant=V2_CT, bucket=bucket)


@pytest.mark.parametrize("H,Hkv,dtype,bs", [
    (32, 8, torch.bfloat16, 16), (32, 8, torch.float16, 16), (16, 16, torch.bfloat16, 32),
    (8, 1, torch.float16, 64), (32, 2, torch.bfloat16, 128),
    # GQA ratios that are not powers of two: Qwen2.5-7B's 7, Qwen3-14B's 5, and 3
    (28, 4, torch.bfloat16, 16), (40, 8, torch.bfloat16, 32), (6, 2, torch.float16, 64),
])
@pytest.mark.parametrize("causal", [True, False])
def test_ct_has_the_policy_off_bits(H, Hkv, dtype, bs, causal):
    """v2_ct under one bucket (strict) and per-request buckets (request), each on a
    table that obeys that policy's address rule: the policy-off bits (of this kernel
    and of the decode kernel, off and on its constant-time walk); padding
    rows 0, rows past num_tokens untouched, NaN/inf garbage in every unowned slot
    and in the reserved pages past the true lengths."""
    rng = random.Random(H * 7 + bs + causal)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    for trial in range(3):
        reqs = random_reqs(rng, gen, rng.randint(1, 5), H, Hkv, dtype)
        longest = max(r.seq_len for r in reqs)
        width = max(-(-rng.choice([longest, 2 * longest, 1100]) // bs) + 1, -(-longest // bs) + 1)
        pad_tokens = rng.choice([0, 5, 130])
        for policy in ("strict", "request"):
            step = reserved_step(reqs, policy, block_size=bs, width=width, gen=gen, pad_tokens=pad_tokens,
                                 extra_rows=3)
            n = int(step.query_start_loc[-1])
            off_bits = bits(run(step, causal)[: step.num_tokens])
            ref = reference(step, scale=0.0883, causal=causal)
            bucket = step.capacity if policy == "strict" else torch.tensor(
                [min(step.capacity, next_pow2(r.seq_len)) for r in reqs], dtype=torch.int32, device="cuda")
            got = run_ct(step, causal, bucket)
            what = f"{policy} L={bucket if isinstance(bucket, int) else bucket.tolist()} " \
                   f"{[(r.q_len, r.seq_len) for r in reqs]}"
            assert rel_err(got, ref, n) < TOL[dtype], what
            assert (got[n: step.num_tokens] == 0).all(), f"padding rows must be zero: {what}"
            assert torch.isnan(got[step.num_tokens:].float()).all(), f"rows at/after num_tokens written: {what}"
            assert torch.equal(bits(got[: step.num_tokens]), off_bits), f"differs from policy off's bits: {what}"
            dec = torch.full_like(step.query, float("nan"))
            decode_sm90(*step.args(), dec, scale=0.0883, causal=causal, num_tokens=step.num_tokens, bucket=bucket)
            assert torch.equal(bits(dec[: step.num_tokens]), off_bits), f"decode kernel {policy} differs: {what}"


def test_ct_many_requests_and_surplus_tiles():
    """More requests than the CTA has threads (the tile count's second chunk), one-
    and two-token prefills (surplus tiles), and a last tile that reaches past the
    query tensor (Q rows are read mod its length)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    rng = random.Random(3)
    reqs = [make_request(q, q + rng.randint(0, 40), H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
            for q in [rng.choice([1, 2, 33]) for _ in range(450)]]
    step = reserved_step(reqs, "strict", block_size=16, width=8, gen=gen, pad_tokens=7)  # max_model_len 128
    n = int(step.query_start_loc[-1])
    got = run_ct(step, True, 128)
    assert torch.equal(bits(got[: step.num_tokens]), bits(run(step, True)[: step.num_tokens]))
    assert torch.equal(bits(got[: step.num_tokens]), bits(run_decode(step, True)[: step.num_tokens]))
    assert (got[n: step.num_tokens] == 0).all()


def test_paged_attention_routes_strict_prefill_steps_to_ct(monkeypatch):
    from dhp_backend.ops import cuda_prefill

    calls = []
    real = cuda_prefill.prefill_sm90

    def spy(*a, **k):
        calls.append(k.get("bucket"))
        return real(*a, **k)

    monkeypatch.setattr(cuda_prefill, "prefill_sm90", spy)
    gen = torch.Generator(device="cuda").manual_seed(12)
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
            for q, s in ((700, 900), (300, 300))]
    step = reserved_step(reqs, "strict", block_size=16, width=128, gen=gen, pad_tokens=4)  # max_model_len 2048
    out = torch.full_like(step.query, float("nan"))
    paged_attention(*step.args(), out, scale=0.0883, causal=True, policy="strict", bucket=2048,
                    num_tokens=step.num_tokens)
    assert calls == [2048], "a strict prefill step did not run on the csrc CT binary"
    assert torch.equal(bits(out[: step.num_tokens]), bits(run(step, True)[: step.num_tokens]))
