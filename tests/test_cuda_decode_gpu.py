"""The csrc Hopper decode kernel (ops.cuda_decode) on an sm_90 GPU: accuracy
against the reference over random decode steps (GQA 1-16, fp16/bf16, block sizes
16-128, lengths across page, step and split boundaries, NaN/inf garbage in every
cache slot and block-table entry no request owns), padding rows zero and rows past
num_tokens untouched, and its bits equal to the csrc prefill kernel's rows for the
same positions (the arithmetic contract, docs/kernels.md section 7: prefill = chunk
= decode for every position, what lets ops.paged_attention run a layer's steps on
the two kernels) in both split modes and every split schedule; repeatable bits,
batch invariance, several query tokens per request (drafts), vLLM's K/V-interleaved
cache views, and the routing in ops.paged_attention. The constant-time walk (CT
binaries) runs on block tables that obey the address rule (design.md section 2:
each request owns distinct pages up to its bucket, `testing.pages.reserved_table`),
with NaN/inf garbage in the reserved pages past the true lengths.

Needs nvcc (the kernel is built on first use). Run:
``pytest -m gpu tests/test_cuda_decode_gpu.py``.
"""

import random

import pytest
import torch

from triton_steps import assemble, bits, make_request, reference, rel_err, reserved_step

from dhp_backend.ops import paged_attention, step_kernel
from dhp_backend.ops.cuda_build import find_nvcc
from dhp_backend.ops.cuda_decode import VARIANTS, decode_sm90
from dhp_backend.ops.cuda_common import unavailable_reason
from dhp_backend.ops.cuda_prefill import prefill_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or unavailable_reason() is not None,
                       reason="needs an sm_90 GPU"),
    pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc to build csrc/"),
]

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
SCALE = 0.0883
# Lengths at and around page (16), step (64) and split (512) boundaries.
EDGE_LENS = (1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1025, 2100)


def run(step, causal=True, variant="auto", mode=None, out=None, check=True, order=None):
    out = torch.full_like(step.query, float("nan")) if out is None else out
    return decode_sm90(*step.args(), out, scale=SCALE, causal=causal, num_tokens=step.num_tokens, variant=variant,
                       mode=mode, check=check, order=order)


def run_prefill(step, causal=True):
    """The csrc prefill kernel on the same step (each decode token a request row of its
    own tile): the rows every decode row must equal, bit for bit."""
    out = torch.full_like(step.query, float("nan"))
    return prefill_sm90(*step.args(), out, scale=SCALE, causal=causal, num_tokens=step.num_tokens)


def decode_step(rng, gen, n, H, Hkv, dtype, bs, lens=None, pad_tokens=0):
    lens = lens or [rng.choice(EDGE_LENS + (rng.randint(1, 3000),)) for _ in range(n)]
    reqs = [make_request(1, s, H=H, Hkv=Hkv, D=128, dtype=dtype, gen=gen) for s in lens]
    return assemble(reqs, block_size=bs, gen=gen, pad_tokens=pad_tokens, extra_rows=3)


@pytest.mark.parametrize("H,Hkv,dtype,bs", [
    (32, 8, torch.bfloat16, 16), (32, 8, torch.float16, 16), (16, 16, torch.bfloat16, 32),
    (8, 1, torch.float16, 64), (32, 2, torch.bfloat16, 128), (12, 4, torch.bfloat16, 16),
])
def test_matches_reference_and_prefill_bits(H, Hkv, dtype, bs):
    rng = random.Random(H * 1000 + Hkv * 10 + bs)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    for trial in range(3):
        step = decode_step(rng, gen, rng.randint(1, 9), H, Hkv, dtype, bs, pad_tokens=rng.choice([0, 3]))
        n = int(step.query_start_loc[-1])
        ref = reference(step, scale=SCALE, causal=True)
        prefill_bits = bits(run_prefill(step)[: step.num_tokens])
        for mode, order in (("split", None), ("fold", False), ("fold", True)):
            for variant in VARIANTS:
                out = run(step, variant=variant, mode=mode, order=order)
                err = rel_err(out, ref, n)
                assert err < TOL[dtype], f"trial {trial} {variant}/{mode}: rel err {err:.2e} for {step.seq_lens}"
                assert (out[n: step.num_tokens] == 0).all(), "padding rows must be zero"
                assert torch.isnan(out[step.num_tokens:].float()).all(), "rows at/after num_tokens were written"
                assert torch.equal(bits(out[: step.num_tokens]), prefill_bits), (
                    f"{variant}/{mode} differs from the prefill kernel's bits, lengths {step.seq_lens.tolist()}")
        again = run(step)
        assert torch.equal(bits(again[: step.num_tokens]), prefill_bits), "not repeatable bit for bit"


