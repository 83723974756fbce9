"""`integration/tp_run.py` without a GPU: its arguments, vLLM's split of heads over ranks, the
per-rank log and trace checks (on lines in vLLM 0.24's worker format), the bit comparison and
the report. The engines themselves run on the GPU machine (`scripts/device_run.sh tp2`)."""

from __future__ import annotations

import json

import pytest

from integration import tp_run


# --------------------------------------------------------------------------- heads per rank, arguments

@pytest.mark.parametrize("heads, kv, tp, expected", [
    (16, 8, 2, (8, 4)),    # whole GQA groups on each rank
    (32, 8, 2, (16, 4)),   # Llama-3-8B
    (8, 1, 2, (4, 1)),     # MQA: the one KV head replicated on both ranks
    (16, 2, 4, (4, 1)),    # 2 KV heads over 4 ranks: each held by 2 ranks
    (64, 8, 8, (8, 1)),
])
def test_heads_per_rank_follows_vllms_split(heads, kv, tp, expected):
    assert tp_run.heads_per_rank(heads, kv, tp) == expected


@pytest.mark.parametrize("heads, kv, tp, message", [
    (12, 4, 8, "12 query heads do not split over 8 ranks"),
    (16, 6, 4, "6 KV heads over 4 ranks"),   # more KV heads than ranks, not a multiple
    (16, 3, 4, "3 KV heads over 4 ranks"),   # fewer, not a divisor: no even replication
    (16, 8, 0, "tensor parallel size 0"),
])
def test_heads_per_rank_refuses_what_vllm_cannot_split(heads, kv, tp, message):
    with pytest.raises(tp_run.ConfigError, match=message):
        tp_run.heads_per_rank(heads, kv, tp)


def test_parse_args_defaults_and_order():
    a = tp_run.parse_args(["--out", "x"])
    assert a.parts == list(tp_run.PARTS) and a.tp == 2 and a.throughput_model == "llama3-8b"
    assert a.time_budget_s < 8 * 60  # the whole script inside the 8 minutes of one device call's GPU time
    assert tp_run.parse_args(["--out", "x", "--parts", "tp1, thr,gen"]).parts == ["gen", "thr", "tp1"]


@pytest.mark.parametrize("argv, message", [
    (["--parts", "gen,serve"], "unknown part 'serve'; accepted: gen, fa3, det, thr, tp1"),
    (["--parts", ","], "none named"),
    (["--tp", "1"], "--tp 1; accepted: an integer >= 2"),
    (["--tp", "3"], "checkpoint kv8: 16 query heads do not split over 3 ranks"),
    (["--throughput-model", "llama3-70b"], "--throughput-model 'llama3-70b'; accepted: llama3-8b, tiny"),
    (["--time-budget-s", "0"], "--time-budget-s 0.0"),
])
def test_bad_arguments_name_what_is_accepted(argv, message, capsys):
    with pytest.raises(tp_run.ConfigError) as exc:
        tp_run.parse_args(["--out", "x", *argv])
    assert message in str(exc.value)
    assert tp_run.main(["--out", "x", *argv]) == 2
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- per-rank logs and traces

def _worker(rank, pid, level, where, msg):
    # vLLM 0.24: utils/system_utils._add_prefix + logger._FORMAT
    return f"({'Worker_TP%d' % rank} pid={pid}) {level} 11-26 10:00:0{rank} [{where}] {msg}"


# A worker's start-up report as vLLM 0.24 prints it at TP 2 (2 x H200, 2026-11-26), one line per record.
STEPS = {"decode": "cuda_decode_ct: csrc/decode_sm90.cu, p2x2_pv_ef (constant-time walk); found in the build cache",
         "prefill": "cuda_prefill_ct: csrc/prefill_sm90.cu, compat_ct binary; found in the build cache",
         "mixed": "cuda_prefill_ct: csrc/prefill_sm90.cu, compat_ct binary; found in the build cache"}


def _report(rank, pid, policy, steps):
    body = [f"DHP 0.1.0 start-up report (vLLM 0.24; pid {pid}, worker on cuda:{rank})",
            f"  policy: {policy}; bucket L = max_model_len = 512 (timing reveals only the step geometry)",
            "  2 layers: 8 query heads / 4 KV heads, head size 128, block size 16, bfloat16 on cuda (sm_90)",
            *(f"    {kind} steps:   {what}" for kind, what in steps.items()),
            "  KV reservation and capacity: in the engine core's block (its scheduler reserves)"]
    return [_worker(rank, pid, "WARNING", "report.py:99", line) for line in body]


