"""`dhp-backend audit timing`: gate G4 (design.md section 3), a dudect-style timing test on the GPU.

For each shape and each pair of secret classes (`classes.GATING_PAIRS` gate,
`classes.REPORTED_PAIRS` are measured and reported only), both input sets are
built (separate buffers, same public shape), each launch is checked to give
finite output, and then N *rounds* run: one launch of each class per round,
in an order drawn from a seeded RNG. Every launch is timed with a pair of
CUDA events around one `classes.launch`. Statistics (`audit.stats`): online
Welch t, cropped Welch t (secondary), and paired sign / Wilcoxon tests of the
per-round differences. A pair passes with |t| < 4.5 and paired |z| < 4.5
after >= 10^5 samples per class. Verdicts: gating pairs "pass", "FAIL",
"too few samples" (not a pass) or "error" (not measured: the reason is in
``error``); the control "leak detected" or "NOT DETECTED"; reported pairs
"differs" or "no difference seen".

How the host is kept out of the numbers. Rounds run in chunks (``--chunk``,
default 128): the stream is synchronised, a GPU spin (`torch.cuda._sleep`)
sized to 1.5x the host's measured enqueue time of a chunk is queued, then the
chunk's launches and events, then one synchronisation and the chunk's event
times are read. While the GPU spins the host queues the whole chunk ahead of
it, so no start event fires before its kernel is queued (otherwise a launch's
time would include the host's Python and launch overhead whenever the GPU is
faster than the host, which it is for short launches). A chunk whose enqueue
took longer than its spin is counted as *starved* in the report. Chunks are
small so the pending-work queue never fills (a full queue blocks the host).

Modes: ``eager`` (each round calls `classes.launch`) and ``graph`` (one CUDA
graph per class holding one launch, captured after a warm-up on a side
stream; rounds replay the graphs). The **control** is the `off` policy with
classes short vs long: true lengths are public there, so the harness must see
a difference (|t| > 4.5) in every mode, else "the harness cannot detect a
leak" and the gate fails.

Arguments (`add_arguments`)::

    --shapes "16,4096"      shapes "batch,bucket[,q_len]", several separated by ";" or spaces
                            (other public parameters: classes.Shape defaults)
    --policy strict         policy of the gating / reported pairs (the control always uses "off")
    --samples 100000        rounds (= samples per class) of each gating pair
    --reported-samples 20000  rounds of each reported (degenerate-data) pair
    --control-samples 20000   rounds of the control pair
    --graph / --no-graph    also measure in CUDA-graph replay (default: on)
    --chunk 128             rounds between synchronisations
    --warmup 50             untimed rounds before timing
    --seed 0                RNG seed of the launch order (input data: classes.make_inputs's seeds)
    --report-dir docs/audit write <date>-timing-<device>.md/.json and PNG plots there ("" = no files)
    --save-samples          also write every raw sample to <stem>-samples.npz
    --json                  print the summary as JSON (progress goes to stderr)

Report JSON keys: ``gate, date, device, versions, settings, renderer, summary,
results``; ``summary``: ``passed, control_detected, gating_passed, failures,
messages, seconds``; each result: ``pair, a, b, role, mode, shape, policy, path, n,
mean_us, std_us, median_us, diff_pct, t, df, cropped_t_max, cropped_quantile,
paired, verdict, passed, detected, chunks, starved_chunks, trace, plots,
error``.

Exit code of `run`: 0 when every gating pair passes and the control detects its
leak in every mode, 1 otherwise, 2 without a CUDA GPU (G4 runs on the GPU
machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import sys
import time

from dhp_backend.audit.provenance import device_slug, report_stem, versions, write_report_files
import zlib

import numpy as np

from dhp_backend.audit import stats

DEFAULT_SAMPLES = 100_000
DEFAULT_SIDE_SAMPLES = 20_000
CONTROL = ("short", "long")
RESULT_KEYS = ("pair", "a", "b", "role", "mode", "shape", "policy", "path", "n", "mean_us", "std_us", "median_us",
               "diff_pct", "t", "df", "cropped_t_max", "cropped_quantile", "paired", "verdict", "passed",
               "detected", "chunks", "starved_chunks", "trace", "plots", "error")
REPORT_KEYS = ("gate", "date", "device", "versions", "settings", "renderer", "summary", "results")
SUMMARY_KEYS = ("passed", "control_detected", "gating_passed", "failures", "messages", "seconds")


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="16,4096",
                        help='"batch,bucket[,q_len]" per shape, several separated by ";" (default 16,4096)')
    parser.add_argument("--policy", default="strict", choices=["strict", "batch", "request", "off"],
                        help="policy of the gating and reported pairs (the control always uses off)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="rounds per gating pair")
    parser.add_argument("--reported-samples", type=int, default=DEFAULT_SIDE_SAMPLES,
                        help="rounds per reported (degenerate-data) pair")
    parser.add_argument("--control-samples", type=int, default=DEFAULT_SIDE_SAMPLES,
                        help="rounds of the control pair (policy off, short vs long)")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                        help="also time CUDA-graph replays (default: on)")
    parser.add_argument("--chunk", type=int, default=128, help="rounds between synchronisations")
    parser.add_argument("--warmup", type=int, default=50, help="untimed rounds before timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the launch-order RNG")
    parser.add_argument("--report-dir", default=os.path.join("docs", "audit"),
                        help='write <date>-timing-<device>.md/.json and PNGs here ("" = none)')
    parser.add_argument("--save-samples", action="store_true", help="also write raw samples to <stem>-samples.npz")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def parse_shapes(text: str, policy: str = "strict") -> list:
    from dhp_backend.audit import classes

    shapes = []
    for item in re.split(r"[;\s]+", text.strip()):
        if not item:
            continue
        try:
            nums = [int(x) for x in item.split(",")]
        except ValueError:
            raise ValueError(f"--shapes: {item!r} is not batch,bucket[,q_len] (integers)") from None
        if len(nums) not in (2, 3) or min(nums) <= 0:
            raise ValueError(f"--shapes: {item!r} is not batch,bucket[,q_len] (positive integers)")
        shapes.append(classes.Shape(batch=nums[0], bucket=nums[1], q_len=nums[2] if len(nums) == 3 else 1,
                                    policy=policy))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def run(args: argparse.Namespace) -> int:
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        shapes = parse_shapes(args.shapes, args.policy)
        for name in ("samples", "reported_samples", "control_samples", "chunk"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    except ValueError as e:
        print(f"dhp-backend audit timing: {e}", file=sys.stderr)
        return 2
    try:
        import torch
        have_gpu = torch.cuda.is_available()
    except ImportError:
        have_gpu = False
    if not have_gpu:
        print("dhp-backend audit timing: no CUDA GPU here. G4 (the timing gate) times kernel launches with "
              "CUDA events, so it runs on the GPU machine.", file=sys.stderr)
        return 2

    t0 = time.time()
    modes = ("eager", "graph") if args.graph else ("eager",)
    results = []
    timer = Timer(chunk=args.chunk, warmup=args.warmup, progress=log)
    log(f"G4 timing gate on {timer.device_name}: {len(shapes)} shape(s), modes {', '.join(modes)}; "
        f"GPU spin {timer.cycles_per_ms / 1e6:.2f} Gcycles/s" if timer.cycles_per_ms else
        f"G4 timing gate on {timer.device_name}: torch.cuda._sleep missing, no host pad (see starved chunks)")
    for shape in shapes:
        for spec in plan(shape, args.samples, args.reported_samples, args.control_samples):
            results += timer.measure_pair(spec, modes, seed=args.seed)
    s = summarize(results, time.time() - t0)
    meta = {"device": timer.device_name, "versions": versions(), "settings": {
        k: getattr(args, k) for k in ("shapes", "policy", "samples", "reported_samples", "control_samples",
                                      "graph", "chunk", "warmup", "seed")} | {"host_pad": timer.pad_note()}}
    if args.report_dir:
        s["reports"] = list(write_reports(args.report_dir, s, results, meta, save_samples=args.save_samples))
    if args.json:
        print(json.dumps(s, indent=2, default=str))
    else:
        print_summary(s, results)
    return 0 if s["passed"] else 1


# ---------------------------------------------------------------- what to measure

@dataclasses.dataclass(frozen=True)
class PairSpec:
    shape: object  # classes.Shape
    a: str
    b: str
    role: str  # "control" | "gating" | "reported"
    rounds: int

    @property
    def label(self) -> str:
        return f"{self.a} vs {self.b}"


def plan(shape, samples: int, reported_samples: int, control_samples: int) -> list[PairSpec]:
    """Control first (if it fails the rest is moot but still measured), then gating, then reported pairs."""
    from dhp_backend.audit import classes

    specs = [PairSpec(dataclasses.replace(shape, policy="off"), *CONTROL, "control", control_samples)]
    specs += [PairSpec(shape, a, b, "gating", samples) for a, b in classes.GATING_PAIRS]
    specs += [PairSpec(shape, a, b, "reported", reported_samples) for a, b in classes.REPORTED_PAIRS]
    return specs


# ---------------------------------------------------------------- online analysis (GPU and synthetic)

class PairStats:
    """Everything `result` reports, updated one chunk of rounds at a time."""

    def __init__(self) -> None:
        self.welch = stats.WelchT()
        self.crop = stats.CroppedWelch()
        self._a: list[np.ndarray] = []
        self._b: list[np.ndarray] = []
        self.trace = {"n": [], "t": [], "z_n": [], "z": []}
        self.chunks = self.starved = 0

    def add(self, ta, tb, starved: bool = False) -> None:
        ta, tb = np.asarray(ta, np.float64), np.asarray(tb, np.float64)
        self.welch.update_batch(0, ta)
        self.welch.update_batch(1, tb)
        self.crop.update_batch(ta, tb)
        self._a.append(ta)
        self._b.append(tb)
        self.chunks += 1
        self.starved += bool(starved)
        self.trace["n"].append(self.welch.n[0])
        self.trace["t"].append(self.welch.t)

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        a, b = np.concatenate(self._a or [np.empty(0)]), np.concatenate(self._b or [np.empty(0)])
        self._a, self._b = [a], [b]
        return a, b

    def checkpoint(self) -> float:
        """Paired z now (sorting all differences: called at ~10 % steps, not per chunk)."""
        a, b = self.samples()
        z = stats.paired(a - b)["z_max"] if a.size else math.nan
        self.trace["z_n"].append(int(a.size))
        self.trace["z"].append(z)
        return z

    def result(self, spec_like: dict) -> dict:
        a, b = self.samples()
        self.crop.flush()
        p = stats.paired(a - b) if a.size else {"sign": {}, "wilcoxon": {}, "z_max": math.nan,
                                                 "median_diff": math.nan}
        if not self.trace["z_n"] or self.trace["z_n"][-1] != a.size:
            self.trace["z_n"].append(int(a.size))
            self.trace["z"].append(p["z_max"])
        t = self.welch.t
        ma, mb = self.welch.means
        ct, cq = self.crop.max_abs_t()
        role = spec_like["role"]
        detected = stats.leak_detected(t) if role == "control" else None
        verdict = stats.verdict(self.welch.n, t, p["z_max"])
        if role == "control":
            verdict = "leak detected" if detected else "NOT DETECTED"
        elif role == "reported":  # not gating: say what was seen, not pass/fail
            verdict = "differs" if verdict == "FAIL" else "no difference seen"
        return {**spec_like, "n": list(self.welch.n), "mean_us": [ma, mb],
                "std_us": [math.sqrt(v) if v == v else math.nan for v in self.welch.variances],
                "median_us": [float(np.median(a)) if a.size else math.nan, float(np.median(b)) if b.size else math.nan],
                "diff_pct": 100.0 * (mb - ma) / ma if ma else math.nan, "t": t, "df": self.welch.df,
                "cropped_t_max": ct, "cropped_quantile": cq, "paired": p, "verdict": verdict,
                "passed": (verdict == "pass") if role == "gating" else None, "detected": detected,
                "chunks": self.chunks, "starved_chunks": self.starved, "trace": self.trace, "plots": [],
                "error": None, "_samples": (a, b)}


def analyse_streams(xa, xb, *, pair=("random", "random2"), role="gating", mode="synthetic", shape="synthetic",
                    policy="strict", chunk: int = 1024) -> dict:
    """Run recorded or synthetic per-round timings (µs, paired by index) through the gate's analysis."""
    xa, xb = np.asarray(xa, np.float64), np.asarray(xb, np.float64)
    ps = PairStats()
    for i in range(0, xa.size, chunk):
        ps.add(xa[i:i + chunk], xb[i:i + chunk])
    return ps.result(_spec_dict(pair[0], pair[1], role, mode, shape, policy))


