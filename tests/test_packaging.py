"""What `pip install .` ships: the product with its CUDA sources, not the tools beside it.

The wheel is built (pip, no isolation, no dependencies) from a copy of the files
the build reads, so the checkout gets no build/ or egg-info; then a
non-editable install is emulated by putting the unpacked wheel alone on the
path, where `cuda_build.csrc_dir` must find the sources as package data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from dhp_backend.ops import cuda_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What setuptools reads to build the wheel, and benchmarks/ to show it is left out.
BUILD_INPUTS = ("pyproject.toml", "README.md", "dhp_backend", "csrc", "benchmarks")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        s = os.path.join(ROOT, name)
        if os.path.isdir(s):
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(s, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return str(out / whl)


def _names(wheel: str) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_ships_the_cuda_sources(wheel):
    names = _names(wheel)
    sources = sorted(f for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith(cuda_build.SOURCE_SUFFIXES))
    assert {"decode_sm90.cu", "prefill_sm90.cu"} <= set(sources)
    missing = [f for f in sources if f"dhp_backend/csrc/{f}" not in names]
    assert not missing, f"csrc sources missing from the wheel: {missing}"


def test_wheel_leaves_the_tools_out(wheel):
    names = _names(wheel)
    top = {n.split("/", 1)[0] for n in names}
    assert "benchmarks" not in top and not any("/benchmarks/" in n or "/bench/" in n for n in names), sorted(top)
    assert top <= {"dhp_backend"} | {n for n in top if n.endswith((".dist-info", ".data"))}, sorted(top)


def test_wheel_holds_every_subpackage(wheel):
    """pyproject lists the packages by hand (find cannot map csrc/): a new subpackage
    must be added there, or a non-editable install would lack it."""
    names = _names(wheel)
    for here, dirs, files in os.walk(os.path.join(ROOT, "dhp_backend")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            pkg = os.path.relpath(here, ROOT).replace(os.sep, "/")
            assert f"{pkg}/__init__.py" in names, (
                f"{pkg} is not in the wheel: add {pkg.replace('/', '.')!r} to [tool.setuptools] packages in "
                "pyproject.toml")


def test_an_installed_wheel_finds_its_cuda_sources(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "DHP_CSRC"}
    env["PYTHONPATH"] = str(site)  # the unpacked wheel first, not the checkout
    proc = subprocess.run([sys.executable, "-c", "import dhp_backend.ops.cuda_build as b; print(b.__file__); "
                           "print(b.csrc_dir())"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, found = proc.stdout.split()
    assert module.startswith(str(site)), f"imported {module}, not the installed wheel"
    assert os.path.samefile(found, site / "dhp_backend" / "csrc")
    assert (site / "dhp_backend" / "csrc" / "decode_sm90.cu").is_file()


def test_csrc_dir_in_a_checkout_and_by_override(monkeypatch, tmp_path):
    monkeypatch.delenv("DHP_CSRC", raising=False)
    assert cuda_build.csrc_dir() == (cuda_build.Path(cuda_build.__file__).resolve().parents[2] / "csrc")
    monkeypatch.setenv("DHP_CSRC", str(tmp_path))
    assert cuda_build.csrc_dir() == tmp_path
    monkeypatch.setenv("DHP_CSRC", str(tmp_path / "nowhere"))
    with pytest.raises(cuda_build.CudaBuildError, match=r"DHP_CSRC=.*nowhere is not a directory"):
        cuda_build.csrc_dir()


def test_the_package_imports_nothing_from_the_tools_beside_it():
    """benchmarks/ and integration/ are not installed: a dhp_backend module that imported
    them would work in a checkout and fail in an install."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+(benchmarks|integration|tests)\b", re.M)
    offenders = []
    for here, dirs, files in os.walk(os.path.join(ROOT, "dhp_backend")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(here, f)
                with open(path) as fh:
                    if pattern.search(fh.read()):
                        offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, offenders
