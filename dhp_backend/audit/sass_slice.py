"""Backward slice of a SASS predicate inside its basic block: is it computed from public values only?

ptxas sometimes creates a predicated branch that has no predicated PTX
counterpart (it hoists a loop's zero-trip guard into the entry block, say) and
whose line info points at whatever source line the surrounding instructions
came from. The source rules cannot explain such a branch; this can, when it is
public: walking back from the branch inside its basic block, every definition
the predicate depends on must bottom out in kernel parameters (constant bank
``c[...]``), special registers (thread / program index), immediates or the zero
registers.

Conservative by construction: a load from memory, a vote or reduction across
lanes, an opcode whose destinations are not known here, or reaching the start of
the basic block with something still unresolved all answer "not proven", and the
gate then fails the branch as before. A lane shuffle (``SHFL``) is followed like
arithmetic: its value and lane operands must both resolve to public values, and
then what it returns is public too (another lane's copy of a value every lane
computes from public inputs, such as a warp's index broadcast from lane 0).
"""

from __future__ import annotations

import re

# Compare-like opcodes: their leading predicate operands are the destinations.
_PRED_WRITERS = ("ISETP", "UISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "UPLOP3", "FCHK")
# Opcodes whose destination is the first register operand (plus carry-out
# predicates that follow it, or a predicate that precedes it in LOP3's form).
_ALU = frozenset({
    "MOV", "UMOV", "IMAD", "UIMAD", "IADD3", "UIADD3", "VIADD", "LOP3", "ULOP3", "SHF", "USHF", "LEA", "ULEA",
    "SEL", "USEL", "SGXT", "USGXT", "IMNMX", "VIMNMX", "UIMNMX", "VIADDMNMX", "FLO", "UFLO", "POPC", "UPOPC", "BREV", "UBREV",
    "PRMT", "UPRMT", "IABS", "ISCADD", "R2UR", "I2F", "F2I", "IMUL", "UMUL", "BMSK", "UBMSK", "P2R", "R2P",
    "S2R", "S2UR", "CS2R", "LDC", "ULDC", "IDP", "FADD", "FMUL", "FFMA", "FMNMX", "FSEL",
    "SHFL",  # SHFL.IDX PT, R9, R2, RZ, 0x1f: lane-valid predicate and value written; value, lane, clamp read
})
# Definitions from memory, or from other lanes' predicates and sums: never public here. (SHFL is in _ALU's
# company below: its destinations lead, its value and lane operands are followed.)
_SECRET_SOURCES = frozenset({
    "LDG", "LDS", "LDL", "LD", "LDSM", "ATOM", "ATOMS", "ATOMG", "LDGDEPBAR", "TLD", "TEX", "SUATOM",
    "SULD", "REDUX", "VOTE", "VOTEU", "MATCH",
})
# Write no register or predicate (stores, barriers, fences, async copies into shared memory).
_NO_DEST = frozenset({
    "ST", "STG", "STS", "STL", "RED", "BAR", "MEMBAR", "DEPBAR", "NOP", "FENCE", "LDGSTS", "ERRBAR", "CCTL",
    "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "ARRIVES",
})
_PUBLIC_CONSTANT_REGS = frozenset({"RZ", "URZ", "PT", "UPT", "SRZ"})
_REG_RE = re.compile(r"\b(U?R\d+|U?P\d|UPT|PT|URZ|RZ)\b")
_PRED_RE = re.compile(r"^!?(U?P\d|UPT|PT)$")


def _operands(text: str) -> tuple[str, list[str]]:
    """(opcode, operands) of an instruction text, without its guard predicate."""
    t = re.sub(r"^@!?U?P(?:\d|T)\s+", "", text.strip())
    op, _, rest = t.partition(" ")
    ops = [o.strip().replace(".reuse", "") for o in rest.split(",")] if rest.strip() else []
    return op, ops


def _regs(operand: str) -> list[str]:
    """Registers an operand reads (inside brackets too); constant-bank and special registers read none."""
    if operand.startswith(("c[", "-c[", "|c[")) and "][" in operand and not re.search(r"\]\[\s*U?R\d", operand):
        return []
    if operand.startswith("SR_") or operand.startswith("SRZ"):
        return []
    return [r for r in _REG_RE.findall(operand) if r not in _PUBLIC_CONSTANT_REGS]


def _widen(reg: str, opcode: str) -> list[str]:
    """A destination register and the ones a 64/128-bit write also covers."""
    m = re.match(r"^(U?R)(\d+)$", reg)
    n = 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode or opcode.startswith("CS2R")) else 1
    if not m or n == 1:
        return [reg]
    return [f"{m.group(1)}{int(m.group(2)) + k}" for k in range(n)]


