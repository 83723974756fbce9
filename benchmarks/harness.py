"""`python -m benchmarks.harness`: DHP against vLLM's attention kernels, in one process, on the same tensors.

    python -m benchmarks.harness [--quick] [--device auto|cuda|cpu] [--out DIR] [--latest PATH]
                                 [--e2e-json PATH] [--cases PATTERNS] [--anchors NAMES]
                                 [--reps N] [--warmup N] [--max-sets N] [--no-graph] [--no-plots]

(from the repository root: the benchmarks sit beside the package and are not installed)

For every case (`benchmarks.cases`) the input sets are built once; each anchor
(`benchmarks.anchors`) converts them to its native layout outside the timed region,
is checked against a float32 reference on the same data (relative error below
2e-2 for bf16/fp16, else the row says "wrong result" and it is not timed), and
then timed (`benchmarks.timer`): decode steps replayed from CUDA graphs where the
anchor captures, the rest eager. The device's copy bandwidth and GEMM rate
(`benchmarks.ceilings`) are measured in the same run. `benchmarks.report` writes
``bench.json``, ``bench.md`` and the plots to ``--out`` and prints the summary.

With ``--device cpu`` (no GPU) the run uses tiny shapes, host clocks, and DHP
through the Triton interpreter when ``TRITON_INTERPRET=1`` was set before
anything imported triton (the harness does not set it), else the reference
path; the GPU anchors give "not available" rows.

The ``features`` family (sliding windows, logits soft-cap, attention sinks:
`benchmarks.cases.feature_cases`) is never part of the default list: name it
(``--cases features``, with ``--quick`` for six of its twelve cases). Every
anchor either applies a case's features or gives a "not available" row.
"""

from __future__ import annotations

import argparse
import json
import datetime
import functools
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda: the GPU shape list; cpu: tiny shapes (pipeline check); auto: cuda if present")
    p.add_argument("--quick", action="store_true", help="a subset of the shapes and fewer repetitions")
    p.add_argument("--out", default="bench-out", help="output folder (default ./bench-out)")
    p.add_argument("--latest", metavar="PATH", help="also write a copy of the JSON here (e.g. docs/bench/latest.json)")
    p.add_argument("--e2e-json", metavar="PATH", action="append",
                   help="end-to-end throughput JSON (integration/e2e_throughput.py) for the summary's e2e keys; "
                        "repeatable (newest first): each key comes from the first run that has both of its rows")
    p.add_argument("--cases", metavar="PATTERNS",
                   help="comma-separated substrings of case names or family names (decode, prefill, mixed, "
                        "head64, gqa, strict); the features family (windows, soft-cap, sinks vs FA3) runs only "
                        "when named: 'features', or the start of its case names ('mistral', 'gemma2', 'gpt-oss')")
    p.add_argument("--anchors", metavar="NAMES", help="comma-separated anchors (default: all): "
                   "fa3, flashinfer, triton_unified, sdpa_cudnn, dhp_off, dhp_strict, dhp_batch, dhp_request")
    p.add_argument("--reps", type=int, help="timed launches per row (default 100, --quick 30; CPU 3)")
    p.add_argument("--warmup", type=int, help="untimed launches first (default 10, --quick 5; CPU 1)")
    p.add_argument("--max-sets", type=int, help="most input sets rotated per case (default 32; CPU 2)")
    p.add_argument("--no-graph", action="store_true", help="time decode eagerly too (no CUDA graph replay)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resummarize", metavar="BENCH_JSON",
                   help="no timing: reload a bench JSON, recompute its summary (with --e2e-json) and rewrite "
                        "the outputs to --out (and --latest); for joining a GPU run with a later end-to-end run")


def _device(choice: str):
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.harness: --device cuda, but torch sees no CUDA device "
                         "(use --device cpu for the tiny CPU run)")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice, torch.cuda.current_device()) if choice == "cuda" else torch.device("cpu")


def device_info(device) -> dict:
    import platform

    import torch

    if device.type != "cuda":
        return {"type": "cpu", "name": f"CPU ({platform.processor() or platform.machine()})",
                "cores": os.cpu_count(), "l2_bytes": None}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "capability": list(torch.cuda.get_device_capability(device)),
            "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
            "l2_bytes": getattr(p, "L2_cache_size", None)}


