"""Planted kernels for tests/test_audit_sass.py, audited in a fresh process.

Run as ``python tests/data/planted_kernels.py`` with TRITON_INTERPRET unset: it
compiles each kernel for sm_90, runs the G2 gate on it and prints one JSON
object. A separate process because Triton fixes interpreter vs compiler mode
when a @jit function is defined, and the CPU test session imports Triton in
interpreter mode.
"""

import json
import os
import sys

import triton
import triton.language as tl


@triton.jit
def planted_loop(x_ptr, out_ptr, BLOCK: tl.constexpr):
    n = tl.load(x_ptr)  # a secret value as a trip count
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n):
        acc += tl.load(out_ptr + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


@triton.jit
def planted_if(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if tl.load(x_ptr) > 0:  # a branch on a secret value
        tl.store(out_ptr + offs, tl.load(out_ptr + BLOCK + offs) * 2.0)


@triton.jit
def planted_div(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, tl.math.div_rn(x, x + 3.0))


@triton.jit
def planted_clean(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n):  # a public trip count (an argument)
        acc += tl.exp2(tl.load(x_ptr + i * BLOCK + offs))
    tl.store(out_ptr + offs, acc / tl.where(acc > 0, acc, 1.0))


@triton.jit
def planted_guarded(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    keep = tl.load(out_ptr + BLOCK) > 0  # a secret choice: ptxas guards the FFMA by it
    tl.store(out_ptr + offs, tl.where(keep, x * x + 1.0, x))


# Source lines the test expects findings at.
LINES = {"planted_loop": planted_loop.fn.__code__.co_firstlineno + 4,
         "planted_if": planted_if.fn.__code__.co_firstlineno + 3,
         "planted_guarded": planted_guarded.fn.__code__.co_firstlineno + 5}


def _compile(fn, x):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": x, "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    sig = {k: sig[k] for k in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, {"BLOCK": 128}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def main():
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    from dhp_backend.audit import gate, ttir
    from dhp_backend.audit import rules as R

    out = {"lines": LINES}
    for fn, x in ((planted_loop, "*i32"), (planted_if, "*i32"), (planted_div, "*fp32"), (planted_clean, "*fp32"),
                  (planted_guarded, "*fp32")):
        ck = _compile(fn, x)
        out[fn.__name__] = gate.audit_compiled(ck, fn.__name__)
    # The clean kernel's loop is public only through a rule that says so.
    R.SPECS["planted_clean"] = R.KernelSpec("planted_clean", frozenset({"mem:x_ptr", "mem:out_ptr"}), (
        R.SourceRule("n-loop", "planted_clean", r"^for i in range\(0, n\):", "loop", frozenset({"arg:n"}),
                     "n is a public argument"),), (R.Scenario("default", {}, True, ""),))
    ck = _compile(planted_clean, "*fp32")
    out["planted_clean_with_rule"] = gate.audit_compiled(ck, "planted_clean")
    out["planted_clean_ttir_for"] = [sorted(c.labels) for c in ttir.analyse(ck.asm["ttir"]) if c.kind == "scf.for"]
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
