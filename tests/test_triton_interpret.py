"""The Triton kernels under the Triton CPU interpreter (CI): small shapes only.

Correctness against the PyTorch reference across decode / prefill / mixed steps,
GQA ratios, causal with context and non-causal, every policy, KV block sizes 16
and 32, stale garbage in the cache; then the determinism properties: bitwise
repeatability, batch invariance, identical bits across policies and across the
two split modes.
"""

import os
import sys

# Triton picks interpreter or compiler per function when it is decorated, and its
# own standard library (tl.sum, tl.max...) is decorated when triton is first
# imported. So the variable must be set before anything imports triton.
_TRITON_PREIMPORTED = "triton" in sys.modules
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
import torch  # noqa: E402

# In a full test run something else (vLLM, the GPU tests) may have imported
# triton for the compiler first; the interpreter cannot run then. The module then
# re-runs itself in a fresh process (test_interpreter_suite_in_fresh_process)
# and skips its tests here.
IN_PROCESS = type(tl.sum).__name__ == "InterpretedFunction"
_k = sys.modules.get("dhp_backend.ops.triton.kernels")
if _k is not None and type(_k.attention_kernel).__name__ != "InterpretedFunction":
    IN_PROCESS = False
_SUBPROCESS_TEST = "test_interpreter_suite_in_fresh_process"


@pytest.fixture(autouse=True)
def _interpreter_or_fresh_process(request):
    if request.node.name == _SUBPROCESS_TEST:
        if IN_PROCESS:
            pytest.skip("the suite runs in this process")
    elif not IN_PROCESS:
        pytest.skip(f"triton was imported for the compiler first (pre-imported: {_TRITON_PREIMPORTED}); "
                    f"covered by {_SUBPROCESS_TEST}")


def test_interpreter_suite_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        cwd=os.path.dirname(tests_dir), env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


from dhp_backend.ops import ProblemSpec, paged_attention  # noqa: E402
from dhp_backend.ops.triton import paged_attention_triton, supports  # noqa: E402
from triton_steps import (  # noqa: E402
    assemble, bits, cdiv, check_written, drop_pages_below_window, make_request, poison_pages_below_window,
    poisoned_out, random_sinks, rank_step, reference, rel_err, reserved_step,
)

# Stale NaN/inf in the cache flows through the score dot product before it is
# selected away; numpy warns about it, the kernels handle it.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SPLIT = 128  # small split size so that short sequences cross split boundaries


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _run(step, *, policy, causal=True, scale=None, mode=None, split_kv=SPLIT, bucket="auto", tiling=None,
         **features):
    D = step.query.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = poisoned_out(step)
    b = step.bucket(policy) if bucket == "auto" else bucket
    paged_attention_triton(*step.args(), out, scale=scale, causal=causal, num_tokens=step.num_tokens,
                           policy=policy, bucket=b, _mode=mode, _split_kv=split_kv, _tiling=tiling, **features)
    check_written(step, out)
    return out


def _build(q_lens, seq_lens, *, H, Hkv, D=64, BS=16, dtype=torch.float16, seed=0, pad_tokens=0, **kw):
    g = _gen(seed)
    reqs = [make_request(q, s, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g) for q, s in zip(q_lens, seq_lens)]
    return assemble(reqs, block_size=BS, H=H, Hkv=Hkv, D=D, dtype=dtype, pad_tokens=pad_tokens, gen=g, **kw)


