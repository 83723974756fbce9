"""G2 for the csrc CUDA kernels: every branch of a constant-time binary explained by a public rule.

    dhp-backend audit sass-cuda [--sources prefill_sm90.cu,decode_sm90.cu] [--json] [--report-dir DIR]

Builds each source to a cubin with nvcc (``-lineinfo``, the device flags of the
library `ops.cuda_build` loads; needs nvcc, no GPU), disassembles it with
``nvdisasm -gi`` (CUDA source line and inline chain per instruction) and ``-gp``
(the PTX line ptxas compiled it from, in the cubin's ``.nv_debug_ptx_txt``),
and for every function that `cuda_rules.instance` marks gating classifies each
control instruction:

1. generic, as in the Triton gate (`gate`): reconvergence markers, an
   unpredicated EXIT or jump, the trap loop after the last EXIT;
2. a wait: the predicate comes straight from ``SYNCS.PHASECHK`` (an mbarrier
   try-wait) or ``USETMAXREG.TRY_ALLOC`` (``setmaxnreg.inc`` waiting for the
   registers another warpgroup frees); the trip count is timing, not data;
3. an elect loop (``BRA.U.ANY`` around ``ELECT``): ptxas issues an instruction
   that needs warp-uniform operands (a TMA copy) once per active lane; its trip
   count is the number of active lanes, fixed by the (gated) branches before it;
4. a branch compiled from PTX control flow (``@%p bra``) or from a predicated
   PTX instruction: its CUDA line must match a rule of `cuda_rules.RULES` and
   the PTX predicate's labels (`ptx.Taint`, flow-insensitive) must lie inside
   the rule's classes;
5. any other predicated branch (ptxas's own, e.g. a hoisted loop guard): a
   backward slice over the SASS control-flow graph must resolve its predicate
   into parameters, thread and CTA indices (`sass_slice.public_predicate_cfg`).

Also every guarded ``bra`` in the function's PTX must carry public labels
(whether or not ptxas kept it as a branch), and no slow path (``div.rn``,
subroutine calls, FCHK) may appear. Non-gating instances are audited the same
way and reported; their documented labels do not fail them.

Exit status: 0 pass, 1 a gating binary fails, 2 no nvcc here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
import time

from dhp_backend.audit import cuda_rules as CR
from dhp_backend.audit import guarded as guardedmod
from dhp_backend.audit import ptx as ptxmod
from dhp_backend.audit import sass as sassmod
from dhp_backend.audit import sass_slice as slicemod

# What the library build of each source uses (ops.cuda_prefill / ops.cuda_decode).
SOURCES = {
    "prefill_sm90.cu": ("dhp_prefill_sm90", ()),
    "decode_sm90.cu": ("dhp_decode_sm90", ()),
}


def elf_section(blob: bytes, name: str) -> bytes | None:
    """A section of a 64-bit little-endian ELF (a cubin), or None."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    entsize, count, strndx = struct.unpack_from("<HHH", blob, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", blob, shoff + i * entsize) for i in range(count)]
    strtab = heads[strndx][4]
    for sh_name, _type, _flags, _addr, off, size in heads:
        end = blob.index(b"\0", strtab + sh_name)
        if blob[strtab + sh_name:end].decode() == name:
            return blob[off:off + size]
    return None


def embedded_ptx(cubin: bytes) -> str:
    """The PTX ptxas compiled, as ``nvdisasm -gp`` numbers its lines (NUL-separated in the section)."""
    raw = elf_section(cubin, ".nv_debug_ptx_txt")
    if raw is None:
        raise ValueError("the cubin has no .nv_debug_ptx_txt section: build it with -lineinfo")
    return raw.decode("utf-8", errors="replace").replace("\0", "\n")


def function_ptx(ptx: str, name: str) -> str:
    """``ptx`` with every line outside the ``.entry name`` function blanked (line numbers kept)."""
    lines = ptx.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith((f".entry {name}(", f".visible .entry {name}("))),
                 None)
    if start is None:
        raise ValueError(f"{name} not in the embedded PTX")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^(\.visible\s+)?\.(entry|func)\s", lines[i])),
               len(lines))
    return "\n".join(ln if start <= i < end else "" for i, ln in enumerate(lines))