def test_long_contexts_and_split_modes_agree():
    """Many splits (32K context), every split mode and variant, against the prefill kernel's bits."""
    rng = random.Random(3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    step = decode_step(rng, gen, 3, 32, 8, torch.bfloat16, 16, lens=[32768, 9000, 4097])
    ref = reference(step, scale=SCALE, causal=True)
    want = bits(run_prefill(step)[:3])
    for mode in ("split", "fold"):
        for variant in VARIANTS:
            out = run(step, variant=variant, mode=mode)
            assert rel_err(out, ref, 3) < TOL[torch.bfloat16]
            assert torch.equal(bits(out[:3]), want), f"{variant}/{mode}"
    # The splits dealt to the CTAs otherwise (64 splits per row at 32K): same bits.
    for spp in (1, 5, 16, 64):
        out = decode_sm90(*step.args(), torch.full_like(step.query, float("nan")), scale=SCALE, causal=True,
                          num_tokens=step.num_tokens, mode="split", spp=spp)
        assert torch.equal(bits(out[:3]), want), f"split mode, spp {spp}"


def test_wide_block_table_short_walks():
    """vLLM's block table is max_model_len wide whatever the lengths, and a CUDA
    graph keeps the grid of the table's capacity: short walks in a table of 128K
    positions (256 splits per row; split mode deals a row's splits to the chunks
    round robin and the merge folds only the splits with positions), in both
    modes and every variant: the reference's values and the prefill kernel's bits
    (which folds only the splits with positions too); then captured at these
    lengths and replayed with every length grown (more splits than at capture)."""
    rng = random.Random(23)
    gen = torch.Generator(device="cuda").manual_seed(23)
    lens = [1, 511, 512, 513, 4000, 9000, 20000]
    reqs = [make_request(1, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for s in lens]
    step = assemble(reqs, block_size=16, gen=gen, pad_tokens=2, extra_rows=3, max_blocks=8192, spare_blocks=2000)
    n = len(lens)
    ref = reference(step, scale=SCALE, causal=True)
    want = bits(run_prefill(step)[: step.num_tokens])
    for mode in ("split", "fold"):
        for variant in VARIANTS:
            out = run(step, variant=variant, mode=mode)
            assert rel_err(out, ref, n) < TOL[torch.bfloat16], f"{variant}/{mode}"
            assert (out[n: step.num_tokens] == 0).all(), "padding rows must be zero"
            assert torch.isnan(out[step.num_tokens:].float()).all(), "rows at/after num_tokens were written"
            assert torch.equal(bits(out[: step.num_tokens]), want), \
                f"{variant}/{mode}: bits differ from the prefill kernel's"
    out = torch.full_like(step.query, float("nan"))
    run(step, out=out, mode="split")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(step, out=out, mode="split", check=False)
    # Grow every request (vLLM appends tokens in place): new pages from the spare
    # blocks appended to its table row, K/V written at the new positions.
    owned = {int(b) for i, s in enumerate(lens) for b in step.block_table[i, : -(-s // 16)].tolist()}
    spare = iter(sorted(set(range(step.key_cache.shape[0])) - owned))
    grown = [s + rng.randint(100, 2500) for s in lens]
    for i, (old, new) in enumerate(zip(lens, grown)):
        for page in range(-(-old // 16), -(-new // 16)):
            step.block_table[i, page] = next(spare)
        pos = torch.arange(old, new, device="cuda")
        blk, slot = step.block_table[i, pos // 16].long(), pos % 16
        for cache in (step.key_cache, step.value_cache):
            cache[blk, :, slot] = torch.randn((new - old, 8, 128), generator=gen, device="cuda").to(cache.dtype)
    step.seq_lens.copy_(torch.tensor(grown, dtype=torch.int32, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(step, scale=SCALE, causal=True), n) < TOL[torch.bfloat16]
    assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step)[: step.num_tokens]))


def test_draft_tokens_causal_and_full():
    """Token tiles of requests with several query tokens (speculative drafts):
    each token sees its own causal prefix; non-causal sees all."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for q, s in ((3, 700), (1, 64),
                                                                                               (4, 513))]
    step = assemble(reqs, block_size=16, gen=gen, pad_tokens=2)
    n = int(step.query_start_loc[-1])
    for causal in (True, False):
        ref = reference(step, scale=SCALE, causal=causal)
        out = run(step, causal=causal)
        assert rel_err(out, ref, n) < TOL[torch.bfloat16]
        assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step, causal=causal)[: step.num_tokens]))


def test_batch_invariant():
    rng = random.Random(7)
    gen = torch.Generator(device="cuda").manual_seed(7)
    target = make_request(1, 3000, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
    alone = run(assemble([target], block_size=16, gen=gen))[:1]
    for n_other in (1, 5, 40):
        others = [make_request(1, rng.randint(1, 5000), H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
                  for _ in range(n_other)]
        pos = rng.randint(0, n_other)
        step = assemble(others[:pos] + [target] + others[pos:], block_size=16, gen=gen)
        got = run(step)[pos: pos + 1]
        assert torch.equal(bits(got), bits(alone)), f"request's bits changed with {n_other} others at {pos}"


def test_paged_attention_routes_off_decode_steps_with_prefill_bits(monkeypatch):
    """ops.paged_attention (path auto, policy off) runs a decode step on the csrc
    decode kernel with the prefill kernel's bits; strict does not run on the off binary."""
    from dhp_backend.ops import cuda_decode, dispatch, plan

    calls = []  # the bucket of each csrc decode launch: None = the policy-off binary
    real = cuda_decode.decode_sm90

    def spy(*a, **k):
        calls.append(k.get("bucket"))
        return real(*a, **k)

    monkeypatch.setattr(cuda_decode, "decode_sm90", spy)
    rng = random.Random(11)
    gen = torch.Generator(device="cuda").manual_seed(11)
    # No padding tokens: 2 on 6 requests would make it a "mixed" step by the
    # launcher's tiling rule (vLLM pads num_reqs with the tokens for its graphs).
    # The table obeys strict's address rule (every request owns its pages up to the
    # table's capacity), so that the strict launch below may read them.
    reqs = [make_request(1, rng.choice(EDGE_LENS + (rng.randint(1, 3000),)), H=32, Hkv=8, D=128,
                         dtype=torch.bfloat16, gen=gen) for _ in range(6)]
    step = reserved_step(reqs, "strict", block_size=16, width=-(-max(r.seq_len for r in reqs) // 16) + 1, gen=gen)
    spec = dispatch.ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                                block_size=16, causal=True, device_capability=(9, 0))
    assert step_kernel(spec, "off", step.num_tokens, 6) == plan.CUDA_DECODE
    assert step_kernel(spec, "strict", step.num_tokens, 6) == plan.CUDA_DECODE_CT  # constant-time: the CT binary
    out = torch.full_like(step.query, float("nan"))
    paged_attention(*step.args(), out, scale=SCALE, causal=True, policy="off", num_tokens=step.num_tokens)
    assert calls == [None], f"a policy-off decode step did not run on the csrc policy-off binary: {calls}"
    assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step)[: step.num_tokens]))
    calls.clear()
    strict = torch.full_like(step.query, float("nan"))
    paged_attention(*step.args(), strict, scale=SCALE, causal=True, policy="strict",
                    bucket=step.bucket("strict"), num_tokens=step.num_tokens)
    assert calls == [step.bucket("strict")], \
        f"a strict step did not run on the csrc CT binary (policy off's is not constant-time): {calls}"
    assert torch.equal(bits(strict[: step.num_tokens]), bits(out[: step.num_tokens]))


def test_interleaved_kv_cache_views():
    """vLLM's cache layout: K and V of a slot side by side ([blocks, Hkv, bs, 2, D])."""
    rng = random.Random(5)
    gen = torch.Generator(device="cuda").manual_seed(5)
    step = decode_step(rng, gen, 4, 32, 8, torch.bfloat16, 16, lens=[500, 64, 1, 1300])
    kv = torch.stack([step.key_cache, step.value_cache], dim=3)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    out = torch.full_like(step.query, float("nan"))
    decode_sm90(step.query, k, v, step.block_table, step.query_start_loc, step.seq_lens, out, scale=SCALE,
                causal=True, num_tokens=step.num_tokens)
    assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step)[: step.num_tokens]))


def test_graph_capture_replays_new_lengths():
    """Captured once (vLLM's full CUDA graphs of decode steps), replayed after the
    lengths and block ids change in place: the same bits as an eager launch."""
    rng = random.Random(13)
    gen = torch.Generator(device="cuda").manual_seed(13)
    step = decode_step(rng, gen, 8, 32, 8, torch.bfloat16, 16, lens=[4000] * 8)
    out = torch.full_like(step.query, float("nan"))
    run(step, out=out)  # build and warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(step, out=out, check=False)  # no host reads under capture (as ops.paged_attention calls it)
    new_lens = torch.tensor([rng.randint(1, 4000) for _ in range(8)], dtype=torch.int32, device="cuda")
    step.seq_lens.copy_(new_lens)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step)[: step.num_tokens]))


