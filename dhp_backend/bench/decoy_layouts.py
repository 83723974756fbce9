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
- ``scatter``: x * decoy_mult mod n (the Triton kernels' decoy map; the csrc CT
  kernels' before perf-notes change 35);
- ``perm``: a random permutation of the cache indexed by x (a table);
- ``decoys``: the csrc CT kernels' default decoy map (the scatter shuffled by a
  12-round swap-or-not bijection, launch.csrc_decoy_page).

With it the G4 short class itself (true length q_len: its padding on the kernels'
decoys), and under Triton the same on the table's own pages (the diagnostic of
bench.padding_locality: what is left when short and long read the same pages).

Launches of all tables are interleaved in random order; each row gives the mean
time, its difference to ``random`` and Welch's t.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from dhp_backend.audit import classes
from dhp_backend.bench.padding_locality import welch

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
        "decoys": torch.tensor([[tlaunch.csrc_decoy_page(i, j, batch, n) for j in range(width)] for i in range(batch)]),
    }
    for k, t in out.items():
        assert int(t.min()) >= 0 and int(t.max()) < n, k
        if k not in ("random", "random2", "consecutive"):  # the maps are bijections: distinct pages when (B+1)W <= n
            assert t.unique().numel() == t.numel() or (batch + 1) * width > n, k
    return {k: t.to(torch.int32).cuda().contiguous() for k, t in out.items()}


def measure(shape: classes.Shape, kernel: str, rounds: int, seed: int = 0, chunk: int = 32) -> list[dict]:
    """Graph replays of one launch per table, interleaved in random order, in chunks
    queued behind a GPU sleep (as G4's timer: the host never starves the GPU)."""
    from dhp_backend.audit.timing import gpu_sleep_cycles_per_ms

    x = classes.make_inputs(shape, "long", seed=0, device="cuda")
    short = classes.make_inputs(shape, "short", seed=0, device="cuda")  # same layout and data, true length q_len
    nb = x["key_cache"].shape[0]
    width = x["block_table"].shape[1]
    tabs = tables(shape.batch, width, nb, x["block_table"])
    scale = shape.head_size ** -0.5
    # (name, table, seq_lens, test hooks): every table with all-real requests, and the
    # G4 short class itself (its padding on the kernels' decoys; under Triton also on
    # the table's own pages, the diagnostic of bench.padding_locality)
    configs = [(f"long:{k}", t, x["seq_lens"], {}) for k, t in tabs.items()]
    configs.append(("short:decoys", x["block_table"], short["seq_lens"], {}))
    if kernel == "triton":
        configs.append(("short:table", x["block_table"], short["seq_lens"], {"_decoy_mult": 0}))

    def launch(t, sl, o, hooks):
        if kernel == "cuda_ct":
            from dhp_backend.ops.cuda_decode import decode_sm90

            decode_sm90(x["query"], x["key_cache"], x["value_cache"], t, x["query_start_loc"], sl, o,
                        scale=scale, causal=True, num_tokens=x["num_tokens"], bucket=shape.bucket, check=False)
        else:
            from dhp_backend.ops.triton import paged_attention_triton

            paged_attention_triton(x["query"], x["key_cache"], x["value_cache"], t, x["query_start_loc"],
                                   sl, o, scale=scale, causal=True, num_tokens=x["num_tokens"],
                                   policy="strict", bucket=shape.bucket, **hooks)

    outs = [classes.empty_out(x) for _ in configs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for (_, t, sl, h), o in zip(configs, outs):
            for _ in range(3):
                launch(t, sl, o, h)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for (_, t, sl, h), o in zip(configs, outs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch(t, sl, o, h)
        graphs.append(g)
    for (name, *_), g, o in zip(configs, graphs, outs):  # correctness first: no timing of broken launches
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        if not torch.isfinite(o[: x["num_tokens"]].float()).all():
            raise RuntimeError(f"{kernel} {name}: non-finite output")
    cyc = gpu_sleep_cycles_per_ms(torch)
    names = [c[0] for c in configs]
    times = {k: [] for k in names}
    rng = random.Random(seed)
    n = len(configs)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(chunk * n)]
    for g in graphs * 20:
        g.replay()
    done = 0
    while done < rounds:
        order = [i for _ in range(chunk) for i in rng.sample(range(n), n)]
        torch.cuda.synchronize()
        if cyc:
            torch.cuda._sleep(int(2.0 * cyc))  # 2 ms: more than the host needs to queue the chunk
        for i, (e0, e1) in zip(order, ev):
            e0.record()
            graphs[i].replay()
            e1.record()
        torch.cuda.synchronize()
        for i, (e0, e1) in zip(order, ev):
            times[names[i]].append(e0.elapsed_time(e1) * 1e3)
        done += chunk
    rows = []
    for k in names:
        m, mr, t = welch(times[k], times["long:random"])
        rows.append(dict(shape=shape.key, kernel=kernel, config=k, us=round(m, 3),
                         vs_random_pct=round(100 * (m - mr) / mr, 3), welch_t=round(t, 2), rounds=len(times[k])))
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
    print("| shape | kernel | lengths:pages | us | vs long:random | Welch t |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['kernel']} | {r['config']} | {r['us']} | {r['vs_random_pct']:+.3f} % | "
              f"{r['welch_t']:+.1f} |")


if __name__ == "__main__":
    main()
