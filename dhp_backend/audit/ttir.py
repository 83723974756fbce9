"""Taint analysis of Triton's TTIR: what every loop bound and branch condition depends on.

Each SSA value gets a set of labels naming where it comes from:

- ``arg:NAME``  a kernel argument (scalars and pointer values);
- ``pid``       a program id (the grid position, public by construction);
- ``mem:NAME``  a value loaded through a pointer derived from argument NAME
  (a load's result also carries everything its address and mask carry, so a
  public table read at a secret index is secret-dependent).

Constants carry no label. Labels flow through every op (flow-insensitive, to a
fixpoint, so loop-carried values are covered); values leaving a loop or an
``scf.if`` also carry the labels of its bounds / condition (implicit flow).

Policies are runtime flags in the kernels (``l_mode``), and a select on a flag
keeps both sides' labels. A *scenario* assumes argument values
(``{"l_mode": 0}``) and folds integer constants through ``arith.cmpi`` and
``arith.select``, so the analysis sees the expression the kernel evaluates under
that policy. Every control op is then reported with its labels: `gate` checks
them against the rule tables. Text parsing of the printed TTIR (with locations),
no MLIR bindings, so it works on any Triton version's dump.
"""

from __future__ import annotations

import dataclasses
import re

_LOCDEF_RE = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_VAL_RE = re.compile(r"%[A-Za-z0-9_$.]+(?:#\d+)?")
_TRAIL_LOC_RE = re.compile(r"\s+loc\((#loc\d*|\".*?\"(?::\d+:\d+)?|unknown|callsite.*|fused.*)\)\s*$")


@dataclasses.dataclass(frozen=True)
class ControlOp:
    kind: str  # "scf.for" | "scf.if" | "scf.while" | "cf.cond_br"
    file: str | None
    line: int | None
    chain: tuple[tuple[str, int], ...]
    labels: frozenset[str]  # of the bounds / condition under the scenario
    text: str  # the op's first line, shortened


class _Loc:
    def __init__(self, defs: dict[str, str]):
        self.defs = defs
        self.memo: dict[str, tuple] = {}

    def resolve(self, ref: str) -> tuple[str | None, int | None, tuple]:
        """(file, line, chain of call sites) of ``#locN`` or of an inline ``loc(...)`` body."""
        if ref in self.memo:
            return self.memo[ref]
        body = self.defs.get(ref, ref) if ref.startswith("#loc") else ref
        self.memo[ref] = (None, None, ())  # guards cycles
        res = self._body(body)
        self.memo[ref] = res
        return res

    def _body(self, body: str):
        body = body.strip()
        m = re.match(r'^"([^"]*)":(\d+):\d+$', body)
        if m:
            return m.group(1), int(m.group(2)), ()
        m = re.match(r"^callsite\((\S+) at (\S+)\)$", body)
        if m:
            f, ln, ch = self.resolve(m.group(1))
            f2, ln2, ch2 = self.resolve(m.group(2))
            if f is None:
                return f2, ln2, ch2
            return f, ln, ch + ((f2, ln2),) + ch2
        m = re.match(r'^"[^"]*"\((#loc\d*)\)$', body)  # a named location: "name"(#locN)
        if m:
            return self.resolve(m.group(1))
        m = re.match(r"^fused\[(#loc\d*)", body)
        if m:
            return self.resolve(m.group(1))
        if body.startswith("#loc"):
            return self.resolve(body)
        return None, None, ()


@dataclasses.dataclass
class _Op:
    results: list[str]
    name: str
    operands: list[str]
    line: str
    loc: str | None
    parent: int | None  # index of the enclosing region op
    region_args: list[str] = dataclasses.field(default_factory=list)  # scf.for iv / iter args
    inits: list[str] = dataclasses.field(default_factory=list)
    bounds: list[str] = dataclasses.field(default_factory=list)
    yields: list[list[str]] = dataclasses.field(default_factory=list)
    block_args: list[str] = dataclasses.field(default_factory=list)  # ^bb args in its regions


def _split_results(lhs: str) -> list[str]:
    res = []
    for part in lhs.split(","):
        part = part.strip()
        m = re.match(r"^(%[A-Za-z0-9_$.]+)(?::(\d+))?$", part)
        if not m:
            continue
        if m.group(2):
            res += [f"{m.group(1)}#{k}" for k in range(int(m.group(2)))]
        else:
            res.append(m.group(1))
    return res


