"""G2 SASS gate (dhp_backend.audit): parser, taint, planted kernels, and the real kernels' CI subset.

Compiles for sm_90 with Triton's bundled ptxas: no GPU needed. The planted
kernels prove the gate catches what it must (a data-dependent loop and ``if``,
precise division) and passes what it must (a clean kernel). They live in
tests/data/planted_kernels.py and compile in a fresh process: this test session
imports Triton in interpreter mode (conftest), which cannot compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from dhp_backend.audit import ptx, sass  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Gate results of tests/data/planted_kernels.py, compiled in a fresh process (see its docstring).

    With a Triton cache of its own: the cache is keyed by kernel source, not by file, so a binary left
    by another checkout (an earlier CI clone, since deleted) carries that checkout's path in its line
    info; the gate then cannot read the line its rule names and fails the clean kernel (CI, 1230d07).
    ``gate.resolve_source`` maps such paths back only for the package's own files."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.join(DATA, "planted_kernels.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _at(f, name, planted):
    return f["source"].startswith(f"planted_kernels.py:{planted['lines'][name]}")


def test_planted_secret_choice_guarded_arithmetic_fails(planted):
    """`tl.where(secret, x * x + 1, x)`: ptxas guards the FFMA by the secret (it runs for one value and
    not the other, with equal instruction counts); the gate names it at its line (audit/guarded.py)."""
    r = planted["planted_guarded"]
    assert not r["passed"] and r["guarded_data_ops"].get("FAIL", 0) >= 1
    fails = [f for f in r["failures"] if "guarded floating-point" in f["why"]]
    assert fails and all(f["instr"].startswith("@") for f in fails)
    assert any(_at(f, "planted_guarded", planted) for f in fails)
    # The clean kernel's guards (its public loop, div.full's range scaling) are all vouched for.
    clean = planted["planted_clean_with_rule"]["guarded_data_ops"]
    assert clean and "FAIL" not in clean


def test_planted_secret_trip_count_fails_naming_instruction_and_line(planted):
    r = planted["planted_loop"]
    assert not r["passed"]
    sass_fails = [f for f in r["failures"] if f["index"] is not None]
    assert sass_fails, r["failures"]
    assert all(f["kernel"] == "planted_loop" for f in sass_fails)
    assert any(("BRA" in f["instr"] or "EXIT" in f["instr"]) and _at(f, "planted_loop", planted)
               for f in sass_fails), sass_fails
    assert any("mem:x_ptr" in f["why"] for f in r["failures"]), r["failures"]


def test_planted_secret_if_fails(planted):
    r = planted["planted_if"]
    assert not r["passed"]
    assert any(_at(f, "planted_if", planted) and "mem:x_ptr" in f["why"] for f in r["failures"]), r["failures"]
    # The branch survives into SASS and is named there too.
    assert any(f["index"] is not None and _at(f, "planted_if", planted) for f in r["failures"]), r["failures"]


def test_planted_precise_division_is_flagged(planted):
    r = planted["planted_div"]
    assert not r["passed"]
    assert any(s["where"] == "ptx" and s["what"] == "IEEE division" for s in r["slow_paths"]), r["slow_paths"]
    assert any(s["where"] == "sass" and s["what"] in ("CALL", "FCHK") for s in r["slow_paths"]), r["slow_paths"]
    assert any("slow path" in f["why"] for f in r["failures"])


def test_planted_clean_kernel_passes(planted):
    r = planted["planted_clean_with_rule"]
    assert r["passed"], [(f["index"], f["instr"], f["why"]) for f in r["failures"]]
    assert {b["rule"] for b in r["branches"]} >= {"n-loop", "exit"}
    assert not r["slow_paths"]
    # Without the rule the same loop is unexplained: rules are required, not implied.
    assert not planted["planted_clean"]["passed"]


def test_ttir_taint_of_a_public_loop(planted):
    assert planted["planted_clean_ttir_for"] == [["arg:n"]]


# --- parsers ------------------------------------------------------------------------------------


def test_sass_parser_on_recorded_snippet():
    gi = sass.parse_nvdisasm(open(os.path.join(DATA, "sass_snippet_gi.txt")).read())
    gp = sass.parse_nvdisasm(open(os.path.join(DATA, "sass_snippet_gp.txt")).read())
    f = sass.join_line_info(gi, gp)["attention_kernel"]
    ins = {i.offset: i for i in f["instrs"]}
    guard = ins[0x8980]
    assert (guard.predicate, guard.base, guard.target) == ("P1", "BRA", ".L_x_8")
    assert guard.src.line == 356 and guard.ptx_line == 2961 and guard.is_branching
    jump = ins[0x89b0]
    assert jump.predicate is None and jump.src.line == 350
    fm = ins[0x89c0]  # an inlined location keeps its chain
    assert fm.src.line == 46 and fm.src.chain[0][1] == 358
    trap = ins[0xa7f0]
    assert trap.target == ".L_x_10" and f["labels"][".L_x_10"] == 0xa7f0
    assert ins[0xa7e0].base == "EXIT" and ins[0xa7e0].ptx_line == 3405
    assert not ins[0x8990].is_control


def test_ptx_predicate_taint():
    src = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b32 	%r1, [k_param_1];
	mov.u32 	%r2, %tid.x;
	setp.lt.u32 	%p1, %r2, 64;
	ld.global.b32 	%r3, [%rd1];
	setp.gt.s32 	%p2, %r3, %r1;
	@%p1 st.global.b32 [%rd1], %r2;
	@%p2 bra 	$L__BB0_2;
	div.rn.f32 	%f1, %f2, %f3;
}
"""
    t = ptx.Taint(src, ["x_ptr", "n"])
    assert t.labels("%p1") == {"tid"}
    assert "mem:x_ptr" in t.labels("%p2") and "param:n" in t.labels("%p2")
    assert [s["what"] for s in ptx.slow_paths(src)] == ["IEEE division"]


