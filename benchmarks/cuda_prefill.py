"""The csrc Hopper prefill kernel against FA3 and DHP's Triton kernel, same tensors, same run.

    python -m benchmarks.cuda_prefill [--out DIR] [--probe] [--shapes ...] [--variants ...] [--bucket L]

``--probe`` runs every binary on three small problems and exits non-zero unless
all are right: the first thing a device call runs (in a subprocess with a
timeout, so a hung kernel costs seconds).

Every variant is checked against SDPA (dense per request, bf16) before it is
timed. Llama-3-8B heads (32 query, 8 KV, d 128), block 16, bf16, NaN garbage in
every cache slot no request holds data in (the kernel must not let it through), a
random block table (`testing.pages.reserved_table`; with ``--bucket L`` every request
owns its pages up to L, the address rule of the constant-time walk). Rows: FA3 on
the same data in its own paged layout (NHD, contiguous), DHP's Triton kernel under
policy ``off`` (``triton_off``, its fastest), and the csrc kernel's ``v2`` binary
(``cuda_v2``: what `ops.plan` runs policy-off prefill and mixed steps on where the
csrc kernels take the layer). FLOPs are the useful count (the causal triangle).

``--bucket L`` adds the constant-time policy's rows: ``triton_strict`` (DHP's
Triton kernel under policy strict, bucket L) and ``cuda_v2_ct`` (the csrc
constant-time binary, bucket L; every request reads its L / 16 reserved pages), with the
executed work (every query row to L) as ``exec_tflops`` and its ratio to FA3's
useful rate as ``strict_eff`` (the harness's strict_efficiency).

Bits (the csrc kernels' contract, docs/kernels.md section 7; the Triton kernels have
an arithmetic of their own, so their rows are timing anchors, never compared with
the csrc rows): ``cuda_v2`` against the csrc decode kernel computing every row of the
same step through token tiles (``bits_equal_decode``: prefill = decode), and each
constant-time row against its family's policy-off row (``bits_equal_off``:
``cuda_v2_ct`` against ``cuda_v2``, ``triton_strict`` against ``triton_off``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from benchmarks import cuda_runs
from benchmarks.inputs import rel_err
from dhp_backend.ops.cuda_prefill import V2, V2_CT, V_DESC

H, HKV, D, BS = 32, 8, 128, 16
SCALE = D ** -0.5

# name -> (list of (q_len, seq_len), causal)
SHAPES = {
    "causal-1k": ([(1024, 1024)], True),
    "causal-2k": ([(2048, 2048)], True),
    "causal-4k": ([(4096, 4096)], True),
    "causal-8k": ([(8192, 8192)], True),
    "causal-16k": ([(16384, 16384)], True),
    "full-4k": ([(4096, 4096)], False),
    "full-8k": ([(8192, 8192)], False),
    "chunk-2k-on-4k": ([(2048, 4096)], True),
    "batch4-4000": ([(4000, 4000)] * 4, True),
    "batch2-8k": ([(8192, 8192)] * 2, True),  # issue 30's Qwen2.5-7B row (with --heads 28,4)
    # The mixed chunked-prefill step of design.md (a 2048-token chunk on 4K context
    # plus 63 decodes at 4K): a "prefill" step by the launcher's rule, so policy
    # off routes it to the v2 binary.
    "chunk2k+63dec": ([(2048, 4096)] + [(1, 4096)] * 63, True),
}
DEFAULT_VARIANTS = f"fa3,triton_off,cuda_{V2}"
# Rows only --bucket gives a meaning (the constant-time walk to L), and their
# family's policy-off row, whose bits they must have.
CT_ROWS = {"triton_strict": "triton_off", f"cuda_{V2_CT}": f"cuda_{V2}"}
ROWS = ("fa3", "triton_off", f"cuda_{V2}", *CT_ROWS)


HEAD_SIZES = (64, 80, 96, 128, 256)  # the csrc libraries' (docs/kernels.md section 7)


def set_heads(ap, spec: str) -> None:
    """--heads "H,HKV[,D]": the module's head counts and head size for this run (every helper here and in
    `benchmarks.cuda_decode` reads them; D also sets SCALE = D^-0.5), e.g. 16,8,256 for Gemma-2 9B."""
    global H, HKV, D, SCALE
    accepted = f"'H,HKV' or 'H,HKV,D': positive integers, HKV dividing H, D one of {HEAD_SIZES}"
    try:
        vals = [int(x) for x in spec.split(",")]
    except ValueError:
        ap.error(f"--heads {spec!r}; accepted: {accepted}")
    if len(vals) not in (2, 3):
        ap.error(f"--heads {spec!r}; accepted: {accepted}")
    h, hkv, d = (*vals, D) if len(vals) == 2 else vals
    if h < 1 or hkv < 1 or h % hkv or d not in HEAD_SIZES:
        ap.error(f"--heads {spec!r}; accepted: {accepted}")
    H, HKV, D, SCALE = h, hkv, d, d ** -0.5


def useful_flop(reqs, causal: bool) -> float:
    f = 0
    for q, s in reqs:
        f += q * (s - q) + q * (q + 1) // 2 if causal else q * s
    return 4.0 * H * D * f


def executed_flop(reqs, bucket: int) -> float:
    """The constant-time walk's work: every query row against all L positions."""
    return 4.0 * H * D * sum(q for q, _ in reqs) * bucket