def _strip_trailing_loc(s: str) -> tuple[str, str | None]:
    m = _TRAIL_LOC_RE.search(s)
    if not m:
        return s, None
    return s[: m.start()], m.group(1)


def parse(ttir: str, kernel: str | None = None):
    """Ops of the kernel function (the first public ``tt.func`` or the one named ``kernel``)."""
    lines = ttir.splitlines()
    locdefs = {}
    for ln in lines:
        m = _LOCDEF_RE.match(ln.strip())
        if m:
            locdefs[m.group(1)] = m.group(2)
    args: list[str] = []
    ptr_args: set[str] = set()
    ops: list[_Op] = []
    stack: list[int | None] = []  # open regions: index of the op that opened it (None for func)
    in_func = False
    for raw in lines:
        s = raw.strip()
        if not in_func:
            m = re.match(r"^tt\.func\s+(?:public\s+)?@(\w+)\((.*)$", s)
            if m and (kernel is None or m.group(1) == kernel) and ("public" in s or kernel):
                in_func = True
                args = re.findall(r"(%[A-Za-z0-9_$.]+):", m.group(2))
                ptr_args = set(re.findall(r"%([A-Za-z0-9_$.]+): !tt\.ptr", m.group(2)))
                stack = [None]
            continue
        if not s:
            continue
        if s.startswith("}"):
            # "} loc(#l)" closes a region op; "} else {" switches region; "}) : ..." closes a generic op.
            closed = stack.pop() if stack else None
            _, loc = _strip_trailing_loc(s)
            if closed is not None and loc and ops[closed].loc is None:
                ops[closed].loc = loc
            if s.startswith("} else") or s.startswith("} do"):
                stack.append(closed)
            elif s.startswith("})"):
                # a generic op "tt.reduce"(...) ({ ... }) : ... loc(...)
                if closed is not None and loc:
                    ops[closed].loc = loc
            if not stack:
                break
            continue
        if s.startswith("^bb"):
            # region block arguments: they carry what the enclosing op's operands carry
            parent = stack[-1] if stack else None
            if parent is not None:
                ops[parent].block_args += _VAL_RE.findall(s.split(")")[0])
            continue
        body, loc = _strip_trailing_loc(s)
        if " = " in body.split("(")[0] or re.match(r"^%[^=]+ = ", body):
            lhs, rhs = body.split(" = ", 1)
            results = _split_results(lhs)
        else:
            results, rhs = [], body
        name_m = re.match(r'^"?([A-Za-z_][\w.]*)"?', rhs)
        name = name_m.group(1) if name_m else rhs.split()[0]
        operands = [v for v in _VAL_RE.findall(rhs)]
        op = _Op(results=results, name=name, operands=operands, line=s, loc=loc, parent=stack[-1] if stack else None)
        if name == "scf.for":
            m = re.match(r"^scf\.for (%\S+) = (%\S+) to (%\S+) step (%\S+)(.*)$", rhs)
            if m:
                op.bounds = [m.group(2), m.group(3), m.group(4)]
                op.region_args = [m.group(1)]
                im = re.search(r"iter_args\((.*?)\)\s*->", m.group(5)) or re.search(r"iter_args\((.*)\)", m.group(5))
                if im:
                    for pair in im.group(1).split(","):
                        if "=" in pair:
                            a, b = pair.split("=")
                            op.region_args.append(a.strip())
                            op.inits.append(b.strip())
        elif name == "scf.if":
            op.bounds = operands[:1]
        elif name == "cf.cond_br":
            op.bounds = operands[:1]
        elif name == "scf.while":
            op.bounds = []  # set from scf.condition below
        elif name == "scf.condition":
            if op.parent is not None:
                ops[op.parent].bounds += operands[:1]
        elif name == "scf.yield" and op.parent is not None:
            ops[op.parent].yields.append(operands)
        ops.append(op)
        if s.endswith("{"):
            stack.append(len(ops) - 1)
    return args, ptr_args, ops, _Loc(locdefs)


_CMP = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "slt": lambda a, b: a < b, "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b, "sge": lambda a, b: a >= b,
    "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b, "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b,
}


