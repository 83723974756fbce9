"""G1 counters tooling on the CPU: the ncu CSV parser on recorded H200 output, the comparison rule,
and the no-GPU exit. The ncu runs themselves happen on the GPU machine."""

import argparse
import json
import os

import pytest

from dhp_backend.audit import counters as C

DATA = os.path.join(os.path.dirname(__file__), "data", "ncu")


def _load(name):
    with open(os.path.join(DATA, name)) as f:
        return C.parse_ncu_csv(f.read())


# docs/results/2026-11-21-h200/README.md (git history), G1 table
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
    assert (s.layout, s.num_blocks, s.blocks) == ("random", 0, 25000)  # a realistic cache by default
    nc = C.parse_shape("B2-L512-h8x2-d64-float16-noncausal-off")
    assert C.parse_shape(C.shape_spec(nc)) == nc and not nc.causal
    ch = C.parse_shape("B16-L32768-q1-request-churned-nb40000")
    assert (ch.policy, ch.layout, ch.blocks) == ("request", "churned", 40000)
    assert C.parse_shape(C.shape_spec(ch)) == ch
    with pytest.raises(ValueError):
        C.parse_shape("B4-X9")
    with pytest.raises(ValueError, match="unknown part 'batch'"):
        C.parse_shape("B4-L4096-batch")  # the retired policy
    pairs = C.parse_pairs("all")
    assert [p[2] for p in pairs] == [True, True, False, False, False, False]
    assert [(a, b) for a, b, g in pairs if g] == [("short", "long"), ("random", "random2")]
    assert {b for _, b, g in pairs if not g} == {"zeros", "constant", "extreme", "skewed"}
    assert C.parse_pairs("short:long,random:zeros") == [("short", "long", True), ("random", "zeros", False)]
    cmd = C.ncu_command("ncu", "B16-L4096-q1", "short", 3, "/tmp/x.json")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "--launch-skip" in cmd
    assert cmd[cmd.index("--launch-skip") + 1] == "2" and cmd[cmd.index("--kernel-name") + 1] == C.KERNEL_FILTER


def test_dram_tolerance_option():
    base = [_kernel("attention_kernel", **{C.DRAM_METRIC: 1_000_000_000})]
    near = [_kernel("attention_kernel", **{C.DRAM_METRIC: 1_004_000_000})]
    far = [_kernel("attention_kernel", **{C.DRAM_METRIC: 1_006_000_000})]
    assert C.compare_kernels(base, far)["passed"]  # within the design's 1 %
    assert C.compare_kernels(base, near, dram_tolerance=0.005)["passed"]
    res = C.compare_kernels(base, far, dram_tolerance=0.005)
    assert not res["passed"]
    assert next(c for c in res["kernels"][0]["checks"] if c["metric"] == C.DRAM_METRIC)["rule"] == "within 0.5 %"
    assert _args().dram_tolerance == C.DRAM_TOLERANCE == 0.01


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


# --- per instruction (the warp-specialised csrc prefill kernel, audit/counters_pc.py) ---------------

# The shape of `ncu --import R --page source --csv --print-source sass` on ncu 2025.3 (H200 run,
# 2026-11-22): a kernel-name line, a header row, one row per SASS instruction (columns cut down).
_SOURCE_CSV = '''==PROF== noise the parser skips
"Kernel Name","void dhp::<unnamed>::prefill_kernel<(bool)1, (int)0>(CUtensorMap_st, dhp::<unnamed>::Params)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed"
"0x7f0000000000","      LDC R1, c[0x0][0x28]","13","{n0}","39936"
"0x7f0000000010","      SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [R8+UR4+0x28000], R5","2","{n1}","0"
"0x7f0000000020","@!P4 BRA 0x7f0000000060","0","{n2}","0"
"0x7f0000000030","      FFMA R2, R3, R4, R5","0","{n3}","0"
"0x7f0000000040","      EXIT","0","{n4}","0"
"0x7f0000000050","      BRA 0x7f0000000050","0","0","0"
"0x7f0000000060","      SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [R8+UR4+0x28000], R5","0","{n6}","0"
"0x7f0000000070","@!P4 BRA 0x7f0000000060","0","{n7}","0"
"0x7f0000000080","      BRA 0x7f0000000030","0","{n8}","0"
"0x7f0000000090","      WARPSYNC.ALL","0","{n9}","0"
"0x7f00000000a0","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8","0","{n9}","0"
"0x7f00000000b0","      PLOP3.LUT P0, PT, PT, PT, UP0, 0x80, 0x0","0","{n9}","0"
"0x7f00000000c0","@!P0 BRA 0x7f0000000090","0","{n9}","0"
"0x7f00000000d0","      YIELD","0","{n10}","0"
'''


