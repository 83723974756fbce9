"""Which decoy map reads the cache the way real pages do?  (GPU experiment)

    python -m dhp_backend.bench.decoy_layouts [--rounds 10000] [--shapes 16,4096 64,4096] [--out F.json]

G4 finds padded steps slower than real ones (the page-locality leak: README's
security notes). A padded request reads decoy pages where a long one reads its
own, so the question is one of *page order*: does walking the pages that a decoy
map names cost what walking a real page layout costs? This times the strict
kernels on all-real requests (every position real, so scores, masks and V are
the same work) under block tables whose entries are:

- ``random`` / ``random2``: two random layouts (the audit's real pages; the pair
  is the control: how far apart two real layouts are);
- ``consecutive``: a freshly filled cache (pages 0, 1, 2, ...);
- ``colmajor``: the decoy map's column-major index x(r, lb) itself (the map before
  the scatter);
- ``scatter``: the kernels' decoy map (x * decoy_mult mod n);
- ``perm``: a random permutation of the cache indexed by x (a table);
- ``son<R>``: a swap-or-not shuffle of x with R rounds (`swap_or_not`, computed).

Launches of all tables are interleaved in random order; each row gives the mean
time, its difference to ``random`` and Welch's t.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from dhp_backend.audit import classes

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for uint32 values in int64 (in 16-bit halves: no int64 overflow)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (int64 tensor holding uint32 values)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def swap_or_not(x: torch.Tensor, n: int, rounds: int) -> torch.Tensor:
    """A bijection of [0, n) (Hoang, Morris, Rogaway's swap-or-not shuffle): each
    round pairs x with K - x mod n and swaps by a hash of the pair, an involution."""
    for i in range(rounds):
        k = int(hash32(torch.tensor([n * 31 + i])).item()) % n
        p = (k - x) % n
        b = hash32(torch.maximum(x, p) ^ (0x9E3779B9 * (i + 1) & MASK32)) & 1
        x = torch.where(b == 1, p, x)
    return x


def tables(batch: int, width: int, n: int, base: torch.Tensor) -> dict[str, torch.Tensor]:
    from dhp_backend.ops.triton import launch as tlaunch

    r = torch.arange(batch, dtype=torch.int64).view(-1, 1)
    lb = torch.arange(width, dtype=torch.int64).view(1, -1)
    x = (lb * (batch + 1) + r) % n
    g = torch.Generator().manual_seed(2)
    perm = torch.randperm(n, generator=g)
    out = {
        "random": base.cpu().to(torch.int64),
        "random2": torch.randperm(n, generator=torch.Generator().manual_seed(1))[: batch * width].view(batch, width),
        "consecutive": torch.arange(batch * width).view(batch, width),
        "colmajor": x,
        "scatter": (x * tlaunch.decoy_mult(n)) % n,
        "perm": perm[x],
        "son6": swap_or_not(x, n, 6),
        "son12": swap_or_not(x, n, 12),
    }
    for k, t in out.items():
        assert int(t.min()) >= 0 and int(t.max()) < n, k
        if k not in ("random", "random2", "consecutive"):  # the maps are bijections: distinct pages when (B+1)W <= n
            assert t.unique().numel() == t.numel() or (batch + 1) * width > n, k
    return {k: t.to(torch.int32).cuda().contiguous() for k, t in out.items()}


def _welch(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((v - ma) ** 2 for v in a) / (len(a) - 1)
    vb = sum((v - mb) ** 2 for v in b) / (len(b) - 1)
    return ma, mb, (ma - mb) / math.sqrt(va / len(a) + vb / len(b))


def measure(shape: classes.Shape, kernel: str, rounds: int, seed: int = 0) -> list[dict]:
    x = classes.make_inputs(shape, "long", seed=0, device="cuda")
    nb = x["key_cache"].shape[0]
    width = x["block_table"].shape[1]
    tabs = tables(shape.batch, width, nb, x["block_table"])
    out = classes.empty_out(x)
    scale = shape.head_size ** -0.5

    def launch(t):
        if kernel == "cuda_ct":
            from dhp_backend.ops.cuda_decode import decode_sm90

            decode_sm90(x["query"], x["key_cache"], x["value_cache"], t, x["query_start_loc"], x["seq_lens"], out,
                        scale=scale, causal=True, num_tokens=x["num_tokens"], bucket=shape.bucket, check=False)
        else:
            from dhp_backend.ops.triton import paged_attention_triton

            paged_attention_triton(x["query"], x["key_cache"], x["value_cache"], t, x["query_start_loc"],
                                   x["seq_lens"], out, scale=scale, causal=True, num_tokens=x["num_tokens"],
                                   policy="strict", bucket=shape.bucket)

    ref = None
    for name, t in tabs.items():  # correctness first: every table reads real pages, so outputs differ
        launch(t)
        torch.cuda.synchronize()
        if not torch.isfinite(out[: x["num_tokens"]].float()).all():
            raise RuntimeError(f"{kernel} {name}: non-finite output")
        ref = out.clone() if ref is None else ref
        for _ in range(20):
            launch(t)
    names = list(tabs)
    rng = random.Random(seed)
    order = [k for _ in range(rounds) for k in rng.sample(names, len(names))]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
    torch.cuda.synchronize()
    for k, (e0, e1) in zip(order, ev):
        e0.record()
        launch(tabs[k])
        e1.record()
    torch.cuda.synchronize()
    times = {k: [] for k in names}
    for k, (e0, e1) in zip(order, ev):
        times[k].append(e0.elapsed_time(e1) * 1e3)
    rows = []
    for k in names:
        m, mr, t = _welch(times[k], times["random"])
        rows.append(dict(shape=shape.key, kernel=kernel, table=k, us=round(m, 3),
                         vs_random_pct=round(100 * (m - mr) / mr, 3), welch_t=round(t, 2), rounds=rounds))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--shapes", nargs="+", default=["16,4096", "64,4096"], help="B,L pairs")
    ap.add_argument("--kernels", nargs="+", default=["cuda_ct", "triton"])
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    rows = []
    for s in a.shapes:
        b, L = (int(v) for v in s.split(","))
        shape = classes.Shape(batch=b, bucket=L)
        for kern in a.kernels:
            print(f"... {shape.key} {kern}", flush=True)
            rows += measure(shape, kern, a.rounds)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"rows": rows}, f, indent=1)
    print("\ndecoy maps as page layouts, all-real requests (positive: slower than a random layout)")
    print("| shape | kernel | table | us | vs random | Welch t |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['kernel']} | {r['table']} | {r['us']} | {r['vs_random_pct']:+.3f} % | "
              f"{r['welch_t']:+.1f} |")


if __name__ == "__main__":
    main()
