"""ptxas keeps the prefill kernels' wgmma pipelines: no serialized wgmma (needs nvcc; no GPU).

ptxas serializes a kernel's wgmmas, each waited for before the next one issues, when it cannot prove the
code around them warp-uniform (C7520), when the pipeline lacks registers (C7511) or when a wgmma is guarded
(C7515), and says so only as a "Potential Performance Loss" line of `-Xptxas -v`. Twice that went unseen:
branches around the wgmmas (docs/perf-notes.md lever 64: 0.92 -> 0.64x FA3) and head 256's constant-time
consumer, serialized since it was written (lever 66: its step count broadcast from lane 0,
`kUniformStepsCT`, 32 waits a step -> 2). Each library's SASS is checked here for those warnings and for
the waits they cause (`WARPGROUP.DEPBAR.LE gsb0, 0x0`: a handful per kernel, not one per wgmma).
"""

import re
import subprocess

import pytest

from dhp_backend.audit import sass
from dhp_backend.ops import cuda_build

pytestmark = pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc to build csrc/prefill_sm90.cu")

SERIALIZED = ("C7511", "C7515", "C7520")
# Libraries whose kernels must keep their pipelines: the plain head-128 library, gpt-oss's head-64 window +
# sinks, Phi-3's head-96 window, the head-128 feature library and Gemma's head-256 window + cap.
LIBRARIES = [dict(), dict(head=64, window=True, sinks=True), dict(head=96, window=True),
             dict(window=True, softcap=True, sinks=True), dict(head=256, window=True, softcap=True)]


def _compile(tmp_path, features):
    name, source, flags = cuda_build.feature_library(cuda_build.PREFILL_LIBRARY, **features)
    out = tmp_path / f"{name}.cubin"
    src_dir = cuda_build.csrc_dir()
    r = subprocess.run([cuda_build.find_nvcc(), "-O3", "-std=c++17", "-cubin", *flags, "-Xptxas", "-v",
                        "-I", str(src_dir), str(src_dir / source), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, r.stderr


def _waits_per_kernel(cubin) -> dict[str, tuple[int, int]]:
    """{kernel: (WARPGROUP.DEPBAR.LE gsb0, 0x0 count, HGMMA count)} from the cubin's SASS."""
    text = subprocess.run([sass.tool_path("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    counts: dict[str, list[int]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = counts.setdefault(m.group(1), [0, 0])
        elif cur is not None:
            cur[0] += "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line
            cur[1] += " HGMMA." in line
    return {k: (w, h) for k, (w, h) in counts.items() if h}


@pytest.mark.parametrize("features", LIBRARIES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "plain")
def test_no_prefill_kernel_serializes_its_wgmmas(tmp_path, features):
    try:
        sass.tool_path("cuobjdump")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cubin, log = _compile(tmp_path, features)
    warned = [ln for ln in log.splitlines() if any(c in ln for c in SERIALIZED)]
    assert not warned, warned
    waits = _waits_per_kernel(cubin)
    assert any("prefill_v2_kernel" in k for k in waits) and any("prefill_v2_ct_kernel" in k for k in waits)
    for kernel, (w, h) in waits.items():
        assert w <= 4 < h, (kernel, w, h)  # the step's waits (S, PV, the fold), not one per wgmma
