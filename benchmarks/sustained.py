"""Decode under sustained load: the csrc decode kernel against FA3 when each runs
back to back for seconds, with the SM clock and board power sampled meanwhile.

    python -m benchmarks.sustained [--shapes B16-32k,...] [--seconds 3] [--out DIR]

Why: the harness (and `benchmarks.cuda_decode`) time the median of ~100 launches after
a short warm-up, a burst that starts from whatever clock the idle card had. A
serving engine decodes without pause; on an H200 a memory-bound decode stream
then sits at the 700 W board limit and the SM clock drops (1.4-1.8 GHz instead of
1.98), by how much depends on the kernel. The two regimes can rank kernels
differently, so this reports both: ``burst`` (graph replays, median of 60 after
3 warm-up) and ``sustained`` (graph replays for ``--seconds`` after a second of
untimed load; mean time per call over the window).

Same steps as `benchmarks.cuda_decode` (Llama-3-8B heads, bf16, block 16, random
block table, NaN in unowned slots); each target checked against SDPA before it is
timed. Targets: ``fa3`` and ``dhp`` (the decode kernel ops.paged_attention runs
under policy off: `ops.cuda_decode` variant "auto"). Output: a table, JSON and a
PNG (sustained and burst ratio per shape) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from benchmarks import cuda_runs
from benchmarks.cuda_decode import _shape, _table_width, cuda_fn, kv_bytes
from benchmarks.cuda_prefill import fa3_fn, make_step, sdpa_ref

SHAPES = [f"B{b}-{c}k" for c in (4, 16, 32) for b in (1, 4, 16, 64, 256)]
TARGETS = ("fa3", "dhp")
CALLS_PER_GRAPH = 20


class PowerSampler:
    """nvidia-smi sampling SM clock (MHz) and board power (W) every ``ms``."""

    def __init__(self, ms: int = 50):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", str(ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> list[tuple[float, float]]:
        self.proc.terminate()
        out = self.proc.communicate()[0]
        rows = []
        for line in out.strip().splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:
                rows.append((float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue  # "[N/A]" or a partial line at termination
        return rows


def _graph(fns):
    """One graph of CALLS_PER_GRAPH calls alternating over the input sets."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS_PER_GRAPH):
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    return g


