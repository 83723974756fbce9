"""`benchmarks.harness` on a CPU: summary arithmetic, row statuses, the output files.

No test asserts on a time. In this process DHP runs the reference path (conftest
keeps TRITON_INTERPRET unset outside the interpreter module, and vLLM may have
imported triton for the compiler already); the one end-to-end CLI run goes to a
fresh subprocess with TRITON_INTERPRET=1 so that DHP runs the Triton kernels
in the interpreter, as a GPU run would run them compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import anchors as A
from benchmarks import cases as C
from benchmarks import harness, inputs, report
from benchmarks.timer import HostTimer, Timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_ANCHORS = ("fa3", "flashinfer", "triton_unified", "sdpa_cudnn")


# ------------------------------------------------------------------ synthetic rows

def _row(case, anchor, ms, *, family, ctx, bound="memory", batch=1, status="ok", useful=(1e9, 1e12),
         executed=None):
    r = {"case": case, "anchor": anchor, "family": family, "ctx": ctx, "bound": bound, "batch": batch,
         "status": status, "time_ms": ms if status == "ok" else None,
         "useful_GBps": useful[0] / (ms * 1e-3) / 1e9 if status == "ok" else None,
         "useful_TFLOPs": useful[1] / (ms * 1e-3) / 1e12 if status == "ok" else None,
         "executed_GBps": None, "executed_TFLOPs": None}
    if executed and status == "ok":
        r["executed_GBps"] = executed[0] / (ms * 1e-3) / 1e9
        r["executed_TFLOPs"] = executed[1] / (ms * 1e-3) / 1e12
    return r


def _synthetic_rows():
    rows = []
    # decode: ratio = t_fa3 / t_off; ctx 1024 is outside the key's shapes (would be the worst).
    for name, ctx, t_fa3, t_off in (("d1k", 1024, 1.0, 10.0), ("d4k", 4096, 1.0, 2.0), ("d32k", 32768, 1.0, 1.25)):
        rows += [_row(name, "fa3", t_fa3, family="decode", ctx=ctx), _row(name, "dhp_off", t_off, family="decode",
                                                                           ctx=ctx)]
    # prefill: one shape lacks FA3 (not available): counted shapes only, the gap reported.
    rows += [_row("p4k", "fa3", 2.0, family="prefill", ctx=4096, bound="compute"),
             _row("p4k", "dhp_off", 4.0, family="prefill", ctx=4096, bound="compute"),
             _row("p8k", "fa3", 0.0, family="prefill", ctx=8192, bound="compute", status="not available: x"),
             _row("p8k", "dhp_off", 4.0, family="prefill", ctx=8192, bound="compute")]
    # GQA 7 prefill and the mixed step: their own keys (FA3 time over DHP's on the same work)
    rows += [_row("g7", "fa3", 2.0, family="prefill_gqa7", ctx=8192, bound="compute"),
             _row("g7", "dhp_off", 5.0, family="prefill_gqa7", ctx=8192, bound="compute"),
             _row("mx", "fa3", 3.0, family="mixed", ctx=6144, bound="compute"),
             _row("mx", "dhp_off", 4.0, family="mixed", ctx=6144, bound="compute")]
    # strict: executed work 8x the useful, DHP strict 4x slower -> efficiency 2.0; GB/s for decode.
    rows += [_row("s", "fa3", 1.0, family="strict", ctx=4096),
             _row("s", "dhp_strict", 4.0, family="strict", ctx=4096, executed=(8e9, 8e12))]
    return rows


def test_summary_picks_the_worst_shape_and_ignores_other_shapes():
    s = report.summarize(_synthetic_rows(), device="GPU X", commit="abc")
    assert s["decode_off_vs_fa3"] == pytest.approx(0.5)  # d4k; d1k (0.1) is below 4K context
    assert s["worst_shape"]["decode_off_vs_fa3"] == "d4k"
    assert s["detail"]["decode_off_vs_fa3"]["counted"] == 2
    assert s["prefill_off_vs_fa3"] == pytest.approx(0.5)
    assert s["detail"]["prefill_off_vs_fa3"]["missing"] == ["p8k"]
    assert s["detail"]["prefill_off_vs_fa3"]["complete"] is False
    assert s["strict_efficiency_vs_fa3"] == pytest.approx(2.0)
    assert s["prefill_off_vs_fa3_gqa7"] == pytest.approx(0.4) and s["worst_shape"]["prefill_off_vs_fa3_gqa7"] == "g7"
    assert s["mixed_off_vs_fa3"] == pytest.approx(0.75)
    assert s["detail"]["prefill_off_vs_fa3"]["counted"] == 1  # the GQA 7 shape is not in prefill_off's
    assert (s["device"], s["commit"]) == ("GPU X", "abc")
    assert set(report.SUMMARY_KEYS) <= set(s)


def test_summary_is_null_when_an_input_is_missing():
    rows = [r for r in _synthetic_rows() if r["anchor"] != "fa3"]
    s = report.summarize(rows)
    for k in report.SUMMARY_KEYS:
        assert s[k] is None and s["worst_shape"][k] is None
    assert s["detail"]["e2e_off_vs_flash_attn"]["missing"] == [None]  # no e2e file: no reason given here
    s = report.summarize([], e2e_rows=None, e2e_why="no --e2e-json given")
    assert s["detail"]["e2e_vs_flash_attn_batch_invariant"]["missing"] == ["no --e2e-json given"]


def _e2e_file(tmp_path, rows):
    p = tmp_path / "e2e.json"
    p.write_text(json.dumps({"header": {}, "results": rows}))
    return str(p)


E2E_ROWS = [
    {"config": "fa3", "backend": "FLASH_ATTN", "policy": None, "batch_invariant": False, "status": "ok",
     "output_tok_per_s": 1000.0},
    {"config": "fa3-bi", "backend": "FLASH_ATTN", "policy": None, "batch_invariant": True, "status": "ok",
     "output_tok_per_s": 800.0},
    {"config": "dhp-off", "backend": "DHP", "policy": "off", "batch_invariant": False, "status": "ok",
     "output_tok_per_s": 950.0},
    {"config": "dhp-strict", "backend": "DHP", "policy": "strict", "batch_invariant": False, "status": "ok",
     "output_tok_per_s": 500.0},  # not an e2e_off row
    {"config": "dhp-off-bi", "backend": "DHP", "policy": "off", "batch_invariant": True, "status": "ok",
     "output_tok_per_s": 960.0},
    {"config": "dhp-strict-bi", "backend": "DHP", "policy": "strict", "batch_invariant": True, "status": "ok",
     "output_tok_per_s": 920.0},
    {"config": "dhp-request-bi", "backend": "DHP", "policy": "request", "batch_invariant": True,
     "status": "failed: timeout", "output_tok_per_s": None},
]


def test_summary_reads_the_e2e_json(tmp_path):
    rows, why = report.load_e2e(_e2e_file(tmp_path, E2E_ROWS))
    assert why is None
    s = report.summarize([], e2e_rows=rows)
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(0.95)
    assert s["e2e_vs_flash_attn_batch_invariant"] == pytest.approx(920 / 800)  # the slowest DHP -bi row
    assert s["e2e_off_bi_vs_flash_attn_bi"] == pytest.approx(960 / 800)  # policy off under batch invariance only
    assert "dhp-strict-bi" in s["worst_shape"]["e2e_vs_flash_attn_batch_invariant"]
    # no batch-invariant FLASH_ATTN row -> null, and why
    rows, _ = report.load_e2e(_e2e_file(tmp_path, [r for r in E2E_ROWS if r["config"] != "fa3-bi"]))
    s = report.summarize([], e2e_rows=rows)
    assert s["e2e_vs_flash_attn_batch_invariant"] is None
    assert s["detail"]["e2e_vs_flash_attn_batch_invariant"]["missing"] == ["FLASH_ATTN row"]
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(0.95)
    rows, why = report.load_e2e(str(tmp_path / "absent.json"))
    assert rows is None and "cannot read" in why


def test_summary_takes_each_e2e_key_from_the_first_complete_run(tmp_path):
    # Newest run first: it has FLASH_ATTN and DHP off only; the older one has every row.
    newer = tmp_path / "new.json"
    newer.write_text(json.dumps({"results": [dict(E2E_ROWS[0]),
                                             {**E2E_ROWS[2], "output_tok_per_s": 970.0}]}))
    older = _e2e_file(tmp_path, E2E_ROWS)
    runs = [(str(newer), *report.load_e2e(str(newer))), (older, *report.load_e2e(older))]
    s = report.summarize([], e2e_runs=runs)
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(0.97)  # the newer run, both rows from it
    assert s["detail"]["e2e_off_vs_flash_attn"]["source"] == str(newer)
    assert s["e2e_vs_flash_attn_batch_invariant"] == pytest.approx(920 / 800)  # only the older run has it
    assert s["detail"]["e2e_vs_flash_attn_batch_invariant"]["source"] == older
    # A key that no run completes says what each run lacked.
    runs = [(str(newer), *report.load_e2e(str(newer))), ("absent.json", *report.load_e2e("absent.json"))]
    d = report.summarize([], e2e_runs=runs)["detail"]["e2e_vs_flash_attn_batch_invariant"]
    assert d["value"] is None and d["source"] is None
    assert any(m.startswith(str(newer)) for m in d["missing"]) and any("cannot read" in m for m in d["missing"])


def test_e2e_file_of_parts_gives_one_run_per_gpu(tmp_path):
    # Two GPUs side by side: each ratio from one part, never FLASH_ATTN of one GPU over DHP of the other.
    parts = tmp_path / "parts.json"
    parts.write_text(json.dumps({"parts": [
        {"gpu": 0, "results": [dict(E2E_ROWS[0], output_tok_per_s=1100.0), {**E2E_ROWS[2], "output_tok_per_s": 990.0}]},
        {"gpu": 1, "results": [dict(E2E_ROWS[0]), {**E2E_ROWS[2], "output_tok_per_s": 980.0}]},
        {"gpu": 2}]}))
    runs = report.load_e2e_runs([str(parts)])
    assert [r[0] for r in runs] == [f"{parts}#gpu0", f"{parts}#gpu1", f"{parts}#gpu2"]
    assert runs[2][1] is None and "no 'results' list" in runs[2][2]
    s = report.summarize([], e2e_runs=runs)
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(990 / 1100)  # the first part, both rows from it
    assert s["detail"]["e2e_off_vs_flash_attn"]["source"] == f"{parts}#gpu0"
    plain = _e2e_file(tmp_path, E2E_ROWS)  # a file without parts stays one run
    assert [r[0] for r in report.load_e2e_runs([plain])] == [plain]


def test_resummarize_joins_a_bench_json_with_e2e_runs(tmp_path):
    """`bench --resummarize`: no timing, the kernel keys recomputed from the rows, the e2e keys from the runs."""
    from benchmarks import harness

    # A real GPU run: the published latest.json (every header field, every row).
    with open(os.path.join(ROOT, "docs", "bench", "latest.json")) as f:
        doc = json.load(f)
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    e2e = _e2e_file(tmp_path, E2E_ROWS)
    out, latest = tmp_path / "out", tmp_path / "latest.json"
    rc = harness.main(["--resummarize", str(src), "--e2e-json", e2e, "--out", str(out), "--latest", str(latest),
                       "--no-plots"])
    assert rc == 0
    new = json.loads(latest.read_text())
    assert new["header"]["e2e_json"] == [e2e] and new["rows"] == doc["rows"]
    s = new["summary"]
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(0.95)
    assert s["commit"] == doc["header"]["commit"] and s["device"] == doc["header"]["device"]["name"]
    for k in ("decode_off_vs_fa3", "prefill_off_vs_fa3", "strict_efficiency_vs_fa3"):
        assert s[k] == pytest.approx(doc["summary"][k]), k
    assert (out / "bench.md").exists()


# ------------------------------------------------------------------ work counts, layouts

def test_work_counts_follow_the_policy():
    c = C.prefill(32, True, shape=C.TINY)  # Hq 4, Hkv 2, d 64, bf16
    u = C.work(c)
    assert u["flops"] == 4 * 4 * 64 * (32 * 33 // 2)  # causal triangle
    assert u["bytes"] == 32 * 2 * 2 * 64 * 2 + 2 * 32 * 4 * 64 * 2
    nc = C.prefill(32, False, shape=C.TINY)
    assert C.work(nc)["flops"] == 4 * 4 * 64 * 32 * 32
    s = C.strict(C.decode(2, 64, shape=C.TINY), 128)
    ex = C.work(s, "strict")
    assert ex["flops"] == 4 * 4 * 64 * 2 * 128 and ex["bytes"] > C.work(s)["bytes"]
    assert C.work(s, "request") == C.work(s)  # 64 is already a power of two
    m = C.mixed(chunk=8, chunk_context=24, decodes=3, decode_ctx=20)
    assert m.kind == "mixed" and m.q_lens == (1, 1, 1, 8) and m.seq_lens == (20, 20, 20, 32)
    assert C.buckets(m, "request") == [32, 32, 32, 32] and C.buckets(m, "off") is None
    assert C.cache_blocks(s) == 3 * 8  # every request's reservation at L=128, plus one spare request's


def test_gpu_shape_list():
    full, quick = C.gpu_cases(), C.gpu_cases(quick=True)
    assert len(quick) < len(full)
    names = {c.name for c in full}
    assert {"decode B256 ctx32768", "prefill S16384 noncausal", "head64 fp16 B16 H16 S2048 noncausal"} <= names
    assert {c.family for c in full} == {"decode", "prefill", "prefill_gqa7", "mixed", "head64", "gqa", "strict"}
    g7 = [c for c in full if c.family == "prefill_gqa7"]
    assert [c.seq_lens for c in g7] == [(4096, 4096), (8192, 8192), (16384, 16384)]
    assert all((c.num_heads, c.num_kv_heads, c.causal) == (28, 4, True) for c in g7)
    assert [c.seq_lens for c in quick if c.family == "prefill_gqa7"] == [(4096, 4096)]
    assert any(c.num_kv_heads == 32 for c in full) and any(c.num_kv_heads == 4 for c in full)
    assert all(c.anchors == C.STRICT_ANCHORS for c in full if c.family == "strict")
    big = next(c for c in full if c.name == "decode B256 ctx32768")
    assert C.work(big)["bytes"] > 34e9  # 34 GB of K/V
    n, why = inputs.plan_memory(big, 4, free_bytes=40 * 2**30)
    assert n == 0 and "does not fit" in why
    assert inputs.plan_memory(C.decode(1, 1024), 20, free_bytes=80 * 2**30) == (20, None)
    assert [c.name for c in C.select(full, "gqa")] == [c.name for c in full if c.family == "gqa"]


def test_native_layouts_hold_the_same_values():
    c = C.decode(3, 40, shape=C.TINY)
    s = inputs.build_set(c, torch.Generator().manual_seed(0), torch.device("cpu"))
    nhd, hnd = A.nhd_cache(s.kv, c.head_size), A.hnd_cache(s.kv, c.head_size)
    assert torch.equal(nhd[:, 0].permute(0, 2, 1, 3), s.key_cache)  # [blocks, slot, head, d]
    assert torch.equal(nhd[:, 1].permute(0, 2, 1, 3), s.value_cache)
    assert torch.equal(hnd[:, 0], s.key_cache) and torch.equal(hnd[:, 1], s.value_cache)
    indptr, indices, last = A.FlashInfer.pages(c, s)
    assert indptr.tolist() == [0, 3, 6, 9] and last.tolist() == [8, 8, 8]
    assert torch.equal(indices, s.block_table[:, :3].reshape(-1))


class MathSdpa(A.SdpaCudnn):
    """The cuDNN anchor's gather/group/mask/pack logic with the math backend, on the CPU."""

    def available(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.backend, self.sdpa_kernel = SDPBackend.MATH, sdpa_kernel


@pytest.mark.parametrize("c", [
    C.mixed(chunk=24, chunk_context=40, decodes=3, decode_ctx=33),
    C.prefill(48, True, shape=C.TINY),
    C.prefill(20, False, shape=C.TINY, batch=2),
    C.decode(3, 50, shape={**C.TINY, "num_kv_heads": 1}),
], ids=lambda c: c.name)
def test_dense_sdpa_layout_matches_the_reference(c):
    s = inputs.build_set(c, torch.Generator().manual_seed(1), torch.device("cpu"))
    ref = inputs.reference(c, s)
    a = MathSdpa(torch.device("cpu"))
    a.available()
    a.prepare(c, [s])
    assert inputs.rel_err(a.packed(0, a.run(0)), ref) < 2e-2


def test_reference_chunks_agree_with_ops_reference():
    from dhp_backend.ops.reference import paged_attention_reference

    c = C.mixed(chunk=24, chunk_context=40, decodes=3, decode_ctx=33)
    s = inputs.build_set(c, torch.Generator().manual_seed(2), torch.device("cpu"))
    out = torch.empty_like(s.query, dtype=torch.float32)
    paged_attention_reference(s.query.float(), s.key_cache, s.value_cache, s.block_table, s.query_start_loc,
                              s.seq_lens, out, scale=c.head_size ** -0.5, causal=True, num_tokens=c.num_tokens)
    chunked = inputs.reference(c, s, max_scores=4 * 64)  # forces several row chunks
    assert torch.allclose(chunked, out, atol=1e-5)


def test_timing_percentiles():
    t = Timing.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.n) == (3.0, 1.4, 4.6, 5)


