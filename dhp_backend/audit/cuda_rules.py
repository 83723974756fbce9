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

Which binaries are gated: the constant-time walks with one public bucket (policies
strict, request with one bucket): ``prefill_sm90.cu``'s prefill_v2_ct_kernel with
LMODE 0, and ``decode_sm90.cu``'s decode_v2_kernel with option kConstTime and its
merge_kernel with WALK 1. Their per-request-bucket forms (prefill LMODE 1, decode
kBucketPerReq, merge WALK 2; policy request) are reported with their documented
extra label (the bucket of the tile's request: docs/kernels.md section 5, as the
Triton kernels' ``l_mode=1`` scenario). The other csrc binaries run policy ``off``
only, which is not constant-time by contract (design.md section 2): they are
listed, not gated.
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

    kernel: str  # prefill_v2_ct_kernel, decode_v2_kernel...
    args: tuple  # template arguments in order (bools as 0/1)
    gating: bool
    documented: frozenset  # extra label classes a non-gating instance is documented to add
    note: str


# The template arguments of each kernel the csrc libraries hold, in order.
_ARGS = {"prefill_v2_ct_kernel": ("BF16", "LMODE"), "prefill_v2_kernel": ("BF16",),
         "decode_v2_kernel": ("BF16", "STAGES", "WRITE_PARTIALS", "MIN_BLOCKS", "SMALL_Q", "OPT"),
         "merge_kernel": ("BF16", "WALK")}
DECODE_CONST_TIME, DECODE_BUCKET_PER_REQ = 128, 256  # decode_sm90.cu: kConstTime, kBucketPerReq

RULES = (
    CudaRule("locate-loop", "prefill_sm90.cu", r"^for \(int base = 1; base <= p\.num_seqs; base \+= kThreads\) \{$",
             PUBLIC, "locate_ct counts over all requests in chunks of kThreads: ceil(num_seqs / 384) trips, "
                     "num_seqs is the step's public number of requests"),
    CudaRule("role", "prefill_sm90.cu", r"^(\} else )?if \(threadIdx\.x (==|<|>=) [^)]*\) \{$", PUBLIC,
             "warp-specialised roles by thread index: producer thread, V cleaners, consumers"),
    CudaRule("turn-finish", "prefill_sm90.cu",
             r'^if constexpr \(PINGPONG\) asm volatile\("\{\\n\\t\.reg \.pred p;\\n\\tsetp\.eq\.s32 p, %1, 0;\\n\\t@p bar\.sync %0, 256;',
             PUBLIC, "Turns::finish: consumer warpgroup 0 (a thread index) takes the last hand-over of the turns "
                     "the two consumer warpgroups alternate on, once per tile"),
    CudaRule("step-loop", "prefill_sm90.cu", r"^for \(int t = 0; t < w\.n_steps; \+\+t\) \{$", PUBLIC,
             "ceil(L / 128) KV steps of the public bucket L (l_scalar), for the producer, the V cleaners "
             "and the consumers alike"),
    CudaRule("producer-issue", "prefill_sm90.cu", r"^if \(lane == 0\) load_stage\(.*\);$", PUBLIC,
             "the producer warp waits as one and its lane 0 issues the step's TMA loads (thread index); the "
             "pages are the request's reserved table entries up to the bucket, read by every lane"),
    CudaRule("ring-reuse", "prefill_sm90.cu", r"^if \(t >= STAGES\) mbar_wait\(", PUBLIC,
             "the producer waits for a stage's release from the second round of the ring on: step index only"),
    CudaRule("pages-per-step", "prefill_sm90.cu", r"^if \(pg < pages_per_step\) \{", PUBLIC,
             "pages per 64-position step follow the block size (a kernel parameter)"),
    CudaRule("clean-loop", "prefill_sm90.cu",
             r"^for \(int it = 0; it < kPieces; it \+= kCleanBatch\) \{$", PUBLIC,
             "a constant trip count: every 16-byte piece of the stage's V tile is loaded and stored back "
             "(masked by the length), at the tile's own addresses"),
    CudaRule("run-init", "prefill_sm90.cu", r"^for \(int i = 0; i < 16; \+\+i\) run_smem\[", PUBLIC,
             "a constant trip count (16 float4 of running state per thread)"),
    # decode_sm90.cu, the constant-time walk (kConstTime; walk 1 gates, walk 2 is reported).
    CudaRule("dec-locate-loop", "decode_sm90.cu",
             r"^for \(int base = 1; base <= p\.num_seqs; base \+= blockDim\.x\) \{$", PUBLIC,
             "work_ct counts over all requests in chunks of the CTA's threads: ceil(num_seqs / blockDim.x) trips"),
    CudaRule("dec-role", "decode_sm90.cu",
             r"^if \((threadIdx\.x (==|>=) \d+|warp < 2|lane == 0|ws == 0 && lane % 4 == 0)\)"
             r"( \{)?(\s+//.*)?$", PUBLIC,
             "warp-specialised roles by thread index: barrier init, producer warp and its issuing lane, the S and "
             "PV warp pairs, the lanes that write a row's values"),
    CudaRule("dec-split-loop", "decode_sm90.cu",
             r"^for \(int (sp|s) = w\.s_lo; (sp|s) < w\.s_end; (sp|s) \+= w\.s_stride\) \{$", PUBLIC,
             "the CTA's splits chunk, chunk + chunks, ... below min(ceil(L / 512), n_split_grid): the CTA index, "
             "the host's plan and the public bucket L"),
    CudaRule("dec-no-split", "decode_sm90.cu", r"^if \(w\.s_lo >= w\.s_end\) return;$", PUBLIC,
             "a chunk past the bucket's splits (CTA index, plan, bucket) issues no loads"),
    CudaRule("dec-ids-ahead", "decode_sm90.cu",
             r"^ids_next = s \+ w\.s_stride < w\.s_end \? split_ids\(s \+ w\.s_stride\) : 0;$", PUBLIC,
             "the next split's block ids are read while there is a next split of the bucket"),
    CudaRule("dec-step-loop", "decode_sm90.cu",
             r"^for \(int j = split_first\((sp|s)\); j < (je|split_end\(w, s\)); \+\+j, \+\+k\) \{$", PUBLIC,
             "a split's 64-position steps below ceil(L / 64): the bucket's step count"),
    CudaRule("dec-ring-reuse", "decode_sm90.cu", r"^if \(k >= (STAGES|2)\) mbar_wait\(", PUBLIC,
             "waits for a ring slot's release from its second round on: the running step index only"),
    CudaRule("dec-boxes", "decode_sm90.cu", r"^if \(b < boxes\) \{$", PUBLIC,
             "TMA boxes per 64-position step follow the block size (a kernel parameter)"),
    CudaRule("dec-split-end", "decode_sm90.cu", r"^if \((j \+ 1 == je|last_split\(w, sp\))\) \{", PUBLIC,
             "a split's last step and the CTA's last split: step and split indices of the bucket's walk"),
    CudaRule("dec-cta-end", "decode_sm90.cu",
             r"^if \((k \+ 1 == n_steps|n_steps == 0)\) store_out_rows\(", PUBLIC,
             "the CTA's output rows after its last step (or at once with no step): the bucket's step count"),
    CudaRule("dec-group-rows", "decode_sm90.cu", r"^if \(ok_(lo|hi)\) store_out_half<", PUBLIC,
             "only the tile rows that are query heads of the group are stored: thread index and GROUP"),
    CudaRule("dec-head-cols", "decode_sm90.cu", r"^if \(kModelHead == kHead \|\| col \+ 8 \* nt < kModelHead\)$", PUBLIC,
             "heads 80 and 96 (head-128 tiles): a thread's output columns at or past the head size are not "
             "stored; its columns follow from its warp and lane, the head size is a compile-time constant"),
    CudaRule("merge-head-cols", "decode_sm90.cu", r"^if \(kModelHead != kHead && d >= kModelHead\) return;", PUBLIC,
             "heads 80 and 96: the merge threads of columns at or past the head size (thread index against "
             "the compile-time head size) store nothing"),
    CudaRule("merge-chunks", "decode_sm90.cu",
             r"^(for \(int c0 = s_first; c0 < n_split; c0 \+= kMergeChunk\) \{|"
             r"for \(int k = d; k < n \* \(kHead / 4\); k \+= kHead\) \{|"
             r"for \(int base = 0; base < n; base \+= 32\) \{|for \(int j = 0; j < n; \+\+j\) \{|"
             r"if \(d < (n|32)\) \{|float v = base \+ d < n \? m_s\[base \+ d\] : -INFINITY;|"
             r"if \(d == 0\) mr_carry = mr_s\[n - 1\];)", PUBLIC,
             "the merge folds the bucket's splits, min(ceil(L / 512), n_split_grid), in chunks of 64 by the "
             "thread index: public counts (s_first is 0 in the constant-time binaries: a window moves only "
             "policy off's first split; thread 0 carries the running max)"),
    # prefill_sm90.cu, the v2 constant-time consumer and kernel (consume_v2_ct, prefill_v2_ct_kernel).
    CudaRule("v2p-role", "prefill_sm90.cu", r"^(\} else )?if \((threadIdx\.x (==|<|>=) [^)]*|lane == 0)\)( \{)?",
             PUBLIC, "warp-specialised roles by thread index: barrier init, producer warpgroup (Q rows, the TMA "
                     "thread, the V cleaners), consumers, the lane that releases a stage"),
    CudaRule("v2p-split-end", "prefill_sm90.cu",
             r"^if \(\(t \+ 1\) % kStepsPerSplit == 0 \|\| t \+ 1 == w\.n_steps\) \{", PUBLIC,
             "a split's end: the step index and the bucket's step count"),
    CudaRule("v2p-init", "prefill_sm90.cu", r"^for \(int i = 0; i < STAGES; \+\+i\) mbar_init\(", PUBLIC,
             "a constant trip count"),
    # decode_sm90.cu, the v2 consumer (consume_v2, decode_v2_kernel) on the constant-time walk.
    CudaRule("v2-role", "decode_sm90.cu",
             r"^(\} else )?if \((threadIdx\.x (==|>=) \d+|warp < 2|lane == 0|lane % 4 == 0|"
             r"ws == 0 && lane % 4 == 0( && last_split\(w, sp\))?)\)( \{)?(\s+//.*)?$", PUBLIC,
             "warp-specialised roles by thread index (barrier init, producer, S / PV pairs, the lanes that write "
             "a row's values); last_split: the split index of the bucket's walk"),
    CudaRule("v2-step-loop", "decode_sm90.cu",
             r"^for \(int j = split_first\(sp\); j < je; j \+= 2, k \+= 2\) \{$", PUBLIC,
             "a split's 128-position steps below the bucket's step count"),
    CudaRule("v2-ring-reuse", "decode_sm90.cu", r"^if \(u >= 2\) mbar_wait\(", PUBLIC,
             "the P ring's second round on: step index only"),
    CudaRule("v2-split-end", "decode_sm90.cu", r"^if \(j \+ 2 == je\) \{", PUBLIC,
             "a split's last step: step index of the bucket's walk"),
    CudaRule("v2-cta-end", "decode_sm90.cu", r"^if \((k \+ 2 == n_steps|n_steps == 0)\) store_out_rows\(", PUBLIC,
             "the CTA's output after its last step: the bucket's step count"),
    CudaRule("v2-inv", "decode_sm90.cu", r"^if \(!WRITE_PARTIALS && k \+ 2 == n_steps\) \{", PUBLIC,
             "the CTA's last step"),
    CudaRule("v2-rows", "decode_sm90.cu",
             r"^if \((ws != 0 \|\| lane % 4 != 0 \|\| !\(h == 0 \? ok_lo : ok_hi\)|"
             r"h == 0 \? !ok_lo : !ok_hi)\) continue;$", PUBLIC,
             "the tile rows that are query heads of the group, by the lanes that write them: thread index, GROUP"),
    CudaRule("mbarrier-wait", "sm90_primitives.cuh", r"^\} while \(!done\);$", PUBLIC | {"mbarrier"},
             "mbar_wait's retry loop: it spins until a barrier phase completes. The phase completes on a fixed "
             "number of arrivals and TMA bytes (the same for every secret class); the number of spins is the "
             "hardware's timing, which G4 measures, not a function of data"),
)

# Instances: CT binaries gate (LMODE 0) or are reported (LMODE 1); the rest run policy off.
_MANGLED_ARGS = re.compile(r"(Lb[01]E|Li-?\d+E)")


def instance(mangled: str) -> Instance | None:
    """The csrc kernel instance a cubin function is, or None for a function this table does not know."""
    for kernel in _ARGS:
        k = mangled.find(kernel)
        if k >= 0:
            break
    else:
        return None
    tail = mangled[k + len(kernel):]
    args = tuple(int(m[2:-1]) for m in _MANGLED_ARGS.findall(tail.split("EEv", 1)[0] + "E"))
    names = _ARGS[kernel]
    if len(args) != len(names):  # fail closed: a new template flag the table does not name yet gates
        return Instance(kernel, args, True, frozenset(),
                        f"{len(args)} template arguments, the table names {len(names)}: gated until it does")
    named = dict(zip(names, args))
    # The walk of a binary: 0 true lengths (policy off), 1 one bucket, 2 per-request buckets.
    walk = 0
    if kernel == "decode_v2_kernel" and named["OPT"] & DECODE_CONST_TIME:
        walk = 2 if named["OPT"] & DECODE_BUCKET_PER_REQ else 1
    elif kernel == "merge_kernel":
        walk = named["WALK"]
    elif kernel == "prefill_v2_ct_kernel":
        walk = 1 + named["LMODE"]
    if walk == 1:
        return Instance(kernel, args, True, frozenset(),
                        "constant-time walk, one public bucket (strict, request with one bucket)")
    if walk == 2:
        return Instance(kernel, args, False, frozenset({"mem"}),
                        "constant-time walk, per-request buckets (policy request): each token's or tile's walk is "
                        "its request's bucket, loaded by its request index (docs/kernels.md section 5)")
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
