"""DHP's configuration is checked where vLLM parses the engine arguments (issue 34).

A malformed DHP setting stops the engine before any engine process starts, with
one DHP error, naming the bad value and the accepted ones, as the last line.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("vllm")

from dhp_backend.vllm import compat, startup_check  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_config(backend="CUSTOM", additional=None, cache_dtype="auto"):
    enum_cls = compat._registry().AttentionBackendEnum
    return types.SimpleNamespace(
        attention_config=types.SimpleNamespace(backend=None if backend is None else enum_cls[backend]),
        additional_config=additional or {}, cache_config=types.SimpleNamespace(cache_dtype=cache_dtype))


@pytest.fixture(autouse=True)
def _registered():
    from dhp_backend import plugin

    plugin.register()


@pytest.mark.parametrize("additional,needle", [
    ({"dhp": {"policy": "strcit"}}, "unknown DHP policy 'strcit'; accepted: 'strict', 'request', 'off'"),
    ({"DHP": {"policy": "strict"}}, "section 'DHP' is not DHP's; accepted: the lower-case key 'dhp'"),
    ({"dhp": {"allow_fallback": "nope"}}, "got 'nope'; accepted: a boolean"),
    ({"dhp": "off"}, "got 'off'; accepted: a JSON object"),
])
def test_bad_settings_stop_the_engine_with_a_dhp_error(additional, needle):
    with pytest.raises(startup_check.DHPConfigError, match="^DHP configuration: ") as info:
        startup_check.check(fake_config(additional=additional))
    assert needle in str(info.value)


def _platform(monkeypatch, cpu: bool):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: cpu)


def test_deterministic_on_a_gpu_without_vllms_mode_refuses_with_the_command_to_run(monkeypatch):
    """vLLM reads VLLM_BATCH_INVARIANT before plugins load: the engine must be restarted with it."""
    _platform(monkeypatch, cpu=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(sys, "argv", ["/opt/bin/vllm", "serve", "m", "--additional-config",
                                      '{"dhp": {"deterministic": true}}'])
    with pytest.raises(startup_check.DHPConfigError, match="^DHP configuration: deterministic=true needs") as info:
        startup_check.check(fake_config(additional={"dhp": {"deterministic": True}}))
    assert ("Start it as: VLLM_BATCH_INVARIANT=1 /opt/bin/vllm serve m --additional-config "
            "'{\"dhp\": {\"deterministic\": true}}'") in str(info.value)
    monkeypatch.setenv("DHP_DETERMINISTIC", "on")  # the environment fallback asks for the same
    with pytest.raises(startup_check.DHPConfigError, match="needs vLLM's batch-invariant mode"):
        startup_check.check(fake_config())
    monkeypatch.delenv("DHP_DETERMINISTIC")
    assert startup_check.check(fake_config()).deterministic is False  # off by default: nothing required


def _report_of(config) -> str:
    """The start-up block an engine process of this configuration prints (dhp_backend.vllm.report)."""
    from dhp_backend import startup_report
    from dhp_backend.vllm import report

    config.model_config = types.SimpleNamespace(max_model_len=512)
    return startup_report.render(report.build(config, "engine core", {}, {}, None, None, ()))


def test_deterministic_with_vllms_mode_starts_and_says_so(monkeypatch):
    _platform(monkeypatch, cpu=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    config = fake_config(additional={"dhp": {"deterministic": "yes"}})
    cfg = startup_check.check(config)
    assert cfg.deterministic and "deterministic=True" in cfg.describe()
    assert ("  deterministic mode: on: DHP attention + vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)"
            in _report_of(config).splitlines())


def test_deterministic_on_the_cpu_platform(monkeypatch):
    """vLLM's batch-invariant kernels are GPU Triton kernels: on CPU the mode is refused, not required,
    and the engine's start-up report says what deterministic mode covers there."""
    _platform(monkeypatch, cpu=True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(startup_check.DHPConfigError, match="CPU engine fails on its first step"):
        startup_check.check(fake_config(additional={"dhp": {"deterministic": True}}))
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    config = fake_config(additional={"dhp": {"deterministic": True}})
    assert startup_check.check(config).deterministic
    assert ("  deterministic mode: on, DHP attention only: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) "
            "does not run on CPUs") in _report_of(config)


def test_fp8_kv_cache_is_refused_up_front():
    with pytest.raises(startup_check.DHPConfigError, match=r"--kv-cache-dtype 'fp8'.*accepted: auto, float16, "
                                                          r"bfloat16"):
        startup_check.check(fake_config(cache_dtype="fp8"))


def test_other_backends_are_left_alone():
    assert startup_check.check(fake_config(backend="FLASH_ATTN", additional={"dhp": {"policy": "x"}})) is None
    assert startup_check.check(fake_config(backend=None, additional={"DHP": 1})) is None


def test_cpu_engine_without_the_override_warns_once_that_dhp_will_not_run(monkeypatch, caplog):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU platform's behaviour")
    monkeypatch.delenv("DHP_OVERRIDE_CPU_ATTN", raising=False)
    monkeypatch.setitem(compat._registry()._ATTN_OVERRIDES, compat._registry().AttentionBackendEnum.CPU_ATTN, None)
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        cfg = startup_check.check(fake_config())
    assert cfg is not None
    msgs = [r.getMessage() for r in caplog.records if r.name == "dhp_backend"]
    assert any("will NOT run DHP" in m and "DHP_OVERRIDE_CPU_ATTN=1" in m for m in msgs), msgs


def test_a_misspelled_policy_is_the_last_line_an_engine_prints(tmp_path):
    script = (
        "from integration.tiny_llama import build\n"
        f"d = build({str(tmp_path)!r}, seed=0)\n"
        "from vllm import LLM\n"
        "LLM(str(d), attention_backend='DHP', max_model_len=256,\n"
        "    additional_config={'dhp': {'policy': 'strcit'}})\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "DHPConfigError: DHP configuration: " in last and "'strcit'" in last, proc.stderr[-3000:]
    assert "accepted: 'strict', 'request', 'off'" in last
    assert "Engine core initialization failed" not in proc.stderr  # stopped before any engine started
