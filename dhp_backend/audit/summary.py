"""``dhp-backend audit`` with no gate named: every gate this machine can run, then one table.

    dhp-backend audit [--gates G1,G2,G3,G4] [--report-dir DIR] [--jobs N] [--json]

- G2 SASS: the CI subset (`variants.CI_SUBSET`), compiled for sm_90 here (`report.run`);
- G3 bits: `bits.gate` with its defaults (every part this machine can run);
- G1 counters: `counters.gate` with its defaults, only with a CUDA GPU and ``ncu``;
- G4 timing: ``dhp_backend.audit.timing.run`` with ``--preset subset`` (one ~8-minute piece of the
  grid: decode, strict, churned layout, graph replay; the full grid takes hours and is run in
  pieces, `dhp-backend audit timing --estimate`), only with a CUDA GPU; "not available" while that
  module does not exist.

Arguments:
    --gates       which gates to consider (default: all four).
    --report-dir  passed to every gate that writes reports (e.g. docs/audit).
    --jobs        parallel compiles for G2 (default: every core).
    --json        print the table as JSON.

`run_all` returns 1 when a gate that ran failed (or crashed), else 0; a gate
that could not run here (no GPU, no ncu, module missing) does not fail the run,
it is listed with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

GATES = ("G1", "G2", "G3", "G4")
SCOPES = {"G1": "ncu counters, default shapes x all pairs", "G2": "SASS, CI subset (sm_90, compiled here)",
          "G3": "bits: repeat, batch invariance, policies",
          "G4": "timing, dudect-style: --preset subset (decode, strict, churned, graph)"}


def _gate_args(module, report_dir, **extra) -> argparse.Namespace:
    """A gate's own defaults (from its ``add_arguments``), with the shared options set."""
    p = argparse.ArgumentParser()
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    ns = p.parse_args([])
    if report_dir is not None:  # else each gate keeps its own default (G4 writes to docs/audit)
        ns.report_dir = report_dir
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


def _row(gate: str, result: str, report: str | None = None, detail: str = "", scope: str | None = None) -> dict:
    return {"gate": gate, "scope": scope or SCOPES[gate], "result": result, "report": report or "-",
            "detail": detail}


def _g2(args, log) -> dict:
    from dhp_backend.audit import report, variants

    vs = list(variants.CI_SUBSET)
    t = time.time()
    results = report.run(vs, jobs=args.jobs, progress=log)
    s = report.summarize(results, time.time() - t, "CI subset")
    path = None
    if args.report_dir:
        path = report.write_reports(args.report_dir, s, results, where="cpu")[0]
    ok = s["passed"] and not s["rule_table_errors"]
    rows = [_row("G2", "PASS" if ok else "FAIL", path,
                 f"{s['variants']} variants, {len(s['failures'])} failures, {s['seconds']} s")]
    rows.append(_g2_cuda(args, log))
    return rows


def _g2_cuda(args, log) -> dict:
    from dhp_backend.audit import cuda_gate
    from dhp_backend.ops import cuda_build

    scope = "SASS, csrc CUDA kernels (nvcc here)"
    if cuda_build.find_nvcc() is None:
        return _row("G2", "skipped", detail="no nvcc here: the csrc binaries cannot be built", scope=scope)
    s = cuda_gate.audit_sources(progress=log)
    path = cuda_gate.write_reports(args.report_dir, s)[0] if args.report_dir else None
    n_fail = sum(len(r["failures"]) for r in s["results"] if r["gating"])
    return _row("G2", "PASS" if s["passed"] else "FAIL", path,
                f"{s['gating_binaries']} gating binaries, {n_fail} failures, {s['seconds']} s", scope=scope)


def _g3(args, log) -> dict:
    from dhp_backend.audit import bits

    s = bits.gate(_gate_args(bits, args.report_dir), progress=log)
    return _row("G3", "PASS" if s["passed"] else "FAIL", (s.get("reports") or [None])[0],
                f"parts {s['scope']}, {s['seconds']} s", scope=f"bits: {s['scope']}")


def _g1(args, log) -> dict:
    from dhp_backend.audit import counters

    why = counters.unavailable_reason()
    if why:
        return _row("G1", "skipped", detail=why)
    s = counters.gate(_gate_args(counters, args.report_dir), progress=log)
    return _row("G1", "PASS" if s["passed"] else "FAIL", (s.get("reports") or [None])[0],
                f"{s['gating_failed']} gating / {s['reported_failed']} reported pairs differ, {s['seconds']} s")


def _g4(args, log) -> dict:
    try:
        timing = importlib.import_module("dhp_backend.audit.timing")
    except ModuleNotFoundError as e:
        if e.name not in ("dhp_backend.audit.timing",):
            raise
        return _row("G4", "not available", detail="dhp_backend.audit.timing is not in this tree yet")
    if not hasattr(timing, "run"):
        return _row("G4", "not available", detail="dhp_backend.audit.timing has no run(args)")
    import torch

    if not torch.cuda.is_available():
        return _row("G4", "skipped", detail="no CUDA GPU visible to torch here")
    ns = _gate_args(timing, args.report_dir)
    if hasattr(ns, "preset"):
        ns.preset = "subset"
    rc = timing.run(ns)
    result = {0: "PASS", 1: "FAIL"}.get(rc, "skipped" if rc == 2 else "FAIL")
    return _row("G4", result, getattr(ns, "report_dir", None), f"exit {rc}; see its output above")


_RUNNERS = {"G2": _g2, "G3": _g3, "G1": _g1, "G4": _g4}


def render_table(rows: list[dict]) -> list[str]:
    """The one-screen table: gate, scope, result, report (and why, for gates that did not run)."""
    w_scope = max([len("scope")] + [len(r["scope"]) for r in rows])
    w_res = max([len("result")] + [len(r["result"]) for r in rows])
    lines = [f"{'gate':4}  {'scope':{w_scope}}  {'result':{w_res}}  report", "-" * (4 + w_scope + w_res + 16)]
    for r in rows:
        lines.append(f"{r['gate']:4}  {r['scope']:{w_scope}}  {r['result']:{w_res}}  {r['report']}")
        if r["detail"]:
            lines.append(f"{'':4}  {r['detail'][:160]}")
    return lines


def exit_code(rows: list[dict]) -> int:
    return 1 if any(r["result"] in ("FAIL", "ERROR") for r in rows) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gates", default=",".join(GATES), help="gates to consider (default: %(default)s)")
    p.add_argument("--report-dir", help="reports of every gate go here (e.g. docs/audit)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles for G2 (default: all cores)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def run_all(args) -> int:
    wanted = [g.strip().upper() for g in args.gates.split(",") if g.strip()]
    bad = [g for g in wanted if g not in GATES]
    if bad:
        print(f"dhp-backend audit: unknown gate(s) {', '.join(bad)}; accepted: {', '.join(GATES)}", file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    rows = []
    for g in ("G2", "G3", "G1", "G4"):  # the CPU gates first: their answer comes in minutes
        if g not in wanted:
            continue
        log(f"=== {g}")
        try:
            res = _RUNNERS[g](args, log)
            rows += res if isinstance(res, list) else [res]
        except Exception as e:  # noqa: BLE001 - a gate that crashes is a failed gate, with its reason
            log(traceback.format_exc())
            rows.append(_row(g, "ERROR", detail=f"{type(e).__name__}: {e}"))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print()
        for line in render_table(rows):
            print(line)
    return exit_code(rows)
