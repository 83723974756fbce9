"""Decision run (a) of issue 30's arithmetic contract (docs/perf-notes.md, "Next: a prefill-shaped
arithmetic contract"): the csrc prefill consumer with 128-position steps, per-lane row sums and folds
every 512 / 1024 positions or none, against today's contract (``compat``), the FA3-like consumer
(``plain``, other bits) and FA3 itself, same tensors, same run.

    python -m benchmarks.contract_v2 [--probe] [--out DIR] [--shapes ...] [--heads 32,8;28,4] [--rounds 2]
    python -m benchmarks.contract_v2 --report RUN.json [RUN.json ...] --out docs/bench   # no GPU

``--report`` merges runs (a later run's row replaces an earlier one's of the same shape, heads and variant;
every ratio stays within its own run) into ``contract-v2-h200.md`` / ``.json`` / ``.png`` under ``--out``.

An EXPERIMENT, outside the package: its kernels (``benchmarks/csrc/prefill_v2_sm90.cu``, which includes
``csrc/prefill_sm90.cu`` unchanged and adds the v2 consumer) are built into a library of their own with the
engine's nvcc flags; the engine's library never holds them. bf16, head 128, block 16, policy ``off``
semantics (true lengths). Every binary is checked against SDPA before it is timed (``--probe``: small
shapes only, exit 1 when wrong). The ``compat`` row is the routed binary built by the same nvcc in the same
library, so the csrc rows compare like with like. ``--rounds 2`` times every variant twice, the second
round in reverse order, and reports the median of the two medians with both (drift shows as their spread).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import cuda_prefill as cp
from benchmarks import cuda_runs, experiment_lib
from benchmarks.inputs import rel_err

SOURCE = Path(__file__).resolve().parent / "csrc" / "prefill_v2_sm90.cu"
# name -> code of the experiment library's entry (prefill_v2_sm90.cu)
VARIANTS = {"compat": 33, "plain": 38, "v2_fold512": 35, "v2_fold1024": 36, "v2_nofold": 37,
            "v2fma_fold512": 39, "v2fma_fold1024": 40, "v2fma_nofold": 41,
            "v2fma_fold512_spread": 42, "v2fma_nofold_spread": 43, "plain_spread": 44,
            "v2fma_fold512_s3": 45, "v2fma_nofold_s3": 46, "compat_spread": 47,
            "plain_spread_overlap": 48, "plain_spread_pingpong": 49, "plain_spread_overlap_pingpong": 50,
            "v2fma_fold512_spread_packed": 52,
            # the same arithmetic, running state in shared memory, FA3's schedules (consume_v2_sched)
            "v2s_spread": 53, "v2s_spread_overlap": 54, "v2s_spread_pingpong": 55,
            "v2s_spread_overlap_pingpong": 56, "v2s_spread_overlap_packed": 57,
            "v2s_spread_overlap_pingpong_packed": 58}
# the variants whose rows must carry v2fma_fold512's bits (the contract: producer, tile packing,
# stage count, where the running state lives and the warpgroups' schedule do not change a row)
SAME_BITS_AS_V2 = ("v2fma_fold512_spread", "v2fma_fold512_s3", "v2fma_fold512_spread_packed", "v2s_spread",
                   "v2s_spread_overlap", "v2s_spread_pingpong", "v2s_spread_overlap_pingpong",
                   "v2s_spread_overlap_packed", "v2s_spread_overlap_pingpong_packed")
DEFAULT_SHAPES = "causal-4k,causal-8k,causal-16k,batch4-4000,chunk2k+63dec"
DEFAULT_HEADS = "32,8;28,4"  # Llama-3-8B (GQA 4) and Qwen2.5-7B (GQA 7: 8 tile slots, one unused)
QWEN_SHAPES = "causal-8k,batch2-8k"  # the shapes timed at heads other than the first


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """Build (once per source/flags/nvcc, cached under the engine's build cache) and load the library."""
    lib = experiment_lib.load(SOURCE, "dhp_prefill_v2")
    i64, i32, p, u32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint
    lib.dhp_prefill_v2_sm90.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32,
                                        i32, i32, i32, i32, ctypes.c_float, i32, i32, u32, u32, p]
    lib.dhp_prefill_v2_sm90.restype = i32
    # the full entry: the product entry's arguments (dhp_backend.ops.cuda_prefill._entry)
    lib.dhp_prefill_v2p_sm90.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32,
                                         i32, i32, i32, i32, ctypes.c_float, i32, i32, i32, u32, u32,
                                         i32, i32, p, i32, i32, u32, p, p]
    lib.dhp_prefill_v2p_sm90.restype = i32
    return lib


