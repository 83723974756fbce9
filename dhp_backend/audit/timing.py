"""`dhp-backend audit timing`: gate G4 (design.md section 3), a dudect-style timing test on the GPU.

What it compares. Pairs of secret classes (`classes`) that share every public
parameter, on inputs that obey the address rule (design.md section 2): every
request reserves its bucket L, so its block table row holds distinct real pages
up to L and a short and a long request read the very same pages. The grid:

- step kinds: ``decode`` (``--decode-batch`` requests, one query token each) and
  ``prefill`` (``--prefill B,q``: B requests, a chunk of q query tokens each on a
  context); buckets ``--lengths`` (default 4096 and 32768);
- policies ``strict`` (short = the query length, long = L) and ``request`` (per-request
  power-of-two buckets as an int32 tensor: short = L/2 + 1, long = L, one power of two);
- page layouts (`testing.pages`): ``consecutive`` (a fresh engine), ``random``, and
  ``churned`` (the free list of vLLM's own block pool after a serving run,
  `testing.pages.churned_order`), in a cache of ``--num-blocks`` blocks (default
  ``max(25000, (B + 1) * L / block_size)``: realistic, pages never repeat in a step);
- modes ``eager`` (each round calls `classes.launch`) and ``graph`` (one CUDA graph per
  class, captured after a warm-up on a side stream; rounds replay them);
- pairs: gating ``short vs long`` and ``random vs random2``; reported (degenerate data,
  measured, not gating: GPU power management moves them, not our code) ``random vs
  zeros`` and ``random vs constant`` (``--pairs`` also takes ``random:extreme``,
  ``random:skewed``);
- the **control**: policy ``off``, short vs long, per step kind and bucket (on the first
  layout of ``--layouts``), in every mode: true lengths are public there, so the harness
  must see the difference (|t| > 4.5), else "the harness cannot detect a leak" and the
  gate fails;
- the **null pair** (``--null``, default on): ``long vs long2``, identical inputs in both
  classes, per step kind, bucket, policy and mode (on the first layout), at the gating
  pairs' sample count: the harness's floor, which must show no difference (verdict
  "no difference seen", else "FLOOR DIFFERS" and the gate fails). It caught the harness
  once: class-specific copy sources made a pair's second class 0.018 % slower (`SlotStaging`);
- attention features (issue 31): ``--features window=W,softcap=C,sinks`` (`audit.features`;
  any subset) measures every shape of the run as a layer with those features (public model
  configuration), and ``heads=QxKVxD`` as a layer of that geometry (e.g. ``heads=16x8x256``:
  Gemma-2 9B's, the head-256 libraries), and ``path=triton`` on the Triton ``CONST_TIME`` kernels
  forced (what a GPU without the csrc kernels runs; with or without features). Such layers run the
  csrc kernels' library of their head size and features (`plan.step_kernel`), and under ``strict``/``request`` a windowed layer walks the whole
  bucket (docs/kernels.md section 6), so the classes are the plain ones: short and long put
  the window at two secret positions in the same walk. Rows carry ``features`` ("" for plain
  attention on the default 32x8x128 layer) and merge beside the plain rows; they gate like them
  but fill no cell of the full grid (plain attention's). One device call measures a windowed layer (Gemma-3's
  window, a quarter of the bucket) on the subset's piece: ``dhp-backend audit timing
  --preset subset --features window=1024`` (decode, L 4096, strict and request, churned,
  graph; ``--estimate``: ~5.0 min on an H100).

How a pair is measured. Both input sets are built (tables and data shared where the
classes have them in common), each launch is checked to give finite output, then N
*rounds* run: one launch of each class per round, in an order drawn from a seeded RNG,
each timed with a pair of CUDA events around one `classes.launch`. Statistics
(`audit.stats`): online Welch t, cropped Welch t (secondary), and paired sign /
Wilcoxon tests of the per-round differences. A gating pair passes with |t| < 4.5 and
paired |z| < 4.5 after >= 10^5 samples per class, for every length pair on every
layout, policy, step kind and mode. Verdicts: gating pairs "pass", "FAIL", "too few
samples" (not a pass) or "error" (not measured: the reason is in ``error``); the
control "leak detected" or "NOT DETECTED"; reported pairs "differs" or "no difference
seen".

How the host is kept out of the numbers. Rounds run in chunks (``--chunk``, default
128): the stream is synchronised, a GPU spin (`torch.cuda._sleep`) sized to 1.5x the
host's measured enqueue time of a chunk is queued, then the chunk's launches and
events, then one synchronisation and the chunk's event times are read. While the GPU
spins the host queues the whole chunk ahead of it, so no start event fires before its
kernel is queued. A chunk whose enqueue took longer than its spin is counted as
*starved* in the report.

Selecting a piece of the grid. Every axis is an option (``--steps``, ``--lengths``,
``--policies``, ``--layouts``, ``--modes``, ``--pairs``), ``--preset subset`` is the
piece that fits one ~8-minute device call on an H100 (decode, both buckets, strict,
churned, graph replay), ``--estimate`` prints the plan and its expected wall time and
exits (no GPU needed), ``--quick`` is a smoke run (few samples, every layout; not a
gate verdict), ``--idle-after-us X`` a diagnostic of the card's power management (the GPU
idles X us after every timed launch, so its average power drops; a difference that shrinks
as X grows is the clock control reacting to the data, not the kernel's work; its report is
``g4-idle-diagnostic.json/.md``, never merged into the gate's). Each run merges its rows into ``<report-dir>/g4-latest.json`` (or the
``--merge`` file) when that file is of the same code (`source_hash`) and device, so the
full grid can be measured in pieces; the summary there says which cells are still missing.
With ``--resume`` a run skips the pairs and modes that file already holds (same code and
device, at least this run's samples), so a piece can name whole axes and a device call
spends its time only on the cells still missing.

Output: ``<report-dir>/g4-latest.json`` and ``g4-latest.md``. JSON: top level ``gate,
date, device, commit, source, versions, settings, churn, summary, rows`` (``source``: a digest
of the measured code, `MEASURED_CODE`, `source_hash`: pieces merge when it and the device agree); ``summary``:
``passed`` (every cell of the full grid measured, every gating row passes, every
control detected), ``complete, missing, gating_passed, control_detected, failures,
messages, seconds, rows``; each row: ``pair, layout, num_blocks, mode, step, policy,
bucket, lengths, n_per_class, diff_pct, t`` and the richer ``commit, features, a, b, role, shape,
path, n, mean_us, std_us, median_us, df, cropped_t_max, cropped_quantile, paired, verdict,
passed, detected, chunks, starved_chunks, trace, plots, error`` (``features``: the layer's
attention features as ``--features`` spells them, "" for none; ``path``: the dispatcher's path
and the kernel the step runs on).

Exit code of `run`: 0 when every gating pair of this run passes and the control detects
its leak in every mode measured (``--quick``: when everything ran and the control was
detected), 1 otherwise, 2 without a CUDA GPU (G4 runs on the GPU machine) or for bad
arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import sys
import time
import zlib

import numpy as np

from dhp_backend.audit import features as feats
from dhp_backend.audit import stats
from dhp_backend.audit.provenance import commit as source_commit
from dhp_backend.audit.provenance import versions, write_report_files

DEFAULT_SAMPLES = 100_000
DEFAULT_SIDE_SAMPLES = 20_000
QUICK = {"samples": 2_000, "reported_samples": 500, "control_samples": 1_000, "warmup": 10}
STEPS = ("decode", "prefill")
LENGTHS = (4096, 32768)
# The gate's buckets per step kind (issue 28: decode B16 at L 4096 and 32768, one prefill-chunk step).
# ``--lengths`` names the buckets of every step kind of a run instead; rows at other buckets gate too.
GRID_LENGTHS = {"decode": (4096, 32768), "prefill": (4096,)}
POLICIES = ("strict", "request")  # the constant-time policies; the control runs "off"
LAYOUTS = ("consecutive", "random", "churned")
MODES = ("eager", "graph")
CONTROL = ("short", "long")
PRESETS = {
    "full": {},
    # one device call on an H100 (--estimate): the churned layout, decode at L 4096, both constant-time
    # policies, graph replay, gating and reported pairs, the control (a data pair at L 32768 copies 2 GB of
    # pages per launch: a call of its own)
    "subset": {"steps": "decode", "lengths": "4096", "policies": "strict,request", "layouts": "churned",
               "modes": "graph", "time_budget": 540.0},
}
LATEST = "g4-latest"
# A gating pair that ends with |t| or paired |z| in [EXTEND_AT, THRESHOLD) runs as many rounds again and is
# decided on all of them (`borderline`, --no-extend-borderline turns it off). Why: gpt-oss's head-64 window
# library's request short vs long passed twice at 10^5 rounds with t -3.78 and -2.44 (H200, 2026-11-29) and
# failed at 2 x 10^5 (t -9.20, -7.65): a real difference of 0.02 %, near the gate's resolution at 10^5.
# Extending only ever adds samples to a pair already near the threshold, so it can turn a pass into a FAIL
# that more data supports, and costs device time only there.
EXTEND_AT = 3.0
DIAGNOSTIC = "g4-idle-diagnostic"  # the report of an --idle-after-us run
ROW_KEYS = ("pair", "layout", "num_blocks", "mode", "step", "policy", "bucket", "lengths", "n_per_class",
            "diff_pct", "t")
RESULT_KEYS = ROW_KEYS + ("features", "a", "b", "role", "shape", "path", "n", "mean_us", "std_us", "median_us", "df",
                          "cropped_t_max", "cropped_quantile", "paired", "verdict", "passed", "detected", "chunks",
                          "starved_chunks", "trace", "plots", "error", "extended")
REPORT_KEYS = ("gate", "date", "device", "commit", "source", "versions", "settings", "churn", "summary", "rows")
SUMMARY_KEYS = ("passed", "complete", "missing", "control_detected", "floor_clean", "gating_passed", "failures",
                "messages", "seconds", "rows")


# ---------------------------------------------------------------- command line

def _csv(text: str, accepted, what: str) -> list[str]:
    vals = [x.strip() for x in str(text).split(",") if x.strip()]
    for v in vals:
        if accepted is not None and v not in accepted:
            raise ValueError(f"--{what}: {v!r}; accepted: {', '.join(accepted)}")
    if not vals:
        raise ValueError(f"--{what}: nothing selected")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a named piece of the grid: 'subset' = one H100 call (decode, 4096, "
                             "strict + request, churned, graph); 'full' = everything (the default). Axis options given "
                             "explicitly override the preset's")
    parser.add_argument("--steps", default=None, help=f"step kinds, comma-separated (default {','.join(STEPS)})")
    parser.add_argument("--lengths", default=None,
                        help="buckets L of every step kind, comma-separated (default: the gate's, "
                             + "; ".join(f"{k} {','.join(map(str, v))}" for k, v in GRID_LENGTHS.items()) + ")")
    parser.add_argument("--policies", default=None,
                        help=f"constant-time policies of the pairs (default {','.join(POLICIES)}; the control "
                             "always runs off)")
    parser.add_argument("--layouts", default=None, help=f"page layouts (default {','.join(LAYOUTS)})")
    parser.add_argument("--modes", default=None, help=f"launch modes (default {','.join(MODES)})")
    feats.add_argument(parser)
    parser.add_argument("--pairs", default="all",
                        help="all (gating + reported, default) | gating | reported | A:B,C:D (classes.CLASSES)")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the control (policy off, short vs long) per step kind and bucket")
    parser.add_argument("--null", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the null pair (long vs long2, identical inputs: the harness's floor) per step "
                             "kind, bucket and policy")
    parser.add_argument("--decode-batch", type=int, default=16, help="requests of a decode step (default 16)")
    parser.add_argument("--prefill", default="4,64",
                        help='"B,q": requests of a prefill-chunk step and query tokens each (default 4,64)')
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="blocks in the cache (default: max(25000, (B + 1) * L / block_size) per shape)")
    parser.add_argument("--samples", type=int, default=None, help=f"rounds per gating pair (default "
                                                                   f"{DEFAULT_SAMPLES}; --quick {QUICK['samples']})")
    parser.add_argument("--reported-samples", type=int, default=None,
                        help=f"rounds per reported pair (default {DEFAULT_SIDE_SAMPLES})")
    parser.add_argument("--control-samples", type=int, default=None,
                        help=f"rounds of the control pair (default {DEFAULT_SIDE_SAMPLES})")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: few samples (not a gate verdict), every selected layout")
    parser.add_argument("--estimate", action="store_true",
                        help="print the plan and its estimated H100 wall time, then exit (no GPU needed)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: start no pair whose estimated end lies past this (0 = none; --preset "
                             "subset: 540, under the device's 10-minute command limit); the report is written "
                             "after every measured pair either way")
    parser.add_argument("--chunk", type=int, default=128, help="rounds between synchronisations")
    parser.add_argument("--idle-after-us", type=float, default=0.0,
                        help="diagnostic: the GPU idles this long (a spin, outside the timed events) after every "
                             "timed launch, lowering its average power; a difference that shrinks as the idle "
                             "time grows comes from the card's power management, not from the kernel's work. Not "
                             f"a gate verdict: written to <report-dir>/{DIAGNOSTIC}.json/.md, never merged into "
                             "the gate's report (default 0)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds before timing (default 50)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the launch order, the page layouts and the data (default 0)")
    parser.add_argument("--report-dir", default=os.path.join("docs", "audit"),
                        help=f'write {LATEST}.json/.md here ("" = no files)')
    parser.add_argument("--merge", default=None,
                        help=f"merge this run's rows into the rows of this report (default: <report-dir>/{LATEST}"
                             ".json when it exists); rows of other code (timing.MEASURED_CODE differs) or another "
                             "device are dropped; '' = no merge")
    parser.add_argument("--resume", action="store_true",
                        help="skip every measurement that the report this run merges into (--merge) already holds "
                             "for this code and device with at least this run's samples: a grid filled over several "
                             "device calls measures no cell twice")
    parser.add_argument("--extend-borderline", action=argparse.BooleanOptionalAction, default=True,
                        help=f"a gating pair whose |t| or paired |z| ends in [{EXTEND_AT:g}, 4.5) runs as many "
                             "rounds again and is decided on all of them (default on; not under --quick)")
    parser.add_argument("--plots", action="store_true", help="also write PNG plots to <report-dir>/timing-plots/")
    parser.add_argument("--save-samples", action="store_true",
                        help=f"also write every raw sample to <report-dir>/{LATEST}-samples.npz")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")


def idle_diagnostic(idle_after_us: float) -> str:
    """What a run with ``--idle-after-us`` is ("" for none): said in the plan, the summary and the report."""
    return (f"the GPU idles {idle_after_us:g} us after every launch: a diagnostic, not a gate verdict"
            if idle_after_us else "")


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: tuple
    lengths: tuple
    policies: tuple
    layouts: tuple
    modes: tuple
    pairs: tuple  # (a, b, role)
    control: bool
    decode_batch: int
    prefill: tuple  # (B, q)
    num_blocks: int
    samples: int
    reported_samples: int
    control_samples: int
    warmup: int
    chunk: int
    seed: int
    quick: bool
    preset: str | None
    time_budget: float = 0.0
    features: feats.Features = feats.Features()  # every shape's (--features); none: plain attention
    idle_after_us: float = 0.0  # diagnostic (--idle-after-us): GPU idle after each timed launch
    null: bool = True  # the null pair per step kind, bucket and policy (--null)
    extend_borderline: bool = True  # a borderline gating pair runs its rounds again (--extend-borderline)

    def lengths_of(self, step: str) -> tuple:
        """The buckets of ``step`` this run measures: ``--lengths`` when given, else the gate's."""
        return self.lengths or GRID_LENGTHS[step]

    @property
    def diagnostic(self) -> str:
        """Why this run gives no gate verdict ("" when it does)."""
        if self.quick:
            return "quick: not a gate verdict"
        return idle_diagnostic(self.idle_after_us)
        return ""


