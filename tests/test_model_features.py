"""Logits soft-capping, attention sinks and sliding windows (issue 31): the
reference against a float64 oracle over random batch specs, the seam's validation
of the three arguments, and the plan's routing of such layers to the Triton kernels.

The Triton kernels with these features: tests/test_triton_interpret.py (CPU
interpreter) and tests/test_triton_gpu.py (CUDA).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from dhp_backend.ops import ProblemSpec, paged_attention, plan, plan_step, step_kernel
from dhp_backend.ops.attention import check_sliding_window
from paged_batch import (
    KINDS, Request, assert_close_to_oracle, drop_pages_below_window, make_batch, oracle, random_requests,
)

CAPS = (None, 0.5, 2.0, 50.0)  # scaled scores here are O(1): 0.5 and 2 bite, 50 (Gemma-2's) barely
NUM_SPECS = 64


def _features(rng: random.Random, num_heads: int, dtype: torch.dtype):
    cap = rng.choice(CAPS)
    sinks = None
    if cap is None or rng.random() < 0.6:
        sinks = torch.tensor([rng.gauss(0.0, 2.0) for _ in range(num_heads)])
        if rng.random() < 0.3:
            sinks[rng.randrange(num_heads)] = float("-inf")  # a head without a sink
        sinks = sinks.to(rng.choice((torch.float32, dtype)))  # float32, or the model dtype as vLLM hands it
    return cap, sinks


def _run(batch, **kw):
    out = torch.full((batch.num_tokens + 2,) + tuple(batch.query.shape[1:]), float("nan"), dtype=batch.query.dtype)
    paged_attention(*batch.args(), out, scale=batch.scale, causal=batch.causal, policy="off",
                    num_tokens=batch.num_tokens, path="reference", **kw)
    return out


def _random_batch(rng: random.Random, seed: int, *, causal: bool | None = None):
    """A random step of the seed's kind (decodes, prefills, chunks, mixed): heads,
    dtype, block size, head size, padding rows and stale garbage drawn from ``rng``;
    causal in 85 % of them unless ``causal`` is given."""
    kind = KINDS[seed % len(KINDS)]
    num_heads, num_kv_heads = rng.choice(((4, 4), (4, 2), (8, 2), (8, 1), (6, 1)))
    dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
    block_size = rng.choice((1, 16, 32, 48))
    reqs = random_requests(rng, kind, rng.randint(1, 4), max_len=64 if block_size == 1 else 200)
    head_size = rng.choice((64, 80, 128))
    causal = rng.random() < 0.85 if causal is None else causal
    return make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                      block_size=block_size, dtype=dtype, seed=seed, causal=causal,
                      pad_tokens=rng.choice((0, 0, 3)), garbage=rng.choice(("large", "nan"))), kind


@pytest.mark.parametrize("chunk", range(4))
def test_reference_with_soft_cap_and_sinks_matches_float64_oracle(chunk):
    per = NUM_SPECS // 4
    seen = set()
    for seed in range(chunk * per, (chunk + 1) * per):
        rng = random.Random(1000 + seed)
        batch, kind = _random_batch(rng, seed)
        num_heads, dtype = batch.num_heads, batch.query.dtype
        cap, sinks = _features(rng, num_heads, dtype)
        seen.add((cap is not None, sinks is not None))
        out = _run(batch, logits_soft_cap=cap, sinks=sinks)
        assert torch.isnan(out[batch.num_tokens:]).all(), f"seed {seed}: wrote past num_tokens"
        ref = oracle(batch, logits_soft_cap=cap, sinks=sinks)
        assert_close_to_oracle(out[:batch.num_tokens], ref, dtype,
                               what=f"seed {seed} ({kind}, {dtype}, cap {cap}, sinks {sinks is not None})")
    assert seen >= {(True, False), (False, True), (True, True)}


def test_the_features_change_the_result_as_the_oracle_says():
    """Guards the oracle itself: a cap and sinks move the output, and a cap far
    above every score or sinks of -inf do not."""
    batch = make_batch([Request(30, 1), Request(0, 17)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                       seed=3)
    plain = oracle(batch)
    assert (oracle(batch, logits_soft_cap=0.5) - plain).abs().max() > 1e-2
    assert (oracle(batch, sinks=torch.full((4,), 2.0)) - plain).abs().max() > 1e-2
    assert torch.allclose(oracle(batch, logits_soft_cap=1e6), plain, atol=1e-9)
    assert torch.allclose(oracle(batch, sinks=torch.full((4,), float("-inf"))), plain, rtol=0, atol=1e-12)
    # the reference: a cap of 0 is vLLM's "no cap" (same bits as None)
    n = batch.num_tokens
    assert torch.equal(_run(batch, logits_soft_cap=0)[:n], _run(batch)[:n])
    # sinks only shrink each row: out = plain * sum / (sum + e^sink)
    big = oracle(batch, sinks=torch.full((4,), 30.0))
    assert big.abs().max() < 1e-6


def _small():
    return make_batch([Request(5, 2)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=1)


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf"), True, "50", torch.tensor([50.0])])
def test_bad_soft_cap_is_refused_naming_it(cap):
    with pytest.raises(ValueError, match=r"paged_attention: logits_soft_cap is .*; accepted: None \(or 0\) for "
                                         r"no cap, or a finite positive real number"):
        _run(_small(), logits_soft_cap=cap)


@pytest.mark.parametrize("sinks,pattern", [
    (torch.zeros(3), r"sinks is of shape \(3,\); accepted: one logit per query head: \[4\]"),
    (torch.zeros(4, 1), r"sinks is 2-D with shape \(4, 1\); accepted: a 1-D tensor"),
    (torch.zeros(4, dtype=torch.int32), r"sinks is of dtype torch.int32; accepted: torch.float32"),
    (torch.zeros(4, dtype=torch.float16), r"sinks is of dtype torch.float16; accepted: torch.float32$"),
    (torch.zeros(8)[::2], r"sinks is strided with stride 2; accepted: a contiguous tensor"),
    ([0.0] * 4, r"sinks is of type list; accepted: a torch.Tensor"),
    (torch.tensor([0.0, float("nan"), 1.0, float("inf")]),
     r"sinks is NaN or \+inf at heads \[1, 3\]; accepted: finite per-head logits \(-inf: no sink"),
])
def test_bad_sinks_are_refused_naming_them(sinks, pattern):
    with pytest.raises(ValueError, match=pattern):
        _run(_small(), sinks=sinks)  # the small batch is float32: float32 sinks only


def test_sinks_in_the_query_dtype_are_accepted():
    batch = make_batch([Request(5, 2)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=1,
                       dtype=torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0])
    a = _run(batch, sinks=sinks.to(torch.bfloat16))
    b = _run(batch, sinks=sinks.to(torch.bfloat16).float())
    assert torch.equal(a[:batch.num_tokens], b[:batch.num_tokens])


CUDA_SPEC = dict(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8, block_size=16,
                 causal=True, device_capability=(9, 0))


@pytest.mark.parametrize("features", [dict(sinks=True), dict(logits_soft_cap=30.0, sinks=True),
                                      dict(sliding_window=128, sinks=True), dict(logits_soft_cap=50.0)])
def test_featured_layers_the_csrc_kernels_refuse_run_every_step_on_triton(with_nvcc, features):
    plain = ProblemSpec(**CUDA_SPEC)
    # 32 query heads per KV head: more than the csrc kernels take (every head size the Triton kernels take is
    # also a csrc head size)
    spec = ProblemSpec(**{**CUDA_SPEC, "num_heads": 64, "num_kv_heads": 2}, **features)
    steps = [("off", 64, 64), ("off", 4096, 1), ("strict", 16, 16), ("strict", 4096, 1), ("request", 48, 16)]
    # the plain layer goes to the csrc kernels on these steps (so the routing below is the features')
    assert any(step_kernel(plain, p, n, r) != plan.TRITON for p, n, r in steps)
    for p, n, r in steps:
        assert step_kernel(spec, p, n, r) == plan.TRITON, (p, n, r)
        sp = plan_step(spec, p, num_tokens=n, num_reqs=r, max_blocks=512,
                       bucket_l=8192 if p == "strict" else None, num_sms=132)
        assert sp.kernel == plan.TRITON
        assert "32 query heads per KV head" in plan.step_route(spec, p, n, r)[1]
        for words in spec.features:
            assert words in sp.binary() and words in sp.describe()


@pytest.mark.parametrize("features", [dict(logits_soft_cap=50.0), dict(sliding_window=4096), dict(sinks=True),
                                      dict(logits_soft_cap=30.0, sliding_window=1024),
                                      dict(sliding_window=128, sinks=True)])
def test_featured_head_128_layers_run_every_step_on_the_csrc_feature_libraries(with_nvcc, monkeypatch, features):
    """A head-128 layer with a window, a soft-cap and/or sinks runs every step on the csrc kernels, as a plain
    one, and its start-up preparation builds its feature libraries (cuda_build.feature_library), not the
    plain ones."""
    from dhp_backend.ops import cuda_build

    spec = ProblemSpec(**CUDA_SPEC, **features)
    steps = [("off", 64, 64, plan.CUDA_DECODE), ("off", 4096, 1, plan.CUDA_PREFILL),
             ("strict", 16, 16, plan.CUDA_DECODE_CT), ("strict", 4096, 1, plan.CUDA_PREFILL_CT),
             ("request", 48, 16, plan.CUDA_PREFILL_CT)]
    for p, n, r, kernel in steps:
        assert step_kernel(spec, p, n, r) == kernel, (p, n, r)
        if kernel.startswith("cuda_prefill"):
            sp = plan_step(spec, p, num_tokens=n, num_reqs=r, max_blocks=512,
                           bucket_l=8192 if p == "strict" else None, num_sms=132)
            for words in spec.features:
                assert words in sp.binary() and words in sp.describe()
    built = []
    monkeypatch.setattr(cuda_build, "build", lambda name, source, flags=cuda_build.SM90A: built.append(
        (name, source, flags)) or name)
    assert plan.prepare_kernels(spec) == [name for name, _, _ in built]
    window, cap, sinks = "sliding_window" in features, "logits_soft_cap" in features, "sinks" in features
    want = {cuda_build.feature_library(lib, window=window, softcap=cap, sinks=sinks) for lib in cuda_build.LIBRARIES}
    assert set(built) == want and len(built) == 2
    for name, _, flags in built:
        assert ("-DDHP_WINDOW=1" in flags) == window and ("-DDHP_SOFTCAP=1" in flags) == cap
        assert ("-DDHP_SINKS=1" in flags) == sinks
        assert name.endswith(("_window", "_softcap", "_sinks")) and name.startswith(("dhp_decode_sm90",
                                                                                     "dhp_prefill_sm90"))


def test_feature_arguments_of_the_csrc_launchers():
    from dhp_backend.ops.cuda_common import feature_args

    lib, tail = feature_args("t", 0.125, True, None, None)
    assert lib == dict(window=False, softcap=False, sinks=False, head=128) and tail == (0, 0.0, 0.0, None)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)  # head 64 (gpt-oss): the head-64 libraries
    lib, tail = feature_args("t", 0.125, True, 4096, 50.0, torch.tensor([0.5, 1.0, -2.0, float("-inf")],
                                                                         dtype=torch.bfloat16), q)
    assert lib == dict(window=True, softcap=True, sinks=True, head=64) and tail[0] == 4096
    assert tail[3].dtype == torch.float32 and tail[3].tolist() == [0.5, 1.0, -2.0, float("-inf")]
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.float16), [0.0] * 4):
        with pytest.raises(ValueError, match="sinks is .*accepted: None or a \\[num_heads\\] tensor"):
            feature_args("t", 0.125, True, None, None, bad, q)
    # head 64: v2::soft_cap's saturating form (1 - 2 / (2^(s * pre) + 1)) * post
    assert tail[1] == pytest.approx(2 * 0.125 * math.log2(math.e) / 50)
    assert tail[2] == pytest.approx(50 * math.log2(math.e))
    # head 256 (kTanhCap): tanh.approx(s * pre) * post
    _, tail256 = feature_args("t", 0.125, True, None, 50.0, None, torch.zeros(3, 4, 256, dtype=torch.bfloat16))
    assert tail256[1] == pytest.approx(0.125 / 50) and tail256[2] == tail[2]
    for bad, match in ((dict(sliding_window=0), "sliding_window is 0"), (dict(sliding_window=True), "sliding_window"),
                       (dict(logits_soft_cap=-1.0), "logits_soft_cap is -1.0"),
                       (dict(logits_soft_cap=float("inf")), "logits_soft_cap is inf")):
        with pytest.raises(ValueError, match=match):
            feature_args("t", 0.125, True, bad.get("sliding_window"), bad.get("logits_soft_cap"))
    with pytest.raises(ValueError, match="causal=False"):
        feature_args("t", 0.125, False, 128, None)


@pytest.mark.parametrize("head", [64, 96, 128, 256])
def test_soft_cap_constants_give_the_cap_in_each_heads_form(head):
    """csrc/v2_arith.cuh soft_cap's two forms (tanh at head 256, the saturating ex2 form elsewhere),
    evaluated here in float64 with the host's constants: both give c * tanh(s * scale / c) * log2(e),
    saturating at +-c * log2(e), so a constant of the wrong form (a factor 2 log2(e) off) fails."""
    from dhp_backend.ops.cuda_common import soft_cap_constants

    scale, c = 0.0625, 30.0
    pre, post = soft_cap_constants(scale, c, head)
    s = torch.tensor([-1e6, -900.0, -40.0, -1.0, 0.0, 0.5, 7.0, 300.0, 1e6], dtype=torch.float64)
    want = c * torch.tanh(s * scale / c) * math.log2(math.e)
    if head == 256:
        got = torch.tanh(s * pre) * post
    else:
        got = (1 - 2 / (torch.exp2(s * pre) + 1)) * post
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9), (head, got, want)


def test_run_refuses_sinks_the_plan_was_not_made_for():
    batch = _small()
    spec = ProblemSpec(device_type="cpu", dtype="float32", head_size=64, num_heads=4, num_kv_heads=2, block_size=16)
    out = torch.zeros_like(batch.query)
    p = plan_step(spec, "off", num_tokens=batch.num_tokens, num_reqs=1, max_blocks=batch.block_table.shape[1],
                  path="reference", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"plan.run: sinks is a tensor; accepted: None, as the plan was made for"):
        plan.run(p, *batch.args(), out, scale=0.1, causal=True, bucket=None, sinks=torch.zeros(4))
    p2 = plan_step(dataclasses.replace(spec, sinks=True), "off", num_tokens=batch.num_tokens, num_reqs=1,
                   max_blocks=batch.block_table.shape[1], path="reference", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"plan.run: sinks is None; accepted: a \[num_heads\] tensor"):
        plan.run(p2, *batch.args(), out, scale=0.1, causal=True, bucket=None)


def test_info_lists_the_features_and_plans_them_by_head_size(capsys, with_nvcc):
    import json

    from dhp_backend import cli

    assert cli.main(["info", "--device", "cuda", "--json", "--logits-soft-cap", "50", "--sinks"]) == 0
    r = json.loads(capsys.readouterr().out)
    for case in r["cases"].values():  # head 128 (info's default): the csrc feature library
        assert case["kernel"].startswith("cuda_"), case
        assert "logits soft-cap 50" in case["binary"] and "attention sinks" in case["binary"]
    for head, family in ((64, "cuda_"), (256, "cuda_")):  # gpt-oss, Gemma-2: the head-64 / head-256 libraries
        assert cli.main(["info", "--device", "cuda", "--json", "--logits-soft-cap", "50", "--sinks",
                         "--head-size", str(head)]) == 0
        r = json.loads(capsys.readouterr().out)
        assert set(r["features"]) == {"logits_soft_cap", "sinks", "sliding_window"}
        for name in ("logits_soft_cap", "sinks", "sliding_window"):
            assert "Triton kernels" in r["features"][name] and "csrc Hopper kernels" in r["features"][name]
            assert "(head 256, 128, 96, 80, 64)" in r["features"][name]  # cuda_build.HEAD_SIZES, formatted
        for case in r["cases"].values():
            assert case["kernel"].startswith(family), (head, case)
            assert "logits soft-cap 50" in case["binary"] and "attention sinks" in case["binary"]
    # the text report names a head-64 layer's library and the build line that makes it ahead of time
    assert cli.main(["info", "--device", "cuda", "--head-size", "64", "--sinks", "--sliding-window", "128"]) == 0
    text = capsys.readouterr().out
    assert "csrc/decode_sm90.cu (library dhp_decode_sm90_window_sinks_h64)" in text
    assert "(`dhp-backend build --head 64 --features window,sinks` builds it now)" in text
    with pytest.raises(SystemExit):
        cli.main(["info", "--logits-soft-cap", "-3"])


def test_info_plans_a_windowed_layer_on_the_csrc_kernels_and_normalises_a_window_past_the_context(
        capsys, with_nvcc):
    import json

    from dhp_backend import cli

    assert cli.main(["info", "--device", "cuda", "--json", "--sliding-window", "1024", "--max-model-len",
                     "8192"]) == 0
    r = json.loads(capsys.readouterr().out)
    for case in r["cases"].values():
        assert case["kernel"].startswith("cuda_") and "sliding window 1024" in case["binary"], case
    # Phi-3.5-mini's window, larger than the context: no window, the plain routing
    assert cli.main(["info", "--device", "cuda", "--json", "--sliding-window", "262144", "--max-model-len",
                     "131072"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert all("sliding window" not in (case["binary"] or "") for case in r["cases"].values())
    for bad in ("0", "-5", "1.5", "x"):
        with pytest.raises(SystemExit):
            cli.main(["info", "--sliding-window", bad])


# --- sliding windows ---------------------------------------------------------------------------
# The window against the block size (the kernels' page walk) and the context.
WINDOW_KINDS = ("below a block", "a block", "above a block", "the context or more")


def _window(rng: random.Random, kind: str, block_size: int, reqs: list) -> int:
    longest = max(r.seq_len for r in reqs)
    if kind == "below a block":
        return rng.randint(1, max(1, block_size - 1))
    if kind == "a block":
        return block_size
    if kind == "above a block":
        return rng.randint(block_size + 1, max(block_size + 2, longest - 1))
    return rng.choice((longest, longest + rng.randint(1, 40), 10 ** 6))


@pytest.mark.parametrize("chunk", range(4))
def test_reference_with_sliding_window_matches_float64_oracle(chunk):
    """Random steps of decodes, prefills and chunks, with windows below, at and
    above the block size and past the context, alone and with caps and sinks; in
    half of them the pages below each request's window hold vLLM's null block
    (NaN here), which the reference never reads."""
    per = NUM_SPECS // 4
    seen = set()
    for seed in range(chunk * per, (chunk + 1) * per):
        rng = random.Random(5000 + seed)
        batch, kind = _random_batch(rng, seed, causal=True)
        num_heads, dtype, block_size = batch.num_heads, batch.query.dtype, batch.key_cache.shape[2]
        wkind = WINDOW_KINDS[(seed // len(KINDS)) % len(WINDOW_KINDS)]
        window = _window(rng, wkind, block_size, batch.requests)
        cap, sinks = _features(rng, num_heads, dtype) if seed % 2 else (None, None)
        dropped = rng.random() < 0.5
        if dropped:
            batch = drop_pages_below_window(batch, window)
        out = _run(batch, logits_soft_cap=cap, sinks=sinks, sliding_window=window)
        assert torch.isnan(out[batch.num_tokens:]).all(), f"seed {seed}: wrote past num_tokens"
        ref = oracle(batch, logits_soft_cap=cap, sinks=sinks, sliding_window=window)
        assert_close_to_oracle(out[:batch.num_tokens], ref, dtype,
                               what=f"seed {seed} ({kind}, {dtype}, window {window} ({wkind}, block {block_size}), "
                                    f"cap {cap}, sinks {sinks is not None}, null pages {dropped})")
        seen.add((wkind, cap is not None or sinks is not None))
    assert seen == {(w, f) for w in WINDOW_KINDS for f in (False, True)}, seen


def test_the_window_changes_the_result_as_vllm_defines_it():
    """Guards the oracle and pins vLLM's off-by-one: W = 1 sees the row's own
    position only (out = v_i), W = 2 sees i - 1 and i, a window past every
    context changes nothing."""
    batch = make_batch([Request(30, 1), Request(0, 17), Request(9, 6)], num_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=3)
    plain = oracle(batch)
    assert (oracle(batch, sliding_window=8) - plain).abs().max() > 1e-2
    assert torch.equal(oracle(batch, sliding_window=36), plain)  # 36 >= every seq_len
    own = torch.cat([v[r.context:].double().repeat_interleave(2, dim=1) for r, v in zip(batch.requests,
                                                                                         batch.values)])
    assert torch.allclose(oracle(batch, sliding_window=1), own, rtol=0, atol=1e-12)
    n = batch.num_tokens
    assert torch.allclose(_run(batch, sliding_window=1)[:n].double(), own, rtol=0, atol=1e-6)
    # W = 2: the last row of the prefill sees positions 15 and 16 only
    q = batch.query[1 + 16].double()  # [H, D]
    k, v = batch.keys[1][15:17].double(), batch.values[1][15:17].double()  # [2, Hkv, D]
    p = torch.softmax(torch.einsum("hd,khd->hk", q, k.repeat_interleave(2, dim=1)) * batch.scale, dim=-1)
    want = torch.einsum("hk,khd->hd", p, v.repeat_interleave(2, dim=1))
    assert torch.allclose(oracle(batch, sliding_window=2)[1 + 16], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [0, -2, 1.5, True, "128", torch.tensor([128]), torch.tensor(2.0)])
def test_bad_sliding_window_is_refused_naming_it(window):
    with pytest.raises(ValueError, match=r"paged_attention: sliding_window is .*; accepted: None \(or -1\) for no "
                                         r"window, or an int W >= 1"):
        _run(_small(), sliding_window=window)


def test_sliding_window_normalisation_and_the_causal_rule():
    assert check_sliding_window(None) is None and check_sliding_window(-1) is None
    assert check_sliding_window(4096) == 4096 and check_sliding_window(torch.tensor(7)) == 7
    assert check_sliding_window(4095, 4096) == 4095
    assert check_sliding_window(4096, 4096) is None and check_sliding_window(262144, 131072) is None
    batch = _small()  # seq_len 7
    with pytest.raises(ValueError, match=r"sliding_window is 4 with causal=False; accepted: a window on causal "
                                         r"attention only"):
        paged_attention(*batch.args(), torch.zeros_like(batch.query), scale=0.1, causal=False, policy="off",
                        path="reference", sliding_window=4)
    # a window the context cannot reach is no window, causal or not: the plain bits
    for causal in (True, False):
        a, b = torch.zeros_like(batch.query), torch.zeros_like(batch.query)
        paged_attention(*batch.args(), a, scale=0.1, causal=causal, policy="off", path="reference")
        paged_attention(*batch.args(), b, scale=0.1, causal=causal, policy="off", path="reference",
                        sliding_window=64, max_model_len=64)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"ProblemSpec: sliding_window is 0; accepted: None \(no window\) or an "
                                         r"int >= 1"):
        ProblemSpec(**CUDA_SPEC, sliding_window=0)
    with pytest.raises(ValueError, match=r"ProblemSpec: sliding_window is 8 with causal=False"):
        ProblemSpec(**{**CUDA_SPEC, "causal": False}, sliding_window=8)


def test_run_refuses_a_window_the_plan_was_not_made_for():
    batch = _small()
    spec = ProblemSpec(device_type="cpu", dtype="float32", head_size=64, num_heads=4, num_kv_heads=2, block_size=16,
                       sliding_window=4)
    out = torch.zeros_like(batch.query)
    p = plan_step(spec, "off", num_tokens=batch.num_tokens, num_reqs=1, max_blocks=batch.block_table.shape[1],
                  path="reference", device=torch.device("cpu"))
    assert "sliding window 4" in p.binary()
    for wrong in (None, 5):
        with pytest.raises(ValueError, match=rf"plan.run: sliding_window is {wrong}; accepted: 4, the "
                                             r"ProblemSpec.sliding_window the plan was made for"):
            plan.run(p, *batch.args(), out, scale=0.1, causal=True, bucket=None, sliding_window=wrong)
    with pytest.raises(ValueError, match=r"plan.run: causal is False with sliding_window 4; accepted: causal=True"):
        plan.run(p, *batch.args(), out, scale=0.1, causal=False, bucket=None, sliding_window=4)
    plan.run(p, *batch.args(), out, scale=0.1, causal=True, bucket=None, sliding_window=4)
    ref = torch.zeros_like(out)
    paged_attention(*batch.args(), ref, scale=0.1, policy="off", path="reference", sliding_window=4)
    assert torch.equal(out, ref)