# Codes of the full entry that the product launcher (ops.cuda_prefill.prefill_sm90) drives under
# `product_launcher`: the v2 consumer with folds every 512 under policy off, and on the
# constant-time walk (takes a bucket).
LAUNCHER_CODES = {"v2": 39}
LAUNCHER_CT_CODES = {"v2_ct": 51}


@contextlib.contextmanager
def product_launcher():
    """ops.cuda_prefill.prefill_sm90 with this library's full entry in place of the engine's, and the
    variants `LAUNCHER_CODES` / `LAUNCHER_CT_CODES` known to it: its checks, bucket handling and sink
    workspace, with the experiment's kernels."""
    from dhp_backend.ops import cuda_prefill as cpf

    saved = (cpf._entry, dict(cpf._CODES), dict(cpf._CT_CODES), dict(cpf._ALL_CODES))
    cpf._entry = lambda: library().dhp_prefill_v2p_sm90
    cpf._CODES.update(LAUNCHER_CODES)
    cpf._CT_CODES.update(LAUNCHER_CT_CODES)
    cpf._ALL_CODES.update(LAUNCHER_CODES, **LAUNCHER_CT_CODES)
    try:
        yield cpf
    finally:
        cpf._entry = saved[0]
        for live, old in zip((cpf._CODES, cpf._CT_CODES, cpf._ALL_CODES), saved[1:]):
            live.clear()
            live.update(old)


def v2_fn(st, causal: bool, variant: str):
    """A closure launching ``variant`` on step ``st`` (benchmarks.cuda_prefill.make_step) into its own output."""
    from dhp_backend.ops.cuda_common import launch_error
    from dhp_backend.ops.cuda_prefill import V_DESC, validate

    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    if st["q"].dtype != torch.bfloat16:
        raise ValueError(f"dtype {st['q'].dtype}; accepted: torch.bfloat16 (the experiment builds bf16 binaries only)")
    q, kc, vc = st["q"], st["kc"], st["vc"]
    out = torch.full_like(q, float("nan"))
    T = q.shape[0]
    validate(q, kc, vc, st["table"], st["qsl"], st["sl"], out, T)
    fn = library().dhp_prefill_v2_sm90
    args = (q.data_ptr(), q.stride(0), q.stride(1), kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1),
            kc.stride(2), kc.shape[0], out.data_ptr(), out.stride(0), out.stride(1), st["table"].data_ptr(),
            st["table"].stride(0), st["sl"].data_ptr(), st["qsl"].data_ptr(), st["sl"].shape[0], T, T, q.shape[1],
            kc.shape[1], kc.shape[2], float(cp.SCALE) * math.log2(math.e), int(causal), VARIANTS[variant],
            V_DESC[0], V_DESC[1])

    def run():
        rc = fn(*args, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"contract_v2 {variant}: launch failed: {launch_error(rc)}")
        return out
    return run


def commit() -> str | None:
    """The tree's commit: $DHP_COMMIT, else the .dhp-commit a device call carries (scripts/device_run.sh)."""
    if os.environ.get("DHP_COMMIT"):
        return os.environ["DHP_COMMIT"]
    f = Path(".dhp-commit")
    return f.read_text().strip() if f.is_file() else None


