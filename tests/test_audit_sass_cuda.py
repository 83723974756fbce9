"""G2 for the csrc CUDA kernels (dhp_backend.audit.cuda_gate): PTX taint, SASS slices, a planted kernel,
and, where nvcc is installed, the real constant-time prefill binaries.

The planted kernel (tests/data/cuda_gate/planted.cu) is stored with its cubin
(built once with nvcc 13.0, the command is in the file), so CI, which has no
nvcc, still runs the gate on a real Hopper binary with Triton's nvdisasm. It
has a loop bound by a parameter (public), an ``if`` on loaded data (secret: a
SASS branch) and a ternary select on data that nvcc turns into a PTX branch
(secret even where ptxas predicates it away).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from dhp_backend.audit import cuda_gate, cuda_rules, guarded, ptx, sass, sass_slice  # noqa: E402
from dhp_backend.ops import cuda_build  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "cuda_gate")
PLANTED = os.path.join(DATA, "planted.cubin")


def _nvdisasm_or_skip():
    try:
        sass.tool_path("nvdisasm")
    except FileNotFoundError as e:
        pytest.skip(str(e))


# --- PTX taint ---------------------------------------------------------------------------------

_SCOPED = """.entry k(
.param .u32 k_param_0
)
{
.reg .pred %p<3>;
.reg .b32 %r<9>;
ld.param.u32 %r1, [k_param_0];
setp.lt.s32 %p1, %r1, 1;
@%p1 bra $L1;
ld.global.u32 %r7, [%rd1];
{
.reg .pred %p1;
setp.ne.u32 %p1, %r7, 0;
bar.red.popc.u32 %r2, 0, %p1;
}
setp.gt.s32 %p2, %r2, 0;
{
.reg .pred p;
mbarrier.try_wait.parity.shared::cta.b64 p, [%r3], %r4;
selp.u32 %r5, 1, 0, p;
}
$L1:
ret;
}"""


def test_taint_keeps_scoped_registers_apart_and_follows_barrier_counts():
    t = ptx.Taint(_SCOPED, ["n"])
    # The outer %p1 (a parameter test) is not the inner %p1 (a test of loaded data).
    assert t.labels("%p1") == frozenset({"param:n"})
    inner = [ln for ln in t.lines if ln.startswith("setp.ne.u32")][0]
    assert "%p1@" in inner
    # A CTA-wide count of a secret predicate is secret (it used to carry no label at all).
    assert "mem:?" in t.labels("%p2")
    # An mbarrier try-wait result is the wait label, through the asm-local name and selp.
    assert t.labels("%r5") == frozenset({"mbarrier:wait"})
    assert t.guard_register("@%p1 bra $L1;") == "%p1"
    assert t.guard_register("@!p@3 bra $L1;") == "p@3"


# --- SASS: waits and the CFG slice -----------------------------------------------------------------

_SASS = """
\t.text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R1, 0x1, PT ;
.L_x_0:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0030*/               @!P1 BRA `(.L_x_0) ;
        /*0040*/               @!P0 BRA `(.L_x_1) ;
        /*0050*/                   LDG.E R3, desc[UR4][R4.64] ;
        /*0060*/                   ISETP.GT.AND P2, PT, R3, RZ, PT ;
        /*0070*/                @P2 BRA `(.L_x_1) ;
.L_x_1:
        /*0080*/                   EXIT ;
"""


def test_wait_and_cfg_slice_on_a_recorded_snippet():
    f = sass.parse_nvdisasm(_SASS)["k"]
    ins, labels = f["instrs"], f["labels"]
    assert sass_slice.wait_source(ins, labels, ins[3]).startswith("SYNCS.PHASECHK")
    # P0 is defined before a loop header (a block start): the CFG slice follows both
    # predecessors (fall-through and the retry loop's back edge) to the parameter.
    assert sass_slice.public_predicate(ins, labels, ins[4])[0] is False  # one block only: not proven
    ok, why = sass_slice.public_predicate_cfg(ins, labels, ins[4])
    assert ok, why
    ok, why = sass_slice.public_predicate_cfg(ins, labels, ins[7])
    assert not ok and "memory" in why
    assert sass_slice.wait_source(ins, labels, ins[7]) is None


# --- instances ------------------------------------------------------------------------------------

def test_instances_from_mangled_names():
    """prefill_sm90.cu: the v2 CT kernel gates with LMODE 0, is reported with the request's
    bucket documented with LMODE 1; the policy-off kernel is listed only."""
    base = "_ZN3dhp48_GLOBAL__N__79ae1585_15_prefill_sm90_cu_8545efc1{}I{}EEv14CUtensorMap_stS2_S2_NS0_6ParamsE"
    ct0 = cuda_rules.instance(base.format("20prefill_v2_ct_kernel", "Lb1ELi0E"))
    ct1 = cuda_rules.instance(base.format("20prefill_v2_ct_kernel", "Lb1ELi1E"))
    off = cuda_rules.instance(base.format("17prefill_v2_kernel", "Lb1E"))
    assert ct0.kernel == "prefill_v2_ct_kernel" and ct0.gating and ct0.args == (1, 0)
    assert not ct1.gating and ct1.documented == frozenset({"mem"})
    assert off.kernel == "prefill_v2_kernel" and not off.gating and not off.documented and "policy off" in off.note
    # A template list of another length (a flag added to the kernel, not to the table) fails closed: gated.
    for extra in ("Lb1E", "Lb1ELi0ELi3E"):
        new_arity = cuda_rules.instance(base.format("20prefill_v2_ct_kernel", extra))
        assert new_arity.gating and "gated until" in new_arity.note
    assert cuda_rules.instance("_Z12some_helperv") is None


def test_decode_instances_from_mangled_names():
    """decode_sm90.cu: option kConstTime (128) gates, with kBucketPerReq (256) it is
    reported with the request's bucket documented; the merge by its WALK; policy-off
    binaries are listed only."""
    dec = ("_ZN3dhp47_GLOBAL__N__2b23ac5e_14_decode_sm90_cu_63b36a6b16decode_v2_kernelI{}"
           "EEv14CUtensorMap_stS2_S2_NS0_6ParamsE")
    merge = "_ZN3dhp47_GLOBAL__N__2b23ac5e_14_decode_sm90_cu_63b36a6b12merge_kernelI{}EEvNS0_6ParamsE"
    ct1 = cuda_rules.instance(dec.format("Lb1ELi2ELb1ELi2ELb1ELi217E"))
    ct2 = cuda_rules.instance(dec.format("Lb1ELi2ELb1ELi2ELb1ELi473E"))
    off = cuda_rules.instance(dec.format("Lb1ELi2ELb1ELi2ELb1ELi89E"))
    assert ct1.gating and ct1.args == (1, 2, 1, 2, 1, 217)
    assert not ct2.gating and ct2.documented == frozenset({"mem"})
    assert not off.gating and not off.documented and "policy off" in off.note
    assert cuda_rules.instance(merge.format("Lb1ELi1E")).gating
    assert cuda_rules.instance(merge.format("Lb0ELi2E")).documented == frozenset({"mem"})
    assert not cuda_rules.instance(merge.format("Lb1ELi0E")).gating
    assert cuda_rules.instance(merge.format("Lb1E")).gating  # an arity the table does not know: fails closed


# --- the planted kernel ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def planted_result():
    _nvdisasm_or_skip()
    blob = open(PLANTED, "rb").read()
    funcs = sass.disassemble(blob)
    ptx_text = cuda_gate.embedded_ptx(blob)
    assert ".entry planted_kernel(" in ptx_text

    def run(rules):
        saved = cuda_rules.RULES
        cuda_rules.RULES = rules
        try:
            inst = cuda_rules.Instance("planted_kernel", (), True, frozenset(), "planted")
            return cuda_gate.audit_function("planted_kernel", funcs, ptx_text, inst, source_dirs=(DATA,))
        finally:
            cuda_rules.RULES = saved

    return run


_PLANTED_RULES = (
    cuda_rules.CudaRule("planted-loop", "planted.cu", r"^for \(int (i|k) = ", cuda_rules.PUBLIC, "parameter bound"),
    # A rule that (wrongly) claims the data-dependent if is public: the PTX labels must still fail it.
    cuda_rules.CudaRule("planted-if", "planted.cu", r"^if \(v > 0\.f\)", cuda_rules.PUBLIC, "wrong on purpose"),
)


def test_planted_kernel_secret_branches_fail_public_loops_pass(planted_result):
    r = planted_result(_PLANTED_RULES)
    assert not r["passed"]
    by_text = {}
    for b in (b for b in r["branches"] if b["instr"].startswith("@")):  # the predicated ones
        by_text.setdefault(b["source_text"].split("//")[0].strip(), []).append(b)
    loops = [b for t, bs in by_text.items() if t.startswith("for (") for b in bs]
    assert loops and all(b["ok"] and b["rule"] == "planted-loop" for b in loops)
    ifs = by_text.get("if (v > 0.f) {", [])
    assert ifs and all(not b["ok"] and "mem" in b["detail"] for b in ifs)  # the rule cannot vouch for data
    # The data ternary: a PTX branch on loaded data, flagged although ptxas predicated it.
    ptx_fails = [f for f in r["failures"] if f["source"].startswith("ptx:")]
    assert ptx_fails and all("not public" in f["why"] for f in ptx_fails)


def test_planted_kernel_without_rules_names_every_unexplained_branch(planted_result):
    r = planted_result(())
    unexplained = [f for f in r["failures"] if f["index"] is not None and "guarded floating-point" not in f["why"]
                   and "BAR" not in f["instr"]]
    assert unexplained and all("no rule for planted.cu" in f["why"] for f in unexplained)


def test_planted_kernel_barrier_chosen_by_data_fails_by_thread_index_passes(planted_result):
    """ptxas predicates a bar.arrive under an `if` instead of branching around it: the gate explains a
    predicated barrier as it does a branch, so one chosen by loaded data fails and one chosen by the thread
    index passes (by the SASS slice: no rule needed)."""
    r = planted_result(_PLANTED_RULES)
    bars = {b["source_text"].split("asm")[0].strip(): b for b in r["branches"] if " BAR." in b["instr"]}
    secret, public = bars["if (p.x[threadIdx.x] > 1.f)"], bars["if (threadIdx.x < 64)"]
    assert secret["instr"].startswith("@") and not secret["ok"] and "comes from memory" in secret["detail"]
    assert public["instr"].startswith("@") and public["ok"] and public["rule"] == "param-guard"
    assert any(f["index"] == secret["index"] for f in r["failures"])


def test_planted_kernel_data_ternary_guarded_arithmetic_fails(planted_result):
    """`acc == v ? 1.f : ex2(acc - v)`: ptxas runs the ex2 (MUFU) under a guard on loaded data, so
    one input does the work and another skips it. The gate names it, whatever the branch rules say;
    the loop's public guards pass."""
    r = planted_result(_PLANTED_RULES)
    guarded = [f for f in r["failures"] if "guarded floating-point" in f["why"]]
    assert guarded, r["guarded_data_ops"]
    assert any(f["instr"].split()[1].startswith("MUFU") for f in guarded)
    assert all(f["instr"].startswith("@") for f in guarded)
    assert r["guarded_data_ops"].get("FAIL") == len(guarded)


def test_guarded_data_op_rules_on_ptx_snippets():
    """The PTX side of the guarded-arithmetic rule: a branch-skipped block on a public predicate
    vouches for the guard; a result that feeds a select on loaded data in its block does not."""
    text = "\n".join([
        ".visible .entry k(.param .u32 k_param_0)", "{",
        "ld.param.u32 %r1, [k_param_0];",
        "mov.u32 %r2, %tid.x;",
        "ld.global.f32 %f1, [%rd1];",
        "setp.lt.s32 %p1, %r2, 1;",
        "setp.gt.f32 %p2, %f1, 0f00000000;",
        "@%p1 bra $L__BB0_2;",
        "max.f32 %f2, %f2, %f1;",          # line 9: skipped by a branch on tid
        "$L__BB0_2:",
        "@%p1 bra $L__BB0_3;",
        "fma.rn.f32 %f3, %f1, %f1, %f2;",  # line 12: skipped by that branch, but feeds a select on data
        "selp.f32 %f4, %f3, %f2, %p2;",
        "$L__BB0_3:",
        "ret;", "}"])
    taint = ptx.Taint(text)
    assert taint.lines[8].strip().startswith("max.f32") and taint.lines[11].strip().startswith("fma.rn")

    judge = cuda_gate._csrc_public(frozenset())

    def instr(text, pred, line):  # one guarded SASS instruction, its guard unknown to the slice
        op = text.split()[1]
        return sass.Instr(index=0, offset=0, predicate=pred, opcode=op, text=text, ptx_line=line)

    rule, why = guarded.rule(instr("@P0 FMNMX R1, R2, R1, !PT", "P0", 9), [], {}, taint, judge)
    assert rule == "ptx-guard", why
    rule2, why2 = guarded.rule(instr("@P1 FFMA R3, R1, R1, R2", "P1", 12), [], {}, taint, judge)
    assert rule2 is None and "select on ['%p2']" in why2, why2
    ins3 = instr("@P5 FMUL R149, R149, 0.25 ;", "P5", None)
    assert guarded.rule(ins3, [ins3], {}, taint, judge)[0] == "div-range"


def test_source_text_reads_this_checkouts_csrc_before_the_compiled_path(tmp_path):
    """A cached cubin can name another checkout's file, which may have changed since; the line
    text comes from this checkout's csrc/, whose contents the cubin was built from."""
    from types import SimpleNamespace

    stale = tmp_path / "decode_sm90.cu"
    stale.write_text("// an edited copy elsewhere\n" * 40)
    want = (cuda_build.csrc_dir() / "decode_sm90.cu").read_text().splitlines()[29].strip()
    assert cuda_gate._source_text(SimpleNamespace(file=str(stale), line=30)) == want
    # a file csrc/ does not hold is still read where it was compiled
    other = tmp_path / "planted.cu"
    other.write_text("a\n  if (x) {\n")
    assert cuda_gate._source_text(SimpleNamespace(file=str(other), line=2)) == "if (x) {"


def test_elf_section_rejects_non_elf():
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        cuda_gate.elf_section(b"not an elf file at all", ".text")


def test_cli_without_nvcc_says_so(monkeypatch, capsys):
    from dhp_backend import cli

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    assert cli.main(["audit", "sass-cuda"]) == 2
    assert "no nvcc" in capsys.readouterr().err


# --- the real binaries (nvcc needed: the developer machine, the GPU machine) -------------------------

@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc to build csrc/prefill_sm90.cu")
def test_prefill_constant_time_binaries_pass_the_gate():
    _nvdisasm_or_skip()
    s = cuda_gate.audit_sources(("prefill_sm90.cu",), progress=lambda m: None)
    gating = [r for r in s["results"] if r["gating"]]
    reported = [r for r in s["results"] if not r["gating"] and r.get("audited", True)]
    assert len(gating) == 2 and s["passed"], [f for r in gating for f in r["failures"]][:5]
    for r in gating:  # every kind of branch the CT walk has, each explained
        assert {"locate-loop", "step-loop", "role", "wait", "elect-loop", "producer-issue", "v2p-split-end",
                "turn-finish"} <= set(r["by_rule"])
        assert not r["documented"]
    # Per-request buckets: the one documented dependence (the request's bucket, from memory).
    assert len(reported) == 2 and all(r["passed"] and r["documented"] == ["mem"] for r in reported)


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc to build csrc/decode_sm90.cu")
def test_decode_constant_time_binaries_pass_the_gate():
    _nvdisasm_or_skip()
    s = cuda_gate.audit_sources(("decode_sm90.cu",), progress=lambda m: None)
    gating = [r for r in s["results"] if r["gating"]]
    reported = [r for r in s["results"] if not r["gating"] and r.get("audited", True)]
    decode = [r for r in gating if r["kernel"] == "decode_v2_kernel"]
    # The one-bucket CT binary (the v2 consumer's walk): fp16/bf16 x split/fold x small/large Q tile, + 2 merges.
    assert len(decode) == 8 and len(gating) == 10 and s["passed"], [f for r in gating for f in r["failures"]][:5]
    for r in decode:  # every kind of branch the CT walk has, each explained
        assert {"dec-locate-loop", "dec-split-loop", "v2-step-loop", "v2-split-end", "dec-role", "wait",
                "elect-loop"} <= set(r["by_rule"])
        assert not r["documented"]
    assert reported and all(r["passed"] and r["documented"] == ["mem"] for r in reported)

