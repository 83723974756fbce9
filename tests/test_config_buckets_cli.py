"""Configuration sources, length buckets, path dispatch and the `dhp-backend` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dhp_backend.cli import main as cli_main
from dhp_backend.config import DHPConfig, Policy
from dhp_backend.ops import FallbackRefused, ProblemSpec, bucket_for_step, choose_path, next_pow2
from dhp_backend.ops.buckets import next_pow2_tensor


# --- configuration -----------------------------------------------------------------
def test_defaults():
    cfg = DHPConfig.from_sources(None, environ={})
    assert (cfg.policy, cfg.allow_fallback, cfg.path) == (Policy.STRICT, False, "auto")


def test_additional_config_beats_environment():
    env = {"DHP_POLICY": "off", "DHP_ALLOW_FALLBACK": "0", "DHP_PATH": "triton"}
    cfg = DHPConfig.from_sources({"dhp": {"policy": "REQUEST", "allow_fallback": True, "path": "reference"}},
                                 environ=env)
    assert (cfg.policy, cfg.allow_fallback, cfg.path) == (Policy.REQUEST, True, "reference")
    cfg = DHPConfig.from_sources({"other_plugin": {}}, environ=env)
    assert (cfg.policy, cfg.allow_fallback, cfg.path) == (Policy.OFF, False, "triton")
    assert "policy from DHP_POLICY" in cfg.describe()


# Malformed configurations through the parser the engine uses: (additional_config,
# environment, the bad value as the message must show it, what "accepted" must list).
BAD_CONFIGS = [
    ({"dhp": {"policy": "fast"}}, {}, "'fast'", "'strict', 'request', 'off'"),
    ({"dhp": {"policy": 3}}, {}, "3", "'strict'"),
    ({"dhp": {"policy": None}}, {}, "None", "'strict'"),
    ({"dhp": {"policy": "batch"}}, {}, "'batch' was retired", "'request'"),
    ({"dhp": {"polcy": "off"}}, {}, "'polcy' (did you mean 'policy'?)", "policy, allow_fallback, path"),
    ({"dhp": {"allow_fallbak": True}}, {}, "'allow_fallbak' (did you mean 'allow_fallback'?)", "allow_fallback"),
    ({"dhp": {"Policy": "off"}}, {}, "'Policy' (did you mean 'policy'?)", "policy"),
    ({"dhp": "strict"}, {}, "'strict'", "a JSON object"),
    ({"dhp": ["strict"]}, {}, "['strict']", "a JSON object"),
    ({"DHP": {"policy": "strict"}}, {"DHP_POLICY": "off"}, "section 'DHP'", "'dhp'"),
    ({"dhpp": {"policy": "strict"}}, {}, "section 'dhpp'", "'dhp'"),
    ({"Dhp": {}}, {}, "section 'Dhp'", "'dhp'"),
    ("strict", {}, "'strict'", "a JSON object"),
    ({"dhp": {"allow_fallback": "maybe"}}, {}, "'maybe'", "true/false"),
    ({"dhp": {"allow_fallback": 2}}, {}, "2", "the integers 1/0"),
    ({"dhp": {"allow_fallback": 1.0}}, {}, "1.0", "true/false"),
    ({"dhp": {"allow_fallback": []}}, {}, "[]", "true/false"),
    ({"dhp": {"path": "cuda"}}, {}, "'cuda'", "'auto', 'reference', 'triton'"),
    ({"dhp": {"path": 1}}, {}, "1", "'auto'"),
    (None, {"DHP_POLICY": "nope"}, "'nope'", "'strict', 'request', 'off'"),
    (None, {"DHP_ALLOW_FALLBACK": "2"}, "'2'", "yes/no"),
    (None, {"DHP_PATH": "gpu"}, "'gpu'", "'triton'"),
    # a bad value is an error in either source, even when the other one wins
    ({"dhp": {"policy": "strict"}}, {"DHP_POLICY": "garbage"}, "'garbage'", "'off'"),
    ({"dhp": {"path": "auto"}}, {"DHP_PATH": "garbage"}, "'garbage'", "'auto'"),
    ({"dhp": {"allow_fallback": False}}, {"DHP_ALLOW_FALLBACK": "perhaps"}, "'perhaps'", "true/false"),
]


@pytest.mark.parametrize("section,env,bad,accepted", BAD_CONFIGS,
                         ids=[f"{i}-{str(c[0])[:24]}-{str(c[1])[:24]}" for i, c in enumerate(BAD_CONFIGS)])
def test_bad_configuration_is_explained(section, env, bad, accepted):
    with pytest.raises(ValueError) as info:
        DHPConfig.from_sources(section, environ=env)
    msg = str(info.value)
    assert bad in msg, f"the message does not show the bad value {bad}: {msg}"
    assert "accepted: " in msg and accepted in msg.split("accepted: ", 1)[1], msg


@pytest.mark.parametrize("value,expected", [
    (True, True), (False, False), (1, True), (0, False), ("TRUE", True), (" no ", False), ("On", True),
    ("off", False), ("yes", True), ("0", False)])
def test_booleans_are_the_same_set_everywhere(value, expected):
    assert DHPConfig.from_sources({"dhp": {"allow_fallback": value}}, environ={}).allow_fallback is expected
    if isinstance(value, str):
        assert DHPConfig.from_sources(None, environ={"DHP_ALLOW_FALLBACK": value}).allow_fallback is expected


def test_enums_are_case_insensitive_and_overrides_are_reported():
    cfg = DHPConfig.from_sources({"dhp": {"policy": " Request ", "path": "REFERENCE"}},
                                 environ={"DHP_POLICY": "OFF"})
    assert (cfg.policy, cfg.path) == (Policy.REQUEST, "reference")
    assert "policy from additional_config (overrides DHP_POLICY='OFF')" in cfg.describe()
    assert "path from additional_config" in cfg.describe()


# --- buckets -------------------------------------------------------------------------
def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    lens = torch.arange(0, 70_000, dtype=torch.int32)
    expected = torch.tensor([next_pow2(int(n)) for n in lens], dtype=torch.int32)
    assert torch.equal(next_pow2_tensor(lens), expected)


def test_bucket_per_policy():
    lens = [5, 100, 1000]
    assert bucket_for_step("strict", max_model_len=4096, seq_lens=lens) == 4096
    assert bucket_for_step("off", max_model_len=4096, seq_lens=lens) is None
    with pytest.raises(ValueError, match="'batch' was retired"):
        bucket_for_step("batch", max_model_len=4096, seq_lens=lens)
    b = bucket_for_step("request", max_model_len=512, seq_lens=torch.tensor([1, 5, 100, 511], dtype=torch.int32))
    assert b.dtype == torch.int32 and b.tolist() == [1, 8, 128, 512]
    with pytest.raises(ValueError, match="max_model_len"):
        bucket_for_step("strict", max_model_len=0)
    with pytest.raises(ValueError, match="request"):
        bucket_for_step("request", max_model_len=64)


# --- dispatch ----------------------------------------------------------------------------
SPEC_UNCOVERED = ProblemSpec("cuda", "bfloat16", 72, 32, 8, 16, True, (9, 0))


def test_dispatch_refuses_or_falls_back_explicitly():
    # (the reason names whichever coverage check fails first; head size 72 fails some)
    with pytest.raises(FallbackRefused, match="not constant-time.*allow_fallback"):
        choose_path(SPEC_UNCOVERED, "strict")
    with pytest.raises(FallbackRefused):
        choose_path(SPEC_UNCOVERED, "request")
    allowed = choose_path(SPEC_UNCOVERED, "strict", allow_fallback=True)
    assert allowed.name == "reference" and not allowed.constant_time
    assert allowed.reason.startswith("fallback: ") and len(allowed.reason) > len("fallback: ")
    assert choose_path(SPEC_UNCOVERED, "off").name == "reference"
    with pytest.raises(ValueError, match="path='triton'"):
        choose_path(SPEC_UNCOVERED, "off", requested="triton")
    with pytest.raises(ValueError, match="unknown path"):
        choose_path(SPEC_UNCOVERED, "off", requested="fast")


# --- CLI ------------------------------------------------------------------------------------
def test_info_json(capsys):
    assert cli_main(["info", "--json", "--device", "cuda", "--policy", "request", "--head-size", "72"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["versions"]["dhp_backend"] == "0.1.0" and r["versions"]["torch"]
    assert r["config"]["policy"] == "request"
    assert set(r["cases"]) == {"decode", "prefill", "mixed"}
    for case in r["cases"].values():
        assert case["path"] == "REFUSED" and "refuses the reference path (fallback: " in case["why"]
    assert r["cases"]["decode"]["bucket"] == [1024] * 8  # 8 decodes at context 1000 -> next power of two
    assert "allow_fallback" in r["refusal"]


def test_info_text_and_additional_config(capsys):
    assert cli_main(["info", "--device", "cpu", "--additional-config",
                     '{"dhp": {"policy": "off"}}']) == 0
    out = capsys.readouterr().out
    assert "policy=off" in out and "path: reference (NOT constant-time)" in out and "true lengths" in out


def test_info_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["info", "--num-heads", "6", "--num-kv-heads", "4"])
    assert e.value.code == 2
    assert cli_main(["info", "--additional-config", '{"dhp": {"policy": "x"}}']) == 2
    assert "unknown DHP policy" in capsys.readouterr().err
    assert cli_main(["info", "--additional-config", '{dhp']) == 2
    err = capsys.readouterr().err
    assert "--additional-config: not JSON" in err and "accepted: a JSON object" in err and "Traceback" not in err


def test_console_script_installed():
    exe = Path(sys.executable).with_name("dhp-backend")
    if not exe.exists():
        pytest.skip("package not installed in this interpreter's environment")
    res = subprocess.run([str(exe), "info", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("DHP 0.1.0 start-up report (")


def test_request_buckets_written_into_persistent_buffer():
    buf = torch.full((8,), -1, dtype=torch.int32)
    view = bucket_for_step("request", max_model_len=100, seq_lens=torch.tensor([3, 70], dtype=torch.int32),
                           out=buf)
    assert view.data_ptr() == buf.data_ptr() and view.tolist() == [4, 100]
    assert buf[2:].tolist() == [-1] * 6
    with pytest.raises(ValueError, match="out must be"):
        bucket_for_step("request", max_model_len=100, seq_lens=torch.tensor([3, 70], dtype=torch.int32),
                        out=torch.empty(1, dtype=torch.int32))


def test_graph_capture_rules():
    from dhp_backend.ops import PathChoice, graph_capturable

    triton_path = PathChoice("triton", True, "covered")
    reference = PathChoice("reference", False, "fallback")
    assert graph_capturable(triton_path, "strict") and graph_capturable(triton_path, "request")
    assert graph_capturable(triton_path, "off")
    assert not any(graph_capturable(reference, p) for p in ("strict", "request", "off"))


@pytest.mark.parametrize("argv,needle", [
    (["info", "--additional-config", '"strict"'], "additional_config: got 'strict'; accepted: a JSON object"),
    (["info", "--additional-config", '{"dhp": "off"}', "--policy", "off"],
     "additional_config['dhp']: got 'off'; accepted: a JSON object"),
    (["info", "--additional-config", '{"dhp": {"polcy": "off"}}'], "did you mean 'policy'?"),
    (["info", "--additional-config", '{"DHP": {"policy": "off"}}'], "section 'DHP' is not DHP's"),
    (["info", "--additional-config", "{bad json"], "Expecting property name"),
    (["info", "--policy", "batch"], "invalid choice: 'batch' (choose from 'strict', 'request', 'off')"),
    (["info", "--additional-config", '{"dhp": {"policy": "batch"}}'], "'batch' was retired"),
])
def test_info_rejects_malformed_configuration_with_exit_2(argv, needle, capsys):
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_info_example_steps_respect_the_bucket(capsys):
    for mml in (1, 2, 64, 65, 300):
        assert cli_main(["info", "--json", "--max-model-len", str(mml), "--policy", "off"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert all(max(c["seq_lens"]) <= mml for c in r["cases"].values()), (mml, r["cases"])


def test_info_says_when_a_forced_path_cannot_run(monkeypatch, capsys):
    monkeypatch.setenv("DHP_PATH", "triton")
    assert cli_main(["info", "--json", "--device", "cpu", "--policy", "off"]) == 0
    r = json.loads(capsys.readouterr().out)
    for case in r["cases"].values():
        assert case["path"] == "CANNOT RUN" and case["why"].startswith("forced path 'triton' cannot run this case")


@pytest.mark.parametrize("argv,needle", [
    (["audit", "sass", "--all", "--groups", "0"], "--groups: query heads per KV head, integers in [1, 128]"),
    (["audit", "sass", "--all", "--groups", "-2"], "got '-2'"),
    (["audit", "sass", "--all", "--groups", "1,x"], "--groups: comma-separated integers"),
    (["audit", "sass", "--heads", "64", "--dtypes", "fp32"], "--dtypes, --heads select variants for --all"),
    (["audit", "sass", "--groups", "4"], "--groups select variants for --all"),
])
def test_audit_sass_refuses_impossible_or_ignored_options(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_info_names_the_kernel_each_step_runs_on(capsys):
    assert cli_main(["info", "--json", "--device", "cuda", "--policy", "strict"]) == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    from dhp_backend.ops import ProblemSpec, step_kernel

    spec = ProblemSpec("cuda", "bfloat16", 128, 32, 8, 16, True, (9, 0))
    for c in cases.values():
        assert c["path"] == "triton" and c["constant_time"]
        assert c["kernel"] == step_kernel(spec, "strict", c["tokens"], c["requests"])
    assert cli_main(["info", "--json", "--device", "cuda", "--policy", "off"]) == 0
    assert not any(c["constant_time"] for c in json.loads(capsys.readouterr().out)["cases"].values())


def test_every_setting_is_in_the_table_and_env_only_ones_say_so():
    """Settings read before vLLM's config exists come from their variable only; an
    additional_config key naming one says which variable; each is parsed strictly."""
    from dhp_backend import config

    cfg = DHPConfig.from_sources({"dhp": {"check_values": "yes", "trace_file": "/tmp/t.jsonl"}},
                                 environ={"DHP_CUDA_CACHE": "/tmp/c", "DHP_OVERRIDE_CPU_ATTN": "on"})
    assert (cfg.check_values, cfg.trace_file, cfg.cuda_cache, cfg.override_cpu_attn) == (True, "/tmp/t.jsonl",
                                                                                          "/tmp/c", True)
    assert "check_values=True" in cfg.describe() and "cuda_cache from DHP_CUDA_CACHE" in cfg.describe()
    with pytest.raises(ValueError, match=r"key 'cuda_cache' is read before vLLM's configuration exists; "
                                         r"accepted: the environment variable DHP_CUDA_CACHE"):
        DHPConfig.from_sources({"dhp": {"cuda_cache": "/tmp/c"}}, environ={})
    assert config.from_env("override_cpu_attn", {}) is False
    assert config.from_env("override_cpu_attn", {"DHP_OVERRIDE_CPU_ATTN": "1"}) is True
    with pytest.raises(ValueError, match=r"DHP_OVERRIDE_CPU_ATTN: got 'maybe'; accepted: a boolean"):
        config.from_env("override_cpu_attn", {"DHP_OVERRIDE_CPU_ATTN": "maybe"})
    with pytest.raises(ValueError, match=r"DHP_TRACE_FILE: got ' '; accepted: a non-empty path"):
        DHPConfig.from_sources(None, environ={"DHP_TRACE_FILE": " "})
    # a trace file the engine could not open is refused at start-up, not in its first forward pass
    with pytest.raises(ValueError, match=r"DHP_TRACE_FILE: the directory of '/nonexistent-dhp/t.jsonl' "
                                         r"\(/nonexistent-dhp\) does not exist; accepted: a file path"):
        DHPConfig.from_sources(None, environ={"DHP_TRACE_FILE": "/nonexistent-dhp/t.jsonl"})
    with pytest.raises(ValueError, match=r"trace_file'\]: '/tmp' is a directory; accepted: a file path"):
        DHPConfig.from_sources({"dhp": {"trace_file": "/tmp"}}, environ={})
    # no product module reads a DHP_ variable but through the table
    names = {s.env for s in config.SETTINGS}
    root = Path(__file__).resolve().parents[1] / "dhp_backend"
    import re

    for f in root.rglob("*.py"):
        if f.parts[-2] in ("bench", "audit"):
            continue
        for name in re.findall(r"environ(?:\.get)?[\[(]\s*[\"'](DHP_\w+)", f.read_text()):
            assert name in names, f"{f}: {name} is read outside config.SETTINGS"


def test_info_prints_the_plan_of_each_step(capsys):
    assert cli_main(["info", "--json", "--device", "cpu", "--policy", "off", "--head-size", "64"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["config"]) >= {"policy", "check_values", "trace_file", "cuda_cache", "sources"}
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from dhp_backend.ops import plan

        plan.clear_caches()
        assert cli_main(["info", "--json", "--device", "cpu", "--policy", "off", "--head-size", "64"]) == 0
        cases = json.loads(capsys.readouterr().out)["cases"]
        assert cases["decode"]["kernel"] == "triton" and "decode tile" in cases["decode"]["binary"]
        assert cases["decode"]["launch"]["tiling"] == "token" and cases["prefill"]["launch"]["tiling"] == "request"
    finally:
        del os.environ["TRITON_INTERPRET"]
        plan.clear_caches()