def test_longest_first_schedule_keeps_the_bits():
    """Fold mode's longest-first schedule (order_kernel: tokens counting-sorted by
    their walk) moves timing only: every row, padding rows and the rows past
    num_tokens are those of the grid order and of the prefill kernel, with drafts
    (several tokens per request), padding tokens and lengths of every size; also
    when picked by the rule (more CTAs than one wave) and under graph replay."""
    from dhp_backend.ops.cuda_decode import longest_first, plan

    rng = random.Random(17)
    gen = torch.Generator(device="cuda").manual_seed(17)
    q_lens = [rng.choice([1, 1, 1, 3]) for _ in range(70)]
    reqs = [make_request(q, max(q, rng.choice(EDGE_LENS + (rng.randint(1, 9000), 8192))), H=32, Hkv=8, D=128,
                         dtype=torch.bfloat16, gen=gen) for q in q_lens]
    step = assemble(reqs, block_size=16, gen=gen, pad_tokens=5, extra_rows=3)
    n = int(step.query_start_loc[-1])
    p = plan(step.num_tokens, 70, 32, 8, step.block_table.shape[1] * 16, "bfloat16", "v2", None)
    assert longest_first(p, step.num_tokens, 8), f"the rule should pick the schedule here: {p}"
    want = bits(run_prefill(step)[: step.num_tokens])
    ref = reference(step, scale=SCALE, causal=True)
    for variant in VARIANTS:
        for order in (None, True, False):
            out = run(step, variant=variant, mode="fold", order=order)
            assert rel_err(out, ref, n) < TOL[torch.bfloat16], f"{variant} order={order}"
            assert (out[n: step.num_tokens] == 0).all(), "padding rows must be zero"
            assert torch.isnan(out[step.num_tokens:].float()).all(), "rows at/after num_tokens were written"
            assert torch.equal(bits(out[: step.num_tokens]), want), f"{variant} order={order}: bits differ"
    out = torch.full_like(step.query, float("nan"))
    run(step, out=out, order=True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(step, out=out, check=False, order=True)
    new_lens = [rng.randint(q, s) for q, s in zip(q_lens, step.seq_lens.tolist())]
    step.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out[: step.num_tokens]), bits(run_prefill(step)[: step.num_tokens]))