def header(args, device, timer) -> dict:
    from dhp_backend.audit.provenance import _dist_version, versions

    v = versions()
    v["flashinfer"] = _dist_version("flashinfer-python", "flashinfer")
    return {"tool": "benchmarks.harness", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": device_info(device), "versions": v, "commit": v.get("commit"),
            "command": sys.argv[1:] if args.command_line is None else args.command_line,
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
            "settings": {"quick": args.quick, "reps": args.reps, "warmup": args.warmup, "max_sets": args.max_sets,
                         "graphs": not args.no_graph, "clock": timer.clock, "seed": args.seed,
                         "tolerance": "relative L2 error < 2e-2 (bf16/fp16) vs float32 reference"}}


class Progress:
    def __init__(self, total: int) -> None:
        self.done, self.total = 0, total

    def row(self, case_name: str, anchor: str, text: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {case_name} {anchor} ... {text}", flush=True)


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}".rstrip(": ")


def base_row(c, anchor) -> dict:
    from benchmarks import cases as C

    useful = C.work(c)
    return {"case": c.name, "family": c.family, "kind": c.kind, "bound": c.bound, "batch": c.num_reqs,
            "ctx": c.max_seq_len, "q_len": c.max_q_len, "causal": c.causal, "max_model_len": c.max_model_len,
            "heads": [c.num_heads, c.num_kv_heads], "head_size": c.head_size, "dtype": c.dtype,
            "sliding_window": c.sliding_window, "logits_soft_cap": c.logits_soft_cap, "sinks": c.sinks,
            "anchor": anchor.name, "label": anchor.label, "status": None, "mode": None,
            "time_ms": None, "p10_ms": None, "p25_ms": None, "p75_ms": None, "p90_ms": None, "n": None,
            "rel_err": None, "useful_bytes": useful["bytes"], "useful_flops": useful["flops"],
            "useful_GBps": None, "useful_TFLOPs": None, "executed_bytes": None, "executed_flops": None,
            "executed_GBps": None, "executed_TFLOPs": None, "vs_fa3": None, "vs_flashinfer": None,
            "sets": None, "notes": []}


def measure_anchor(anchor, c, sets, ref, *, timer, device, graphs: bool, tolerance: float) -> dict:
    """One row: prepare, check against the reference, maybe capture, time. Never raises."""
    import torch

    from benchmarks import cases as C
    from benchmarks.anchors import NotAvailable
    from benchmarks.inputs import rel_err
    from benchmarks.timer import capture_graphs

    row = base_row(c, anchor)
    row["sets"] = len(sets)
    fns = replays = captured = None
    try:
        anchor.prepare(c, sets)
        row.update(anchor.info())
        result = anchor.run(0)
        timer.sync()
        err = rel_err(anchor.packed(0, result), ref)
        row["rel_err"] = err
        del result
        if not err < tolerance:
            row["status"] = "wrong result"
            return row
        fns = [functools.partial(anchor.run, i) for i in range(len(sets))]
        row["mode"] = "host" if device.type != "cuda" else "eager"
        if graphs and anchor.graphable and device.type == "cuda" and c.kind == "decode":
            try:
                replays, outs, captured = capture_graphs(fns)
                replays[0]()
                torch.cuda.synchronize()
                g_err = rel_err(anchor.packed(0, outs[0]), ref)
                del outs
                if g_err < tolerance:
                    fns, row["mode"] = replays, "graph"
                else:
                    row["notes"].append(f"graph replay gave rel err {g_err:.2e}: timed eager")
                    replays = captured = None
            except Exception as exc:  # noqa: BLE001 - eager timing is still a result
                row["notes"].append(f"graph capture failed ({_short(exc)}): timed eager")
                captured = None
                torch.cuda.synchronize()
        t = timer.measure(fns)
        row.update(status="ok", time_ms=t.median_ms, p10_ms=t.p10_ms, p25_ms=t.p25_ms, p75_ms=t.p75_ms,
                   p90_ms=t.p90_ms, n=t.n)
        sec = t.median_ms * 1e-3
        row["useful_GBps"] = row["useful_bytes"] / sec / 1e9
        row["useful_TFLOPs"] = row["useful_flops"] / sec / 1e12
        policy = getattr(anchor, "policy", None)
        if policy in ("strict", "request"):
            ex = C.work(c, policy)
            row.update(executed_bytes=ex["bytes"], executed_flops=ex["flops"],
                       executed_GBps=ex["bytes"] / sec / 1e9, executed_TFLOPs=ex["flops"] / sec / 1e12)
    except NotAvailable as exc:
        row["status"] = f"not available: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken anchor is a row, never a crash
        row["status"] = f"not available: {_short(exc)}"
        if device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError):
            row["status"] = f"not available: out of memory ({_short(exc)[:160]})"
    finally:
        row["notes"] = [n for n in row["notes"] + list(anchor.notes) if n]
        del fns, replays, captured  # the graphs hold their memory pool until dropped
        anchor.release()
        _free_device_memory(device, row)
    return row


