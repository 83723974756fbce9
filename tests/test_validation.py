"""Bad inputs to `ops.paged_attention`: each is rejected with a clear ValueError.

Every message must name the argument, show the value it got and say what is
accepted. Rejected inputs covered here:

- query: not a tensor; 2-D; integer dtype; last dimension not contiguous; zero heads
- key_cache / value_cache: dtype differs from query; on another device; shapes differ;
  head size differs from query; KV heads do not divide query heads; not 4-D
- block_table: int64 instead of int32; fewer rows than requests
- query_start_loc: wrong length; wrong dtype
- seq_lens: wrong dtype; 2-D
- out: wrong dtype; wrong head shape; fewer rows than num_tokens; non-contiguous last dim
- num_tokens: above query rows; negative; bool
- scale: zero, negative, NaN, bool, string
- causal: not a bool
- policy: unknown name
- bucket: missing under strict; given under off; above the block table's capacity;
  per-request tensor of wrong length or dtype under request; zero
- values: query_start_loc[0] != 0; decreasing query_start_loc; query longer than its
  sequence; negative length; length above the bucket; block id negative / out of range;
  length needing more blocks than the table has; last offset beyond num_tokens
- path: unknown; 'triton' when the kernels do not cover the problem
- the address rule under strict/request: a page below the bucket that is invalid or
  repeated (the caller must reserve distinct pages up to each bucket)
- policy strict with only the non-constant-time path and no explicit permission
"""

from __future__ import annotations

import re

import pytest
import torch

from dhp_backend.ops import FallbackRefused, paged_attention
from paged_batch import Request, make_batch


def base():
    b = make_batch([Request(20, 1), Request(0, 5)], num_heads=4, num_kv_heads=2, head_size=16,
                   block_size=8, seed=1, extra_columns=1)
    return dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
                block_table=b.block_table, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                out=torch.empty_like(b.query), scale=0.25, causal=True, policy="off", path="reference")


def call(**changes):
    kw = base()
    kw.update(changes)
    args = [kw.pop(k) for k in ("query", "key_cache", "value_cache", "block_table", "query_start_loc",
                                "seq_lens", "out")]
    return paged_attention(*args, **kw)


def mutate(name, fn):
    kw = base()
    return {name: fn(kw[name])}


def with_values(**tensors):
    return {k: torch.tensor(v, dtype=torch.int32) for k, v in tensors.items()}


B = base()
NB = B["key_cache"].shape[0]

