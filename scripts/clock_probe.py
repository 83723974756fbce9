"""SM clock and power while a decode kernel runs back to back (CUDA-graph replays),
per target: does a sustained memory-bound launch stream run at a lower SM clock,
and does it cost one kernel more than another? Usage:
    python scripts/clock_probe.py B16-32k m2x2_pv_ef fa3 [--seconds 4]
Prints, per target: us per call, median / p10 SM clock (MHz) and power (W) sampled by
nvidia-smi every 50 ms while the replays run."""
import argparse
import statistics
import subprocess
import time

import torch

from dhp_backend.bench.cuda_decode import _shape, _table_width, cuda_fn
from dhp_backend.bench.cuda_prefill import fa3_fn, make_step

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("targets", nargs="+")
ap.add_argument("--seconds", type=float, default=4.0)
args = ap.parse_args()
B, ctx, reqs = _shape(args.shape)
gen = torch.Generator(device="cuda").manual_seed(0)
sets = [make_step(reqs, gen, width=_table_width(args.shape)) for _ in range(2)]
for target in args.targets:
    fns = [fa3_fn(s, True) if target == "fa3" else cuda_fn(s, target) for s in sets]
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(20):
            fns[i % 2]()
    g.replay()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    n = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() - t0 < args.seconds:
        for _ in range(10):
            g.replay()
        n += 200
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out = smi.communicate()[0]
    rows = [[float(x) for x in line.split(",")] for line in out.strip().splitlines()
            if line.count(",") == 2 and "N/A" not in line]
    rows = rows[len(rows) // 5:]  # past the ramp
    clk = sorted(r[0] for r in rows)
    pw = [r[1] for r in rows]
    us = start.elapsed_time(end) * 1000 / n
    print(f"{args.shape} {target:14s} {us:8.1f} us/call  SM clock median {statistics.median(clk):.0f} MHz "
          f"(p10 {clk[len(clk) // 10]:.0f})  power median {statistics.median(pw):.0f} W  "
          f"temp {rows[-1][2]:.0f} C  ({len(rows)} samples)", flush=True)
    time.sleep(1.0)