def _log(policy="strict", ranks=(0, 1), reports=1, steps=None):
    lines = ["INFO 11-26 10:00:00 [llm_engine.py:1] front end line",
             "(EngineCore pid=10) WARNING 11-26 10:00:00 [report.py:99] DHP 0.1.0 start-up report (vLLM 0.24; "
             "pid 10, engine core)",
             "(EngineCore pid=10) WARNING 11-26 10:00:00 [report.py:99]   policy: strict; bucket L = ..."]
    for r in ranks:
        pid = 100 + r
        lines.append(_worker(r, pid, "INFO", "parallel_state.py:1", "rank init"))
        lines.append(_worker(r, pid, "WARNING", "cuda_build.py:160", "DHP: built csrc/prefill_sm90.cu in 6.3 s"))
        for _ in range(reports):
            lines += _report(r, pid, policy, (steps or {}).get(r, STEPS))
        lines.append(_worker(r, pid, "INFO", "jit_monitor.py:60", "Kernel JIT monitor activated"))
    return "\n".join(lines) + "\n"


def test_rank_logs_reads_each_workers_dhp_lines():
    ranks = tp_run.rank_logs(_log().replace("(Worker_TP1", "\x1b[36m(Worker_TP1").replace("pid=101)", "pid=101)\x1b[0m"))
    assert sorted(ranks) == [0, 1]
    assert ranks[1]["pids"] == {101}
    assert ranks[0]["dhp"] == ["DHP: built csrc/prefill_sm90.cu in 6.3 s",
                               "DHP 0.1.0 start-up report (vLLM 0.24; pid 100, worker on cuda:0)"]  # prefix gone
    assert [len(b) for b in ranks[1]["blocks"]] == [7]  # the engine core's block belongs to no rank
    assert ranks[1]["blocks"][0][1].startswith("policy: strict;")


def test_check_rank_logs_passes_one_start_up_report_per_rank():
    res = tp_run.check_rank_logs(_log("request"), 2, "request")
    assert res["ok"], res["problems"]
    assert res["ranks"][1]["kernels"] == ["decode:cuda_decode_ct", "mixed:cuda_prefill_ct", "prefill:cuda_prefill_ct"]
    assert res["ranks"][0]["pids"] == [100]


def test_check_rank_logs_passes_the_logs_of_a_tp2_run():
    """Two workers' blocks interleaved line by line, as their processes write at once."""
    a, b = _report(0, 100, "off", STEPS), _report(1, 101, "off", STEPS)
    text = "\n".join(x for pair in zip(a, b) for x in pair)
    assert tp_run.check_rank_logs(text, 2, "off")["ok"]


@pytest.mark.parametrize("log, problem", [
    (_log(ranks=(0,)), "worker lines of ranks [0]; expected ranks 0..1"),
    (_log(reports=2), "rank 0: 2 start-up reports; expected 1"),
    (_log(reports=0), "rank 0: 0 start-up reports; expected 1"),
    (_log(policy="off"), "rank 0: start-up report without policy strict"),
    (_log(steps={1: {**STEPS, "decode": "triton: the Triton kernels"}}), "ranks name different kernels"),
    (_log(steps={0: {"decode": STEPS["decode"]}}), "rank 0: start-up report names kernels ['decode:cuda_decode_ct']"),
])
def test_check_rank_logs_names_what_is_wrong(log, problem):
    res = tp_run.check_rank_logs(log, 2, "strict")
    assert not res["ok"]
    assert any(problem in p for p in res["problems"]), res["problems"]


def _trace(heads=((8, 4), (8, 4)), policy="strict", kernels=(("cuda_decode_ct", "triton"),) * 2):
    out = []
    for i, (h, k) in enumerate(zip(heads, kernels)):
        out.append({"pid": 100 + i, "event": "forward", "path": "triton", "policy": policy, "num_heads": h[0],
                    "num_kv_heads": h[1]})
        out += [{"pid": 100 + i, "event": "kernel", "kernel": name, "policy": policy} for name in k]
    return out


def test_check_rank_trace():
    res = tp_run.check_rank_trace(_trace(), 2, (8, 4), "strict", {100: 0, 101: 1})
    assert res["ok"], res["problems"]
    assert res["ranks"]["1"] == {"pid": 101, "kernels": ["cuda_decode_ct", "triton"], "heads": [(8, 4)]}
    cases = [
        (_trace()[:3], "1 processes ran DHP's forward; expected 2"),
        (_trace(heads=((16, 8), (16, 8))), "(query, KV) heads (16, 8); expected (8, 4) per rank"),
        (_trace(policy="off"), "ran policy 'off'; asked for 'strict'"),
        (_trace(kernels=(("triton",), ("cuda_decode_ct", "triton"))), "ranks ran different kernels"),
    ]
    for trace, problem in cases:
        res = tp_run.check_rank_trace(trace, 2, (8, 4), "strict")
        assert not res["ok"] and any(problem in p for p in res["problems"]), (problem, res["problems"])


