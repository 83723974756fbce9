"""benchmarks.cuda_runs (what the csrc kernels' benches share), on CPU tensors: a row is
timed only when its output is right; a missing anchor
is a row that says so; the benches refuse a machine without an sm_90 GPU, and a row
name they do not know (or a constant-time row without --bucket) before any GPU work; the
shape names of benchmarks.cuda_decode; benchmarks.sustained's table and plot."""

import pytest
import torch

from benchmarks import cuda_decode, cuda_prefill, cuda_runs, sustained

REF = torch.ones(4, 2, 8)


def _row():
    return dict(variant="v", us=None, rel_err=None)


def _fns(out):
    return [lambda: out, lambda: out]


def test_right_output_is_timed_and_returned():
    row, timed = _row(), []
    o = cuda_runs.check_and_time(row, _fns(REF + 1e-4), REF, lambda f: timed.append(f) or 0.25)
    assert row["us"] == 250.0 and row["rel_err"] < 1e-3 and "error" not in row
    assert len(timed) == 1 and torch.equal(o, REF + 1e-4)


def test_wrong_output_is_not_timed():
    row = _row()
    o = cuda_runs.check_and_time(row, _fns(REF * 2), REF, lambda f: pytest.fail("timed a wrong result"))
    assert o is None and row["us"] is None and row["error"] == "wrong result"
    nan = cuda_runs.check_and_time(_row(), _fns(torch.full_like(REF, float("nan"))), REF, lambda f: 1.0)
    assert nan is None


def test_rows_checked_and_missing_anchor():
    row = _row()
    padded = torch.cat([REF, torch.full((3, 2, 8), float("nan"))])  # rows past the step's are not checked
    o = cuda_runs.check_and_time(row, _fns(padded), REF, lambda f: 0.1, rows_checked=4)
    assert o.shape == REF.shape and row["us"] == pytest.approx(100.0)
    row = _row()
    assert cuda_runs.check_and_time(row, [None, None], REF, lambda f: 1.0) is None
    assert row["error"] == "not available" and row["us"] is None


