"""Decision run (b) of issue 30's arithmetic contract (docs/kernels.md section 7): the csrc decode
kernel's consumer on the next contract, checked bit for bit against the prefill that chose it.

    python -m benchmarks.decode_v2 --probe      # right, and a decode row == the v2 prefill's row
    python -m benchmarks.decode_v2 --g2         # the csrc SASS gate on its constant-time binaries (no GPU)
    python -m benchmarks.cuda_decode --variants fa3,cuda_auto,exp_v2,exp_p2x2_pv_ef ...   # timing

An EXPERIMENT, outside the package: ``benchmarks/csrc/decode_v2_sm90.cu`` includes
``csrc/decode_sm90.cu`` unchanged and adds the v2 consumer; it is built into a library of its own
(`benchmarks.experiment_lib`). The launches go through the product's launcher
(`dhp_backend.ops.cuda_decode.decode_sm90`: its planning, split/fold choice, workspace and
longest-first schedule) with the experiment library's entry in place of the engine's, so the
rows differ in the kernel only. ``exp_<variant>`` of a product variant is the product's binary
built by the same nvcc in the experiment library (a like-for-like baseline).

The probe (exit 1 when wrong):
  - the v2 prefill (``contract_v2``'s ``v2fma_fold512``) through the product's prefill launcher and on its
    constant-time walks (``consume_v2_ct``: one bucket, per-request buckets): the same bits;
  - every decode row against SDPA, both split modes, splits dealt one and three per CTA, and the constant-time
    walks (one bucket; per-request buckets) whose bits must be policy ``off``'s;
  - **the contract's invariance**: a decode row equals, bit for bit, the last row of the v2 prefill
    (``benchmarks.contract_v2`` variant ``v2fma_fold512``) of the same request on the same cache, and
    the whole prefill step run through the decode kernel (each token its own row, token tiles) equals
    the prefill in every row: prefill = chunk = decode for every position;
  - the experiment library's product binaries give the engine's bits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import sys
from pathlib import Path

import torch

from benchmarks import cuda_runs, experiment_lib
from benchmarks.inputs import rel_err

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_v2_sm90.cu"
# The v2 consumer's code (decode_v2_sm90.cu: 4 + 8 * (kPipe | kV2)) and its residency (two CTAs per SM).
_PIPE = 1 | 8 | 16 | 64  # the product's kPipe: kPairedV | kEvictFirst | kMmaSync | kMmaPipe
V2_CODE = 4 + 8 * (_PIPE | 512)
V2 = "v2"


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    lib = experiment_lib.load(SOURCE, "dhp_decode_v2")
    # The product entry's signature (dhp_backend.ops.cuda_decode._entry).
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.dhp_decode_v2_sm90.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32,
                                       i32, i32, i32, i32, ctypes.c_float, i32, i32, i32, p, p, p, i32, i32, p,
                                       i32, p, i32, p]
    lib.dhp_decode_v2_sm90.restype = i32
    return lib


@contextlib.contextmanager
def experiment_entry():
    """The product launcher with the experiment library's entry, and variant ``v2`` known to it."""
    from dhp_backend.ops import cuda_decode as cd

    saved_entry, saved_variants, saved_ct = cd._entry, dict(cd.VARIANTS), cd.CT_VARIANTS
    cd._entry = lambda: library().dhp_decode_v2_sm90
    cd.VARIANTS[V2] = (V2_CODE, 2)
    cd.CT_VARIANTS = (*saved_ct, V2)  # the launcher adds the walk's options to the code
    try:
        yield cd
    finally:
        cd._entry = saved_entry
        cd.CT_VARIANTS = saved_ct
        cd.VARIANTS.clear()
        cd.VARIANTS.update(saved_variants)


def exp_fn(st, variant: str = V2, mode=None, spp=None, bucket=None):
    """A closure launching ``variant`` (``v2`` or a product variant) of the experiment library on
    decode step ``st`` (benchmarks.cuda_prefill.make_step) into its own output; policy off, or with
    ``bucket`` (an int, or int32 per-request buckets) the constant-time walk to it."""
    from benchmarks.cuda_prefill import SCALE

    out = torch.full_like(st["q"], float("nan"))
    args = (st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out)
    kw = dict(scale=SCALE, causal=True, variant=variant, mode=mode, spp=spp, bucket=bucket)
    with experiment_entry() as cd:
        cd.decode_sm90(*args, **kw)  # the metadata checked once

    def run():
        with experiment_entry() as cd:
            return cd.decode_sm90(*args, **kw, check=False)
    return run


