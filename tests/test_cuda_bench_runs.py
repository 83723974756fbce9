"""bench.cuda_runs (what the csrc kernels' benches share), on CPU tensors: a row is
timed only when its output is right or it is a declared diagnostic; a missing anchor
is a row that says so; both benches refuse a machine without an sm_90 GPU."""

import pytest
import torch

from dhp_backend.bench import cuda_decode, cuda_prefill, cuda_runs

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


def test_diagnostic_is_timed_unchecked_and_never_compared():
    row = _row()
    o = cuda_runs.check_and_time(row, _fns(REF * 7), REF, lambda f: 0.5, diagnostic=True)
    assert o is None and row["us"] == 500.0 and row["error"] == cuda_runs.DIAGNOSTIC and row["rel_err"] > 1


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
@pytest.mark.parametrize("bench", [cuda_decode, cuda_prefill])
def test_benches_refuse_without_gpu(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--probe"])
    assert e.value.code == 2 and "needs an sm_90 GPU (no CUDA device)" in capsys.readouterr().err
