"""The csrc build cache (`ops/cuda_build.py`) with a stand-in nvcc: built once and then cached, a corrupt or
half-written entry rebuilt, two processes building at once make one build, failures and a missing nvcc
reported clearly, `dhp-backend build`, and the engine start-up hook (`ops.plan.prepare_kernels`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dhp_backend.config import Policy
from dhp_backend.ops import cuda_build, cuda_common, plan
from dhp_backend.ops.dispatch import ProblemSpec

REPO = Path(__file__).resolve().parents[1]

# The stand-in nvcc: the `fake_nvcc` fixture (tests/conftest.py).


def test_built_once_then_cached_with_a_log_line(fake_nvcc, caplog):
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        first = cuda_build.build(*cuda_build.PREFILL_LIBRARY)
    assert first.state == "built" and "not in the cache" in first.why and first.path.is_file()
    assert first.path.with_name(first.path.name + ".sha256").read_text().strip() == cuda_build._digest(first.path)
    assert "building csrc/prefill_sm90.cu with nvcc (Cuda compilation tools, release 99.9" in caplog.text
    assert "built csrc/prefill_sm90.cu in" in caplog.text
    again = cuda_build.build(*cuda_build.PREFILL_LIBRARY)
    assert (again.state, again.path) == ("cached", first.path)
    assert len(fake_nvcc()) == 1
    assert "in the cache" in again.describe() and "built in" in first.describe()


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_bytes(p.read_bytes()[:10]), "corrupt"),          # truncated
    (lambda p: p.write_bytes(b"x" + p.read_bytes()[1:]), "corrupt"),     # altered
    (lambda p: p.with_name(p.name + ".sha256").unlink(), "without its checksum"),  # interrupted build
    (lambda p: p.unlink(), "not in the cache"),                          # removed
])
def test_a_damaged_entry_is_rebuilt(fake_nvcc, damage, why):
    first = cuda_build.build(*cuda_build.DECODE_LIBRARY)
    damage(first.path)
    again = cuda_build.build(*cuda_build.DECODE_LIBRARY)
    assert why in again.why and again.path == first.path and len(fake_nvcc()) == 2
    assert cuda_build._entry_state(again.path) is None


def test_two_processes_building_at_once_make_one_build(fake_nvcc, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.5")
    code = ("import json; from dhp_backend.ops import cuda_build as c; b = c.build(*c.PREFILL_LIBRARY); "
            "print(json.dumps([b.state, str(b.path), c._entry_state(b.path)]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r[0] for r in results) == ["built", "cached"]  # the second waited for the first's build
    assert results[0][1] == results[1][1] and results[0][2] is None is results[1][2]
    assert len(fake_nvcc()) == 1


def test_a_failing_build_says_why(fake_nvcc, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(cuda_build.CudaBuildError, match=r"(?s)nvcc failed building prefill_sm90.cu \(exit 2\).*planted"):
        cuda_build.build(*cuda_build.PREFILL_LIBRARY)


def test_cli_build_prebuilds_every_library(fake_nvcc, capsys, monkeypatch):
    from dhp_backend import cli

    assert cli.main(["build", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["library"], r["state"]) for r in rows] == [(n, "built") for n, _ in cuda_build.LIBRARIES]
    assert cli.main(["build"]) == 0
    out = capsys.readouterr().out
    assert out.count("in the cache") == len(cuda_build.LIBRARIES) and "DHP_CUDA_CACHE" in out
    # a model with windowed, soft-capped layers: its feature libraries too (the plain ones found in the cache)
    assert cli.main(["build", "--json", "--features", "window,softcap"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["library"], r["state"]) for r in rows] == [(n, "cached") for n, _ in cuda_build.LIBRARIES] + [
        (f"{n}_window_softcap", "built") for n, _ in cuda_build.LIBRARIES]
    assert cli.main(["build", "--features", "window,alibi"]) == 2
    assert "accepted: window, softcap, sinks" in capsys.readouterr().err
    # a head-64 model (gpt-oss): its own libraries, plain and with its features
    assert cli.main(["build", "--json", "--head", "64", "--features", "window,sinks"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["library"], r["state"]) for r in rows] == [(f"{n}_h64", "built") for n, _ in cuda_build.LIBRARIES] + [
        (f"{n}_window_sinks_h64", "built") for n, _ in cuda_build.LIBRARIES]
    assert cli.main(["build", "--head", "112"]) == 2
    assert "--head 112; accepted: 64, 80, 96, 128, 256" in capsys.readouterr().err
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    assert cli.main(["build"]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def _sm90_spec():
    return ProblemSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16",
                       device_type="cuda", device_capability=(9, 0))


def _routes(spec, builds, policy="strict"):
    """What the start-up report says of each step kind (dhp_backend.startup_report)."""
    from dhp_backend import startup_report
    from dhp_backend.config import DHPConfig

    return startup_report.step_routes(spec, DHPConfig(policy=Policy.parse(policy)), 8192, builds, num_sms=132)


def test_engine_start_up_builds_what_the_routes_use(fake_nvcc, caplog):
    plan.clear_caches()
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        built = plan.prepare_kernels(_sm90_spec())
    assert sorted(b.source for b in built) == ["decode_sm90.cu", "prefill_sm90.cu"]
    assert caplog.text.count("DHP: built csrc/") == 2  # the events: one line per build, with its duration
    routes = _routes(_sm90_spec(), built)
    assert routes["decode"].kernel == plan.CUDA_DECODE_CT and routes["prefill"].kernel == plan.CUDA_PREFILL_CT
    assert routes["decode"].state.startswith("built now in ")
    assert "not in the cache: first build" in routes["decode"].state
    plan.clear_caches()
    again = plan.prepare_kernels(_sm90_spec())  # a restart: both found in the cache
    assert [b.state for b in again] == ["cached", "cached"] and len(fake_nvcc()) == 2
    assert _routes(_sm90_spec(), again)["prefill"].state.startswith("found in the build cache (")
    assert plan.prepare_kernels(_sm90_spec(), "triton") == []  # path triton: nothing to build
    cpu = ProblemSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16",
                      device_type="cpu", device_capability=None)
    assert plan.prepare_kernels(cpu) == []
    plan.clear_caches()


def test_a_failed_build_sends_every_step_of_the_layer_to_triton(fake_nvcc, monkeypatch, caplog):
    """The first library that fails stops the preparation (the other would be refused too:
    a layer runs every step on the csrc kernels or none), and every step kind of every policy
    runs on Triton."""
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    monkeypatch.setattr(cuda_common, "_BUILD_FAILED", {})
    plan.clear_caches()
    with caplog.at_level(logging.ERROR, logger="dhp_backend"):
        assert plan.prepare_kernels(_sm90_spec()) == []
    assert "csrc/decode_sm90.cu failed to build; every step of these layers runs on the Triton kernels" in caplog.text
    assert len(fake_nvcc()) == 1, "the second library was built after the first failed"
    spec = _sm90_spec()
    for policy in ("strict", "request", "off"):
        for num_tokens, num_reqs in ((16, 16), (256, 2), (2048 + 63, 64)):  # decode, prefill, mixed
            assert plan.step_kernel(spec, policy, num_tokens, num_reqs) == plan.TRITON, (policy, num_tokens)
    plan.clear_caches()


def test_no_nvcc_builds_nothing_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    plan.clear_caches()
    assert plan.prepare_kernels(_sm90_spec()) == []
    for kind, route in _routes(_sm90_spec(), []).items():
        assert route.kernel == plan.TRITON, kind
        assert "not a csrc kernel: no nvcc to build csrc/" in route.state and "CUDA toolkit >= 12.5" in route.state
    plan.clear_caches()


def test_every_layer_shares_one_preparation(fake_nvcc, caplog):
    plan.clear_caches()
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        first = [plan.prepare_kernels(_sm90_spec()) for _ in range(32)]  # 32 layers of one model
    assert all(f is first[0] for f in first) and len(fake_nvcc()) == 2  # two libraries, built once each
    assert caplog.text.count("DHP: built csrc/") == 2
    plan.clear_caches()


def test_a_featured_layer_builds_its_feature_libraries_and_one_of_another_head_size_nothing(fake_nvcc):
    import dataclasses

    head112 = dataclasses.replace(_sm90_spec(), head_size=112, sinks=True)
    assert plan.prepare_kernels(head112) == [] and fake_nvcc() == []  # its steps all run on Triton
    capped = dataclasses.replace(_sm90_spec(), logits_soft_cap=50.0, sliding_window=4096, sinks=True)
    built = plan.prepare_kernels(capped)
    assert sorted(b.name for b in built) == ["dhp_decode_sm90_window_softcap_sinks",
                                             "dhp_prefill_sm90_window_softcap_sinks"]
    assert len(fake_nvcc()) == 2
    plan.clear_caches()
    # gpt-oss's local layers: head 64 with sinks and a window, on the head-64 libraries built with -DDHP_HEAD=64
    oss = dataclasses.replace(_sm90_spec(), num_heads=64, head_size=64, sinks=True, sliding_window=128)
    built = plan.prepare_kernels(oss)
    assert sorted(b.name for b in built) == ["dhp_decode_sm90_window_sinks_h64", "dhp_prefill_sm90_window_sinks_h64"]
    assert len(fake_nvcc()) == 4 and all("_window_sinks_h64-" in out for out in fake_nvcc()[2:]), fake_nvcc()
    plan.clear_caches()
    # Gemma-2's local layers: head 256 with a window and a soft cap, on the head-256 libraries (-DDHP_HEAD=256)
    gemma = dataclasses.replace(_sm90_spec(), num_heads=16, num_kv_heads=8, head_size=256, sliding_window=4096,
                                logits_soft_cap=50.0)
    built = plan.prepare_kernels(gemma)
    assert sorted(b.name for b in built) == ["dhp_decode_sm90_window_softcap_h256",
                                             "dhp_prefill_sm90_window_softcap_h256"]
    assert len(fake_nvcc()) == 6 and all("_window_softcap_h256-" in out for out in fake_nvcc()[4:]), fake_nvcc()
    plan.clear_caches()


def test_feature_library_names_and_flags_per_head_size():
    name, src, flags = cuda_build.feature_library(cuda_build.PREFILL_LIBRARY, head=64)
    assert (name, src) == ("dhp_prefill_sm90_h64", "prefill_sm90.cu") and flags[-1] == "-DDHP_HEAD=64"
    # head 96 (Phi-3): its own library, run on head-128 tiles (its split states are 128-column rows), as 80
    name, _, flags = cuda_build.feature_library(cuda_build.DECODE_LIBRARY, window=True, head=96)
    assert name == "dhp_decode_sm90_window_h96" and flags[-2:] == ("-DDHP_WINDOW=1", "-DDHP_HEAD=96")
    assert cuda_build.TILE_HEAD[96] == 128 and set(cuda_build.TILE_HEAD) == set(cuda_build.HEAD_SIZES)
    assert cuda_build.feature_library(cuda_build.DECODE_LIBRARY) == ("dhp_decode_sm90", "decode_sm90.cu",
                                                                     cuda_build.SM90A)
    # head 256 (Gemma-2 9B, Gemma-3 <= 12B): tiles of its own, 256-column split states
    name, _, flags = cuda_build.feature_library(cuda_build.PREFILL_LIBRARY, softcap=True, head=256)
    assert name == "dhp_prefill_sm90_softcap_h256" and flags[-1] == "-DDHP_HEAD=256"
    assert cuda_build.TILE_HEAD[256] == 256
    with pytest.raises(ValueError, match=r"head size 112; accepted: 64, 80, 96, 128, 256"):
        cuda_build.feature_library(cuda_build.DECODE_LIBRARY, head=112)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_a_library_of_another_head_size_is_refused(monkeypatch, kernel):
    """A launcher checks the library it loads for a head size is one (its dhp_*_sm90_head_size export): a
    library of another head size would read the wrong columns, so loading it fails with a message."""
    import importlib
    import types

    module = importlib.import_module(f"dhp_backend.ops.cuda_{kernel}")
    entry = f"dhp_{kernel}_sm90"
    seen = []

    def fake_load(*a, **k):
        seen.append(a[0])
        return types.SimpleNamespace(**{entry: types.SimpleNamespace(), f"{entry}_head_size": lambda: 128})

    monkeypatch.setattr(module, "load", fake_load)
    module._entry.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"loaded for head size 64 was built for head size 128"):
            module._entry(head=64)
        assert seen == [f"{entry}_h64"]
    finally:
        module._entry.cache_clear()
