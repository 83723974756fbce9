"""`benchmarks.ab`: csrc variants built as asked (or refused with a message), compared row by row, and the
whole loop on the CPU harness."""

import json

import pytest

from benchmarks import ab

# A line of csrc/prefill_sm90.cu that occurs once (read from the tree: the flag's value changes with the kernels).
KSNAP = next(ln.strip() for ln in (ab.CSRC / "prefill_sm90.cu").read_text().splitlines()
             if ln.startswith("constexpr bool kSnapCT = "))


def test_variants_parse_and_accumulate_edits(tmp_path):
    vs = ab.parse_variants(["base", f"x:prefill_sm90.cu:{KSNAP}=>constexpr bool kSnapCT = false;",
                            "x:decode_sm90.cu:a=>b", f"old:{tmp_path}"])
    assert [v.name for v in vs] == ["base", "x", "old"]
    assert vs[0].source == ab.CSRC and not vs[0].edits
    assert vs[1].edits == [("prefill_sm90.cu", KSNAP, "constexpr bool kSnapCT = false;"), ("decode_sm90.cu", "a", "b")]
    assert vs[2].source == tmp_path.resolve()


@pytest.mark.parametrize("specs, why", [
    (["base"], "at least two"),
    (["base", "base"], "at least two"),
    (["base", "b c:x=>y"], "not a word"),
    (["base", ":x=>y"], "not a word"),
    (["base", "b:/no/such/dir"], "neither a directory"),
    (["base", "b:prefill_sm90.cu:=>y"], "needs FILE and OLD"),
    (["base", "b:f.cu:x=>y", "b:/tmp"], "stands alone"),
])
def test_bad_variants_are_refused_with_what_is_accepted(specs, why):
    with pytest.raises(ab.VariantError, match=why) as e:
        ab.parse_variants(specs)
    assert "accepted:" in str(e.value)


def test_edits_must_match_exactly_once(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "prefill_sm90.cu").write_text("int a = 1;\nint b = 1;\n")
    ok = ab.Variant("ok", src, [("prefill_sm90.cu", "int a = 1;", "int a = 2;")])
    assert (ab.materialize(ok, tmp_path / "v") / "prefill_sm90.cu").read_text() == "int a = 2;\nint b = 1;\n"
    assert (src / "prefill_sm90.cu").read_text().startswith("int a = 1;")  # the source is never edited
    for edit, why in [(("prefill_sm90.cu", "= 1;", "= 3;"), "occurs 2 times"),
                      (("prefill_sm90.cu", "int c", "int d"), "occurs 0 times"),
                      (("nope.cu", "a", "b"), "does not exist")]:
        with pytest.raises(ab.VariantError, match=why):
            ab.materialize(ab.Variant("bad", src, [edit]), tmp_path / "v")
    with pytest.raises(ab.VariantError, match="not a csrc directory"):
        ab.materialize(ab.Variant("empty", tmp_path / "v"), tmp_path / "w")


def _row(case, anchor, t, status="ok", vs=None):
    return {"case": case, "anchor": anchor, "time_ms": t, "status": status, "vs_fa3": vs}


def test_compare_takes_medians_and_never_numbers_a_failed_row():
    runs = {
        "a": [{"rows": [_row("p", "fa3", 1.0), _row("p", "dhp_off", 2.0, vs=0.5), _row("q", "dhp_off", 1.0)]},
              {"rows": [_row("p", "fa3", 1.0), _row("p", "dhp_off", 2.2, vs=0.45), _row("q", "dhp_off", 1.0)]}],
        "b": [{"rows": [_row("p", "fa3", 1.1), _row("p", "dhp_off", 1.8, vs=0.61), _row("q", "dhp_off", 0.5,
                                                                                      status="wrong result")]},
              {"rows": [_row("p", "fa3", 1.0), _row("p", "dhp_off", 1.9, vs=0.53)]}],
    }
    res = ab.compare(runs)
    rows = {(r["case"], r["anchor"]): r for r in res["rows"]}
    assert rows[("p", "fa3")]["times"] == [1.0, 1.0, 1.1, 1.0] and rows[("p", "fa3")]["median_ms"] == 1.0
    p = rows[("p", "dhp_off")]["variants"]
    assert p["a"]["median_ms"] == pytest.approx(2.1) and p["a"]["vs_fa3"] == pytest.approx(0.475)
    assert p["b"]["vs_first"] == pytest.approx(1.85 / 2.1 - 1)
    q = rows[("q", "dhp_off")]["variants"]["b"]
    assert q["bad"] == ["wrong result"] and q["median_ms"] is None and q["vs_first"] is None
    md = "\n".join(ab.markdown(res))
    assert "wrong result" in md and "-11.90 %" in md


def test_the_loop_on_the_cpu_harness(tmp_path, capsys):
    out = tmp_path / "ab"
    rc = ab.main(["--variant", "base", "--variant", f"cmt:prefill_sm90.cu:{KSNAP}=>{KSNAP} // edited",
                  "--rounds", "1", "--out", str(out), "--device", "cpu", "--cases", "prefill", "--anchors", "dhp_off"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads((out / "ab.json").read_text())
    assert res["variants"] == ["base", "cmt"] and res["rows"] and not res["errors"]
    assert all(r["variants"][v]["median_ms"] > 0 for r in res["rows"] for v in ("base", "cmt"))
    assert "// edited" in (out / "variants" / "cmt" / "csrc" / "prefill_sm90.cu").read_text()
    assert (out / "r1-base" / "bench.json").exists() and (out / "ab.md").exists()
    md = (out / "ab.md").read_text()  # the chart, or why there is none
    assert ("![time against the first variant](ab.png)" in md) == (out / "ab.png").exists()
    assert (out / "ab.png").exists() or "matplotlib is not installed" in md
    assert ab.main(["--variant", "a", "--variant", "b", "--rounds", "0"]) == 2
    assert ab.main(["--variant", "a", "--variant", "b:/no/dir"]) == 2
    assert ab.main(["--variant", "a", "--variant", "b", "--latest", "x.json"]) == 2
    assert "accepted" in capsys.readouterr().err


def test_a_run_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """ab.json / ab.md are written after every run: a call killed in its third run keeps the first two,
    marked NOT COMPLETE."""
    calls = []

    def fake(out, csrc, hargs, log):
        calls.append(out.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the call's timeout
        return {"rows": [{"case": "p", "anchor": "fa3", "status": "ok", "time_ms": 1.0},
                         {"case": "p", "anchor": "dhp_strict", "status": "ok", "time_ms": 2.0 + len(calls),
                          "vs_fa3": 0.5}]}

    monkeypatch.setattr(ab, "run_harness", fake)
    out = tmp_path / "ab"
    with pytest.raises(KeyboardInterrupt):
        ab.main(["--variant", "a", "--variant", "b", "--rounds", "2", "--out", str(out)])
    res = json.loads((out / "ab.json").read_text())
    assert calls == ["r1-a", "r1-b", "r2-b"] and (res["runs_done"], res["runs_total"]) == (2, 4)
    row = next(r for r in res["rows"] if r["kind"] == "dhp")
    assert row["variants"]["a"]["times"] == [3.0] and row["variants"]["b"]["times"] == [4.0]
    assert "NOT COMPLETE: 2 of 4 runs" in (out / "ab.md").read_text()