def destinations(opcode: str, ops: list[str]) -> tuple[list[str], int] | None:
    """(registers and predicates written, how many leading operands are destinations),
    or None if this module does not know the instruction's form."""
    base = opcode.split(".")[0]
    if base in _NO_DEST:
        return [], 0
    if base in _PRED_WRITERS:
        out = []
        for o in ops:
            if not _PRED_RE.match(o):
                break
            out.append(o.lstrip("!"))
        return out, len(out)
    if base in _ALU or base in _SECRET_SOURCES:
        out, i = [], 0
        while i < len(ops) and _PRED_RE.match(ops[i]):  # LOP3.LUT P0, R0, ...
            out.append(ops[i].lstrip("!"))
            i += 1
        if i < len(ops) and re.match(r"^U?R\d+$", ops[i]):
            out += _widen(ops[i], opcode)
            i += 1
            while i < len(ops) and _PRED_RE.match(ops[i]):  # IADD3 R4, P0, PT, ...
                out.append(ops[i].lstrip("!"))
                i += 1
        return out, i
    return None


def _is_control_flow_boundary(ins) -> bool:
    return ins.base in ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSYNC", "WARPSYNC")


def _slice_step(ins, need: set) -> tuple[set, bool] | str:
    """One instruction of a backward slice: the registers still to resolve above ``ins``
    (``need`` below it) and whether ``ins`` defined some of them; or, as a string, why the
    slice cannot go on (an unknown instruction that mentions one, a load, a vote or a reduction)."""
    opcode, ops = _operands(ins.text)
    known = destinations(opcode, ops)
    if known is None:
        mentioned = {r for o in ops for r in _REG_RE.findall(o)}
        if need & mentioned:
            return f"#{ins.index} {ins.text}: unknown destinations of {opcode.split('.')[0]}"
        return set(need), False
    dests, n_dest_operands = known
    written = need & set(dests)
    if not written:
        return set(need), False
    if opcode.split(".")[0] in _SECRET_SOURCES:
        return f"#{ins.index} {ins.text}: {sorted(written)} comes from memory or from other lanes' votes or sums"
    sources = {r for o in ops[n_dest_operands:] for r in _regs(o)}
    out = set(need)
    if ins.predicate:  # a guarded definition: the old value may survive, and the guard matters
        sources |= {ins.predicate.lstrip("!")} | written
    else:
        out -= written
    return out | (sources - _PUBLIC_CONSTANT_REGS), True


def public_predicate(instrs: list, labels: dict, branch) -> tuple[bool, str]:
    """Whether ``branch``'s guard predicate is computed from public values only (see module doc).

    ``instrs``: the function's instructions in order; ``labels``: label -> byte offset.
    Returns (proven, explanation).
    """
    if not branch.predicate:
        return False, "unpredicated"
    need = {branch.predicate.lstrip("!")} - _PUBLIC_CONSTANT_REGS
    block_starts = set(labels.values())
    trail = []
    i = branch.index
    while need:
        if instrs[i].offset in block_starts:
            return False, f"basic block starts at 0x{instrs[i].offset:04x} with {sorted(need)} unresolved"
        i -= 1
        if i < 0:
            return False, f"function entry reached with {sorted(need)} unresolved"
        ins = instrs[i]
        if _is_control_flow_boundary(ins):
            return False, f"control flow at #{ins.index} ({ins.text}) with {sorted(need)} unresolved"
        step = _slice_step(ins, need)
        if isinstance(step, str):
            return False, step
        need, defined = step
        if defined:
            trail.append(f"#{ins.index} {ins.text}")
    return True, "predicate from kernel parameters / thread and program indices only: " + " <- ".join(trail)


# Instructions whose predicate result says "not yet" to a wait (mbarrier try-wait, setmaxnreg.inc).
_WAIT_OPCODES = ("SYNCS.PHASECHK", "USETMAXREG")


