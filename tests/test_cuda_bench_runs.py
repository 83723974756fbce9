"""benchmarks.cuda_runs (what the csrc kernels' benches share), on CPU tensors: a row is
timed only when its output is right; a missing anchor
is a row that says so; the benches refuse a machine without an sm_90 GPU; the
shape names of benchmarks.cuda_decode; benchmarks.sustained's table and plot; benchmarks.contract_v2's
refusals and its merged report; benchmarks.decode_v2's variant code and its use of the product launcher."""

import pytest
import torch

import json

from benchmarks import contract_v2, cuda_decode, cuda_prefill, cuda_runs, decode_v2, sustained

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
                                        (sustained, ["--shapes", "B1-4k"]), (contract_v2, ["--probe"]),
                                        (decode_v2, ["--probe"])])
def test_benches_refuse_without_gpu(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and "needs an sm_90 GPU (no CUDA device)" in capsys.readouterr().err


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


def test_contract_v2_refuses_bad_variant_and_dtype():
    st = dict(q=torch.zeros(4, 32, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="variant 'nope'; accepted: compat, plain, v2_fold512"):
        contract_v2.v2_fn(st, True, "nope")
    with pytest.raises(ValueError, match="dtype torch.float16; accepted: torch.bfloat16"):
        contract_v2.v2_fn(st, True, "v2_fold512")
    with pytest.raises(SystemExit):
        contract_v2.main(["--variants", "fa3,warp_speed"])


def _run(tmp_path, name, commit, rows):
    path = tmp_path / name
    path.write_text(json.dumps(dict(device="NVIDIA H200", torch="x", commit=commit, command="contract_v2.py --out o",
                                    rows=rows)))
    return str(path)


def test_contract_v2_report_merges_runs(tmp_path):
    def row(variant, us, fa3_over, compat_over, shape="causal-4k"):
        return dict(shape=shape, heads="32,8", variant=variant, us=us, fa3_over=fa3_over, compat_over=compat_over)
    first = _run(tmp_path, "a.json", "aaa", [row("fa3", 100.0, 1.0, 1.6), row("compat", 160.0, 0.625, 1.0),
                                             row("v2_fold512", 150.0, 0.667, 1.067)])
    second = _run(tmp_path, "b.json", "bbb", [row("fa3", 101.0, 1.0, 1.6), row("compat", 161.0, 0.627, 1.0),
                                              row("v2_fold512", 140.0, 0.721, 1.15),
                                              dict(row("plain", None, None, None), error="wrong result")])
    lines = contract_v2.report([first, second], str(tmp_path / "out"))
    assert lines[0] == "| variant | causal-4k (32,8) | run |"
    v2 = next(x for x in lines if x.startswith("| v2_fold512 |"))
    assert v2 == "| v2_fold512 | 0.721 (1.15) | 2 |"  # the later run's cell, both ratios from that run
    assert not any(x.startswith("| plain |") for x in lines)  # a row without a time is no cell
    md = (tmp_path / "out" / "contract-v2-h200.md").read_text()
    assert "1: commit aaa" in md and "2: commit bbb" in md and "`v2_fold512`: 128-position steps" in md
    merged = json.loads((tmp_path / "out" / "contract-v2-h200.json").read_text())
    assert [r["commit"] for r in merged["runs"]] == ["aaa", "bbb"] and "compat" in merged["about"]
    assert (tmp_path / "out" / "contract-v2-h200.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_v2_code_matches_the_kernel_sources():
    """The v2 consumer's variant code is the product's kPipe options plus the experiment's kV2 bit, read
    from the two .cu files: a renumbering in either would launch another binary."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    product = (root / "csrc" / "decode_sm90.cu").read_text()
    opts = {k: int(v) for k, v in re.findall(r"\b(k[A-Z]\w+) = (\d+)", product)}
    pipe = opts["kPairedV"] | opts["kEvictFirst"] | opts["kMmaSync"] | opts["kMmaPipe"]
    assert re.search(r"constexpr int kPipe = kSync \| kMmaPipe;", product)
    assert re.search(r"constexpr int kSync = kPairedV \| kEvictFirst \| kMmaSync;", product)
    kv2 = int(re.search(r"constexpr int kV2 = (\d+);", decode_v2.SOURCE.read_text()).group(1))
    assert kv2 & pipe == 0 and kv2 not in opts.values()
    assert decode_v2.V2_CODE == 4 + 8 * (pipe | kv2)
    assert "4 + 8 * (kPipe | kV2)" in decode_v2.SOURCE.read_text()


def test_decode_v2_patches_the_product_launcher_only_inside():
    from dhp_backend.ops import cuda_decode as cd

    entry, variants = cd._entry, dict(cd.VARIANTS)
    with decode_v2.experiment_entry() as mod:
        assert mod is cd and cd.VARIANTS[decode_v2.V2] == (decode_v2.V2_CODE, 2)
        assert cd._entry is not entry
    assert cd._entry is entry and cd.VARIANTS == variants and decode_v2.V2 not in cd.VARIANTS
    with pytest.raises(RuntimeError, match="boom"):
        with decode_v2.experiment_entry():
            raise RuntimeError("boom")
    assert cd._entry is entry and cd.VARIANTS == variants