def test_dealt_schedule_keeps_the_bits():
    """Split mode's dealing on the device from the true lengths (csrc deal_kernel) moves timing only:
    mixed lengths (a short walk beside 32K ones, one just past a split boundary, drafts, an empty
    request, padding tokens), every slot count and CTA cost of the model (1 slot: one item a token;
    many: one split an item), the fixed dealing and fold mode give the prefill kernel's bits, and so
    do the launches of one step (deal_step) after the first, which read its table. The split area is
    filled with NaN before each launch, so a split that no item stored would show, and the table with
    entries that all name token 0's first split before each launch that makes it, so a row the
    dealing left unwritten would show; a launch of another step in between makes the table anew; a
    CUDA graph of two layers captured after an eager run of its step makes its own table, and replayed
    with new lengths deals them anew with the same bits."""
    from dhp_backend.ops import cuda_decode
    from dhp_backend.ops import workspace as wsp

    gen = torch.Generator(device="cuda").manual_seed(23)
    shape = [(1, 32768), (1, 4000), (3, 20000), (1, 8208), (1, 512), (2, 2), (1, 32000), (0, 0), (1, 17000)]
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for q, s in shape]
    step = assemble(reqs, block_size=16, gen=gen, pad_tokens=3, extra_rows=3)
    n = int(step.query_start_loc[-1])
    want = bits(run_prefill(step)[: step.num_tokens])
    ws, _, _ = wsp.reserve_workspace("cuda")
    table = wsp.deal_table("cuda").view(-1, 8)
    wrong = torch.tensor([0, 0, 0, 1, 0, 1, 1, 0], dtype=torch.int32, device="cuda")  # token 0, split 0, length 1

    def dealt(deal=None, deal_cost=None, mode="split", spp=None, out=None, check=True, deal_step=None, on=None):
        on = step if on is None else on
        if check:  # a split no item stored reads NaN in the merge; a table row not written, a wrong state
            ws.fill_(float("nan"))
            holds = cuda_decode._deal_table_holds.get(on.query.device)
            if deal_step is None or holds is None or holds[0] != deal_step:  # a launch that makes the table
                table.copy_(wrong.expand_as(table))
        out = torch.full_like(on.query, float("nan")) if out is None else out
        return decode_sm90(*on.args(), out, scale=SCALE, causal=True, num_tokens=on.num_tokens, mode=mode,
                           deal=deal, deal_cost=deal_cost, spp=spp, check=check, deal_step=deal_step)

    ref = reference(step, scale=SCALE, causal=True)
    runs = [dict(), dict(deal=0), dict(mode="fold"), dict(spp=3), dict(deal=264)]
    runs += [dict(deal=d, deal_cost=c) for d in (1, 8, 33, 132, 264, 528, 4096) for c in (None, -1.0, 0.0, 50.0)]
    runs += [dict(deal=d, deal_step=7) for d in (33, 264, 264)]  # the 2nd and 3rd read the 1st one's table
    for kw in runs:
        out = dealt(**kw)
        assert rel_err(out, ref, n) < TOL[torch.bfloat16], kw
        assert (out[n: step.num_tokens] == 0).all(), f"{kw}: padding rows must be zero"
        assert torch.isnan(out[step.num_tokens:].float()).all(), f"{kw}: rows at/after num_tokens were written"
        assert torch.equal(bits(out[: step.num_tokens]), want), f"{kw}: bits differ from the prefill kernel's"
    # Another step (other lengths, fewer tokens) between two launches of step 8 makes its own table: the
    # second launch of step 8 sees that and makes step 8's again (the poison would show otherwise).
    other = assemble([make_request(1, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for s in (700, 9000)],
                     block_size=16, gen=gen)
    assert torch.equal(bits(dealt(deal=264, deal_step=8)[: step.num_tokens]), want)
    assert torch.equal(bits(dealt(deal=264, deal_step=9, on=other)[: other.num_tokens]),
                       bits(run_prefill(other)[: other.num_tokens]))
    assert torch.equal(bits(dealt(deal=264, deal_step=8)[: step.num_tokens]), want)
    for bad in (True, 1.5, "7"):
        with pytest.raises(ValueError, match=r"deal_step is .*; accepted: None or an int"):
            dealt(deal=264, deal_step=bad)
    out = torch.full_like(step.query, float("nan"))
    out2 = torch.full_like(step.query, float("nan"))
    dealt(deal=264, out=out, deal_step=10)  # an eager run of step 10 first: the capture makes its own table
    dealt(deal=264, out=out2, deal_step=10)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # two layers of one step: the first makes the table, the second reads it
        dealt(deal=264, out=out, check=False, deal_step=10)
        dealt(deal=264, out=out2, check=False, deal_step=10)
    for trial in range(3):  # new lengths in place (each request keeps its tokens and pages)
        q_lens = (step.query_start_loc[1:] - step.query_start_loc[:-1]).tolist()
        caps = [s for s in step.seq_lens.tolist()]
        new = [c if q == 0 else random.Random(trial * 100 + i).randint(q, max(q, c)) for i, (q, c) in
               enumerate(zip(q_lens, caps))]
        step.seq_lens.copy_(torch.tensor(new, dtype=torch.int32, device="cuda"))
        ws.fill_(float("nan"))
        table.copy_(wrong.expand_as(table))
        g.replay()
        torch.cuda.synchronize()
        want = bits(run_prefill(step)[: step.num_tokens])
        assert torch.equal(bits(out[: step.num_tokens]), want), f"replay {trial}, lengths {new}"
        assert torch.equal(bits(out2[: step.num_tokens]), want), f"replay {trial}, lengths {new}, table reused"



def test_dealt_schedule_with_more_requests_than_it_reads():
    """A split-mode step of more requests than a dealt launch reads (csrc kDealMaxReqs) keeps the fixed
    dealing (deal_args), with the prefill kernel's bits; a forced dealing there is refused, naming it."""
    from dhp_backend.ops.cuda_decode import _deal_max_reqs, deal_args, plan

    limit = _deal_max_reqs()
    assert limit == 256
    rng = random.Random(29)
    gen = torch.Generator(device="cuda").manual_seed(29)
    step = decode_step(rng, gen, limit + 4, 8, 1, torch.bfloat16, 16,
                       lens=[rng.randint(1, 3000) for _ in range(limit + 4)])
    p = plan(step.num_tokens, limit + 4, 8, 1, step.block_table.shape[1] * 16, "bfloat16", "v2", "split")
    assert deal_args(p, False, None, step.num_tokens, limit + 4, limit, None, None) == (0, 0.0)
    want = bits(run_prefill(step)[: step.num_tokens])
    out = run(step, mode="split")
    assert torch.equal(bits(out[: step.num_tokens]), want)
    with pytest.raises(ValueError, match="deal is 264"):
        decode_sm90(*step.args(), torch.full_like(step.query, float("nan")), scale=SCALE, causal=True,
                    num_tokens=step.num_tokens, mode="split", deal=264)


# ---- the constant-time walk (bucket given: CT binaries) -----------------------------

def next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


def run_ct(step, bucket, causal=True, variant="auto", mode=None):
    out = torch.full_like(step.query, float("nan"))
    return decode_sm90(*step.args(), out, scale=SCALE, causal=causal, num_tokens=step.num_tokens, variant=variant,
                       mode=mode, bucket=bucket)


CT_POLICIES = ("strict", "request")


def ct_bucket(step, reqs, policy):
    """The bucket argument of ``policy`` for ``step`` (max_model_len = the table's
    capacity): strict's int, request's per-request int32 buckets."""
    if policy == "strict":
        return step.capacity
    return torch.tensor([min(step.capacity, next_pow2(r.seq_len)) for r in reqs], dtype=torch.int32, device="cuda")


def check_ct(reqs, dtype, *, bs, width, gen, pad_tokens=0, extra_rows=3, causal=True, variants=None,
             modes=("split", "fold")):
    """Every CT variant and mode under every policy's bucket, each on a step whose
    table obeys that policy's address rule (`reserved_step`): accurate, padding rows
    0, rows past num_tokens untouched, and the policy-off bits, which are the csrc
    prefill kernel's (off and on its constant-time walk to the same bucket)."""
    from dhp_backend.ops.cuda_decode import CT_VARIANTS

    for policy in CT_POLICIES:
        step = reserved_step(reqs, policy, block_size=bs, width=width, gen=gen, pad_tokens=pad_tokens,
                             extra_rows=extra_rows)
        bucket = ct_bucket(step, reqs, policy)
        n = int(step.query_start_loc[-1])
        ref = reference(step, scale=SCALE, causal=causal)
        off_bits = bits(run(step, causal=causal)[: step.num_tokens])
        tri = bits(run_prefill(step, causal=causal)[: step.num_tokens])
        assert torch.equal(tri, off_bits), f"decode off differs from the prefill kernel ({policy} table)"
        pre_ct = torch.full_like(step.query, float("nan"))
        prefill_sm90(*step.args(), pre_ct, scale=SCALE, causal=causal, num_tokens=step.num_tokens,
                     variant="v2_ct", bucket=bucket)
        assert torch.equal(bits(pre_ct[: step.num_tokens]), off_bits), f"prefill {policy} differs from policy off"
        for mode in modes:
            for variant in variants or CT_VARIANTS:
                got = run_ct(step, bucket, causal=causal, variant=variant, mode=mode)
                what = (f"{policy} L={bucket if isinstance(bucket, int) else bucket.tolist()} {variant}/{mode} "
                        f"{[(r.q_len, r.seq_len) for r in reqs]}")
                assert rel_err(got, ref, n) < TOL[dtype], what
                assert (got[n: step.num_tokens] == 0).all(), f"padding rows must be zero: {what}"
                assert torch.isnan(got[step.num_tokens:].float()).all(), f"rows at/after num_tokens written: {what}"
                assert torch.equal(bits(got[: step.num_tokens]), tri), f"differs from policy off's bits: {what}"


@pytest.mark.parametrize("H,Hkv,dtype,bs", [
    (32, 8, torch.bfloat16, 16), (32, 8, torch.float16, 16), (16, 16, torch.bfloat16, 32),
    (8, 1, torch.float16, 64), (32, 2, torch.bfloat16, 128), (12, 4, torch.bfloat16, 16),
])
def test_ct_has_the_policy_off_bits(H, Hkv, dtype, bs):
    """Decode steps on the constant-time walk: one bucket (strict: the table's
    capacity) and per-request buckets (request), lengths at page/step/split edges,
    NaN/inf garbage in every unowned slot and in the reserved pages past the true
    lengths (the V operands there must be zeroed, not multiplied by 0)."""
    rng = random.Random(H * 31 + Hkv + bs)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    for trial in range(2):
        lens = [rng.choice(EDGE_LENS + (rng.randint(1, 3000),)) for _ in range(rng.randint(1, 9))]
        reqs = [make_request(1, s, H=H, Hkv=Hkv, D=128, dtype=dtype, gen=gen) for s in lens]
        width = -(-rng.choice([max(lens), 2 * max(lens), 4100]) // bs) + 1
        check_ct(reqs, dtype, bs=bs, width=max(width, -(-max(lens) // bs) + 1), gen=gen,
                 pad_tokens=rng.choice([0, 3]))


def test_ct_drafts_and_non_causal():
    """Token tiles of requests with several query tokens under the CT walk: each
    token's causal limit comes from its own position, selected, not branched on."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen) for q, s in ((3, 700), (1, 64),
                                                                                               (4, 513))]
    for causal in (True, False):
        check_ct(reqs, torch.bfloat16, bs=16, width=80, gen=gen, pad_tokens=2, extra_rows=0, causal=causal,
                 variants=("v2",))


def test_ct_more_requests_than_threads():
    """The token -> request count runs in chunks of the CTA's threads (160; the
    merge's 128): 300 requests take two or three chunks."""
    rng = random.Random(23)
    gen = torch.Generator(device="cuda").manual_seed(23)
    reqs = [make_request(1, rng.randint(1, 600), H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
            for _ in range(300)]
    check_ct(reqs, torch.bfloat16, bs=16, width=48, gen=gen, pad_tokens=5, extra_rows=0, variants=("v2",))


def test_ct_refuses_what_it_cannot_run():
    gen = torch.Generator(device="cuda").manual_seed(1)
    reqs = [make_request(1, 100, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)]
    step = reserved_step(reqs, "strict", block_size=16, width=8, gen=gen)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] is 100, above its bucket 64"):
        run_ct(step, 64)
    with pytest.raises(ValueError, match=r"variant is 'm2x3_pv_ef'; accepted: auto, v2"):
        run_ct(step, 128, variant="m2x3_pv_ef")
    with pytest.raises(ValueError, match=r"bucket is 129; accepted: an int in \[1, "):
        run_ct(step, 129)


def test_paged_attention_routes_ct_decode_steps_unless_path_triton(monkeypatch):
    """Path auto runs strict decode steps on the CT binary (spied) with policy off's
    bits; path 'triton' keeps every step on the Triton kernels (their own arithmetic:
    other bits, the same values within the tolerance)."""
    from dhp_backend.ops import cuda_decode

    calls = []
    real = cuda_decode.decode_sm90

    def spy(*a, **k):
        calls.append(k.get("bucket"))
        return real(*a, **k)

    monkeypatch.setattr(cuda_decode, "decode_sm90", spy)
    gen = torch.Generator(device="cuda").manual_seed(29)
    # No padding tokens: they would make a step of 6 requests "mixed" (request tiles).
    reqs = [make_request(1, s, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=gen)
            for s in (900, 17, 2048, 1, 513, 64)]
    step = reserved_step(reqs, "strict", block_size=16, width=128, gen=gen)  # max_model_len 2048
    want = bits(run(step)[: step.num_tokens])
    ref = reference(step, scale=SCALE, causal=True)
    for path, expected in (("auto", [2048]), ("triton", [])):
        calls.clear()
        out = torch.full_like(step.query, float("nan"))
        paged_attention(*step.args(), out, scale=SCALE, causal=True, policy="strict", bucket=2048,
                        num_tokens=step.num_tokens, path=path)
        assert calls == expected, f"path {path!r}: {calls}"
        assert rel_err(out, ref, 6) < TOL[torch.bfloat16], path
        if path == "auto":
            assert torch.equal(bits(out[: step.num_tokens]), want)