def _source_text(src, dirs: tuple = ()) -> str:
    """The stripped source line a location names, read by basename from ``dirs``, then this
    checkout's ``csrc/``, and only then from the path as compiled. The build cache is keyed by the
    sources' contents and shared between checkouts, so a cubin may carry another checkout's path,
    whose file can have changed since (a CI clone read shifted lines of the main tree's edited
    file); this checkout's ``csrc/`` holds the very contents the cubin was built from."""
    from dhp_backend.ops.cuda_build import csrc_dir

    if src is None:
        return ""
    base = os.path.basename(src.file)
    for path in (*(os.path.join(d, base) for d in dirs), str(csrc_dir() / base), src.file):
        if os.path.isfile(path):
            with open(path) as f:
                lines = f.read().splitlines()
            return lines[src.line - 1].strip() if 0 < src.line <= len(lines) else ""
    return ""


def _elect_loop(instrs: list, labels: dict, ins) -> tuple[bool, str]:
    """A ``BRA.U.ANY`` back to an ELECT whose predicate only PLOP3 writes in the loop."""
    if not ins.opcode.startswith("BRA.U.ANY") or not ins.predicate:
        return False, ""
    tgt = labels.get(ins.target)
    body = [i for i in instrs if tgt is not None and tgt <= i.offset < ins.offset]
    if not body:
        return False, "BRA.U.ANY that is not a backward branch"
    if not any(i.base == "ELECT" for i in body):
        return False, "BRA.U.ANY loop without ELECT"
    p = ins.predicate.lstrip("!")
    writers = [i for i in body if re.search(rf"^(@!?U?P\w+\s+)?\S+\s+{p}\b", i.text)]
    bad = [i for i in writers if not i.opcode.startswith("PLOP3")]
    if bad:
        return False, f"loop predicate {p} also written by #{bad[0].index} {bad[0].text}"
    return True, (f"ELECT loop over the active lanes (#{body[0].index}..#{ins.index}): one trip per active lane, "
                  "and which lanes are active is decided by the gated branches before it")


def _csrc_public(documented: frozenset):
    """The csrc gate's verdict on a PTX predicate's labels for `guarded.rule`: "public", "documented"
    (the binary's documented extra labels) or None."""
    def judge(labs) -> str | None:
        classes = {CR.label_class(x) for x in labs}
        if classes <= CR.PUBLIC:
            return "public"
        return "documented" if classes - CR.PUBLIC <= documented else None
    return judge


