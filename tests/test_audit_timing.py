"""G4 timing gate on the CPU: statistics on synthetic streams, PNG fallback, the plan and its inputs (address
rule, shared pages), the g4-latest report and its merging, no-GPU exit, the run glue with a faked GPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
import zlib

import numpy as np
import pytest
import torch

from dhp_backend.audit import png, stats, timing

N = 100_000


def _stream(rng, n, *, base=100.0, shift=0.0, tail_p=0.0, tail_us=0.0, shared=None):
    """Event-like launch times (µs): per-round shared drift, jitter, rare outliers, 0.5 µs quantisation."""
    x = base + shift + rng.normal(0.0, 0.8, n) + rng.exponential(0.3, n)
    x += np.where(rng.random(n) < 0.002, rng.exponential(20.0, n), 0.0)  # interrupts / neighbours
    if tail_p:
        x += np.where(rng.random(n) < tail_p, tail_us, 0.0)
    if shared is not None:
        x += shared
    return np.round(x * 2.0) / 2.0


def _pair(seed, **leak):
    rng = np.random.default_rng(seed)
    shared = np.cumsum(rng.normal(0.0, 0.01, N)) + rng.normal(0.0, 0.3, N)  # clock drift + per-round state
    return _stream(rng, N, shared=shared), _stream(rng, N, shared=shared, **leak)


# ---------------------------------------------------------------- Welch

def test_online_welch_equals_two_pass_numpy():
    rng = np.random.default_rng(1)
    a = 1e6 + rng.normal(0, 1e-2, 5000)  # large offset, tiny spread: naive sum-of-squares would cancel
    b = 1e6 + 3e-4 + rng.normal(0, 2e-2, 7000)
    one, batch = stats.WelchT(), stats.WelchT()
    for x in a:
        one.update(0, x)
    for x in b:
        one.update(1, x)
    for i in range(0, a.size, 999):
        batch.update_batch(0, a[i:i + 999])
    for i in range(0, b.size, 1234):
        batch.update_batch(1, b[i:i + 1234])
    ref = stats.welch_t(a, b)
    for w in (one, batch):
        assert w.n == (a.size, b.size)
        assert w.means[0] == pytest.approx(a.mean(), rel=1e-13)
        assert w.means[1] == pytest.approx(b.mean(), rel=1e-13)
        assert w.variances[0] == pytest.approx(a.var(ddof=1), rel=1e-7)
        assert w.variances[1] == pytest.approx(b.var(ddof=1), rel=1e-7)
        assert w.t == pytest.approx(ref, rel=1e-6)
    assert math.isnan(stats.WelchT().t)


def test_clean_streams_pass():
    a, b = _pair(2)
    r = timing.analyse_streams(a, b)
    assert r["n"] == [N, N]
    assert abs(r["t"]) < stats.THRESHOLD and r["paired"]["z_max"] < stats.THRESHOLD
    assert r["verdict"] == "pass" and r["passed"] is True
    short = timing.analyse_streams(a[:5000], b[:5000])
    assert short["verdict"] == "too few samples" and short["passed"] is False


def test_half_percent_mean_shift_fails():
    a, b = _pair(3, shift=0.5)  # 0.5 % of 100 µs
    r = timing.analyse_streams(a, b)
    assert abs(r["t"]) > stats.THRESHOLD and r["paired"]["z_max"] > stats.THRESHOLD
    assert r["verdict"] == "FAIL" and r["passed"] is False
    assert r["diff_pct"] == pytest.approx(0.5, abs=0.05)


def test_tail_only_leak_fails():
    a, b = _pair(4, tail_p=0.03, tail_us=4.0)  # 3 % of B's launches 4 µs slower; the median does not move
    assert np.median(a) == np.median(b)
    r = timing.analyse_streams(a, b)
    assert abs(r["t"]) > stats.THRESHOLD or r["paired"]["z_max"] > stats.THRESHOLD
    assert r["verdict"] == "FAIL"


def test_control_and_summary():
    a, b = _pair(5, shift=30.0)
    ctl = timing.analyse_streams(a[:20000], b[:20000], pair=("short", "long"), role="control")
    assert ctl["detected"] is True and ctl["verdict"] == "leak detected"
    same = timing.analyse_streams(a[:20000], a[:20000], pair=("short", "long"), role="control")
    assert same["detected"] is False
    g = timing.analyse_streams(*_pair(6))
    s = timing.summarize([ctl, g], 1.0)
    assert s["run_passed"] is True and s["control_detected"] is True
    assert s["passed"] is False and not s["complete"]  # one cell of the full grid is not the gate
    s = timing.summarize([same, g], 1.0)
    assert s["run_passed"] is False and "cannot detect a leak" in s["messages"][0]
    assert timing.summarize([g], 1.0)["control_detected"] is None  # not measured: not a failure of this run
    assert timing.summarize([g], 1.0)["run_passed"] is True


# ---------------------------------------------------------------- paired tests

def _wilcoxon_brute(d):
    d = [x for x in d if x != 0]
    n = len(d)
    absd = [abs(x) for x in d]
    ranks = [sum(1 for y in absd if y < x) + (sum(1 for y in absd if y == x) + 1) / 2 for x in absd]
    w = sum(r for r, x in zip(ranks, d) if x > 0)
    groups = {}
    for x in absd:
        groups[x] = groups.get(x, 0) + 1
    var = n * (n + 1) * (2 * n + 1) / 24 - sum(t ** 3 - t for t in groups.values()) / 48
    return w, (w - n * (n + 1) / 4) / math.sqrt(var)


def test_wilcoxon_ties_and_zeros():
    d = [1, 1, 1, -1, 2, 2, -2, 0, 0, 3, -0.5, 3, 3, -3]
    w = stats.wilcoxon_signed_rank(d)
    w_ref, z_ref = _wilcoxon_brute(d)
    assert w["n"] == 12 and w["zeros"] == 2
    assert w["w_plus"] == pytest.approx(w_ref) and w["z"] == pytest.approx(z_ref)
    r, sizes = stats.average_ranks(np.array([5.0, 1.0, 5.0, 3.0, 5.0]))
    assert r.tolist() == [4.0, 1.0, 4.0, 2.0, 4.0] and sorted(sizes.tolist()) == [1, 1, 3]
    assert stats.wilcoxon_signed_rank([0, 0, 0])["z"] == 0.0
    s = stats.sign_test(d)
    assert (s["positive"], s["negative"], s["zeros"]) == (8, 4, 2)
    # Heavy ties (0.5 µs quantisation, most differences in three values) but symmetric: no signal.
    rng = np.random.default_rng(7)
    q = rng.choice([-0.5, 0.0, 0.5], size=N, p=[0.3, 0.4, 0.3])
    assert stats.paired(q)["z_max"] < stats.THRESHOLD
    q2 = rng.choice([-0.5, 0.0, 0.5], size=N, p=[0.28, 0.4, 0.32])  # 2 points of asymmetry
    p2 = stats.paired(q2)
    assert abs(p2["sign"]["z"]) > stats.THRESHOLD and abs(p2["wilcoxon"]["z"]) > stats.THRESHOLD


# ---------------------------------------------------------------- cropping

def test_percentile_cropping():
    q = stats.crop_quantiles(100)
    assert q[0] == pytest.approx(1 - 0.5 ** 0.1) and q[-1] == pytest.approx(1 - 0.5 ** 10)
    rng = np.random.default_rng(8)
    n = 50_000
    # Rare huge outliers in both classes drown a small bulk shift in the full-sample variance.
    out_a = np.where(rng.random(n) < 0.01, rng.exponential(2000.0, n), 0.0)
    out_b = np.where(rng.random(n) < 0.01, rng.exponential(2000.0, n), 0.0)
    a = 100 + rng.normal(0, 1, n) + out_a
    b = 100.1 + rng.normal(0, 1, n) + out_b
    full = stats.WelchT()
    full.update_batch(0, a)
    full.update_batch(1, b)
    crop = stats.CroppedWelch(k=20)
    for i in range(0, n, 700):
        crop.update_batch(a[i:i + 700], b[i:i + 700])
    tmax, quant = crop.max_abs_t()
    assert abs(full.t) < stats.THRESHOLD < tmax and quant < 0.99
    # thresholds are pooled quantiles of the calibration window, and every sample is counted once
    assert crop.thresholds is not None and np.all(np.diff(crop.thresholds) >= 0)
    top = crop.tests[-1]
    assert sum(top.n) <= 2 * n and sum(top.n) > 1.9 * n
    small = stats.CroppedWelch()
    small.update_batch([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
    assert small.thresholds is None
    small.flush()
    assert small.thresholds is not None


# ---------------------------------------------------------------- PNG fallback and reports

def _png_info(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    w, h, depth, colour = struct.unpack(">IIBB", data[16:26])
    pos, idat = 8, b""
    while pos < len(data):
        ln, k = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + ln]
        assert struct.unpack(">I", data[pos + 8 + ln:pos + 12 + ln])[0] == zlib.crc32(k + body) & 0xFFFFFFFF
        if k == b"IDAT":
            idat += body
        pos += 12 + ln
    assert len(zlib.decompress(idat)) == h * (1 + 3 * w) and (depth, colour) == (8, 2)
    return w, h


def test_fallback_png_is_valid(tmp_path):
    rng = np.random.default_rng(9)
    p = png.histograms(str(tmp_path / "h.png"), rng.normal(10, 1, 3000), rng.normal(10.2, 1, 3000),
                       labels=("random", "zeros"), title="test", width=321, height=203)
    assert _png_info(open(p, "rb").read()) == (321, 203)
    p = png.series(str(tmp_path / "s.png"), np.arange(50), rng.normal(0, 2, 50), hlines=(4.5, -4.5), width=300,
                   height=150)
    data = open(p, "rb").read()
    assert _png_info(data) == (300, 150)
    assert png.read_header(data)["width"] == 300


def _rows(a, b):
    """Rows of every role on synthetic streams (control, gating too short, reported, an error)."""
    from dhp_backend.audit import classes

    churned = classes.Shape(layout="churned")
    rows = [timing.analyse_streams(a[:20000], (b + 40)[:20000], pair=("short", "long"), role="control",
                                   policy="off"),
            timing.analyse_streams(a[:3000], b[:3000], pair=("short", "long"), role="gating", shape=churned),
            timing.analyse_streams(a[:3000], b[:3000] + 1, pair=("random", "zeros"), role="reported",
                                   shape=churned, mode="graph")]
    spec = timing.PairSpec(dataclasses.replace(churned, policy="request"), "random", "random2", "gating", 10)
    rows.append(timing.error_result(spec, "graph", "RuntimeError: capture failed"))
    return rows


def test_report_json_has_documented_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "renderer", lambda: "builtin (dhp_backend.audit.png)")
    a, b = _pair(10)
    rows = _rows(a, b)
    meta = {"device": "NVIDIA H100 80GB HBM3", "versions": dict(timing.versions(), commit="abc1234"),
            "settings": {"seed": 0, "warmup": 50, "chunk": 128, "host_pad": "fake"}, "seconds": 3.0,
            "churn": {"25000": {"fingerprint": "f" * 16, "vllm": "0.24.0", "seed": 0}}}
    (md, js), merged = timing.write_reports(str(tmp_path), rows, meta, date="2026-01-02", plots=True,
                                            save_samples=True)
    assert js == str(tmp_path / "g4-latest.json") and md == str(tmp_path / "g4-latest.md")
    doc = json.load(open(js))
    assert set(timing.REPORT_KEYS) <= set(doc)
    assert (doc["device"], doc["commit"], doc["date"]) == ("NVIDIA H100 80GB HBM3", "abc1234", "2026-01-02")
    assert set(timing.SUMMARY_KEYS) <= set(doc["summary"])
    for r in doc["rows"]:
        assert set(timing.RESULT_KEYS) <= set(r), set(timing.RESULT_KEYS) - set(r)
        assert "_samples" not in r
    by = {(r["role"], r["pair"]): r for r in doc["rows"]}
    ctl, gate = by[("control", "short vs long")], by[("gating", "short vs long")]
    assert ctl["verdict"] == "leak detected" and ctl["policy"] == "off"
    assert gate["verdict"] == "too few samples" and gate["layout"] == "churned" and gate["num_blocks"] == 25000
    assert (gate["step"], gate["bucket"], gate["lengths"], gate["n_per_class"]) == ("decode", 4096, [1, 4096], 3000)
    assert by[("reported", "random vs zeros")]["verdict"] == "differs"
    err = by[("gating", "random vs random2")]
    assert err["verdict"] == "error" and err["policy"] == "request" and err["lengths"] == [3072, 3072]
    s = doc["summary"]
    assert s["passed"] is False and s["complete"] is False and s["control_detected"] is True
    # the grid: 36 length cells + 8 data cells + 6 controls + 12 null cells; one gating row is there
    assert len(s["missing"]) == 36 + 8 + 6 + 12 - 1
    plotted = [r for r in doc["rows"] if r["plots"]]
    assert len(plotted) == 3
    for r in plotted:
        for p in r["plots"]:
            assert os.path.dirname(p).endswith("timing-plots")
            _png_info(open(p, "rb").read())
    text = open(md).read()
    assert "G4 timing gate" in text and "capture failed" in text and "churned" in text and "ffffffffffffffff" in text
    assert "not measured yet" in text and "decoy" not in text.lower()
    assert (tmp_path / "g4-latest-samples.npz").exists()
    assert merged["rows"] == 4


def test_reports_merge_rows_of_one_commit(tmp_path):
    a, b = _pair(11)
    meta = {"device": "NVIDIA H100 80GB HBM3", "versions": {"commit": "abc1234"}, "settings": {}}
    first = _rows(a, b)[:2]
    timing.write_reports(str(tmp_path), first, meta)
    second = [timing.analyse_streams(a[:3000], b[:3000], pair=("short", "long"), role="gating",
                                     layout="consecutive")]
    _, merged = timing.write_reports(str(tmp_path), second, meta)
    doc = json.load(open(tmp_path / "g4-latest.json"))
    assert len(doc["rows"]) == 3 and merged["merge"].startswith("merged with 2 rows")
    assert {r["layout"] for r in doc["rows"] if r["role"] == "gating"} == {"churned", "consecutive"}
    # the same cell measured again replaces the earlier row
    _, merged = timing.write_reports(str(tmp_path), second, meta)
    assert json.load(open(tmp_path / "g4-latest.json"))["summary"]["rows"] == 3
    # another commit of the same code (a report committed between pieces): still one report
    _, merged = timing.write_reports(str(tmp_path), second, dict(meta, versions={"commit": "def5678"}))
    doc = json.load(open(tmp_path / "g4-latest.json"))
    assert len(doc["rows"]) == 3 and doc["commit"] == "def5678" and doc["source"] == timing.source_hash()
    assert {r["commit"] for r in doc["rows"]} == {"abc1234", "def5678"}
    # other code: the earlier rows are dropped, not mixed in
    _, merged = timing.write_reports(str(tmp_path), second, dict(meta, source="0" * 16))
    doc = json.load(open(tmp_path / "g4-latest.json"))
    assert len(doc["rows"]) == 1 and "not merged" in merged["merge"] and doc["source"] == "0" * 16
    # an explicit file to merge into (the repository's copy, on the GPU machine's fresh $OUT)
    out = tmp_path / "out"
    _, merged = timing.write_reports(str(out), first, dict(meta, source="0" * 16),
                                     merge_from=str(tmp_path / "g4-latest.json"))
    assert merged["rows"] == 3 and (out / "g4-latest.json").exists()
    assert timing.source_hash() == timing.source_hash() and len(timing.source_hash()) == 16


def test_run_without_gpu_returns_2_and_estimate_runs_anywhere(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    assert timing.run(ap.parse_args([])) == 2
    assert "GPU machine" in capsys.readouterr().err
    for bad in (["--lengths", "4k"], ["--layouts", "decoy"], ["--policies", "batch"], ["--prefill", "4"],
                ["--steps", "mixed"], ["--pairs", "random:nothing"], ["--samples", "0"], ["--num-blocks", "100"]):
        assert timing.run(ap.parse_args(bad)) == 2, bad
        assert "audit timing: --" in capsys.readouterr().err
    assert timing.run(ap.parse_args(["--estimate"])) == 0
    out = capsys.readouterr().out
    assert "9 cache group(s)" in out and "estimated wall time on an H100" in out
    assert timing.run(ap.parse_args(["--estimate", "--preset", "subset"])) == 0
    assert "decode L4096 churned, 25000 blocks" in capsys.readouterr().out


def test_full_grid_is_the_issue_s_cells():
    grid = timing.full_grid()
    lengths = [c for c in grid if (c[5], c[6]) == ("short", "long")]
    data = [c for c in grid if (c[5], c[6]) == ("random", "random2")]
    # short vs long: decode at 4096 and 32768, prefill at 4096; 2 policies x 3 layouts x 2 modes each
    assert len(lengths) == 3 * 2 * 3 * 2 and {(c[0], c[1]) for c in lengths} == {
        ("decode", 4096), ("decode", 32768), ("prefill", 4096)}
    assert {c[3] for c in lengths} == set(timing.LAYOUTS)
    # random vs random2: each step kind's smallest bucket, per policy and mode, on any one layout
    assert len(data) == 2 * 2 * 2 and {(c[0], c[1], c[3]) for c in data} == {("decode", 4096, None),
                                                                          ("prefill", 4096, None)}
    assert "dhp_backend/vllm" not in timing.MEASURED_CODE and "csrc" in timing.MEASURED_CODE


def _settings(*argv):
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    return timing.settings_from_args(ap.parse_args(list(argv)))


def test_plan_covers_the_grid_with_shared_caches():
    st = _settings()
    groups = timing.plan(st)
    assert [(g.step, g.bucket, g.layout) for g in groups][:3] == [("decode", 4096, "consecutive"),
                                                                  ("decode", 4096, "random"),
                                                                  ("decode", 4096, "churned")]
    # decode at L 4096 and 32768, prefill at L 4096 (the gate's buckets), three layouts each
    assert [(g.step, g.bucket) for g in groups][::3] == [("decode", 4096), ("decode", 32768), ("prefill", 4096)]
    assert len(groups) == 3 * 3
    for g in groups:
        roles = [s.role for s in g.specs]
        first_layout = g.layout == st.layouts[0]
        # the data pairs: on the first layout of the step kind's smallest bucket only (`timing.full_grid`)
        data_cell = first_layout and g.bucket == 4096
        assert roles.count("control") == (1 if first_layout else 0)
        if first_layout:
            ctl = g.specs[0]
            assert ctl.shape.policy == "off" and (ctl.a, ctl.b) == ("short", "long") and ctl.rounds == 20_000
        gating = [s for s in g.specs if s.role == "gating"]
        pairs = (("short", "long"), ("random", "random2")) if data_cell else (("short", "long"),)
        assert {(s.shape.policy, s.a, s.b) for s in gating} == {(p, a, b) for p in ("strict", "request")
                                                              for a, b in pairs}
        assert all(s.rounds == 100_000 for s in gating)
        assert {(s.a, s.b) for s in g.specs if s.role == "reported"} == (
            {("random", "zeros"), ("random", "constant")} if data_cell else set())
        for s in g.specs:  # one cache per group: every shape of it has the same table and cache size
            assert (s.shape.layout, s.shape.bucket, s.shape.step) == (g.layout, g.bucket, g.step)
            assert s.shape.blocks == g.specs[0].shape.blocks
    shapes = {(g.step, g.bucket): g.specs[0].shape for g in groups}
    assert (shapes["decode", 4096].batch, shapes["decode", 4096].q_len, shapes["decode", 4096].blocks) == (16, 1, 25000)
    assert shapes["decode", 32768].blocks == 17 * 2048  # (B + 1) * L / block_size > 25,000
    assert (shapes["prefill", 4096].batch, shapes["prefill", 4096].q_len) == (4, 64)
    assert ("prefill", 32768) not in shapes
    big = {(g.step, g.bucket): g.specs[0].shape for g in timing.plan(_settings("--lengths", "4096,32768"))}
    assert (big["prefill", 32768].batch, big["prefill", 32768].q_len, big["prefill", 32768].blocks) == (4, 64, 25000)
    # a piece of the grid, and the preset one device call runs
    sub = _settings("--preset", "subset")
    assert (sub.steps, sub.lengths, sub.policies, sub.layouts, sub.modes) == (
        ("decode",), (4096,), ("strict", "request"), ("churned",), ("graph",))
    assert timing.estimate_s(sub)["total_s"] < 9 * 60
    assert _settings("--preset", "subset", "--layouts", "random").layouts == ("random",)
    q = _settings("--quick")
    assert q.layouts == timing.LAYOUTS and q.samples < 10_000 and q.quick
    assert _settings("--pairs", "gating", "--no-control").pairs == (("short", "long", "gating"),
                                                                    ("random", "random2", "gating"))
    assert _settings("--pairs", "random:skewed").pairs == (("random", "skewed", "reported"),)
    assert _settings("--num-blocks", "60000").num_blocks == 60000
    assert timing.estimate_s(st)["total_s"] > 60 * 60  # the full grid needs several device sessions


def test_classes_lengths_share_the_bucket():
    from dhp_backend.audit import classes
    from dhp_backend.ops.buckets import next_pow2, reserved_tokens

    for step_q in (1, 64):
        for L in (4096, 32768):
            for policy in ("strict", "request"):
                sh = classes.Shape(bucket=L, q_len=step_q, policy=policy)
                short, long_ = classes.true_length(sh, "short"), classes.true_length(sh, "long")
                assert step_q <= short < long_ == L
                # the reservation is the bucket for both classes, and it is what the engine reserves
                for n in (short, long_):
                    assert classes.reserved_tokens(sh) == reserved_tokens(policy, n, L) == L
                if policy == "request":  # one power of two: the same per-request bucket
                    assert next_pow2(short) == next_pow2(long_) == L and short == L // 2 + 1
                else:
                    assert short == step_q
                mid = classes.true_length(sh, "random")
                assert next_pow2(mid) == L and mid == classes.true_length(sh, "random2")
                # the diagnostic length classes at<N>: any length that shares the bucket, nothing outside it
                for n in (short, (short + long_) // 2, long_):
                    assert classes.true_length(sh, f"at{n}") == n
                    assert classes.reserved_tokens(sh) == reserved_tokens(policy, n, L) == L
                for bad in [long_ + 1] + ([short - 1] if short > 1 else []):
                    with pytest.raises(ValueError, match=f"at{bad}.*outside"):
                        classes.true_length(sh, f"at{bad}")
    assert classes.is_class("at2176") and not classes.is_class("at") and not classes.is_class("at-3")
    assert not classes.is_class("at0") and not classes.is_class("short_aligned")
    from dhp_backend.audit.timing import parse_pairs

    assert parse_pairs("at2176:long,short:long") == [("at2176", "long", "reported"), ("short", "long", "gating")]
    with pytest.raises(ValueError, match="at<N>"):
        parse_pairs("atx:long")

@pytest.mark.parametrize("layout", ["consecutive", "random", "churned"])
def test_make_inputs_obey_the_address_rule_and_share_pages(layout):
    from dhp_backend.audit import classes
    from dhp_backend.ops import paged_attention

    for policy in ("strict", "request", "off"):
        sh = classes.Shape(batch=3, bucket=128, q_len=1, num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                           dtype="float32", policy=policy, layout=layout, num_blocks=40)
        shared = {}
        ins = {c: classes.make_inputs(sh, c, seed=1, device="cpu", shared=shared) for c in classes.CLASSES}
        t = ins["short"]["block_table"]
        assert tuple(t.shape) == (3, 8) and int(t.min()) >= 1 and t.unique().numel() == 24
        for c, x in ins.items():
            assert x["block_table"] is t, "one public table for every class"
            assert x["seq_lens"].tolist() == [classes.true_length(sh, c)] * 3
        # short, long and random differ in lengths only: the very same tensors
        assert ins["short"]["key_cache"] is ins["long"]["key_cache"] is ins["random"]["key_cache"]
        at = classes.make_inputs(sh, "at100", seed=1, device="cpu", shared=shared)
        assert at["key_cache"] is ins["short"]["key_cache"] and at["seq_lens"].tolist() == [100] * 3
        assert not torch.equal(ins["random"]["key_cache"], ins["random2"]["key_cache"])
        assert bool((ins["zeros"]["value_cache"] == 0).all())
        assert bool((ins["constant"]["query"] == classes.CONSTANT).all())
        if policy == "request":
            assert ins["short"]["bucket"].tolist() == ins["long"]["bucket"].tolist() == [128] * 3
        else:
            assert ins["short"]["bucket"] == ({"strict": 128, "off": None}[policy])
        # the seam's own check of the address rule accepts them, and the reference runs them
        for c in ("short", "long", "constant"):
            x = ins[c]
            out = torch.full_like(x["query"], float("nan"))
            paged_attention(x["query"], x["key_cache"], x["value_cache"], x["block_table"], x["query_start_loc"],
                            x["seq_lens"], out, scale=0.25, causal=True, policy=policy, bucket=x["bucket"],
                            num_tokens=x["num_tokens"], path="reference", allow_fallback=True, check_values=True)
            assert bool(torch.isfinite(out).all())
    # the default cache: at least 25,000 blocks, more than the step's pages
    assert classes.Shape().blocks == 25000 and classes.Shape(bucket=32768).blocks == 17 * 2048
    assert classes.Shape(layout="churned").key.endswith("-strict-churned")
    with pytest.raises(ValueError):
        classes.make_inputs(classes.Shape(policy="batch"), "short", device="cpu")


# ---------------------------------------------------------------- the GPU loop against a fake clock

def test_timing_loop_pairs_rounds_correctly():
    """`Timer._time` with events on a fake clock: each launch lands in its class and round."""
    from types import SimpleNamespace

    clock = {"ms": 0.0, "calls": []}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["ms"]

        def elapsed_time(self, end):
            return end.t - self.t

        def synchronize(self):
            pass

    def launch(cls, ms):
        def f():
            second = bool(clock["calls"]) and len(clock["calls"]) % 2 == 1  # second launch of a round
            clock["calls"].append(cls)
            clock["ms"] += ms + (0.05 if second else 0.0)  # an order effect the random order must cancel
        return f

    fake = SimpleNamespace(cuda=SimpleNamespace(Event=Event, synchronize=lambda: None, _sleep=lambda c: None))
    t = object.__new__(timing.Timer)
    t.torch, t.chunk, t.warmup, t.cycles_per_ms = fake, 128, 0, 1e6
    lines = []
    t.progress = lines.append
    ps = timing.PairStats()
    fns = [launch("a", 0.1), launch("b", 0.2)]
    t._host_ms_per_round = lambda fns_, ev: 0.01  # no calibration launches: keeps rounds aligned
    t._time(fns, 1000, np.random.default_rng(0), ps, "a vs b")
    a, b = ps.samples()
    assert a.size == b.size == 1000 and ps.chunks == 8  # 7 full chunks of 128 and one of 104
    assert set(np.round(a, 6)) == {100.0, 150.0} and set(np.round(b, 6)) == {200.0, 250.0}
    assert np.all((np.round(a) == 150) == (np.round(b) == 200))  # the second launch of a round is the slow one
    first_a = np.array(clock["calls"][0::2]) == "a"
    assert 400 < first_a.sum() < 600 and np.all((np.round(a) == 100) == first_a)
    assert len(lines) == 8 and "100%" in lines[-1]  # every chunk crosses a 10 % step here
    # --idle-after-us: one GPU spin queued after every timed launch, outside its events
    sleeps = []
    t.torch = SimpleNamespace(cuda=SimpleNamespace(Event=Event, synchronize=lambda: None, _sleep=sleeps.append))
    t.idle_after_ms = 0.05
    t._time(fns, 256, np.random.default_rng(1), timing.PairStats(), "a vs b")
    assert sleeps.count(int(0.05 * 1e6)) == 2 * 256
    # every launch's preparation reads the slot its chunk staged for it, with its own class's values
    staged, preps = [], []
    for c, f in zip("ab", fns):
        f.prep = lambda slot, c=c: preps.append((c, slot))
        f.stage = lambda order: staged.append(list(order))
    clock["calls"].clear()
    t.idle_after_ms = 0.0
    t._time(fns, 300, np.random.default_rng(2), timing.PairStats(), "a vs b")
    chunks = staged[1:]  # the first stage is the warm-up's (0, 1), then one per chunk
    assert [len(o) for o in chunks] == [256, 256, 88]
    timed = preps[-600:]
    assert [c for c, _ in timed] == clock["calls"][-600:]
    k = 0
    for order in chunks:
        for slot, want in enumerate(order):
            c, got = timed[k]
            assert got == slot and "ab"[want] == c
            k += 1


def test_a_borderline_gating_pair_runs_its_rounds_again(monkeypatch):
    """`Timer._extend`: a gating pair that ends with |t| (or paired |z|) in [EXTEND_AT, 4.5) is timed for as many
    rounds again and decided on all of them (the head-64 window row passed twice at t -3.78 / -2.44 with 10^5
    rounds and failed at 2 x 10^5); a clear pass, a reported pair, the option off or a time budget that ends
    first are not extended."""
    from types import SimpleNamespace

    def stream(n, shift, seed, t_target=None):
        g = np.random.default_rng(seed)
        a, b = g.normal(100.0, 1.0, n), g.normal(100.0, 1.0, n)
        if t_target is not None:  # shift b so that Welch's t is exactly t_target
            se = math.sqrt(a.var(ddof=1) / n + b.var(ddof=1) / n)
            b += t_target * se - (b.mean() - a.mean())
        return a, b + shift

    def timer(batches, extend=True, deadline=None):
        t = object.__new__(timing.Timer)
        t.progress, t.extend_borderline, t.deadline = [].append, extend, deadline
        t.calls = []

        def fake_time(fns, rounds, rng, ps, label):
            t.calls.append(label)
            a, b = batches[len(t.calls) - 1]
            ps.add(a, b)
            ps.checkpoint()
        t._time = fake_time
        return t

    spec = SimpleNamespace(role="gating", label="short vs long", rounds=2000)
    first = stream(2000, 0.0, 1, t_target=-3.6)  # borderline: the gate would pass it
    ps = timing.PairStats()
    ps.add(*first)
    assert timing.stats.verdict(ps.welch.n, ps.welch.t, ps.checkpoint()) == "too few samples"  # below 10^5
    assert timing.borderline(ps.welch.t, ps.trace["z"][-1])
    # the same difference again: decided on 4000 rounds per class, where it fails
    t = timer([first, stream(2000, 0.0, 2, t_target=-3.6)])
    ps = timing.PairStats()
    t._time(None, spec.rounds, None, ps, "short vs long [graph]")
    assert t._extend(spec, "graph", None, None, ps) is True
    row = ps.result({"role": "gating"})
    assert t.calls == ["short vs long [graph]", "short vs long [graph] extended"]
    assert row["extended"] is True and row["n"] == [4000, 4000] and abs(row["t"]) > 4.5 and row["verdict"] == "FAIL"
    # a clear pass, a reported pair, the option off, a budget that ends first: one batch, not extended
    for batch, sp, kw in ((stream(2000, 0.0, 3, t_target=0.5), spec, {}),
                          (first, SimpleNamespace(role="reported", label="random vs zeros", rounds=2000), {}),
                          (first, spec, {"extend": False}),
                          (first, spec, {"deadline": 0.0})):
        monkeypatch.setattr(timing, "pair_estimate_s", lambda s, modes: 10.0)
        t = timer([batch], **kw)
        ps = timing.PairStats()
        t._time(None, sp.rounds, None, ps, "x")
        assert t._extend(sp, "graph", None, None, ps) is False and len(t.calls) == 1
        assert ps.result({"role": sp.role})["extended"] is False
    assert not timing.borderline(float("nan"), 1.0) and not timing.borderline(4.5, 0.0)
    assert timing.borderline(3.0, 0.0) and timing.borderline(0.2, -4.49)


def test_slot_staging_copies_each_class_values_from_the_launch_slot():
    """`timing.SlotStaging`: a launch's lengths come from its slot of one staging tensor (its address follows
    the launch's position, not its class); slot None copies the class's own tensors (the one-off checks)."""
    import torch

    dst_len, dst_bucket = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    own = [(torch.full((3,), 5, dtype=torch.int32), torch.full((3,), 8, dtype=torch.int32)),
           (torch.full((3,), 7, dtype=torch.int32), torch.full((3,), 8, dtype=torch.int32))]
    st = timing.SlotStaging([[(dst_len, ln), (dst_bucket, b)] for ln, b in own], 6)
    order = [1, 0, 0, 1, 1]
    st.stage(order)
    for slot, c in enumerate(order):
        st.copy(c, slot)
        assert dst_len.tolist() == own[c][0].tolist() and dst_bucket.tolist() == [8] * 3
    own[0][0].fill_(99)  # staged values, not the class's tensor, feed a slotted copy
    st.copy(0, 1)
    assert dst_len.tolist() == [5] * 3
    st.copy(0, None)
    assert dst_len.tolist() == [99] * 3
    with pytest.raises(ValueError, match="7 launches staged, 6 slots"):
        st.stage([0] * 7)
    with pytest.raises(ValueError, match="one dtype"):
        timing.SlotStaging([[(dst_len, own[0][0].long())], [(dst_len, own[1][0])]], 2)
    # a pair with its own data: the L2 flush and the page copies stay out of the staging
    flush, pages = ("flush", torch.zeros(8)), (torch.zeros(4), torch.arange(2), torch.ones(2))
    q = ("data", torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))  # Q rows: bf16
    mixed = timing.SlotStaging.of([[(dst_len, own[0][0]), pages, q, flush], [(dst_len, own[1][0]), pages, q, flush]],
                                  4)
    assert [len(c) for c in mixed.copies] == [1, 1] and tuple(mixed.packed.shape) == (2, 3)
    empty = timing.SlotStaging([[], []], 4)  # nothing small to copy: staging is a no-op
    empty.stage([0, 1])
    empty.copy(1, 0)


def fake_timer(measure):
    """A `timing.Timer` stand-in whose `measure_pair` is ``measure(spec, modes, seed, shared)``."""

    class FakeTimer:
        device_name, cycles_per_ms = "NVIDIA H100 80GB HBM3", 1.9e6

        def __init__(self, chunk, warmup, progress, idle_after_us=0.0):
            FakeTimer.idle_after_us = idle_after_us

        def pad_note(self):
            return "fake"

        def release(self):
            pass

        def measure_pair(self, spec, modes, seed=0, shared=None):
            return measure(spec, modes, seed, shared)

    return FakeTimer


def test_run_glue_with_a_fake_timer(tmp_path, monkeypatch, capsys):
    """`run` end to end (arguments, plan, merged reports, exit codes) with the GPU measurement faked."""
    import torch

    seen, floor = [], {"offset": 0.0}

    def measure(spec, modes, seed, shared):
        seen.append((spec, shared is not None))
        rng = np.random.default_rng(seed)
        a = rng.normal(100, 1, spec.rounds)
        b = rng.normal(100, 1, spec.rounds) + (20 if spec.role == "control" else 0)
        b += floor["offset"] if spec.role == "null" else 0.0
        return [timing.analyse_streams(a, b, pair=(spec.a, spec.b), role=spec.role, mode=m, shape=spec.shape)
                for m in modes]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "Timer", fake_timer(measure))
    monkeypatch.setattr(timing, "churn_info", lambda n, seed: {"num_blocks": n, "seed": seed, "fingerprint": "x",
                                                                 "vllm": "fake"})
    monkeypatch.setattr(timing.stats.verdict, "__kwdefaults__", {"threshold": 4.5, "min_samples": 100_000})
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    small = ["--samples", "2000", "--reported-samples", "500", "--control-samples", "500", "--report-dir",
             str(tmp_path)]
    assert timing.run(ap.parse_args(small + ["--steps", "decode", "--lengths", "4096", "--modes", "eager"])) == 1
    out = capsys.readouterr().out
    assert "G4 timing gate, this run: FAIL" in out and "too few samples" in out and "/15 measurements" in out
    doc = json.load(open(tmp_path / "g4-latest.json"))
    # 1 control + 2 null pairs (first layout, per policy) + 3 layouts x 2 short vs long + the data pairs on
    # the first layout: 2 random vs random2 + 2 x 2 reported
    assert len(doc["rows"]) == 15 and doc["summary"]["control_detected"] is True
    data = [r for r in doc["rows"] if r["a"] == "random"]
    assert len(data) == 6 and {r["layout"] for r in data} == {timing.LAYOUTS[0]}
    nulls = [r for r in doc["rows"] if r["role"] == "null"]
    assert {(r["policy"], r["layout"], r["a"], r["b"]) for r in nulls} == {
        (p, timing.LAYOUTS[0], "long", "long2") for p in ("strict", "request")}
    assert all(r["n_per_class"] == 2000 and r["passed"] is None for r in nulls)
    assert {r["layout"] for r in doc["rows"]} == set(timing.LAYOUTS) and {r["mode"] for r in doc["rows"]} == {"eager"}
    assert doc["churn"]["25000"]["fingerprint"] == "x" and all(sh for _, sh in seen)
    # --quick: a smoke run exits 0 when everything ran and the control was detected
    assert timing.run(ap.parse_args(["--quick", "--report-dir", "", "--steps", "prefill", "--lengths", "4096",
                                     "--layouts", "random"])) == 0
    capsys.readouterr()
    # the same piece passes once 2000 samples are enough, and the next piece merges into the report
    monkeypatch.setattr(timing.stats.verdict, "__kwdefaults__", {"threshold": 4.5, "min_samples": 1000})
    assert timing.run(ap.parse_args(small + ["--steps", "decode", "--lengths", "4096", "--modes", "graph",
                                             "--layouts", "churned"])) == 0
    doc = json.load(open(tmp_path / "g4-latest.json"))
    assert len(doc["rows"]) == 15 + 11 and {r["mode"] for r in doc["rows"]} == {"eager", "graph"}
    # the eager null rows of the first run had too few samples: the floor is not established, not unclean
    assert {r["verdict"] for r in doc["rows"] if r["role"] == "null" and r["mode"] == "graph"} == {"no difference seen"}
    assert doc["summary"]["floor_clean"] is None and "floor not established" in (tmp_path / "g4-latest.md").read_text()
    missing_before = len(doc["summary"]["missing"])
    assert timing.run(ap.parse_args(small + ["--steps", "decode", "--lengths", "4096", "--modes", "graph",
                                             "--layouts", "random", "--no-control"])) == 0
    doc = json.load(open(tmp_path / "g4-latest.json"))
    # its short vs long cells (random layout); its data pairs' cells were filled on the churned layout
    assert len(doc["summary"]["missing"]) == missing_before - 2 and not doc["summary"]["passed"]
    # --idle-after-us: a diagnostic of the card's power management; the timer idles the GPU, the rows go to a
    # report of their own (the gate's report is untouched, even when asked to merge) and give no verdict
    before = (tmp_path / "g4-latest.json").read_bytes()
    assert timing.run(ap.parse_args(small + ["--steps", "decode", "--lengths", "4096", "--modes", "graph",
                                             "--layouts", "churned", "--idle-after-us", "200", "--merge",
                                             str(tmp_path / "g4-latest.json")])) == 0
    assert timing.Timer.idle_after_us == 200.0 and (tmp_path / "g4-latest.json").read_bytes() == before
    diag = json.load(open(tmp_path / f"{timing.DIAGNOSTIC}.json"))
    assert len(diag["rows"]) == 11 and diag["settings"]["idle_after_us"] == 200.0 and not diag["summary"]["passed"]
    assert "diagnostic" in (tmp_path / f"{timing.DIAGNOSTIC}.md").read_text().splitlines()[2]
    with pytest.raises(ValueError, match="--idle-after-us"):
        timing.settings_from_args(ap.parse_args(["--idle-after-us", "-5"]))
    # a null pair that differs (identical inputs timed apart: the harness's own floor) fails the run and the gate
    floor["offset"] = 1.0
    assert timing.run(ap.parse_args(small + ["--steps", "prefill", "--lengths", "4096", "--modes", "graph",
                                             "--layouts", "random", "--policies", "strict", "--pairs", "short:long",
                                             "--no-control", "--report-dir", str(tmp_path / "floor")])) == 1
    doc = json.load(open(tmp_path / "floor" / "g4-latest.json"))
    (null,) = [r for r in doc["rows"] if r["role"] == "null"]
    assert null["verdict"] == "FLOOR DIFFERS" and doc["summary"]["floor_clean"] is False
    floor["offset"] = 0.0
    assert timing.run(ap.parse_args(small + ["--steps", "prefill", "--lengths", "4096", "--modes", "graph",
                                             "--layouts", "random", "--policies", "strict", "--pairs", "short:long",
                                             "--no-control", "--report-dir", str(tmp_path / "clean")])) == 0
    clean = json.load(open(tmp_path / "clean" / "g4-latest.json"))
    assert clean["summary"]["floor_clean"] is True
    assert "null-pair floor clean" in (tmp_path / "clean" / "g4-latest.md").read_text()
    assert any("floor is not clean" in m for m in doc["summary"]["messages"]) and not doc["summary"]["passed"]
    assert "null-pair floor **not clean**" in (tmp_path / "floor" / "g4-latest.md").read_text()


def test_resume_measures_only_the_cells_the_report_lacks(tmp_path, monkeypatch, capsys):
    """--resume: a cell the merged report holds for this code and device, with at least this run's samples,
    is not measured again; other code, another device or fewer samples measure it anew."""
    import torch

    seen = []

    def measure(spec, modes, seed, shared):
        seen.append((spec.shape.layout, spec.role, tuple(modes)))
        rng = np.random.default_rng(seed)
        return [timing.analyse_streams(rng.normal(100, 1, spec.rounds), rng.normal(100, 1, spec.rounds),
                                       pair=(spec.a, spec.b), role=spec.role, mode=m, shape=spec.shape)
                for m in modes]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "Timer", fake_timer(measure))
    monkeypatch.setattr(timing, "churn_info", lambda n, seed: {"num_blocks": n, "seed": seed, "fingerprint": "x",
                                                                 "vllm": "fake"})
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    base = ["--samples", "1000", "--report-dir", str(tmp_path), "--steps", "decode", "--lengths", "4096",
            "--policies", "strict", "--pairs", "short:long", "--no-control", "--no-null", "--modes", "graph"]
    timing.run(ap.parse_args(base + ["--layouts", "churned"]))
    assert seen == [("churned", "gating", ("graph",))]
    seen.clear()
    # the same piece and one more layout, resumed: only the new layout and the new mode run
    timing.run(ap.parse_args(base[:-1] + ["graph,eager", "--layouts", "churned,random", "--resume"]))
    assert seen == [("churned", "gating", ("eager",)), ("random", "gating", ("graph", "eager"))]
    assert "in the report already" not in capsys.readouterr().out
    doc = json.load(open(tmp_path / "g4-latest.json"))
    assert len(doc["rows"]) == 4
    seen.clear()
    timing.run(ap.parse_args(base + ["--layouts", "churned,random", "--resume"]))
    assert seen == [] and "in the report already" in capsys.readouterr().out
    # more samples than the report's rows: measured again; without --resume: measured again
    timing.run(ap.parse_args(["--samples", "2000"] + base[2:] + ["--layouts", "random", "--resume"]))
    timing.run(ap.parse_args(base + ["--layouts", "random"]))
    assert seen == [("random", "gating", ("graph",))] * 2
    # another code's report: nothing is skipped
    doc = json.load(open(tmp_path / "g4-latest.json"))
    doc["source"] = "0" * 16
    (tmp_path / "g4-latest.json").write_text(json.dumps(doc))
    seen.clear()
    timing.run(ap.parse_args(base + ["--layouts", "churned", "--resume"]))
    assert seen == [("churned", "gating", ("graph",))] and "every measurement runs" in capsys.readouterr().out


def test_time_budget_and_checkpoints(tmp_path, monkeypatch, capsys):
    """A run cut short keeps the rows of every pair it finished (the report is written after each, and
    whole: no '.partial' file is left); a time budget skips what would not fit."""
    import torch

    calls = []

    def measure(spec, modes, seed, shared):
        calls.append(spec)
        if sum(c.shape.bucket == 32768 for c in calls) == 2:
            raise KeyboardInterrupt  # the device's time limit, say, in the second pair of the L 32768 group
        a = np.random.default_rng(len(calls)).normal(100, 1, spec.rounds)
        return [timing.analyse_streams(a, a + (20 if spec.role == "control" else 0), pair=(spec.a, spec.b),
                                       role=spec.role, mode=m, shape=spec.shape) for m in modes]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "Timer", fake_timer(measure))
    monkeypatch.setattr(timing, "churn_info", lambda n, seed: {"fingerprint": "x", "vllm": "fake"})
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    args = ["--samples", "300", "--reported-samples", "100", "--control-samples", "100", "--report-dir",
            str(tmp_path), "--steps", "decode", "--layouts", "churned", "--policies", "strict"]
    with pytest.raises(KeyboardInterrupt):
        timing.run(ap.parse_args(args))
    doc = json.load(open(tmp_path / "g4-latest.json"))
    first = calls[[c.shape.bucket for c in calls].index(32768)]
    # L 4096: control, null, 2 gating + 2 reported pairs, eager and graph; L 32768: the pair before the cut
    assert sorted(r["bucket"] for r in doc["rows"]) == [4096] * 12 + [32768] * 2
    assert {(r["pair"], r["bucket"]) for r in doc["rows"]} >= {(f"{first.a} vs {first.b}", 32768)}
    assert not list(tmp_path.glob("*.partial"))
    # a budget that nothing fits: nothing starts, the run says so and fails (no gating row measured)
    calls.clear()
    assert timing.run(ap.parse_args(args + ["--time-budget", "0.001", "--report-dir", ""])) == 1
    assert not calls and "time budget" in capsys.readouterr().out
    assert _settings("--preset", "subset").time_budget == 540 and _settings().time_budget == 0
    assert _settings("--preset", "subset", "--time-budget", "0").time_budget == 0


def test_thin_trace_keeps_the_ends_and_at_most_the_limit():
    trace = {"n": list(range(128, 128 * 782 + 1, 128)), "t": [float(i) for i in range(782)], "z_n": [1, 2], "z": [0.5, 0.7]}
    thin = timing.thin_trace(trace, points=100)
    assert len(thin["n"]) == len(thin["t"]) == 100
    assert (thin["n"][0], thin["n"][-1], thin["t"][-1]) == (128, 128 * 782, 781.0)
    assert thin["n"] == sorted(thin["n"]) and thin["z"] == trace["z"]
    short = {"n": [1, 2], "t": [0.1, 0.2], "z_n": [], "z": []}
    assert timing.thin_trace(short) == short


# ---------------------------------------------------------------- attention features (issue 31)

def test_features_option_parses_strictly():
    from dhp_backend.audit import features

    f = features.parse(" sinks , window=4096,softcap=50")
    assert (f.sliding_window, f.logits_soft_cap, f.sinks) == (4096, 50.0, True)
    assert f.label == "window=4096,softcap=50,sinks" and f.key == "-win4096-softcap50-sinks"
    assert features.parse(f.label) == f  # the label reads back
    assert features.parse("softcap=30.5").label == "softcap=30.5"
    assert features.parse("softcap=0.00001").key == "-softcap0.00001"  # no exponent, no '-' in a shape key
    for plain in ("", "none", " NONE ", None):
        assert features.parse(plain) == features.Features() and not features.parse(plain)
        assert features.parse(plain).label == features.parse(plain).key == ""
    bad = {"window": "int >= 1", "window=0": "int >= 1", "window=-1": "int >= 1", "window=4.5": "int >= 1",
           "softcap=0": "finite number > 0", "softcap=-2": "finite number > 0", "softcap=inf": "finite number > 0",
           "softcap=nan": "finite number > 0", "softcap=x": "finite number > 0", "sinks=1": "takes no value",
           "window=4,window=8": "given twice", "window=4,,sinks": "empty item", "sinks,": "empty item",
           "cap=50": "unknown item", "swa=4096": "unknown item"}
    for text, why in bad.items():
        with pytest.raises(ValueError, match=why) as e:
            features.parse(text)
        assert str(e.value).startswith("--features: ") and "accepted: " in str(e.value), text
    with pytest.raises(ValueError, match="sliding_window"):
        features.Features(sliding_window=-3)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        features.Features(logits_soft_cap=float("inf"))


def test_features_option_names_a_layer_geometry():
    """heads=QxKVxD audits a layer of another geometry (Gemma-2's 16x8x256: the head-256 libraries); the
    default 32x8x128 has one spelling, none, so plain rows keep their labels and grid cells."""
    from dhp_backend.audit import classes, features

    f = features.parse("window=1024, heads=16x8x256,softcap=50")
    assert f.geometry == (16, 8, 256) and f.label == "heads=16x8x256,window=1024,softcap=50"
    assert features.parse(f.label) == f and f.key == "-win1024-softcap50"  # the shape key names h and d itself
    assert features.parse("heads=32x8x128") == features.Features() and not features.parse("HEADS=32X8X128")
    sh = classes.Shape(**f.shape_fields())
    assert (sh.num_heads, sh.num_kv_heads, sh.head_size) == (16, 8, 256) and features.of(sh) == f
    assert sh.key == "B16-L4096-q1-h16x8-d256-bs16-bfloat16-strict-random-win1024-softcap50"
    assert sh.features == f.label
    geo = features.parse("heads=16x8x256")
    assert geo and geo.label == "heads=16x8x256"
    st = dataclasses.replace(_settings(), features=geo)
    assert timing.step_shape(st, "prefill", 4096, "request", "churned").features == "heads=16x8x256"
    # a row of another geometry fills no cell of the full grid (that grid is the default layer's)
    row = {"step": "decode", "bucket": 4096, "policy": "strict", "layout": "churned", "mode": "graph",
           "a": "short", "b": "long", "role": "gating", "features": "heads=16x8x256", "passed": True}
    assert timing.row_key(row) != timing.row_key({**row, "features": ""})
    for text in ("heads=16x3x256", "heads=16x8", "heads=0x8x128", "heads=16x8x256x1", "heads=ax8x128",
                 "heads=16x8x128,heads=16x8x256"):
        with pytest.raises(ValueError, match="heads|given twice") as e:
            features.parse(text)
        assert "accepted: " in str(e.value), text
    with pytest.raises(ValueError, match="geometry"):
        features.Features(geometry=(16, 8))


def test_features_option_forces_the_triton_kernels():
    """path=triton audits the Triton CONST_TIME kernels (what a GPU without the csrc kernels runs) on a machine
    whose dispatcher would pick the csrc ones: its rows, shape keys and the kernel named in the report say so,
    and they fill no cell of the default path's grid."""
    from types import SimpleNamespace

    from dhp_backend.audit import classes, features

    f = features.parse("path=triton, window=1024")
    assert f.path == "triton" and f and f.label == "window=1024,path=triton" and f.key == "-win1024-triton"
    assert features.parse(f.label) == f
    assert features.parse("path=auto") == features.Features() and features.parse("PATH=Triton").path == "triton"
    t = features.parse("path=triton")
    assert t and t.label == "path=triton" and t.key == "-triton"
    sh = classes.Shape(batch=4, q_len=64, **t.shape_fields())
    assert sh.path == "triton" and sh.key == classes.Shape(batch=4, q_len=64).key + "-triton"
    assert sh.features == "path=triton" and features.of(sh) == t
    from dhp_backend.audit import counters

    assert counters.parse_shape(counters.shape_spec(sh)) == sh  # G1's child reads the path back from its spec
    for text in ("path=reference", "path=", "path=csrc", "path=triton,path=auto"):
        with pytest.raises(ValueError, match="path|given twice") as e:
            features.parse(text)
        assert "accepted: " in str(e.value), text
    with pytest.raises(ValueError, match="path"):
        features.Features(path="reference")
    # the kernel the report names: the Triton kernel on an H100 / H200 too, where auto would take a csrc one
    tm = object.__new__(timing.Timer)
    tm.torch = SimpleNamespace(cuda=SimpleNamespace(get_device_capability=lambda device: (9, 0)))
    tm.device = "cuda:0"
    for q, batch in ((1, 16), (64, 4)):
        path = tm.path_of(classes.Shape(batch=batch, q_len=q, path="triton"))
        assert path.startswith("triton") and path.endswith("kernel triton"), path
        choice, kernel = classes.route(classes.Shape(batch=batch, q_len=q, path="triton"), device_capability=(9, 0))
        assert (choice.name, kernel) == ("triton", "triton")
    st = dataclasses.replace(_settings(), features=t)
    assert timing.step_shape(st, "decode", 4096, "strict", "churned").path == "triton"
    row = {"step": "decode", "bucket": 4096, "policy": "strict", "layout": "churned", "mode": "graph",
           "a": "short", "b": "long", "role": "gating", "features": "path=triton", "passed": True}
    assert timing.row_key(row) != timing.row_key({**row, "features": ""})


@pytest.mark.parametrize("policy", ["strict", "off"])
def test_triton_path_launch_runs_the_triton_kernels(policy, monkeypatch):
    """`classes.launch` on a path=triton shape asks the seam for the Triton path (and an auto shape for auto)."""
    from dhp_backend.audit import classes

    seen = []
    import dhp_backend.ops as ops

    monkeypatch.setattr(ops, "paged_attention", lambda *a, **k: seen.append(k["path"]) or a[6])
    for path in ("triton", "auto"):
        sh = classes.Shape(batch=2, bucket=64, num_heads=4, num_kv_heads=2, head_size=16, dtype="float32",
                           policy=policy, num_blocks=16, path=path)
        x = classes.make_inputs(sh, "short", seed=0, device="cpu")
        classes.launch(x, torch.empty_like(x["query"]))
        classes.launch(x, torch.empty_like(x["query"]), path="reference")  # an explicit path wins
    assert seen == ["triton", "reference", "auto", "reference"]


def test_shape_keys_unchanged_for_plain_shapes():
    from dhp_backend.audit import classes

    # the keys of reports measured before features existed (rows merge by them)
    assert classes.Shape().key == "B16-L4096-q1-h32x8-d128-bs16-bfloat16-strict-random"
    assert (classes.Shape(batch=4, q_len=64, policy="request", layout="churned", num_blocks=40000).key
            == "B4-L4096-q64-h32x8-d128-bs16-bfloat16-request-churned-nb40000")
    assert classes.Shape().features == ""
    sh = classes.Shape(sliding_window=1024, logits_soft_cap=50.0, sinks=True)
    assert sh.key == classes.Shape().key + "-win1024-softcap50-sinks"
    assert sh.features == "window=1024,softcap=50,sinks"
    assert classes.Shape(sinks=True).key.endswith("-random-sinks")
    with pytest.raises(ValueError, match="causal"):
        classes.Shape(sliding_window=64, causal=False)
    with pytest.raises(ValueError, match="sliding_window"):
        classes.Shape(sliding_window=-1)
    # the settings of a run without --features build the shapes they always built
    assert timing.step_shape(_settings(), "decode", 4096, "strict", "random") == classes.Shape()


@pytest.mark.parametrize("policy", ["strict", "request", "off"])
def test_featured_launch_matches_the_reference_and_obeys_the_address_rule(policy):
    """A windowed, soft-capped layer with sinks: every class passes the seam's value check (pages up to the
    bucket, distinct), and `classes.launch` gives the reference's output with the same features."""
    from dhp_backend.audit import classes
    from dhp_backend.ops import paged_attention
    from dhp_backend.ops.reference import paged_attention_reference

    sh = classes.Shape(batch=3, bucket=128, q_len=1, num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                       dtype="float32", policy=policy, layout="churned", num_blocks=40, sliding_window=24,
                       logits_soft_cap=5.0, sinks=True)
    plain = dataclasses.replace(sh, sliding_window=0, logits_soft_cap=0.0, sinks=False)
    shared = {}
    ins = {c: classes.make_inputs(sh, c, seed=1, device="cpu", shared=shared) for c in ("short", "long", "random",
                                                                                       "random2")}
    sinks = ins["short"]["sinks"]
    assert sinks.dtype == torch.float32 and tuple(sinks.shape) == (4,) and bool(torch.isfinite(sinks).all())
    assert all(x["sinks"] is sinks for x in ins.values()), "one public sinks tensor for every class"
    assert classes.make_inputs(plain, "short", seed=1, device="cpu")["sinks"] is None
    for c, x in ins.items():
        # the seam's own check (the address rule under strict/request) accepts the class's table and lengths
        checked = torch.full_like(x["query"], float("nan"))
        paged_attention(x["query"], x["key_cache"], x["value_cache"], x["block_table"], x["query_start_loc"],
                        x["seq_lens"], checked, scale=sh.head_size ** -0.5, causal=True, policy=policy,
                        bucket=x["bucket"], num_tokens=x["num_tokens"], path="reference", allow_fallback=True,
                        check_values=True, logits_soft_cap=5.0, sinks=sinks, sliding_window=24)
        out = classes.launch(x, torch.full_like(x["query"], float("nan")))
        assert bool(torch.isfinite(out).all()), c
        ref = paged_attention_reference(x["query"], x["key_cache"], x["value_cache"], x["block_table"],
                                        x["query_start_loc"], x["seq_lens"], torch.empty_like(x["query"]),
                                        scale=sh.head_size ** -0.5, causal=True, num_tokens=x["num_tokens"],
                                        logits_soft_cap=5.0, sinks=sinks, sliding_window=24)
        assert torch.equal(out, ref) and torch.equal(checked, ref), c
        if classes.true_length(sh, c) > 24:  # the features change the result: the launch passed them
            unfeatured = dict(x, shape=plain, sinks=None)
            assert not torch.equal(classes.launch(unfeatured, torch.empty_like(x["query"])), out), c


def test_featured_shapes_name_their_kernel(with_nvcc):
    """The report's "Kernel path per policy and step": a plain, windowed, capped or sinks layer of head 128 runs
    on a csrc kernel (the plain or a feature library) where it may."""
    from types import SimpleNamespace

    from dhp_backend.audit import classes

    t = object.__new__(timing.Timer)
    t.torch = SimpleNamespace(cuda=SimpleNamespace(get_device_capability=lambda device: (9, 0)))
    t.device = "cuda:0"
    for q in (1, 64):
        batch = 16 if q == 1 else 4
        plain = t.path_of(classes.Shape(batch=batch, q_len=q))
        assert plain.startswith("csrc kernel cuda_") and "the layer's path: triton" in plain, plain
        for f in ({"sliding_window": 1024}, {"logits_soft_cap": 50.0}, {"sinks": True}):
            path = t.path_of(classes.Shape(batch=batch, q_len=q, **f))
            assert path.startswith("csrc kernel cuda_") and "the layer's path: triton" in path, (f, path)


def test_features_in_the_plan_rows_and_reports(tmp_path, monkeypatch, capsys):
    """``--features``: the estimate names them, every shape carries them, rows and tables show them, and
    featured rows merge beside the plain ones without filling the plain grid's cells."""
    import torch

    st = _settings("--features", "window=1024,sinks", "--preset", "subset")
    assert st.features.label == "window=1024,sinks" and timing.settings_dict(st)["features"] == "window=1024,sinks"
    for g in timing.plan(st):
        for spec in g.specs:
            assert (spec.shape.sliding_window, spec.shape.sinks, spec.shape.logits_soft_cap) == (1024, True, 0.0)
    lines = []
    timing.describe_plan(st, lines.append)
    assert "features window=1024,sinks" in lines[0]
    lines.clear()
    timing.describe_plan(_settings(), lines.append)
    assert "features none (plain attention)" in lines[0]
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    assert timing.run(ap.parse_args(["--estimate", "--features", "window=0"])) == 2
    assert "audit timing: --features: 'window=0'" in capsys.readouterr().err

    def measure(spec, modes, seed, shared):
        rng = np.random.default_rng(seed)
        a = rng.normal(100, 1, spec.rounds)
        b = rng.normal(100, 1, spec.rounds) + (20 if spec.role == "control" else 0)
        rows = [timing.analyse_streams(a, b, pair=(spec.a, spec.b), role=spec.role, mode=m, shape=spec.shape)
                for m in modes]
        for r in rows:
            r["path"] = "triton (constant-time capable): fake; kernel " + ("triton" if spec.shape.features
                                                                           else "cuda_decode_ct")
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "Timer", fake_timer(measure))
    monkeypatch.setattr(timing, "churn_info", lambda n, seed: {"fingerprint": "x", "vllm": "fake"})
    monkeypatch.setattr(timing.stats.verdict, "__kwdefaults__", {"threshold": 4.5, "min_samples": 1000})
    piece = ["--samples", "2000", "--reported-samples", "500", "--control-samples", "500", "--report-dir",
             str(tmp_path), "--steps", "decode", "--lengths", "4096", "--layouts", "churned", "--modes", "graph"]
    assert timing.run(ap.parse_args(piece)) == 0
    plain_doc = json.load(open(tmp_path / "g4-latest.json"))
    assert {r["features"] for r in plain_doc["rows"]} == {""}
    assert timing.run(ap.parse_args(piece + ["--features", "window=1024,softcap=50"])) == 0
    assert "window=1024,softcap=50" in capsys.readouterr().out  # the console table
    doc = json.load(open(tmp_path / "g4-latest.json"))
    rows = doc["rows"]
    assert len(rows) == 2 * len(plain_doc["rows"]), "featured rows merge beside the plain ones, replacing none"
    featured = [r for r in rows if r["features"]]
    assert {r["features"] for r in featured} == {"window=1024,softcap=50"}
    assert all(r["shape"].endswith("-win1024-softcap50") for r in featured)
    assert doc["summary"]["missing"] == plain_doc["summary"]["missing"]  # no plain cell filled by them
    assert doc["settings"]["features"] == "window=1024,softcap=50"
    md = open(tmp_path / "g4-latest.md").read()
    assert "| features |" in md and "| window=1024,softcap=50 |" in md
    assert "`strict` decode (window=1024,softcap=50): triton (constant-time capable): fake; kernel triton" in md
    assert "`strict` decode: triton (constant-time capable): fake; kernel cuda_decode_ct" in md
    # a failing featured row fails the report's gate and names its features
    bad = dict(featured[0], passed=False, verdict="FAIL", role="gating")
    s = timing.summarize([bad], 1.0)
    assert not s["gating_passed"] and "L4096 window=1024,softcap=50 " in s["failures"][0]