def _source(n0=1248, n1=1248, n2=1248, n3=4992, n4=1248, n6=0, n7=0, n8=0, n9=32, n10=5):
    from dhp_backend.audit import counters_pc

    ks = counters_pc.parse_source_csv(_SOURCE_CSV.format(n0=n0, n1=n1, n2=n2, n3=n3, n4=n4, n6=n6, n7=n7, n8=n8,
                                                         n9=n9, n10=n10))
    assert len(ks) == 1 and "prefill_kernel" in ks[0]["kernel"] and len(ks[0]["instrs"]) == 14
    return ks[0]


def test_per_instruction_parser_and_wait_loops():
    from dhp_backend.audit import counters_pc

    k = _source()
    assert k["instrs"][3]["sass"] == "FFMA R2, R3, R4, R5" and k["instrs"][3]["executed"] == 4992
    # branch targets as offsets in the kernel: two processes load it at different addresses
    assert k["instrs"][2]["sass"] == "@!P4 BRA .+0x60"
    moved = counters_pc.parse_source_csv(_SOURCE_CSV.replace("0x7f00000000", "0x7e55555500").format(
        n0=1, n1=1, n2=1, n3=1, n4=1, n6=0, n7=0, n8=0, n9=1, n10=1))[0]
    assert [x["sass"] for x in moved["instrs"]] == [x["sass"] for x in k["instrs"]]
    # the try-wait, its branch, the retry block and its jump back; not the FFMA, EXIT or the trap loop
    sass_ = [x["sass"] for x in k["instrs"]]
    offsets = [x["address"] - k["instrs"][0]["address"] for x in k["instrs"]]
    assert counters_pc.wait_instructions(sass_) == {1, 2, 6, 7, 8, 10, 11, 12}
    # with offsets, whole wait-only loops: the WARPSYNC before setmaxnreg's retry too (a YIELD
    # outside any wait loop stays counted)
    assert counters_pc.wait_instructions(sass_, offsets) == {1, 2, 6, 7, 8, 9, 10, 11, 12}


def test_a_retry_loop_that_reloads_the_phase_is_a_wait_loop():
    """The CT prefill binary's out-of-line mbarrier retry (H200 G1, 2026-11-26): ptxas moves the phase
    into the wait's register inside the loop, so that move runs once per retry, as timing decides; a
    move into any other register, or one outside the loop, still counts."""
    from dhp_backend.audit import counters_pc

    def code(move):
        return ["NOP", move, "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR8+0x28048], R24", "@!P3 BRA .+0x10",
                "BRA .+0x60", "FFMA R2, R3, R4, R5", "IMAD.U32 R7, RZ, RZ, UR18", "EXIT"]

    offsets = [16 * i for i in range(8)]
    assert counters_pc.wait_instructions(code("IMAD.U32 R24, RZ, RZ, UR18"), offsets) == {1, 2, 3, 4}
    assert counters_pc.wait_instructions(code("MOV R24, UR18"), offsets) == {1, 2, 3, 4}
    # not the wait's operand, or not a pure move: the loop is not only a wait, its move counts
    assert 1 not in counters_pc.wait_instructions(code("IMAD.U32 R9, RZ, RZ, UR18"), offsets)
    assert 1 not in counters_pc.wait_instructions(code("IMAD R24, R3, R4, UR18"), offsets)
    assert counters_pc.wait_instructions(code("IMAD.U32 R24, RZ, RZ, UR18")) == {2, 3, 4}  # no offsets: the chain


