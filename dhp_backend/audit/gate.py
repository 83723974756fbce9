"""Classify every control instruction of one compiled kernel; the G2 verdict for it.

Input: the artefacts Triton produced for one specialization (TTIR, PTX, cubin),
wherever they come from (compiled here for sm_90, or taken from
``kernel.device_caches`` on the GPU machine). Output: a JSON-able dict listing
every branch with the rule that explains it, slow paths, and failures. The
decision for one instruction (see `rules` for the rule kinds):

1. BSSY/BSYNC/WARPSYNC, unpredicated EXIT or jump, the trap loop: generic rules.
2. CALL/RET, FCHK: a subroutine or a precise-division check: fail (slow path).
3. A predicated branch or an indirect jump: its PTX line (nvdisasm ``-gp``) says
   what ptxas compiled it from.
   - A PTX ``bra``/``ret``/``exit``: source control flow. The Python line (``-gi``)
     must match a source rule of the kernel, TTIR must hold a control op of the
     rule's kind at that line, and under every gating scenario its labels must
     lie inside the rule's sources.
   - A predicated PTX instruction of another kind (a guarded store): a lane
     guard; its PTX predicate must derive only from thread/program index and
     parameters.
   - Anything else: unexplained.
Also every TTIR control op must be covered by a source rule and public, whether
or not it survived as a SASS branch (a data-dependent ``if`` that the compiler
turned into predication is still reported).
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re

from dhp_backend.audit import guarded as guardedmod
from dhp_backend.audit import ptx as ptxmod
from dhp_backend.audit import rules as R
from dhp_backend.audit import sass as sassmod
from dhp_backend.audit import sass_slice as slicemod
from dhp_backend.audit import ttir as ttirmod


@functools.lru_cache(maxsize=64)
def _functions(path: str) -> tuple:
    """(start, end, name) of every function defined in a source file, innermost last."""
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.lineno, node.end_lineno or node.lineno, node.name))
    return tuple(sorted(out))


_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_source(path: str | None) -> str | None:
    """The file a line-info path names, in this checkout.

    Triton's on-disk cache is keyed by the kernel source and its starting line
    (and its callees'), not by where the file was: a binary compiled from another
    checkout (a CI clone, a removed worktree, the developer's tree) carries that
    checkout's path. A path inside a ``dhp_backend/`` tree is always read from
    this package's copy, whether or not the other file still exists: the cache
    key guarantees the same kernel source at the same lines here, while the other
    checkout may since have changed (a fresh-clone CI run once read a developer
    tree's edited file at the cached binary's path and failed). Anything else is
    returned as is, and the gate fails closed on a line it cannot read."""
    if not path:
        return path
    parts = path.replace("\\", "/").split("/")
    if "dhp_backend" in parts:
        local = os.path.join(_PACKAGE_PARENT, *parts[len(parts) - 1 - parts[::-1].index("dhp_backend"):])
        if os.path.exists(local):
            return local
    return path


def source_line(path: str | None, line: int | None) -> tuple[str | None, str]:
    """(enclosing function, stripped text) of a source line."""
    if not path or not line:
        return None, ""
    path = resolve_source(path)
    text = linecache.getline(path, line).strip()
    fn = None
    for a, b, name in _functions(path):
        if a <= line <= b:
            fn = name  # sorted by start: the last match is the innermost
    return fn, text


def _match_rule(spec: R.KernelSpec, fn: str | None, text: str):
    for r in spec.rules:
        if r.function == fn and re.match(r.pattern, text):
            return r
    return None


def _where(src) -> dict:
    if src is None:
        return {"file": None, "line": None, "function": None, "text": "", "at": "no line info"}
    fn, text = source_line(src.file, src.line)
    return {"file": src.file, "line": src.line, "function": fn, "text": text, "at": src.short()}


def _check_source_rule(rule, ctl_by_scn, spec, where) -> tuple[bool, list[str], list[str]]:
    """(ok, failure details, documented-leak notes) for a source rule at a line."""
    kind = {"loop": ("scf.for",), "if": ("scf.if",)}[rule.kind]
    fails, notes = [], []
    for scn in spec.scenarios:
        ops = [c for c in ctl_by_scn[scn.name] if c.kind in kind and c.line == where["line"]
               and c.file and os.path.basename(c.file) == os.path.basename(where["file"] or "")]
        if not ops:
            if scn.gating:
                fails.append(f"rule {rule.name} ({rule.kind}) but TTIR has no {kind[0]} at line {where['line']} "
                             f"under '{scn.name}'")
            continue
        labels = frozenset().union(*(c.labels for c in ops))
        extra = labels - rule.sources
        if not extra:
            continue
        if scn.gating:
            fails.append(f"under '{scn.name}' the {rule.kind} condition depends on {sorted(extra)}, "
                         f"outside rule {rule.name}'s sources {sorted(rule.sources)}")
        elif extra <= scn.documented:
            notes.append(f"{rule.name} under '{scn.name}': also depends on {sorted(extra)}")
        else:
            fails.append(f"under '{scn.name}' depends on {sorted(extra - scn.documented)}, beyond the "
                         f"documented {sorted(scn.documented)}")
    return not fails, fails, notes


def _lane_public(labs) -> str | None:
    """`guarded.rule`'s verdict on a PTX predicate's labels: public when every label is a thread or
    program index or a kernel parameter (the lane guards' rule), else None."""
    return "public" if all(x.startswith(R.LANE_GUARD_ALLOWED_PREFIXES) for x in labs) else None


def audit_artefacts(kernel: str, ttir: str, ptx: str, cubin: bytes, variant: dict | None = None) -> dict:
    """The gate for one compiled kernel. ``kernel``: the function name (its spec in `rules`)."""
    spec = R.spec_for(kernel)
    ctl_by_scn = {s.name: ttirmod.analyse(ttir, s.assume, kernel) for s in spec.scenarios}
    arg_names = ttirmod.parse(ttir, kernel)[0]
    ptaint = ptxmod.Taint(ptx, [a[1:] for a in arg_names])
    ptx_instrs = ptxmod.instructions("\n".join(ptaint.lines))  # asm-scoped registers renamed as the taint has them
    funcs = sassmod.disassemble(cubin)
    f = funcs.get(kernel) or (next(iter(funcs.values())) if len(funcs) == 1 else None)
    if f is None:
        raise ValueError(f"{kernel} not in the cubin (functions: {sorted(funcs)})")
    instrs = f["instrs"]
    labels = f["labels"]
    last_exit = max((i.index for i in instrs if i.base == "EXIT" and not i.predicate), default=-1)

    branches, failures, notes, slow = [], [], [], []
    guarded: dict[str, int] = {}
    for ins in instrs:
        if ins.base == "FCHK" or ins.opcode.startswith("MUFU.RCP64") or ins.opcode.startswith("DSETP"):
            slow.append({"where": "sass", "index": ins.index, "instr": ins.text, "what": ins.opcode,
                         "at": _where(ins.src)["at"]})
        if ins.predicate and ins.base in guardedmod.DATA_OPS:  # guarded arithmetic (audit/guarded.py)
            why = guardedmod.check(ins, instrs, labels, ptaint, _lane_public, guarded)
            if why:
                w = _where(ins.src)
                failures.append({"kernel": kernel, "index": ins.index, "instr": ins.text, "source": w["at"],
                                 "source_text": w["text"], "why": why})
        if not ins.is_control:
            continue
        w = _where(ins.src)
        rec = {"index": ins.index, "offset": f"0x{ins.offset:04x}", "instr": ins.text, "predicate": ins.predicate,
               "source": w["at"], "function": w["function"], "source_text": w["text"], "ptx_line": ins.ptx_line,
               "ptx": ptx_instrs.get(ins.ptx_line, "") if ins.ptx_line else ""}
        rule, detail, ok = None, "", True
        indirect = ins.base in ("BRX", "JMX")
        if ins.base in ("CALL", "RET"):
            ok, detail = False, "subroutine call/return: a slow-path routine (precise division, libdevice...)"
            slow.append({"where": "sass", "index": ins.index, "instr": ins.text, "what": ins.base, "at": w["at"]})
        elif not ins.predicate and not indirect:
            rule, detail = sassmod.unpredicated_rule(ins, labels, last_exit)
            ok = rule is not None
        else:
            p = rec["ptx"]
            pop = ptxmod.opcode(p).split(".")[0] if p else ""
            preg, _ = ptxmod.guard(p) if p else (None, False)
            plabels = sorted(ptaint.labels(preg)) if preg else []
            rec["ptx_predicate_labels"] = plabels
            srule = _match_rule(spec, w["function"], w["text"])
            if pop in ("bra", "ret", "exit") or (srule and not preg):
                if srule is None:
                    ok = False
                    detail = (f"no source rule of {kernel} for {w['function']}:{w['line']} '{w['text']}'"
                              f" (PTX predicate derives from {plabels})")
                else:
                    ok, fails, nts = _check_source_rule(srule, ctl_by_scn, spec, w)
                    rule = srule.name
                    detail = "; ".join(fails)
                    notes += [n for n in nts if n not in notes]
            elif preg:
                bad = [x for x in plabels if not x.startswith(R.LANE_GUARD_ALLOWED_PREFIXES)]
                if bad:
                    ok = False
                    detail = f"ptxas branch around predicated '{p[:60]}' whose predicate derives from {bad}"
                else:
                    rule = "lane-guard"
            else:
                # ptxas-made branch (e.g. a hoisted zero-trip guard): prove its predicate public
                # by a backward slice in SASS, or fail.
                proven, why = slicemod.public_predicate(instrs, labels, ins)
                if proven:
                    rule, detail = "param-guard", why
                else:
                    ok = False
                    detail = f"predicated branch with no PTX counterpart and no source rule; SASS slice: {why}"
        rec.update(rule=rule, ok=ok, detail=detail)
        branches.append(rec)
        if not ok:
            failures.append({"kernel": kernel, "index": ins.index, "instr": ins.text, "source": w["at"],
                             "source_text": w["text"], "why": detail})

    # Source-level control flow, whether or not a branch survived in SASS.
    for scn in spec.scenarios:
        if not scn.gating:
            continue
        for c in ctl_by_scn[scn.name]:
            fn, text = source_line(c.file, c.line)
            r = _match_rule(spec, fn, text)
            extra = c.labels - (r.sources if r else frozenset())
            if r is None or extra:
                at = f"{os.path.basename(c.file or '?')}:{c.line}"
                why = (f"TTIR {c.kind} at {at} '{text}' " +
                       ("has no source rule" if r is None else f"depends on {sorted(extra)}") +
                       f" (labels {sorted(c.labels)}, scenario '{scn.name}')")
                failures.append({"kernel": kernel, "index": None, "instr": c.text, "source": at,
                                 "source_text": text, "why": why})

    for s in ptxmod.slow_paths(ptx):
        slow.append({"where": "ptx", **s})
    for s in slow:
        if s["where"] == "ptx" or s["what"] in ("FCHK",):
            failures.append({"kernel": kernel, "index": s.get("index"), "instr": s["instr"],
                             "source": s.get("at") or f"ptx:{s.get('ptx_line')}", "source_text": "",
                             "why": f"slow path: {s['what']}" + (f" ({s['why']})" if s.get("why") else "")})
    return {"kernel": kernel, "variant": variant or {}, "n_instructions": len(instrs), "branches": branches,
            "guarded_data_ops": guarded,
            "slow_paths": slow, "documented_leaks": notes, "failures": failures, "passed": not failures,
            "counts": {"mufu_ex2": sum(i.opcode.startswith("MUFU.EX2") for i in instrs),
                       "mufu_rcp": sum(i.opcode.startswith("MUFU.RCP") for i in instrs),
                       "hgmma": sum(i.base == "HGMMA" for i in instrs)}}


def audit_compiled(ck, kernel: str | None = None, variant: dict | None = None) -> dict:
    """The gate on a Triton ``CompiledKernel`` (from `triton.compile` or ``fn.device_caches``)."""
    name = kernel or getattr(ck, "name", None) or ck.metadata.name
    return audit_artefacts(name, ck.asm["ttir"], ck.asm["ptx"], ck.asm["cubin"], variant)
