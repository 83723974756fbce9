"""The rule table of the CUDA SASS gate (`cuda_gate`): why each branch of a csrc kernel may exist.

The Triton gate (`rules`) checks a branch's condition on Triton's TTIR. A csrc
kernel has no TTIR; its checkable facts are the PTX that ptxas compiled (kept in
the cubin's ``.nv_debug_ptx_txt`` section, which ``nvdisasm -gp`` cites line by
line) and the SASS itself. So a rule here names a CUDA source line (the
innermost location ``nvdisasm -gi`` gives the branch) and the label classes its
PTX condition may carry (`ptx.Taint`):

- ``tid`` / ``pid``: thread and CTA index;
- ``param``: a kernel parameter. Every field of the csrc kernels' ``Params`` is
  public under the constant-time policies: shapes, counts, the bucket, pointers
  (what they point *to* is another matter: a load through them is ``mem``);
- ``mbarrier``: whether an mbarrier phase has completed (``mbarrier.try_wait``):
  only in the wait loop, whose trip count is the hardware's timing, not data.

Anything else (``mem:*``: a value loaded from memory, a matrix result, another
lane's data) makes the branch fail, whatever the rule says.

Which binaries are gated: the constant-time walk of ``prefill_sm90.cu`` (template
flag CT) with one public bucket (LMODE 0: policies strict, batch, request with one
bucket) gates; LMODE 1 (per-request buckets, policy request) is reported with its
documented extra label (the bucket of the tile's request: docs/kernels.md section
5, as the Triton kernels' ``l_mode=1`` scenario). The other csrc binaries run
policy ``off`` only, which is not constant-time by contract (design.md section
2): they are listed, not gated.
"""

from __future__ import annotations

import dataclasses
import os
import re

PUBLIC = frozenset({"tid", "pid", "param"})


@dataclasses.dataclass(frozen=True)
class CudaRule:
    name: str
    file: str  # basename of the source file holding the line
    pattern: str  # regex on the stripped source line
    allowed: frozenset  # label classes the PTX condition may carry
    reason: str


@dataclasses.dataclass(frozen=True)
class Instance:
    """One template instance of a csrc kernel, from its mangled name."""

    kernel: str  # prefill_kernel, decode_kernel...
    args: tuple  # template arguments in order (bools as 0/1)
    gating: bool
    documented: frozenset  # extra label classes a non-gating instance is documented to add
    note: str


_PREFILL_ARGS = ("BF16", "OVERLAP", "PINGPONG", "STAGES", "DIAG", "COMPAT", "S_N128", "CT", "LMODE", "WIDE_REGS")

RULES = (
    CudaRule("locate-loop", "prefill_sm90.cu", r"^for \(int base = 1; base <= p\.num_seqs; base \+= kThreads\) \{$",
             PUBLIC, "locate_ct counts over all requests in chunks of kThreads: ceil(num_seqs / 384) trips, "
                     "num_seqs is the step's public number of requests"),
    CudaRule("role", "prefill_sm90.cu", r"^(\} else )?if \(threadIdx\.x (==|<|>=) [^)]*\) \{$", PUBLIC,
             "warp-specialised roles by thread index: producer thread, V cleaners, consumers"),
    CudaRule("step-loop", "prefill_sm90.cu", r"^for \(int t = 0; t < w\.n_steps; \+\+t\) \{$", PUBLIC,
             "ceil(L / 128) KV steps of the public bucket L (l_scalar), for the producer, the V cleaners "
             "and the consumers alike"),
    CudaRule("ring-reuse", "prefill_sm90.cu", r"^if \(t >= STAGES\) mbar_wait\(", PUBLIC,
             "the producer waits for a stage's release from the second round of the ring on: step index only"),
    CudaRule("pages-per-step", "prefill_sm90.cu", r"^if \(pg < pages_per_step\) \{", PUBLIC,
             "pages per 64-position step follow the block size (a kernel parameter)"),
    CudaRule("clean-loop", "prefill_sm90.cu",
             r"^for \(int it = 0; it < kTileBytes / 16 / kCleanThreads; \+\+it\) \{$", PUBLIC,
             "a constant trip count: every V row of the stage is cleaned or rewritten"),
    CudaRule("run-init", "prefill_sm90.cu", r"^for \(int i = 0; i < 16; \+\+i\) run_smem\[", PUBLIC,
             "a constant trip count (16 float4 of running state per thread)"),
    CudaRule("fold", "prefill_sm90.cu",
             r"^if \(\(t \+ 1\) % \(kSplitKV / kCols\) == 0 \|\| t \+ 1 == w\.n_steps\) \{", PUBLIC,
             "the fold at the end of each 512-position split: step index and the bucket's step count"),
    CudaRule("mbarrier-wait", "sm90_primitives.cuh", r"^\} while \(!done\);$", PUBLIC | {"mbarrier"},
             "mbar_wait's retry loop: it spins until a barrier phase completes. The phase completes on a fixed "
             "number of arrivals and TMA bytes (the same for every secret class); the number of spins is the "
             "hardware's timing, which G4 measures, not a function of data"),
)

# Instances: CT binaries gate (LMODE 0) or are reported (LMODE 1); the rest run policy off.
_MANGLED_ARGS = re.compile(r"(Lb[01]E|Li-?\d+E)")


def instance(mangled: str) -> Instance | None:
    """The csrc kernel instance a cubin function is, or None for a function this table does not know."""
    for kernel in ("prefill_kernel", "decode_kernel"):
        k = mangled.find(kernel)
        if k >= 0:
            break
    else:
        return None
    tail = mangled[k + len(kernel):]
    args = tuple(int(m[2:-1]) for m in _MANGLED_ARGS.findall(tail.split("EEv", 1)[0] + "E"))
    if kernel == "prefill_kernel" and len(args) != len(_PREFILL_ARGS):  # fail closed: a new template
        return Instance(kernel, args, True, frozenset(),  # flag the table does not name yet gates
                        f"{len(args)} template arguments, the table names {len(_PREFILL_ARGS)}: gated until it does")
    if kernel == "prefill_kernel":
        named = dict(zip(_PREFILL_ARGS, args))
        if named["CT"]:
            if named["LMODE"] == 0:
                return Instance(kernel, args, True, frozenset(),
                                "constant-time walk, one public bucket (strict, batch, request with one bucket)")
            return Instance(kernel, args, False, frozenset({"mem"}),
                            "constant-time walk, per-request buckets (policy request): each tile's step count is "
                            "its request's bucket, loaded by the tile's request index (docs/kernels.md section 5)")
    return Instance(kernel, args, False, frozenset(),
                    "policy off only: true lengths, not constant-time by contract (design.md section 2)")


def label_class(label: str) -> str:
    """``param:...`` -> ``param``, ``mem:?`` -> ``mem``, ``mbarrier:wait`` -> ``mbarrier``."""
    return label.split(":", 1)[0]


def match(file: str | None, text: str) -> CudaRule | None:
    """The rule for a source line (by file basename and the line's stripped text), or None."""
    base = os.path.basename(file or "")
    for r in RULES:
        if r.file == base and re.match(r.pattern, text):
            return r
    return None