# --------------------------------------------------------------------------- bits

def test_first_difference_compares_logprob_bits():
    a = [{"token_ids": [5, 6], "logprobs": [-0.5, -1.25]}, {"token_ids": [7], "logprobs": [-2.0]}]
    hexed = [{"token_ids": o["token_ids"], "logprobs": [float(x).hex() for x in o["logprobs"]]} for o in a]
    assert tp_run.first_difference(a, a) is None
    assert tp_run.first_difference(a, hexed) is None  # run_generation's floats against golden_run's float.hex
    one_ulp = [a[0], {"token_ids": [7], "logprobs": [float.fromhex((-2.0).hex()) + 4.440892098500626e-16]}]
    assert one_ulp[1]["logprobs"][0] != -2.0
    msg = tp_run.first_difference(a, one_ulp)
    assert msg.startswith("first difference: prompt '1', step 0") and "1 of 2 prompts differ" in msg
    other = [a[0], {"token_ids": [8], "logprobs": [-2.0]}]
    assert "token 8" in tp_run.first_difference(a, other)
    assert tp_run.first_difference(a, a[:1]) == "1 outputs; the reference has 2"


# --------------------------------------------------------------------------- report

def test_overall_ok():
    ok, bad = tp_run.check("a", "gen", True), tp_run.check("b", "gen", False)
    skipped, report_only = tp_run.check("c", "det", None), tp_run.check("d", "tp1", False, required=False)
    assert tp_run.overall_ok([ok, report_only])
    assert not tp_run.overall_ok([ok, bad])
    assert not tp_run.overall_ok([ok, skipped])  # a required check that did not run is no pass
    assert not tp_run.overall_ok([])


def test_write_report(tmp_path):
    report = {
        "ok": False,
        "header": {"tp": 2, "devices": "2 x NVIDIA H100 80GB HBM3", "vllm_version": "0.24.0", "date": "2026-11-26",
                   "git_commit": "abc1234", "wall_s": 401.0, "time_budget_s": 450, "notes": ["a note"]},
        "checks": [tp_run.check("gen-kv8-strict", "gen", True, "9 requests generated"),
                   tp_run.check("det-same-bits", "det", False, "first difference: prompt '3' | step 2"),
                   tp_run.check("throughput", "thr", None, "skipped: 30 s of the budget left")],
        "runs": {"gen-kv8-strict": {"model": "kv8", "backend": "DHP", "policy": "strict", "tp": 2, "status": "ok",
                                    "wall_s": 38.2, "trace": tp_run.check_rank_trace(_trace(), 2, (8, 4), "strict",
                                                                                     {100: 0, 101: 1}),
                                    "logs": {"ranks": {0: {"pids": {100}}}}}},
        "throughput": {"workload": "llama3-8b", "rows": [
            {"config": "fa3", "status": "ok", "output_tok_per_s": 9000.0, "total_tok_per_s": 40000.0, "ratio": 1.0},
            {"config": "dhp-off", "status": "failed: x", "output_tok_per_s": None, "total_tok_per_s": None,
             "ratio": None}]},
    }
    tp_run.write_report(tmp_path, report)
    back = json.loads((tmp_path / "tp_run.json").read_text())
    assert back["checks"][1]["ok"] is False and back["runs"]["gen-kv8-strict"]["logs"]["ranks"]["0"]["pids"] == [100]
    md = (tmp_path / "tp_run.md").read_text()
    assert "DHP at TP = 2" in md and "2 x NVIDIA H100 80GB HBM3" in md and "**FAILED**" in md
    assert "| gen-kv8-strict | gen | yes | pass |" in md
    assert "| det-same-bits | det | yes | FAIL | first difference: prompt '3' \\| step 2 |" in md
    assert "| throughput | thr | yes | not run |" in md
    assert ("| 38 | 0: [(8, 4)]; 1: [(8, 4)] | 0: cuda_decode_ct,triton; 1: cuda_decode_ct,triton |"
            in md), md
    assert "| fa3 | ok | 9,000 | 40,000 | 1.000 |" in md and "| dhp-off | failed: x | - | - | - |" in md
    assert not (tmp_path / "tp_run.json.tmp").exists()
