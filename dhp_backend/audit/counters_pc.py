"""G1 per instruction, for the warp-specialised csrc kernels: every SASS instruction's execution count
identical across secret classes, except the instructions of wait loops.

Why: the csrc constant-time binaries (`prefill_v2_ct_kernel<...>`, and
`decode_v2_kernel<...>` with option kConstTime) have a TMA producer warp and consumer
warps that meet on mbarriers, and the prefill kernel's consumer
warpgroups that take their registers with ``setmaxnreg.inc``. ptxas builds each
wait as a retry loop (``SYNCS.PHASECHK`` or ``USETMAXREG.TRY_ALLOC``, the
predicate copy, the branch back). How often such a loop spins is how long the
awaited copy or warpgroup took: hardware timing, which G4 measures, not a function
of the data. The kernel-wide totals ``smsp__inst_executed`` and the branch count
include those spins, so they differ by tens to hundreds between any two runs,
even of the same class. Per instruction, ncu's SourceCounters section
(``Instructions Executed``: warp-level executions of each SASS instruction)
separates them: every instruction outside the wait loops must execute exactly
as often in both classes, and only the wait loops' own instructions may differ.

Which instructions are wait loops is read from the SASS text ncu prints
(`wait_instructions`): a SYNCS.PHASECHK or USETMAXREG, a PLOP3 that copies its
predicate, a branch on that predicate, and the unconditional branch right after a
retry branch (the jump back out of the out-of-line retry block); with the branch
targets, every loop that holds a wait and nothing else but such instructions
and the wait's operands recomputed in the loop (`_phase_chain`: moves into them, or
an integer op of one register the loop does not write and constants, such as the
parity's ``LOP3 R113, R211, 0x1`` and ``SHF.L R24, R113, 0x1f`` that ptxas put inside
the head-256 CT prefill's retry loop). Nothing else is excluded; the
G2 gate for CUDA (`cuda_gate`, rule ``wait``) checks the same loops at compile
time.
"""

from __future__ import annotations

import csv
import io
import re

# The kernels profiled per instruction: the warp-specialised csrc kernels (their
# constant-time binaries: prefill_sm90.cu CT, decode_sm90.cu kConstTime).
WARP_SPECIALISED = ("prefill_v2_ct_kernel", "prefill_v2_kernel", "decode_v2_kernel")
PER_INSTRUCTION_FILTER = "regex:" + "|".join(WARP_SPECIALISED)  # ncu --kernel-name syntax


def is_warp_specialised(kernel_name: str) -> bool:
    return any(k in kernel_name for k in WARP_SPECIALISED)
EXECUTED = "Instructions Executed"
_WAIT_OPS = ("SYNCS.PHASECHK", "USETMAXREG")


def source_command(ncu: str, report: str, launches: int, child: list[str]) -> list[str]:
    """Profile the last launch's kernels of the filter with the SourceCounters section into ``report``."""
    return [ncu, "--clock-control", "none", "--kernel-name", PER_INSTRUCTION_FILTER, "--launch-skip",
            str(launches - 1), "--launch-count", "1", "--section", "SourceCounters", "-o", report, "-f", *child]


def import_command(ncu: str, report: str) -> list[str]:
    return [ncu, "--import", report if report.endswith(".ncu-rep") else report + ".ncu-rep", "--page", "source",
            "--csv", "--print-source", "sass"]