def audit_function(name: str, funcs: dict, ptx_all: str, inst: CR.Instance, source_dirs: tuple = ()) -> dict:
    """The gate for one kernel function of a cubin (``funcs``: `sass.disassemble`; ``ptx_all``: `embedded_ptx`)."""
    f = funcs[name]
    instrs, labels = f["instrs"], f["labels"]
    taint = ptxmod.Taint(function_ptx(ptx_all, name))
    allowed_extra = inst.documented
    last_exit = max((i.index for i in instrs if i.base == "EXIT" and not i.predicate), default=-1)
    branches, failures, documented, slow = [], [], [], []

    def classes(labs) -> set[str]:
        return {CR.label_class(x) for x in labs}

    def judge(rule_classes, labs) -> tuple[bool, list[str]]:
        extra = sorted(classes(labs) - set(rule_classes))
        if not extra:
            return True, []
        if set(extra) <= allowed_extra:
            documented.append(extra)
            return True, extra
        return False, extra

    guarded: dict[str, int] = {}
    judge_guard = _csrc_public(allowed_extra)
    for ins in instrs:
        if ins.base == "FCHK" or ins.opcode.startswith(("MUFU.RCP64", "DSETP")):
            slow.append({"index": ins.index, "instr": ins.text, "what": ins.opcode})
        if ins.predicate and ins.base in guardedmod.DATA_OPS:
            why = guardedmod.check(ins, instrs, labels, taint, judge_guard, guarded)
            if why:
                failures.append({"index": ins.index, "instr": ins.text,
                                 "source": ins.src.short() if ins.src else "no line info",
                                 "source_text": _source_text(ins.src, source_dirs), "why": why})
        # A predicated barrier chooses, like a branch, which threads wait at it (ptxas predicates a
        # bar.sync / bar.arrive under a warp-uniform condition instead of branching around it): explained
        # the same way.
        if not (ins.is_control or (ins.predicate and ins.base == "BAR")):
            continue
        text = _source_text(ins.src, source_dirs)
        rec = {"index": ins.index, "offset": f"0x{ins.offset:04x}", "instr": ins.text,
               "source": ins.src.short() if ins.src else "no line info", "source_text": text,
               "ptx_line": ins.ptx_line}
        ptx_text = taint.lines[ins.ptx_line - 1].strip() if ins.ptx_line and ins.ptx_line <= len(taint.lines) else ""
        rec["ptx"] = ptx_text[:120]
        rule, ok, detail = None, True, ""
        indirect = ins.base in ("BRX", "JMX")
        if ins.base in ("CALL", "RET"):
            ok, detail = False, "subroutine call/return: a slow-path routine"
            slow.append({"index": ins.index, "instr": ins.text, "what": ins.base})
        elif not ins.predicate and not indirect:
            rule, detail = sassmod.unpredicated_rule(ins, labels, last_exit)
            ok = rule is not None
        elif indirect:
            ok, detail = False, "indirect branch"
        else:
            wait = slicemod.wait_source(instrs, labels, ins)
            elect_ok, elect_why = _elect_loop(instrs, labels, ins)
            guard = taint.guard_register(ptx_text) if ptx_text else None
            if wait:
                rule, detail = "wait", f"predicate from {wait}: a wait whose spins are timing, not data"
            elif elect_ok:
                rule, detail = "elect-loop", elect_why
            elif ins.opcode.startswith("BRA.U.ANY"):
                ok, detail = False, elect_why
            elif guard:
                labs = sorted(taint.labels(guard))
                rec["ptx_predicate_labels"] = labs
                srule = CR.match(ins.src.file if ins.src else None, text)
                if srule is None:
                    ok = False
                    detail = f"no rule for {rec['source']} '{text}' (PTX predicate labels {labs})"
                else:
                    rule = srule.name
                    ok, extra = judge(srule.allowed, labs)
                    if extra:
                        detail = (f"{'documented: ' if ok else ''}condition also carries {extra} "
                                  f"(labels {labs}), outside rule {srule.name}'s {sorted(srule.allowed)}")
            else:
                waits: set = set()
                proven, why = slicemod.public_predicate_cfg(instrs, labels, ins, waits=waits)
                if proven:
                    rule = "wait" if waits else "param-guard"
                    if waits:
                        detail = (f"predicate from wait results (#{', #'.join(map(str, sorted(waits)))}: timing, not "
                                  f"data) and public values only, on every path; {why}")
                    else:
                        detail = why
                elif "mem" in allowed_extra and "comes from memory" in why:
                    rule, detail = "documented", f"documented for this binary: {why}"
                    documented.append(["mem"])
                else:
                    ok, detail = False, f"ptxas-made branch with no PTX predicate; SASS slice: {why}"
        rec.update(rule=rule, ok=ok, detail=detail)
        branches.append(rec)
        if not ok:
            failures.append({"index": ins.index, "instr": ins.text, "source": rec["source"], "source_text": text,
                             "why": detail})

    # Every guarded PTX branch, kept by ptxas or not.
    ptx_branches = 0
    for k, line in enumerate(taint.lines, 1):
        s = line.split("//")[0].strip()
        g = ptxmod.guard(s)[0] if s.startswith("@") else None
        if not g or ptxmod.opcode(s).split(".")[0] != "bra":
            continue
        ptx_branches += 1
        labs = taint.labels(g)
        ok, extra = judge(CR.PUBLIC | {"mbarrier"}, labs)
        if not ok:
            failures.append({"index": None, "instr": s[:120], "source": f"ptx:{k}", "source_text": "",
                             "why": f"PTX branch on {sorted(labs)}: {extra} is not public"})
    for s in ptxmod.slow_paths("\n".join(taint.lines)):
        failures.append({"index": None, "instr": s["instr"], "source": f"ptx:{s['ptx_line']}", "source_text": "",
                         "why": f"slow path: {s['what']} ({s['why']})"})
    for s in slow:
        if s["what"] in ("FCHK",) or s["what"].startswith(("MUFU.RCP64", "DSETP")):
            failures.append({"index": s["index"], "instr": s["instr"], "source": "", "source_text": "",
                             "why": f"slow path: {s['what']}"})
    by_rule: dict[str, int] = {}
    for b in branches:
        by_rule[b["rule"] or "FAIL"] = by_rule.get(b["rule"] or "FAIL", 0) + 1
    return {"function": name, "kernel": inst.kernel, "template_args": list(inst.args), "gating": inst.gating,
            "note": inst.note, "n_instructions": len(instrs), "n_control": len(branches),
            "n_ptx_branches": ptx_branches, "by_rule": by_rule, "guarded_data_ops": guarded, "branches": branches,
            "documented": sorted({x for d in documented for x in d}), "failures": failures,
            "passed": not failures}


