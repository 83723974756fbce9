"""Build the CUDA C++ kernels of ``csrc/`` with nvcc, cached, visibly.

A kernel library is built once per (sources, flags, nvcc) and kept under
``$DHP_CUDA_CACHE`` (default ``~/.cache/dhp_backend/cuda``), keyed by a hash
of all three (the flags name the GPU architecture), so editing a source
rebuilds it and nothing stale is loaded. The libraries are plain shared objects
with C entry points, loaded with ctypes: no PyTorch headers, no pybind, so the
build needs only nvcc (CUDA >= 12.5 for ``cudaGetDriverEntryPointByVersion``).

The product's libraries (`LIBRARIES`) are built at engine start-up, before
vLLM profiles memory and captures CUDA graphs (`prebuild`, called by the
adapter through `ops.plan.prepare_kernels`), or ahead of time by ``dhp-backend
build`` (container images: no GPU needed). A build logs what it builds, why,
and how long it took; whether each library was built or found in the cache is
in the engine's start-up report (`dhp_backend.startup_report`) and in
``dhp-backend build``'s output.
Each cache entry carries the SHA-256 of its artefact; an entry whose artefact
is missing, truncated or altered is rebuilt. Builds write to a temporary name
and are renamed into place under a per-entry file lock, so two processes
building at once produce one build and never load a half-written file.

Hopper code is built for ``sm_90a`` (wgmma and setmaxnreg need the ``a``
target; the ``-gencode`` form, see the device notes).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from dhp_backend import config

SM90A = ("-gencode=arch=compute_90a,code=sm_90a",)
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")

# The libraries the engine routes to: (library name, source in csrc/). Each holds
# every routed binary of its source (both dtypes, both bucket modes).
DECODE_LIBRARY = ("dhp_decode_sm90", "decode_sm90.cu")
PREFILL_LIBRARY = ("dhp_prefill_sm90", "prefill_sm90.cu")
LIBRARIES = (DECODE_LIBRARY, PREFILL_LIBRARY)
# A layer with a sliding window, a logits soft-cap and/or attention sinks runs on a library of its own,
# the same source compiled with the features' macros (csrc/v2_arith.cuh: DHP_WINDOW, DHP_SOFTCAP,
# DHP_SINKS), built when a
# model has such layers: the plain libraries stay the code they were, and no plain step pays for a
# feature it does not use.
_FEATURE_MACROS = (("window", "-DDHP_WINDOW=1"), ("softcap", "-DDHP_SOFTCAP=1"), ("sinks", "-DDHP_SINKS=1"))
# The head sizes the csrc kernels are compiled for (csrc/v2_arith.cuh DHP_HEAD): 128 is the plain
# libraries' size; another size is a library of its own (suffix _h<size>, -DDHP_HEAD=<size>), like a feature.
# 80 (Phi-2) and 96 (Phi-3) run on head-128 tiles whose columns D-127 the TMA fills with zeros (`TILE_HEAD`);
# 256 (Gemma-2 9B, Gemma-3 <= 12B) on tiles of its own (csrc/prefill_sm90.cu kRunGlobal, kConsumersCT).
HEAD_SIZES = (64, 80, 96, 128, 256)
# The head size of a library's tiles (csrc/v2_arith.cuh kHead): its split states' rows in the workspace.
TILE_HEAD = {64: 64, 80: 128, 96: 128, 128: 128, 256: 256}
DEFAULT_HEAD = 128


def feature_library(library: tuple[str, str], *, window: bool = False, softcap: bool = False,
                    sinks: bool = False, head: int = DEFAULT_HEAD) -> tuple[str, str, tuple[str, ...]]:
    """``(name, source, flags)`` of ``library`` (e.g. `DECODE_LIBRARY`) compiled with the model features
    named and for head size ``head`` (`build` / `load` take the three): the plain library for head 128
    without features. E.g. ``dhp_decode_sm90_window_sinks_h64`` (gpt-oss)."""
    if head not in HEAD_SIZES:
        raise ValueError(f"head size {head!r}; accepted: {', '.join(map(str, HEAD_SIZES))} (the csrc kernels)")
    name, source = library
    on = {"window": window, "softcap": softcap, "sinks": sinks}
    suffix = "".join(f"_{k}" for k, _ in _FEATURE_MACROS if on[k])
    flags = tuple(flag for k, flag in _FEATURE_MACROS if on[k])
    if head != DEFAULT_HEAD:
        suffix += f"_h{head}"
        flags += (f"-DDHP_HEAD={head}",)
    return name + suffix, source, SM90A + flags

logger = logging.getLogger("dhp_backend")


@dataclasses.dataclass(frozen=True)
class Built:
    """One library's build: where it is, and whether this call built it (and why) or found it cached."""

    name: str
    source: str
    path: Path
    state: str  # "cached" | "built" | "rebuilt"
    why: str  # why it was (re)built; "" when cached
    seconds: float

    def describe(self) -> str:
        if self.state == "cached":
            return f"csrc/{self.source} -> {self.path.name}: in the cache ({self.path.parent})"
        return f"csrc/{self.source} -> {self.path.name}: {self.state} in {self.seconds:.1f} s ({self.why})"


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


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_state(out: Path) -> str | None:
    """Why the cache entry ``out`` cannot be used as it is (None when it can): missing, or its artefact does
    not match the SHA-256 recorded when it was built (truncated, altered, or written by something else)."""
    if not out.is_file():
        return "not in the cache: first build of these sources, flags and nvcc"
    sums = out.with_name(out.name + ".sha256")
    if not sums.is_file():
        return "cache entry without its checksum (an interrupted or older build)"
    if sums.read_text().strip() != _digest(out):
        return "cache entry corrupt (its checksum does not match)"
    return None


