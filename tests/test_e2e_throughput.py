"""`integration/e2e_throughput.py`: the end-to-end throughput script.

The speed comparison itself runs on the GPU machine; here the script runs in
CPU mode (vLLM's CPU engine, the tiny dummy-weight Llama, a handful of requests)
to check its plumbing: one process per configuration, the JSON and markdown
report, the output-length check, the DHP trace, the error for an unknown
configuration. No assertion on speed. The ratio, target and grouping logic is
checked on synthetic rows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration import e2e_throughput as et  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None

from engine_process import engine_env, run_in_session  # noqa: E402

ENV = engine_env()

NUM_REQUESTS, OUTPUT_LEN = 4, 8


def run_script(*args, timeout=600):
    return run_in_session([sys.executable, "-m", "integration.e2e_throughput", *args], ENV, timeout=timeout)


# --------------------------------------------------------------------------- CPU engine, end to end

@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    out = tmp_path_factory.mktemp("e2e-throughput") / "report.json"
    # --eager: no torch.compile (saves ~15 s per engine on 2 cores; the GPU run compiles)
    code, text = run_script("--device", "cpu", "--model-config", "tiny", "--configs", "cpu-attn,dhp-off",
                            "--num-requests", str(NUM_REQUESTS), "--min-prompt", "16", "--max-prompt", "48",
                            "--output-len", str(OUTPUT_LEN), "--max-model-len", "256", "--eager",
                            "--out", str(out))
    assert code == 0, text[-4000:]
    return out, json.loads(out.read_text()), text


@pytest.mark.e2e
def test_cpu_run_schema_and_rows(cpu_report):
    out, report, text = cpu_report
    h = report["header"]
    for key in ("date", "device", "device_name", "vllm_version", "torch_version", "git_commit", "workload"):
        assert key in h, key
    assert h["device"] == "cpu" and h["device_name"] == "cpu"
    w = h["workload"]
    assert (w["model_config"], w["num_requests"], w["output_len"], w["max_model_len"], w["dtype"]) == (
        "tiny", NUM_REQUESTS, OUTPUT_LEN, 256, "float32")
    assert "max_model_len = 256" in " ".join(h["notes"])  # the strict bucket is stated

    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["cpu-attn", "dhp-off"]
    for r in rows.values():
        assert set(et.ROW_KEYS) <= set(r), sorted(set(et.ROW_KEYS) - set(r))
        assert r["status"] == "ok", (r["status"], r.get("log"))
        assert r["batch_invariant"] is False
        assert r["output_tok_per_s"] > 0 and r["total_tok_per_s"] > r["output_tok_per_s"]
        assert r["elapsed_s"] > 0 and r["init_s"] > 0
        assert r["num_requests"] == NUM_REQUESTS
        # every request got exactly the requested number of tokens
        assert r["requests_wrong_length"] == 0
        assert r["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        assert isinstance(r["tokens_hash"], str) and len(r["tokens_hash"]) == 16
        assert r["max_model_len"] == 256
    assert (rows["cpu-attn"]["backend"], rows["cpu-attn"]["policy"]) == ("CPU_ATTN", None)
    assert (rows["dhp-off"]["backend"], rows["dhp-off"]["policy"]) == ("DHP", "off")
    assert rows["cpu-attn"]["dhp_path"] is None  # the baseline really is vLLM's own backend
    assert rows["dhp-off"]["dhp_path"] == "reference"  # DHP ran in the engine (its trace says so)
    assert rows["dhp-off"]["dhp_kernels"] is None  # the reference path traces no kernel events
    # the same prompts for every configuration
    assert rows["cpu-attn"]["prompts_hash"] == rows["dhp-off"]["prompts_hash"]
    assert rows["cpu-attn"]["prompt_tokens"] == rows["dhp-off"]["prompt_tokens"]

    ratios = report["ratios"]
    assert ratios["cpu-attn"] == {"baseline": "cpu-attn", "ratio": 1.0}
    assert ratios["dhp-off"]["baseline"] == "cpu-attn" and ratios["dhp-off"]["ratio"] > 0
    assert sorted(c for g in report["hash_groups"] for c in g) == ["cpu-attn", "dhp-off"]

    md = out.with_suffix(".md").read_text()
    assert "| cpu-attn | CPU_ATTN |" in md and "| dhp-off | DHP | off |" in md
    assert "[1/2] cpu-attn: ok" in text and "[2/2] dhp-off: ok" in text


def test_unknown_config_is_refused_with_the_accepted_names(tmp_path):
    out = tmp_path / "r.json"
    code, text = run_script("--device", "cpu", "--model-config", "tiny", "--configs", "cpu-attn,bogus",
                            "--out", str(out), timeout=120)
    assert code != 0
    assert "unknown config 'bogus'" in text, text
    for name in ("cpu-attn", "dhp-off", "dhp-strict", "dhp-request", "dhp-strict-bi"):
        assert name in text.split("accepted:", 1)[1], text
    assert not out.exists()  # refused before any engine started
    code, text = run_script("--device", "cuda", "--configs", "fa3,fa4", "--out", str(out), timeout=120)
    assert code != 0 and "unknown config 'fa4'" in text
    assert all(n in text for n in ("fa3", "flashinfer", "triton", "dhp-strict-bi", "fa3-bi")), text


# --------------------------------------------------------------------------- pure logic

def _row(config, tok_s, status="ok"):
    spec = et.parse_config(config, "cuda")
    return {**spec, "status": status, "output_tok_per_s": tok_s if status == "ok" else None}


def test_compute_ratios_on_synthetic_rows():
    rows = [_row("fa3", 100.0), _row("dhp-off", 97.0), _row("dhp-strict", None, "failed: x"),
            _row("triton", 88.5), _row("fa3-bi", 80.0), _row("dhp-strict-bi", 100.0),
            _row("dhp-off-bi", 96.0, "wrong output length: 1 of 256 requests not 256 tokens")]
    r = et.compute_ratios(rows, "fa3")
    assert r["fa3"] == {"baseline": "fa3", "ratio": 1.0}
    assert r["dhp-off"] == {"baseline": "fa3", "ratio": 0.97}
    assert r["triton"]["ratio"] == 0.885
    assert r["dhp-strict"] == {"baseline": "fa3", "ratio": None}  # failed row: no ratio
    # -bi rows against fa3-bi, and also against plain fa3
    assert r["fa3-bi"] == {"baseline": "fa3-bi", "ratio": 1.0, "vs_fa3": 0.8}
    assert r["dhp-strict-bi"] == {"baseline": "fa3-bi", "ratio": 1.25, "vs_fa3": 1.0}
    assert r["dhp-off-bi"]["ratio"] is None  # not ok (wrong length): never compared

    targets = {t["config"]: t for t in et.check_targets(r)}
    assert targets["dhp-off"]["met"] is True  # 0.97 >= 0.97
    assert targets["dhp-off-bi"]["met"] is None and targets["dhp-off-bi"]["target"] == 1.0
    assert "dhp-strict-bi" not in targets  # issue 30 sets no target for strict in batch-invariant mode
    assert "fa3-bi" not in targets and "triton" not in targets


def test_ratios_without_baseline_row_are_none():
    r = et.compute_ratios([_row("dhp-off", 50.0), _row("dhp-strict-bi", 40.0)], "fa3")
    assert r["dhp-off"]["ratio"] is None
    assert r["dhp-strict-bi"] == {"baseline": "fa3-bi", "ratio": None, "vs_fa3": None}
    cpu = et.compute_ratios([{**et.parse_config("cpu-attn", "cpu"), "status": "ok", "output_tok_per_s": 10.0},
                             {**et.parse_config("dhp-off", "cpu"), "status": "ok", "output_tok_per_s": 5.0}],
                            "cpu-attn")
    assert cpu["dhp-off"] == {"baseline": "cpu-attn", "ratio": 0.5}


def test_path_and_kernels_column():
    """The markdown's DHP column names the kernels the steps ran (traced), not only the path asked for."""
    assert et._path_and_kernels({"dhp_path": "triton", "dhp_kernels": "cuda_decode,cuda_prefill,triton"}) == \
        "triton (cuda_decode,cuda_prefill,triton)"
    assert et._path_and_kernels({"dhp_path": "reference", "dhp_kernels": None}) == "reference"
    assert et._path_and_kernels({}) == "-"