def audit_cubin(cubin: bytes, source: str) -> list[dict]:
    """Every kernel function of one cubin: gating and reported instances audited, the rest listed."""
    funcs = sassmod.disassemble(cubin)
    ptx_all = embedded_ptx(cubin)
    out = []
    for name in sorted(funcs):
        inst = CR.instance(name)
        if inst is None:
            continue
        if inst.gating or inst.documented:
            r = audit_function(name, funcs, ptx_all, inst)
        else:
            r = {"function": name, "kernel": inst.kernel, "template_args": list(inst.args), "gating": False,
                 "note": inst.note, "audited": False, "passed": None, "failures": []}
        r["source"] = source
        out.append(r)
    return out


# The feature libraries audited with the plain ones (`--features`): a model's window, soft-cap and
# sinks (cuda_build.feature_library); all three at once compile every feature path of the kernels. The
# head-64, head-80, head-96 and head-256 libraries (gpt-oss, Phi-2, Phi-3, Gemma; csrc/v2_arith.cuh DHP_HEAD)
# are other binaries of the same sources: "h64" / "h80" / "h96" / "h256" sets audit them.
FEATURE_SETS = {"plain": {}, "window+softcap+sinks": dict(window=True, softcap=True, sinks=True),
                "h64": dict(head=64), "h64+window+softcap+sinks": dict(window=True, softcap=True, sinks=True, head=64),
                "h80": dict(head=80), "h96": dict(head=96),
                "h96+window+softcap+sinks": dict(window=True, softcap=True, sinks=True, head=96),
                "h256": dict(head=256),
                "h256+window+softcap+sinks": dict(window=True, softcap=True, sinks=True, head=256)}
DEFAULT_FEATURE_SETS = ",".join(FEATURE_SETS)


def audit_sources(sources=tuple(SOURCES), progress=print, feature_sets=("plain",)) -> dict:
    from dhp_backend.ops import cuda_build

    t0 = time.time()
    results, nvcc = [], cuda_build.find_nvcc()
    for src, features in [(s, f) for f in feature_sets for s in sources]:
        if src not in SOURCES:
            raise ValueError(f"unknown csrc source {src!r}: one of {', '.join(SOURCES)}")
        if features not in FEATURE_SETS:
            raise ValueError(f"unknown feature set {features!r}: one of {', '.join(FEATURE_SETS)}")
        name, _, flags = cuda_build.feature_library((SOURCES[src][0], src), **FEATURE_SETS[features])
        progress(f"  {src} ({features}): nvcc -cubin -lineinfo ...")
        cubin = cuda_build.build_cubin(name, src, flags).read_bytes()
        rs = audit_cubin(cubin, src if features == "plain" else f"{src} [{features}]")
        for r in rs:
            if r.get("audited", True):
                progress(f"  {src} {r['kernel']}{r['template_args']}: {'gating' if r['gating'] else 'reported'}, "
                         f"{r['n_control']} control instructions {r['by_rule']} -> "
                         f"{'PASS' if r['passed'] else 'FAIL (%d)' % len(r['failures'])}")
        results += rs
    gating = [r for r in results if r["gating"]]
    return {"gate": "G2 SASS (csrc CUDA kernels)", "nvcc": nvcc, "seconds": round(time.time() - t0, 1),
            "gating_binaries": len(gating), "reported_binaries": sum(1 for r in results if r.get("audited", True)
                                                                     and not r["gating"]),
            "not_gated": sum(1 for r in results if r.get("audited") is False),
            "passed": bool(gating) and all(r["passed"] for r in gating), "results": results}


