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
  from memory, or produced by a matrix/async unit; that is data, never public here;
- ``mbarrier:wait``: the result of ``mbarrier.try_wait``/``test_wait`` (whether a
  barrier phase has completed: timing, not data; the CUDA gate allows it only in
  wait loops, `cuda_rules`).

Registers are the ``%name`` ones and the bare names that inline assembly
declares in its own scope (``{ .reg .pred p; ... }``), all scopes merged (a name
reused by two asm blocks unions their labels: more labels, never fewer). A
barrier reduction (``bar.red.popc``) carries its operands' labels to its result.

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
# Registers: %r12, %rd3, %p1, named ones, and (after `unshadow`) scoped ones: %p1@4, p@7.
_REG_RE = re.compile(r"%[a-z]+[0-9]+(?:@\d+)?|%[A-Za-z_][\w$]*(?:@\d+)?|(?<![\w%$.])[A-Za-z_]\w*@\d+")
_GUARD = r"@!?%?[A-Za-z_][\w$]*(?:@\d+)?\s+"  # "@%p1 ", "@!p ", "@p@3 "
_LOCAL_REG_DECL = re.compile(r"^\s*\.reg\s+\.\w+\s+([^;]+);")


def _local_names(ptx: str) -> set[str]:
    """Bare register names declared by inline assembly (``.reg .pred p;``), not ``%r<12>`` ranges."""
    names = set()
    for ln in ptx.splitlines():
        m = _LOCAL_REG_DECL.match(ln)
        if m:
            for n in m.group(1).split(","):
                n = n.strip()
                if re.fullmatch(r"[A-Za-z_]\w*", n):
                    names.add(n)
    return names

_INSTR_RE = re.compile(r"^\s*(" + _GUARD + r")?([a-z][\w.:]*)\s*(.*?);?\s*$")


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
    m = re.match(r"^@(!?)(%?[A-Za-z_][\w$]*(?:@\d+)?)\s", instr.strip())
    return (m.group(2), m.group(1) == "!") if m else (None, False)


def opcode(instr: str) -> str:
    s = re.sub("^" + _GUARD, "", instr.strip())
    return s.split()[0] if s else ""


def unshadow(ptx: str) -> str:
    """The PTX with every register declared inside a nested ``{ }`` scope renamed ``name@N``.

    nvcc expands inline assembly and some intrinsics (``__syncthreads_count``) in
    their own scope, redeclaring names such as ``%p1`` that the function also
    uses: without the renaming, a flow-insensitive taint would merge the two.
    One output line per input line (line numbers are what ptxas line info cites).
    """
    out, scopes, n = [], [{}], 0
    tok = re.compile(r"(?<![\w$.])(%?[A-Za-z_][\w$]*)")
    for ln in ptx.splitlines():
        code = ln.split("//")[0]
        m = _LOCAL_REG_DECL.match(code)
        if m and len(scopes) > 2:  # depth 1 is the function body (its %r<N> ranges); deeper: asm scopes
            for name in (x.strip() for x in m.group(1).split(",")):
                if re.fullmatch(r"%?[A-Za-z_][\w$]*", name):
                    n += 1
                    scopes[-1][name] = f"{name}@{n}"
        elif scopes and any(scopes[1:]):
            def rename(mm, _scopes=scopes):
                for sc in reversed(_scopes):
                    if mm.group(1) in sc:
                        return sc[mm.group(1)]
                return mm.group(1)
            ln = tok.sub(rename, ln)
        for ch in code:
            if ch == "{":
                scopes.append({})
            elif ch == "}" and len(scopes) > 1:
                scopes.pop()
        out.append(ln)
    return "\n".join(out)


class Taint:
    """Register -> labels for one PTX function (the kernel entry)."""

    def __init__(self, ptx: str, param_names: list[str] | None = None):
        ptx = unshadow(ptx)
        self.lines = ptx.splitlines()  # the renamed text, by line (1-based: lines[k - 1])
        pos, ptrs = _params(ptx)
        self.param_name = {}
        for sym, k in pos.items():
            self.param_name[sym] = param_names[k] if param_names and k < len(param_names) else sym
        self.ptr_params = {self.param_name[s] for s in ptrs}
        edges: list[tuple[list[str], list[str], frozenset]] = []
        local = sorted(_local_names(ptx), key=len, reverse=True)
        reg_re = (re.compile(_REG_RE.pattern + "|" + "|".join(rf"(?<![\w%$.]){re.escape(n)}\b" for n in local))
                  if local else _REG_RE)
        self._reg_re = reg_re
        for s in instructions(ptx).values():
            g, _ = guard(s)
            op = opcode(s)
            rest = re.sub("^" + _GUARD, "", s).strip()[len(op):].strip().rstrip(";")
            parts = _split_operands(rest)
            if not parts:
                continue
            first = parts[0]
            reduction = op.startswith(("bar.red", "barrier.red"))  # a register result: the CTA's count/and/or
            if first.startswith("[") or (not reduction and op.split(".")[0] in (
                    "st", "red", "bar", "bra", "ret", "exit", "fence", "membar", "cp", "prefetch", "barrier",
                    "trap")):
                continue  # no register result
            dsts = reg_re.findall(first)
            srcs = [r for p in parts[1:] for r in reg_re.findall(p)]
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
            elif op.startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
                base.add("mbarrier:wait")
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

    def guard_register(self, instr: str) -> str | None:
        """The guard predicate of ``@p ...`` / ``@!%p1 ...`` (bare asm-local names too); None if unguarded."""
        return guard(instr)[0]


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