def parse_source_csv(text: str) -> list[dict]:
    """``[{"kernel": name, "instrs": [{"sass": text, "executed": int}, ...]}, ...]`` from
    ``ncu --import R --page source --csv --print-source sass`` (one table per kernel, each
    after a ``"Kernel Name","..."`` line)."""
    out: list[dict] = []
    header: list[str] | None = None
    for row in csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append({"kernel": row[1] if len(row) > 1 else "", "instrs": []})
            header = None
        elif row[0] == "Address":
            header = row
        elif header and out and len(row) >= len(header) - 1:
            col = {h: i for i, h in enumerate(header)}
            if "Source" not in col or EXECUTED not in col:
                raise ValueError(f"ncu source page: no Source / {EXECUTED!r} column in {header[:8]}")
            v = row[col[EXECUTED]].replace(",", "").strip()
            out[-1]["instrs"].append({"sass": row[col["Source"]].strip(), "executed": int(float(v)) if v else 0,
                                      "address": int(row[col["Address"]], 16) if "Address" in col else None})
    for k in out:  # branch targets print as absolute addresses: make them offsets in the kernel
        base = k["instrs"][0]["address"] if k["instrs"] else None
        if base is not None:
            for x in k["instrs"]:
                x["sass"] = _ADDR.sub(lambda m, b=base: f".+0x{int(m.group(0), 16) - b:x}"
                                      if int(m.group(0), 16) >= b else m.group(0), x["sass"])
    return out


_ADDR = re.compile(r"0x[0-9a-fA-F]{9,16}\b")  # a code address, not an immediate or a constant-bank offset


def _parts(sass: str) -> tuple[str | None, str, list[str]]:
    """(guard predicate without '!', opcode, operands) of one SASS instruction text."""
    t = sass.strip().rstrip(";")
    guard = None
    m = re.match(r"^@(!?)(U?P[0-9T])\s+(.*)$", t)
    if m:
        guard, t = m.group(2), m.group(3)
    op, _, rest = t.partition(" ")
    return guard, op, [o.strip() for o in rest.split(",")] if rest.strip() else []


# What a loop may hold and still be only a wait: the wait itself, predicate copies, branches,
# and the scheduling hints ptxas puts in spin loops.
_WAIT_BODY_OPS = _WAIT_OPS + ("PLOP3", "UPLOP3", "BRA", "YIELD", "WARPSYNC", "NOP", "NANOSLEEP")
_TARGET = re.compile(r"\.\+0x([0-9a-f]+)")


def wait_instructions(sass: list[str], offsets: list[int] | None = None) -> set[int]:
    """Indices of the instructions that belong to wait loops (module doc). With the
    instructions' ``offsets`` in the kernel (targets printed as ``.+0x..``), every loop
    whose body holds a wait and nothing but `_WAIT_BODY_OPS` counts whole (ptxas puts a
    WARPSYNC before setmaxnreg's retry and YIELDs in mbarrier retry blocks)."""
    waits = _wait_chain(sass)
    if offsets is not None:
        at = {o: i for i, o in enumerate(offsets)}
        for i, text in enumerate(sass):
            _, op, ops = _parts(text)
            m = _TARGET.search(text) if op.startswith("BRA") else None
            j = at.get(int(m.group(1), 16)) if m else None
            if j is None or j > i:
                continue
            body = range(j, i + 1)
            ops_in = [_parts(sass[k])[1] for k in body]
            if not any(o.startswith(_WAIT_OPS) for o in ops_in):
                continue
            chain = _phase_chain([sass[k] for k in body])
            if all(o.startswith(_WAIT_BODY_OPS) or (k - j) in chain for o, k in zip(ops_in, body)):
                waits.update(body)
    return waits


_REGISTER = re.compile(r"\bU?R[0-9]+\b")


def _wait_operand_registers(body: list[str]) -> set[str]:
    """The registers the waits of a loop body read (the mbarrier address and the phase)."""
    regs: set[str] = set()
    for text in body:
        _, op, ops = _parts(text)
        if op.startswith(_WAIT_OPS):
            for o in ops[1:]:
                regs.update(_REGISTER.findall(o))
    return regs


# Integer ops ptxas uses to recompute a wait's phase operand inside its retry loop (`_phase_chain`).
_PHASE_OPS = ("LOP3", "SHF")