@pytest.mark.parametrize("pair", [("short", "long"), ("long", "long2"), ("random", "random2"), ("random", "zeros")])
def test_shared_buffers_prepare_every_pair_kind_on_the_cpu(monkeypatch, pair):
    """`Timer._prepare_shared` (eager) on tiny CPU inputs: every pair kind's copies (lengths, bucket, Q rows,
    pages, the L2 flush) prepare, and each class's prepared launch gives its own inputs' bits. A data pair
    once failed here on the GPU only (its Q copy went into the integer staging)."""
    from dhp_backend.audit import classes

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timer = object.__new__(timing.Timer)
    timer.torch, timer.chunk, timer.device = torch, 4, torch.device("cpu")
    timer._flush = torch.ones(64)
    for policy in ("strict", "request"):
        shape = classes.Shape(batch=2, bucket=64, q_len=1, num_heads=4, num_kv_heads=2, head_size=64,
                              dtype="float32", policy=policy, layout="random", num_blocks=3 * 64 // 16 + 1)
        shared = {}
        inputs = [classes.make_inputs(shape, c, device="cpu", shared=shared) for c in pair]
        spec = timing.PairSpec(shape, *pair, "gating", 10)
        fns, (out,), graphs = timer._prepare_shared(spec, "eager", inputs)
        assert not graphs and len(fns) == 2
        for x, fn, slot in ((inputs[1], fns[1], 1), (inputs[0], fns[0], 0)):
            fn.stage((0, 1))
            fn.prep(slot)
            fn()
            own = classes.empty_out(x)
            classes.launch(x, own)
            assert torch.equal(out, own), (pair, policy)


# --- scripts/g4_merge.py: the reports of a multi-GPU call (scripts/g4_pieces.sh), one per GPU ---

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _g4_merge():
    import importlib.util

    spec = importlib.util.spec_from_file_location("g4_merge", os.path.join(_ROOT, "scripts", "g4_merge.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report_with(doc: dict, rows: list, folder: str, **changes) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, timing.LATEST + ".json"), "w") as f:
        json.dump(dict(doc, rows=rows, **changes), f)


def test_g4_merge_joins_the_pieces_of_a_multi_gpu_call_and_refuses_what_does_not_merge(tmp_path):
    with open(os.path.join(_ROOT, "docs", "audit", timing.LATEST + ".json")) as f:
        doc = json.load(f)  # the committed report: its format, code digest and device
    # twelve rows of distinct cells, whatever the committed report holds (a piece may hold few rows)
    rows = [dict(doc["rows"][0], layout=lay, mode=mode, policy=pol)
            for lay in timing.LAYOUTS for mode in timing.MODES for pol in timing.POLICIES]
    assert len({timing.row_key(r) for r in rows}) == len(rows) == 12
    seed, p0, p1 = rows[:-8], rows[-8:-4], rows[-4:]
    merge = _g4_merge().main
    _report_with(doc, seed, str(tmp_path / "seed"))
    _report_with(doc, seed + p0, str(tmp_path / "call" / "audit0"))
    _report_with(doc, seed + p1, str(tmp_path / "call" / "audit1"))
    assert merge([str(tmp_path / "seed"), str(tmp_path / "call"), "--out", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / (timing.LATEST + ".json")) as f:
        merged = json.load(f)
    assert sorted(map(timing.row_key, merged["rows"])) == sorted(map(timing.row_key, rows))
    assert (tmp_path / "out" / (timing.LATEST + ".md")).exists()
    # the seed was left alone (--out elsewhere)
    with open(tmp_path / "seed" / (timing.LATEST + ".json")) as f:
        assert len(json.load(f)["rows"]) == len(seed)
    # a cell measured by two pieces: refused, nothing written
    _report_with(doc, seed + p0 + p1[:1], str(tmp_path / "call" / "audit1"))
    with pytest.raises(SystemExit, match="two pieces"):
        merge([str(tmp_path / "seed"), str(tmp_path / "call"), "--out", str(tmp_path / "out2")])
    assert not (tmp_path / "out2").exists()
    # a piece of other measured code (or another card): refused
    _report_with(doc, seed + p1, str(tmp_path / "call" / "audit1"), source="0" * 16)
    with pytest.raises(SystemExit, match="not mergeable"):
        merge([str(tmp_path / "seed"), str(tmp_path / "call"), "--out", str(tmp_path / "out3")])
    # a call that measured nothing new writes nothing
    _report_with(doc, seed, str(tmp_path / "empty" / "audit0"))
    assert merge([str(tmp_path / "seed"), str(tmp_path / "empty"), "--out", str(tmp_path / "out4")]) == 1
    assert not (tmp_path / "out4").exists()


@pytest.mark.parametrize("features, measured_s", [
    ("heads=64x8x64,window=128,sinks", (81, 85)),          # H200, 2026-11-29 (docs/audit/README.md)
    ("heads=16x8x256,window=1024,softcap=50", (110, 134)),
])
def test_the_estimate_of_a_data_pair_meets_its_h200_runs(features, measured_s):
    """The wall time the plan gives random vs random2 (their data copied every round) lies within 15 % of
    the H200 runs it was fitted to; short vs long stays the launch model's (41-54 s measured)."""
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    st = timing.settings_from_args(ap.parse_args([
        "--features", features, "--steps", "prefill", "--lengths", "4096", "--policies", "strict", "--layouts",
        "churned", "--modes", "graph", "--pairs", "gating", "--no-null", "--no-control"]))
    est = {(sp.a, sp.b): timing.pair_estimate_s(sp, st.modes) for g in timing.plan(st) for sp in g.specs}
    lo, hi = measured_s
    assert 0.85 * lo <= est[("random", "random2")] <= 1.15 * hi
    assert 41 * 0.85 <= est[("short", "long")] <= 54 * 1.15