def _compile(name: str, source: str, cmd_flags: tuple[str, ...], artefact: str, purpose: str) -> Built:
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
    if _entry_state(out) is None:
        return Built(name, source, out, "cached", "", 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:  # one build per cache entry across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        why = _entry_state(out)  # another process may have built it while this one waited
        if why is None:
            return Built(name, source, out, "cached", "", 0.0)
        state = "built" if why.startswith("not in the cache") else "rebuilt"
        nvcc_line = next((ln for ln in version.splitlines() if "release" in ln), version.strip()[-60:])
        logger.warning("DHP: building csrc/%s with nvcc (%s; %s) into %s ...", source, nvcc_line.strip(), why,
                       out_dir)
        t0 = time.monotonic()
        tmp = out_dir / f".{os.getpid()}.{artefact}"
        cmd = [nvcc, *cmd_flags, "-I", str(src_dir), "-o", str(tmp), str(main)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not tmp.is_file():
            tail = (res.stderr or res.stdout)[-3000:]
            raise CudaBuildError(f"nvcc failed building {main.name} (exit {res.returncode}):\n{' '.join(cmd)}\n{tail}")
        sums = out.with_name(out.name + ".sha256")
        sums_tmp = out_dir / f".{os.getpid()}.{sums.name}"
        sums_tmp.write_text(_digest(tmp) + "\n")
        # The artefact first, then its checksum: an entry is complete only when both match.
        os.replace(tmp, out)
        os.replace(sums_tmp, sums)
        seconds = time.monotonic() - t0
        logger.warning("DHP: built csrc/%s in %.1f s", source, seconds)
    return Built(name, source, out, state, why, seconds)


def build(name: str, source: str, flags: tuple[str, ...] = SM90A) -> Built:
    """Compile ``csrc/<source>`` (and the headers beside it) into ``lib<name>.so`` unless the cache holds it."""
    return _compile(name, source, BASE_FLAGS + tuple(flags), f"lib{name}.so",
                    "the csrc kernels are built on first use")


# The device half of BASE_FLAGS: a ``-cubin`` build with these gives the same
# SASS as the library's (same nvcc, same device flags), for the SASS gate.
CUBIN_FLAGS = tuple(f for f in BASE_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC"))


def build_cubin(name: str, source: str, flags: tuple[str, ...] = SM90A) -> Path:
    """``csrc/<source>`` compiled to a cubin with line info (``<name>.cubin``, cached like `build`)."""
    return _compile(name, source, CUBIN_FLAGS + ("-cubin",) + tuple(flags), f"{name}.cubin",
                    "the SASS gate of the csrc kernels compiles them").path


def prebuild(libraries=LIBRARIES) -> list[Built]:
    """Build (or find in the cache) each of ``libraries``; raises `CudaBuildError` on the first that fails."""
    return [build(name, source) for name, source in libraries]


_LOADED: dict[tuple, ctypes.CDLL] = {}


def load(name: str, source: str, flags: tuple[str, ...] = SM90A) -> ctypes.CDLL:
    """The built library, loaded once per process. A cache entry the loader rejects is rebuilt once."""
    flags = tuple(flags)
    key = (name, flags)
    if key not in _LOADED:
        built = build(name, source, flags)
        try:
            _LOADED[key] = ctypes.CDLL(str(built.path))
        except OSError as e:  # e.g. a library of another machine's toolchain left in a shared cache
            logger.warning("DHP: %s could not be loaded (%s); rebuilding it", built.path, e)
            built.path.with_name(built.path.name + ".sha256").unlink(missing_ok=True)
            _LOADED[key] = ctypes.CDLL(str(build(name, source, flags).path))
    return _LOADED[key]