def _phase_chain(body: list[str]) -> set[int]:
    """Indices (in ``body``, one loop) of the instructions that only recompute the loop's waits' operands:
    moves into an operand register (`_is_move_into`), and, feeding those operands back to front, an
    unguarded LOP3 / SHF with one register source besides RZ whose destination the chain needs and
    which does not read its own destination. Run once per retry, they depend only on registers the
    loop does not change, as the wait's own operands."""
    needed = _wait_operand_registers(body)
    chain: set[int] = set()
    changed = True
    while changed:
        changed = False
        for k, text in enumerate(body):
            if k in chain:
                continue
            if _is_move_into(text, needed):
                chain.add(k)
                changed = True
                continue
            guard, op, ops = _parts(text)
            if guard is not None or not op.startswith(_PHASE_OPS) or not ops or ops[0] not in needed:
                continue
            sources = {r for o in ops[1:] for r in _REGISTER.findall(o)} - {"RZ", "URZ"}
            if len(sources) == 1 and ops[0] not in sources:
                chain.add(k)
                needed |= sources
                changed = True
    written = [_parts(body[k])[2][0] for k in chain]
    if len(written) != len(set(written)):  # a register written twice in the loop: not a plain recomputation
        return set()
    return chain


def _is_move_into(text: str, registers: set[str]) -> bool:
    """A pure register move (MOV, or IMAD of RZ * RZ + x) whose destination a wait of the same loop
    reads: ptxas reloads the phase into the wait's operand inside some retry loops (prefill CT,
    ``IMAD.U32 R24, RZ, RZ, UR18`` before ``SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR8+...], R24``), so it
    runs once per retry, as the wait does."""
    guard, op, ops = _parts(text)
    if guard is not None or not ops or ops[0] not in registers:
        return False
    return op.startswith("MOV") or (op.startswith("IMAD") and len(ops) == 4 and ops[1] == ops[2] == "RZ")


def _wait_chain(sass: list[str]) -> set[int]:
    """The wait instructions, the PLOP3 copies and branches on their predicates, and the
    unconditional jump right after such a branch."""
    waits: set[int] = set()
    live: set[str] = set()  # predicates that hold a wait's "not yet"
    prev_retry = False
    for i, text in enumerate(sass):
        guard, op, ops = _parts(text)
        dest = ops[0].lstrip("!") if ops else ""
        if op.startswith(_WAIT_OPS):
            waits.add(i)
            live.add(dest)
            prev_retry = False
            continue
        if op.startswith(("PLOP3", "UPLOP3")) and any(o.lstrip("!") in live for o in ops[1:]):
            waits.add(i)
            live.add(dest)
            prev_retry = False
            continue
        if op.startswith("BRA"):
            if guard and guard in live:
                waits.add(i)
                prev_retry = True
                continue
            if guard is None and prev_retry:
                waits.add(i)  # the jump back out of an out-of-line retry block
        elif dest in live:
            live.discard(dest)  # overwritten by something else
        prev_retry = False
    return waits


def compare(a: dict, b: dict) -> dict:
    """Per-instruction comparison of one kernel's two profiles (`parse_source_csv` entries)."""
    sa, sb = [x["sass"] for x in a["instrs"]], [x["sass"] for x in b["instrs"]]
    if sa != sb:
        return {"ok": False, "why": f"different binaries ({len(sa)} vs {len(sb)} instructions)"}
    base = a["instrs"][0].get("address") if a["instrs"] else None
    offsets = [x["address"] - base for x in a["instrs"]] if base is not None else None
    waits = wait_instructions(sa, offsets)
    outside, wait_diff = [], 0
    for i, (x, y) in enumerate(zip(a["instrs"], b["instrs"])):
        d = y["executed"] - x["executed"]
        if i in waits:
            wait_diff += d
        elif d:
            outside.append({"index": i, "sass": x["sass"], "a": x["executed"], "b": y["executed"]})
    return {"ok": not outside, "instructions": len(sa), "wait_instructions": len(waits),
            "wait_executions_diff": wait_diff,
            "executed_outside_waits": tuple(sum(x["executed"] for i, x in enumerate(p["instrs"]) if i not in waits)
                                            for p in (a, b)),
            "differences": outside[:20], "n_differences": len(outside),
            "why": "" if not outside else f"{len(outside)} instruction(s) outside wait loops execute a different "
                                          f"number of times, first #{outside[0]['index']} {outside[0]['sass']}: "
                                          f"{outside[0]['a']} vs {outside[0]['b']}"}
