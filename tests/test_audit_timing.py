"""G4 timing gate on the CPU: statistics on synthetic streams, PNG fallback, report writer, no-GPU exit."""

from __future__ import annotations

import argparse
import json
import math
import struct
import zlib

import numpy as np
import pytest

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
    assert timing.summarize([ctl, g], 1.0)["passed"] is True
    s = timing.summarize([same, g], 1.0)
    assert s["passed"] is False and "cannot detect a leak" in s["messages"][0]


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


def test_report_json_has_documented_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "renderer", lambda: "builtin (dhp_backend.audit.png)")
    a, b = _pair(10)
    results = [timing.analyse_streams(a[:20000], (b + 40)[:20000], pair=("short", "long"), role="control"),
               timing.analyse_streams(a[:3000], b[:3000], pair=("random", "random2"), role="gating"),
               timing.analyse_streams(a[:3000], b[:3000] + 1, pair=("random", "zeros"), role="reported")]
    spec = timing.PairSpec(timing.parse_shapes("16,4096")[0], "short", "long", "gating", 10)
    results.append(timing.error_result(spec, "graph", "RuntimeError: capture failed"))
    s = timing.summarize(results, 2.0)
    meta = {"device": "NVIDIA H100 80GB HBM3", "versions": timing.versions(), "settings": {"seed": 0}}
    md, js = timing.write_reports(str(tmp_path), s, results, meta, date="2026-01-02", save_samples=True)
    assert js.endswith("2026-01-02-timing-h100-80gb-hbm3.json") and md.endswith(".md")
    doc = json.load(open(js))
    assert set(timing.REPORT_KEYS) <= set(doc)
    assert set(timing.SUMMARY_KEYS) <= set(doc["summary"])
    assert doc["renderer"].startswith("builtin")
    for r in doc["results"]:
        assert set(timing.RESULT_KEYS) <= set(r), set(timing.RESULT_KEYS) - set(r)
        assert "_samples" not in r
    assert doc["summary"]["passed"] is False  # too few gating samples, and an errored gating pair
    assert [r["verdict"] for r in doc["results"]] == ["leak detected", "too few samples", "differs", "error"]
    for r in doc["results"][:3]:
        assert len(r["plots"]) == 2
        for p in r["plots"]:
            _png_info(open(p, "rb").read())
    text = open(md).read()
    assert "G4 timing gate" in text and "capture failed" in text and "builtin" in text
    assert (tmp_path / "2026-01-02-timing-h100-80gb-hbm3-samples.npz").exists()


def test_run_without_gpu_returns_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    assert timing.run(ap.parse_args([])) == 2
    assert "GPU machine" in capsys.readouterr().err
    assert timing.run(ap.parse_args(["--shapes", "16"])) == 2
    assert "batch,bucket" in capsys.readouterr().err


def test_plan_has_control_gating_and_reported():
    from dhp_backend.audit import classes

    shape = timing.parse_shapes("16,4096")[0]
    specs = timing.plan(shape, 100, 20, 30)
    assert specs[0].role == "control" and specs[0].shape.policy == "off" and (specs[0].a, specs[0].b) == (
        "short", "long")
    assert [(s.a, s.b) for s in specs if s.role == "gating"] == list(classes.GATING_PAIRS)
    assert [(s.a, s.b) for s in specs if s.role == "reported"] == list(classes.REPORTED_PAIRS)
    assert all(s.shape.policy == "strict" for s in specs[1:])
    assert timing.parse_shapes("8,2048;4,1024,16")[1].q_len == 16


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


def test_run_glue_with_a_fake_timer(tmp_path, monkeypatch, capsys):
    """`run` end to end (argument handling, plan, reports, exit code) with the GPU measurement faked."""
    import torch

    class FakeTimer:
        device_name, cycles_per_ms = "NVIDIA H200", 1.9e6

        def __init__(self, chunk, warmup, progress):
            pass

        def pad_note(self):
            return "fake"

        def measure_pair(self, spec, modes, seed=0):
            rng = np.random.default_rng(seed)
            a = rng.normal(100, 1, spec.rounds)
            b = rng.normal(100, 1, spec.rounds) + (20 if spec.role == "control" else 0)
            return [timing.analyse_streams(a, b, pair=(spec.a, spec.b), role=spec.role, mode=m,
                                           shape=spec.shape.key, policy=spec.shape.policy) for m in modes]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "Timer", FakeTimer)
    monkeypatch.setattr(timing, "renderer", lambda: "builtin (dhp_backend.audit.png)")
    ap = argparse.ArgumentParser()
    timing.add_arguments(ap)
    args = ap.parse_args(["--samples", "2000", "--reported-samples", "500", "--control-samples", "500",
                          "--report-dir", str(tmp_path), "--no-graph"])
    assert timing.run(args) == 1  # 2000 < 10^5 samples: the gate cannot pass
    out = capsys.readouterr().out
    assert "G4 timing gate: FAIL" in out and "too few samples" in out
    doc = json.load(open(next(tmp_path.glob("*-timing-h200.json"))))
    assert [r["mode"] for r in doc["results"]] == ["eager"] * 6 and doc["summary"]["control_detected"]
    # the same run passes once 2000 samples are enough (pass rule's minimum lowered for the test)
    monkeypatch.setattr(timing.stats.verdict, "__kwdefaults__", {"threshold": 4.5, "min_samples": 1000})
    assert timing.run(ap.parse_args(["--samples", "2000", "--reported-samples", "500", "--control-samples",
                                     "500", "--report-dir", "", "--graph"])) == 0