CASES = [
    # (id, changes, argument named in the message)
    ("query-not-tensor", {"query": [[1.0]]}, "query"),
    ("query-2d", mutate("query", lambda q: q.reshape(q.shape[0], -1)), "query"),
    ("query-int", mutate("query", lambda q: q.to(torch.int32)), "query"),
    ("query-noncontig", mutate("query", lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)), "query"),
    ("query-zero-heads", {"query": torch.empty(6, 0, 16)}, "query"),
    ("kcache-dtype", mutate("key_cache", lambda k: k.half()), "key_cache"),
    ("kcache-device", mutate("key_cache", lambda k: k.to("meta")), "key_cache"),
    ("kcache-3d", mutate("key_cache", lambda k: k[0]), "key_cache"),
    ("vcache-shape", mutate("value_cache", lambda v: v[:-1]), "value_cache"),
    ("head-size-mismatch", {"key_cache": B["key_cache"][..., :8], "value_cache": B["value_cache"][..., :8]},
     "key_cache"),
    ("kv-heads-not-dividing", {"key_cache": torch.zeros(NB, 3, 8, 16), "value_cache": torch.zeros(NB, 3, 8, 16)},
     "key_cache"),
    ("block-table-int64", mutate("block_table", lambda t: t.long()), "block_table"),
    ("block-table-rows", mutate("block_table", lambda t: t[:1]), "block_table"),
    ("qsl-length", mutate("query_start_loc", lambda t: t[:-1]), "query_start_loc"),
    ("qsl-dtype", mutate("query_start_loc", lambda t: t.long()), "query_start_loc"),
    ("seq-lens-dtype", mutate("seq_lens", lambda t: t.float()), "seq_lens"),
    ("seq-lens-2d", mutate("seq_lens", lambda t: t[None]), "seq_lens"),
    ("out-dtype", mutate("out", lambda o: o.half()), "out"),
    ("out-shape", mutate("out", lambda o: o[:, :2]), "out"),
    ("out-rows", mutate("out", lambda o: o[:3]), "out"),
    ("out-noncontig", mutate("out", lambda o: o.transpose(1, 2).contiguous().transpose(1, 2)), "out"),
    ("num-tokens-high", {"num_tokens": 100}, "num_tokens"),
    ("num-tokens-negative", {"num_tokens": -1}, "num_tokens"),
    ("num-tokens-bool", {"num_tokens": True}, "num_tokens"),
    ("scale-zero", {"scale": 0.0}, "scale"),
    ("scale-negative", {"scale": -1.0}, "scale"),
    ("scale-nan", {"scale": float("nan")}, "scale"),
    ("scale-bool", {"scale": True}, "scale"),
    ("scale-str", {"scale": "0.1"}, "scale"),
    ("causal-int", {"causal": 1}, "causal"),
    ("policy-unknown", {"policy": "paranoid"}, "policy"),
    ("bucket-missing-strict", {"policy": "strict", "allow_fallback": True}, "bucket"),
    ("bucket-under-off", {"bucket": 64}, "bucket"),
    ("bucket-zero", {"policy": "batch", "bucket": 0, "allow_fallback": True}, "bucket"),
    ("bucket-above-table", {"policy": "strict", "bucket": 10_000, "allow_fallback": True}, "bucket"),
    ("bucket-tensor-length", {"policy": "request", "bucket": torch.tensor([32], dtype=torch.int32),
                              "allow_fallback": True}, "bucket"),
    ("bucket-tensor-dtype", {"policy": "request", "bucket": torch.tensor([32, 32]), "allow_fallback": True},
     "bucket"),
    ("qsl-not-starting-at-zero", with_values(query_start_loc=[1, 2, 6]), "query_start_loc[0]"),
    ("qsl-decreasing", with_values(query_start_loc=[0, 4, 2]), "query_start_loc[2]"),
    ("query-longer-than-sequence", with_values(seq_lens=[20, 3]), "seq_lens[1]"),
    ("negative-length", with_values(seq_lens=[-1, 5], query_start_loc=[0, 0, 5]), "seq_lens[0]"),
    ("length-above-bucket", {"policy": "strict", "bucket": 16, "allow_fallback": True}, "seq_lens[0]"),
    ("request-bucket-too-small", {"policy": "request", "bucket": torch.tensor([16, 8], dtype=torch.int32),
                                  "allow_fallback": True}, "seq_lens[0]"),
    ("block-id-negative", mutate("block_table", lambda t: t.clone().index_fill_(1, torch.tensor([0]), -1)),
     "block_table[0, 0]"),
    ("block-id-out-of-range", mutate("block_table", lambda t: t.clone().index_fill_(1, torch.tensor([0]), NB)),
     "block_table[0, 0]"),
    ("length-beyond-table", with_values(seq_lens=[50, 5]), "seq_lens[0]"),
    ("qsl-beyond-num-tokens", {"num_tokens": 4}, "query_start_loc[-1]"),
    ("path-unknown", {"path": "cuda"}, "path"),
]


@pytest.mark.parametrize("changes,argument", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_with_clear_message(changes, argument):
    with pytest.raises(ValueError) as info:
        call(**changes)
    msg = str(info.value)
    assert re.search(r"\b" + re.escape(argument), msg), f"message does not name {argument!r}: {msg}"
    assert "accepted" in msg, f"message does not say what is accepted: {msg}"


def test_triton_path_refused_when_not_covered():
    # head size 16 on the CPU is outside every kernel's coverage: a forced
    # 'triton' path is an error, never a silent substitute
    with pytest.raises(ValueError, match="path='triton'.*do not cover"):
        call(path="triton")


def test_strict_refuses_non_constant_time_fallback():
    with pytest.raises(FallbackRefused) as info:
        call(policy="strict", bucket=32, path="auto")
    msg = str(info.value)
    assert "not constant-time" in msg and "allow_fallback" in msg and "'off'" in msg


def test_valid_call_passes_and_values_check_can_be_skipped():
    out = call()
    assert torch.isfinite(out).all()
    # check_values=False skips host-side value checks (for callers that validated already)
    call(check_values=False)


# --- the address rule (design.md section 2): pages up to the bucket ------------------------
# base(): block_size 8, table width 4 (3 blocks for the 20+1-token request, 1 for the
# 5-token one, one extra column), every column a distinct page of its request.

def _table_with(r, col, value):
    t = base()["block_table"].clone()
    t[r, col] = value
    return t


@pytest.mark.parametrize("policy,bucket", [("strict", 32), ("request", 32),
                                           ("request", torch.tensor([32, 16], dtype=torch.int32))])
def test_constant_time_rejects_unreserved_page_below_the_bucket(policy, bucket):
    # request 1 (5 tokens: 1 block) with bucket >= 16 reads column 1 too: it must be a real page
    bad = _table_with(1, 1, 10_000)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\].*past the request's true length but below its "
                                         r"bucket.*reserve") as info:
        call(block_table=bad, policy=policy, bucket=bucket, allow_fallback=True)
    assert "accepted" in str(info.value)
    # policy off never reads it: accepted
    call(block_table=bad)