# --- the real kernels ----------------------------------------------------------------------------


def test_rule_tables_are_consistent():
    from dhp_backend.audit import rules

    assert rules.check_tables() == []


def test_real_kernels_pass_on_ci_subset(tmp_path):
    from dhp_backend.audit import report, variants

    results = report.run(list(variants.CI_SUBSET), jobs=os.cpu_count(), progress=None)
    s = report.summarize(results, 0.0, "CI subset")
    assert s["passed"], report.print_summary(s, results) or s["failures"]
    assert {r["kernel"] for r in results} == {"attention_kernel", "merge_kernel"}
    # Each result audited the binary it names (split mode, step kind and policy-off
    # binary included), not a default of them.
    assert sorted(r["variant"]["key"] for r in results) == sorted(v.key for v in variants.CI_SUBSET)
    # Every attention variant has its three loops explained by source rules (the split/fold
    # mode is a constexpr: one binary per mode, no branch).
    for r in results:
        rules_ = {b["rule"] for b in r["branches"]}
        if r["kernel"] == "attention_kernel":
            assert {"locate-loop", "split-loop", "kv-loop"} <= rules_, r["variant"]
        else:
            assert "merge-loop" in rules_
        assert not r["slow_paths"], r["slow_paths"]
    md, js = report.write_reports(str(tmp_path), s, results)
    assert os.path.getsize(md) > 1000 and os.path.getsize(js) > 1000


def test_model_feature_binaries_pass(tmp_path):
    """G2 on the soft-cap, sinks and sliding-window binaries (issue 31): the same
    public loops as the plain binaries, nothing else, no slow path (tanh's division
    is div.full). The window's selection needs no rule of its own; the policy-off
    window binaries' short walk (bounds from the true length) is gated on l_mode,
    so under a public bucket their loops are public too."""
    from dhp_backend.audit import report, variants

    results = report.run(list(variants.FEATURE_SUBSET), jobs=os.cpu_count(), progress=None)
    s = report.summarize(results, 0.0, "model features")
    assert s["passed"], report.print_summary(s, results) or s["failures"]
    assert sorted(r["variant"]["key"] for r in results) == sorted(v.key for v in variants.FEATURE_SUBSET)
    assert {(v.const_time, v.split) for v in variants.FEATURE_SUBSET if v.window} == {
        (ct, sp) for ct in (True, False) for sp in (True, False)}
    for r in results:
        rules_ = {b["rule"] for b in r["branches"]}
        if r["kernel"] == "attention_kernel":
            assert {"locate-loop", "split-loop", "kv-loop"} <= rules_, r["variant"]
        assert not r["slow_paths"], r["slow_paths"]