def analyse(ttir: str, assume: dict[str, int] | None = None, kernel: str | None = None) -> list[ControlOp]:
    """Every control op of the kernel with the labels of its bounds / condition."""
    args, ptr_args, ops, locs = parse(ttir, kernel)
    assume = assume or {}
    taint: dict[str, frozenset] = {}
    const: dict[str, int] = {}
    for a in args:
        taint[a] = frozenset({f"arg:{a[1:]}"})
        if a[1:] in assume:
            const[a] = int(assume[a[1:]])

    def t(v: str) -> frozenset:
        if v in taint:
            return taint[v]
        if "#" not in v and v + "#0" in taint:
            return taint[v + "#0"]
        return frozenset()

    def add(v: str, labels) -> bool:
        old = taint.get(v, frozenset())
        new = old | labels
        if new != old:
            taint[v] = new
            return True
        return False

    def union(vs) -> frozenset:
        out = frozenset()
        for v in vs:
            out |= t(v)
        return out

    for _ in range(50):  # fixpoint over loop-carried values; converges in a few passes
        changed = False
        for op in ops:
            n = op.name
            if n == "arith.constant":
                m = re.search(r"arith\.constant (-?\d+|true|false)\s*:\s*i\d+\s*$", _strip_trailing_loc(op.line)[0])
                if m and op.results:
                    const[op.results[0]] = {"true": 1, "false": 0}.get(m.group(1), None) if m.group(1) in (
                        "true", "false") else int(m.group(1))
                continue
            if n == "tt.get_program_id" or n == "tt.get_num_programs":
                for r in op.results:
                    changed |= add(r, frozenset({"pid"}))
                continue
            if n == "arith.cmpi" and len(op.operands) == 2 and all(v in const for v in op.operands):
                pm = re.search(r"arith\.cmpi (\w+),", op.line)
                if pm and pm.group(1) in _CMP and op.results:
                    const[op.results[0]] = int(_CMP[pm.group(1)](*(const[v] for v in op.operands)))
                    continue
            if n == "arith.select" and op.operands and op.operands[0] in const and len(op.operands) == 3:
                pick = op.operands[1] if const[op.operands[0]] else op.operands[2]
                for r in op.results:
                    changed |= add(r, t(pick))
                    if pick in const:
                        const[r] = const[pick]
                continue
            if n in ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast") and op.operands[0] in const:
                const[op.results[0]] = const[op.operands[0]]
                continue
            if n == "tt.load":
                ptr_labels = union(op.operands)
                mem = frozenset(f"mem:{lab[4:]}" for lab in ptr_labels
                                if lab.startswith("arg:") and lab[4:] in ptr_args)
                for r in op.results:
                    changed |= add(r, ptr_labels | mem | (frozenset() if mem else frozenset({"mem:?"})))
                continue
            if n == "scf.for":
                ctl = union(op.bounds)
                if op.region_args:
                    changed |= add(op.region_args[0], ctl)
                for k, ia in enumerate(op.region_args[1:]):
                    lab = ctl | t(op.inits[k]) | union(y[k] for y in op.yields if k < len(y))
                    changed |= add(ia, lab)
                    if k < len(op.results):
                        changed |= add(op.results[k], lab)
                for b in op.block_args:
                    changed |= add(b, ctl)
                continue
            if n in ("scf.if", "scf.while"):
                ctl = union(op.bounds) | (union(op.operands) if n == "scf.while" else frozenset())
                for k, r in enumerate(op.results):
                    changed |= add(r, ctl | union(y[k] for y in op.yields if k < len(y)))
                for b in op.block_args:
                    changed |= add(b, ctl | union(op.operands) | union(v for y in op.yields for v in y))
                continue
            # generic op: results carry every operand's labels; region block args
            # (reductions' combiners) carry the op's operands.
            lab = union(op.operands)
            for b in op.block_args:
                changed |= add(b, lab)
            for r in op.results:
                changed |= add(r, lab)
        if not changed:
            break

    out = []
    for op in ops:
        if op.name not in ("scf.for", "scf.if", "scf.while", "cf.cond_br"):
            continue
        f, ln, chain = locs.resolve(op.loc) if op.loc else (None, None, ())
        if op.name == "scf.if" and op.bounds and op.bounds[0] in const:
            continue  # folded by the scenario: not a runtime branch under it
        first = op.line.split("{")[0].strip()
        out.append(ControlOp(kind=op.name, file=f, line=ln, chain=chain, labels=union(op.bounds),
                             text=first[:160]))
    return out
