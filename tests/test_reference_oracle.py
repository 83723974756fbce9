"""The reference path against a float64 dense oracle over many seeded random steps."""

from __future__ import annotations

import random

import pytest
import torch

from dhp_backend.ops import paged_attention
from paged_batch import KINDS, Request, assert_close_to_oracle, make_batch, oracle, random_requests

BLOCK_SIZES = (1, 16, 32, 128, 48)  # 48: not a power of two
HEAD_SIZES = (64, 80, 96, 128, 256)
# (num_heads, num_kv_heads): GQA ratios 1, 2, 4, 8 and MQA
HEAD_LAYOUTS = ((4, 4), (4, 2), (8, 2), (8, 1), (16, 2), (2, 2), (6, 1))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

NUM_SPECS = 520
CHUNKS = 13


def spec_for(seed: int) -> dict:
    rng = random.Random(seed)
    block_size = BLOCK_SIZES[seed % len(BLOCK_SIZES)]
    kind = KINDS[(seed // len(BLOCK_SIZES)) % len(KINDS)]
    num_heads, num_kv_heads = rng.choice(HEAD_LAYOUTS)
    max_len = 64 if block_size == 1 else 300  # block size 1 means one block per token
    return dict(
        requests=random_requests(rng, kind, rng.randint(1, 5), max_len=max_len),
        num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=rng.choice(HEAD_SIZES), block_size=block_size,
        dtype=rng.choice(DTYPES), seed=seed,
        causal=rng.random() < 0.85,
        pad_tokens=rng.choice((0, 0, 0, 3)),
        garbage=rng.choice(("large", "nan", "zero")),
        extra_columns=rng.randint(0, 3),
    ), kind


def run_reference(batch, **kw):
    out = torch.full((batch.num_tokens + 2,) + tuple(batch.query.shape[1:]), float("nan"),
                     dtype=batch.query.dtype)
    paged_attention(*batch.args(), out, scale=batch.scale, causal=batch.causal, policy="off",
                    num_tokens=batch.num_tokens, path="reference", **kw)
    return out


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_reference_matches_float64_oracle(chunk):
    per = NUM_SPECS // CHUNKS
    kinds_seen = set()
    for seed in range(chunk * per, (chunk + 1) * per):
        spec, kind = spec_for(seed)
        kinds_seen.add(kind)
        batch = make_batch(**spec)
        out = run_reference(batch)
        # rows past num_tokens are the caller's: untouched (still NaN)
        assert torch.isnan(out[batch.num_tokens:]).all(), f"seed {seed}: wrote past num_tokens"
        assert_close_to_oracle(out[:batch.num_tokens], oracle(batch), spec["dtype"],
                               what=f"seed {seed} ({kind}, {spec['dtype']}, bs={spec['block_size']}, "
                                    f"d={spec['head_size']}, heads={spec['num_heads']}/{spec['num_kv_heads']})")
    assert kinds_seen == set(KINDS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_cases(dtype):
    cases = {
        "single token, empty context": [Request(0, 1)],
        "decode with context of one block exactly": [Request(16, 1)],
        "prefill exactly filling blocks": [Request(0, 32)],
        "chunk starting mid-block": [Request(5, 20)],
        "zero-length padded requests (CUDA-graph padding)": [Request(0, 0), Request(10, 1), Request(0, 0)],
        "many decodes of different lengths": [Request(n, 1) for n in (0, 1, 15, 16, 17, 100)],
    }
    for name, reqs in cases.items():
        batch = make_batch(reqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                           seed=7, pad_tokens=2)
        out = run_reference(batch)
        assert_close_to_oracle(out[:batch.num_tokens], oracle(batch), dtype, what=name)
        # padding rows after the last request are defined zeros
        assert (out[batch.num_tokens - 2:batch.num_tokens] == 0).all(), name


def test_reference_bits_independent_of_batch_and_repeatable():
    """G3 on the reference: a request's bits alone == inside shuffled batches, and every run."""
    rng = random.Random(3)
    reqs = random_requests(rng, "mixed", 6)
    full = make_batch(reqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seed=11)
    out_full = run_reference(full)
    again = run_reference(full)
    assert torch.equal(out_full[:full.num_tokens], again[:full.num_tokens])

    starts = full.query_start_loc.tolist()
    for r in range(len(reqs)):
        # the same request alone: same logical data, different cache placement
        solo = make_batch([reqs[r]], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seed=99 + r)
        solo.query = full.query[starts[r]:starts[r + 1]].clone()
        solo.keys, solo.values = [full.keys[r]], [full.values[r]]
        # rewrite the solo cache with the full batch's logical K/V for that request
        table = solo.block_table[0]
        for p in range(reqs[r].seq_len):
            b, o = int(table[p // 16]), p % 16
            solo.key_cache[b, :, o] = full.keys[r][p]
            solo.value_cache[b, :, o] = full.values[r][p]
        out_solo = run_reference(solo)
        assert torch.equal(out_solo[:reqs[r].q_len], out_full[starts[r]:starts[r + 1]]), f"request {r}"


def test_strided_cache_views_like_vllm():
    """The adapter hands K and V as strided views into one [B, H, 2, N, D] buffer."""
    reqs = [Request(40, 1), Request(0, 30), Request(20, 9)]
    batch = make_batch(reqs, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=5)
    nb, hkv, bs, d = batch.key_cache.shape
    pages = torch.stack([batch.key_cache, batch.value_cache], dim=2).contiguous()  # [B, H, 2, N, D]
    batch.key_cache, batch.value_cache = pages[:, :, 0], pages[:, :, 1]
    assert not batch.key_cache.is_contiguous()
    out = run_reference(batch)
    assert_close_to_oracle(out[:batch.num_tokens], oracle(batch), torch.float32, what="strided views")
