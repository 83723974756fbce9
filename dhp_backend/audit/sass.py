"""Disassemble a cubin with source and PTX line info, and parse its instructions.

`nvdisasm` (shipped in Triton's wheel, under ``triton/backends/nvidia/bin``) runs
twice on the same cubin: ``-gi`` annotates every instruction with its Python
source line and the chain of inlined call sites (from ptxas ``-lineinfo``), and
``-gp`` with the PTX line it came from. Joined by instruction offset, each
instruction then names kernel, index, text, Python line and PTX line, which is
what a finding must name. Parsing is pure text, so it is unit-tested on a
recorded snippet without running any tool.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

# Every instruction that can change the path of a warp or end it. BSSY/BSYNC and
# WARPSYNC are listed too: they are the compiler's reconvergence markers around
# divergent regions, so they show where divergence may happen.
CONTROL_OPCODES = frozenset({
    "BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BREAK", "BSSY", "BSYNC", "WARPSYNC",
    "BPT", "KILL", "YIELD", "BMOV", "NANOSLEEP",
})
# Of those, the ones that only mark or wait, never choose a path by themselves.
_NON_BRANCHING = frozenset({"BSSY", "BSYNC", "WARPSYNC", "YIELD", "BMOV", "NANOSLEEP"})


@dataclasses.dataclass(frozen=True)
class SrcLoc:
    file: str
    line: int
    chain: tuple[tuple[str, int], ...] = ()  # call sites it was inlined at, innermost first

    def short(self) -> str:
        s = f"{os.path.basename(self.file)}:{self.line}"
        for f, ln in self.chain:
            s += f" <- {os.path.basename(f)}:{ln}"
        return s


@dataclasses.dataclass(frozen=True)
class Instr:
    index: int  # position in the function's instruction list (0-based)
    offset: int  # byte offset in the function
    predicate: str | None  # "P0", "!P2", "UP1"... None when unpredicated (or @PT)
    opcode: str  # "BRA", "ISETP.GE.AND"...
    text: str  # the instruction as printed, without the offset comment
    src: SrcLoc | None = None
    ptx_line: int | None = None

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def is_control(self) -> bool:
        return self.base in CONTROL_OPCODES

    @property
    def is_branching(self) -> bool:
        return self.is_control and self.base not in _NON_BRANCHING

    @property
    def target(self) -> str | None:
        m = re.search(r"`\(([^)]+)\)", self.text)
        return m.group(1) if m else None


_FUNC_RE = re.compile(r"^\s*\.text\.(\S+):\s*$")
_INSTR_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*(?:/\*.*\*/)?\s*$")
_LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)(.*)$')
_INLINED_RE = re.compile(r'inlined at "([^"]+)", line (\d+)')
_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+):\s*$")


def _parse_loc(m: re.Match) -> tuple[str, int, tuple[tuple[str, int], ...]]:
    chain = tuple((f, int(ln)) for f, ln in _INLINED_RE.findall(m.group(3)))
    return m.group(1), int(m.group(2)), chain


def parse_nvdisasm(text: str) -> dict[str, dict]:
    """{function: {"instrs": [Instr...], "labels": {label: offset}, "locs": {offset: (file, line, chain)}}}.

    Works on ``-gi`` and ``-gp`` output alike (and on output without line info).
    nvdisasm prints a location only when it changes; each instruction takes the
    last one printed. Of several ``//##`` lines printed together (an inlined
    location, then its outer site) the first, which carries the chain, wins.
    """
    funcs: dict[str, dict] = {}
    cur = None
    loc = None
    fresh = False  # a //## line was seen since the last instruction
    for raw in text.splitlines():
        m = _FUNC_RE.match(raw)
        if m:
            cur = funcs.setdefault(m.group(1), {"instrs": [], "labels": {}, "locs": {}})
            loc, fresh = None, False
            continue
        if cur is None:
            continue
        m = _LINE_RE.search(raw)
        if m:
            if not fresh:
                loc = _parse_loc(m)
                fresh = True
            continue
        m = _LABEL_RE.match(raw)
        if m:
            cur["labels"][m.group(1)] = None  # resolved to the next instruction's offset
            cur.setdefault("_pending", []).append(m.group(1))
            continue
        m = _INSTR_RE.match(raw)
        if not m:
            continue
        fresh = False
        off = int(m.group(1), 16)
        body = m.group(2).strip()
        pred = None
        pm = re.match(r"^@(!?U?P[0-9T]+)\s+(.*)$", body)
        if pm:
            pred, body = pm.group(1), pm.group(2)
            if pred == "PT":
                pred = None
        opcode = body.split()[0] if body else ""
        for lab in cur.pop("_pending", []):
            cur["labels"][lab] = off
        cur["locs"][off] = loc
        text_ = (f"@{pred} " if pred else "") + body
        cur["instrs"].append(Instr(index=len(cur["instrs"]), offset=off, predicate=pred, opcode=opcode,
                                   text=text_))
    for f in funcs.values():
        f.pop("_pending", None)
    return funcs


def join_line_info(gi: dict[str, dict], gp: dict[str, dict] | None) -> dict[str, dict]:
    """Attach the Python location (from ``-gi``) and the PTX line (from ``-gp``) to each instruction."""
    out = {}
    for name, f in gi.items():
        ptx_locs = (gp or {}).get(name, {}).get("locs", {})
        instrs = []
        for ins in f["instrs"]:
            loc = f["locs"].get(ins.offset)
            src = SrcLoc(loc[0], loc[1], loc[2]) if loc else None
            p = ptx_locs.get(ins.offset)
            ptx_line = p[1] if p and p[0].startswith(".nv_debug_ptx") else None
            instrs.append(dataclasses.replace(ins, src=src, ptx_line=ptx_line))
        out[name] = {"instrs": instrs, "labels": f["labels"]}
    return out


def unpredicated_rule(ins: Instr, labels: dict, last_exit: int) -> tuple[str | None, str]:
    """(generic rule, "") for an unpredicated, direct control instruction, or (None, why not).

    Shared by the Triton and the CUDA gates: reconvergence markers, EXIT, the trap
    loop after the last EXIT (``last_exit``: its index, -1 if none) and plain jumps
    choose no path on data."""
    if not ins.is_branching:
        return "reconvergence", ""
    if ins.base == "EXIT":
        return "exit", ""
    if ins.index > last_exit >= 0 and labels.get(ins.target) == ins.offset:
        return "trap-loop", ""
    if ins.base in ("BRA", "JMP"):
        return "jump", ""
    return None, f"unpredicated {ins.base} with no generic rule"


# --- running the tools ------------------------------------------------------------------------


def tool_path(name: str) -> str:
    """Triton's bundled CUDA tool (``nvdisasm``, ``cuobjdump``): the same one CI and the GPU machine use."""
    try:
        from triton import knobs

        p = getattr(knobs.nvidia, name).path
        if p and os.path.exists(p):
            return p
    except Exception:  # noqa: BLE001 - older Triton without knobs: fall back to the wheel layout
        pass
    import triton

    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(p):
        return p
    import shutil

    found = shutil.which(name)  # a CUDA toolkit on PATH (the GPU machine has one)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found in the Triton wheel ({p}) nor on PATH")


def disassemble(cubin: bytes) -> dict[str, dict]:
    """{function: {"instrs", "labels"}} of a cubin, with Python and PTX line info when present."""
    nvdisasm = tool_path("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        outs = []
        for flag in ("-gi", "-gp"):
            r = subprocess.run([nvdisasm, "-c", flag, f.name], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvdisasm {flag} failed: {r.stderr.strip()[:500]}")
            outs.append(r.stdout)
    return join_line_info(parse_nvdisasm(outs[0]), parse_nvdisasm(outs[1]))
