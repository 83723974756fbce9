"""testing.pages on the CPU: the churned layout (vLLM's own block pool after a serving run) and the
block tables that obey the address rule, for every layout."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dhp_backend.ops.buckets import reserved_tokens
from dhp_backend.testing import pages

pytest.importorskip("vllm.v1.core.block_pool")

V24_SITE = "/tmp/v24/site"  # vLLM 0.24 (the GPU machine's) unpacked, where this machine has it


def _adjacent(order) -> float:
    d = np.diff(np.asarray(order))
    return float(np.mean(np.abs(d) == 1))


@pytest.mark.parametrize("n", [2, 3, 17, 500, 5000])
def test_churned_order_is_a_permutation_of_the_real_pages(n):
    order = pages.churned_order(n, seed=1)
    assert sorted(order) == list(range(1, n)), "every page once, block 0 (the null block) never"


def test_churned_order_at_60k_blocks_fast_and_mixed():
    import time

    pages.churned_order(100, seed=5)  # vLLM imported outside the timed call
    t = time.time()
    order = pages.churned_order(60_000, seed=5)
    took = time.time() - t
    assert took < 20, f"{took:.1f} s for 60,000 blocks"
    assert sorted(order) == list(range(1, 60_000))
    a = np.asarray(order)
    # not the fresh engine's order ...
    assert order != list(range(1, 60_000))
    assert abs(np.corrcoef(a, np.arange(a.size))[0, 1]) < 0.5
    # ... mixed: a request's reservation (2048 pages at L = 32768) spans the whole cache
    spans = [(a[i:i + 2048].max() - a[i:i + 2048].min()) / a.size for i in range(0, a.size - 2048, 2048)]
    assert np.mean(spans) > 0.8
    # ... and not a uniform shuffle: vLLM hands out runs of adjacent pages (prefill chunks, frees in
    # reverse order), which a random permutation almost never has (expected fraction 2 / 60,000)
    assert _adjacent(order) > 0.2
    shuffled = pages.page_order("random", 60_000, seed=5)
    assert _adjacent(shuffled) < 0.001
    stats = next(v for k, v in pages.CHURN_STATS.items() if k[0] == 60_000 and k[1] == 5)
    assert stats["handed_out"] >= pages.CHURN_TURNOVER * 60_000 and stats["requests"] > 100
    assert stats["preemptions"] >= 0 and stats["prefix_hit_blocks"] > 0


def test_churned_order_deterministic_per_seed_and_options():
    a = pages.churned_order(3000, seed=3)
    pages._churned_order.cache_clear()
    assert pages.churned_order(3000, seed=3) == a
    assert pages.churned_order(3000, seed=4) != a
    assert pages.churned_order(3000, seed=3, prefix_caching=False) != a
    assert pages.page_order("churned", 3000, seed=3) == a
    assert pages.churn_fingerprint(a) == pages.churn_fingerprint(list(a)) and len(pages.churn_fingerprint(a)) == 16


# Recorded with vLLM 0.32 (CI) and 0.24 (the GPU machine's): their block pools give the same order.
RECORDED = {(500, 7, True): "acbb133efc60a9ff", (500, 7, False): "144b3b093f281a20",
            (25000, 7, True): "426804fbde83576c"}


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_churned_order_matches_the_recorded_fingerprints(key):
    n, seed, pc = key
    assert pages.churn_fingerprint(pages.churned_order(n, seed=seed, prefix_caching=pc)) == RECORDED[key], (
        f"vLLM {pages.vllm_version()}'s block pool hands out pages in another order than 0.24/0.32 did: "
        "the churned layout of G4 reports made with it is not the recorded one")


@pytest.mark.skipif(not os.path.isdir(os.path.join(V24_SITE, "vllm")), reason="vLLM 0.24 not unpacked here")
def test_vllm_024_block_pool_gives_the_same_order():
    code = ("from dhp_backend.testing import pages; o = pages.churned_order(25000, seed=7); "
            "print(pages.vllm_version(), pages.churn_fingerprint(o))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([V24_SITE, root]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    version, fp = out.stdout.split()[-2:]
    assert version.startswith("0.24") and fp == RECORDED[(25000, 7, True)]


# ---------------------------------------------------------------- reserved_table, every layout

@pytest.mark.parametrize("layout", pages.LAYOUTS)
def test_reserved_table_obeys_the_address_rule(layout):
    bs, nb, width = 16, 3000, 64
    lens = [1, 16, 17, 100, 1000, 1024]
    for policy in ("strict", "request", "off"):
        res = [reserved_tokens(policy, s, width * bs) for s in lens]
        t = pages.reserved_table(res, block_size=bs, num_blocks=nb, width=width, layout=layout, seed=2)
        assert t.dtype == torch.int32 and tuple(t.shape) == (len(lens), width)
        need = [pages.pages_for(x, bs) for x in res]
        owned = torch.cat([t[r, :n] for r, n in enumerate(need)])
        assert owned.unique().numel() == owned.numel(), "no page twice, in a row or across rows"
        assert int(owned.min()) >= 1 and int(owned.max()) < nb, "real pages: never block 0, inside the cache"
        for r, n in enumerate(need):
            assert bool((t[r, n:] == pages.NULL_BLOCK).all()), "columns past the reservation: the null block"
        if policy == "strict":
            assert need == [width] * len(lens)
        # the same table for the same layout and seed: it is public, shared by every secret class
        again = pages.reserved_table(res, block_size=bs, num_blocks=nb, width=width, layout=layout, seed=2)
        assert torch.equal(t, again)


def test_reserved_table_layouts_differ_and_follow_their_orders():
    bs, nb = 16, 4000
    res = [64 * bs] * 8
    tables = {lay: pages.reserved_table(res, block_size=bs, num_blocks=nb, layout=lay, seed=1) for lay in pages.LAYOUTS}
    c = tables["consecutive"]
    assert torch.equal(c.flatten(), torch.arange(1, 8 * 64 + 1, dtype=torch.int32))
    assert not torch.equal(tables["random"], c) and not torch.equal(tables["churned"], c)
    assert not torch.equal(tables["random"], tables["churned"])
    order = pages.churned_order(nb, seed=1)
    assert tables["churned"].flatten().tolist() == order[: 8 * 64], "requests take the free list head first"
    with pytest.raises(ValueError):
        pages.reserved_table([nb * bs], block_size=bs, num_blocks=nb, layout="churned")  # cache too small
    with pytest.raises(ValueError):
        pages.page_order("decoy", 100)


def test_recorded_orders_are_the_live_ones_and_load_without_vllm(monkeypatch):
    """The GPU machine may lack vLLM: the audit's default caches load from the recorded file, which must
    be what vLLM's pool gives here."""
    import json

    with np.load(pages.RECORDED_ORDERS, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
    assert meta["params"] == pages.DEFAULT_CHURN
    sizes = sorted(int(k.split("_")[0][1:]) for k in meta["orders"])
    from dhp_backend.audit import classes

    for step in ((16, 1), (4, 64)):
        for L in (4096, 32768):
            assert classes.default_num_blocks(step[0], L, 16) in sizes, "every default G4 cache is recorded"
    live = {n: pages.churned_order(n, seed=0) for n in sizes}
    for n in sizes:
        assert pages.churn_fingerprint(live[n]) == meta["orders"][f"n{n}_s0"]["fingerprint"]
    monkeypatch.setitem(sys.modules, "vllm.v1.core.block_pool", None)  # as if vLLM were not installed
    for n in sizes:
        assert pages.churned_order(n, seed=0) == live[n]
        st = pages.CHURN_STATS[(n, 0, *pages.DEFAULT_CHURN.values())]
        assert st["source"].startswith("recorded") and st["handed_out"] >= 4 * n
    with pytest.raises(ImportError, match="recorded"):
        pages.churned_order(1234, seed=0)