# What each variant is, for the report (docs/perf-notes.md: the contract's items).
ABOUT = {
    "fa3": "FlashAttention-3 (vllm_flash_attn, fa_version 3), the anchor",
    "compat": "today's contract (the routed binary): 64-position steps, row sums by quad shuffles each step, "
              "s * scale then s - m, folds every 512",
    "plain": "FA3-like arithmetic (other bits): 128-position steps, per-thread sums, one fma exponent, no splits",
    "v2_fold512": "128-position steps + per-lane row sums, compat's exponent form, folds every 512",
    "v2_fold1024": "the same, folds every 1024",
    "v2_nofold": "the same, no splits",
    "v2fma_fold512": "128-position steps + per-lane sums + FA3's exponent form (one fma), folds every 512",
    "v2fma_fold1024": "the same, folds every 1024",
    "v2fma_nofold": "the same, no splits",
    "v2fma_fold512_spread": "v2fma_fold512 with the producer spread over four warps",
    "v2fma_nofold_spread": "v2fma_nofold with the producer spread over four warps",
    "plain_spread": "plain with the producer spread over four warps",
    "compat_spread": "today's contract (the same bits) with the producer spread over four warps",
    "v2fma_fold512_s3": "v2fma_fold512 on three stages",
    "v2fma_nofold_s3": "v2fma_nofold on three stages",
    "plain_spread_overlap": "plain_spread with FA3's intra-warpgroup overlap (softmax of step t+1 under the PV of t)",
    "plain_spread_pingpong": "plain_spread with FA3's pingpong (the two consumer warpgroups take turns at the tensor cores)",
    "plain_spread_overlap_pingpong": "plain_spread with both",
    "v2fma_fold512_spread_packed": "v2fma_fold512_spread with packed GQA rows (GQA 7: 18 tokens x 7 heads a tile, "
                                   "not 16 x 8 slots; the same bits)",
}
PALETTE = [(120, 120, 120), (214, 39, 40), (31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (23, 190, 207), (188, 189, 34), (90, 90, 200), (0, 0, 0),
           (255, 187, 120), (152, 223, 138), (174, 199, 232), (197, 176, 213)]


def report(paths, out_dir: str, stem: str = "contract-v2-h200") -> list[str]:
    """Merge runs into <stem>.json / .md / .png; returns the markdown's table lines."""
    from dhp_backend.audit import png

    runs, cells = [], {}
    for i, path in enumerate(paths):
        with open(path) as fh:
            run = json.load(fh)
        runs.append({k: run.get(k) for k in ("device", "torch", "commit", "command")} | {"rows": run["rows"]})
        for r in run["rows"]:
            if r.get("us"):
                cells[(r["heads"], r["shape"], r["variant"])] = dict(r, run=i)
    cols = list(dict.fromkeys((h, s) for h, s, _ in cells))
    variants = [v for v in ABOUT if any(k[2] == v for k in cells)]
    lines = ["| variant | " + " | ".join(f"{s} ({h})" for h, s in cols) + " | run |",
             "|---|" + "---:|" * len(cols) + "---|"]
    for v in variants:
        cs = [cells.get((h, s, v)) for h, s in cols]
        fmt = [f"{c['fa3_over']:.3f} ({c['compat_over']:.2f})" if c and c.get("fa3_over") and c.get("compat_over")
               else (f"{c['us']:.0f} us" if c else "-") for c in cs]
        used = sorted({c["run"] + 1 for c in cs if c})
        lines.append(f"| {v} | " + " | ".join(fmt) + f" | {','.join(map(str, used))} |")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json"), "w") as fh:
        json.dump({"about": ABOUT, "runs": runs}, fh, indent=1)
    dev = sorted({r["device"] for r in runs})
    md = [f"# Issue 30, decision run (a): the prefill arithmetic contract ({', '.join(dev)})", "",
          "`python -m benchmarks.contract_v2` (the experiment's library: `benchmarks/csrc/prefill_v2_sm90.cu`; "
          "`csrc/prefill_sm90.cu` unchanged). bf16, head 128, block 16, policy `off` semantics, CUDA events, two "
          "input sets alternating, median of the rounds' medians. Cell: **time ratio vs FA3** (> 1: faster than "
          "FA3), in brackets **vs compat** (today's routed binary), both from the same run. Every binary was "
          "checked against SDPA before it was timed (rel. err. <= 0.0025).", "",
          "Runs: " + "; ".join(f"{i + 1}: commit {r['commit']}, `{(r['command'] or '').split('contract_v2.py')[-1].strip()}`"
                               for i, r in enumerate(runs)), "", *lines, "", "Variants:", ""]
    md += [f"- `{v}`: {ABOUT[v]}" for v in variants]
    with open(os.path.join(out_dir, stem + ".md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    # Grouped bars: x FA3 per shape, one bar per variant; a dashed line at 1.0 (FA3).
    w, h = 1100, 460
    c = png.Canvas(w, h)
    left, right, top, bottom = 60, w - 250, 40, h - 60
    c.text(left, 10, "PREFILL X FA3 (TIME RATIO) PER SHAPE, " + ", ".join(dev))
    top_v = 1.1
    y = lambda v: bottom - (v / top_v) * (bottom - top)  # noqa: E731
    c.line(left, bottom, right, bottom, png.BLACK)
    c.line(left, top, left, bottom, png.BLACK)
    for tick in (0.25, 0.5, 0.75, 1.0):
        c.line(left, y(tick), right, y(tick), png.GREY if tick < 1 else png.RED, dash=0 if tick < 1 else 6)
        c.text(8, int(y(tick)) - 5, f"{tick:.2f}")
    group = (right - left) / max(1, len(cols))
    bar = max(2, int((group - 10) / max(1, len(variants))))
    for gi, (hd, sh) in enumerate(cols):
        x0 = left + 5 + gi * group
        for vi, v in enumerate(variants):
            cell = cells.get((hd, sh, v))
            if cell and cell.get("fa3_over"):
                c.rect(int(x0 + vi * bar), int(y(min(cell["fa3_over"], top_v))), int(x0 + (vi + 1) * bar - 2),
                       bottom - 1, PALETTE[vi % len(PALETTE)])
        c.text(int(x0), bottom + 8, sh[:14])
        c.text(int(x0), bottom + 22, hd)
    for vi, v in enumerate(variants):
        c.rect(right + 15, top + vi * 18, right + 27, top + vi * 18 + 10, PALETTE[vi % len(PALETTE)])
        c.text(right + 33, top + vi * 18, v[:26])
    c.write(os.path.join(out_dir, stem + ".png"))
    return lines


def probe() -> bool:
    """Every binary right on small shapes (not hung), at both head configurations' GQA."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    errs, differ = {}, []
    for heads in ("32,8", "28,4"):
        cp.H, cp.HKV = (int(x) for x in heads.split(","))
        for reqs, causal in (([(200, 200)], True), ([(128, 128)], False), ([(100, 1300), (77, 77)], True),
                             ([(700, 2100)], True), ([(1, 513), (130, 1100), (511, 1535)], True)):
            st = cp.make_step(reqs, gen)
            ref = cp.sdpa_ref(st, causal)
            outs = {}
            for name in VARIANTS:
                outs[name] = v2_fn(st, causal, name)()
                torch.cuda.synchronize()
                errs[f"{heads} {reqs} causal={causal} {name}"] = rel_err(outs[name][: ref.shape[0]], ref)
            want = outs["v2fma_fold512"].view(torch.int16)
            differ += [f"{heads} {reqs} causal={causal} {name}" for name in SAME_BITS_AS_V2
                       if name in outs and not torch.equal(outs[name].view(torch.int16), want)]
    ok = all(e < 2e-2 for e in errs.values()) and not differ
    print(f"probe: {'OK' if ok else 'WRONG'} bits differ from v2fma_fold512: {differ} " +
          json.dumps({k: round(v, 5) for k, v in errs.items()}), flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"at the first --heads (default {DEFAULT_SHAPES})")
    ap.add_argument("--heads", default=DEFAULT_HEADS,
                    help=f"';'-separated 'H,HKV' configurations (default {DEFAULT_HEADS}); the ones after the "
                         f"first run --other-shapes")
    ap.add_argument("--other-shapes", default=QWEN_SHAPES)
    ap.add_argument("--variants", default="fa3," + ",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", nargs="+", default=None, metavar="RUN.json",
                    help="merge these runs' contract_v2.json into --out (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        if not args.out:
            ap.error("--report needs --out DIR")
        print("\n".join(report(args.report, args.out)))
        return 0
    names = args.variants.split(",")
    bad = [n for n in names if n != "fa3" and n not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; accepted: fa3, {', '.join(VARIANTS)}")
    stop = cuda_runs.probe_first(ap, probe, "prefill (contract v2)", args.probe)
    if stop is not None:
        return stop

    from benchmarks.timer import CudaTimer
    timer = CudaTimer(reps=args.reps, warmup=3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    plan = []
    for i, heads in enumerate(args.heads.split(";")):
        for shape in (args.shapes if i == 0 else args.other_shapes).split(","):
            if shape not in cp.SHAPES:
                ap.error(f"unknown shape {shape!r}; known: {', '.join(cp.SHAPES)}")
            plan.append((heads, shape))
    rows, t0 = [], time.time()
    for k, (heads, shape) in enumerate(plan):
        cp.H, cp.HKV = (int(x) for x in heads.split(","))
        reqs, causal = cp.SHAPES[shape]
        flop = cp.useful_flop(reqs, causal)
        sets = [cp.make_step(reqs, gen) for _ in range(2)]
        ref = cp.sdpa_ref(sets[0], causal)
        fns, shape_rows, outs = {}, [], {}
        for name in names:
            row = dict(shape=shape, heads=heads, variant=name, causal=causal, us=None, tflops=None, rel_err=None,
                       rounds_us=[])
            try:
                fs = [cp.fa3_fn(s, causal) for s in sets] if name == "fa3" else [v2_fn(s, causal, name) for s in sets]
                o = cuda_runs.check_and_time(row, fs, ref, lambda f: timer.measure(f).median_ms,
                                             rows_checked=ref.shape[0])
                if o is not None:
                    fns[name], outs[name] = fs, o
                    row["rounds_us"].append(row["us"])
            except Exception as e:  # noqa: BLE001 - a failing variant is a finding, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            shape_rows.append(row)
        for _ in range(1, args.rounds):  # later rounds in reverse order: drift shows as spread
            for row in reversed(shape_rows):
                if row["variant"] in fns:
                    row["rounds_us"].append(timer.measure(fns[row["variant"]]).median_ms * 1e3)
        for row in shape_rows:
            if row["rounds_us"]:
                row["us"] = sorted(row["rounds_us"])[len(row["rounds_us"]) // 2] if len(row["rounds_us"]) % 2 else \
                    sum(row["rounds_us"]) / len(row["rounds_us"])
                row["tflops"] = flop / row["us"] / 1e6
        cuda_runs.fa3_ratios(shape_rows)
        base = next((r["us"] for r in shape_rows if r["variant"] == "compat" and r["us"]), None)
        for r in shape_rows:
            r["compat_over"] = base / r["us"] if base and r["us"] else None
            if r["variant"] in outs and "compat" in outs and r["variant"] != "compat":
                r["max_abs_vs_compat"] = float((outs[r["variant"]].float() - outs["compat"].float()).abs().max())
                r["bits_equal_compat"] = bool(torch.equal(outs[r["variant"]].view(torch.int16),
                                                          outs["compat"].view(torch.int16)))
        cuda_runs.print_progress(k, len(plan), t0, f"{shape} @{heads}", shape_rows)
        rows += shape_rows
    print(f"\n{'shape':16s} {'heads':6s} {'variant':12s} {'us':>9s} {'TFLOP/s':>8s} {'x FA3':>6s} {'x compat':>8s} "
          f"{'rel err':>8s} rounds")
    for r in rows:
        f = lambda x, w, d: f"{x:{w}.{d}f}" if x is not None else " " * (w - 1) + "-"  # noqa: E731
        print(f"{r['shape']:16s} {r['heads']:6s} {r['variant']:12s} {f(r['us'], 9, 1)} {f(r['tflops'], 8, 1)} "
              f"{f(r['fa3_over'], 6, 3)} {f(r['compat_over'], 8, 3)} {f(r['rel_err'], 8, 5)} "
              f"{[round(x, 1) for x in r['rounds_us']]} {'bits=compat' if r.get('bits_equal_compat') else ''} "
              f"{r.get('error', '')}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "contract_v2.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           commit=commit(), command=" ".join(sys.argv), rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