def test_a_retry_loop_that_recomputes_the_parity_is_a_wait_loop():
    """The head-256 CT prefill binary's consumer wait (H200 G1, 2026-11-27): under register pressure ptxas
    recomputes the parity operand inside the retry loop (``LOP3 R113, R211, 0x1``, ``SHF.L R24, R113,
    0x1f``), so both run once per retry. An op that reads two registers, or writes a register the wait
    does not read, or a loop with other work, still counts."""
    from dhp_backend.audit import counters_pc

    def code(*body):
        return ["NOP", *body, "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R9+URZ+0x28008], R24",
                f"@!P2 BRA .+0x{16:x}", "IMAD.SHL.U32 R118, R14, 0x40, RZ", "EXIT"]

    parity = ("LOP3.LUT R113, R211, 0x1, RZ, 0xc0, !PT", "YIELD", "SHF.L.U32 R24, R113, 0x1f, RZ")
    sass_ = code(*parity)
    offsets = [16 * i for i in range(len(sass_))]
    assert counters_pc.wait_instructions(sass_, offsets) == {1, 2, 3, 4, 5}
    two = code("LOP3.LUT R113, R211, R5, RZ, 0xc0, !PT", "YIELD", "SHF.L.U32 R24, R113, 0x1f, RZ")
    assert 1 not in counters_pc.wait_instructions(two, offsets)  # two sources: the loop counts
    other = code("LOP3.LUT R7, R211, 0x1, RZ, 0xc0, !PT", "YIELD", "SHF.L.U32 R24, R113, 0x1f, RZ")
    assert 1 not in counters_pc.wait_instructions(other, offsets)  # R7 feeds no wait
    work = code("LOP3.LUT R113, R211, 0x1, RZ, 0xc0, !PT", "FFMA R2, R3, R4, R5", "SHF.L.U32 R24, R113, 0x1f, RZ")
    assert not {1, 2, 3} & counters_pc.wait_instructions(work, offsets)
    loopy = code("LOP3.LUT R24, R24, 0x1, RZ, 0xc0, !PT", "YIELD", "NOP")
    assert 1 not in counters_pc.wait_instructions(loopy, offsets)  # reads what it writes: not a recomputation


def test_per_instruction_rule_spins_differ_work_does_not():
    from dhp_backend.audit import counters_pc

    calm, spun = _source(), _source(n6=37, n7=37, n8=5, n9=40)
    r = counters_pc.compare(calm, spun)
    assert r["ok"] and r["wait_executions_diff"] == 79 + 4 * 8 and r["wait_instructions"] == 9
    assert not counters_pc.compare(calm, _source(n10=6))["ok"]  # the YIELD outside the loops counts
    more_work = _source(n3=4993)
    r = counters_pc.compare(calm, more_work)
    assert not r["ok"] and r["differences"][0]["index"] == 3 and "FFMA" in r["why"]
    other = dict(calm, instrs=calm["instrs"][:-1])
    assert not counters_pc.compare(calm, other)["ok"]  # another binary