def parse_pairs(text: str) -> list[tuple[str, str, str]]:
    from dhp_backend.audit import classes

    gating = [(a, b, "gating") for a, b in classes.GATING_PAIRS]
    reported = [(a, b, "reported") for a, b in classes.REPORTED_PAIRS]
    if text == "all":
        return gating + reported
    if text == "gating":
        return gating
    if text == "reported":
        return reported
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        a, _, b = item.partition(":")
        for c in (a, b):
            if not classes.is_class(c):
                raise ValueError(f"--pairs: class {c!r} in {item!r}; accepted: {classes.accepted_classes()}")
        gate = (a, b) in classes.GATING_PAIRS or (b, a) in classes.GATING_PAIRS
        out.append((a, b, "gating" if gate else "reported"))
    if not out:
        raise ValueError("--pairs: no pair given")
    return out


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validated settings (ValueError with the option's name otherwise)."""
    preset = PRESETS[args.preset] if getattr(args, "preset", None) else {}

    def axis(name, default):
        v = getattr(args, name, None)
        return v if v is not None else preset.get(name, ",".join(map(str, default)))

    lengths = []  # none given: each step kind's buckets of the gate (`GRID_LENGTHS`, `Settings.lengths_of`)
    given = axis("lengths", ())
    for x in (_csv(given, None, "lengths") if given else ()):
        if not x.isdigit() or int(x) <= 0:
            raise ValueError(f"--lengths: {x!r} is not a positive integer")
        lengths.append(int(x))
    try:
        pb, pq = (int(x) for x in str(args.prefill).split(","))
    except ValueError:
        raise ValueError(f"--prefill: {args.prefill!r} is not B,q (two integers)") from None
    quick = bool(getattr(args, "quick", False))

    def count(name, default, quick_default):
        v = getattr(args, name, None)
        v = (quick_default if quick else default) if v is None else v
        if v <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {v}")
        return int(v)

    st = Settings(
        steps=tuple(_csv(axis("steps", STEPS), STEPS, "steps")), lengths=tuple(lengths),
        policies=tuple(_csv(axis("policies", POLICIES), POLICIES, "policies")),
        layouts=tuple(_csv(axis("layouts", LAYOUTS), LAYOUTS, "layouts")),
        modes=tuple(_csv(axis("modes", MODES), MODES, "modes")), pairs=tuple(parse_pairs(args.pairs)),
        control=bool(args.control), null=bool(getattr(args, "null", True)), decode_batch=int(args.decode_batch),
        prefill=(pb, pq),
        num_blocks=int(args.num_blocks or 0), samples=count("samples", DEFAULT_SAMPLES, QUICK["samples"]),
        reported_samples=count("reported_samples", DEFAULT_SIDE_SAMPLES, QUICK["reported_samples"]),
        control_samples=count("control_samples", DEFAULT_SIDE_SAMPLES, QUICK["control_samples"]),
        warmup=count("warmup", 50, QUICK["warmup"]), chunk=count("chunk", 128, 128), seed=int(args.seed),
        quick=quick, preset=getattr(args, "preset", None),
        time_budget=float(getattr(args, "time_budget", None) if getattr(args, "time_budget", None) is not None
                          else preset.get("time_budget", 0.0)),
        features=feats.parse(getattr(args, "features", "")),
        idle_after_us=float(getattr(args, "idle_after_us", 0.0) or 0.0),
        extend_borderline=bool(getattr(args, "extend_borderline", True)) and not quick)
    if not 0 <= st.idle_after_us <= 1e5:
        raise ValueError(f"--idle-after-us: {st.idle_after_us:g} us; accepted: 0 (none) to 100000")
    if st.time_budget < 0:
        raise ValueError(f"--time-budget: must be >= 0, got {st.time_budget}")
    if min(st.decode_batch, pb, pq) <= 0 or pq == 1:
        raise ValueError("--decode-batch and --prefill B,q: positive, and a prefill chunk has q > 1")
    for shape in (step_shape(st, k, L, "strict", "random") for k in st.steps for L in st.lengths_of(k)):
        if st.num_blocks and st.num_blocks < shape.batch * shape.width + 1:
            raise ValueError(f"--num-blocks {st.num_blocks}: {shape.step} at L={shape.bucket} reserves "
                             f"{shape.batch * shape.width} pages (+ block 0, the null block)")
    return st


def step_shape(st: Settings, step: str, bucket: int, policy: str, layout: str):
    from dhp_backend.audit import classes

    batch, q = (st.decode_batch, 1) if step == "decode" else st.prefill
    return classes.Shape(batch=batch, bucket=bucket, q_len=q, policy=policy, layout=layout,
                         num_blocks=st.num_blocks, **st.features.shape_fields())


# ---------------------------------------------------------------- what to measure

@dataclasses.dataclass(frozen=True)
class PairSpec:
    shape: object  # classes.Shape (its policy, layout and cache size included)
    a: str
    b: str
    role: str  # "control" | "null" | "gating" | "reported"
    rounds: int

    @property
    def label(self) -> str:
        return f"{self.a} vs {self.b}"


@dataclasses.dataclass
class Group:
    """Pairs measured on one cache (step kind, bucket, layout): tables and data are built once for them."""

    step: str
    bucket: int
    layout: str
    specs: list


def plan(st: Settings) -> list[Group]:
    """Per step kind and bucket, per layout: the control (first layout only), then per policy the null
    pair (first layout only) and the gating pairs, then the reported ones. Pairs of classes with different
    data (`data_pair`) run on the first layout of the step kind's smallest bucket only (`full_grid`)."""
    from dhp_backend.audit import classes

    groups = []
    for step in st.steps:
        lengths = st.lengths_of(step)
        for L in lengths:
            for li, layout in enumerate(st.layouts):
                specs = []
                if st.control and li == 0:
                    specs.append(PairSpec(step_shape(st, step, L, "off", layout), *CONTROL, "control",
                                          st.control_samples))
                for role in ("gating", "reported"):  # gating first: a time budget cuts reported pairs first
                    for policy in st.policies:
                        shape = step_shape(st, step, L, policy, layout)
                        if role == "gating" and st.null and li == 0:
                            specs += [PairSpec(shape, a, b, "null", st.samples) for a, b in classes.NULL_PAIRS]
                        specs += [PairSpec(shape, a, b, r, st.samples if r == "gating" else st.reported_samples)
                                  for a, b, r in st.pairs if r == role
                                  and (not data_pair(a, b) or (li == 0 and L == min(lengths)))]
                groups.append(Group(step, L, layout, specs))
    return groups


# Cost model (µs), fitted to a G4 run on an H200 (2026-11-25, Triton kernels, all four step kinds x
# buckets: decode B16 95 / 680 µs per launch at L 4096 / 32768, prefill B4 q64 183 / 1205 µs; 560 µs per
# round of host pad and events in eager mode, 70 µs in graph replay), with decode's memory-bound walk
# at an H100's ~3.3 TB/s (~0.66 ms at B16 L32768; the brief's csrc replay: ~0.5 ms): per launch of a
# constant-time class, plus per round (two launches) the host pad and events.
ROUND_OVERHEAD_US = {"graph": 70.0, "eager": 560.0}
GROUP_SETUP_S = 8.0  # inputs (a 25,000+ block cache per data class), graph captures, warm-up
FIRST_COMPILE_S = 60.0  # Triton JIT / nvcc builds of the step kinds' binaries on a fresh machine


def launch_us(shape) -> float:
    """Estimated time of one launch of ``shape`` on an H100 (a constant-time class; policy off short: less)."""
    kv_bytes = shape.batch * shape.bucket * shape.num_kv_heads * shape.head_size * 2 * 2
    t = kv_bytes / 3.3e6 + 10.0  # bytes / (B/µs): memory-bound decode
    if shape.q_len > 1:  # prefill chunks: latency/compute bound, 183 / 1205 µs at B4 q64 L 4096 / 32768
        t = max(t, (30.0 + 147.0 * shape.bucket / 4096) * shape.batch * shape.q_len / 256)
    return t


# Classes with their own data (random vs random2) copy their data before every launch, untimed, and flush L2
# after it; the host is then the bound ("starved chunks" near 100 %). Per launch: DATA_US_PER_MB for each MB of
# `classes.data_copy_bytes` plus DATA_FIXED_US, fitted to the H200's data pairs of 2026-11-29 (csrc
# constant-time prefill B4 q64 L 4096, graph, 10^5 rounds: 81-85 s for 35.7 MB a launch at head 64, 110-134 s
# for 136 MB at head 256, where short vs long took 41-54 s). The first model (a copy at ~3.3 TB/s and a
# 2 x 50 MB flush) said 53 s and 65 s. Decode's data pairs keep that first model: `--preset subset` (decode B16
# L 4096, its data pairs included) took 440 s on an H200 against ~480 s estimated.
DATA_US_PER_MB, DATA_FIXED_US = 1.95, 105.0


def pair_estimate_s(spec: PairSpec, modes) -> float:
    """Estimated seconds of one pair in ``modes`` (`launch_us`, `ROUND_OVERHEAD_US`; classes with their own
    data add their untimed data copy and L2 flush: `DATA_US_PER_MB` for prefill chunks)."""
    from dhp_backend.audit import classes

    k = launch_us(spec.shape) * (0.56 if spec.role == "control" else 1.0)  # short under off: almost free
    if classes.data_key(spec.a) != classes.data_key(spec.b):
        if spec.shape.q_len > 1:  # prefill chunks: the H200 fit above
            k += DATA_US_PER_MB * classes.data_copy_bytes(spec.shape) / 1e6 + DATA_FIXED_US
        else:  # decode: a copy read and written at ~3.3 TB/s, and the L2 flush after it (2 x 50 MB)
            k += 2 * classes.data_copy_bytes(spec.shape) / 3.3e6 + 2 * 50e6 / 3.3e6
    return sum(spec.rounds * (2 * k + ROUND_OVERHEAD_US[m]) * 1e-6 for m in modes)


def estimate_s(st: Settings) -> dict:
    """Estimated wall seconds of the plan on an H100: per group and total."""
    per_group, total = [], FIRST_COMPILE_S
    for g in plan(st):
        s = GROUP_SETUP_S + sum(pair_estimate_s(spec, st.modes)
                                # --idle-after-us: two idle spins per round, per mode
                                + 2 * spec.rounds * len(st.modes) * st.idle_after_us / 1e6 for spec in g.specs)
        per_group.append((f"{g.step} L{g.bucket} {g.layout}", s))
        total += s
    return {"total_s": total, "groups": per_group}


def describe_plan(st: Settings, out=print) -> None:
    groups = plan(st)
    n = sum(len(g.specs) for g in groups) * len(st.modes)
    est = estimate_s(st)
    out(f"G4 plan: {len(groups)} cache group(s), {n} measurements (pairs x modes); steps {','.join(st.steps)}, "
        f"buckets {'; '.join(f'{k} ' + ','.join(map(str, st.lengths_of(k))) for k in st.steps)}, policies {','.join(st.policies)}, layouts "
        f"{','.join(st.layouts)}, modes {','.join(st.modes)}; features "
        f"{st.features.label or 'none (plain attention)'}; {st.samples} rounds per gating pair, "
        f"{st.reported_samples} per reported pair, {st.control_samples} for the control"
        + (f" ({st.diagnostic})" if st.diagnostic else ""))
    for (name, s), g in zip(est["groups"], groups):
        shape = g.specs[0].shape if g.specs else None
        blocks = f", {shape.blocks} blocks" if shape else ""
        out(f"  {name}{blocks}: {len(g.specs)} pairs, ~{s / 60:.1f} min")
    out(f"  estimated wall time on an H100: ~{est['total_s'] / 60:.1f} min (incl. ~{FIRST_COMPILE_S:.0f} s "
        "first compile; a device command may run 10 min)"
        + (f"; a borderline gating pair (|t| or paired |z| in [{EXTEND_AT:g}, {stats.THRESHOLD:g})) runs its "
           "rounds twice" if st.extend_borderline else ""))


def run(args: argparse.Namespace) -> int:
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        st = settings_from_args(args)
    except ValueError as e:
        print(f"dhp-backend audit timing: {e}", file=sys.stderr)
        return 2
    if getattr(args, "estimate", False):
        describe_plan(st, log)
        return 0
    try:
        import torch
        have_gpu = torch.cuda.is_available()
    except ImportError:
        have_gpu = False
    if not have_gpu:
        print("dhp-backend audit timing: no CUDA GPU here. G4 (the timing gate) times kernel launches with "
              "CUDA events, so it runs on the GPU machine (--estimate prints the plan here).", file=sys.stderr)
        return 2

    t0 = time.time()
    describe_plan(st, log)
    timer = Timer(chunk=st.chunk, warmup=st.warmup, progress=log, idle_after_us=st.idle_after_us)
    log(f"G4 timing gate on {timer.device_name}: GPU spin {timer.cycles_per_ms / 1e6:.2f} Gcycles/s"
        if timer.cycles_per_ms else
        f"G4 timing gate on {timer.device_name}: torch.cuda._sleep missing, no host pad (see starved chunks)")
    merge = "auto" if args.merge is None else (args.merge or None)
    if st.idle_after_us:  # a diagnostic's rows never join (or replace) a gate's
        if args.merge:
            log(f"--idle-after-us: not merged into {args.merge} (a diagnostic run's rows stay in their own report)")
        merge = None
    ver = versions()

    source = source_hash()
    have: dict = {}
    if getattr(args, "resume", False):
        path = os.path.join(args.report_dir or ".", LATEST + ".json") if merge == "auto" else merge
        have, how = measured_cells(path, device=timer.device_name, source=source)
        log(f"--resume: {how}")

    def meta(churn, seconds):
        return {"device": timer.device_name, "versions": ver, "source": source, "churn": churn,
                "seconds": round(seconds, 1),
                "settings": settings_dict(st) | {"host_pad": timer.pad_note()}}

    def checkpoint(rows, churn):  # after every pair: a run cut short by the device's limit keeps its rows
        if args.report_dir and rows:
            write_reports(args.report_dir, rows, meta(churn, time.time() - t0), merge_from=merge)

    rows, churn, skipped = measure_plan(timer, st, log, checkpoint=checkpoint, started=t0, have=have)
    s = summarize(rows, time.time() - t0, quick=st.quick, diagnostic=st.diagnostic)
    if skipped:
        s["messages"].append(f"time budget {st.time_budget:.0f} s: {len(skipped)} measurements not started ("
                             + "; ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else "") + ")")
    s["skipped"] = skipped
    if args.report_dir:
        paths, merged = write_reports(args.report_dir, rows, meta(churn, s["seconds"]), merge_from=merge,
                                      plots=args.plots, save_samples=args.save_samples, log=log)
        s["reports"] = list(paths)
        s["report_summary"] = merged
    if args.json:
        print(json.dumps(_jsonable(s), indent=2, default=str))
    else:
        print_summary(s, rows)
    return exit_code(s, bool(st.diagnostic))


def settings_dict(st: Settings) -> dict:
    d = dataclasses.asdict(st)
    d["pairs"] = [f"{a}:{b}" for a, b, _ in st.pairs]
    d["lengths"] = {k: list(st.lengths_of(k)) for k in st.steps}
    d["features"] = st.features.label
    return d


def exit_code(s: dict, diagnostic: bool) -> int:
    """A gate run: 0 when its rows pass. A diagnostic (quick, idle gaps): 0 when it ran and the control,
    where measured, was detected."""
    if diagnostic:
        return 0 if s["control_detected"] is not False and not s["errors"] else 1
    return 0 if s["run_passed"] else 1


def measured_cells(path: str | None, *, device: str, source: str) -> tuple[dict, str]:
    """The cells a report already holds for this device and code (`source_hash`), as {`row_key`: samples
    per class} (``--resume``), and what was found."""
    if not path or not os.path.exists(path):
        return {}, f"no report at {path}: every measurement runs"
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        return {}, f"{path} unreadable ({e}): every measurement runs"
    if doc.get("device") != device or doc.get("source") != source:
        return {}, (f"{path} is of {doc.get('device')} at code {doc.get('source')} (this run: {device}, code "
                    f"{source}): every measurement runs")
    cells = {row_key(r): int(r.get("n_per_class") or 0) for r in doc.get("rows", []) if r.get("verdict") != "error"}
    return cells, f"{len(cells)} cells of {path} are of this code and device; those with enough samples are skipped"


def measure_plan(timer, st: Settings, log, *, checkpoint=None, started: float | None = None,
                 have: dict | None = None):
    """Every group of the plan on the GPU: (rows, churn info per cache size, skipped measurements).

    With ``st.time_budget``, a pair whose estimated time (`launch_us`) would end past the budget
    (counted from ``started``) is not started; ``checkpoint(rows, churn)`` runs after every measured pair.
    ``have`` (`measured_cells`): the modes of a pair already measured with at least its rounds are not
    measured again."""
    groups = plan(st)
    total = sum(len(g.specs) for g in groups) * len(st.modes)
    done, rows, churn, skipped = 0, [], {}, []
    have = have or {}
    t0 = time.time()
    started = t0 if started is None else started
    timer.extend_borderline = st.extend_borderline
    timer.deadline = started + st.time_budget if st.time_budget else None
    for gi, g in enumerate(groups, 1):
        shape0 = g.specs[0].shape if g.specs else None
        if shape0 is None:
            continue
        info = ""
        if g.layout == "churned":
            info = churn_info(shape0.blocks, st.seed)
            churn[str(shape0.blocks)] = info
            info = f"; churned order {info['fingerprint']}, {info.get('source', 'vLLM ' + str(info.get('vllm')))}"
        log(f"== group {gi}/{len(groups)}: {g.step} L={g.bucket} layout {g.layout}, {shape0.blocks} blocks{info}")
        shared: dict = {}
        for spec in g.specs:
            done += len(st.modes)
            modes = tuple(m for m in st.modes if have.get(row_key(row_fields(spec, m)), 0) < spec.rounds)
            if not modes:
                log(f"  [resume] {spec.label} {spec.shape.key} {','.join(st.modes)}: in the report already")
                continue
            if st.time_budget and time.time() - started + pair_estimate_s(spec, modes) > st.time_budget:
                skipped += [f"{spec.label} {spec.shape.step} L{spec.shape.bucket} {spec.shape.policy} "
                            f"{spec.shape.layout} {m}" for m in modes]
                log(f"  [time budget] not starting {spec.label} {spec.shape.key} "
                    f"(~{pair_estimate_s(spec, modes):.0f} s)")
                continue
            rows += timer.measure_pair(spec, modes, seed=st.seed, shared=shared)
            if checkpoint is not None:  # after every pair: a run the device's time limit kills keeps its rows
                checkpoint(rows, churn)
            el = time.time() - t0
            log(f"  [{done}/{total} measurements, {el / 60:.1f} min; ~{el / done * (total - done) / 60:.1f} min left]")
        del shared
        timer.release()
    return rows, churn, skipped


def churn_info(num_blocks: int, seed: int) -> dict:
    """Which churned order a report ran on (vLLM version, fingerprint, what the simulated run did)."""
    from dhp_backend.testing import pages

    order = pages.page_order("churned", num_blocks, seed=seed)
    st = next((v for k, v in pages.CHURN_STATS.items() if k[0] == num_blocks and k[1] == seed), {})
    return {"num_blocks": num_blocks, "seed": seed, "fingerprint": pages.churn_fingerprint(order), **st}


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
        self.extended = False  # a borderline gating pair ran its rounds twice (`borderline`)

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
        elif role == "null":  # identical inputs: any difference is the harness's
            verdict = {"FAIL": "FLOOR DIFFERS", "pass": "no difference seen"}.get(verdict, verdict)
        return {**spec_like, "n": list(self.welch.n), "n_per_class": int(min(self.welch.n)), "mean_us": [ma, mb],
                "std_us": [math.sqrt(v) if v == v else math.nan for v in self.welch.variances],
                "median_us": [float(np.median(a)) if a.size else math.nan, float(np.median(b)) if b.size else math.nan],
                "diff_pct": 100.0 * (mb - ma) / ma if ma else math.nan, "t": t, "df": self.welch.df,
                "cropped_t_max": ct, "cropped_quantile": cq, "paired": p, "verdict": verdict,
                "passed": (verdict == "pass") if role == "gating" else None, "detected": detected,
                "chunks": self.chunks, "starved_chunks": self.starved, "trace": thin_trace(self.trace), "plots": [],
                "error": None, "extended": self.extended, "_samples": (a, b)}


def borderline(t: float, z_paired: float, *, extend_at: float = EXTEND_AT, threshold: float = stats.THRESHOLD) -> bool:
    """Whether a gating pair ended near the threshold without reaching it: the larger of |t| and paired |z| in
    [extend_at, threshold). A nan is not borderline (such a pair fails: `stats.verdict`)."""
    if t != t or z_paired != z_paired:
        return False
    return extend_at <= max(abs(t), abs(z_paired)) < threshold


TRACE_POINTS = 100  # Welch t over samples, kept in the report: enough for its plot, not one point per chunk


def thin_trace(trace: dict, points: int = TRACE_POINTS) -> dict:
    """The trace with at most ``points`` Welch-t points, evenly spaced and always the last (the report keeps
    one row per pair; a point per 128-round chunk made a 10^5-round row ~20 KB of trace)."""
    n = len(trace["n"])
    if n <= points:
        return dict(trace)
    keep = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
    return {**trace, "n": [trace["n"][i] for i in keep], "t": [trace["t"][i] for i in keep]}


def analyse_streams(xa, xb, *, pair=("random", "random2"), role="gating", mode="synthetic", shape=None,
                    policy="strict", layout="random", step="decode", chunk: int = 1024) -> dict:
    """Run recorded or synthetic per-round timings (µs, paired by index) through the gate's analysis.

    ``shape``: a `classes.Shape` (its policy and layout are used) or None (a B16 L4096 decode shape with
    ``policy``, ``layout`` and ``step``)."""
    from dhp_backend.audit import classes

    if shape is None:
        shape = classes.Shape(policy=policy, layout=layout, q_len=1 if step == "decode" else 64,
                              batch=16 if step == "decode" else 4)
    xa, xb = np.asarray(xa, np.float64), np.asarray(xb, np.float64)
    ps = PairStats()
    for i in range(0, xa.size, chunk):
        ps.add(xa[i:i + chunk], xb[i:i + chunk])
    return ps.result(row_fields(PairSpec(shape, pair[0], pair[1], role, xa.size), mode))


def row_fields(spec: PairSpec, mode: str, path: str | None = None) -> dict:
    """The fields of a row that say what was measured."""
    from dhp_backend.audit import classes

    sh = spec.shape
    return {"pair": spec.label, "layout": sh.layout, "num_blocks": sh.blocks, "mode": mode, "step": sh.step,
            "policy": sh.policy, "bucket": sh.bucket, "features": sh.features,
            "lengths": [classes.true_length(sh, spec.a), classes.true_length(sh, spec.b)],
            "a": spec.a, "b": spec.b, "role": spec.role, "shape": sh.key, "path": path}


def row_key(r: dict) -> tuple:
    """What a row measured: rows of two runs with equal keys replace each other in a merged report (rows of
    reports from before ``features`` existed are plain attention)."""
    return (r["step"], r["bucket"], r["policy"], r["layout"], r["mode"], r["a"], r["b"], r["role"],
            r.get("features") or "")


def error_result(spec: PairSpec, mode: str, why: str) -> dict:
    d = row_fields(spec, mode)
    return {**d, **{k: None for k in RESULT_KEYS if k not in d}, "n": [0, 0], "n_per_class": 0, "verdict": "error",
            "passed": False if spec.role == "gating" else None,
            "detected": False if spec.role == "control" else None, "trace": {"n": [], "t": [], "z_n": [], "z": []},
            "plots": [], "error": why, "extended": False}


# ---------------------------------------------------------------- GPU measurement


def gpu_sleep_cycles_per_ms(torch, cycles: int = 2_000_000) -> float | None:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` (None where torch lacks it).

    The spin pads a timed chunk so that the host has queued it before it runs
    (shared with benchmarks/timer.py)."""
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
    idle_after_ms = 0.0  # GPU idle queued after every timed launch (--idle-after-us; a diagnostic)
    extend_borderline = False  # set by measure_plan from the settings (--extend-borderline)
    deadline: float | None = None  # wall-clock end of the time budget: no extension estimated past it

    def __init__(self, chunk: int = 128, warmup: int = 50, progress=print, idle_after_us: float = 0.0) -> None:
        import torch

        self.torch, self.chunk, self.warmup, self.progress = torch, chunk, warmup, progress
        self.idle_after_ms = idle_after_us / 1e3
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
        """The kernel that runs this shape's launches and the dispatcher's path (a gating pair on the reference
        path proves little): "csrc kernel cuda_prefill_ct (the layer's path: triton (constant-time capable): ...)"
        where the csrc kernels take the layer, else "<path description>; kernel <kernel>"."""
        try:
            from dhp_backend.audit import classes

            choice, kernel = classes.route(shape, device_capability=self.torch.cuda.get_device_capability(self.device))
        except Exception as e:  # noqa: BLE001 - informational only
            return f"unknown ({type(e).__name__}: {e})"
        if kernel != choice.name:  # the csrc kernels took the layer (plan.step_kernel): name them first
            return f"csrc kernel {kernel} (the layer's path: {choice.describe()})"
        return f"{choice.describe()}; kernel {kernel}"

    @staticmethod
    def shares_buffers(inputs: list) -> bool:
        """Whether both classes run on one set of buffers: always when they share the block table (every
        class of a shape does). Classes that share their data too (short, long, long2) differ only in the
        lengths (and under request the bucket tensor), copied in before each launch; classes with different
        data (random vs random2, degenerate data) get their data copied in as well: the Q rows and the
        step's pages of the K/V cache (`classes.data_copy_bytes`)."""
        a, b = inputs
        return a["block_table"] is b["block_table"]

    @staticmethod
    def same_data(inputs: list) -> bool:
        a, b = inputs
        return all(a[k] is b[k] for k in ("query", "key_cache", "value_cache"))

    def _prepare(self, spec: PairSpec, mode: str, inputs: list) -> tuple[list, list, list]:
        """Launch callables for both classes, checked to produce finite output; (fns, outs, graphs).

        Both classes run on ONE set of buffers: one output, one length tensor (and bucket tensor), one
        Q and one K/V cache, one CUDA graph; each class's secrets are copied into the shared tensors before
        its launch, outside the timed events (`fn.prep`): its lengths, and for classes with their own data
        (random vs random2, degenerate data) its Q rows and the K/V pages the step reads (the table's, all
        distinct). So the two classes differ in their secret values only, not in where their buffers sit:
        with a buffer set (and a graph) per class, a null pair of identical inputs measured 0.09 % apart
        (t 16, H200), the size of what a gate must see. The lengths come from slots of one staging tensor,
        not from each class's own tensors (`SlotStaging`: with class sources the null pair's second class
        ran 0.018 % slower under request). Rows say ``buffers: "shared"`` or ``"shared, data
        copied"``; ``"per class"`` remains for inputs that do not share a table (none the harness builds)."""
        from dhp_backend.audit import classes

        torch = self.torch
        if self.shares_buffers(inputs):
            return self._prepare_shared(spec, mode, inputs)
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

    def _prepare_shared(self, spec: PairSpec, mode: str, inputs: list) -> tuple[list, list, list]:
        from dhp_backend.audit import classes

        torch = self.torch
        base = dict(inputs[0])
        base["seq_lens"] = inputs[0]["seq_lens"].clone()
        tensor_bucket = isinstance(inputs[0].get("bucket"), torch.Tensor)
        if tensor_bucket:
            base["bucket"] = inputs[0]["bucket"].clone()
        if not tensor_bucket and inputs[0].get("bucket") != inputs[1].get("bucket"):
            raise RuntimeError(f"classes {spec.a!r} and {spec.b!r} have different host buckets: not one shape")
        copies = [[(base["seq_lens"], x["seq_lens"])] + ([(base["bucket"], x["bucket"])] if tensor_bucket else [])
                  for x in inputs]
        if not self.same_data(inputs):
            # One Q and one cache for both classes: each launch's class has its data copied in first. Only
            # the pages the step reads are copied (the table's, distinct under the address rule), gathered
            # once per class, so the copy is two index_copy_ kernels of the step's size, not the cache's.
            shape = spec.shape
            pages = inputs[0]["block_table"][:, :shape.width].reshape(-1).long()
            if int(pages.unique().numel()) != int(pages.numel()):
                raise RuntimeError("the step's pages repeat: a data copy would not give each class its own data")
            for k in ("query", "key_cache", "value_cache"):
                base[k] = inputs[0][k].clone()
            for x, c in zip(inputs, copies):
                # ("data", destination, source): the class's Q rows, copied whole; the staging (`SlotStaging`)
                # is for the small integer secrets of one dtype
                c.append(("data", base["query"], x["query"]))
                for k in ("key_cache", "value_cache"):
                    c.append((base[k], pages, x[k].index_select(0, pages)))
                # The copy reads the class's own staging tensors: what of them stays in L2 differs by class
                # in *where* it sits (run 2026-11-26, H200: random vs random2 t -52 on the consecutive
                # layout without this). Reading one fixed buffer of twice the L2 afterwards leaves both
                # classes' launches the same L2 contents.
                c.append(("flush", self._l2_flush_buffer()))
        out = classes.empty_out(base)
        # The lengths (and request's bucket) reach the shared tensors from slots of one staging tensor
        # (`SlotStaging`), never from each class's own tensors.
        staging = SlotStaging.of(copies, 2 * self.chunk)

        def prep_for(i):
            def prep(slot=None):
                staging.copy(i, slot)
                for c in copies[i]:
                    if isinstance(c[0], str) and c[0] == "flush":  # ("flush", buffer)
                        c[1].sum()  # a read of every byte: the L2 then holds this buffer's lines only
                    elif isinstance(c[0], str):  # ("data", destination, source)
                        c[1].copy_(c[2])
                    elif len(c) == 3:
                        c[0].index_copy_(0, c[1], c[2])
            return prep

        graphs = []
        if mode == "eager":
            run = lambda: classes.launch(base, out)  # noqa: E731
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in (0, 1):
                    prep_for(i)()
                    for _ in range(3):
                        classes.launch(base, out)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                classes.launch(base, out)
            graphs.append(g)
            run = g.replay
        fns = []
        for i in (0, 1):
            fn = (lambda r=run: r())
            fn.prep = prep_for(i)
            fn.stage = staging.stage
            fns.append(fn)
        for x, cls, fn in zip(inputs, (spec.a, spec.b), fns):
            out.fill_(float("nan"))  # a launch that writes nothing must not pass as finite
            fn.prep()
            fn()
            torch.cuda.synchronize()
            bad = int((~torch.isfinite(out.float())).sum())
            if bad:
                raise RuntimeError(f"class {cls!r} ({mode}): {bad} non-finite outputs; broken launches are not timed")
            if not self.same_data(inputs):  # the copy must give the launch this class's data, bit for bit
                own = classes.empty_out(x)
                classes.launch(x, own)
                torch.cuda.synchronize()
                if not torch.equal(out, own):
                    raise RuntimeError(f"class {cls!r} ({mode}): the shared buffers after its data copy give other "
                                       "bits than its own inputs; the copy is incomplete")
        return fns, [out], graphs

    def _l2_flush_buffer(self):
        """One buffer of twice the device's L2 (kept for the process): reading it evicts whatever a data copy
        left in L2."""
        buf = getattr(self, "_flush", None)
        if buf is None:
            torch = self.torch
            l2 = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 << 20)
            buf = self._flush = torch.ones(2 * l2 // 4, dtype=torch.float32, device=self.device)
        return buf

    def _host_ms_per_round(self, fns, events) -> float:
        """Host enqueue time of one round (two launches, four events), measured behind a GPU spin."""
        torch = self.torch
        k = min(16, self.chunk)
        _stage(fns, [j for _ in range(k) for j in (0, 1)])
        torch.cuda.synchronize()
        self._pad(self.MAX_SLEEP_MS)
        t = time.perf_counter()
        for r in range(k):
            for j in (0, 1):
                _prep(fns[j], 2 * r + j)
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
        _stage(fns, (0, 1))
        for _ in range(self.warmup):
            for j, f in enumerate(fns):
                _prep(f, j)
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
            _stage(fns, [c for r in range(k) for c in ((0, 1) if a_first[r] else (1, 0))])
            torch.cuda.synchronize()  # the GPU is idle: the spin starts now
            pad = self.SLEEP_MARGIN * host_round * k
            self._pad(pad)
            t = time.perf_counter()
            for r in range(k):
                first = 0 if a_first[r] else 1
                for j, c in enumerate((first, 1 - first)):
                    _prep(fns[c], 2 * r + j)
                    starts[2 * r + j].record()
                    fns[c]()
                    ends[2 * r + j].record()
                    self._pad(self.idle_after_ms)  # --idle-after-us (0: nothing queued)
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

    def _extend(self, spec: PairSpec, mode: str, fns, rng, ps: PairStats) -> bool:
        """A borderline gating pair (`borderline`) runs its rounds again, into the same statistics, unless
        the time budget's end (``deadline``) would come first."""
        if not (self.extend_borderline and spec.role == "gating"):
            return False
        z = ps.trace["z"][-1] if ps.trace["z"] else ps.checkpoint()
        t = ps.welch.t
        if not borderline(t, z):
            return False
        label = f"{spec.label} [{mode}]"
        if self.deadline is not None and time.time() + pair_estimate_s(spec, (mode,)) > self.deadline:
            self.progress(f"    {label}: borderline (t {t:+.2f}, paired |z| {z:.2f}); not extended: the time "
                          "budget ends first")
            return False
        self.progress(f"    {label}: borderline (t {t:+.2f}, paired |z| {z:.2f}): {spec.rounds} rounds more, "
                      f"decided on all {2 * spec.rounds}")
        self._time(fns, spec.rounds, rng, ps, f"{label} extended")
        ps.extended = True
        return True

    def release(self) -> None:
        """Give the cache's memory back between groups."""
        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def measure_pair(self, spec: PairSpec, modes, seed: int = 0, shared: dict | None = None) -> list[dict]:
        """Both classes' inputs built once (tables and data from ``shared`` where another pair of the group
        built them); each mode measured on them. Errors become failed results."""
        from dhp_backend.audit import classes

        torch = self.torch
        lens = "/".join(str(classes.true_length(spec.shape, c)) for c in (spec.a, spec.b))
        self.progress(f"  [{spec.role}] {spec.label} ({lens})  {spec.shape.policy}  {spec.shape.key}  "
                      f"{spec.rounds} rounds")
        try:
            inputs = [classes.make_inputs(spec.shape, c, seed=seed, device=self.device, shared=shared)
                      for c in (spec.a, spec.b)]
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
                self._extend(spec, mode, fns, rng, ps)
                row = ps.result(row_fields(spec, mode, self.path_of(spec.shape)))
                row["buffers"] = ("per class" if not self.shares_buffers(inputs) else
                                  "shared" if self.same_data(inputs) else "shared, data copied")
                out.append(row)
            except Exception as e:  # noqa: BLE001 - one broken mode must not lose the others' results
                out.append(error_result(spec, mode, f"{type(e).__name__}: {e}"))
                self.progress(f"    {spec.label} [{mode}]: ERROR {type(e).__name__}: {e}")
            finally:
                del graphs
                torch.cuda.synchronize()
        del inputs
        return out


class SlotStaging:
    """Where each launch's small secrets (true lengths; under request the bucket) are copied from: slot j of
    one staging tensor, for launch j of a chunk, filled before the chunk (outside the timed events) with the
    values of the class that launch j runs.

    Why: copied from each class's own tensors, every launch of one class read the same source addresses
    and every launch of the other class other ones, and that alone timed apart. The null pair long vs
    long2 (identical inputs) measured the pair's second class slower: +0.018 % (t -12, 10^5 per class)
    on the prefill chunk under request (two copies per launch: lengths and bucket), +0.010 % and +0.004 %
    with the classes swapped (5x10^4), and that floor was the whole of request's prefill "failure"
    (short vs long +0.015 %). With slots: null pairs +0.001 % and -0.002 %, short vs long -0.002 %
    (H200, 2026-11-26). Now a launch's source address depends on its position in the chunk only.

    ``copies[i]``: class i's ``(destination, source)`` pairs, in the same order and of one dtype for both
    classes (each copy stays a plain memcpy). ``copy(i, slot)`` with ``slot=None`` copies from class i's
    own tensors: the one-off launches that check each class's output."""

    @classmethod
    def of(cls, copies: list, n_slots: int) -> "SlotStaging":
        """The staging of a pair's per-class copy lists: their ``(destination, source)`` tensor pairs; the
        ``("flush", buffer)`` entries, the data copies ``("data", destination, source)`` and the page copies
        ``(destination, index, source)`` keep their own."""
        import torch

        return cls([[c for c in copies[i] if len(c) == 2 and isinstance(c[0], torch.Tensor)] for i in (0, 1)],
                   n_slots)

    def __init__(self, copies: list, n_slots: int) -> None:
        import torch

        self.copies = copies
        self.packed = self.slots = None
        if not copies[0]:
            return
        dtype = copies[0][0][1].dtype
        if any(src.dtype != dtype or dst.dtype != dtype for c in copies for dst, src in c):
            raise ValueError("SlotStaging: the copies' tensors must share one dtype (a plain memcpy each)")
        if [dst for dst, _ in copies[0]] != [dst for dst, _ in copies[1]]:
            raise ValueError("SlotStaging: both classes copy into the same destinations, in one order")
        self.packed = torch.stack([torch.cat([src.reshape(-1) for _, src in c]) for c in copies])
        self.slots = torch.empty((n_slots, self.packed.shape[1]), dtype=dtype, device=self.packed.device)

    def stage(self, order) -> None:
        """Slot j gets the values of class ``order[j]`` (0 or 1)."""
        if self.slots is None:
            return
        import torch

        idx = torch.tensor(list(order), dtype=torch.long, device=self.slots.device)
        if len(idx) > self.slots.shape[0]:
            raise ValueError(f"SlotStaging: {len(idx)} launches staged, {self.slots.shape[0]} slots")
        torch.index_select(self.packed, 0, idx, out=self.slots[:len(idx)])

    def copy(self, i: int, slot: int | None) -> None:
        off = 0
        for dst, src in self.copies[i]:
            n = dst.numel()
            dst.copy_(src if slot is None else self.slots[slot, off:off + n].view(dst.shape), non_blocking=True)
            off += n


def _prep(fn, slot=None) -> None:
    """Run a launch's untimed preparation (the shared-buffer copy of its class's secrets), if it has one."""
    prep = getattr(fn, "prep", None)
    if prep is not None:
        prep(slot)


def _stage(fns, order) -> None:
    stage = getattr(fns[0], "stage", None)
    if stage is not None:
        stage(order)


# ---------------------------------------------------------------- verdicts and reports

def data_pair(a: str, b: str) -> bool:
    """Whether classes ``a`` and ``b`` differ in their data (random vs random2, degenerate data), not only
    in their true lengths."""
    from dhp_backend.audit import classes

    return classes.data_key(a) != classes.data_key(b)


def full_grid() -> list[tuple]:
    """The cells the gate needs (step, bucket, policy, layout, mode, a, b).

    Length pairs (short vs long): every step kind at each of its buckets (`GRID_LENGTHS`), policy, page
    layout and mode. Data pairs (random vs random2): every step kind at its smallest bucket, per policy and
    mode, on any one layout (layout None): both classes read the very same addresses (one table, their
    lengths equal), so what they test is the values' effect on the arithmetic, which neither the layout
    nor the bucket changes; on the first layout of the smallest bucket each one costs a 0.27 GB page copy
    per decode launch, where at L 32768 it would cost 2 GB."""
    from dhp_backend.audit import classes

    return [(step, L if not data_pair(a, b) else min(GRID_LENGTHS[step]), pol, lay, mode, a, b)
            for step in STEPS for L in GRID_LENGTHS[step] for pol in POLICIES for mode in MODES
            for a, b in classes.GATING_PAIRS
            for lay in (LAYOUTS if not data_pair(a, b) else (None,)) if not data_pair(a, b) or L == min(GRID_LENGTHS[step])]


def summarize(rows: list[dict], seconds: float, *, quick: bool = False, diagnostic: str = "") -> dict:
    """Verdicts over ``rows``: ``passed`` is the gate's (the full grid measured, every gating row passing,
    the control detected in every step kind, bucket and mode of the grid); ``run_passed`` judges these
    rows only (a piece of the grid). Rows of layers with features (``features``) gate as the others do, but
    fill no cell of the full grid: that grid is plain attention's."""
    gating = [r for r in rows if r["role"] == "gating"]
    controls = [r for r in rows if r["role"] == "control"]
    nulls = [r for r in rows if r["role"] == "null"]
    gating_passed = bool(gating) and all(r["passed"] for r in gating)
    control_detected = all(r["detected"] for r in controls) if controls else None
    # clean: every null row saw no difference; not clean: one differs (or errored); None: none measured,
    # or some with too few samples to say
    unclean = [r for r in nulls if r["verdict"] not in ("no difference seen", "too few samples")]
    clean = bool(nulls) and all(r["verdict"] == "no difference seen" for r in nulls)
    floor_clean = False if unclean else (True if clean else None)
    null_have = {(r["step"], r["bucket"], r["policy"], r["mode"]) for r in nulls if not r.get("features")}
    missing_null = sorted({c[:3] + (c[4],) for c in full_grid()} - null_have)
    have = {(r["step"], r["bucket"], r["policy"], r["layout"], r["mode"], r["a"], r["b"]) for r in gating
            if not r.get("features")}
    have_any_layout = {c[:3] + c[4:] for c in have}
    missing = [c for c in full_grid() if (c not in have if c[3] is not None else c[:3] + c[4:] not in have_any_layout)]
    ctl_have = {(r["step"], r["bucket"], r["mode"]) for r in controls if not r.get("features")}
    missing_ctl = [(s, L, m) for s in STEPS for L in GRID_LENGTHS[s] for m in MODES if (s, L, m) not in ctl_have]
    messages = []
    if control_detected is False:
        bad = ", ".join(f"{r['step']} L{r['bucket']}{_feat(r)} {r['mode']} (|t| = {_f(r['t'])}"
                        f"{'; ' + r['error'] if r['error'] else ''})" for r in controls if not r["detected"])
        messages.append(f"the harness cannot detect a leak: the control (policy off, short vs long) was not "
                        f"detected in {bad}")
    if floor_clean is False:
        bad = ", ".join(f"{r['step']} L{r['bucket']}{_feat(r)} {r['policy']} {r['mode']} "
                        f"({_f(r['diff_pct'], '+.3f')} %, t = {_f(r['t'])})" for r in unclean)
        messages.append(f"the harness's floor is not clean: the null pair (identical inputs) differs in {bad}; "
                        "no gating row of such a cell can be trusted")
    if quick:
        messages.append("quick run: too few samples for a gate verdict (a smoke test of the harness)")
    elif diagnostic:
        messages.append(diagnostic)
    failures = [f"{r['pair']} [{r['step']} L{r['bucket']}{_feat(r)} {r['policy']} {r['layout']} {r['mode']}]: "
                f"{r['verdict']}"
                + (f" ({r['error']})" if r["error"] else "") for r in gating if not r["passed"]]
    side = [f"{r['pair']} [{r['step']} L{r['bucket']}{_feat(r)} {r['policy']} {r['layout']} {r['mode']}]: "
            f"t = {_f(r['t'])}, "
            f"{_f(r['diff_pct'], '+.3f')} %" for r in rows if r["role"] == "reported" and r["verdict"] == "differs"]
    if side:
        messages.append("reported (not gating) pairs that differ: " + "; ".join(side))
    complete = not missing and not missing_ctl and not missing_null
    return {"gate": "G4 timing", "passed": (complete and gating_passed and control_detected is True
                                            and floor_clean is True and not (quick or diagnostic)),
            "run_passed": gating_passed and control_detected is not False and floor_clean is not False,
            "complete": complete, "missing": [" ".join(str(x) if x is not None else "(any layout)" for x in c[:5])
                                              + f" {c[5]} vs {c[6]}" for c in missing]
            + [f"control {s} {L} {m}" for s, L, m in missing_ctl]
            + [f"null {s} {L} {p} {m}" for s, L, p, m in missing_null],
            "control_detected": control_detected, "floor_clean": floor_clean, "gating_passed": gating_passed,
            "failures": failures,
            "errors": [f"{r['pair']} [{r['shape']} {r['mode']}]: {r['error']}" for r in rows if r["error"]],
            "messages": messages, "seconds": round(seconds, 1), "rows": len(rows)}


def _feat(r: dict) -> str:
    """" <features>" for a row of a layer with features, "" for plain attention (names in messages)."""
    return f" {r['features']}" if r.get("features") else ""


def _f(x, spec: str = "+.2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_summary(s: dict, rows: list[dict], out=print) -> None:
    verdict = "PASS" if s["run_passed"] else "FAIL"
    out(f"G4 timing gate, this run: {verdict}  (control "
        f"{ {True: 'detects its leak', False: 'NOT DETECTED', None: 'not measured'}[s['control_detected']] }; "
        f"{s['rows']} rows, {s['seconds']} s)")
    out(f"  {'role':9} {'pair':18} {'step':7} {'L':>6} {'features':12} {'policy':8} {'layout':11} {'mode':6} "
        f"{'n':>7} {'Δ%':>8} {'t':>8} {'paired z':>8}  verdict")
    for r in rows:
        z = r["paired"]["z_max"] if r.get("paired") else None
        out(f"  {r['role']:9} {r['pair']:18} {r['step']:7} {r['bucket']:>6} {r.get('features') or '-':12} "
            f"{r['policy']:8} {r['layout']:11} {r['mode']:6} {r['n_per_class']:>7} {_f(r['diff_pct'], '+.3f'):>8} "
            f"{_f(r['t']):>8} {_f(z, '.2f'):>8}  {r['verdict']}{' (extended: borderline)' if r.get('extended') else ''}")
    for m in s["messages"]:
        out(f"  NOTE: {m}")
    for f in s["failures"]:
        out(f"  FAIL: {f}")
    if s.get("report_summary"):
        m = s["report_summary"]
        out(f"  report ({m['rows']} rows, with earlier runs' on this code): gate "
            f"{'PASS' if m['passed'] else 'not passed'}; {len(m['missing'])} cells of the full grid missing; "
            f"{len(m['failures'])} gating rows failing")
    if s.get("reports"):
        out(f"  reports: {', '.join(s['reports'][:2])}")


def renderer() -> str:
    try:
        import matplotlib  # noqa: F401
        return "matplotlib"
    except ImportError:
        return "builtin (dhp_backend.audit.png)"


def _row_name(r: dict) -> str:
    feat = f"-{r['features']}" if r.get("features") else ""
    return _safe(f"{r['step']}-L{r['bucket']}{feat}-{r['policy']}-{r['layout']}-{r['mode']}-{r['a']}-vs-{r['b']}")


def plot_pair(r: dict, stem: str) -> list[str]:
    """Histograms of the two classes and t over samples, as PNGs (``stem``-<row>-hist.png / -t.png)."""
    a, b = r["_samples"]
    base = f"{stem}-{_row_name(r)}"
    hist, tplot = base + "-hist.png", base + "-t.png"
    title = f"{r['pair']} ({r['step']} L{r['bucket']}{_feat(r)} {r['policy']} {r['layout']} {r['mode']})"
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


# What a G4 measurement runs and judges: the kernels and their planning (``csrc/``, ``dhp_backend/ops/``),
# the gates (``dhp_backend/audit/``, recorded layouts included), the page tables and the settings. The vLLM
# adapter, the CLI's other commands and the test helpers are not in it: changing them does not split a
# report that takes several device sessions to fill.
MEASURED_CODE = ("csrc", "dhp_backend/ops", "dhp_backend/audit", "dhp_backend/testing/pages.py",
                 "dhp_backend/config.py", "dhp_backend/__init__.py")


def source_hash() -> str:
    """A digest of the code a measurement depends on (`MEASURED_CODE`). Two runs with equal digests ran
    the same code even at different commits (a commit that only adds a report, docs or adapter code does
    not split a report in pieces)."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for top in MEASURED_CODE:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            h.update(top.encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read())
            continue
        for d, dirs, files in sorted(os.walk(path)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
            for f in sorted(files):
                if f.endswith((".pyc", ".pyo")) or f.startswith("."):
                    continue
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


def merge_rows(rows: list[dict], previous: dict | None, *, device: str, commit: str | None,
               source: str | None = None) -> tuple[list, str]:
    """This run's rows over an earlier report's: (rows, what happened). Merged only when the earlier report
    ran on the same device and the same code (`source_hash`; reports without one: the same commit)."""
    if not previous:
        return list(rows), "no earlier report"
    same_code = (previous.get("source") == source) if previous.get("source") and source else (
        previous.get("commit") == commit)
    if previous.get("device") != device or not same_code:
        return list(rows), (f"earlier report of {previous.get('device')} at {previous.get('commit')} (code "
                            f"{previous.get('source')}) not merged (this run: {device} at {commit}, code {source})")
    mine = {row_key(r) for r in rows}
    kept = [r for r in previous.get("rows", []) if row_key(r) not in mine]
    return kept + list(rows), f"merged with {len(kept)} rows of an earlier run ({previous.get('date')})"


def write_reports(report_dir: str, rows: list[dict], meta: dict, *, merge_from: str | None = "auto",
                  plots: bool = False, save_samples: bool = False, date: str | None = None,
                  log=None) -> tuple[tuple[str, str], dict]:
    """``<report-dir>/g4-latest.json`` and ``.md`` (rows merged into ``merge_from``'s when it is of the same
    code and device, `merge_rows`; ``"auto"``: the ``g4-latest.json`` already in ``report_dir``; None or "": no merge), and
    optionally PNG plots and raw samples. Returns ((md, json), merged summary).

    ``meta``: device (name), versions, settings, churn. Rows carrying ``_samples`` can get plots.
    """
    os.makedirs(report_dir, exist_ok=True)
    date = date or datetime.date.today().isoformat()
    # a diagnostic (GPU idle after each launch) never takes the gate report's name
    stem = os.path.join(report_dir, DIAGNOSTIC if (meta.get("settings") or {}).get("idle_after_us") else LATEST)
    commit = (meta.get("versions") or {}).get("commit") or source_commit()
    source = meta.get("source") or source_hash()
    if plots:
        pdir = os.path.join(report_dir, "timing-plots")
        os.makedirs(pdir, exist_ok=True)
        for r in rows:
            if r.get("_samples") is not None and r["_samples"][0].size:
                r["plots"] = plot_pair(r, os.path.join(pdir, LATEST))
    if save_samples:
        np.savez_compressed(stem + "-samples.npz", **{
            f"{_row_name(r)}-{c}": r["_samples"][i]
            for r in rows if r.get("_samples") is not None for i, c in enumerate(("a", "b"))})
    previous = None
    if merge_from == "auto":
        merge_from = stem + ".json"
    if merge_from and os.path.exists(merge_from):
        try:
            with open(merge_from) as f:
                previous = json.load(f)
        except (OSError, ValueError) as e:
            previous = None
            if log:
                log(f"G4: could not read {merge_from} to merge ({e}); writing this run's rows only")
    merged, how = merge_rows([dict(_jsonable(r), commit=r.get("commit") or commit) for r in rows], previous,
                             device=meta["device"], commit=commit, source=source)
    if log:
        log(f"G4 report: {how}")
    merged.sort(key=lambda r: (STEPS.index(r["step"]) if r["step"] in STEPS else 9, r["bucket"],
                               {"control": 0, "null": 1, "gating": 2, "reported": 3}.get(r["role"], 4), r["policy"],
                               LAYOUTS.index(r["layout"]) if r["layout"] in LAYOUTS else 9, r["pair"], r["mode"]))
    s = summarize(merged, float(meta.get("seconds") or 0.0),
                  diagnostic=idle_diagnostic(float((meta.get("settings") or {}).get("idle_after_us") or 0.0)))
    s["merge"] = how
    churn = dict((previous or {}).get("churn") or {}) if how.startswith("merged") else {}
    churn.update(meta.get("churn") or {})
    doc = {"gate": "G4 timing", "date": date, "device": meta["device"], "commit": commit, "source": source,
           "versions": meta["versions"], "settings": meta["settings"], "churn": churn, "summary": s,
           "rows": merged}
    paths = write_report_files(stem, _jsonable(doc), _markdown(doc))
    return paths, s


def _markdown(doc: dict) -> list[str]:
    s, v, st = doc["summary"], doc["versions"], doc["settings"]
    verdict = "PASS" if s["passed"] else ("FAIL" if s["failures"] or s["control_detected"] is False
                                          or s.get("floor_clean") is False else "not complete")
    if st.get("idle_after_us"):
        verdict = f"diagnostic ({idle_diagnostic(st['idle_after_us'])})"
    control = {True: "detects its leak", False: "**does not detect its leak**", None: "not measured"}
    grid = "the full grid is measured" if s["complete"] else f"{len(s['missing'])} cells of the full grid missing"
    gating = "all pass" if s["gating_passed"] else "**not all pass**"
    floor = {True: "clean", False: "**not clean**", None: "not established"}[s.get("floor_clean")]
    md = [f"# G4 timing gate — {doc['date']}, {doc['device']}, commit {doc['commit']}", "",
          f"Result: **{verdict}** — {s['rows']} rows; gating rows {gating}; control "
          f"{control[s['control_detected']]}; null-pair floor {floor}; {grid} ({s.get('merge', '')}).", "",
          f"dhp_backend {v.get('dhp_backend')}, torch {v.get('torch')} (CUDA {v.get('cuda')}), Triton "
          f"{v.get('triton')}, vLLM {v.get('vllm')}, driver {v.get('driver')}, Python {v.get('python')}. Produced by "
          "`dhp-backend audit timing` (`dhp_backend/audit/timing.py`); `g4-latest.json` next to this file has every "
          "number, per row and per run setting.", "",
          "## Method", "",
          "Inputs obey the address rule (design.md section 2): every request of both classes reserves its bucket L, "
          "so its block-table row holds distinct real pages up to L in the row's page layout (`consecutive`: a "
          "fresh engine; `random`; `churned`: the free list of vLLM's own block pool after a serving run, "
          "`testing.pages.churned_order`), and a short and a long request read the very same pages. Caches hold "
          "`num_blocks` blocks (at least 25,000 and more than (B + 1) L / block_size). Rounds of one launch per class "
          f"in seeded random order; each launch timed with CUDA events; {st.get('warmup')} warm-up rounds; a "
          f"synchronisation every {st.get('chunk')} rounds behind a GPU spin (host pad: {st.get('host_pad')}). Pass: "
          f"|Welch t| < {stats.THRESHOLD} and paired |z| (sign test and Wilcoxon signed-rank of per-round "
          f"differences) < {stats.THRESHOLD} with at least {stats.MIN_SAMPLES} samples per class, for every gating "
          "row of the full grid (" + "; ".join(f"{k} at L {', '.join(map(str, v))}" for k, v in GRID_LENGTHS.items())
          + "; policies strict and request, three layouts, eager and graph: `timing.full_grid`). Reported pairs "
          "(degenerate data) are findings, not gating.", ""]
    for blocks, c in sorted((doc.get("churn") or {}).items()):
        md += [f"Churned layout of {blocks} blocks: order {c.get('fingerprint')} of vLLM {c.get('vllm')}'s "
               f"BlockPool, {c.get('source', 'live')} (seed {c.get('seed')}; {c.get('requests')} requests, "
               f"{c.get('preemptions')} preemptions, {c.get('handed_out')} blocks handed out over {c.get('steps')} "
               "steps).", ""]
    paths = sorted({f"`{r['policy']}` {r['step']}{' (' + r['features'] + ')' if r.get('features') else ''}: "
                    f"{r['path']}" for r in doc["rows"] if r.get("path")})
    if paths:
        md += ["Kernel path per policy and step (from the dispatcher): " + "; ".join(paths) + ".", ""]
    featured = sorted({r["features"] for r in doc["rows"] if r.get("features")})
    if featured:
        md += ["Rows with `features` (" + ", ".join(f"`{f}`" for f in featured) + ") measure layers with those "
               "attention features (public model configuration, `--features`): they gate like the others but fill "
               "no cell of the full grid, which is plain attention's.", ""]
    for m in s["messages"]:
        md += [f"**Note:** {m}", ""]
    titles = {"control": "Control (must detect: policy off, true lengths public)",
              "null": "Null pair (identical inputs in both classes: the harness's floor, must show no difference)",
              "gating": "Gating pairs",
              "reported": "Reported pairs (degenerate data; not gating)"}
    for role in ("control", "null", "gating", "reported"):
        rs = [r for r in doc["rows"] if r["role"] == role]
        if not rs:
            continue
        md += [f"## {titles[role]}", "",
               "| pair | lengths | step | L | features | policy | layout | blocks | mode | n per class | mean A µs "
               "| mean B µs | Δ % | t | cropped max \\|t\\| | paired \\|z\\| | starved | verdict |",
               "|" + " --- |" * 18]
        for r in rs:
            p = r.get("paired") or {}
            ma, mb = (r.get("mean_us") or [None, None])
            lens = "/".join(map(str, r.get("lengths") or []))
            md.append(f"| {r['pair']} | {lens} | {r['step']} | {r['bucket']} | {r.get('features') or '-'} | "
                      f"{r['policy']} | {r['layout']} | "
                      f"{r['num_blocks']} | {r['mode']} | {r['n_per_class']} | {_f(ma, '.3f')} | {_f(mb, '.3f')} | "
                      f"{_f(r['diff_pct'], '+.3f')} | {_f(r['t'])} | {_f(r.get('cropped_t_max'), '.2f')} | "
                      f"{_f(p.get('z_max'), '.2f')} | {r.get('starved_chunks')}/{r.get('chunks')} | {r['verdict']}"
                      f"{' (extended: borderline)' if r.get('extended') else ''}"
                      f"{' — ' + r['error'] if r.get('error') else ''} |")
        md.append("")
    if s["missing"]:
        md += ["## Cells of the full grid not measured yet", "",
               ", ".join(s["missing"][:200]) + (" ..." if len(s["missing"]) > 200 else ""), ""]
    plots = [(r, p) for r in doc["rows"] for p in (r.get("plots") or [])]
    if plots:
        md += ["## Plots", ""]
        for r, p in plots:
            md.append(f"- {r['pair']} ({r['step']} L{r['bucket']}{_feat(r)} {r['policy']} {r['layout']} {r['mode']}): "
                      f"[{os.path.basename(p)}](timing-plots/{os.path.basename(p)})")
    return md
