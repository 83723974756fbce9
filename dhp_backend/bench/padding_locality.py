"""Does padding cost what real positions cost?  Short vs long true length under
``strict``, for two decoy maps and two page layouts (GPU).

    python -m dhp_backend.bench.padding_locality [--rounds 3000] [--out FILE.json]

G4 (``dhp-backend audit timing``) is the gate; this is the quick experiment
behind a fix. A padded request reads decoy pages where a long one reads its own:
if the decoys have another DRAM/TLB locality than the real pages, the two run
at different speeds. Compared, interleaved launch by launch in random order:

- decoy map: the kernel's scatter (``launch.decoy_mult``), the unscattered
  column-major map (multiplier 1, the map before the fix), and, as a diagnostic,
  the table's own entries (multiplier 0: short and long read the very same
  pages, so what remains is the data: masked scores and zeroed V rows);
- page layout (public, the block table): a random permutation (a fragmented
  cache) and consecutive pages (a freshly filled one).

Prints, per combination, the mean short/long time difference and Welch's t.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from dhp_backend.audit import classes


def welch(a, b):
    """(mean a, mean b, Welch's t of a - b) of two samples (also bench.decoy_layouts)."""
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    return ma, mb, (ma - mb) / math.sqrt(va / len(a) + vb / len(b))


def _inputs(shape, cls, layout):
    x = classes.make_inputs(shape, cls, seed=0, device="cuda")
    if layout == "consecutive":
        B, W = x["block_table"].shape
        x["block_table"] = torch.arange(B * W, dtype=torch.int32, device="cuda").view(B, W).contiguous()
    return x


def measure(shape, layout, mult, rounds, seed=0):
    from dhp_backend.ops.triton import paged_attention_triton

    sets = {c: _inputs(shape, c, layout) for c in ("short", "long")}
    outs = {c: classes.empty_out(x) for c, x in sets.items()}

    def launch(c):
        x = sets[c]
        paged_attention_triton(x["query"], x["key_cache"], x["value_cache"], x["block_table"],
                               x["query_start_loc"], x["seq_lens"], outs[c], scale=shape.head_size ** -0.5,
                               causal=True, num_tokens=x["num_tokens"], policy="strict", bucket=shape.bucket,
                               _decoy_mult=mult)

    for c in ("short", "long"):
        for _ in range(20):
            launch(c)
    rng = random.Random(seed)
    order = [c for _ in range(rounds) for c in rng.sample(("short", "long"), 2)]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
    torch.cuda.synchronize()
    for c, (e0, e1) in zip(order, ev):
        e0.record()
        launch(c)
        e1.record()
    torch.cuda.synchronize()
    t = {"short": [], "long": []}
    for c, (e0, e1) in zip(order, ev):
        t[c].append(e0.elapsed_time(e1) * 1e3)
    ms, ml, tt = welch(t["short"], t["long"])
    return dict(layout=layout, decoy_mult=mult, us_short=round(ms, 3), us_long=round(ml, 3),
                short_vs_long_pct=round(100 * (ms - ml) / ml, 3), welch_t=round(tt, 2), rounds=rounds)


def main(argv=None):
    from dhp_backend.ops.triton import launch as tlaunch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bucket", type=int, default=4096)
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    shape = classes.Shape(batch=a.batch, bucket=a.bucket)
    num_blocks = shape.batch * -(-shape.bucket // shape.block_size) + 16
    rows = []
    for layout in ("random", "consecutive"):
        for mult in (tlaunch.decoy_mult(num_blocks), 1, 0):
            rows.append(measure(shape, layout, mult, a.rounds))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\npadding locality, {shape.key}, {a.rounds} rounds per class (negative: padded runs faster)")
    print("| page layout | decoy multiplier (0: the table's pages) | short us | long us | short vs long | Welch t |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layout']} | {r['decoy_mult']} | {r['us_short']} | {r['us_long']} | "
              f"{r['short_vs_long_pct']:+.3f} % | {r['welch_t']:+.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": shape.key, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