def test_rule_judges_wait_sensitive_totals_per_instruction():
    inst = _metrics()["smsp__inst_executed.sum"]
    a = [dict(_kernel("prefill_kernel"), per_instruction=_source())]
    b = [dict(_kernel("prefill_kernel", **{"smsp__inst_executed.sum": inst + 79}), per_instruction=_source(
        n6=37, n7=37, n8=5))]
    res = C.compare_kernels(a, b)
    assert res["passed"], res
    checks = {c["metric"]: c for c in res["kernels"][0]["checks"]}
    assert "wait loops" in checks["smsp__inst_executed.sum"]["rule"]
    assert checks["per-instruction executions"]["diff"] == 79
    # the same totals, but an instruction outside the waits moved: fails
    b_bad = [dict(b[0], per_instruction=_source(n3=4993, n6=37, n7=37, n8=4))]
    assert not C.compare_kernels(a, b_bad)["passed"]
    # no per-instruction profile on one side: fails, whatever the totals say
    assert not C.compare_kernels(a, [dict(b[0], per_instruction={"error": "ncu failed"})])["passed"]
    # a memory count is never excused by the waits
    b_mem = [dict(b[0], metrics=dict(b[0]["metrics"], **{"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 1}))]
    assert not C.compare_kernels(a, b_mem)["passed"]


# --- attention features (issue 31) ------------------------------------------------------------------


def test_shapes_with_features():
    plain = C.parse_shapes("B16-L4096-q1,B4-L4096-q64")
    assert [s.key for s in plain] == ["B16-L4096-q1-h32x8-d128-bs16-bfloat16-strict-random",
                                      "B4-L4096-q64-h32x8-d128-bs16-bfloat16-strict-random"]  # keys as before
    shapes = C.parse_shapes("B16-L4096-q1,B4-L4096-q64-request", "window=1024,softcap=50,sinks")
    for s, p in zip(shapes, ("strict", "request")):
        assert (s.sliding_window, s.logits_soft_cap, s.sinks, s.policy) == (1024, 50.0, True, p)
        assert s.features == "window=1024,softcap=50,sinks" and s.key.endswith("-win1024-softcap50-sinks")
        assert C.parse_shape(C.shape_spec(s)) == s  # the child reads the features back from its spec
    # a spec's own geometry is no conflict with --features' attention features; heads= sets a default one
    (g,) = C.parse_shapes("B4-L4096-q64-h16x8-d256", "window=1024")
    assert g.features == "heads=16x8x256,window=1024" and C.parse_shape(C.shape_spec(g)) == g
    (g,) = C.parse_shapes("B4-L4096-q64", "heads=16x8x256")
    assert (g.num_heads, g.num_kv_heads, g.head_size) == (16, 8, 256)
    with pytest.raises(ValueError, match="one of the two"):
        C.parse_shapes("B4-L4096-q64-h16x8-d256", "heads=16x8x256")
    # path=triton: the Triton CONST_TIME kernels forced, with or without features; the spec spells it "triton"
    (t,) = C.parse_shapes("B16-L4096-q1", "path=triton,window=1024")
    assert (t.path, t.sliding_window) == ("triton", 1024) and t.key.endswith("-win1024-triton")
    assert C.parse_shape(C.shape_spec(t)) == t and C.parse_shape("B16-L4096-q1-triton").path == "triton"
    with pytest.raises(ValueError, match="one of the two"):
        C.parse_shapes("B16-L4096-q1-triton", "window=1024")
    own = C.parse_shape("B2-L512-win128-softcap30.5")
    assert (own.sliding_window, own.logits_soft_cap, own.sinks) == (128, 30.5, False)
    for spec, features, why in (("B4-L4096-win1024", "sinks", "one of the two"), ("B4-win0", "", "unknown part"),
                                ("B4-softcap0", "", "unknown part"), ("B4-win64-noncausal", "", "causal"),
                                ("B4", "window=x", "--features: 'window=x'"), ("", "", "no shape")):
        with pytest.raises(ValueError, match=why):
            C.parse_shapes(spec, features)


def test_run_refuses_bad_features_with_a_message(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(C.shutil, "which", lambda name: "/usr/bin/ncu")
    assert C.run(_args(features="sinks,window")) == 2
    err = capsys.readouterr().err
    assert "audit counters: --features: 'window'" in err and "accepted: " in err


def test_gate_rows_carry_features(tmp_path, monkeypatch):
    """`gate` with ncu faked: each pair's row names its features, the tables show them and the kernel the
    child ran on."""
    import torch

    kernels = [_kernel("attention_kernel", **{C.DRAM_METRIC: 1_000_000})]
    seen = []

    def profile(ncu, shape, cls, launches, timeout):
        seen.append(shape)
        return {"kernels": kernels, "seconds": 1.0, "profiled_kernels": 1,
                "child": {"path": "triton", "kernel": "triton", "features": shape.features}}

    monkeypatch.setattr(C, "profile", profile)
    monkeypatch.setattr(C, "versions", lambda ncu=None: {"commit": "abc1234"})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    s = C.gate(_args(shapes="B16-L4096-q1", features="window=1024", pairs="gating", report_dir=str(tmp_path)),
               progress=lambda m: None)
    assert s["passed"] and {sh.sliding_window for sh in seen} == {1024}
    assert [(r["features"], r["a"], r["b"]) for r in s["pairs"]] == [("window=1024", "short", "long"),
                                                                     ("window=1024", "random", "random2")]
    md = open(s["reports"][0]).read()
    assert "| shape | features | pair |" in md and "-win1024 | window=1024 | short vs long |" in md
    assert "| path | kernel |" in md and "| triton | triton |" in md
    plain = C.gate(_args(shapes="B16-L4096-q1", pairs="gating"), progress=lambda m: None)
    assert {r["features"] for r in plain["pairs"]} == {""}


def test_a_cut_run_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
    """The report is written after every shape: a run the device's time limit stops in its second shape
    leaves the first one's pairs, marked not complete (never PASS)."""
    import torch

    kernels = [_kernel("attention_kernel", **{C.DRAM_METRIC: 1_000_000})]
    calls = []

    def profile(ncu, shape, cls, launches, timeout):
        calls.append(shape.key)
        if len(set(calls)) == 2:
            raise KeyboardInterrupt  # the device's time limit, say
        return {"kernels": kernels, "seconds": 1.0, "profiled_kernels": 1, "child": {"path": "triton"}}

    monkeypatch.setattr(C, "profile", profile)
    monkeypatch.setattr(C, "versions", lambda ncu=None: {"commit": "abc1234"})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(KeyboardInterrupt):
        C.gate(_args(shapes="B16-L4096-q1,B4-L4096-q64", pairs="gating", report_dir=str(tmp_path)),
               progress=lambda m: None)
    (md,) = tmp_path.glob("*-counters-*.md")
    doc = json.loads(md.with_suffix(".json").read_text())
    assert doc["shapes"] == [calls[0]] and not doc["complete"] and not doc["passed"]
    assert {r["shape"] for r in doc["pairs"]} == {calls[0]} and len(doc["pairs"]) == 2
    assert "**NOT COMPLETE** — 1 of 2 shapes" in md.read_text()
    assert not list(tmp_path.glob("*.partial"))
