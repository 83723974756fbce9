"""The rule tables of the SASS gate: why each control instruction may exist.

A rule is checkable, not an allowlist of instructions. Two kinds:

**Source rules** (per kernel): a loop or ``if`` of the Python source, named by the
@triton.jit function holding it and a regex its line must match. A SASS branch
mapped (nvdisasm line info) to that line is explained only if, in addition,
Triton's TTIR has a control op at that line whose bounds / condition carry no
label outside the rule's ``sources`` (`ttir` taint analysis, under every gating
scenario). So the table says *why* a condition is public, and the taint check
verifies that the compiled condition depends on nothing else. A rule may not list
a source the kernel spec declares secret (checked by `check_tables`).

**Generic rules** (every kernel): instructions that choose no path on data by
construction: an unpredicated EXIT / jump / reconvergence marker, the trap loop
after the last EXIT, and the *lane guard*: a branch ptxas makes out of a
predicated PTX instruction (a store that one thread per row performs) whose
predicate derives only from the thread / program index and parameters, checked
on the PTX (`ptx.Taint`).

Scenarios: the kernels take the policy as a runtime flag (``l_mode``), so the
taint check runs once per policy with that flag folded. Gating scenarios must
be clean; non-gating ones are reported (their leaks are documented contract
limits, docs/kernels.md section 5, and must stay exactly the documented ones).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SourceRule:
    name: str
    function: str  # the @triton.jit function whose source line holds the loop / if
    pattern: str  # regex on the stripped source line
    kind: str  # "loop" (scf.for) | "if" (scf.if)
    sources: frozenset  # labels the bounds / condition may carry (besides constants); see ttir
    reason: str


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    assume: dict
    gating: bool
    note: str
    # Labels that a non-gating scenario is documented to add to the rule sources.
    documented: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    kernel: str
    secret: frozenset  # labels that may never explain a branch
    rules: tuple
    scenarios: tuple


_SPLIT_BOUNDS = frozenset({"pid", "arg:chunk_stride", "arg:n_split_grid", "arg:l_scalar"})

ATTENTION = KernelSpec(
    kernel="attention_kernel",
    # Q/K/V and the cache, each request's query/context length (qsl, seq_lens),
    # and everything derived from them in the workspace.
    secret=frozenset({"mem:q_ptr", "mem:k_ptr", "mem:v_ptr", "mem:qsl_ptr", "mem:seq_ptr", "mem:ws_acc_ptr",
                      "mem:ws_m_ptr", "mem:ws_l_ptr", "mem:sink_ptr", "mem:sink_out_ptr", "mem:out_ptr",
                      "mem:?", "mem:shared", "mem:local"}),
    rules=(
        SourceRule("locate-loop", "locate", r"^for c in range\(0, search_trips\):$", "loop",
                   frozenset({"arg:search_trips"}),
                   "trip count search_trips = ceil(num_reqs / SEARCH_BLOCK), computed on the host from the "
                   "public number of requests"),
        SourceRule("split-loop", "attention_kernel", r"^for s in range\(s_lo, s_hi, s_step\):$", "loop",
                   _SPLIT_BOUNDS,
                   "splits chunk, chunk + chunks, ... below n_split_grid in split mode (program id, host plan "
                   "from public geometry), ceil(ceil(L / BLOCK_N) / TILES_PER_SPLIT) in fold mode with L = l_scalar, "
                   "the public bucket"),
        SourceRule("kv-loop", "attention_kernel", r"^for j in range\(j_lo, j_hi\):$", "loop", _SPLIT_BOUNDS,
                   "KV steps [s*TILES_PER_SPLIT, min(+TILES_PER_SPLIT, ceil(L / BLOCK_N))) of split s: the bucket L "
                   "and the split index only"),
    ),
    scenarios=(
        Scenario("strict/request(int): l_mode=0", {"l_mode": 0}, True,
                 "one public bucket L for every request"),
        Scenario("request(tensor): l_mode=1", {"l_mode": 1}, False,
                 "per-request buckets: which tile takes which request's bucket follows the query lengths "
                 "(query_start_loc); documented in docs/kernels.md section 5",
                 frozenset({"mem:bucket_ptr", "mem:qsl_ptr", "arg:bucket_ptr", "arg:qsl_ptr", "arg:num_reqs",
                            "arg:search_trips", "arg:pad_l", "arg:token_tiles"})),
        Scenario("off: l_mode=2", {"l_mode": 2}, False,
                 "true lengths: not constant-time by contract (design.md section 2)",
                 frozenset({"mem:seq_ptr", "mem:qsl_ptr", "arg:seq_ptr", "arg:qsl_ptr", "arg:num_reqs",
                            "arg:num_tokens", "arg:search_trips", "arg:token_tiles"})),
    ),
)

MERGE = KernelSpec(
    kernel="merge_kernel",
    secret=frozenset({"mem:ws_acc_ptr", "mem:ws_m_ptr", "mem:ws_l_ptr", "mem:out_ptr", "mem:?", "mem:shared",
                      "mem:local"}),
    rules=(
        SourceRule("merge-loop", "merge_kernel",
                   r"^for c in range\(0, \(n_split_grid \+ UNROLL - 1\) // UNROLL\):$", "loop",
                   frozenset({"arg:n_split_grid"}),
                   "ceil(n_split_grid / UNROLL) trips: the number of split states, from the bucket L or the "
                   "table width (public)"),
    ),
    scenarios=(Scenario("all policies", {}, True, "the merge kernel has no policy flag"),),
)

SPECS = {s.kernel: s for s in (ATTENTION, MERGE)}

# Generic rules, applied to every kernel (planted test kernels included).
GENERIC = {
    "exit": "unpredicated EXIT: the end of the kernel, reached by every thread",
    "jump": "unpredicated jump: the path was chosen by the conditional branch that led here",
    "reconvergence": "BSSY/BSYNC/WARPSYNC: compiler reconvergence markers, no choice of path",
    "trap-loop": "self-branch after the last EXIT: ptxas's end-of-code trap, never executed",
    "lane-guard": "branch made by ptxas from a predicated PTX instruction whose predicate derives only from "
                  "thread/program index and parameters (checked on the PTX)",
}

LANE_GUARD_ALLOWED_PREFIXES = ("tid", "pid", "param:")


def spec_for(kernel: str) -> KernelSpec:
    """The kernel's spec; an unknown kernel (a planted test kernel) gets no source rules."""
    return SPECS.get(kernel) or KernelSpec(kernel=kernel, secret=frozenset(), rules=(),
                                           scenarios=(Scenario("default", {}, True, "no policy flag"),))


def check_tables() -> list[str]:
    """Self-consistency of the tables: no rule may list a secret source."""
    errs = []
    for spec in SPECS.values():
        for r in spec.rules:
            bad = r.sources & spec.secret
            if bad:
                errs.append(f"{spec.kernel}: rule {r.name} lists secret sources {sorted(bad)}")
            if r.kind not in ("loop", "if"):
                errs.append(f"{spec.kernel}: rule {r.name} has unknown kind {r.kind}")
    return errs