def _falls_through(ins) -> bool:
    return not (ins.base in ("BRA", "JMP", "BRX", "JMX", "EXIT", "RET") and not ins.predicate)


def public_predicate_cfg(instrs: list, labels: dict, branch, max_states: int = 50000,
                         waits: set | None = None) -> tuple[bool, str]:
    """`public_predicate` across basic blocks: the backward slice follows every predecessor
    (fall-through and every branch to a label), around loops too, until each path has
    resolved the predicate into public values. Same verdicts per instruction; a path that
    reaches the function entry, a memory load or an unknown instruction with something
    unresolved answers "not proven". With ``waits`` (a set), a predicate written by a
    wait instruction (`wait_source`'s SYNCS.PHASECHK / USETMAXREG) counts as resolved
    (timing, not data) and its index is added to the set."""
    if not branch.predicate:
        return False, "unpredicated"
    at = {ins.offset: ins.index for ins in instrs}
    into: dict[int, list[int]] = {}
    for ins in instrs:
        if ins.base in ("BRA", "JMP") and ins.target in labels and labels[ins.target] in at:
            into.setdefault(at[labels[ins.target]], []).append(ins.index)
    starts = {at[o] for o in labels.values() if o in at}

    def preds(j: int) -> list[int]:
        out = list(into.get(j, ())) if j in starts else []
        if j > 0 and _falls_through(instrs[j - 1]):
            out.append(j - 1)
        return out

    need0 = frozenset({branch.predicate.lstrip("!")} - _PUBLIC_CONSTANT_REGS)
    work = [(p, need0) for p in preds(branch.index)]
    if not work:
        return False, "no predecessor"
    seen, defs = set(), set()
    while work:
        j, need = work.pop()
        if (j, need) in seen:
            continue
        seen.add((j, need))
        if len(seen) > max_states:
            return False, f"more than {max_states} slice states"
        ins = instrs[j]
        if ins.base in ("CALL", "RET"):
            return False, f"#{j} {ins.text}: a call on the path"
        nxt = set(need)
        opcode, ops = _operands(ins.text)
        if waits is not None and opcode.startswith(_WAIT_OPCODES) and ops and ops[0].lstrip("!") in need:
            waits.add(j)
            nxt.discard(ops[0].lstrip("!"))
        elif not ins.is_control:
            step = _slice_step(ins, nxt)
            if isinstance(step, str):
                return False, step
            nxt, defined = step
            if defined:
                defs.add(j)
        if not nxt:
            continue
        ps = preds(j)
        if not ps:
            return False, f"function entry (or unreachable code) at #{j} with {sorted(nxt)} unresolved"
        work += [(p, frozenset(nxt)) for p in ps]
    return True, ("predicate from kernel parameters / thread and program indices only, on every path "
                  f"({len(defs)} definitions: " + ", ".join(f"#{d}" for d in sorted(defs)[:12]) +
                  (" ..." if len(defs) > 12 else "") + ")")




def wait_source(instrs: list, labels: dict, branch) -> str | None:
    """The wait instruction a branch's predicate comes from (inside its basic block, through
    PLOP3 copies), or None. ptxas builds ``mbarrier.try_wait`` retry loops on
    SYNCS.PHASECHK and ``setmaxnreg.inc``'s on USETMAXREG.TRY_ALLOC."""
    if not branch.predicate:
        return None
    need = branch.predicate.lstrip("!")
    block_starts = set(labels.values())
    i = branch.index
    while i > 0 and instrs[i].offset not in block_starts:
        i -= 1
        ins = instrs[i]
        opcode, ops = _operands(ins.text)
        if ins.is_control:
            return None
        if opcode.startswith(_WAIT_OPCODES) and need in {o.lstrip("!") for o in ops[:1]}:
            return opcode
        if opcode.startswith(("PLOP3", "UPLOP3")) and ops and ops[0].lstrip("!") == need:
            srcs = [o.lstrip("!") for o in ops[2:5] if o.lstrip("!") not in _PUBLIC_CONSTANT_REGS]
            if len(srcs) != 1 or ins.predicate:
                return None
            need = srcs[0]
            continue
        known = destinations(opcode, ops)
        if known is None or need in known[0]:
            return None
    return None