# ------------------------------------------------------------------ rows from the harness loop

class CountingAnchor(A.Anchor):
    """Counts launches; ``wrong`` returns noise instead of attention."""

    graphable = False

    def __init__(self, name, *, wrong=False, absent=None, broken=False):
        super().__init__(torch.device("cpu"))
        self.name, self.label, self.wrong, self.absent, self.broken = name, f"test {name}", wrong, absent, broken
        self.launches = 0

    def available(self):
        return self.absent

    def prepare(self, case, sets):
        if self.broken:
            raise RuntimeError("kernel launch failed\nsecond line")
        super().prepare(case, sets)
        self.refs = [inputs.reference(case, s).to(s.query.dtype) for s in sets]

    def run(self, i):
        self.launches += 1
        return torch.randn_like(self.refs[i]) if self.wrong else self.refs[i]


def test_rows_for_absent_broken_wrong_and_working_anchors(capsys):
    c = C.decode(2, 64, shape=C.TINY)
    wrong = CountingAnchor("planted_wrong", wrong=True)
    fa3 = CountingAnchor("fa3")  # a correct stand-in, so that the ratio columns fill
    anchors = [CountingAnchor("absent", absent="needs a CUDA GPU"), CountingAnchor("broken", broken=True), wrong,
               fa3, A.DHP(torch.device("cpu"), "off"), A.DHP(torch.device("cpu"), "strict")]
    rows = harness.run_cases([c], anchors, device=torch.device("cpu"), timer=HostTimer(reps=2, warmup=0),
                             l2_bytes=2**20, max_sets=2)
    by = {r["anchor"]: r for r in rows}
    assert by["absent"]["status"] == "not available: needs a CUDA GPU"
    assert by["broken"]["status"] == "not available: RuntimeError: kernel launch failed"
    assert by["planted_wrong"]["status"] == "wrong result" and by["planted_wrong"]["rel_err"] > 0.5
    assert wrong.launches == 1 and by["planted_wrong"]["time_ms"] is None  # checked once, never timed
    assert fa3.launches == 1 + 2  # the check, then the timed launches
    for name in ("dhp_off", "dhp_strict"):
        r = by[name]
        assert r["status"] == "ok" and r["rel_err"] < 2e-2 and r["path"] == "reference" and r["mode"] == "host"
        assert r["vs_fa3"] > 0 and r["vs_flashinfer"] is None and r["sets"] == 2
    assert by["dhp_strict"]["executed_bytes"] == C.work(c, "strict")["bytes"]
    assert by["dhp_off"]["executed_bytes"] is None
    out = capsys.readouterr().out
    assert "[3/6] decode B2 ctx64 planted_wrong ... wrong result" in out

    # the markdown table of these rows carries the ratio columns
    head = {"device": {"name": "CPU"}, "versions": {}, "commit": "abc", "date": "today",
            "settings": {"clock": "host", "reps": 2, "warmup": 0}}
    doc = report.build(head, {}, [c], rows)
    md = report.markdown(doc)
    assert "| vs FA3 | vs FlashInfer |" in md and "wrong result" in md
    line = next(x for x in md.splitlines() if x.startswith("| decode B2 ctx64 | dhp_off |"))
    assert line.split(" | ")[9].endswith("x")  # vs FA3 filled