def _spec_dict(a, b, role, mode, shape, policy, path=None) -> dict:
    return {"pair": f"{a} vs {b}", "a": a, "b": b, "role": role, "mode": mode, "shape": shape, "policy": policy,
            "path": path}


def error_result(spec: PairSpec, mode: str, why: str) -> dict:
    d = _spec_dict(spec.a, spec.b, spec.role, mode, spec.shape.key, spec.shape.policy)
    return {**d, **{k: None for k in RESULT_KEYS if k not in d}, "n": [0, 0], "verdict": "error",
            "passed": False if spec.role == "gating" else None,
            "detected": False if spec.role == "control" else None, "trace": {"n": [], "t": [], "z_n": [], "z": []},
            "plots": [], "error": why}


# ---------------------------------------------------------------- GPU measurement


def gpu_sleep_cycles_per_ms(torch, cycles: int = 2_000_000) -> float | None:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` (None where torch lacks it).

    The spin pads a timed chunk so that the host has queued it before it runs
    (shared with bench/timer.py)."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = 0.0
    for _ in range(3):  # the first call loads the kernel
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        ms = e0.elapsed_time(e1)
    return cycles / ms if ms > 0 else None

class Timer:
    """Times pairs of classes on the current CUDA device (construct only when CUDA is available)."""

    SLEEP_MARGIN = 1.5
    MAX_SLEEP_MS = 250.0

    def __init__(self, chunk: int = 128, warmup: int = 50, progress=print) -> None:
        import torch

        self.torch, self.chunk, self.warmup, self.progress = torch, chunk, warmup, progress
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.cycles_per_ms = self._calibrate_sleep()

    def _calibrate_sleep(self) -> float | None:
        return gpu_sleep_cycles_per_ms(self.torch)

    def _pad(self, ms: float) -> None:
        if self.cycles_per_ms and ms > 0:
            self.torch.cuda._sleep(int(min(ms, self.MAX_SLEEP_MS) * self.cycles_per_ms))

    def pad_note(self) -> str:
        if not self.cycles_per_ms:
            return "none (torch.cuda._sleep missing)"
        return (f"torch.cuda._sleep of {self.SLEEP_MARGIN}x the chunk's host enqueue time (max "
                f"{self.MAX_SLEEP_MS:.0f} ms), {self.cycles_per_ms / 1e6:.2f} Gcycles/s measured")

    def path_of(self, shape) -> str:
        """The path the dispatcher runs for this shape (a gating pair on the reference path proves little)."""
        try:
            from dhp_backend.ops import dispatch

            spec = dispatch.ProblemSpec(device_type="cuda", dtype=shape.dtype, head_size=shape.head_size,
                                        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                        block_size=shape.block_size, causal=shape.causal,
                                        device_capability=self.torch.cuda.get_device_capability(self.device))
            return dispatch.choose_path(spec, shape.policy, allow_fallback=True).describe()
        except Exception as e:  # noqa: BLE001 - informational only
            return f"unknown ({type(e).__name__}: {e})"

    def _prepare(self, spec: PairSpec, mode: str, inputs: list) -> tuple[list, list, list]:
        """Launch callables for both classes, checked to produce finite output; (fns, outs, graphs)."""
        from dhp_backend.audit import classes

        torch = self.torch
        outs = [classes.empty_out(x) for x in inputs]
        graphs = []
        if mode == "eager":
            fns = [lambda x=x, o=o: classes.launch(x, o) for x, o in zip(inputs, outs)]
        else:
            # PyTorch's recipe: warm up on a side stream (compilation, workspace, caches) then capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for x, o in zip(inputs, outs):
                    for _ in range(3):
                        classes.launch(x, o)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            for x, o in zip(inputs, outs):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    classes.launch(x, o)
                graphs.append(g)
            fns = [g.replay for g in graphs]
        for cls, fn, o in zip((spec.a, spec.b), fns, outs):
            o.fill_(float("nan"))  # a launch that writes nothing must not pass as finite
            fn()
            torch.cuda.synchronize()
            bad = int((~torch.isfinite(o.float())).sum())
            if bad:
                raise RuntimeError(f"class {cls!r} ({mode}): {bad} non-finite outputs; broken launches are not timed")
        return fns, outs, graphs

    def _host_ms_per_round(self, fns, events) -> float:
        """Host enqueue time of one round (two launches, four events), measured behind a GPU spin."""
        torch = self.torch
        k = min(16, self.chunk)
        torch.cuda.synchronize()
        self._pad(self.MAX_SLEEP_MS)
        t = time.perf_counter()
        for r in range(k):
            for j in (0, 1):
                events[0][2 * r + j].record()
                fns[j]()
                events[1][2 * r + j].record()
        ms = (time.perf_counter() - t) * 1e3 / k
        torch.cuda.synchronize()
        return ms

    def _time(self, fns, rounds: int, rng, ps: PairStats, label: str) -> None:
        torch = self.torch
        chunk = self.chunk
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(2 * chunk)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2 * chunk)]
        for _ in range(self.warmup):
            for f in fns:
                f()
        host_round = self._host_ms_per_round(fns, (starts, ends))
        gc_was_on = gc.isenabled()
        gc.disable()  # a collection while the host queues a chunk would starve the GPU
        try:
            self._chunks(fns, rounds, rng, ps, label, starts, ends, host_round)
        finally:
            if gc_was_on:
                gc.enable()

    def _chunks(self, fns, rounds, rng, ps, label, starts, ends, host_round) -> None:
        torch, chunk = self.torch, self.chunk
        done, next_report, t0 = 0, 0.1, time.time()
        while done < rounds:
            k = min(chunk, rounds - done)
            a_first = rng.random(k) < 0.5
            torch.cuda.synchronize()  # the GPU is idle: the spin starts now
            pad = self.SLEEP_MARGIN * host_round * k
            self._pad(pad)
            t = time.perf_counter()
            for r in range(k):
                first = 0 if a_first[r] else 1
                for j, c in enumerate((first, 1 - first)):
                    starts[2 * r + j].record()
                    fns[c]()
                    ends[2 * r + j].record()
            host_ms = (time.perf_counter() - t) * 1e3
            ends[2 * k - 1].synchronize()
            us = np.array([starts[i].elapsed_time(ends[i]) for i in range(2 * k)]) * 1e3
            us = us.reshape(k, 2)
            ta = np.where(a_first, us[:, 0], us[:, 1])
            tb = np.where(a_first, us[:, 1], us[:, 0])
            starved = not self.cycles_per_ms or host_ms > min(pad, self.MAX_SLEEP_MS)
            ps.add(ta, tb, starved=starved)
            done += k
            if done >= next_report * rounds or done == rounds:
                z = ps.checkpoint()
                self.progress(f"    {label}: {100 * done / rounds:3.0f}%  n={done}  t={ps.welch.t:+.2f}  "
                              f"paired |z|={z:.2f}  starved chunks {ps.starved}/{ps.chunks}  "
                              f"({time.time() - t0:.0f}s)")
                next_report = math.floor(10 * done / rounds + 1) / 10

    def measure_pair(self, spec: PairSpec, modes, seed: int = 0) -> list[dict]:
        """Both classes' inputs built once; each mode measured on them. Errors become failed results."""
        from dhp_backend.audit import classes

        torch = self.torch
        self.progress(f"  [{spec.role}] {spec.label}  {spec.shape.key}  {spec.rounds} rounds")
        try:
            inputs = [classes.make_inputs(spec.shape, c, seed=seed, device=self.device) for c in (spec.a, spec.b)]
        except Exception as e:  # noqa: BLE001 - reported as this pair's failure
            return [error_result(spec, m, f"inputs: {type(e).__name__}: {e}") for m in modes]
        out = []
        for mi, mode in enumerate(modes):
            graphs = []
            try:
                fns, outs, graphs = self._prepare(spec, mode, inputs)
                ps = PairStats()
                rng = np.random.default_rng([seed, mi, zlib.crc32(spec.label.encode())])
                self._time(fns, spec.rounds, rng, ps, f"{spec.label} [{mode}]")
                out.append(ps.result(_spec_dict(spec.a, spec.b, spec.role, mode, spec.shape.key,
                                                spec.shape.policy, self.path_of(spec.shape))))
            except Exception as e:  # noqa: BLE001 - one broken mode must not lose the others' results
                out.append(error_result(spec, mode, f"{type(e).__name__}: {e}"))
                self.progress(f"    {spec.label} [{mode}]: ERROR {type(e).__name__}: {e}")
            finally:
                del graphs
                torch.cuda.synchronize()
        del inputs
        torch.cuda.empty_cache()
        return out


# ---------------------------------------------------------------- verdicts and reports

def summarize(results: list[dict], seconds: float) -> dict:
    gating = [r for r in results if r["role"] == "gating"]
    controls = [r for r in results if r["role"] == "control"]
    gating_passed = bool(gating) and all(r["passed"] for r in gating)
    control_detected = bool(controls) and all(r["detected"] for r in controls)
    messages = []
    if not control_detected:
        bad = ", ".join(f"{r['mode']} (|t| = {_f(r['t'])}{'; ' + r['error'] if r['error'] else ''})"
                        for r in controls if not r["detected"]) or "no control measured"
        messages.append(f"the harness cannot detect a leak: the control (policy off, short vs long) "
                        f"was not detected in {bad}")
    failures = [f"{r['pair']} [{r['mode']}, {r['shape']}]: {r['verdict']}" + (f" ({r['error']})" if r["error"] else "")
                for r in gating if not r["passed"]]
    side = [f"{r['pair']} [{r['mode']}]: {r['verdict']}, t = {_f(r['t'])}, {_f(r['diff_pct'], '+.3f')} %"
            for r in results if r["role"] == "reported" and r["verdict"] == "differs"]
    if side:
        messages.append("reported (not gating) pairs that differ: " + "; ".join(side))
    return {"gate": "G4 timing", "passed": gating_passed and control_detected, "control_detected": control_detected,
            "gating_passed": gating_passed, "failures": failures, "messages": messages,
            "seconds": round(seconds, 1), "pairs": len(results)}


def _f(x, spec: str = "+.2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_summary(s: dict, results: list[dict], out=print) -> None:
    out(f"G4 timing gate: {'PASS' if s['passed'] else 'FAIL'}  (control "
        f"{'detects its leak' if s['control_detected'] else 'NOT DETECTED'}; {s['pairs']} measurements, "
        f"{s['seconds']}s)")
    out(f"  {'role':9} {'pair':18} {'mode':6} {'n':>7} {'Δ%':>8} {'t':>8} {'crop|t|':>8} {'paired z':>8}  verdict")
    for r in results:
        z = r["paired"]["z_max"] if r.get("paired") else None
        out(f"  {r['role']:9} {r['pair']:18} {r['mode']:6} {min(r['n']):>7} {_f(r['diff_pct'], '+.3f'):>8} "
            f"{_f(r['t']):>8} {_f(r['cropped_t_max'], '.2f'):>8} {_f(z, '.2f'):>8}  {r['verdict']}")
    for m in s["messages"]:
        out(f"  NOTE: {m}")
    for f in s["failures"]:
        out(f"  FAIL: {f}")
    if s.get("reports"):
        out(f"  reports: {', '.join(s['reports'][:2])}")


def renderer() -> str:
    try:
        import matplotlib  # noqa: F401
        return "matplotlib"
    except ImportError:
        return "builtin (dhp_backend.audit.png)"


def plot_pair(r: dict, stem: str) -> list[str]:
    """Histograms of the two classes and t over samples, as PNGs next to the report."""
    a, b = r["_samples"]
    base = f"{stem}-{_safe(r['shape'])}-{r['mode']}-{r['a']}-vs-{r['b']}"
    hist, tplot = base + "-hist.png", base + "-t.png"
    title = f"{r['pair']} ({r['mode']}, {r['shape']})"
    if renderer() == "matplotlib":
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lo, hi = np.quantile(np.concatenate([a, b]), [0.001, 0.999])
        fig, ax = plt.subplots(figsize=(8, 4.5))
        bins = np.linspace(lo, hi if hi > lo else lo + 1, 101)
        ax.hist(a, bins=bins, alpha=0.5, label=f"{r['a']} (mean {r['mean_us'][0]:.3f} µs)")
        ax.hist(b, bins=bins, histtype="step", lw=1.5, label=f"{r['b']} (mean {r['mean_us'][1]:.3f} µs)")
        ax.set(xlabel="µs per launch (CUDA events; 0.1–99.9 % range)", ylabel="launches", title=title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(hist, dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(r["trace"]["n"], r["trace"]["t"], lw=1, label="Welch t")
        if r["trace"]["z_n"]:
            ax.plot(r["trace"]["z_n"], r["trace"]["z"], "o", ms=3, label="paired max |z|")
        for h in (stats.THRESHOLD, -stats.THRESHOLD):
            ax.axhline(h, color="r", ls="--", lw=1)
        ax.set(xlabel="samples per class", ylabel="statistic", title=title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(tplot, dpi=100)
        plt.close(fig)
    else:
        from dhp_backend.audit import png

        png.histograms(hist, a, b, labels=(r["a"], r["b"]), title=title, xlabel="us per launch")
        png.series(tplot, r["trace"]["n"], r["trace"]["t"], hlines=(stats.THRESHOLD, -stats.THRESHOLD),
                   title=f"Welch t over samples: {r['pair']} ({r['mode']})", xlabel="samples per class",
                   ylabel="t")
    return [hist, tplot]


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items() if not k.startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return x


def write_reports(report_dir: str, s: dict, results: list[dict], meta: dict, *, save_samples: bool = False,
                  date: str | None = None) -> tuple[str, str]:
    """``<report-dir>/<date>-timing-<device>.md/.json`` and the PNG plots; returns (md, json) paths.

    ``meta``: device (name), versions, settings. Results carrying ``_samples`` get plots.
    """
    stem, date = report_stem(report_dir, "timing", device_slug(meta["device"]), date)
    rend = renderer()
    for r in results:
        if r.get("_samples") is not None and r["_samples"][0].size:
            r["plots"] = plot_pair(r, stem)
    if save_samples:
        np.savez_compressed(stem + "-samples.npz", **{
            _safe(f"{r['shape']}-{r['mode']}-{r['a']}-vs-{r['b']}-{c}"): r["_samples"][i]
            for r in results if r.get("_samples") is not None for i, c in enumerate(("a", "b"))})
    doc = {"gate": "G4 timing", "date": date, "device": meta["device"], "versions": meta["versions"],
           "settings": meta["settings"], "renderer": rend, "summary": s, "results": results}
    return write_report_files(stem, _jsonable(doc), _markdown(doc, stem))


def _markdown(doc: dict, stem: str) -> list[str]:
    s, v, st = doc["summary"], doc["versions"], doc["settings"]
    md = [f"# G4 timing gate — {doc['date']}, {doc['device']}", "",
          f"Result: **{'PASS' if s['passed'] else 'FAIL'}** — control "
          f"{'detects its leak' if s['control_detected'] else '**does not detect its leak**'}, gating pairs "
          f"{'pass' if s['gating_passed'] else '**fail**'}; {s['seconds']} s.", "",
          f"Commit {v.get('commit')}, dhp_backend {v.get('dhp_backend')}, torch {v.get('torch')} (CUDA "
          f"{v.get('cuda')}), Triton {v.get('triton')}, driver {v.get('driver')}, Python {v.get('python')}. "
          "Produced by `dhp-backend audit timing`; the JSON next to this file has every number.", "",
          "## Method", "",
          f"Rounds of one launch per class in seeded random order (seed {st.get('seed')}); each launch timed "
          f"with CUDA events around one `classes.launch`; {st.get('warmup')} warm-up rounds; synchronisation every "
          f"{st.get('chunk')} rounds, behind a GPU spin so the host has queued the chunk before it runs (host pad: "
          f"{st.get('host_pad')}). Modes: eager{' and CUDA-graph replay' if st.get('graph') else ''}. Policy of "
          f"the gating and reported pairs: `{st.get('policy')}`; the control uses `off`. Pass: |Welch t| < "
          f"{stats.THRESHOLD} and paired |z| (sign test and Wilcoxon signed-rank on per-round differences) < "
          f"{stats.THRESHOLD} with at least {stats.MIN_SAMPLES} samples per class. The cropped t (largest |t| "
          "over dudect's pooled-percentile crops) is reported, not gating. Plots rendered with "
          f"{doc['renderer']}.", ""]
    paths = sorted({f"`{r['policy']}`: {r['path']}" for r in doc["results"] if r.get("path")})
    if paths:
        md += ["Kernel path per policy (from the dispatcher): " + "; ".join(paths) + ".", ""]
    for m in s["messages"]:
        md += [f"**Note:** {m}", ""]
    titles = {"control": "Control (must detect: policy off, true lengths public)",
              "gating": "Gating pairs", "reported": "Reported pairs (degenerate data; not gating)"}
    for role in ("control", "gating", "reported"):
        rs = [r for r in doc["results"] if r["role"] == role]
        if not rs:
            continue
        md += [f"## {titles[role]}", "",
               "| pair | shape | mode | n (A / B) | mean A µs | mean B µs | Δ % | t | cropped max \\|t\\| | "
               "sign z | Wilcoxon z | starved chunks | verdict |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rs:
            p = r.get("paired") or {}
            sz, wz = (p.get("sign") or {}).get("z"), (p.get("wilcoxon") or {}).get("z")
            ma, mb = (r["mean_us"] or [None, None])
            md.append(f"| {r['pair']} | {r['shape']} | {r['mode']} | {r['n'][0]} / {r['n'][1]} | "
                      f"{_f(ma, '.3f')} | {_f(mb, '.3f')} | {_f(r['diff_pct'], '+.3f')} | {_f(r['t'])} | "
                      f"{_f(r['cropped_t_max'], '.2f')} | {_f(sz)} | {_f(wz)} | "
                      f"{r['starved_chunks']}/{r['chunks']} | {r['verdict']}"
                      f"{' — ' + r['error'] if r['error'] else ''} |")
        md.append("")
    md += ["## Plots", ""]
    for r in doc["results"]:
        for p in r["plots"] or []:
            md.append(f"- {r['pair']} ({r['mode']}, {r['shape']}): [{os.path.basename(p)}]({os.path.basename(p)})")
    return md
