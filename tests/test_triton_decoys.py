"""The kernel's decoy-page map (kernels.decoy_block), run under the Triton interpreter.

Padding positions read decoy pages so that they cost what real positions cost
(G1: equal DRAM bytes). The map must be a bijection of (request, logical block)
onto cache pages whenever the cache is large enough, and otherwise repeat a page
only after the whole cache (so a repeat misses L2 like a fresh page). Runs the
real @triton.jit function in a fresh interpreter process, whatever this process
imported first, and checks it against plain integer arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from dhp_backend.ops.triton.kernels import decoy_block
from dhp_backend.ops.triton.launch import decoy_magic

@triton.jit
def table(out_ptr, num_reqs, num_blocks, magic, W: tl.constexpr):
    r = tl.program_id(0)
    lb = tl.arange(0, W)
    tl.store(out_ptr + r * W + lb, decoy_block(r, lb, num_reqs, num_blocks, magic))

res = []
for num_reqs, width, num_blocks in json.loads(sys.argv[1]):
    out = torch.full(((num_reqs + 1) * width,), -1, dtype=torch.int32)
    table[(num_reqs + 1,)](out, num_reqs, num_blocks, decoy_magic(num_blocks), W=width)
    res.append(out.tolist())
print("DECOYS " + json.dumps(res))
"""

# (num_reqs, table width, num_blocks): roomy caches, exactly full, too small, odd sizes, 1 block
CASES = [(3, 16, 200), (7, 32, 256), (15, 64, 1024 + 37), (4, 16, 50), (31, 64, 1000), (2, 8, 1),
         (5, 128, 60_013)]


def test_decoy_map_is_a_bijection_or_repeats_only_after_the_whole_cache():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = json.loads(proc.stdout.split("DECOYS ", 1)[1])
    for (num_reqs, width, num_blocks), got in zip(CASES, tables):
        expected = [(lb * (num_reqs + 1) + r) % num_blocks for r in range(num_reqs + 1) for lb in range(width)]
        assert got == expected, (num_reqs, width, num_blocks)
        assert all(0 <= b < num_blocks for b in got)
        pages = {}
        for r in range(num_reqs + 1):
            for lb in range(width):
                pages.setdefault(got[r * width + lb], []).append(lb)
        if (num_reqs + 1) * width <= num_blocks:
            assert len(pages) == len(got), "decoys collide although the cache has room"
        else:
            # a page serves several (r, lb); the logical blocks that share it are
            # ~num_blocks / (num_reqs + 1) apart in the walk
            gap = num_blocks // (num_reqs + 1)
            for lbs in pages.values():
                lbs.sort()
                assert all(b - a >= gap for a, b in zip(lbs, lbs[1:])), (num_reqs, width, num_blocks, lbs)
