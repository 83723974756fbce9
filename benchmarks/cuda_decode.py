"""The csrc Hopper decode kernel against FA3 and DHP's Triton kernel, same tensors, same run.

    python -m benchmarks.cuda_decode [--out DIR] [--probe] [--shapes B1-32k,...] [--variants ...]

``--probe`` runs every variant in both split modes (and the CT binaries on
their walk) on small steps and exits non-zero unless all are right and bit-equal
to each other (the csrc binaries' promise: mode, schedule, splits per CTA and
policy never change a row's bits): the first thing a device call runs (in a
subprocess with a timeout, so a hung kernel costs seconds).

Llama-3-8B heads (32 query, 8 KV, d 128), block 16, bf16, one query token per
request, NaN in every cache slot no request holds data in, a random block table
(the steps of `benchmarks.cuda_prefill`). Every variant is checked against SDPA
before it is timed; timing is CUDA-graph replay (decode launches are
microseconds), two input sets alternating. Bandwidth counts the K/V bytes of the
true lengths (FA3's and ours alike). ``fa3``, ``triton_off`` and ``triton_strict``
are timing anchors.

``--bucket L`` adds the constant-time walk to L (policy strict): rows
``triton_strict`` (DHP's Triton CONST_TIME kernel) and ``cuda_ct_<variant>`` (the
csrc CT binaries, `CT_VARIANTS`), on shapes whose requests own their pages up to L
(the address rule: each reads its L / 16 reserved pages, so the cache holds B x L
positions); their ``exec_tb_s`` counts the K/V bytes walked (every request to L),
and ``exec_fa3_over`` = exec_tb_s / FA3's tb_s is the strict-efficiency ratio.

Bits, each family against itself (the csrc kernels and the Triton kernels have
arithmetics of their own, docs/kernels.md section 7): every csrc row against the
shape's first policy-off csrc row (``bits_equal_off``, with ``bits_vs`` naming it:
the CT rows' policy invariance, and variants, schedules and splits per CTA giving
the same bits), that row against the csrc prefill kernel (`ops.cuda_prefill`, the
``v2`` binary) on the same step (``bits_equal_prefill``: decode = prefill), and
``triton_strict`` against ``triton_off``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import time

import torch

from benchmarks import cuda_runs
from benchmarks import cuda_prefill as cp  # its head counts and size (cp.H, cp.HKV, cp.D, cp.SCALE): --heads
from benchmarks.cuda_prefill import BS, fa3_fn, make_step, sdpa_ref, triton_off_fn
from benchmarks.inputs import rel_err
from dhp_backend.ops.cuda_decode import AUTO, CT_VARIANTS, VARIANTS
from dhp_backend.ops.cuda_prefill import V2 as PREFILL_V2


def _shape(name: str) -> tuple[int, int, list[tuple[int, int]]]:
    """``B<batch>-<ctx>k``: every request at ctx; ``B<batch>-r<ctx>k``: lengths uniform
    in [ctx / 8, ctx], seeded (vLLM's decode batches: requests of many lengths). A
    suffix ``-w<cap>k`` (`_table_width`) sets the block table's width; ``-q<n>`` gives every
    request n query tokens (a step between decode and prefill: drafts, small chunks; the
    decode kernel computes each token as its own row with its causal limit)."""
    parts = name.split("-")
    b, ctx = parts[:2]
    B = int(b[1:])
    q = next((int(x[1:]) for x in parts[2:] if x.startswith("q")), 1)
    if ctx.startswith("r"):
        hi = int(ctx[1:-1]) * 1024
        rng = random.Random(f"{b}-{ctx}")  # the same lengths with or without a -w suffix
        return B, hi, [(q, rng.randint(max(hi // 8, q), hi)) for _ in range(B)]
    return B, int(ctx[:-1]) * 1024, [(q, int(ctx[:-1]) * 1024)] * B


def _table_width(name: str) -> int:
    """Block-table columns of a shape ``...-w<cap>k``: vLLM's table is max_model_len wide
    whatever the lengths (B1-8k-w8k: 512 columns, an extent of whole splits; 0: `make_step`'s
    default, one page wider than the longest request)."""
    w = next((x for x in name.split("-")[2:] if x.startswith("w")), None)
    return int(w[1:-1]) * 1024 // BS if w else 0


SHAPES = [f"B{b}-{c}k" for b, c in ((1, 4), (1, 16), (1, 32), (4, 4), (4, 16), (4, 32), (16, 4), (16, 32),
                                     (64, 4), (64, 32), (256, 1), (256, 4), (256, 16))] + ["B256-r2k", "B64-r32k"]
DEFAULT_VARIANTS = "fa3,triton_off," + ",".join(f"cuda_{v}" for v in [AUTO, *VARIANTS])
# cuda_<variant>[:grid|:lpt|:spp<N>|:fold|:split|:fixed|:deal<N>[c<cost>][r]]: fold mode's schedule forced
# off (grid order) or on (longest first), split mode's splits per CTA forced to N, the mode itself forced
# (fold: each CTA walks and folds its row's splits, no merge launch; split: split states, then the
# merge), split mode's fixed dealing (the plan's chunks: no dealing on the device), or the device's
# dealing over N slots with the model's CTA cost (negative: one wave): its table made in each timed
# call, or with "r" a step of STEP_LAYERS layers per timed call, the first making the table and the
# rest reading it (decode_sm90's deal_step; the row's time is per layer) (timing only; same bits).
STEP_LAYERS = 8
_step_ids = itertools.count(1)
ORDERS = {"": None, "grid": False, "lpt": True}
MODES_FORCED = ("fold", "split")
ROWS_ACCEPTED = (f"fa3, triton_off, cuda_<{'|'.join([AUTO, *VARIANTS])}>"
                 "[:grid|:lpt|:spp<N>|:fold|:split|:fixed|:deal<N>[c<cost>][r]], "
                 f"and with --bucket triton_strict, cuda_ct_<{'|'.join([AUTO, *CT_VARIANTS])}>")


def kv_bytes(reqs) -> int:
    return sum(s for _, s in reqs) * cp.HKV * cp.D * 2 * 2


def cuda_fn(st, variant, mode=None, order=None, bucket=None, spp=None, deal=None, deal_cost=None,
            deal_reuse=False):
    """A launch of step ``st``; with ``deal_reuse`` STEP_LAYERS launches of one step (its layers: the
    first makes the dealing's table, the others read it)."""
    from dhp_backend.ops.cuda_decode import decode_sm90
    out = torch.full_like(st["q"], float("nan"))
    args = (st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out)
    kw = dict(scale=cp.SCALE, causal=True, variant=variant, mode=mode, order=order, bucket=bucket, spp=spp,
              deal=deal, deal_cost=deal_cost)
    decode_sm90(*args, **kw)  # the metadata checked once
    if not deal_reuse:
        return lambda: decode_sm90(*args, **kw, check=False)
    step_id = next(_step_ids)

    def step():
        for _ in range(STEP_LAYERS):
            decode_sm90(*args, **kw, check=False, deal_step=step_id)
        return out
    return step


def prefill_rows(st):
    """Step ``st`` through the csrc prefill kernel's policy-off binary: the bits every
    csrc decode row must have. Once per shape, untimed."""
    from dhp_backend.ops.cuda_prefill import prefill_sm90
    out = torch.full_like(st["q"], float("nan"))
    return prefill_sm90(st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out, scale=cp.SCALE,
                        causal=True, variant=PREFILL_V2)


def same_bits(a, b) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _short_kernel_name(name: str) -> str:
    """``void dhp::(anonymous namespace)::merge_kernel<true>(...)`` -> ``merge_kernel``."""
    head = name.replace("(anonymous namespace)::", "").removeprefix("void ").split("(", 1)[0].split("<", 1)[0]
    head = head.rsplit("::", 1)[-1] or name[:60]
    if head == "device_kernel":  # CUTLASS's wrapper (FA3): name the kernel class inside it
        inner = re.findall(r"(\w*(?:FlashAttn|Combine|combine)\w*)", name)
        head = f"device_kernel<{inner[-1]}>" if inner else head
    return head


def kernel_times(replays, n: int = 20) -> dict[str, float]:
    """Device time per kernel (us per call) over ``n`` replays (CUPTI reports a graph's
    kernels one by one), summed by short kernel name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            replays[i % len(replays)]()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            us = getattr(ev, "device_time", None)
            us = ev.cuda_time if us is None else us
            k = _short_kernel_name(ev.name)
            out[k] = out.get(k, 0.0) + us / n
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _cuda_variant(name: str):
    """``cuda_<variant>[:grid|:lpt|:spp<N>|:fold|:split|:fixed|:deal<N>[c<cost>][r]]`` -> (variant,
    `cuda_fn` keywords), or None for another name."""
    v, _, o = name[5:].partition(":")
    known = v in VARIANTS or v == AUTO
    if not (name.startswith("cuda_") and known):
        return None
    if re.fullmatch(r"spp[1-9][0-9]*", o):
        return v, dict(spp=int(o[3:]))
    if o == "fixed":
        return v, dict(deal=0)
    m = re.fullmatch(r"deal([1-9][0-9]*)(?:c(-?[0-9]+(?:\.[0-9]+)?))?(r?)", o)
    if m:
        kw = dict(deal=int(m[1]), deal_cost=None if m[2] is None else float(m[2]))
        return v, dict(kw, deal_reuse=True) if m[3] else kw
    if o in MODES_FORCED:
        return v, dict(mode=o)
    return (v, dict(order=ORDERS[o])) if o in ORDERS else None


def _ct_variant(name: str):
    """``cuda_ct_<variant>`` -> the CT variant, or None for another name."""
    v = name[len("cuda_ct_"):] if name.startswith("cuda_ct_") else None
    return v if v in CT_VARIANTS or v == AUTO else None


PROBE_BUCKET = 6144


def probe() -> bool:
    """Every variant and split mode right on small steps (and not hung), the CT
    variants too on the walk to PROBE_BUCKET, and all of a step's runs bit-equal to
    its first (policy off, split mode)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    errs, same = {}, {}
    for lens in ((1,), (17, 64, 513), (1000, 5000, 63, 2)):
        st = make_step([(1, s) for s in lens], gen, width=PROBE_BUCKET // BS, reserve=PROBE_BUCKET)
        ref = sdpa_ref(st, True)
        first = None
        runs = [(variant, mode, order, None, None) for variant in VARIANTS
                for mode, order in (("split", None), ("fold", False), ("fold", True))]
        runs += [(variant, mode, None, PROBE_BUCKET, None) for variant in CT_VARIANTS for mode in ("split", "fold")]
        runs += [(AUTO, "split", None, None, spp) for spp in (1, 3)]  # splits dealt otherwise: same bits
        for variant, mode, order, bucket, spp in runs:
            o = cuda_fn(st, variant, mode, order, bucket, spp)()
            torch.cuda.synchronize()
            key = (f"{lens} {variant}/{mode}{'/lpt' if order else ''}{f'/ct{bucket}' if bucket else ''}"
                   f"{f'/spp{spp}' if spp else ''}")
            errs[key] = rel_err(o, ref)
            first = o.clone() if first is None else first
            same[key] = same_bits(o, first)
    ok = all(e < 2e-2 for e in errs.values()) and all(same.values())
    print(f"probe: {'OK' if ok else 'WRONG'} errs " + json.dumps(errs) + " bits==first run " + json.dumps(same),
          flush=True)
    return ok


def _known(name: str) -> bool:
    return name in ("fa3", "triton_off", "triton_strict") or bool(_cuda_variant(name) or _ct_variant(name))


def bits_mark(row) -> str:
    """The progress line's flag for a row whose bits differ from those it must have."""
    return " [BITS]" if False in (row.get("bits_equal_off"), row.get("bits_equal_prefill")) else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="B<batch>-<ctx>k (e.g. B1-32k) or B<batch>-r<ctx>k (random lengths)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--probe", action="store_true", help="only check the kernel on small steps (exit 1 if wrong)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--spread", type=int, default=1,
                    help="cache of N x the used blocks, used ones scattered over it (a serving engine's cache)")
    ap.add_argument("--interleaved", action="store_true",
                    help="K and V of a (block, head) side by side, the DHP vLLM backend's cache layout")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile graph replays per kernel (torch.profiler): where a row's time goes "
                         "(split kernel, merge, schedule; FA3's kernels), and the gaps between them")
    ap.add_argument("--bucket", type=int, default=0,
                    help="also the constant-time walk to this bucket: rows triton_strict and cuda_ct_<variant> "
                         f"(variants {', '.join(CT_VARIANTS)}, or auto)")
    ap.add_argument("--heads", default=f"{cp.H},{cp.HKV}",
                    help="query heads,KV heads[,head size] (default Llama-3-8B's 32,8 of 128; Gemma-2 9B: "
                         "16,8,256, where ':spp<N>' rows time N splits per CTA, e.g. spp4 for the CTA count "
                         "of a 2048-position split: docs/perf-notes.md item (6)(c))")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cp.set_heads(ap, args.heads)
    if args.bucket:
        ct_names = ["triton_strict", *(f"cuda_ct_{v}" for v in CT_VARIANTS)]
        args.variants += "," + ",".join(n for n in ct_names if n not in args.variants.split(","))
    unknown = [n for n in args.variants.split(",") if not _known(n)]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; accepted: {ROWS_ACCEPTED}")
    walks = [n for n in args.variants.split(",") if n == "triton_strict" or _ct_variant(n)]
    if walks and not args.bucket:
        ap.error(f"variant(s) {walks} without --bucket; accepted: {', '.join(walks)} with --bucket L "
                 "(the constant-time walk's length)")
    t0 = time.time()
    stop = cuda_runs.probe_first(ap, probe, "decode", args.probe)
    if stop is not None:
        return stop

    from benchmarks.timer import CudaTimer, capture_graphs
    timer = CudaTimer(reps=args.reps, warmup=3)

    profiled: dict = {}

    def graph_median_ms(fns):  # decode launches are microseconds: time CUDA-graph replays
        replays, _, graphs = capture_graphs(fns)
        ms = timer.measure(replays).median_ms
        profiled.clear()
        if args.kernels:
            profiled.update(kernel_times(replays))
        del graphs
        return ms
    gen = torch.Generator(device="cuda").manual_seed(0)
    names = args.variants.split(",")
    rows = []
    shapes = args.shapes.split(",")
    for k, shape in enumerate(shapes):
        B, ctx, reqs = _shape(shape)
        nbytes = kv_bytes(reqs)
        # The constant-time rows only where the bucket holds the shape's lengths.
        ct_here = bool(args.bucket) and args.bucket >= ctx
        exec_bytes = kv_bytes([(1, args.bucket)] * B) if args.bucket else 0
        width = max(_table_width(shape), -(-args.bucket // BS))
        sets = [make_step(reqs, gen, spread=args.spread, interleaved=args.interleaved, width=width,
                          reserve=args.bucket if ct_here else 0) for _ in range(2)]
        ref = sdpa_ref(sets[0], True)
        outs = {}
        here = [n for n in names
                if ct_here or not (n == "triton_strict" or _ct_variant(n))]
        for name in here:
            row = dict(shape=shape, heads=f"{cp.H}x{cp.HKV}x{cp.D}", batch=B, ctx=ctx, variant=name, us=None,
                       tb_s=None, rel_err=None)
            per = 1  # launches per timed call (a ':deal<N>r' row: a step's layers)
            try:
                if name == "fa3":
                    fns = [fa3_fn(s, True) for s in sets]
                elif name == "triton_off":
                    fns = [triton_off_fn(s, True) for s in sets]
                elif name == "triton_strict":
                    fns = [triton_off_fn(s, True, "strict", args.bucket) for s in sets]
                elif _ct_variant(name):
                    fns = [cuda_fn(s, _ct_variant(name), bucket=args.bucket) for s in sets]
                else:  # cuda_<variant>[:...] (main refused any other name)
                    variant, kw = _cuda_variant(name)
                    fns = [cuda_fn(s, variant, **kw) for s in sets]
                    per = STEP_LAYERS if kw.get("deal_reuse") else 1
                o = cuda_runs.check_and_time(row, fns, ref, graph_median_ms)
                if per > 1:  # a step's layers per call: the time per layer
                    row["layers"] = per
                    row["us"] = row["us"] / per if row["us"] else row["us"]
                    profiled.update({k: round(v / per, 2) for k, v in profiled.items()})
                if profiled:
                    row["kernels_us"] = dict(profiled)
                if o is not None:
                    outs[name] = o
                if row["us"]:
                    row["tb_s"] = nbytes / row["us"] / 1e6
                    if name == "triton_strict" or _ct_variant(name):
                        row["exec_tb_s"] = exec_bytes / row["us"] / 1e6
            except Exception as e:  # noqa: BLE001 - a failing variant is a finding, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        mine = rows[-len(here):]
        # Bits, each family against its own policy-off row (the csrc and Triton
        # arithmetics differ): every csrc row against the first policy-off csrc row, that
        # row against the csrc prefill kernel on the same step, triton_strict against triton_off.
        off = next((n for n in here if _cuda_variant(n) and n in outs), None)
        for r in mine:
            vs = "triton_off" if r["variant"] == "triton_strict" else off if r["variant"].startswith("cuda_") else None
            if r["variant"] in outs and vs in outs and vs != r["variant"]:
                r["bits_vs"] = vs
                r["bits_equal_off"] = same_bits(outs[r["variant"]], outs[vs])
            if r["variant"] == off:
                try:
                    r["bits_equal_prefill"] = same_bits(outs[off], prefill_rows(sets[0]))
                except Exception as e:  # noqa: BLE001 - the prefill kernel refusing this step is a finding too
                    r["prefill_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        cuda_runs.fa3_ratios(mine)
        fa3_tb = next((r["tb_s"] for r in mine if r["variant"] == "fa3" and r["tb_s"]), None)
        for r in mine:
            if r.get("exec_tb_s") and fa3_tb:
                r["exec_fa3_over"] = r["exec_tb_s"] / fa3_tb
        cuda_runs.print_progress(k, len(shapes), t0, shape, mine, bits_mark)
        del sets
        torch.cuda.empty_cache()

    print(f"\n{'shape':10s} {'variant':14s} {'us':>9s} {'TB/s':>6s} {'x FA3':>6s} {'rel err':>8s} "
          f"bits (==policy-off row, ==csrc prefill){'  [executed TB/s, x FA3]' if args.bucket else ''}")
    for r in rows:
        us = f"{r['us']:9.1f}" if r["us"] else f"{'-':>9s}"
        bw = f"{r['tb_s']:6.2f}" if r["tb_s"] else f"{'-':>6s}"
        fx = f"{r['fa3_over']:6.3f}" if r["fa3_over"] else f"{'-':>6s}"
        er = f"{r['rel_err']:8.1e}" if r["rel_err"] is not None else f"{'-':>8s}"
        ex = f"  [{r['exec_tb_s']:.2f}, {r.get('exec_fa3_over') or 0:.3f}]" if r.get("exec_tb_s") else ""
        bits = " ".join(x for x in (f"=={r['bits_vs']} {r['bits_equal_off']}" if "bits_vs" in r else "",
                                    f"==prefill {r.get('bits_equal_prefill', r.get('prefill_error'))}"
                                    if "bits_equal_prefill" in r or "prefill_error" in r else "") if x)
        print(f"{r['shape']:10s} {r['variant']:14s} {us} {bw} {fx} {er} {bits}{ex} {r.get('error', '')}")
    if args.kernels:
        print("\nwhere the time goes (us per call, graph replay; gap = replay time - the kernels' sum)")
        for r in rows:
            if r.get("kernels_us") and r["us"]:
                ks = r["kernels_us"]
                print(f"{r['shape']:10s} {r['variant']:14s} replay {r['us']:8.1f}  kernels {sum(ks.values()):8.1f}  "
                      f"gap {r['us'] - sum(ks.values()):6.1f}  " + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, spread=args.spread,
                    interleaved=args.interleaved, bucket=args.bucket,
                    commit=os.environ.get("DHP_COMMIT", ""), date=time.strftime("%Y-%m-%d"))
        with open(os.path.join(args.out, "cuda_decode.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