def write_reports(report_dir: str, s: dict, where: str = "nvcc") -> tuple[str, str]:
    """``<date>-sass-cuda-<where>.md`` and ``.json`` in ``report_dir`` (md path, json path)."""
    from dhp_backend.audit.provenance import report_stem, versions, write_report_files

    s = dict(s, versions=versions())
    lines = [f"# G2 SASS gate, csrc CUDA kernels: {'PASS' if s['passed'] else 'FAIL'}", "",
             f"nvcc: `{s['nvcc']}`; {s['gating_binaries']} gating binaries, {s['reported_binaries']} reported, "
             f"{s['not_gated']} not gated (policy off).", "",
             "| source | kernel | template args | role | control instr. | by rule | verdict |",
             "|---|---|---|---|---:|---|---|"]
    for r in s["results"]:
        role = "gating" if r["gating"] else ("reported" if r.get("audited", True) else "not gated")
        verdict = "-" if r["passed"] is None else ("PASS" if r["passed"] else f"FAIL ({len(r['failures'])})")
        lines.append(f"| {r['source']} | {r['kernel']} | {r['template_args']} | {role} | {r.get('n_control', '-')} "
                     f"| {r.get('by_rule', '-')} | {verdict} |")
    lines += ["", "## Rules", ""]
    lines += [f"- `{r.name}` ({r.file}, classes {sorted(r.allowed)}): {r.reason}" for r in CR.RULES]
    for r in s["results"]:
        if r.get("failures"):
            lines += ["", f"## Failures: {r['kernel']}{r['template_args']}", ""]
            lines += [f"- #{x['index']} `{x['instr']}` at {x['source']} `{x['source_text']}`: {x['why']}"
                      for x in r["failures"][:60]]
    stem, _ = report_stem(report_dir, "sass-cuda", where)
    return write_report_files(stem, s, lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sources", default=",".join(SOURCES), help="csrc sources (comma-separated)")
    ap.add_argument("--features", default=DEFAULT_FEATURE_SETS,
                    help=f"feature libraries to audit (comma-separated: {', '.join(FEATURE_SETS)})")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--report-dir", help="write <date>-sass-cuda-cpu.md/.json there")


def run(args) -> int:
    """``dhp-backend audit sass-cuda``."""
    from dhp_backend.ops import cuda_build

    if cuda_build.find_nvcc() is None:
        print("dhp-backend audit sass-cuda: no nvcc here (CUDA toolkit >= 12.5 needed to build the cubins)",
              file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    log("G2 SASS gate, csrc CUDA kernels")
    s = audit_sources(tuple(x.strip() for x in args.sources.split(",") if x.strip()), progress=log,
                      feature_sets=tuple(x.strip() for x in args.features.split(",") if x.strip()))
    if args.report_dir:
        s["reports"] = list(write_reports(args.report_dir, s))
    if args.json:
        print(json.dumps({k: v for k, v in s.items() if k != "results"}, indent=2))
    else:
        print(f"G2 csrc: {'PASS' if s['passed'] else 'FAIL'} ({s['gating_binaries']} gating binaries, "
              f"{s['seconds']} s)")
        for r in s["results"]:
            for x in r.get("failures", [])[:20]:
                print(f"  FAIL {r['kernel']}{r['template_args']} #{x['index']} {x['instr'][:60]} at {x['source']}: "
                      f"{x['why'][:200]}")
        if args.report_dir:
            print(f"  reports: {s['reports'][0]}, {s['reports'][1]}")
    return 0 if s["passed"] else 1