def make_step(reqs, gen, dtype=torch.bfloat16, spread: int = 1, interleaved: bool = False, width: int = 0,
              reserve: int = 0):
    """A packed step in ops.paged_attention's layout with NaN in every slot no request
    holds data in.

    ``reserve``: tokens of pages every request owns at least (its true length's pages
    otherwise): a constant-time walk to a bucket L reads a request's pages up to L, so
    its rows need ``reserve=L`` (the address rule; `testing.pages.reserved_table`).
    ``spread``: the cache holds ``spread`` times the blocks the step uses, and the
    used ones are scattered over all of it (a serving engine's cache: a working set
    spread over GBs). ``interleaved``: K and V of a (block, head) side by side, as in
    the DHP vLLM backend's cache ([blocks, Hkv, 2, bs, D]); else two tensors.
    ``width``: the table's columns (vLLM's: ``cdiv(max_model_len, block_size)``; at least
    the largest reservation's pages). 0: one page wider than the largest reservation,
    so a decode launch's extent (columns x block size) ends one page past whole
    512-position splits (B1 at 8K: 8208 positions, 17 splits), as a vLLM table does when
    ``max_model_len`` is not a multiple of 512; vLLM's tables at a power-of-two
    ``max_model_len`` have whole splits (the harness's `inputs` builds those)."""
    from dhp_backend.testing.pages import pages_for, reserved_table

    dev = "cuda"
    tokens = [max(s, reserve) for _, s in reqs]
    need = [pages_for(t, BS) for t in tokens]
    num_blocks = spread * sum(need) + 8
    if interleaved:
        kv = torch.full((num_blocks, HKV, 2, BS, D), float("nan"), device=dev, dtype=dtype)
        kc, vc = kv[:, :, 0], kv[:, :, 1]
    else:
        kc = torch.full((num_blocks, HKV, BS, D), float("nan"), device=dev, dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
    order = (torch.randperm(num_blocks - 1, generator=gen, device=dev) + 1).tolist()  # block 0: the null block
    table = reserved_table(tokens, block_size=BS, num_blocks=num_blocks, width=width or max(need) + 1,
                           order=order, device=dev)
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s, device=dev)
        blk, slot = table[i].long()[pos // BS], pos % BS
        kc.permute(0, 2, 1, 3)[blk, slot] = torch.randn(s, HKV, D, generator=gen, device=dev).to(dtype)
        vc.permute(0, 2, 1, 3)[blk, slot] = torch.randn(s, HKV, D, generator=gen, device=dev).to(dtype)
    T = sum(q for q, _ in reqs)
    q = torch.randn(T, H, D, generator=gen, device=dev).to(dtype)
    qsl = torch.tensor([0] + [sum(r[0] for r in reqs[: i + 1]) for i in range(len(reqs))], dtype=torch.int32,
                       device=dev)
    sl = torch.tensor([s for _, s in reqs], dtype=torch.int32, device=dev)
    return dict(q=q, kc=kc, vc=vc, table=table, qsl=qsl, sl=sl, reqs=reqs, max_q=max(r[0] for r in reqs))


def sdpa_ref(st, causal):
    out = torch.empty_like(st["q"])
    qsl = st["qsl"].tolist()
    for i, (ql, s) in enumerate(st["reqs"]):
        ids = st["table"][i, : -(-s // BS)].long()
        k = st["kc"][ids].transpose(0, 1).reshape(HKV, -1, D)[:, :s].repeat_interleave(H // HKV, 0)
        v = st["vc"][ids].transpose(0, 1).reshape(HKV, -1, D)[:, :s].repeat_interleave(H // HKV, 0)
        q = st["q"][qsl[i]: qsl[i + 1]].transpose(0, 1)
        mask = None
        if causal and ql != s:  # query row j sits at position s - ql + j
            mask = torch.arange(s, device=q.device)[None, :] <= (s - ql + torch.arange(ql, device=q.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE,
                                                             is_causal=causal and ql == s)
        out[qsl[i]: qsl[i + 1]] = o.transpose(0, 1)
    return out


def cuda_fn(st, causal, variant, bucket=None):
    from dhp_backend.ops.cuda_prefill import prefill_sm90
    out = torch.full_like(st["q"], float("nan"))
    args = (st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out)
    prefill_sm90(*args, scale=SCALE, causal=causal, variant=variant, bucket=bucket)  # the metadata checked once
    return lambda: prefill_sm90(*args, scale=SCALE, causal=causal, variant=variant, bucket=bucket, check=False)


def decode_rows(st, causal):
    """Every row of step ``st`` through the csrc decode kernel (token tiles: each query
    token its own CTA row with its causal limit): the bits every csrc prefill row must
    have. Run once per shape, untimed (the decode kernel is no prefill kernel: a long
    prompt costs it many times the prefill kernel's time)."""
    from dhp_backend.ops.cuda_decode import decode_sm90
    out = torch.full_like(st["q"], float("nan"))
    decode_sm90(st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out, scale=SCALE, causal=causal,
                num_tokens=st["q"].shape[0])
    return out


def same_bits(a, b) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def triton_off_fn(st, causal, policy="off", bucket=None):
    from dhp_backend.ops import paged_attention
    out = torch.empty_like(st["q"])
    args = (st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out)
    return lambda: paged_attention(*args, scale=SCALE, causal=causal, policy=policy, bucket=bucket, path="triton",
                                   check_values=False)


def fa3_fn(st, causal):
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - anchor absent: the row says so
        return None
    kc = torch.nan_to_num(st["kc"].permute(0, 2, 1, 3).contiguous())  # NHD, FA3's paged layout
    vc = torch.nan_to_num(st["vc"].permute(0, 2, 1, 3).contiguous())
    out = torch.empty_like(st["q"])
    max_k = max(s for _, s in st["reqs"])
    return lambda: flash_attn_varlen_func(st["q"], kc, vc, max_seqlen_q=st["max_q"], cu_seqlens_q=st["qsl"],
                                          max_seqlen_k=max_k, seqused_k=st["sl"], causal=causal,
                                          softmax_scale=SCALE, block_table=st["table"], fa_version=3, out=out)


PROBE_BUCKET = 512  # the constant-time binary's walk in the probe (every request reserves it)


def probe() -> bool:
    """Every binary right on small shapes (and not hung)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    errs = {}
    for reqs, causal in (([(200, 200)], True), ([(128, 128)], False), ([(100, 300), (77, 77)], True)):
        st = make_step(reqs, gen, reserve=PROBE_BUCKET)
        ref = sdpa_ref(st, causal)
        for variant in (V2, V2_CT):
            bucket = PROBE_BUCKET if variant == V2_CT else None
            o = cuda_fn(st, causal, variant, bucket)()
            torch.cuda.synchronize()
            errs[f"{reqs} causal={causal} {variant}"] = rel_err(o[: ref.shape[0]], ref)
    ok = all(e < 2e-2 for e in errs.values())
    print(f"probe: {'OK' if ok else 'WRONG'} " + json.dumps(errs), flush=True)
    return ok


def bits_mark(row) -> str:
    """The progress line's flag for a row whose bits differ from those it must have."""
    return " [BITS]" if False in (row.get("bits_equal_off"), row.get("bits_equal_decode")) else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--probe", action="store_true", help="only check the kernel on small shapes (exit 1 if wrong)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", default=f"{H},{HKV}",
                    help="query heads,KV heads[,head size] (default Llama-3-8B's 32,8 of 128; Qwen2.5-7B: 28,4; "
                         "Gemma-2 9B: 16,8,256)")
    ap.add_argument("--bucket", type=int, default=0,
                    help=f"add the rows {', '.join(CT_ROWS)} at this bucket L (>= every shape's length)")
    args = ap.parse_args(argv)
    set_heads(ap, args.heads)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    names = args.variants.split(",")
    if args.bucket:
        names += [n for n in CT_ROWS if n not in names]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; accepted: {', '.join(ROWS)}")
    if not args.bucket and any(n in CT_ROWS for n in names):
        ap.error(f"variant(s) {[n for n in names if n in CT_ROWS]} without --bucket; accepted: "
                 f"{', '.join(CT_ROWS)} with --bucket L (the constant-time walk's length)")
    for shape in args.shapes.split(","):
        longest = max(s for _, s in SHAPES[shape][0])
        if args.bucket and args.bucket < longest:
            ap.error(f"--bucket {args.bucket} is shorter than shape {shape}'s longest request ({longest}); "
                     "accepted: a bucket >= every shape's longest request")
    t0 = time.time()
    stop = cuda_runs.probe_first(ap, probe, "prefill", args.probe)
    if stop is not None:
        return stop

    from benchmarks.timer import CudaTimer
    timer = CudaTimer(reps=args.reps, warmup=3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = args.shapes.split(",")
    for k, shape in enumerate(shapes):
        reqs, causal = SHAPES[shape]
        flop = useful_flop(reqs, causal)
        sets = [make_step(reqs, gen, width=-(-args.bucket // BS), reserve=args.bucket) for _ in range(2)]
        ref = sdpa_ref(sets[0], causal)
        outs = {}
        for name in names:
            row = dict(shape=shape, heads=f"{H}x{HKV}x{D}", variant=name, causal=causal, reqs=reqs, us=None,
                       tflops=None, rel_err=None)
            try:
                if name == "fa3":
                    fns = [fa3_fn(s, causal) for s in sets]
                elif name == "triton_off":
                    fns = [triton_off_fn(s, causal) for s in sets]
                elif name == "triton_strict":
                    fns = [triton_off_fn(s, causal, "strict", args.bucket) for s in sets]
                elif name == f"cuda_{V2_CT}":
                    fns = [cuda_fn(s, causal, V2_CT, args.bucket) for s in sets]
                else:  # cuda_v2 (main refused any other name)
                    fns = [cuda_fn(s, causal, V2) for s in sets]
                o = cuda_runs.check_and_time(row, fns, ref, lambda f: timer.measure(f).median_ms,
                                             rows_checked=ref.shape[0])
                if o is not None:
                    outs[name] = o
                    row["tflops"] = flop / row["us"] / 1e6
                    if name in CT_ROWS:
                        row["bucket"] = args.bucket
                        row["exec_tflops"] = executed_flop(reqs, args.bucket) / row["us"] / 1e6
            except Exception as e:  # noqa: BLE001 - a failing variant is a finding, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        mine = rows[-len(names):]
        # Bits, each family against itself (the csrc and Triton arithmetics differ):
        # a constant-time row has its policy-off row's bits (policy invariance), and the
        # csrc prefill kernel the csrc decode kernel's on the same step (prefill = decode).
        for r in mine:
            off = CT_ROWS.get(r["variant"])
            if r["variant"] in outs and off in outs:
                r["bits_equal_off"] = same_bits(outs[r["variant"]], outs[off])
        v2_row = next((r for r in mine if r["variant"] == f"cuda_{V2}"), None)
        if v2_row is not None and f"cuda_{V2}" in outs:
            try:
                dec = decode_rows(sets[0], causal)[: ref.shape[0]]
                v2_row["bits_equal_decode"] = same_bits(outs[f"cuda_{V2}"], dec)
                del dec
            except Exception as e:  # noqa: BLE001 - the decode kernel refusing this step is a finding too
                v2_row["decode_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        cuda_runs.fa3_ratios(mine)
        fa3 = next((r for r in mine if r["variant"] == "fa3" and r["tflops"]), None)
        for r in mine:
            if fa3 and r.get("exec_tflops"):
                r["strict_eff"] = r["exec_tflops"] / fa3["tflops"]
        cuda_runs.print_progress(k, len(shapes), t0, shape, mine, bits_mark)
        del sets
        torch.cuda.empty_cache()

    for r in rows:
        if "bits_equal_decode" in r or "decode_error" in r:
            print(f"{r['shape']}: {r['variant']} bits equal to the csrc decode kernel's: "
                  f"{r.get('bits_equal_decode', r.get('decode_error'))}")
        if "bits_equal_off" in r:
            print(f"{r['shape']}: {r['variant']} bits equal to {CT_ROWS[r['variant']]}: {r['bits_equal_off']}")
    print(f"\n{'shape':16s} {'variant':24s} {'us':>9s} {'TFLOP/s':>8s} {'x FA3':>6s} {'rel err':>8s} "
          f"{'exec TF/s':>9s} {'eff':>6s}")
    for r in rows:
        us = f"{r['us']:9.1f}" if r["us"] else f"{'-':>9s}"
        tf = f"{r['tflops']:8.1f}" if r["tflops"] else f"{'-':>8s}"
        fx = f"{r['fa3_over']:6.3f}" if r["fa3_over"] else f"{'-':>6s}"
        er = f"{r['rel_err']:8.1e}" if r["rel_err"] is not None else f"{'-':>8s}"
        ex = f"{r['exec_tflops']:9.1f}" if r.get("exec_tflops") else f"{'-':>9s}"
        ef = f"{r['strict_eff']:6.3f}" if r.get("strict_eff") else f"{'-':>6s}"
        print(f"{r['shape']:16s} {r['variant']:24s} {us} {tf} {fx} {er} {ex} {ef} {r.get('error', '')}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    commit=os.environ.get("DHP_COMMIT", ""), date=time.strftime("%Y-%m-%d"), v_desc=V_DESC)
        with open(os.path.join(args.out, "cuda_prefill.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, separators=(",", ":"))  # compact: the device carry is tight
    return 0


if __name__ == "__main__":
    sys.exit(main())