# (id, q_lens, seq_lens, H, Hkv, BS, dtype, causal, policy, pad_tokens)
CASES = [
    ("decode-mha", [1, 1, 1], [5, 130, 70], 2, 2, 16, torch.float16, True, "strict", 0),
    ("decode-gqa4-bs32", [1, 1, 1, 1], [33, 1, 200, 64], 8, 2, 32, torch.float16, True, "request", 2),
    ("prefill-gqa2", [40], [40], 4, 2, 16, torch.float16, True, "strict", 0),
    ("prefill-ctx-mqa", [20, 9], [150, 9], 4, 1, 16, torch.bfloat16, True, "request", 0),
    ("mixed-gqa4", [1, 25, 1, 6], [90, 60, 17, 260], 8, 2, 16, torch.float16, True, "off", 3),
    ("mixed-bs32-fp32", [3, 1, 17], [3, 100, 140], 4, 2, 32, torch.float32, True, "strict", 1),
    ("noncausal-gqa2", [7, 1, 12], [30, 77, 12], 4, 2, 16, torch.float16, False, "request", 0),
    ("noncausal-mqa-bf16", [5, 16], [200, 16], 4, 1, 32, torch.bfloat16, False, "off", 0),
    ("chunk-mid-prompt", [16, 1], [48, 129], 4, 2, 16, torch.float32, True, "request", 0),
    ("zero-qlen-req", [0, 4, 1], [20, 4, 9], 4, 4, 16, torch.float16, True, "strict", 2),
    ("zero-seqlen-req", [0, 3], [0, 40], 4, 2, 16, torch.float16, True, "request", 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    _, q_lens, seq_lens, H, Hkv, BS, dtype, causal, policy, pad = case
    step = _build(q_lens, seq_lens, H=H, Hkv=Hkv, BS=BS, dtype=dtype, pad_tokens=pad, seed=sum(map(ord, case[0])))
    ref = reference(step, scale=64 ** -0.5, causal=causal)
    out = _run(step, policy=policy, causal=causal)
    n = int(step.query_start_loc[-1])
    assert rel_err(out, ref, n) < TOL[dtype]


TOKEN_CASES = [c for c in CASES if c[0] in ("decode-gqa4-bs32", "mixed-gqa4", "zero-qlen-req", "zero-seqlen-req")]


@pytest.mark.parametrize("case", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_token_tiling_matches_reference_and_request_tiling(case):
    """One query token per tile (the decode tiling) on steps with padding rows,
    empty requests and prompts: same result as the reference and as request tiles.

    Bitwise equality of the two tilings is a GPU test (test_triton_gpu.py): here
    the interpreter's dot is numpy's BLAS matmul, whose rounding depends on a
    row's position in the tile (seen: 1-ulp fp16 differences), while a GPU MMA
    computes every row alike."""
    _, q_lens, seq_lens, H, Hkv, BS, dtype, causal, policy, pad = case
    step = _build(q_lens, seq_lens, H=H, Hkv=Hkv, BS=BS, dtype=dtype, pad_tokens=pad, seed=sum(map(ord, case[0])))
    ref = reference(step, scale=64 ** -0.5, causal=causal)
    tok = _run(step, policy=policy, causal=causal, tiling="token")
    req = _run(step, policy=policy, causal=causal, tiling="request")
    n = int(step.query_start_loc[-1])
    assert rel_err(tok, ref, n) < TOL[dtype]
    assert rel_err(tok, req, n) < TOL[dtype] / 10
    assert torch.equal(tok[n: step.num_tokens], torch.zeros_like(tok[n: step.num_tokens]))  # padding rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_split_and_fold_modes_match_reference_and_each_other(dtype):
    step = _build([1, 9, 1], [300, 140, 45], H=4, Hkv=2, dtype=dtype, seed=3, pad_tokens=1)
    ref = reference(step, scale=0.125, causal=True)
    a = _run(step, policy="strict", mode="fold")
    b = _run(step, policy="strict", mode="split")
    n = int(step.query_start_loc[-1])
    assert rel_err(a, ref, n) < TOL[dtype]
    assert torch.equal(bits(a), bits(b))


def test_head_size_80_padding():
    step = _build([1, 5], [70, 40], H=4, Hkv=2, D=80, seed=4)
    ref = reference(step, scale=80 ** -0.5, causal=True)
    out = _run(step, policy="request")
    assert rel_err(out, ref, step.num_tokens) < TOL[torch.float16]


def test_through_ops_seam_with_validation():
    step = _build([2, 1], [50, 33], H=4, Hkv=2, seed=5, pad_tokens=2)
    out = poisoned_out(step)
    paged_attention(*step.args(), out, scale=0.125, causal=True, policy="strict",
                    max_model_len=step.capacity, num_tokens=step.num_tokens, path="triton")
    check_written(step, out)
    ref = reference(step, scale=0.125, causal=True)
    assert rel_err(out, ref, 3) < TOL[torch.float16]


def test_bitwise_repeatable():
    step = _build([1, 13, 1], [200, 30, 64], H=8, Hkv=2, seed=6)
    a = _run(step, policy="strict")
    b = _run(step, policy="strict")
    assert torch.equal(bits(a), bits(b))


def test_bits_equal_across_policies_and_modes():
    step = _build([1, 11, 1, 2], [260, 30, 7, 140], H=4, Hkv=2, seed=7)
    outs = [_run(step, policy=p, mode=m) for p in ("strict", "request", "off") for m in ("fold", "split")]
    for o in outs[1:]:
        assert torch.equal(bits(outs[0]), bits(o))


def test_constant_time_split_states_of_idle_rows_are_not_zeros(monkeypatch):
    """Under a constant-time policy in split mode, a row's split that holds none of its
    positions stores the neutral m and l with |q| as its accumulator, not zeros (zeros
    written and read back for one length class only were a timing signal of the csrc
    decode kernel, docs/kernels.md section 2); padding rows keep zeros; the output keeps
    policy off's bits (the merge multiplies the filler by +0)."""
    from dhp_backend.ops import geometry

    step = _build([1, 1], [7, 300], H=4, Hkv=2, seed=11, pad_tokens=1)
    states = {}
    real_split_states = geometry.split_states

    def spy(ws, n_split_grid, num_tokens, num_heads, head_size):
        got = real_split_states(ws, n_split_grid, num_tokens, num_heads, head_size)
        states.update(n=n_split_grid, T=num_tokens, H=num_heads, D=head_size, views=got)
        return got

    monkeypatch.setattr(geometry, "split_states", spy)
    from dhp_backend.ops import workspace as wsp
    wsp.reserve_workspace(step.query.device)[0].fill_(float("nan"))  # what the launch leaves unwritten
    out = _run(step, policy="strict", mode="split")
    n, T, H, D = states["n"], states["T"], states["H"], states["D"]
    acc_v, m_v, l_v = states["views"]
    acc = acc_v[: n * T * H * D].view(n, T, H, D)
    m, l = m_v[: n * T * H].view(n, T, H), l_v[: n * T * H].view(n, T, H)
    assert n >= 3 and T == 3, (n, T)
    q_abs = step.query[:T].float().abs()
    # token 0: length 7, every split after the first holds none of its positions
    assert torch.all(m[1:, 0] == -3.4028234663852886e38) and torch.all(l[1:, 0] == 0)
    assert torch.equal(acc[1:, 0], q_abs[0].expand(n - 1, H, D)), "idle splits must store |q|, not zeros"
    assert torch.count_nonzero(acc[1:, 0]) > 0
    # token 1: length 300 spans splits 0-2 (SPLIT 128): real states there
    assert torch.all(m[:3, 1] > -1e38) and torch.all(l[:3, 1] > 0)
    assert torch.equal(acc[3:, 1], q_abs[1].expand(n - 3, H, D))
    # token 2: padding (the pseudo-request of length 0): written, zeros (its merge has no live split)
    assert torch.count_nonzero(acc[:, 2]) == 0 and torch.all(l[:, 2] == 0)
    off = _run(step, policy="off", mode="split")
    assert torch.equal(bits(out[: step.num_tokens]), bits(off[: step.num_tokens]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_invariance(dtype):
    rng = random.Random(8)
    g = _gen(8)
    H, Hkv, BS = 4, 2, 16
    pool = [make_request(q, s, H=H, Hkv=Hkv, D=64, dtype=dtype, gen=g)
            for q, s in [(1, 70), (9, 40), (1, 190), (4, 4), (1, 1), (17, 130)]]
    target = make_request(6, 150, H=H, Hkv=Hkv, D=64, dtype=dtype, gen=g)
    max_blocks = 16  # the same table width (so the same strict bucket) in every step

    def target_rows(others, pos, pad):
        reqs = others[:pos] + [target] + others[pos:]
        step = assemble(reqs, block_size=BS, pad_tokens=pad, gen=g, max_blocks=max_blocks)
        out = _run(step, policy="strict")
        start = sum(r.q_len for r in reqs[:pos])
        return out[start: start + target.q_len]

    alone = target_rows([], 0, 0)
    for trial in range(3):
        others = rng.sample(pool, rng.randint(1, len(pool)))
        got = target_rows(others, rng.randint(0, len(others)), rng.randint(0, 3))
        assert torch.equal(bits(alone), bits(got)), f"trial {trial}"


def test_prefill_row_equals_decode_row():
    """Stretch goal: a position's output bits do not depend on being computed in a
    prefill tile or a decode tile."""
    g = _gen(9)
    H, Hkv, D = 4, 2, 64
    req = make_request(10, 75, H=H, Hkv=Hkv, D=D, dtype=torch.float16, gen=g)
    pre = assemble([req], block_size=16, gen=g, max_blocks=8)
    out_pre = _run(pre, policy="strict")
    for i in (0, 4, 9):
        dec_req = type(req)(q=req.q[i: i + 1], k=req.k[: 75 - 9 + i], v=req.v[: 75 - 9 + i])
        dec = assemble([dec_req], block_size=16, gen=g, max_blocks=8)
        out_dec = _run(dec, policy="strict")
        assert torch.equal(bits(out_pre[i]), bits(out_dec[0])), f"row {i}"


def test_only_padding_rows_and_no_requests():
    step = assemble([], block_size=16, H=4, Hkv=2, D=64, dtype=torch.float16, pad_tokens=5, gen=_gen(10))
    out = _run(step, policy="strict", bucket=64)
    assert (out[:5] == 0).all()


def test_supports():
    fp16 = dict(device_type="cpu", dtype="float16", head_size=128, num_heads=32, num_kv_heads=8, block_size=16)
    assert supports(ProblemSpec(**fp16))[0]
    assert not supports(ProblemSpec(**{**fp16, "head_size": 72}))[0]
    assert not supports(ProblemSpec(**{**fp16, "block_size": 8}))[0]
    assert not supports(ProblemSpec(**{**fp16, "device_type": "mps"}))[0]
    cuda_old = ProblemSpec(**{**fp16, "device_type": "cuda", "device_capability": (7, 0)})
    assert not supports(cuda_old)[0]


def test_supports_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, why = supports(ProblemSpec(device_type="cpu", dtype="float16", head_size=64, num_heads=4,
                                   num_kv_heads=2, block_size=16))
    assert not ok and "TRITON_INTERPRET" in why


# --- model features: logits soft-cap and attention sinks (issue 31) ---------------------------
# Caps that bite: scaled scores of these random steps are O(1), so a cap of 1-2
# changes every row; 50 is Gemma-2's (nearly the identity here).
FEATURE_CASES = [
    # (id, case of CASES, logits_soft_cap, sinks)
    ("decode-gqa4-bs32-cap-sinks", "decode-gqa4-bs32", 1.5, True),
    ("prefill-ctx-mqa-cap", "prefill-ctx-mqa", 2.0, False),
    ("mixed-gqa4-sinks", "mixed-gqa4", None, True),
    ("mixed-bs32-fp32-cap50-sinks", "mixed-bs32-fp32", 50.0, True),
    ("noncausal-gqa2-cap-sinks", "noncausal-gqa2", 1.0, True),
]


@pytest.mark.parametrize("fcase", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_features_match_reference(fcase):
    name, base, cap, with_sinks = fcase
    _, q_lens, seq_lens, H, Hkv, BS, dtype, causal, policy, pad = next(c for c in CASES if c[0] == base)
    step = _build(q_lens, seq_lens, H=H, Hkv=Hkv, BS=BS, dtype=dtype, pad_tokens=pad, seed=sum(map(ord, name)))
    sinks = random_sinks(H, gen=_gen(len(name))) if with_sinks else None
    ref = reference(step, scale=64 ** -0.5, causal=causal, logits_soft_cap=cap, sinks=sinks)
    plain = reference(step, scale=64 ** -0.5, causal=causal)
    out = _run(step, policy=policy, causal=causal, logits_soft_cap=cap, sinks=sinks)
    n = int(step.query_start_loc[-1])
    assert rel_err(out, ref, n) < TOL[dtype]
    # the features change the result (a kernel that ignored them would fail above)
    assert rel_err(plain, ref, n) > 3 * TOL[dtype] or cap == 50.0 and not with_sinks
    assert torch.equal(out[n: step.num_tokens], torch.zeros_like(out[n: step.num_tokens]))  # padding rows


def test_features_bits_equal_across_policies_and_modes():
    """Soft-cap and sinks keep the plain kernels' invariance: the same bits under
    every policy and both split modes (the sink is folded once, after the last
    split, by the same function in the attention kernel and the merge kernel)."""
    step = _build([1, 11, 1, 2], [260, 30, 7, 140], H=4, Hkv=2, seed=17)
    feats = dict(logits_soft_cap=2.0, sinks=random_sinks(4, gen=_gen(17), dtype=torch.float16))
    outs = [_run(step, policy=p, mode=m, **feats) for p in ("strict", "request", "off") for m in ("fold", "split")]
    for o in outs[1:]:
        assert torch.equal(bits(outs[0]), bits(o))


def test_features_batch_invariance_and_prefill_row_equals_decode_row():
    g = _gen(18)
    H, Hkv, D, BS = 4, 2, 64, 16
    feats = dict(logits_soft_cap=1.5, sinks=random_sinks(H, gen=g))
    req = make_request(10, 75, H=H, Hkv=Hkv, D=D, dtype=torch.float16, gen=g)
    others = [make_request(q, s, H=H, Hkv=Hkv, D=D, dtype=torch.float16, gen=g) for q, s in [(1, 70), (9, 40)]]
    alone = _run(assemble([req], block_size=BS, gen=g, max_blocks=8), policy="strict", **feats)
    batch = _run(assemble([others[0], req, others[1]], block_size=BS, gen=g, max_blocks=8, pad_tokens=2),
                 policy="strict", **feats)
    assert torch.equal(bits(alone[:10]), bits(batch[1:11]))
    for i in (0, 9):
        dec_req = type(req)(q=req.q[i: i + 1], k=req.k[: 75 - 9 + i], v=req.v[: 75 - 9 + i])
        out_dec = _run(assemble([dec_req], block_size=BS, gen=g, max_blocks=8), policy="strict", **feats)
        assert torch.equal(bits(alone[i]), bits(out_dec[0])), f"row {i}"


def test_sinks_of_minus_infinity_are_an_exact_no_op():
    """A head without a sink (-inf) gets the plain kernel's bits: the sink fold is
    exact for a neutral state (fold's docstring)."""
    step = _build([1, 7], [90, 40], H=4, Hkv=2, seed=19, pad_tokens=1)
    none = torch.full((4,), float("-inf"))
    for mode in ("fold", "split"):
        plain = _run(step, policy="strict", mode=mode)
        assert torch.equal(bits(plain), bits(_run(step, policy="strict", mode=mode, sinks=none))), mode


def test_features_through_the_seam():
    step = _build([2, 1], [50, 33], H=4, Hkv=2, seed=20, pad_tokens=2)
    sinks = random_sinks(4, gen=_gen(20))
    out = poisoned_out(step)
    paged_attention(*step.args(), out, scale=0.125, causal=True, policy="strict", max_model_len=step.capacity,
                    num_tokens=step.num_tokens, path="triton", logits_soft_cap=1.0, sinks=sinks)
    check_written(step, out)
    ref = reference(step, scale=0.125, causal=True, logits_soft_cap=1.0, sinks=sinks)
    assert rel_err(out, ref, 3) < TOL[torch.float16]


# --- tensor parallelism: the step each rank computes ------------------------------------------
# (id, query heads, KV heads) at TP = 2: GQA whose KV heads split (4 of 8 per rank, whole groups),
# and MQA whose one KV head every rank holds (vLLM replicates it).
TP_CASES = [("gqa-kv8", 16, 8), ("mqa-kv1", 8, 1)]


@pytest.mark.parametrize("policy", ["strict", "request", "off"])
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("case", TP_CASES, ids=[c[0] for c in TP_CASES])
def test_tensor_parallel_rank_computes_its_head_slice(case, path, policy):
    """A query head's attention reads only that head's query and its KV head, so a rank at TP = 2
    gives the heads it holds of the TP = 1 output, bit for bit, on the reference and wherever the
    rank's tiles are TP = 1's (whole GQA groups per rank: the same GROUP query heads per tile).

    With a replicated KV head a rank holds half the group, so its tiles pack its rows at other
    positions, and the interpreter's dot (numpy's BLAS) rounds by a row's position in the tile
    (seen: differences of ~1e-6 in fp16): there only close; the GPU, whose MMA computes every row
    alike, is held to the bits in test_triton_gpu.py. (Whole-model bits still differ across TP
    sizes: the row-parallel matmuls sum partial products over the ranks.)"""
    _, H, Hkv = case
    g = _gen(sum(map(ord, case[0] + policy)))
    reqs = [make_request(q, s, H=H, Hkv=Hkv, D=64, dtype=torch.float16, gen=g)
            for q, s in [(1, 70), (13, 40), (1, 130), (6, 6)]]
    step = reserved_step(reqs, policy, block_size=16, width=12, gen=g, pad_tokens=2)

    def seam(s):
        out = poisoned_out(s)
        paged_attention(*s.args(), out, scale=0.125, causal=True, policy=policy, bucket=s.bucket(policy),
                        max_model_len=s.capacity, num_tokens=s.num_tokens, path=path, allow_fallback=True)
        check_written(s, out)
        return out

    full = seam(step)
    n = step.num_tokens
    for rank in range(2):
        part, heads = rank_step(step, 2, rank)
        assert tuple(part.query.shape[1:2]) + tuple(part.key_cache.shape[1:2]) == (H // 2, max(1, Hkv // 2))
        want = full[:n, heads].contiguous()
        got = seam(part)[:n]
        if path == "reference" or Hkv >= 2:
            assert torch.equal(bits(got), bits(want)), f"rank {rank}"
        else:
            assert rel_err(got, want.float(), n) < TOL[torch.float16] / 10, f"rank {rank}"
# --- model features: sliding windows (issue 31) --------------------------------------------
WINDOW_CASES = [
    # (id, case of CASES, window, logits_soft_cap, sinks): windows below, at and above the
    # block size, one position (W = 1), and past every context (no position is dropped)
    ("decode-gqa4-bs32-w5", "decode-gqa4-bs32", 5, None, False),
    ("prefill-ctx-mqa-w16-sinks", "prefill-ctx-mqa", 16, None, True),
    ("mixed-gqa4-w40-cap", "mixed-gqa4", 40, 1.5, False),
    ("chunk-mid-prompt-w1", "chunk-mid-prompt", 1, None, False),
    ("mixed-bs32-fp32-w300-cap50-sinks", "mixed-bs32-fp32", 300, 50.0, True),
]


@pytest.mark.parametrize("wcase", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_window_matches_reference(wcase):
    name, base, window, cap, with_sinks = wcase
    _, q_lens, seq_lens, H, Hkv, BS, dtype, causal, policy, pad = next(c for c in CASES if c[0] == base)
    step = _build(q_lens, seq_lens, H=H, Hkv=Hkv, BS=BS, dtype=dtype, pad_tokens=pad, seed=sum(map(ord, name)))
    feats = dict(logits_soft_cap=cap, sinks=random_sinks(H, gen=_gen(len(name))) if with_sinks else None)
    ref = reference(step, scale=64 ** -0.5, causal=True, sliding_window=window, **feats)
    out = _run(step, policy=policy, sliding_window=window, **feats)
    n = int(step.query_start_loc[-1])
    assert rel_err(out, ref, n) < TOL[dtype]
    if window >= max(seq_lens):
        # a window past every context is an exact no-op: the plain binary's bits
        assert torch.equal(bits(out), bits(_run(step, policy=policy, **feats)))
    else:  # the window changes the result (a kernel that ignored it would fail above)
        assert rel_err(reference(step, scale=64 ** -0.5, causal=True, **feats), ref, n) > 3 * TOL[dtype]


def _window_step(seed, dtype=torch.float16):
    # a long decode, a prompt, a short decode and a chunk: each crosses the window
    return _build([1, 11, 1, 9], [260, 30, 7, 140], H=4, Hkv=2, seed=seed, pad_tokens=1, dtype=dtype)


def test_window_bits_equal_across_policies_modes_and_null_pages():
    """The same bits under every policy and both split modes, and under ``off``
    with vLLM's table for windowed layers (the pages below the window hold the
    null block, full of NaN/inf), which the short walk never lets through."""
    step = _window_step(21)
    feats = dict(logits_soft_cap=2.0, sinks=random_sinks(4, gen=_gen(21)), sliding_window=24)
    outs = [((p, m), _run(step, policy=p, mode=m, **feats)) for p in ("strict", "request", "off")
            for m in ("fold", "split")]
    dropped = drop_pages_below_window(step, 24, gen=_gen(22))
    assert (dropped.block_table[0, :10] == 0).all()  # the long decode's first pages are gone
    outs += [(("off, null pages", m), _run(dropped, policy="off", mode=m, **feats)) for m in ("fold", "split")]
    ref = reference(step, scale=0.125, causal=True, **feats)
    assert rel_err(outs[0][1], ref, step.num_tokens - 1) < TOL[torch.float16]
    for key, o in outs[1:]:
        assert torch.equal(bits(outs[0][1]), bits(o)), key


def test_constant_time_steps_below_the_window_leave_no_trace():
    """Under the constant-time policies a step wholly below a row's window runs unmasked
    on what its pages hold (as the csrc kernels', docs/kernels.md section 7); the row's
    state is put back to the neutral one after it, with a finite filler. So garbage
    (NaN, +-inf, large values) in the request's own pages below the window changes no
    bit, in either split mode: without the reset the state those steps evolve reaches
    the output, without the filler's guard a NaN does."""
    step = _window_step(26)
    feats = dict(logits_soft_cap=2.0, sinks=random_sinks(4, gen=_gen(26)), sliding_window=24)
    dirty = poison_pages_below_window(step, 24, gen=_gen(27))
    assert not torch.equal(dirty.key_cache, step.key_cache)
    for policy in ("strict", "request"):
        for mode in ("fold", "split"):
            clean = _run(step, policy=policy, mode=mode, **feats)
            assert torch.equal(bits(clean), bits(_run(dirty, policy=policy, mode=mode, **feats))), (policy, mode)


def test_off_walks_from_the_window_and_strict_walks_the_bucket(monkeypatch):
    """Policy off starts each tile's walk at its window (the KV steps below it are
    never run), the constant-time policies walk every step of the bucket, and the
    two walks give the same bits (the skipped steps are exact no-ops)."""
    import inspect

    from dhp_backend.ops.triton import kernels

    real = kernels.kv_step
    params = inspect.signature(real.fn).parameters
    visited = []

    def value(x):  # the interpreter's scalars are tensors or plain ints
        return int(x.handle.data) if hasattr(x, "handle") else int(x)

    def counting(*args, **kwargs):
        a = dict(zip(params, args), **kwargs)
        visited.append((value(a["j"]), value(a["BLOCK_N"])))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "kv_step", counting)
    g = _gen(23)
    window = 20
    step = assemble([make_request(1, 260, H=4, Hkv=2, D=64, dtype=torch.float16, gen=g)], block_size=16, gen=g)
    outs = {}
    for policy in ("strict", "off"):
        for mode in ("fold", "split"):
            visited.clear()
            outs[policy, mode] = _run(step, policy=policy, mode=mode, sliding_window=window)
            block_n = visited[0][1]
            steps = sorted({j for j, _ in visited})
            if policy == "strict":  # the bucket: the table's whole width
                assert steps == list(range(cdiv(step.capacity, block_n))), (mode, steps)
            else:  # from the step that holds the window's first position, 259 - 20 + 1
                assert steps == list(range(240 // block_n, cdiv(260, block_n))), (mode, steps)
                assert steps[0] > 0
    for o in outs.values():
        assert torch.equal(bits(outs["strict", "fold"]), bits(o))


def test_window_batch_invariance_and_prefill_row_equals_decode_and_chunk_rows():
    """With a window (below the context): a request's rows do not depend on the
    batch, and a row's bits are the same whether computed in a prefill tile, a
    decode tile or a chunk, under strict and under off (null pages included)."""
    g = _gen(24)
    H, Hkv, D, BS, W = 4, 2, 64, 16, 20
    feats = dict(sinks=random_sinks(H, gen=g), sliding_window=W)
    req = make_request(10, 75, H=H, Hkv=Hkv, D=D, dtype=torch.float16, gen=g)
    others = [make_request(q, s, H=H, Hkv=Hkv, D=D, dtype=torch.float16, gen=g) for q, s in [(1, 70), (9, 40)]]
    alone = _run(assemble([req], block_size=BS, gen=g, max_blocks=8), policy="strict", **feats)
    batch = assemble([others[0], req, others[1]], block_size=BS, gen=g, max_blocks=8, pad_tokens=2)
    assert torch.equal(bits(alone[:10]), bits(_run(batch, policy="strict", **feats)[1:11]))
    assert torch.equal(bits(alone[:10]), bits(_run(drop_pages_below_window(batch, W, gen=g), policy="off",
                                                   **feats)[1:11]))
    ctx = 75 - 10
    # Rows 0..5 as a chunk on the 65-token context. (A chunk starting mid-tile is a GPU
    # test: the interpreter's dot rounds by a row's place in the tile, see above.)
    chunk = type(req)(q=req.q[:6], k=req.k[: ctx + 6], v=req.v[: ctx + 6])
    out_chunk = _run(assemble([chunk], block_size=BS, gen=g, max_blocks=8), policy="strict", **feats)
    assert torch.equal(bits(alone[:6]), bits(out_chunk[:6]))
    for i in (0, 9):
        dec_req = type(req)(q=req.q[i: i + 1], k=req.k[: ctx + i + 1], v=req.v[: ctx + i + 1])
        dec = assemble([dec_req], block_size=BS, gen=g, max_blocks=8)
        assert torch.equal(bits(alone[i]), bits(_run(dec, policy="strict", **feats)[0])), f"row {i}"
        out_off = _run(drop_pages_below_window(dec, W, gen=g), policy="off", **feats)
        assert torch.equal(bits(alone[i]), bits(out_off[0])), f"row {i}, off with null pages"


def test_window_through_the_seam_and_the_address_rule():
    """Through ops.paged_attention: the window normalised against max_model_len, and
    vLLM's table for windowed layers (null pages below the window) accepted under
    off but refused under strict, whose walk reads every page of the bucket."""
    step = _build([2, 1], [50, 33], H=4, Hkv=2, seed=25, pad_tokens=2)
    kw = dict(scale=0.125, causal=True, num_tokens=step.num_tokens, path="triton")
    out = poisoned_out(step)
    paged_attention(*step.args(), out, policy="strict", max_model_len=step.capacity, sliding_window=8, **kw)
    check_written(step, out)
    assert rel_err(out, reference(step, scale=0.125, causal=True, sliding_window=8), 3) < TOL[torch.float16]
    assert torch.equal(bits(out), bits(_run(step, policy="strict", scale=0.125, sliding_window=8)))
    dropped = drop_pages_below_window(step, 8, gen=_gen(25))
    off = poisoned_out(step)
    paged_attention(*dropped.args(), off, policy="off", sliding_window=8, **kw)
    assert torch.equal(bits(out), bits(off))
    with pytest.raises(ValueError, match=r"distinct pages up to the bucket"):
        paged_attention(*dropped.args(), poisoned_out(step), policy="strict", max_model_len=step.capacity,
                        sliding_window=8, **kw)
    wide = poisoned_out(step)  # a window of max_model_len or more is no window: the plain bits
    paged_attention(*step.args(), wide, policy="strict", max_model_len=step.capacity,
                    sliding_window=step.capacity, **kw)
    assert torch.equal(bits(wide), bits(_run(step, policy="strict", scale=0.125)))
