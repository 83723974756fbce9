"""G1 counters tooling on the CPU: the ncu CSV parser on recorded H200 output, the comparison rule,
and the no-GPU exit. The ncu runs themselves happen on the GPU machine."""

import argparse
import os

import pytest

from dhp_backend.audit import counters as C

DATA = os.path.join(os.path.dirname(__file__), "data", "ncu")


def _load(name):
    with open(os.path.join(DATA, name)) as f:
        return C.parse_ncu_csv(f.read())


# docs/results/2026-11-21-h200/README.md, G1 table
RECORDED = {
    "ncu-B16-L4096-len1.csv": {"dram__bytes_read.sum": 298_211_584, "smsp__inst_executed.sum": 39_326_976,
                               "smsp__sass_inst_executed_op_branch.sum": 64_512,
                               "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": 643_392,
                               "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 9_844_416,
                               "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": 1_200_128},
    "ncu-B16-L4096-len4096.csv": {"dram__bytes_read.sum": 297_261_568, "smsp__inst_executed.sum": 39_326_976,
                                  "smsp__sass_inst_executed_op_branch.sum": 64_512},
    "ncu-B64-L4096-len1.csv": {"dram__bytes_read.sum": 1_079_233_280, "smsp__inst_executed.sum": 142_420_416,
                               "smsp__sass_inst_executed_op_branch.sum": 200_928,
                               "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": 2_359_248,
                               "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 36_755_472,
                               "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": 282_624},
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parser_reads_recorded_numbers(name):
    recs = _load(name)
    assert len(recs) == 1
    r = recs[0]
    assert r["name"] == "attention_kernel" and r["block"] == "(128, 1, 1)"
    for metric, value in RECORDED[name].items():
        assert r["metrics"][metric] == value and isinstance(r["metrics"][metric], int), metric


def test_recorded_short_vs_long_passes_on_the_metrics_it_has():
    a, b = _load("ncu-B16-L4096-len1.csv"), _load("ncu-B16-L4096-len4096.csv")
    present = [m for m in C.METRICS if m in a[0]["metrics"]]
    res = C.compare_kernels(a, b, metrics=present)
    assert res["passed"], res
    dram = next(c for c in res["kernels"][0]["checks"] if c["metric"] == C.DRAM_METRIC)
    assert abs(dram["diff"]) == pytest.approx(0.0032, abs=2e-4)
    # the recorded runs did not ask for st requests: missing on both sides fails the full rule
    assert not C.compare_kernels(a, b)["passed"]


def _csv(kernels, noise=True):
    """Synthetic ncu --csv output: several kernels, quoted fields, thousands separators, interleaved logs."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    lines = ["==PROF== Connected to process 1 (/usr/bin/python3)", "app output, with, commas", head]
    for i, (name, metrics) in enumerate(kernels):
        for m, v in metrics.items():
            lines.append(f'"{i}","1","python3","127.0.0.1","{name}","1","7","(128, 1, 1)","(18, 8, 4)","0","9.0",'
                         f'"Command line profiler metrics","{m}","","{v:,}"')
        if noise and i == 0:
            lines.append("==PROF== Disconnected from process 1")
    return "\n".join(lines) + "\n"


def _metrics(scale=1):
    return {m: (1000 + i) * scale for i, m in enumerate(C.METRICS)}


def test_parser_several_kernels_and_last_launch():
    # 3 launches of (attention, merge), the first 2 matching kernels skipped: 4 records remain
    kernels = [("merge_kernel", _metrics()), ("attention_kernel", _metrics(2)), ("merge_kernel", _metrics(3)),
               ("attention_kernel", _metrics(4)), ("merge_kernel", _metrics(5))][1:]
    recs = C.parse_ncu_csv(_csv(kernels))
    assert [r["name"] for r in recs] == ["attention_kernel", "merge_kernel", "attention_kernel", "merge_kernel"]
    last = C.last_launch(recs, 3)
    assert [r["name"] for r in last] == ["attention_kernel", "merge_kernel"]
    assert last[1]["metrics"]["dram__bytes_read.sum"] == (1000 + 6) * 5
    assert C.last_launch(recs[:1], 3) == recs[:1]  # one kernel per launch: 1 record after 2 skipped
    with pytest.raises(ValueError):
        C.last_launch(recs[:2], 3)  # 2 + 2 skipped does not divide into 3 launches
    assert C.parse_ncu_csv("==ERROR== no kernels were profiled\n") == []


def test_parse_value_units_and_separators():
    assert C.parse_value("298,211,584", "byte") == 298211584
    assert C.parse_value("298.21", "Mbyte") == 298210000
    assert C.parse_value("1 200 128", "sector") == 1200128
    assert C.parse_value("n/a") is None


def _kernel(name, **over):
    m = _metrics()
    m.update(over)
    return {"name": name, "block": "(128, 1, 1)", "grid": "(18, 8, 4)", "metrics": m}


def test_rule_on_synthetic_records():
    dram = 1_000_000_000
    base = [_kernel("attention_kernel", **{C.DRAM_METRIC: dram}), _kernel("merge_kernel")]
    assert C.compare_kernels(base, [dict(k) for k in base])["passed"]
    inst = _metrics()["smsp__inst_executed.sum"]
    one_off = [base[0], _kernel("merge_kernel", **{"smsp__inst_executed.sum": inst + 1})]
    res = C.compare_kernels(base, one_off)
    assert not res["passed"]
    assert [k["passed"] for k in res["kernels"]] == [True, False]  # per kernel: only the merge kernel differs
    over = [_kernel("attention_kernel", **{C.DRAM_METRIC: int(dram * 1.015)}), base[1]]
    assert not C.compare_kernels(base, over)["passed"]
    near = [_kernel("attention_kernel", **{C.DRAM_METRIC: int(dram * 1.003)}), base[1]]
    assert C.compare_kernels(base, near)["passed"]
    assert not C.compare_kernels(base, base[:1])["passed"]  # a kernel missing
    moved = [dict(base[0], grid="(19, 8, 4)"), base[1]]
    assert not C.compare_kernels(base, moved)["passed"]  # the grid is public: it must not move


def test_shapes_and_pairs():
    s = C.parse_shape("B4-L4096-q64")
    assert (s.batch, s.bucket, s.q_len) == (4, 4096, 64)
    assert C.parse_shape(C.shape_spec(s)) == s
    nc = C.parse_shape("B2-L512-h8x2-d64-float16-noncausal-off")
    assert C.parse_shape(C.shape_spec(nc)) == nc and not nc.causal
    with pytest.raises(ValueError):
        C.parse_shape("B4-X9")
    assert [p[2] for p in C.parse_pairs("all")] == [True, True, False, False, False]
    assert C.parse_pairs("short:long,random:zeros") == [("short", "long", True), ("random", "zeros", False)]
    cmd = C.ncu_command("ncu", "B16-L4096-q1", "short", 3, "/tmp/x.json")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "--launch-skip" in cmd
    assert cmd[cmd.index("--launch-skip") + 1] == "2" and cmd[cmd.index("--kernel-name") + 1] == C.KERNEL_FILTER


def _args(**kw):
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_run_without_gpu_exits_2_with_a_message(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert C.run(_args()) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert C.run(_args(ncu="ncu-not-installed-here")) == 2
    assert "not on PATH" in capsys.readouterr().err