@pytest.mark.parametrize("policy", ["strict", "request"])
def test_constant_time_rejects_a_page_repeated_below_the_bucket(policy):
    t = base()["block_table"]
    dup = _table_with(1, 1, int(t[1, 0]))  # the padding column aliases the request's own first page
    with pytest.raises(ValueError, match=r"block_table\[1, :4\].*page .* at columns \[0, 1\].*distinct pages up "
                                         r"to the bucket"):
        call(block_table=dup, policy=policy, bucket=32, allow_fallback=True)
    call(block_table=dup)  # off: only pages below the true length are read


def test_constant_time_accepts_a_fully_reserved_table():
    out = call(policy="strict", bucket=32, allow_fallback=True)
    ref = call()
    assert torch.equal(out, ref)
    # a column past the bucket is never read: anything goes there
    call(block_table=_table_with(1, 3, -7), policy="request", bucket=torch.tensor([32, 16], dtype=torch.int32),
         allow_fallback=True)


# --- arguments are typed, and nothing weakens the promise silently (issue 34) ---------------
@pytest.mark.parametrize("value", ["no", "false", "False", "", 0, 1, [], None, "yes"])
def test_allow_fallback_must_be_a_real_bool(value):
    # a truthy string must never turn a constant-time call into the reference path
    with pytest.raises(ValueError, match=r"allow_fallback is .*; accepted: True or False \(a bool\)"):
        call(policy="strict", bucket=32, path="auto", allow_fallback=value)


def test_integer_like_arguments_are_integers():
    import numpy as np

    b = base()
    n = b["query"].shape[0]
    ref = call()
    for num_tokens in (np.int64(n), np.int32(n), torch.tensor(n)):
        assert torch.equal(call(num_tokens=num_tokens), ref)
    for bucket in (np.int64(32), torch.tensor(32, dtype=torch.int32)):
        assert torch.equal(call(policy="strict", bucket=bucket, allow_fallback=True), ref)
    for bad in (float(n), np.float64(n), torch.tensor(float(n)), True, "6"):
        with pytest.raises(ValueError, match=r"num_tokens is .*; accepted: an integer in \[0, "):
            call(num_tokens=bad)


def test_real_scales_of_any_kind_are_accepted():
    import numpy as np

    ref = call()
    for scale in (np.float32(0.25), np.float64(0.25), torch.tensor(0.25), 0.25):
        assert torch.equal(call(scale=scale), ref)


def test_path_is_case_insensitive_and_checked():
    assert torch.equal(call(path="REFERENCE"), call(path="reference"))
    with pytest.raises(ValueError, match=r"path is 1; accepted: 'auto', 'reference', 'triton'"):
        call(path=1)


def test_meta_tensors_are_refused_up_front():
    kw = base()
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=r"query is on the meta device.*accepted: tensors on a CPU or CUDA device"):
        paged_attention(*[meta.pop(k) for k in ("query", "key_cache", "value_cache", "block_table",
                                                 "query_start_loc", "seq_lens", "out")], **meta)


def test_run_refuses_tensors_of_another_geometry_than_the_plan():
    """ops.run checks the tensors against the step geometry its plan was made for."""
    from dhp_backend.ops import ProblemSpec, plan_step, run

    spec = ProblemSpec("cpu", "float32", 64, 4, 2, 16)
    plan = plan_step(spec, "off", num_tokens=3, num_reqs=2, max_blocks=4)
    q = torch.zeros(3, 4, 64)
    cache = torch.zeros(8, 2, 16, 64)
    table = torch.zeros(3, 4, dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"plan.run: the number of requests \(seq_lens\) is 3; accepted: 2"):
        run(plan, q, cache, cache, table, qsl, torch.ones(3, dtype=torch.int32), q.clone(), scale=0.1, causal=True,
            bucket=None)
    with pytest.raises(ValueError, match=r"plan.run: bucket is 64; accepted: true lengths"):
        run(plan, q, cache, cache, table[:2], qsl[:3], torch.ones(2, dtype=torch.int32), q.clone(), scale=0.1,
            causal=True, bucket=64)
    out = run(plan, q, cache, cache, table[:2], qsl[:3], torch.ones(2, dtype=torch.int32), q.clone(), scale=0.1,
              causal=True, bucket=None)
    assert out.shape == q.shape and bool((out[2] == 0).all())  # the padding row past the requests is zero
