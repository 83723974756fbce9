"""The harness's ``features`` family (issue 31): windows, soft-cap and sinks against FA3.

On a CPU: the cases, their work counts, the float32 reference's features, the
anchors' feature handling (FA3 and vLLM Triton get every feature; an anchor that
lacks one says so and never runs) and one CLI run of the tiny features cases
with DHP in the Triton interpreter. No test asserts on a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import anchors as A
from benchmarks import cases as C
from benchmarks import harness, inputs, report
from benchmarks.timer import HostTimer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def _set(c, seed=0):
    return inputs.build_set(c, torch.Generator().manual_seed(seed), CPU)


def _plain(c):
    return dataclasses.replace(c, sliding_window=None, logits_soft_cap=None, sinks=False)


# ------------------------------------------------------------------ the cases

def test_feature_cases_carry_their_models_features():
    full, quick = C.feature_cases(), C.feature_cases(quick=True)
    assert len(full) == 17 and len(quick) == 8 and {c.name for c in quick} <= {c.name for c in full}
    assert len({c.name for c in full}) == len(full)
    assert all(c.family == "features" and c.features for c in full)
    by = {c.name: c for c in full}
    mistral = by["mistral W4096 decode B16 ctx32768"]
    assert (mistral.num_heads, mistral.num_kv_heads, mistral.head_size) == (32, 8, 128)
    assert mistral.features == ("sliding_window",) and mistral.max_model_len == 32768
    gemma = by["gemma2 cap50 prefill S4096 causal"]
    assert (gemma.num_heads, gemma.num_kv_heads, gemma.head_size) == (16, 8, 256)
    assert gemma.features == ("logits_soft_cap",) and gemma.logits_soft_cap == 50.0
    local = by["gemma2-local W4096 cap50 decode B16 ctx8192"]
    assert local.features == ("sliding_window", "logits_soft_cap")
    oss = by["gpt-oss W128 sinks decode B16 ctx8192"]
    assert (oss.num_heads, oss.num_kv_heads, oss.head_size) == (64, 8, 64)
    assert oss.features == ("sliding_window", "sinks") and by["gpt-oss sinks prefill S4096 causal"].features == (
        "sinks",)
    phi3 = by["phi3 W2047 prefill S4096 causal"]
    assert (phi3.num_heads, phi3.num_kv_heads, phi3.head_size, phi3.features) == (32, 32, 96, ("sliding_window",))
    assert by["mistral W4096 mixed chunk2048@ctx6144 + 15 decodes@16384"].kind == "mixed"
    # Every window bites (below max_model_len: DHP and FA3 would otherwise run plain attention).
    assert all(c.sliding_window < c.max_model_len for c in full if c.sliding_window)
    # DHP's Triton path covers head 256 (Gemma-2), so no case had to fall back to head 128.
    from dhp_backend.ops.tiles import SUPPORTED_HEAD_SIZES

    assert {c.head_size for c in full} <= set(SUPPORTED_HEAD_SIZES)


def test_features_run_only_when_named():
    default, feats = C.gpu_cases(), C.feature_cases()
    listed = default + feats
    assert [c.name for c in C.select(listed, None)] == [c.name for c in default]
    assert [c.name for c in C.select(listed, "features")] == [c.name for c in feats]
    # Patterns of the other families time what they always did.
    for p in ("decode", "prefill", "mixed", "strict", "B16", "causal"):
        assert [c.name for c in C.select(listed, p)] == [c.name for c in C.select(default, p)], p
    assert [c.name for c in C.select(listed, "gemma2")] == [c.name for c in feats if c.name.startswith("gemma2")]
    assert [c.name for c in C.select(listed, "gpt-oss w128")] == [
        "gpt-oss W128 sinks decode B16 ctx8192", "gpt-oss W128 sinks prefill S4096 causal"]
    assert all(c.family != "features" for c in C.cpu_cases())


def test_a_window_that_cannot_bite_is_refused():
    with pytest.raises(ValueError, match="max_model_len = 4096"):
        C.featured(C.prefill(4096, True), "x", sliding_window=4096)
    with pytest.raises(ValueError, match="causal"):
        C.featured(C.prefill(64, False, shape=C.TINY), "x", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window"):
        C.decode(2, 64, shape=C.TINY, sliding_window=0)


# ------------------------------------------------------------------ work counts

def test_windowed_work_counts_by_hand():
    kv_row = 2 * 2 * 64 * 2  # TINY: K and V of one position, 2 KV heads, d 64, bf16
    per_key = 4 * 4 * 64  # 4 query heads
    # Decode B2 at 64, W 24: each row sees 24 keys; the K/V of 24 positions per request.
    d = C.featured(C.decode(2, 64, shape=C.TINY), "t", sliding_window=24)
    qo = 2 * 2 * 4 * 64 * 2
    assert C.work(d) == {"bytes": 2 * 24 * kv_row + qo, "flops": per_key * 2 * 24}
    # Prefill S32, W8: rows 0..7 see 1..8 keys (36), rows 8..31 see 8 (24 * 8): 228; every position is seen.
    p = C.featured(C.prefill(32, True, shape=C.TINY), "t", sliding_window=8)
    assert C.work(p) == {"bytes": 32 * kv_row + 2 * 32 * 4 * 64 * 2, "flops": per_key * 228}
    # A chunk of 8 on 24 cached, W 10: positions 24..31 see 10 keys each; keys 15..31 (17) are read.
    # Two decodes at 20: 10 keys, 10 positions each.
    m = C.featured(C.mixed(chunk=8, chunk_context=24, decodes=2, decode_ctx=20, shape=C.TINY), "t",
                   sliding_window=10)
    assert C.work(m) == {"bytes": (17 + 2 * 10) * kv_row + 2 * 10 * 4 * 64 * 2, "flops": per_key * (80 + 2 * 10)}
    # A window wider than every row's reach counts as the plain causal step.
    wide = C.featured(C.decode(2, 64, shape=C.TINY, max_model_len=128), "t", sliding_window=100)
    assert C.work(wide) == C.work(_plain(wide))
    # Executed under a constant-time policy: the window is a selection, the walk is the bucket.
    s = C.featured(C.decode(2, 64, shape=C.TINY, max_model_len=128), "t", sliding_window=24)
    assert C.work(s, "strict") == C.work(_plain(s), "strict") == {"bytes": 2 * 128 * kv_row + qo,
                                                                  "flops": per_key * 2 * 128}
    assert C.work(s, "request") == {"bytes": 2 * 64 * kv_row + qo, "flops": per_key * 2 * 64}
    assert C.work(s, "off") == C.work(s)


def test_windowed_keys_against_a_loop():
    for ctx in range(0, 40, 3):
        for q in (1, 2, 7, 16):
            for W in (1, 5, 16, 60):
                assert C.windowed_keys(ctx, q, W) == sum(min(W, ctx + i + 1) for i in range(q)), (ctx, q, W)


# ------------------------------------------------------------------ the reference

FEATURE_SHAPES = [
    C.featured(C.decode(3, 50, shape=C.TINY), "t", sliding_window=20, logits_soft_cap=50.0),
    C.featured(C.prefill(40, True, shape=C.TINY), "t", sliding_window=7, sinks=True),
    C.featured(C.mixed(chunk=24, chunk_context=40, decodes=3, decode_ctx=33, shape=C.TINY), "t",
               sliding_window=16, sinks=True),
    C.featured(C.decode(2, 40, shape={**C.TINY, "num_kv_heads": 1}), "t", logits_soft_cap=30.0),
]


@pytest.mark.parametrize("c", FEATURE_SHAPES, ids=lambda c: c.name)
def test_reference_applies_the_features_as_ops_reference(c):
    from dhp_backend.ops.reference import paged_attention_reference

    s = _set(c, seed=3)
    out = torch.empty_like(s.query, dtype=torch.float32)
    paged_attention_reference(s.query.float(), s.key_cache, s.value_cache, s.block_table, s.query_start_loc,
                              s.seq_lens, out, scale=c.head_size ** -0.5, causal=True, num_tokens=c.num_tokens,
                              logits_soft_cap=c.logits_soft_cap, sinks=s.sinks, sliding_window=c.sliding_window)
    for max_scores in (2**27, 4 * 64):  # whole rows, and several row chunks
        assert torch.allclose(inputs.reference(c, s, max_scores=max_scores), out, atol=1e-5)
    # Each feature bites on these inputs: without it the check against the reference would fail
    # (the inputs are drawn so that an anchor that dropped one could not pass).
    for f in c.features:
        s2 = dataclasses.replace(s, sinks=None) if f == "sinks" else s
        without = inputs.reference(dataclasses.replace(c, **{f: False if f == "sinks" else None}), s2)
        assert inputs.rel_err(without, out) > 0.1, f


def test_reference_against_a_float64_loop():
    """Row by row, key by key, from the definitions (FlashAttention's window (W - 1, 0))."""
    c = C.featured(C.mixed(chunk=5, chunk_context=9, decodes=1, decode_ctx=12, shape=C.TINY), "t",
                   sliding_window=6, sinks=True)
    s = _set(c, seed=4)
    capped = dataclasses.replace(c, sinks=False, logits_soft_cap=20.0)
    for case, sinks in ((c, s.sinks), (capped, None)):
        st = dataclasses.replace(s, sinks=sinks)
        ref = inputs.reference(case, st)
        G, D, bs = case.num_heads // case.num_kv_heads, case.head_size, case.block_size
        t = 0
        for r, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
            for i in range(q_len):
                pos = seq_len - q_len + i
                for h in range(case.num_heads):
                    logits, values = [], []
                    for k in range(seq_len):
                        if not pos - case.sliding_window < k <= pos:
                            continue
                        blk = int(s.block_table[r, k // bs])
                        kv = s.kv[blk, h // G, k % bs].double()
                        x = float(s.query[t, h].double() @ kv[:D]) * D ** -0.5
                        if case.logits_soft_cap:
                            x = case.logits_soft_cap * math.tanh(x / case.logits_soft_cap)
                        logits.append(x)
                        values.append(kv[D:])
                    m = max(logits + ([float(sinks[h])] if sinks is not None else []))
                    w = [math.exp(x - m) for x in logits]
                    den = sum(w) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                    expect = sum(wi * v for wi, v in zip(w, values)) / den
                    assert torch.allclose(ref[t, h].double(), expect, atol=2e-5), (case.name, r, i, h)
                t += 1


def test_sinks_are_drawn_bf16_exact_and_weigh_about_half_a_row():
    c = C.featured(C.decode(2, 64, shape=C.TINY), "t", sliding_window=32, sinks=True)
    s = _set(c)
    assert s.sinks.dtype == torch.float32 and s.sinks.shape == (c.num_heads,)
    assert torch.equal(s.sinks.to(torch.bfloat16).float(), s.sinks)
    assert abs(float(s.sinks.mean()) - math.log(32)) < 2.5
    plain = _set(_plain(c))
    assert torch.equal(plain.kv, s.kv) and torch.equal(plain.query, s.query) and plain.sinks is None


# ------------------------------------------------------------------ anchors

class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, **kw):
        self.calls.append(kw)
        return kw["out"]


def test_fa3_gets_every_feature_as_vllm_passes_it():
    c = FEATURE_SHAPES[2]  # window 16, sinks
    s = _set(c)
    a = A.FlashAttention3(CPU)
    a.fn = _Recorder()
    a.prepare(c, [s])
    a.run(0)
    kw = a.fn.calls[0]
    assert kw["window_size"] == [15, 0] and kw["fa_version"] == 3 and "softcap" not in kw
    assert kw["s_aux"].dtype == torch.bfloat16 and torch.equal(kw["s_aux"].float(), s.sinks)
    a.release()
    cap = FEATURE_SHAPES[0]  # window 20, cap 50
    a.prepare(cap, [_set(cap)])
    a.run(0)
    kw = a.fn.calls[1]
    assert kw["window_size"] == [19, 0] and kw["softcap"] == 50.0 and "s_aux" not in kw
    # A plain case makes the call it always made: no feature argument at all.
    plain = C.decode(2, 64, shape=C.TINY)
    a.prepare(plain, [_set(plain)])
    a.run(0)
    assert not {"window_size", "softcap", "s_aux"} & set(a.fn.calls[2])


def test_vllm_triton_gets_every_feature():
    c = FEATURE_SHAPES[2]
    s = _set(c)
    a = A.TritonUnified(CPU)
    a.fn, a.min_grid, a.segments = _Recorder(), 128, 16
    a.prepare(c, [s])
    a.run(0)
    kw = a.fn.calls[0]
    assert kw["window_size"] == (15, 0) and kw["softcap"] == 0 and kw["sinks"] is s.sinks


class _MathSdpa(A.SdpaCudnn):
    def available(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.backend, self.sdpa_kernel = SDPBackend.MATH, sdpa_kernel


class _Counting(A.Anchor):
    """A correct stand-in that declares no feature: it must never be launched on a featured case."""

    name, label, graphable = "counting", "counting", False

    def __init__(self, name="counting"):
        super().__init__(CPU)
        self.name, self.launches = name, 0

    def available(self):
        return None

    def run(self, i):
        self.launches += 1
        return inputs.reference(self.case, self.sets[i]).to(self.sets[i].query.dtype)


def test_anchors_lacking_a_feature_say_so_and_never_run():
    c = FEATURE_SHAPES[0]  # window and cap
    s = _set(c)
    for anchor in (A.FlashInfer(CPU), _MathSdpa(CPU)):
        anchor.notes = ["from the previous case"]
        with pytest.raises(A.NotAvailable, match="sliding_window and logits_soft_cap: "):
            anchor.prepare(c, [s])
        assert anchor.notes == []
    counting, sdpa = _Counting(), _MathSdpa(CPU)
    sdpa.available()
    rows = harness.run_cases([c], [counting, sdpa, A.DHP(CPU, "off")], device=CPU,
                             timer=HostTimer(reps=2, warmup=0), l2_bytes=2**20, max_sets=1)
    by = {r["anchor"]: r for r in rows}
    assert counting.launches == 0 and by["counting"]["time_ms"] is None
    assert by["counting"]["status"] == ("not available: sliding_window and logits_soft_cap: this anchor passes "
                                        "no model features to its kernel")
    assert by["sdpa_cudnn"]["status"].startswith("not available: sliding_window and logits_soft_cap: torch's")
    assert by["dhp_off"]["status"] == "ok" and by["dhp_off"]["rel_err"] < 2e-2
    assert (by["dhp_off"]["sliding_window"], by["dhp_off"]["logits_soft_cap"], by["dhp_off"]["sinks"]) == (
        20, 50.0, False)
    assert {a.name for a in A.make_anchors(CPU) if a.features == A.ALL_FEATURES} == {
        "fa3", "triton_unified", "dhp_off", "dhp_strict", "dhp_request"}
    # The stand-in does run a plain case.
    plain = C.decode(2, 64, shape=C.TINY)
    rows = harness.run_cases([plain], [counting], device=CPU, timer=HostTimer(reps=2, warmup=0),
                             l2_bytes=2**20, max_sets=1)
    assert rows[0]["status"] == "ok" and counting.launches == 3


# ------------------------------------------------------------------ report

def _row(case, anchor, ms, **kw):
    return {"case": case, "anchor": anchor, "family": "features", "ctx": 8192, "bound": "memory", "batch": 16,
            "status": "ok", "time_ms": ms, "useful_GBps": ms and 1.0 / ms, "useful_TFLOPs": ms and 1.0 / ms,
            "sliding_window": 4096, "logits_soft_cap": None, "sinks": False, **kw}


def test_report_gives_off_vs_fa3_and_the_constant_time_cost():
    rows = [_row("w", "fa3", 1.0), _row("w", "dhp_off", 1.25), _row("w", "dhp_strict", 5.0),
            _row("w", "dhp_request", 2.5),
            _row("c", "fa3", 2.0, sliding_window=None, logits_soft_cap=50.0), _row("c", "dhp_off", 2.0),
            _row("c", "flashinfer", None, status="not available: sliding_window: x")]
    s = report.summarize(rows)
    assert s["features_off_vs_fa3"] == pytest.approx(0.8) and s["worst_shape"]["features_off_vs_fa3"] == "w"
    lines = report.features_table(rows)
    w = next(x for x in lines if x.startswith("| w |"))
    assert w == "| w | window 4096 | 1 | 1.25 | 0.80x | 5 | 4.00x | 2.5 | 2.00x |"
    assert next(x for x in lines if x.startswith("| c |")).split(" | ")[1:6] == ["cap 50", "2", "2", "1.00x", "-"]
    assert report.features_table([{**r, "family": "decode"} for r in rows]) == []


# ------------------------------------------------------------------ the harness end to end

def test_cpu_features_run_end_to_end_under_the_interpreter(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.harness", "--device", "cpu", "--cases", "features",
                           "--out", str(out), "--no-plots"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    cases = C.cpu_feature_cases()
    assert [c["name"] for c in doc["cases"]] == [c.name for c in cases]
    assert all(c["family"] == "features" for c in doc["cases"])
    rows = doc["rows"]
    assert len(rows) == len(cases) * len(A.ANCHOR_NAMES)
    for r in rows:
        if r["anchor"].startswith("dhp_"):
            assert r["status"] == "ok" and r["kernel"] == "triton" and r["rel_err"] < 2e-2, r
        else:
            assert r["status"].startswith("not available: needs a CUDA GPU"), r
        assert r["sliding_window"] in (24, 8)
    strict = next(r for r in rows if r["anchor"] == "dhp_strict" and r["kind"] == "decode")
    assert strict["executed_flops"] > strict["useful_flops"]  # the bucket, not the window
    md = (out / "bench.md").read_text()
    assert "## Model features: DHP off vs FA3" in md and "| features case |" in proc.stdout