def prefill_fn(st, variant: str, bucket=None):
    """The v2 prefill of step ``st`` through the product launcher (benchmarks.contract_v2.product_launcher):
    ``v2`` under policy off, ``v2_ct`` on the constant-time walk to ``bucket``."""
    from benchmarks.cuda_prefill import SCALE
    from benchmarks import contract_v2

    out = torch.full_like(st["q"], float("nan"))
    with contract_v2.product_launcher() as cpf:
        cpf.prefill_sm90(st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out, scale=SCALE,
                         causal=True, variant=variant, bucket=bucket)
    return out


def decode_of_prefill(st):
    """The decode step of each request's last query row on the same cache and table."""
    last = (st["qsl"][1:] - 1).long()
    B = last.shape[0]
    return dict(st, q=st["q"][last].contiguous(), qsl=torch.arange(B + 1, dtype=torch.int32, device=st["q"].device),
                reqs=[(1, s) for _, s in st["reqs"]], max_q=1), last


def probe() -> bool:
    from benchmarks import contract_v2
    from benchmarks import cuda_prefill as cp
    from benchmarks.cuda_decode import PROBE_BUCKET, cuda_fn

    gen = torch.Generator(device="cuda").manual_seed(1)
    errs, same_prefill, same_product = {}, {}, {}
    for heads in ("32,8", "28,4"):
        cp.H, cp.HKV = (int(x) for x in heads.split(","))
        # lengths: inside one step, a stage past the end, a split's edge, several splits, a page tail
        for lens in ((1, 64, 65), (127, 128, 129, 200), (511, 512, 513), (1000, 2100, 77), (5000, 4099)):
            # every request owns its pages up to PROBE_BUCKET: the constant-time walk reads them
            pre = cp.make_step([(s, s) for s in lens], gen, width=PROBE_BUCKET // cp.BS, reserve=PROBE_BUCKET)
            v2_prefill = contract_v2.v2_fn(pre, True, "v2fma_fold512")()
            per_req = torch.full((len(lens),), PROBE_BUCKET, dtype=torch.int32, device=pre["q"].device)
            # the producer spread over four warps and the packed GQA tile: the same bits
            for variant in ("v2fma_fold512_spread", "v2fma_fold512_spread_packed"):
                o = contract_v2.v2_fn(pre, True, variant)()
                torch.cuda.synchronize()
                same_prefill[f"{heads} {lens} prefill {variant}"] = bool(torch.equal(o.view(torch.int16),
                                                                                     v2_prefill.view(torch.int16)))
            # the v2 prefill through the product launcher, and on the constant-time walks: the same bits
            pre_ref = cp.sdpa_ref(pre, True)
            for name, variant, bucket in (("prefill", "v2", None), ("prefill/ct", "v2_ct", PROBE_BUCKET),
                                          ("prefill/ct-per-request", "v2_ct", per_req)):
                o = prefill_fn(pre, variant, bucket)
                torch.cuda.synchronize()
                key = f"{heads} {lens} {name}"
                errs[key] = rel_err(o, pre_ref)
                same_prefill[key] = bool(torch.equal(o.view(torch.int16), v2_prefill.view(torch.int16)))
            # every row of the prefill step as a row of the decode kernel (token tiles, each token its own
            # CTA row with its causal limit): prefill = chunk = decode for every position, not the last only
            # split mode's workspace holds every row's partials of every split of the table's width
            # (geometry's SPLIT_FLOATS caps it): a step of many tokens runs in the mode the product's
            # geometry picks for it (None), as the engine would run it
            for mode, bucket in ((None, None), ("fold", None), (None, PROBE_BUCKET)):
                o = exp_fn(pre, V2, mode, None, bucket)()
                torch.cuda.synchronize()
                key = f"{heads} {lens} every row via decode/{mode or 'auto'}{'/ct' if bucket else ''}"
                same_prefill[key] = bool(torch.equal(o.view(torch.int16), v2_prefill.view(torch.int16)))
            st, last = decode_of_prefill(pre)
            ref = cp.sdpa_ref(st, True)
            want = v2_prefill[last]
            runs = [(mode, spp, None) for mode, spp in (("split", None), ("fold", None), ("split", 1), ("split", 3))]
            # the constant-time walks (one bucket, per-request buckets): the same bits (policy invariance)
            runs += [(mode, None, b) for mode in ("split", "fold") for b in (PROBE_BUCKET, per_req)]
            for mode, spp, bucket in runs:
                o = exp_fn(st, V2, mode, spp, bucket)()
                torch.cuda.synchronize()
                ct = "" if bucket is None else ("/ct" if isinstance(bucket, int) else "/ct-per-request")
                key = f"{heads} {lens} v2/{mode}{f'/spp{spp}' if spp else ''}{ct}"
                errs[key] = rel_err(o, ref)
                same_prefill[key] = bool(torch.equal(o.view(torch.int16), want.view(torch.int16)))
            for mode in ("split", "fold"):  # the experiment library's product binary == the engine's
                mine = exp_fn(st, "p2x2_pv_ef", mode)()
                theirs = cuda_fn(st, "p2x2_pv_ef", mode)()
                torch.cuda.synchronize()
                same_product[f"{heads} {lens} {mode}"] = bool(torch.equal(mine.view(torch.int16),
                                                                          theirs.view(torch.int16)))
    cp.H, cp.HKV = 32, 8
    ok = all(e < 2e-2 for e in errs.values()) and all(same_prefill.values()) and all(same_product.values())
    print(f"probe: {'OK' if ok else 'WRONG'} errs " + json.dumps({k: round(v, 5) for k, v in errs.items()}) +
          " bits==v2 prefill " + json.dumps(same_prefill) + " product bits " + json.dumps(same_product), flush=True)
    return ok


def _rule(name: str, pattern: str, reason: str):
    from dhp_backend.audit import cuda_rules as CR
    return CR.CudaRule(name, SOURCE.name, pattern, CR.PUBLIC, reason)


def experiment_rules() -> tuple:
    """G2 rules for the branches of decode_v2_sm90.cu's own lines (the lines it includes from
    csrc/decode_sm90.cu keep the product's rules): each says why its condition is public."""
    return (
        _rule("v2-role", r"^(\} else )?if \((threadIdx\.x (==|>=) \d+|warp < 2|lane == 0|lane % 4 == 0|"
                         r"ws == 0 && lane % 4 == 0( && last_split\(w, sp\))?)\)( \{)?(\s+//.*)?$",
              "warp-specialised roles by thread index (barrier init, producer, S / PV pairs, the lanes that write "
              "a row's values); last_split: the split index of the bucket's walk"),
        _rule("v2-split-loop", r"^for \(int sp = w\.s_lo; sp < w\.s_end; sp \+= w\.s_stride\) \{$",
              "the CTA's splits: CTA index, the host's plan and the public bucket"),
        _rule("v2-step-loop", r"^for \(int j = split_first\(sp\); j < je; j \+= 2, k \+= 2\) \{$",
              "a split's 128-position steps below the bucket's step count"),
        _rule("v2-ring-reuse", r"^if \(u >= 2\) mbar_wait\(", "the P ring's second round on: step index only"),
        _rule("v2-split-end", r"^if \(j \+ 2 == je\) \{", "a split's last step: step index of the bucket's walk"),
        _rule("v2-cta-end", r"^if \((k \+ 2 == n_steps|n_steps == 0)\) store_out_rows\(",
              "the CTA's output after its last step: the bucket's step count"),
        _rule("v2-inv", r"^if \(!WRITE_PARTIALS && k \+ 2 == n_steps\) \{", "the CTA's last step"),
        _rule("v2-rows", r"^if \((ws != 0 \|\| lane % 4 != 0 \|\| !\(h == 0 \? ok_lo : ok_hi\)|"
                         r"h == 0 \? !ok_lo : !ok_hi)\) continue;$",
              "the tile rows that are query heads of the group, by the lanes that write them: thread index, GROUP"),
        _rule("v2-group-rows", r"^if \(ok_(lo|hi)\) store_out_half<", "query heads of the group: GROUP"),
    )


def _prefill_rule(name: str, pattern: str, reason: str):
    from dhp_backend.audit import cuda_rules as CR
    return CR.CudaRule(name, "prefill_v2_sm90.cu", pattern, CR.PUBLIC, reason)


def prefill_rules() -> tuple:
    """G2 rules for the branches of prefill_v2_sm90.cu's constant-time consumer and kernel (the lines it
    includes from csrc/prefill_sm90.cu keep the product's rules)."""
    return (
        _prefill_rule("v2p-role", r"^(\} else )?if \((threadIdx\.x (==|<|>=) [^)]*|lane == 0)\)( \{)?", 
                      "warp-specialised roles by thread index: barrier init, producer warpgroup (Q rows, the TMA "
                      "thread, the V cleaners), consumers, the lane that releases a stage"),
        _prefill_rule("v2p-step-loop", r"^for \(int t = 0; t < w\.n_steps; \+\+t\) \{$",
                      "ceil(L / 128) KV steps of the public bucket L"),
        _prefill_rule("v2p-split-end", r"^if \(\(t \+ 1\) % kStepsPerSplit == 0 \|\| t \+ 1 == w\.n_steps\) \{",
                      "a split's end: the step index and the bucket's step count"),
        _prefill_rule("v2p-init", r"^for \(int i = 0; i < STAGES; \+\+i\) mbar_init\(", "a constant trip count"),
    )


# The experiment's kernels G2 audits: (source, kernel name in the cubin, the walk of a template instance
# from its arguments: 0 policy off (the control), 1 one bucket (gating), 2 per-request buckets (reported)).
def _decode_walk(args, CR) -> int:
    opt = args[-1]
    return (2 if opt & CR.DECODE_BUCKET_PER_REQ else 1) if opt & CR.DECODE_CONST_TIME else 0


def _prefill_walk(args, CR) -> int:
    return 1 + args[1]  # prefill_v2_ct_kernel<BF16, LMODE>


G2_TARGETS = ((SOURCE, "decode_v2_kernel", _decode_walk),
              (SOURCE.parent / "prefill_v2_sm90.cu", "prefill_v2_ct_kernel", _prefill_walk),
              # the control: the v2 off consumer with folds every 512 (code 39), audited as if it gated
              (SOURCE.parent / "prefill_v2_sm90.cu", "prefill_v2_kernelILb1ELi2ELi512ELb1ELb0ELi0E", lambda a, c: 0))


def g2(progress=print) -> bool:
    """The csrc G2 gate (dhp_backend.audit.cuda_gate) on the experiment's constant-time binaries, built
    offline (nvcc, no GPU): one bucket gates, per-request buckets are reported with their documented
    label, as the product's kernels; the product's rules plus `experiment_rules` and `prefill_rules`. The
    off binaries are the control: audited as gating, they must fail on a condition that carries a loaded
    value (their walk follows the loaded lengths)."""
    import re
    import subprocess
    import tempfile

    from dhp_backend.audit import cuda_gate
    from dhp_backend.audit import cuda_rules as CR
    from dhp_backend.audit import sass
    from dhp_backend.ops import cuda_build as cb

    nvcc = cb.find_nvcc()
    if nvcc is None:
        progress("g2: nvcc not found")
        return False
    built = {}
    for source in dict.fromkeys(t[0] for t in G2_TARGETS):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / (source.stem + ".cubin")
            res = subprocess.run([nvcc, *cb.CUBIN_FLAGS, "-cubin", *cb.SM90A, "-I", str(cb.csrc_dir()), "-o",
                                  str(out), str(source)], capture_output=True, text=True)
            if res.returncode != 0:
                progress(f"g2: nvcc failed on {source.name}: {(res.stderr or res.stdout)[-2000:]}")
                return False
            cubin = out.read_bytes()
        built[source] = (sass.disassemble(cubin), cuda_gate.embedded_ptx(cubin))
    saved = CR.RULES
    CR.RULES = saved + experiment_rules() + prefill_rules()
    ok, counts = True, {0: 0, 1: 0, 2: 0}
    try:
        for source, kernel, walk_of in G2_TARGETS:
            funcs, ptx_all = built[source]
            for name in sorted(funcs):
                if kernel not in name:
                    continue
                short = kernel.split("ILb", 1)[0]
                tail = name.split(short, 1)[1]
                args = tuple(int(m[2:-1]) for m in re.findall(r"(Lb[01]E|Li-?\d+E)", tail.split("EEv", 1)[0] + "E"))
                walk = walk_of(args, CR)
                inst = CR.Instance(short, args, walk != 2, frozenset({"mem"}) if walk == 2 else frozenset(),
                                   ["control: policy off audited as gating", "v2 constant-time walk, one bucket",
                                    "v2 constant-time walk, per-request buckets"][walk])
                r = cuda_gate.audit_function(name, funcs, ptx_all, inst, source_dirs=(str(SOURCE.parent),))
                counts[walk] += 1
                verdict = "PASS" if r["passed"] else f"FAIL ({len(r['failures'])})"
                role = "control" if walk == 0 else ("gating" if inst.gating else "reported")
                progress(f"g2: {short}{list(args)} {role}: {r['n_control']} control instructions "
                         f"{r['by_rule']}, guarded {r['guarded_data_ops']} -> {verdict}"
                         + (" (detected, as it must)" if walk == 0 and not r["passed"] else ""))
                for f in r["failures"][:3 if walk == 0 else 12]:
                    progress(f"    #{f['index']} {f['instr']} at {f['source']} '{f['source_text']}': {f['why']}")
                if walk == 0:  # detected: some branch's condition carries a loaded value (the lengths)
                    ok &= any("mem:" in f["why"] for f in r["failures"])
                else:
                    ok &= r["passed"] or not inst.gating
    finally:
        CR.RULES = saved
    progress(f"g2: {counts[1]} gating, {counts[2]} reported, {counts[0]} controls -> {'PASS' if ok else 'FAIL'}")
    return ok and all(counts.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", action="store_true", help="check the v2 decode on the GPU (exit 1 if wrong); the default")
    ap.add_argument("--g2", action="store_true",
                    help="instead: the csrc SASS gate on the experiment's constant-time binaries (nvcc, no GPU)")
    args = ap.parse_args(argv)
    if args.g2:
        return 0 if g2() else 1
    return cuda_runs.probe_first(ap, probe, "decode (contract v2)", True)


if __name__ == "__main__":
    sys.exit(main())