def test_fa3_ratios():
    rows = [dict(variant="fa3", us=10.0), dict(variant="x", us=20.0), dict(variant="y", us=None)]
    cuda_runs.fa3_ratios(rows)
    assert [r["fa3_over"] for r in rows] == [1.0, 0.5, None]
    rows = [dict(variant="x", us=20.0)]
    cuda_runs.fa3_ratios(rows)
    assert rows[0]["fa3_over"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("bench,argv", [(cuda_decode, ["--probe"]), (cuda_prefill, ["--probe"]),
                                        (sustained, ["--shapes", "B1-4k"])])
def test_benches_refuse_without_gpu(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and "needs an sm_90 GPU (no CUDA device)" in capsys.readouterr().err


@pytest.mark.parametrize("bench,argv,why", [
    # the rows of the Triton-bit compat binaries and of issue 30's experiment library are gone
    (cuda_prefill, ["--variants", "fa3,cuda_compat"], "unknown variant(s) ['cuda_compat']; accepted: fa3, "
                                                      "triton_off, cuda_v2, triton_strict, cuda_v2_ct"),
    (cuda_prefill, ["--variants", "exp_v2"], "unknown variant(s) ['exp_v2']"),
    (cuda_prefill, ["--variants", "cuda_v2_ct"], "variant(s) ['cuda_v2_ct'] without --bucket; accepted: "
                                                 "triton_strict, cuda_v2_ct with --bucket L"),
    (cuda_prefill, ["--bucket", "2048", "--shapes", "causal-4k"], "--bucket 2048 is shorter than shape causal-4k"),
    (cuda_decode, ["--variants", "fa3,exp_v2,cuda_p2x2_pv_ef"], "unknown variant(s) ['exp_v2', 'cuda_p2x2_pv_ef']; "
                                                                "accepted: fa3, triton_off, cuda_<auto|v2>"),
    (cuda_decode, ["--variants", "cuda_auto:deal0,cuda_auto:dealx"], "unknown variant(s) ['cuda_auto:deal0', "
                                                                     "'cuda_auto:dealx']"),
    (cuda_decode, ["--variants", "cuda_ct_v2"], "variant(s) ['cuda_ct_v2'] without --bucket"),
])
def test_benches_refuse_unknown_rows_before_the_gpu(bench, argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_bench_default_and_ct_rows_are_known():
    assert all(n in cuda_prefill.ROWS for n in cuda_prefill.DEFAULT_VARIANTS.split(","))
    assert cuda_prefill.CT_ROWS == {"triton_strict": "triton_off", "cuda_v2_ct": "cuda_v2"}
    names = cuda_decode.DEFAULT_VARIANTS.split(",")
    assert names == ["fa3", "triton_off", "cuda_auto", "cuda_v2"] and all(map(cuda_decode._known, names))
    assert all(map(cuda_decode._known, ["triton_strict", "cuda_ct_v2", "cuda_ct_auto", "cuda_v2:spp2",
                                        "cuda_auto:lpt"]))
    assert not any(map(cuda_decode._known, ["cuda_ct_v2:spp2", "cuda_v2:fast", "cuda_m2x3_pv_ef"]))


def test_heads_option_sets_counts_size_and_scale(monkeypatch):
    """--heads "H,HKV[,D]" (both benches: the decode bench reads the prefill module's values): a third
    value sets the head size and the scale, which the decode bench's bandwidth counts; bad specs refuse."""
    import argparse

    for name in ("H", "HKV", "D", "SCALE"):
        monkeypatch.setattr(cuda_prefill, name, getattr(cuda_prefill, name))  # restored after the test
    ap = argparse.ArgumentParser()
    cuda_prefill.set_heads(ap, "16,8,256")
    assert (cuda_prefill.H, cuda_prefill.HKV, cuda_prefill.D) == (16, 8, 256) and cuda_prefill.SCALE == 256 ** -0.5
    assert cuda_decode.kv_bytes([(1, 1000)]) == 1000 * 8 * 256 * 2 * 2
    cuda_prefill.set_heads(ap, "28,4")  # two values keep the head size
    assert (cuda_prefill.H, cuda_prefill.HKV, cuda_prefill.D) == (28, 4, 256)
    for bad in ("16,8,100", "16,5", "16", "a,b", "16,8,256,1"):
        with pytest.raises(SystemExit):
            cuda_prefill.set_heads(ap, bad)


def test_bits_mark_flags_only_a_difference():
    assert cuda_prefill.bits_mark(dict(variant="cuda_v2", bits_equal_decode=True)) == ""
    assert cuda_prefill.bits_mark(dict(variant="cuda_v2_ct", bits_equal_off=False)) == " [BITS]"
    assert cuda_prefill.bits_mark(dict(variant="fa3")) == ""
    assert cuda_decode.bits_mark(dict(variant="cuda_v2", bits_equal_prefill=False)) == " [BITS]"
    assert cuda_decode.bits_mark(dict(variant="cuda_ct_v2", bits_equal_off=True)) == ""


def test_decode_shape_names():
    assert cuda_decode._shape("B4-16k") == (4, 16384, [(1, 16384)] * 4)
    B, ctx, reqs = cuda_decode._shape("B8-r4k-w128k")
    assert (B, ctx, len(reqs)) == (8, 4096, 8) and all(512 <= s <= 4096 for _, s in reqs)
    assert cuda_decode._shape("B8-r4k-w128k") == cuda_decode._shape("B8-r4k-w128k")  # seeded
    assert cuda_decode._table_width("B1-4k") == 0
    assert cuda_decode._table_width("B1-4k-w128k") == 128 * 1024 // 16  # columns of 16-token pages
    # -q<n>: n query tokens per request (a step between decode and prefill), with or without -w
    assert cuda_decode._shape("B16-4k-q4") == (16, 4096, [(4, 4096)] * 16)
    B, ctx, reqs = cuda_decode._shape("B8-r4k-q8-w128k")
    assert all(q == 8 and 512 <= s <= 4096 for q, s in reqs)
    assert [s for _, s in reqs] == [s for _, s in cuda_decode._shape("B8-r4k-w128k")[2]]  # the same lengths
    assert cuda_decode._table_width("B8-r4k-q8-w128k") == 128 * 1024 // 16


def test_sustained_table_and_plot(tmp_path):
    rows = [dict(shape="B16-32k", target="fa3", burst_us=490.0, sustained_us=513.0, sustained_sm_mhz_median=1440.0,
                 sustained_sm_mhz_p10=1110.0, sustained_power_w_median=695.0),
            dict(shape="B16-32k", target="dhp", burst_us=507.0, sustained_us=514.0, burst_vs_fa3=490 / 507,
                 sustained_vs_fa3=513 / 514, sustained_sm_mhz_median=1785.0, sustained_sm_mhz_p10=1425.0,
                 sustained_power_w_median=696.0),
            dict(shape="B1-4k", target="fa3", error="not available")]
    md = sustained.table(rows).splitlines()
    assert len(md) == 2 + len(rows)
    assert md[3].split(" | ")[1:] == ["dhp", "507.0", "514.0", "1785, 1425", "696", "0.966", "0.998 |"]
    assert md[4].endswith("not available") and "| - | - |" in md[4]
    why = sustained.plot(rows, str(tmp_path / "s.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in why and not (tmp_path / "s.png").exists()
    else:
        assert why is None and (tmp_path / "s.png").stat().st_size > 1000
        assert "no DHP row" in sustained.plot(rows[:1], str(tmp_path / "t.png"))


def test_decode_rows_name_the_dealing():
    """``cuda_<variant>:...`` rows of benchmarks.cuda_decode: the keywords each passes to decode_sm90."""
    v = cuda_decode._cuda_variant
    assert v("cuda_auto") == ("auto", dict(order=None))
    assert v("cuda_auto:fixed") == ("auto", dict(deal=0))
    assert v("cuda_auto:deal264") == ("auto", dict(deal=264, deal_cost=None))
    assert v("cuda_auto:deal264r") == ("auto", dict(deal=264, deal_cost=None, deal_reuse=True))
    assert v("cuda_auto:deal264c0.5r") == ("auto", dict(deal=264, deal_cost=0.5, deal_reuse=True))
    assert v("cuda_auto:deal528c-1") == ("auto", dict(deal=528, deal_cost=-1.0))
    assert v("cuda_v2:deal132c0.5") == ("v2", dict(deal=132, deal_cost=0.5))
    assert v("cuda_auto:spp8") == ("auto", dict(spp=8))
    assert v("cuda_auto:fold") == ("auto", dict(mode="fold"))
    assert v("cuda_auto:lpt") == ("auto", dict(order=True))
    for bad in ("cuda_auto:deal0", "cuda_auto:deal", "cuda_auto:deal5c", "cuda_x:fixed", "fa3"):
        assert v(bad) is None, bad