def burst_us(g, reps: int = 60, warmup: int = 3) -> float:
    """The harness's regime: median over ``reps`` timed replays after ``warmup``."""
    for _ in range(warmup):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def sustained(g, seconds: float, settle: float = 1.0) -> dict:
    """Back-to-back replays: ``settle`` s untimed, then ``seconds`` timed, clock and power sampled."""
    t0 = time.time()
    while time.time() - t0 < settle:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    sampler = PowerSampler()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    t0 = time.time()
    a.record()
    while time.time() - t0 < seconds:
        for _ in range(5):
            g.replay()
        calls += 5 * CALLS_PER_GRAPH
        torch.cuda.synchronize()
    b.record()
    b.synchronize()
    samples = sampler.stop()
    clk = sorted(s[0] for s in samples)
    return dict(us=a.elapsed_time(b) * 1e3 / calls, calls=calls,
                sm_mhz_median=statistics.median(clk) if clk else None,
                sm_mhz_p10=clk[len(clk) // 10] if clk else None,
                power_w_median=statistics.median(s[1] for s in samples) if samples else None,
                samples=len(samples))


def run(shapes, seconds: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    t_start = time.time()
    for k, shape in enumerate(shapes):
        B, ctx, reqs = _shape(shape)
        # Two input sets alternate (inputs past L2 either way); one where FA3's copies of
        # two sets would not fit the card (B256 at 32K: 34 GB of K/V per set).
        n_sets = 1 if kv_bytes(reqs) > 8 * 2**30 else 2
        sets = [make_step(reqs, gen, width=_table_width(shape)) for _ in range(n_sets)]
        ref = sdpa_ref(sets[0], True)
        for target in TARGETS:
            row = dict(shape=shape, batch=B, ctx=ctx, target=target)

            def measure(fns_):
                g = _graph(fns_)
                row["burst_us"] = burst_us(g)
                row.update({f"sustained_{key}": v for key, v in sustained(g, seconds).items()})
                del g
                return row["burst_us"] / 1e3

            try:
                fns = [fa3_fn(s, True) if target == "fa3" else cuda_fn(s, "auto") for s in sets]
                cuda_runs.check_and_time(row, fns, ref, measure)
            except Exception as e:  # noqa: BLE001 - a failing target is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            fns = None  # FA3's copies of the cache and the graphs' pools go before the next target
            torch.cuda.empty_cache()
            if row.get("sustained_us"):
                row["sustained_tb_s"] = kv_bytes(reqs) / row["sustained_us"] / 1e6
            rows.append(row)
            time.sleep(0.5)
        sets = ref = None
        torch.cuda.empty_cache()
        mine = {r["target"]: r for r in rows[-len(TARGETS):]}
        fa3, dhp = mine.get("fa3", {}), mine.get("dhp", {})
        for key in ("burst_us", "sustained_us"):
            if fa3.get(key) and dhp.get(key):
                dhp[f"{key.split('_')[0]}_vs_fa3"] = fa3[key] / dhp[key]
        print(f"[{k + 1}/{len(shapes)} {time.time() - t_start:5.0f}s] {shape}: "
              + "; ".join(f"{t} burst {r.get('burst_us', float('nan')):.1f} us, sustained "
                          f"{r.get('sustained_us', float('nan')):.1f} us @ {r.get('sustained_sm_mhz_median')} MHz "
                          f"{r.get('sustained_power_w_median')} W" + (f" ({r['error']})" if r.get("error") else "")
                          for t, r in mine.items())
              + (f" -> dhp/fa3 burst {dhp.get('burst_vs_fa3', float('nan')):.3f}, "
                 f"sustained {dhp.get('sustained_vs_fa3', float('nan')):.3f}"), flush=True)
    return rows


def table(rows) -> str:
    head = ("| shape | target | burst us | sustained us | SM MHz (median, p10) | power W | burst x FA3 | "
            "sustained x FA3 |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        def f(key, fmt="{:.1f}"):
            v = r.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        lines.append(f"| {r['shape']} | {r['target']} | {f('burst_us')} | {f('sustained_us')} | "
                     f"{f('sustained_sm_mhz_median', '{:.0f}')}, {f('sustained_sm_mhz_p10', '{:.0f}')} | "
                     f"{f('sustained_power_w_median', '{:.0f}')} | {f('burst_vs_fa3', '{:.3f}')} | "
                     f"{f('sustained_vs_fa3', '{:.3f}')} |" + (f" {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


def plot(rows, path: str) -> str | None:
    """The PNG of the DHP rows' ratios; returns why not when it was not written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib to get it)"
    dhp = [r for r in rows if r["target"] == "dhp" and r.get("sustained_vs_fa3")]
    if not dhp:
        return "plot skipped: no DHP row with both ratios"
    x = range(len(dhp))
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(dhp)), 3.6))
    ax.bar([i - 0.2 for i in x], [r["burst_vs_fa3"] for r in dhp], 0.4, label="burst (median of 60)")
    ax.bar([i + 0.2 for i in x], [r["sustained_vs_fa3"] for r in dhp], 0.4, label="sustained (power-capped)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), [r["shape"] for r in dhp], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("FA3 time / DHP time")
    ax.set_ylim(0.8, max(1.2, max(max(r["burst_vs_fa3"], r["sustained_vs_fa3"]) for r in dhp) + 0.05))
    ax.set_title("DHP decode (policy off) vs FA3: burst vs sustained load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="as benchmarks.cuda_decode (B<batch>-<ctx>k[-w<cap>k])")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed back-to-back window per target (default 3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dhp_backend.ops.cuda_common import unavailable_reason

    reason = unavailable_reason() if torch.cuda.is_available() else "no CUDA device"
    if reason:
        ap.error(f"needs an sm_90 GPU ({reason})")
    rows = run(args.shapes.split(","), args.seconds)
    md = table(rows)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        doc = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DHP_COMMIT"), seconds=args.seconds,
                   calls_per_graph=CALLS_PER_GRAPH, rows=rows, date=time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(os.path.join(args.out, "sustained.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "sustained.md"), "w") as f:
            f.write(md + "\n")
        why = plot(rows, os.path.join(args.out, "sustained.png"))
        if why:
            print(why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