def test_hash_groups():
    rows = [dict(_row("dhp-off-bi", 1.0), tokens_hash="a"), dict(_row("dhp-strict-bi", 1.0), tokens_hash="a"),
            dict(_row("fa3-bi", 1.0), tokens_hash="b"), dict(_row("dhp-request-bi", None, "failed"), tokens_hash="a")]
    assert et.hash_groups(rows) == [["dhp-off-bi", "dhp-strict-bi"], ["fa3-bi"]]


def test_parse_configs():
    assert et.parse_config("dhp-strict-bi", "cuda") == {"config": "dhp-strict-bi", "backend": "DHP",
                                                         "policy": "strict", "batch_invariant": True, "env": {}}
    assert et.parse_config("dhp-strict-triton-bi", "cuda")["env"] == {"DHP_PATH": "triton"}
    assert et.parse_config("flashinfer", "cuda")["backend"] == "FLASHINFER"
    assert et.parse_config("cpu-attn", "cpu")["backend"] == "CPU_ATTN"
    with pytest.raises(et.ConfigError, match="accepted: cpu-attn"):
        et.parse_config("fa3", "cpu")
    with pytest.raises(et.ConfigError, match="named twice"):
        et.parse_configs("fa3,fa3", "cuda")


def test_workload_is_seeded_and_in_range():
    a = et.make_prompts(256, 256, 2048, 128256, seed=0)
    assert a == et.make_prompts(256, 256, 2048, 128256, seed=0)
    assert a != et.make_prompts(256, 256, 2048, 128256, seed=1)
    assert all(256 <= len(p) <= 2048 for p in a) and len(a) == 256
    assert all(10 <= t < 128256 for p in a for t in p)
    assert et.warmup_lengths(8, 256, 2048)[0] == 256 and et.warmup_lengths(8, 256, 2048)[-1] == 2048


