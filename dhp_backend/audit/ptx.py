"""PTX facts for the SASS gate: where a predicate comes from, and slow-path instructions.

ptxas turns some *predicated* PTX instructions (a store guarded by a thread-index
test, say) into SASS branches. Such a branch has no loop or ``if`` in the Python
source; what makes it public is its predicate's provenance. `predicate_labels`
answers that with a flow-insensitive taint over PTX registers (every write of a
register unions into it, so reuse across blocks can only add labels):

- ``tid``: ``%tid``/``%laneid``/``%warpid``/``%ntid`` (thread position, public);
- ``pid``: ``%ctaid``/``%nctaid``/``%clusterid`` (grid position, public);
- ``param:NAME``: a kernel parameter (``ld.param``);
- ``mem:NAME`` / ``mem:shared`` / ``mem:local`` / ``mem:?``: anything loaded
  from memory, or produced by a matrix/async unit; that is data, never public here.

`slow_paths` lists the instructions design.md G2 forbids: IEEE-rounded division,
square root and reciprocal (``div.rn``, ``sqrt.rn``, ``rcp.rn``, and the other
directed roundings), 64-bit integer division/remainder (a subroutine with data-
dependent branches), and any PTX ``call`` (libdevice routines such as ``expf``
with range-reduction branches).
"""

from __future__ import annotations

import re

_SPECIAL = [
    (re.compile(r"%(tid|laneid|warpid|ntid|nwarpid|lanemask_\w+)"), "tid"),
    (re.compile(r"%(ctaid|nctaid|clusterid|nclusterid|cluster_ctaid|cluster_nctaid|cluster_ctarank)"), "pid"),
]
_REG_RE = re.compile(r"%[a-z]+[0-9]+|%[A-Za-z_][\w$]*")
_INSTR_RE = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);?\s*$")


def _params(ptx: str) -> tuple[dict[str, int], set[str]]:
    """Param symbol -> position, and the pointer params (declared ``.ptr``)."""
    pos, ptrs = {}, set()
    for m in re.finditer(r"\.param\s+(\.\w+)\s+(\.ptr\s+)?(?:\.[\w:]+\s+)*(?:\.align\s+\d+\s+)?(\w+_param_(\d+))", ptx):
        pos[m.group(3)] = int(m.group(4))
        if m.group(2):
            ptrs.add(m.group(3))
    return pos, ptrs


def instructions(ptx: str) -> dict[int, str]:
    """{1-based line number: instruction text} (what ptxas line info refers to)."""
    out = {}
    for i, ln in enumerate(ptx.splitlines(), 1):
        s = ln.split("//")[0].strip()
        if s and not s.startswith((".", "$", "{", "}")) and _INSTR_RE.match(s):
            out[i] = s
    return out


def guard(instr: str) -> tuple[str | None, bool]:
    """(predicate register, negated) of ``@%p bra ...`` / ``@!%p st...``; (None, False) if unguarded."""
    m = re.match(r"^@(!?)(%\w+)\s", instr.strip())
    return (m.group(2), m.group(1) == "!") if m else (None, False)


def opcode(instr: str) -> str:
    s = re.sub(r"^@!?%\w+\s+", "", instr.strip())
    return s.split()[0] if s else ""


class Taint:
    """Register -> labels for one PTX function (the kernel entry)."""

    def __init__(self, ptx: str, param_names: list[str] | None = None):
        pos, ptrs = _params(ptx)
        self.param_name = {}
        for sym, k in pos.items():
            self.param_name[sym] = param_names[k] if param_names and k < len(param_names) else sym
        self.ptr_params = {self.param_name[s] for s in ptrs}
        edges: list[tuple[list[str], list[str], frozenset]] = []
        for s in instructions(ptx).values():
            g, _ = guard(s)
            op = opcode(s)
            rest = re.sub(r"^@!?%\w+\s+", "", s).strip()[len(op):].strip().rstrip(";")
            parts = _split_operands(rest)
            if not parts:
                continue
            first = parts[0]
            if first.startswith("[") or op.split(".")[0] in ("st", "red", "bar", "bra", "ret", "exit", "fence",
                                                             "membar", "cp", "prefetch", "barrier", "trap"):
                continue  # no register result
            dsts = _REG_RE.findall(first)
            srcs = [r for p in parts[1:] for r in _REG_RE.findall(p)]
            if g:
                srcs.append(g)
            base = set()
            for rx, lab in _SPECIAL:
                if any(rx.match(p.strip()) for p in parts[1:]):
                    base.add(lab)
            base_op = op.split(".")[0]
            if base_op == "ld" or base_op == "ldu" or base_op == "ldmatrix":
                if ".param" in op:
                    sym = re.search(r"\[(\w+)", rest)
                    base.add("param:" + self.param_name.get(sym.group(1), sym.group(1)) if sym else "param:?")
                elif ".shared" in op:
                    base.add("mem:shared")
                elif ".local" in op:
                    base.add("mem:local")
                else:
                    base.add("mem:*")  # resolved below from the address's params
            elif base_op in ("wgmma", "mma", "wmma", "atom", "tcgen05", "cp", "mbarrier"):
                base.add("mem:?")
            if "wgmma" in op or "mma" in op:
                srcs += dsts  # accumulators are read too
            edges.append((dsts, srcs, frozenset(base)))
        self.taint: dict[str, frozenset] = {}
        for _ in range(100):
            changed = False
            for dsts, srcs, base in edges:
                lab = set(base)
                for r in srcs:
                    lab |= self.taint.get(r, frozenset())
                if "mem:*" in lab:
                    lab.discard("mem:*")
                    ps = {x[6:] for x in lab if x.startswith("param:") and x[6:] in self.ptr_params}
                    lab |= {f"mem:{p}" for p in ps} or {"mem:?"}
                lab = frozenset(lab)
                for d in dsts:
                    old = self.taint.get(d, frozenset())
                    if not lab <= old:
                        self.taint[d] = old | lab
                        changed = True
            if not changed:
                break

    def labels(self, reg: str) -> frozenset:
        return self.taint.get(reg, frozenset())


def _split_operands(rest: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


# Slow paths: (regex on the PTX opcode, what it is, why it is forbidden)
SLOW_PATHS = [
    (r"^div\.(rn|rz|rm|rp)\.f(32|64)", "IEEE division",
     "compiles to a subroutine with a data-dependent slow path (FCHK + CALL) for subnormal/large operands"),
    (r"^sqrt\.(rn|rz|rm|rp)\.", "IEEE square root", "slow path for subnormal/special inputs"),
    (r"^rcp\.(rn|rz|rm|rp)\.", "IEEE reciprocal", "slow path for subnormal/special inputs"),
    (r"^rsqrt\.(rn|rz|rm|rp)\.", "IEEE reciprocal square root", "slow path for special inputs"),
    (r"^(div|rem)\.[su]64", "64-bit integer division", "a subroutine whose iteration count follows the operands"),
    (r"^(ex2|lg2|sin|cos)\.(?!approx)", "non-approximate transcendental", "range reduction with branches"),
    (r"^call", "call", "PTX call: a libdevice routine (expf range reduction...) or another subroutine"),
]


def slow_paths(ptx: str) -> list[dict]:
    out = []
    for line, s in instructions(ptx).items():
        op = opcode(s)
        for rx, what, why in SLOW_PATHS:
            if re.match(rx, op):
                out.append({"ptx_line": line, "instr": s[:120], "what": what, "why": why})
    return out