def _free_device_memory(device, row: dict | None = None) -> None:
    """Sync and return cached blocks; a device error here (a sticky one from a kernel) is noted, not raised."""
    if device.type != "cuda":
        return
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - the rows already say what failed
        if row is not None:
            row["notes"].append(f"device error after this row: {_short(exc)}")


def add_ratios(rows: list[dict]) -> None:
    """vs_fa3 / vs_flashinfer: the anchor's time over this row's (> 1: this row is faster)."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["anchor"]] = r
    for r in rows:
        for anchor, key in (("fa3", "vs_fa3"), ("flashinfer", "vs_flashinfer")):
            a = by_case[r["case"]].get(anchor)
            if r["status"] == "ok" and a is not None and a["status"] == "ok":
                r[key] = a["time_ms"] / r["time_ms"]


def run_cases(cases, anchors, *, device, timer, l2_bytes, max_sets=32, graphs=True, seed=0,
              progress: Progress | None = None) -> list[dict]:
    """Every anchor on every case; one row per (case, anchor the case lists)."""
    import torch

    from benchmarks import inputs
    from benchmarks.anchors import TOLERANCE

    plan = [(c, [a for a in anchors if c.anchors is None or a.name in c.anchors]) for c in cases]
    progress = progress or Progress(sum(len(a) for _, a in plan))
    unavailable = {a.name: a.available() for a in anchors}
    for name, why in unavailable.items():
        if why:
            print(f"  {name}: not available: {why}", flush=True)
    rows: list[dict] = []

    def whole_case(c, case_anchors, status):
        """One row per anchor of a case that cannot run at all, each saying why."""
        for a in case_anchors:
            row = base_row(c, a)
            row["status"] = status
            rows.append(row)
            progress.row(c.name, a.name, status)

    for c, case_anchors in plan:
        case_rows = []
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        n_sets, why = inputs.plan_memory(c, inputs.rotation(c, l2_bytes, max_sets), free)
        if why:
            whole_case(c, case_anchors, f"skipped: {why}")
            continue
        t0 = time.time()
        sets = ref = None
        try:
            gen = torch.Generator(device=device).manual_seed(seed)
            sets = [inputs.build_set(c, gen, device) for _ in range(n_sets)]
            ref = inputs.reference(c, sets[0])
        except Exception as exc:  # noqa: BLE001 - the case's rows say so; the run goes on
            sets = ref = None
            _free_device_memory(device)
            whole_case(c, case_anchors, f"not available: building the inputs failed: {_short(exc)}")
            continue
        print(f"  {c.name}: {n_sets} input set(s), reference in {time.time() - t0:.1f} s", flush=True)
        tol = TOLERANCE[sets[0].query.dtype]
        for a in case_anchors:
            if unavailable[a.name]:
                row = base_row(c, a)
                row["status"] = f"not available: {unavailable[a.name]}"
            else:
                row = measure_anchor(a, c, sets, ref, timer=timer, device=device, graphs=graphs, tolerance=tol)
            case_rows.append(row)
            progress.row(c.name, a.name, _progress_text(row))
        add_ratios(case_rows)
        rows += case_rows
        del sets, ref
        _free_device_memory(device)
    return rows


def _progress_text(row: dict) -> str:
    if row["status"] != "ok":
        extra = f" (rel err {row['rel_err']:.2e})" if row["status"] == "wrong result" else ""
        return row["status"] + extra
    return (f"{row['time_ms']:.4g} ms ({row['mode']}, p10-p90 {row['p10_ms']:.4g}-{row['p90_ms']:.4g}; useful "
            f"{row['useful_GBps']:.3g} GB/s, {row['useful_TFLOPs']:.3g} TFLOP/s)")


def _resummarize(args: argparse.Namespace, report) -> int:
    with open(args.resummarize) as f:
        doc = json.load(f)
    paths_e2e = args.e2e_json or []
    doc["header"]["e2e_json"] = paths_e2e
    doc["summary"] = report.summarize(doc["rows"], e2e_runs=report.load_e2e_runs(paths_e2e) or None,
                                      e2e_why="no --e2e-json given",
                                      device=doc["header"]["device"]["name"], commit=doc["header"].get("commit"))
    paths = report.write(doc, args.out, latest=args.latest, plots=not args.no_plots)
    print("summary:", json.dumps({k: doc["summary"][k] for k in report.SUMMARY_KEYS}))
    print("written:", ", ".join(paths))
    return 0


def run(args: argparse.Namespace) -> int:
    from benchmarks import anchors as A
    from benchmarks import cases as C
    from benchmarks import ceilings, report
    from benchmarks.timer import CudaTimer, HostTimer

    if getattr(args, "resummarize", None):
        return _resummarize(args, report)
    if not hasattr(args, "command_line"):
        args.command_line = None
    device = _device(args.device)
    gpu = device.type == "cuda"
    if args.reps is None:
        args.reps = (30 if args.quick else 100) if gpu else (2 if args.quick else 3)
    if args.max_sets is None:
        args.max_sets = 32 if gpu else 2
    if args.warmup is None:
        args.warmup = (5 if args.quick else 10) if gpu else 1
    try:
        anchors = A.make_anchors(device, [n.strip() for n in args.anchors.split(",") if n.strip()]
                                 if args.anchors else None)
    except ValueError as exc:
        print(f"benchmarks.harness: --anchors: {exc}", file=sys.stderr)
        return 2
    listed = (C.gpu_cases(args.quick) + C.feature_cases(args.quick) if gpu
              else C.cpu_cases() + C.cpu_feature_cases())
    cases = C.select(listed, args.cases)  # the features family only when --cases names it
    if not cases:
        print(f"benchmarks.harness: --cases {args.cases!r} matches no case", file=sys.stderr)
        return 2
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("  CPU run without TRITON_INTERPRET=1: DHP runs the reference path "
              "(set TRITON_INTERPRET=1 before starting to run the Triton kernels in the interpreter)", flush=True)
    timer = CudaTimer(args.reps, args.warmup) if gpu else HostTimer(args.reps, args.warmup)
    head = header(args, device, timer)
    print(f"benchmarks.harness on {head['device']['name']} (commit {head['commit']}), {len(cases)} cases, "
          f"anchors {', '.join(a.name for a in anchors)}; clock: {timer.clock}", flush=True)
    ceil = ceilings.measure(device, timer, quick=args.quick)
    for k, v in ceil.items():
        print(f"  ceiling {k}: " + (f"{v['GBps']:.0f} GB/s" if "GBps" in v else
                                    f"{v['TFLOPs']:.1f} TFLOP/s" if "TFLOPs" in v else v["status"]), flush=True)
    l2 = head["device"].get("l2_bytes") or 50 * 2**20
    t0 = time.time()
    rows = run_cases(cases, anchors, device=device, timer=timer, l2_bytes=l2, max_sets=args.max_sets,
                     graphs=not args.no_graph, seed=args.seed)
    head["seconds"] = round(time.time() - t0, 1)
    doc = report.build(head, ceil, cases, rows, e2e_paths=args.e2e_json or [])
    paths = report.write(doc, args.out, latest=args.latest, plots=not args.no_plots)
    print()
    print(report.summary_text(doc))
    feature_lines = report.features_table(rows)
    if feature_lines:
        print()
        print("\n".join(feature_lines))
    print(f"{len(rows)} rows in {head['seconds']:.0f} s; written: " + ", ".join(paths))
    if gpu:
        print("to publish: --latest docs/bench/latest.json, and copy bench.md and the PNGs of --out to "
              "docs/bench/ (latest.md); dated raw runs stay out of the tree")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
