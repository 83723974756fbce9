"""The decoy-page maps: the Triton kernels' (kernels.decoy_block, run under the
Triton interpreter) and the csrc CT kernels' (the same map shuffled by a
swap-or-not bijection, csrc/ct_walk.cuh; its host copy launch.csrc_decoy_page is
tested here, the device copies against it in tests/test_ct_walk_gpu.py).

Padding positions read decoy pages so that they cost what real positions cost
(G1: equal DRAM bytes). The map must be a bijection of (request, logical block)
onto cache pages whenever the cache is large enough, and otherwise repeat a page
only after the whole cache (so a repeat misses L2 like a fresh page), and scatter
the decoys that neighbouring requests read at one step over the cache instead of
placing them on adjacent pages (a DRAM/TLB locality that made a padded step 1.3%
faster on an H200, G4). Runs the
real @triton.jit function in a fresh interpreter process, whatever this process
imported first, and checks it against plain integer arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import math

import pytest

pytest.importorskip("triton")

from dhp_backend.ops.triton.launch import (  # noqa: E402 (no torch/triton work at import)
    DECOY_ROUNDS, csrc_decoy_page, decoy_magic, decoy_mult, mix32, swap_or_not, triton_decoy_page)

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from dhp_backend.ops.triton.kernels import decoy_block
from dhp_backend.ops.triton.launch import decoy_magic, decoy_mult

@triton.jit
def table(out_ptr, num_reqs, num_blocks, magic, mult, W: tl.constexpr):
    r = tl.program_id(0)
    lb = tl.arange(0, W)
    tl.store(out_ptr + r * W + lb, decoy_block(r, lb, num_reqs, num_blocks, magic, mult))

res = []
for num_reqs, width, num_blocks in json.loads(sys.argv[1]):
    out = torch.full(((num_reqs + 1) * width,), -1, dtype=torch.int32)
    table[(num_reqs + 1,)](out, num_reqs, num_blocks, decoy_magic(num_blocks), decoy_mult(num_blocks), W=width)
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
        mult = decoy_mult(num_blocks)
        expected = [((lb * (num_reqs + 1) + r) % num_blocks) * mult % num_blocks
                    for r in range(num_reqs + 1) for lb in range(width)]
        assert got == expected, (num_reqs, width, num_blocks)
        assert got == [triton_decoy_page(r, lb, num_reqs, num_blocks)
                       for r in range(num_reqs + 1) for lb in range(width)]
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
        if num_blocks >= 1000:
            # the pages neighbouring requests read at one logical block are not neighbours
            adjacent = sum(abs(got[r * width + lb] - got[(r + 1) * width + lb]) <= 1
                           for r in range(num_reqs) for lb in range(width))
            assert adjacent <= 0.02 * num_reqs * width, (num_reqs, width, num_blocks, adjacent)


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 4, 16, 4112, 60_013, 2**16, 2**20 + 7, 3 * 2**24, 2**31 - 1])
def test_decoy_mult_is_a_32_bit_safe_bijection(num_blocks):
    mult = decoy_mult(num_blocks)
    assert 1 <= mult and math.gcd(mult, num_blocks) == 1
    assert (num_blocks - 1) * mult < 2**32  # the kernel multiplies in uint32
    if 64 <= num_blocks <= 2**20:
        assert mult >= 16  # actually scatters
    assert decoy_magic(num_blocks) == (2**32 - 1) // num_blocks


def test_decoy_params_reject_out_of_range_caches():
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="num_blocks"):
            decoy_mult(bad)


def _random_layout_strides(num_reqs, width, num_blocks, seed=0):
    import random

    rng = random.Random(seed)
    pages = [rng.randrange(num_blocks) for _ in range((num_reqs + 1) * width)]
    return len({pages[r * width + lb + 2] - pages[r * width + lb] for r in range(num_reqs) for lb in range(width - 2)})


def _mix32_reference(v):
    # lowbias32 (Chris Wellons' hash-prospector), written out independently
    v &= 0xFFFFFFFF
    v = ((v ^ (v >> 16)) * 0x7FEB352D) % 2**32
    v = ((v ^ (v >> 15)) * 0x846CA68B) % 2**32
    return v ^ (v >> 16)


def test_mix32_matches_an_independent_writing():
    for v in (0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 2**32 + 5):
        assert mix32(v) == _mix32_reference(v)
    assert len({mix32(v) & 1 for v in range(64)}) == 2


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 97, 1000, 4112, 16400])
def test_swap_or_not_is_a_bijection_and_moves_things(n):
    image = [swap_or_not(x, n) for x in range(n)]
    assert sorted(image) == list(range(n))
    if n >= 97:
        assert sum(image[x] == x for x in range(n)) < 0.1 * n  # not the identity in disguise
        # not affine: x -> f(x + 1) - f(x) takes many values
        assert len({(image[x + 1] - image[x]) % n for x in range(n - 1)}) > 0.3 * n
    assert DECOY_ROUNDS >= 12  # fewer rounds: a piecewise-affine map with few pieces (ct_walk.cuh)


@pytest.mark.parametrize("num_reqs,width,num_blocks", CASES)
def test_csrc_map_is_the_triton_map_shuffled_and_keeps_its_guarantees(num_reqs, width, num_blocks):
    got = [csrc_decoy_page(r, lb, num_reqs, num_blocks) for r in range(num_reqs + 1) for lb in range(width)]
    tri = [triton_decoy_page(r, lb, num_reqs, num_blocks) for r in range(num_reqs + 1) for lb in range(width)]
    assert got == [swap_or_not(x, num_blocks) for x in tri]
    # a bijection applied after the Triton map: pages repeat exactly where the Triton map's do
    assert len(set(got)) == len(set(tri))
    if num_blocks >= 1000 and (num_reqs + 1) * width <= num_blocks:
        adjacent = sum(abs(got[r * width + lb] - got[(r + 1) * width + lb]) <= 1
                       for r in range(num_reqs) for lb in range(width))
        assert adjacent <= 0.02 * num_reqs * width


def test_csrc_decoy_strides_match_a_random_layout_and_the_scatter_does_not():
    # the lattice the shuffle removes: the scatter gives a request's pages two logical
    # blocks apart two distinct strides; a random layout (and the shuffled map) thousands
    for num_reqs, width, n in [(16, 256, 16 * 256 + 16), (64, 256, 64 * 256 + 16), (15, 64, 1024 + 37)]:
        def strides(f):
            got = [f(r, lb, num_reqs, n) for r in range(num_reqs + 1) for lb in range(width)]
            return len({got[r * width + lb + 2] - got[r * width + lb]
                        for r in range(num_reqs) for lb in range(width - 2)})
        rand = _random_layout_strides(num_reqs, width, n)
        assert strides(csrc_decoy_page) >= 0.85 * rand, (num_reqs, n)
        assert strides(triton_decoy_page) <= 4
