"""Guarded floating-point instructions: work that runs in one class and not the other.

ptxas compiles ``c ? f(x) : y`` into f's last instruction guarded by c (``@P2 FFMA``), and
``if (c) v = f(v)`` into guarded instructions too. A guarded instruction issues whatever c
is, so G1's instruction counts are equal, but guarded off it does less work than when it
runs: on a secret c that is a timing difference, which G4 measured (the csrc prefill's
commit: 66 guarded FFMAs, H200 short vs long +0.039 %, t -12.8; with the choice a select on
the bits, ``ct::select_f32``, |t| <= 2.1). Both G2 gates (csrc `cuda_gate`, Triton `gate`)
ask of every guarded floating-point instruction that its guard be public, by one of:

- the SASS slice (`sass_slice.public_predicate_cfg`);
- the PTX line it comes from: its own guard (``@%p max.f32``), its select's predicate
  (``selp``), or the branch that skips the straight-line block holding it (``@%p bra $L;
  ...; $L:``, if-converted by ptxas), provided no select on a non-public predicate in the
  same block reads its result (ptxas may fold that select into the guard too);
- div.full's operand range scaling (an FMUL by 2^-2 or 2^24 under a guard on the divisor's
  range): the kernels divide by a row sum l selected into [1, L], where neither guard is
  ever true.
"""

from __future__ import annotations

import re
from typing import Callable

from dhp_backend.audit import ptx as ptxmod
from dhp_backend.audit import sass_slice as slicemod

# Floating-point data-path opcodes checked under a guard.
DATA_OPS = frozenset({"FFMA", "FADD", "FMUL", "FSEL", "FMNMX", "MUFU", "F2FP", "HGMMA", "HMMA", "FSWZADD"})
# div.full.f32's operand range scaling: the dividend and divisor times 2^-2 (divisor above 2^126)
# or 2^24 (below 2^-126).
DIV_RANGE_SCALES = ("0.25", "16777216")


def ptx_branch_guard(taint, line: int) -> str | None:
    """The predicate of the PTX branch that skips the straight-line code holding ``line``
    (``@%p bra $L; ...line...; $L:``); None when the code can be entered otherwise (a label
    first) or no such branch precedes it."""
    lines = taint.lines
    k = line - 1
    while k >= 1:
        t = lines[k - 1].split("//")[0].strip()
        k -= 1
        if not t:
            continue
        if t.endswith(":"):
            return None
        if ptxmod.opcode(t).split(".")[0] == "bra":
            g = taint.guard_register(t)
            target = t.rstrip(" ;").split()[-1]
            after = any(x.split("//")[0].strip() == f"{target}:" for x in lines[line:])
            return g if g and after else None
    return None


def selects_reading(taint, line: int) -> list[str]:
    """The predicates of the PTX selects (selp/slct) in the same basic block that read the
    register the PTX instruction at ``line`` writes."""
    t = taint.lines[line - 1].split("//")[0].strip() if 0 < line <= len(taint.lines) else ""
    parts = re.sub(r"^@!?%?[\w$]+\s+", "", t).rstrip(" ;").split(None, 1)
    if len(parts) < 2:
        return []
    dest = parts[1].split(",")[0].strip()
    out = []
    for x in taint.lines[line:]:  # to the end of the basic block
        u = x.split("//")[0].strip()
        op = ptxmod.opcode(u).split(".")[0]
        if u.endswith(":") or op in ("bra", "ret", "exit"):
            break
        if op in ("selp", "slct"):
            ops = [o.strip() for o in u.rstrip(" ;").split(None, 1)[1].split(",")]
            if dest in ops[1:-1]:
                out.append(ops[-1])
    return out


def rule(ins, instrs: list, labels: dict, taint, judge: Callable) -> tuple[str | None, str]:
    """(rule, why) for a guarded floating-point instruction, or (None, why not). ``judge(labels)``
    says what a PTX predicate's taint labels are: "public", "documented" (an extra label the
    binary is documented to carry) or None (secret)."""
    ops = [o.strip() for o in ins.text.split(",")]
    if ins.base == "FMUL" and ops and ops[-1].rstrip(" ;") in DIV_RANGE_SCALES:
        return "div-range", "div.full operand range scaling: never taken for a row sum l in [1, L]"
    waits: set = set()
    proven, why = slicemod.public_predicate_cfg(instrs, labels, ins, waits=waits)
    if proven:
        return ("wait" if waits else "param-guard"), why
    ptx_text = (taint.lines[ins.ptx_line - 1].split("//")[0].strip()
                if ins.ptx_line and ins.ptx_line <= len(taint.lines) else "")
    pred = taint.guard_register(ptx_text) if ptx_text else None
    if pred is None and ptxmod.opcode(ptx_text).split(".")[0] in ("selp", "slct"):
        pred = ptx_text.rstrip(" ;").split(",")[-1].strip()
    if pred is None and ins.ptx_line:
        pred = ptx_branch_guard(taint, ins.ptx_line)  # `if (public) x = f(x)`, if-converted by ptxas
    if pred:
        labs = set(taint.labels(pred))
        secret = [q for q in (selects_reading(taint, ins.ptx_line) if ins.ptx_line else [])
                  if judge(set(taint.labels(q))) is None]
        if secret:
            return None, f"{why}; its PTX result feeds a select on {secret}, not public"
        verdict = judge(labs)
        if verdict == "public":
            return "ptx-guard", f"PTX `{ptx_text[:60]}`: predicate {pred} carries {sorted(labs)[:6]}"
        if verdict == "documented":
            return "documented", f"PTX predicate {pred} carries {sorted(labs)[:6]} (documented for this binary)"
        why = f"{why}; PTX predicate {pred} carries {sorted(labs)[:6]}"
    return None, f"guard not proven public ({why})"


def check(ins, instrs: list, labels: dict, taint, judge: Callable, counts: dict) -> str | None:
    """`rule` for one guarded floating-point instruction of a gate, tallied in ``counts`` by rule
    ("FAIL" when none applies): the failure's reason, or None when a rule vouches for the guard."""
    r, why = rule(ins, instrs, labels, taint, judge)
    counts[r or "FAIL"] = counts.get(r or "FAIL", 0) + 1
    if r:
        return None
    return (f"guarded floating-point instruction: {why}: a secret guard makes the work run in one class and not "
            "the other (a select on the bits instead: ct::select_f32)")
