"""Shared pytest setup: GPU tests skip without CUDA; tests/ is importable."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest test files (a CPU run's durations, 2026-11-29), first: `make test` deals whole
# files to its two workers in collection order (--dist loadfile), so longest first keeps one worker from
# starting a long file while the other is nearly done (the run's wall time is the busier worker's).
_LONGEST_FIRST = ("test_e2e_cpu_engine", "test_golden", "test_e2e_windowed", "test_audit_sass", "test_triton_interpret",
                  "test_reference_oracle", "test_e2e_throughput", "test_reservation")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(item.nodeid.split("::")[0])[:-3], len(rank)))  # stable
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _scope_triton_interpreter(request, monkeypatch):
    """TRITON_INTERPRET=1 only inside the Triton interpreter test module.

    On a CPU, the dispatcher covers shapes with the Triton kernels only under the
    interpreter; a test module that sets the variable must not change which path
    the adapter and end-to-end tests get. The path choice is cached per problem,
    so the cache is cleared whenever the scope changes.
    """
    wants = "triton_interpret" in request.node.module.__name__
    if wants:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from dhp_backend.ops import plan

    plan.clear_caches()
    yield
    plan.clear_caches()


@pytest.fixture
def with_nvcc(monkeypatch):
    """As if the csrc kernels could be built here (an nvcc on the path), so that plain layers route to them;
    the plans and routes cached before and after are forgotten."""
    from dhp_backend.ops import cuda_build, plan

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    plan.clear_caches()
    yield
    plan.clear_caches()


FAKE_NVCC = textwrap.dedent('''\
    #!{python}
    """A stand-in for nvcc: logs each compile, waits, writes a fake library (or fails on request)."""
    import os, sys, time
    if "--version" in sys.argv:
        print("Cuda compilation tools, release 99.9, V99.9.1")
        sys.exit(0)
    out = sys.argv[sys.argv.index("-o") + 1]
    with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
        f.write(out + "\\n")
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    if os.environ.get("FAKE_NVCC_FAIL"):
        print("prefill_sm90.cu(1): error: planted failure", file=sys.stderr)
        sys.exit(2)
    with open(out, "wb") as f:
        f.write(b"\\x7fELF fake library " + os.urandom(64))
''')


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """nvcc replaced by FAKE_NVCC (CUDA_HOME), the build cache in tmp_path: returns the outputs it compiled."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    log = tmp_path / "nvcc.log"
    log.write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("DHP_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    return lambda: [ln for ln in log.read_text().splitlines() if ln]