def test_cli_audit_sass_exit_code(monkeypatch, capsys):
    from dhp_backend import cli
    from dhp_backend.audit import variants

    monkeypatch.setattr(variants, "CI_SUBSET", variants.CI_SUBSET[-1:])  # one merge variant: fast
    assert cli.main(["audit", "sass", "--jobs", "1"]) == 0
    assert "G2 SASS gate: PASS" in capsys.readouterr().out


def test_enumeration_counts_distinct_binaries():
    from dhp_backend.audit import variants

    vs = variants.enumerate_variants(groups=(4,), dtypes=("bfloat16",), heads=(128,))
    att = [v for v in vs if v.kernel == "attention_kernel"]
    # 4 block sizes x causal x num_heads divisibility x split/fold mode x 3 step kinds
    # x constant-time/policy-off binary; merge: num_heads divisibility only.
    assert len(att) == 192 and len(vs) - len(att) == 2
    assert sum(not v.const_time for v in att) == 96
    assert len({v.key for v in vs}) == len(vs)


def test_interpreted_kernels_get_a_clear_error(monkeypatch):
    """Kernels imported under TRITON_INTERPRET=1 cannot be compiled: the gate says so instead of an
    AttributeError deep in the enumeration."""
    from types import SimpleNamespace

    from dhp_backend.audit import variants
    from dhp_backend.ops.triton import kernels

    v = variants.enumerate_variants(groups=(4,), dtypes=("bfloat16",), heads=(128,))[0]
    monkeypatch.setattr(kernels, v.kernel, SimpleNamespace(arg_names=[]))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        variants.compile_inputs(v)


# --- the SASS predicate slice (branches ptxas makes without a PTX counterpart) ---------------
def _fn(lines, labels=None):
    """Instructions from 'text' lines (guard predicate inline, as nvdisasm prints it)."""
    from dhp_backend.audit.sass import Instr

    out = []
    for k, text in enumerate(lines):
        pred = None
        if text.startswith("@"):
            pred = text.split()[0][1:]
        op = text.split()[1] if pred else text.split()[0]
        out.append(Instr(index=k, offset=16 * k, predicate=pred, opcode=op, text=text))
    return out, labels or {}


def _slice(lines, labels=None):
    from dhp_backend.audit.sass_slice import public_predicate

    instrs, labels = _fn(lines, labels)
    return public_predicate(instrs, labels, instrs[-1])


def test_slice_proves_a_hoisted_loop_guard_public():
    # what Triton 3.6's ptxas emits for merge_kernel's zero-trip guard
    ok, why = _slice(["LDC R54, c[0x0][0x240]", "S2R R73, SR_TID.X", "VIADD R54, R54, 0x7",
                      "ISETP.GT.AND P0, PT, R54, 0x7, PT", "@!P0 BRA `(.L_x_0)"])
    assert ok, why
    ok, why = _slice(["LDC.64 R2, c[0x0][0x210]", "IMAD.WIDE R4, R3, 0x4, R2", "ISETP.NE.AND P0, PT, R5, RZ, PT",
                      "@P0 BRA `(.L_x_1)"])
    assert ok, why  # R5 is the high half of IMAD.WIDE's pair, from a 64-bit parameter


def test_slice_follows_a_broadcast_of_the_thread_index():
    # consumer_warpgroup(): the warp's index broadcast from lane 0, then a barrier chosen by it
    ok, why = _slice(["S2R R2, SR_TID.X", "SHF.R.U32.HI R2, RZ, 0x7, R2", "SHFL.IDX PT, R9, R2, RZ, 0x1f",
                      "ISETP.NE.AND P1, PT, R9, 0x1, PT", "@!P1 BRA `(.L_x_0)"])
    assert ok and "SHFL.IDX" in why, why