def test_child_env(monkeypatch, tmp_path):
    site = tmp_path / "site-flashinfer"
    site.mkdir()
    monkeypatch.setenv("GPU_STACK_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}/root/gpu-stack/site")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DHP_POLICY", "request")
    fi = et.child_env(et.parse_config("flashinfer", "cuda"), "cuda", "/tmp/t")
    assert fi["PYTHONPATH"].split(os.pathsep)[:2] == [str(site), str(ROOT)]
    assert "VLLM_BATCH_INVARIANT" not in fi and "DHP_POLICY" not in fi  # nothing leaks from the caller
    fa = et.child_env(et.parse_config("fa3-bi", "cuda"), "cuda", "/tmp/t", multiprocessing=0)
    assert str(site) not in fa["PYTHONPATH"].split(os.pathsep)  # FlashInfer for its own child only
    assert fa["VLLM_BATCH_INVARIANT"] == "1" and fa["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "DHP_OVERRIDE_CPU_ATTN" not in fa
    dhp_cpu = et.child_env(et.parse_config("dhp-off", "cpu"), "cpu", "/tmp/t")
    assert dhp_cpu["DHP_OVERRIDE_CPU_ATTN"] == "1" and dhp_cpu["DHP_TRACE_FILE"] == "/tmp/t"
    assert "DHP_OVERRIDE_CPU_ATTN" not in et.child_env(et.parse_config("cpu-attn", "cpu"), "cpu", "/tmp/t")
    tri = et.child_env(et.parse_config("dhp-strict-triton-bi", "cuda"), "cuda", "/tmp/t")
    assert tri["DHP_PATH"] == "triton" and tri["VLLM_BATCH_INVARIANT"] == "1"  # strict on the Triton kernels


def test_root_cause_skips_vllm_wrappers():
    log = "\n".join([
        "(MainProcess pid=1) WARNING 11-21 11:51:43 [base.py:380] ValueError: Tokenizer not available",
        "(Worker pid=3) ERROR 11-21 11:51:11 [multiproc_executor.py:953]     raise FallbackRefused(",
        "(Worker pid=3) ERROR 11-21 11:51:11 [multiproc_executor.py:953] "
        "dhp_backend.ops.dispatch.FallbackRefused: DHP policy 'strict' promises constant-time attention",
        "(EngineCore pid=2) ERROR 11-21 11:51:13 [core.py:1510] Exception: WorkerProc initialization failed "
        "due to an exception in a background process. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert et.root_cause(log).startswith("dhp_backend.ops.dispatch.FallbackRefused: DHP policy 'strict'")
    assert et.last_error_line(log).startswith("RuntimeError: Engine core initialization failed")
    assert et.root_cause("just a line\nlast words") == "last words"


def test_model_config_is_llama3_8b_shaped(tmp_path):
    cfg = json.loads((et.write_model("llama3-8b", "bfloat16", tmp_path) / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"], cfg["rope_theta"],
            cfg["max_position_embeddings"], cfg["torch_dtype"]) == (
        4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 8192, "bfloat16")


def test_root_cause_reads_main_process_lines_without_prefix():
    log = ("INFO 11-21 11:51:13 [core.py:1] ok\n"
           "ERROR 11-21 11:51:13 [core.py:2] ValueError: VLLM_BATCH_INVARIANT is not supported by FLASHINFER\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert et.root_cause(log) == "ValueError: VLLM_BATCH_INVARIANT is not supported by FLASHINFER"


def _args(*argv):
    return et.resolve_defaults(et.parser().parse_args(["--device", "cuda", *argv]))


def test_merge_takes_rows_of_the_same_workload_only(tmp_path):
    args = _args("--configs", "dhp-strict,triton")
    earlier = {"header": et.header(args, []), "results": [_row("fa3", 100.0), _row("triton", 1.0)]}
    path = tmp_path / "first.json"
    path.write_text(json.dumps(earlier))
    rows = et.load_merged([str(path)], args, {"dhp-strict", "triton"})
    assert [r["config"] for r in rows] == ["fa3"]  # triton runs again now: the new row wins
    assert rows[0]["source"] == str(path)
    assert et.compute_ratios(rows + [_row("dhp-strict", 80.0)], "fa3")["dhp-strict"]["ratio"] == 0.8
    other = _args("--num-requests", "64")
    with pytest.raises(et.ConfigError, match="num_requests"):
        et.load_merged([str(path)], other, set())


def test_tensor_parallel_size_reaches_the_child_and_keys_the_merge(tmp_path):
    a = _args("--tensor-parallel-size", "2")
    i = a.child_argv.index("--tensor-parallel-size")
    assert a.child_argv[i + 1] == "2"
    assert et.header(a, [])["workload"]["tensor_parallel_size"] == 2
    # an earlier report without the key ran at TP 1: its rows are not this run's workload
    earlier = et.header(_args(), [])
    del earlier["workload"]["tensor_parallel_size"]
    path = tmp_path / "tp1.json"
    path.write_text(json.dumps({"header": earlier, "results": [_row("fa3", 100.0)]}))
    with pytest.raises(et.ConfigError, match="tensor_parallel_size: 1 there, 2 here"):
        et.load_merged([str(path)], a, set())
    assert [r["config"] for r in et.load_merged([str(path)], _args(), set())] == ["fa3"]
    with pytest.raises(et.ConfigError, match="--tensor-parallel-size 0"):
        _args("--tensor-parallel-size", "0")


def test_defaults_fit_the_workload():
    a = _args()
    assert (a.num_requests, a.min_prompt, a.max_prompt, a.output_len, a.dtype) == (256, 256, 2048, 256, "bfloat16")
    assert a.max_model_len == 8192  # the model's own context (the DHP strict bucket), not the smallest that fits
    assert a.configs.split(",")[:4] == ["fa3", "dhp-off", "fa3-bi", "dhp-strict-bi"]
    assert a.configs.split(",")[-1] == "flashinfer"
    with pytest.raises(et.ConfigError, match="exceeds"):
        _args("--max-model-len", "1024")


def test_profile_kernels_runs_the_engine_in_process():
    a = _args("--profile-kernels")
    assert a.multiprocessing == 0 and "--profile-kernels" in a.child_argv
    with pytest.raises(et.ConfigError, match="multiprocessing 0"):
        _args("--profile-kernels", "--multiprocessing", "1")
    with pytest.raises(et.ConfigError, match="needs --device cuda"):
        et.resolve_defaults(et.parser().parse_args(["--device", "cpu", "--profile-kernels"]))


def test_kernel_profile_sums_by_name_and_kind():
    from integration import kernel_profile as kp

    assert kp.kind_of("void vllm::reshape_and_cache_flash_kernel<...>") == "kv_cache_update"
    assert kp.kind_of("void flash::FlashAttnFwdSm90<...>") == "attention"
    assert kp.kind_of("dhp_decode_sm90_kernel") == "attention"
    assert kp.kind_of("attention_kernel") == "attention"
    assert kp.kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kp.kind_of("void vllm::rms_norm_kernel<...>") == "norm_act_rope"
    assert kp.kind_of("void at::native::elementwise_kernel<...>") == "sampling_other"
    events = [("attention_kernel", 0.002), ("nvjet_x", 0.005), ("attention_kernel", 0.001),
              ("void vllm::reshape_and_cache_flash_kernel", 0.0005)]
    s = kp.summarize(events, wall_s=0.01)
    assert s["gpu_busy_s"] == pytest.approx(0.0085)
    assert s["busy_share_of_wall"] == pytest.approx(0.85)
    assert list(s["kinds"]) == ["gemm", "attention", "kv_cache_update"]  # by time, largest first
    assert s["kinds"]["attention"] == {"calls": 2, "seconds": pytest.approx(0.003),
                                       "share_of_busy": pytest.approx(0.003 / 0.0085, abs=1e-4)}
    assert s["top_kernels"][0]["name"] == "nvjet_x" and s["top_kernels"][1]["calls"] == 2
    text = "\n".join(kp.markdown("dhp-off", s))
    assert "| attention | 2 | 0.003 |" in text and "`nvjet_x`" in text
