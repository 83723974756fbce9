"""`dhp-backend audit sass`: run the G2 gate over variants, write the reports, print the summary.

Variants compile in worker processes (``--jobs``, default: every core), each
compiling and auditing one binary and returning JSON. Triton's own cache keeps
compiled binaries between runs (``--cache-dir`` points it elsewhere, e.g. a CI
cache directory). Reports: ``<report-dir>/<date>-sass-cpu-triton<version>.md``
and ``.json``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import time

from dhp_backend.audit.provenance import report_stem, versions, write_report_files
from dhp_backend.audit import rules as R


def _audit_one(vd: dict) -> dict:
    from dhp_backend.audit import gate, variants

    # Every field of the variant (split mode, step kind, policy-off binary included):
    # each one selects a different binary.
    fields = {f.name for f in dataclasses.fields(variants.Variant)}
    v = variants.Variant(**{k: vd[k] for k in fields if k in vd})
    t = time.time()
    try:
        ck = variants.compile_variant(v)
        res = gate.audit_compiled(ck, v.kernel, v.as_dict())
        res["registers"] = getattr(ck.metadata, "num_regs", None) or getattr(ck, "n_regs", None)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile fails the gate, with the reason
        res = {"kernel": v.kernel, "variant": v.as_dict(), "branches": [], "slow_paths": [], "documented_leaks": [],
               "passed": False, "failures": [{"kernel": v.kernel, "index": None, "instr": "", "source": "",
                                              "source_text": "",
                                              "why": f"compile/audit error: {type(e).__name__}: {e}"}]}
    res["seconds"] = round(time.time() - t, 2)
    return res


def run(variant_list, jobs: int | None = None, cache_dir: str | None = None, progress=print) -> list[dict]:
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(cache_dir)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(variant_list) or 1))
    items = [v.as_dict() for v in variant_list]
    results = []
    t0 = time.time()
    # Compile in fresh processes, always: Triton decides interpreter vs compiler
    # for every @jit function (its own library's included) when it is defined,
    # so a process that imported Triton under TRITON_INTERPRET=1 (the CPU test
    # session does) cannot compile for a GPU target. Children get an
    # environment without it.
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
            futs = [ex.submit(_audit_one, d) for d in items]
            for n, fut in enumerate(cf.as_completed(futs), 1):
                r = fut.result()
                results.append(r)
                _progress(progress, n, len(items), r, t0)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    order = {d["key"]: i for i, d in enumerate(items)}
    results.sort(key=lambda r: order.get(r["variant"].get("key"), 0))
    return results


def _progress(progress, n, total, r, t0):
    if progress:
        progress(f"[{n}/{total}] {r['variant'].get('key', r['kernel'])}: {'pass' if r['passed'] else 'FAIL'} "
                 f"({len(r['branches'])} control instrs, {r['seconds']}s; {time.time() - t0:.0f}s elapsed)")


def summarize(results: list[dict], seconds: float, scope: str) -> dict:
    fails = [f for r in results for f in r["failures"]]
    leaks = sorted({n for r in results for n in r["documented_leaks"]})
    by_rule: dict[str, int] = {}
    for r in results:
        for b in r["branches"]:
            by_rule[b["rule"] or "UNEXPLAINED"] = by_rule.get(b["rule"] or "UNEXPLAINED", 0) + 1
    return {"gate": "G2 SASS", "passed": not fails and bool(results), "scope": scope, "variants": len(results),
            "variants_failed": sum(not r["passed"] for r in results), "control_instructions": sum(
                len(r["branches"]) for r in results), "by_rule": by_rule, "failures": fails,
            "documented_leaks": leaks, "seconds": round(seconds, 1), "rule_table_errors": R.check_tables()}


def print_summary(s: dict, results: list[dict], out=print) -> None:
    out(f"G2 SASS gate: {'PASS' if s['passed'] else 'FAIL'}  ({s['variants']} variants, {s['scope']}, "
        f"{s['control_instructions']} control instructions, {s['seconds']}s)")
    out("  explained by rule: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_rule"].items())))
    if s["documented_leaks"]:
        out("  not gated (documented contract limits, docs/kernels.md section 5):")
        for n in s["documented_leaks"][:6]:
            out(f"    {n}")
    for e in s["rule_table_errors"]:
        out(f"  RULE TABLE ERROR: {e}")
    if s["failures"]:
        out(f"  {len(s['failures'])} failure(s) in {s['variants_failed']} variant(s):")
        for f in s["failures"][:12]:
            idx = f"#{f['index']} " if f["index"] is not None else ""
            out(f"    {f['kernel']} {idx}{f['instr'][:60]} [{f['source']}] {f['source_text'][:50]}")
            out(f"      -> {f['why'][:200]}")
        if len(s["failures"]) > 12:
            out(f"    ... {len(s['failures']) - 12} more in the report")


def _rule_table_md() -> list[str]:
    lines = ["## Rule table", "", "Generic rules (every kernel):", "", "| rule | why it is public |", "| --- | --- |"]
    lines += [f"| `{k}` | {v} |" for k, v in R.GENERIC.items()]
    lines += ["", "Source rules (a branch at this line is explained only if TTIR's control op at that line "
              "depends on nothing outside `sources`, under every gating scenario):", "",
              "| kernel | rule | function | line pattern | kind | sources | reason |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for spec in R.SPECS.values():
        for r in spec.rules:
            lines.append(f"| {spec.kernel} | `{r.name}` | `{r.function}` | `{r.pattern}` | {r.kind} | "
                         f"{', '.join(sorted(r.sources))} | {r.reason} |")
    lines += ["", "Scenarios (policy flag folded into the taint analysis):", "",
              "| kernel | scenario | gating | note |", "| --- | --- | --- | --- |"]
    for spec in R.SPECS.values():
        for sc in spec.scenarios:
            lines.append(f"| {spec.kernel} | {sc.name} | {'yes' if sc.gating else 'no'} | {sc.note} |")
    return lines


def write_reports(report_dir: str, s: dict, results: list[dict], where: str = "cpu") -> tuple[str, str]:
    """``where``: the machine whose compiler built the binaries ("cpu" = compiled for sm_90 on a CPU)."""
    vers = {**versions(), "target": "sm_90 (compiled on the CPU with Triton's bundled ptxas)" if where == "cpu"
            else "the binaries this GPU's Triton compiled and ran"}
    stem, date = report_stem(report_dir, "sass", f"{where}-triton{vers['triton']}")
    md = [f"# G2 SASS gate — {date}, {'CPU (compiled for sm_90)' if where == 'cpu' else where}, "
          f"Triton {vers['triton']}", "",
          f"Result: **{'PASS' if s['passed'] else 'FAIL'}** — {s['variants']} variants ({s['scope']}), "
          f"{s['control_instructions']} control instructions, {len(s['failures'])} failures, {s['seconds']} s.",
          "", f"Commit {vers['commit']}, dhp_backend {vers['dhp_backend']}, Python {vers['python']}, "
          f"target {vers['target']}. Produced by `dhp-backend audit sass`; the JSON next to this file has every "
          "instruction.", "",
          "What the SASS comes from: this machine's Triton. The GPU machine runs another Triton version; run "
          "`gate.audit_compiled` on `variants.from_device_caches()` there to judge what executes.", ""]
    if s["failures"]:
        md += ["## Failures", "", "| kernel | instr # | instruction | source | why |",
               "| --- | --- | --- | --- | --- |"]
        for f_ in s["failures"]:
            md.append(f"| {f_['kernel']} | {f_['index']} | `{f_['instr'][:60].replace('`', '')}` | {f_['source']} "
                      f"`{f_['source_text'][:50]}` | {f_['why']} |")
        md.append("")
    if s["documented_leaks"]:
        md += ["## Not gated: documented contract limits", ""] + [f"- {n}" for n in s["documented_leaks"]] + [""]
    md += _rule_table_md() + ["", "## Variants", "",
                              "| variant | result | control instrs | rules | slow paths | MUFU.EX2 / RCP | HGMMA |",
                              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rules_ = {}
        for b in r["branches"]:
            rules_[b["rule"] or "UNEXPLAINED"] = rules_.get(b["rule"] or "UNEXPLAINED", 0) + 1
        c = r.get("counts", {})
        md.append(f"| {r['variant'].get('key')} | {'pass' if r['passed'] else 'FAIL'} | {len(r['branches'])} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(rules_.items()))} | {len(r['slow_paths'])} | "
                  f"{c.get('mufu_ex2')} / {c.get('mufu_rcp')} | {c.get('hgmma')} |")
    shown = set()
    md += ["", "## Branches, per kernel (first variant of each kernel in full)", ""]
    for r in results:
        if r["kernel"] in shown or not r["branches"]:
            continue
        shown.add(r["kernel"])
        md += [f"### {r['variant'].get('key')}", "", "| # | instruction | source | PTX | rule |",
               "| --- | --- | --- | --- | --- |"]
        for b in r["branches"]:
            md.append(f"| {b['index']} | `{b['instr'].replace('`', '')}` | {b['source']} `{b['source_text'][:60]}` | "
                      f"`{b['ptx'][:50]}` | {b['rule'] or 'UNEXPLAINED: ' + b['detail']} |")
        md.append("")
    return write_report_files(stem, {"date": date, "versions": vers, "summary": s, "results": results}, md)