@pytest.mark.parametrize("lines,labels,needle", [
    (["LDG.E R5, desc[UR4][R2.64]", "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "memory"),
    # a shuffle is followed: of a loaded value, or at a loaded lane, it is not public; of an unknown one, unresolved
    (["LDG.E R6, desc[UR4][R2.64]", "SHFL.IDX PT, R5, R6, RZ, 0x1f", "ISETP.GT.AND P0, PT, R5, RZ, PT",
      "@P0 BRA `(.L_x_0)"], None, "memory"),
    (["S2R R6, SR_TID.X", "LDG.E R7, desc[UR4][R2.64]", "SHFL.IDX PT, R5, R6, R7, 0x1f",
      "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "memory"),
    (["SHFL.IDX PT, R5, R6, RZ, 0x1f", "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "function entry"),
    (["VOTE.ANY R5, PT, P1", "ISETP.NE.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "votes or sums"),
    (["LDC R5, c[0x0][0x240]", "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], {".L_x_9": 16},
     "basic block"),
    (["FOO R5, R6", "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "unknown destinations"),
    # a guarded redefinition does not hide the loaded value it may leave in place
    (["LDG.E R5, desc[UR4][R2.64]", "@P1 MOV R5, 0x1", "ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"],
     None, "memory"),
    (["ISETP.GT.AND P0, PT, R5, RZ, PT", "@P0 BRA `(.L_x_0)"], None, "function entry"),
])
def test_slice_refuses_what_it_cannot_prove(lines, labels, needle):
    ok, why = _slice(lines, labels)
    assert not ok and needle in why, why


def test_line_info_from_another_checkout_resolves_here():
    """Triton's cache is keyed by kernel source, so a binary may carry the path of
    the checkout that first compiled it (a CI clone, a removed worktree): the gate
    reads this package's copy of a dhp_backend file, and leaves other paths alone
    (it then fails closed: no rule matches a line it cannot read)."""
    from dhp_backend.audit import gate
    from dhp_backend.ops.triton import kernels

    here = os.path.abspath(kernels.__file__)
    assert gate.resolve_source("/gone/checkout/dhp_backend/ops/triton/kernels.py") == here
    assert gate.resolve_source(here) == here
    assert gate.resolve_source("/gone/elsewhere/kernels.py") == "/gone/elsewhere/kernels.py"
    line = next(i for i, t in enumerate(open(here), 1) if t.strip() == "for j in range(j_lo, j_hi):")
    fn, text = gate.source_line("/gone/checkout/dhp_backend/ops/triton/kernels.py", line)
    assert (fn, text) == ("attention_kernel", "for j in range(j_lo, j_hi):")


def test_line_info_from_an_edited_checkout_still_resolves_here(tmp_path):
    """The other checkout may still exist and have changed since it compiled the
    cached binary (a developer tree edited while a fresh-clone CI run audits):
    its file must not be read; this package's copy is what the cache key matches."""
    from dhp_backend.audit import gate
    from dhp_backend.ops.triton import kernels

    here = os.path.abspath(kernels.__file__)
    other = tmp_path / "dev" / "dhp_backend" / "ops" / "triton" / "kernels.py"
    other.parent.mkdir(parents=True)
    other.write_text("\n" * 40 + open(here).read())  # the same kernels, 40 lines lower
    assert gate.resolve_source(str(other)) == here
    line = next(i for i, t in enumerate(open(here), 1) if t.strip() == "for s in range(s_lo, s_hi, s_step):")
    assert gate.source_line(str(other), line) == ("attention_kernel", "for s in range(s_lo, s_hi, s_step):")
    assert gate.source_line("/gone/elsewhere/kernels.py", line) == (None, "")


def test_cli_audit_sass_all_slices_by_dtype_head_and_group(monkeypatch, capsys):
    """`--all --dtypes/--heads/--groups` audits exactly that slice; bad values are refused by name."""
    from dhp_backend import cli
    from dhp_backend.audit import report, variants

    seen = {}

    class Stop(Exception):
        pass

    def fake_run(vs, **kw):
        seen["vs"] = list(vs)
        raise Stop

    monkeypatch.setattr(report, "run", fake_run)
    with pytest.raises(Stop):
        cli.main(["audit", "sass", "--all", "--dtypes", "bf16", "--heads", "128", "--groups", "4"])
    assert seen["vs"] == variants.enumerate_variants(groups=(4,), dtypes=("bfloat16",), heads=(128,))
    for bad, word in ((["--dtypes", "bf8"], "--dtypes"), (["--heads", "100"], "--heads"),
                      (["--heads", "x"], "--heads"), (["--groups", "a"], "--groups")):
        with pytest.raises(SystemExit) as e:
            cli.main(["audit", "sass", "--all", *bad])
        assert e.value.code == 2 and word in capsys.readouterr().err
