"""Build and load an experiment's CUDA library (benchmarks/csrc/*.cu), outside the engine's.

An experiment's source includes a csrc/ kernel file unchanged and adds its variants; it is
compiled with the engine's nvcc flags into a library of its own, cached under the engine's
build cache by the csrc tree, the flags, the nvcc version, the experiment's source and the
headers beside it (benchmarks/csrc/v2_arith.cuh). The engine's library never holds these binaries.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import time
from pathlib import Path


def load(source: Path, stem: str) -> ctypes.CDLL:
    """Build ``source`` into ``lib<stem>.so`` once (per source, csrc tree, flags and nvcc) and load it."""
    from dhp_backend.ops import cuda_build as cb

    nvcc = cb.find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found: the experiment's kernels are built with the CUDA toolkit")
    csrc = cb.csrc_dir()
    flags = cb.BASE_FLAGS + cb.SM90A
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    # the experiment's own directory too: its source and the headers beside it (v2_arith.cuh)
    own = b"".join(f.name.encode() + f.read_bytes() for f in sorted(source.parent.iterdir())
                   if f.suffix in cb.SOURCE_SUFFIXES)
    key = hashlib.sha256(cb.build_key(csrc, flags, version).encode() + source.read_bytes() + own).hexdigest()[:16]
    out = cb.cache_dir() / f"{stem}-{key}" / f"lib{stem}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        tmp = out.with_name(f".{os.getpid()}.so")
        res = subprocess.run([nvcc, *flags, "-I", str(csrc), "-o", str(tmp), str(source)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name}:\n{(res.stderr or res.stdout)[-3000:]}")
        os.replace(tmp, out)
        print(f"built {out} in {time.time() - t0:.0f}s", flush=True)
    return ctypes.CDLL(str(out))
