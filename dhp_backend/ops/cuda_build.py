"""Build the CUDA C++ kernels of ``csrc/`` with nvcc on first use, cached.

A kernel library is built once per (sources, flags, nvcc) and kept under
``$DHP_CUDA_CACHE`` (default ``~/.cache/dhp_backend/cuda``), keyed by a hash
of all three, so editing a source rebuilds it and nothing stale is loaded. The
libraries are plain shared objects with C entry points, loaded with ctypes:
no PyTorch headers, no pybind, so the build needs only nvcc (CUDA >= 12.5 for
``cudaGetDriverEntryPointByVersion``).

Hopper code is built for ``sm_90a`` (wgmma and setmaxnreg need the ``a``
target; the ``-gencode`` form, see the device notes).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.resources
import os
import shutil
import subprocess
from pathlib import Path

from dhp_backend import config

SM90A = ("-gencode=arch=compute_90a,code=sm_90a",)
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class CudaBuildError(RuntimeError):
    """nvcc missing, or a csrc kernel failed to compile (the message has nvcc's output)."""


def csrc_dir() -> Path:
    """Where the CUDA sources are: the setting ``csrc`` (DHP_CSRC) if set; else the package data
    ``dhp_backend/csrc`` of an installed wheel (pyproject maps the repository's
    ``csrc/`` there); else, in a checkout (an editable install, or the repository on
    ``sys.path``), the repository's ``csrc/`` beside the package."""
    override = config.from_env("csrc")
    if override:
        d = Path(override)
        if not d.is_dir():
            raise CudaBuildError(f"DHP_CSRC={d} is not a directory; accepted: the csrc/ directory of dhp_backend")
        return d
    installed = importlib.resources.files("dhp_backend") / "csrc"
    if installed.is_dir():
        return Path(str(installed))
    checkout = Path(__file__).resolve().parents[2] / "csrc"
    if checkout.is_dir():
        return checkout
    raise CudaBuildError(f"CUDA sources not found (neither {installed} nor {checkout}): reinstall dhp_backend "
                         "(pip install .) or point DHP_CSRC at its csrc/ directory")


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    """The build cache: the setting ``cuda_cache`` (DHP_CUDA_CACHE), else ~/.cache/dhp_backend/cuda."""
    return Path(config.from_env("cuda_cache") or Path.home() / ".cache" / "dhp_backend" / "cuda")


# What a build depends on in csrc/: every source and header (tma_maps.h included:
# a key over *.cu* alone kept a stale build when only a .h changed).
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


def build_key(src_dir: Path, cmd_flags: tuple[str, ...], nvcc_version: str) -> str:
    """The cache key of a build: the csrc sources and headers, the flags and nvcc's version."""
    h = hashlib.sha256()
    for f in sorted(p for p in src_dir.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(cmd_flags).encode())
    h.update(nvcc_version.encode())
    return h.hexdigest()[:16]


def _compile(name: str, source: str, cmd_flags: tuple[str, ...], artefact: str, purpose: str) -> Path:
    """nvcc ``csrc/<source>`` with ``cmd_flags`` into ``<cache>/<name>-<key>/<artefact>``, once per key."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, PATH): "
                             f"{purpose} and need the CUDA toolkit (>= 12.5)")
    src_dir = csrc_dir()
    main = src_dir / source
    if not main.is_file():
        raise CudaBuildError(f"{main} does not exist")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    out_dir = cache_dir() / f"{name}-{build_key(src_dir, cmd_flags, version)}"
    out = out_dir / artefact
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:  # one build per cache entry across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out_dir / f".{os.getpid()}.{artefact}"
        cmd = [nvcc, *cmd_flags, "-I", str(src_dir), "-o", str(tmp), str(main)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout)[-3000:]
            raise CudaBuildError(f"nvcc failed building {main.name} (exit {res.returncode}):\n{' '.join(cmd)}\n{tail}")
        os.replace(tmp, out)
    return out


def build(name: str, source: str, flags: tuple[str, ...] = SM90A) -> Path:
    """Compile ``csrc/<source>`` (and the headers beside it) into ``lib<name>.so``; return its path."""
    return _compile(name, source, BASE_FLAGS + tuple(flags), f"lib{name}.so",
                    "the csrc kernels are built on first use")


# The device half of BASE_FLAGS: a ``-cubin`` build with these gives the same
# SASS as the library's (same nvcc, same device flags), for the SASS gate.
CUBIN_FLAGS = tuple(f for f in BASE_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC"))


def build_cubin(name: str, source: str, flags: tuple[str, ...] = SM90A) -> Path:
    """``csrc/<source>`` compiled to a cubin with line info (``<name>.cubin``, cached like `build`)."""
    return _compile(name, source, CUBIN_FLAGS + ("-cubin",) + tuple(flags), f"{name}.cubin",
                    "the SASS gate of the csrc kernels compiles them")


_LOADED: dict[tuple, ctypes.CDLL] = {}


def load(name: str, source: str, flags: tuple[str, ...] = SM90A) -> ctypes.CDLL:
    """The built library, loaded once per process."""
    flags = tuple(flags)
    key = (name, flags)
    if key not in _LOADED:
        _LOADED[key] = ctypes.CDLL(str(build(name, source, flags)))
    return _LOADED[key]