def test_cli_rejects_unknown_names(capsys):
    assert harness.main(["--device", "cpu", "--cases", "no-such-case"]) == 2
    assert harness.main(["--device", "cpu", "--anchors", "fa4"]) == 2
    err = capsys.readouterr().err
    assert "matches no case" in err and "unknown anchor(s) ['fa4']" in err


# ------------------------------------------------------------------ the harness end to end

def test_cpu_run_end_to_end_under_the_interpreter(tmp_path):
    e2e = _e2e_file(tmp_path, E2E_ROWS)
    out, latest = tmp_path / "out", tmp_path / "docs" / "latest.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", "--device", "cpu", "--out", str(out),
         "--latest", str(latest), "--e2e-json", e2e],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    assert json.loads(latest.read_text()) == doc
    assert set(doc) == {"header", "ceilings", "cases", "rows", "summary"}
    h = doc["header"]
    assert h["device"]["type"] == "cpu" and h["triton_interpret"] is True and "commit" in h
    assert {"torch", "triton", "vllm", "flashinfer"} <= set(h["versions"])
    assert {"copy", "matmul"} == set(doc["ceilings"])
    rows = doc["rows"]
    assert len(rows) == 3 * 7 - 3  # the strict case times 4 anchors
    for r in rows:
        assert r["useful_bytes"] > 0 and r["useful_flops"] > 0
        if r["anchor"] in GPU_ANCHORS:
            assert r["status"].startswith("not available: needs a CUDA GPU") and r["time_ms"] is None
        else:
            assert r["status"] == "ok", r
            assert r["path"] == "auto" and r["kernel"] == "triton" and r["mode"] == "host" and r["rel_err"] < 2e-2
            assert r["p10_ms"] <= r["time_ms"] <= r["p90_ms"] and r["useful_GBps"] > 0
            assert (r["executed_bytes"] is None) == (r["anchor"] == "dhp_off")
    s = doc["summary"]
    assert set(report.SUMMARY_KEYS) <= set(s) and s["device"] == h["device"]["name"]
    assert s["decode_off_vs_fa3"] is None and s["strict_efficiency_vs_fa3"] is None  # no FA3 on a CPU
    assert s["e2e_off_vs_flash_attn"] == pytest.approx(0.95)
    md = (out / "bench.md").read_text()
    assert "| vs FA3 | vs FlashInfer |" in md and "## Summary" in md
    assert "[18/18] strict decode B2 ctx64 M128 dhp_strict ..." in proc.stdout


def test_anchor_imports_say_why_they_are_absent():
    from benchmarks import anchors

    (fn,), why = anchors._imported("dhp_backend.ops", "paged_attention")
    assert why is None and callable(fn)
    mod, why = anchors._imported("no_such_package_dhp")
    assert mod is None and why.startswith("no_such_package_dhp does not import: ModuleNotFoundError")
    mod, why = anchors._imported("json", "dumps", "no_such_function")
    assert mod is None and why == "json has no no_such_function (another version?)"


def test_the_product_cli_has_no_bench_subcommand(capsys):
    """The benchmarks are not installed: `dhp-backend` offers no `bench` (it would import them)."""
    from dhp_backend.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["bench"])
    assert exc.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err
