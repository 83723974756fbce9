"""Quick timing of the Triton kernels against simple anchors, on one GPU.

    python -m benchmarks.quick_kernel_bench [--sweep] [--out DIR]

Llama-3-8B attention (32 query heads, 8 KV heads, head 128, block 16, bf16):
decode B=1/16/64 at 4K and 32K context, and one 4K causal prefill. Each shape
is checked for correctness first (against torch SDPA on the same data, dense),
then timed with `triton.testing.do_bench` (median, L2 flushed by do_bench) while
rotating among several input sets that together exceed L2. Random data, never
zeros. Anchors in the same process: torch SDPA on dense K/V, a device copy (the
bandwidth ceiling) and the K+V bytes each decode must read.

Also: the constant-time check of padding cost (true lengths short vs long inside
one bucket: the times should agree), and a look at the compiled attention
kernel (HGMMA in SASS, branches, spills, precise division).

The ratio columns are what to read; this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

H, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
L2_BYTES = 50 * 2**20


def _cdiv(a, b):
    return -(-a // b)


def make_set(B, q_len, ctx_true, L, gen, *, seq_lens=None):
    """One input set: a paged cache with randomly placed blocks and random data.

    ``ctx_true``: each request's true total length (seq_len); L: the table capacity
    (strict bucket). Every request owns distinct pages up to L (the address rule:
    the engine reserves them), those past the true length hold stale random data.
    """
    max_blocks = _cdiv(L, BS)
    num_blocks = B * max_blocks + 16
    kc = torch.randn(num_blocks, HKV, BS, D, generator=gen, device="cuda", dtype=torch.float32).to(DTYPE)
    vc = torch.randn(num_blocks, HKV, BS, D, generator=gen, device="cuda", dtype=torch.float32).to(DTYPE)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")[: B * max_blocks]
    table = perm.view(B, max_blocks).to(torch.int32).contiguous()
    T = B * q_len
    q = torch.randn(T, H, D, generator=gen, device="cuda", dtype=torch.float32).to(DTYPE)
    qsl = torch.arange(0, T + 1, q_len, device="cuda", dtype=torch.int32)
    if seq_lens is None:
        seq_lens = [ctx_true] * B
    sl = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    return dict(q=q, kc=kc, vc=vc, table=table, qsl=qsl, sl=sl, T=T, L=max_blocks * BS)


def dense_kv(s, B, S):
    """K/V of each request gathered densely: [B, HKV, S, D] (for SDPA)."""
    ids = s["table"][:, : _cdiv(S, BS)].long()
    k = s["kc"][ids].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)[:, :, :S].contiguous()
    v = s["vc"][ids].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)[:, :, :S].contiguous()
    return k, v


def run_ours(s, out, policy="strict", **hooks):
    from dhp_backend.ops.triton import paged_attention_triton

    paged_attention_triton(s["q"], s["kc"], s["vc"], s["table"], s["qsl"], s["sl"], out,
                           scale=D ** -0.5, causal=True, num_tokens=s["T"], policy=policy, bucket=s["L"],
                           **hooks)
    return out


def sdpa_decode(q, k, v):
    # GQA decode as a non-causal attention of the G query heads of each KV head
    # (no K/V expansion): q [B, HKV, G, D] against [B, HKV, S, D].
    B = k.shape[0]
    qq = q.view(B, HKV, H // HKV, D)
    return F.scaled_dot_product_attention(qq, k, v, scale=D ** -0.5).reshape(B, H, D)


def sdpa_prefill(q, k, v):
    # k, v: [1, HKV, S, D]
    S = q.shape[0]
    qq = q.view(S, H, D).transpose(0, 1).unsqueeze(0)
    kk = k.repeat_interleave(H // HKV, dim=1)
    vv = v.repeat_interleave(H // HKV, dim=1)
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=D ** -0.5)
    return o[0].transpose(0, 1)


def fa3_callable(s, q_len, ctx):
    """FlashAttention-3 (vLLM's build, paged) on the same set, or None if not importable.

    FA3 wants NHD pages ([blocks, block_size, kv_heads, head]): a copy of the
    same data, made outside the timed region.
    """
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - anchor absent: the row says so
        return None
    k = s["kc"].permute(0, 2, 1, 3).contiguous()
    v = s["vc"].permute(0, 2, 1, 3).contiguous()
    out = torch.empty_like(s["q"])

    def run():
        return flash_attn_varlen_func(s["q"], k, v, max_seqlen_q=q_len, cu_seqlens_q=s["qsl"], max_seqlen_k=ctx,
                                      seqused_k=s["sl"], causal=True, softmax_scale=D ** -0.5,
                                      block_table=s["table"], fa_version=3, out=out)
    return run


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench(fn_list):
    import triton.testing

    i = [0]

    def step():
        fn_list[i[0] % len(fn_list)]()
        i[0] += 1

    # Graph replay, as the harness times decode: without it a slow host's launch
    # path (Python validation + Triton launch, ~0.2 ms on some machines) is timed.
    for f in fn_list:
        f()
    torch.cuda.synchronize()
    reps = 8
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            step()
    return triton.testing.do_bench(g.replay, warmup=20, rep=300, return_mode="median") * 1e3 / reps  # us


def copy_bandwidth():
    import triton.testing

    n = 512 * 2**20
    a = torch.randn(n // 4, device="cuda")
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=200, return_mode="median") * 1e-3
    return 2 * n / t / 1e9


def shape_rows(args, gen):
    rows = []
    shapes = [("decode", B, ctx) for ctx in (4096, 32768) for B in (1, 16, 64)] + [("prefill", 1, 4096)]
    for kind, B, ctx in shapes:
        q_len = 1 if kind == "decode" else ctx
        one = make_set(B, q_len, ctx, ctx, gen)
        set_bytes = 2 * one["kc"].numel() * 2
        n_rot = max(1, min(4, _cdiv(4 * L2_BYTES, set_bytes)))
        sets = [one] + [make_set(B, q_len, ctx, ctx, gen) for _ in range(n_rot - 1)]
        outs = [torch.full((s["T"], H, D), float("nan"), device="cuda", dtype=DTYPE) for s in sets]
        dense = [dense_kv(s, B, ctx) for s in sets]
        # Correctness first.
        o = run_ours(sets[0], outs[0])
        if kind == "decode":
            ref = sdpa_decode(sets[0]["q"], *dense[0])
            sd = [lambda s=s, d=d: sdpa_decode(s["q"], *d) for s, d in zip(sets, dense)]
        else:
            ref = sdpa_prefill(sets[0]["q"], *dense[0])
            sd = [lambda s=s, d=d: sdpa_prefill(s["q"], *d) for s, d in zip(sets, dense)]
        err = rel(o, ref) if torch.isfinite(o.float()).all() else float("nan")
        if not err < 2e-2:
            print(f"WRONG RESULT {kind} B={B} ctx={ctx}: rel err {err}", flush=True)
        t_ours = bench([lambda s=s, o=o: run_ours(s, o) for s, o in zip(sets, outs)])
        t_sdpa = bench(sd)
        fa3 = [fa3_callable(s, q_len, ctx) for s in sets]
        t_fa3 = err_fa3 = float("nan")
        if all(f is not None for f in fa3):
            err_fa3 = rel(fa3[0](), ref)
            if err_fa3 < 2e-2:  # never time a wrong anchor
                t_fa3 = bench(fa3)
            else:
                print(f"FA3 WRONG RESULT {kind} B={B} ctx={ctx}: rel err {err_fa3}", flush=True)
        del fa3
        kv_bytes = 2 * B * ctx * HKV * D * 2
        flops = 4 * B * q_len * ctx * H * D  # full L for ours (constant time: no causal skip)
        rows.append(dict(kind=kind, B=B, ctx=ctx, rel_err=err, us_ours=t_ours, us_sdpa=t_sdpa,
                         ratio=t_ours / t_sdpa, us_fa3=t_fa3, rel_err_fa3=err_fa3, ours_over_fa3=t_ours / t_fa3,
                         kv_GBps_ours=kv_bytes / t_ours / 1e3,
                         kv_GBps_sdpa=kv_bytes / t_sdpa / 1e3, tflops_ours=flops / t_ours / 1e6))
        print(json.dumps(rows[-1]), flush=True)
        del sets, outs, dense
        torch.cuda.empty_cache()
    return rows


def padding_rows(gen):
    """Constant-time spot check: the same bucket, true lengths shortest vs longest."""
    rows = []
    for B, L in ((1, 32768), (16, 4096), (16, 32768)):
        short = [make_set(B, 1, 1, L, gen) for _ in range(2)]
        long = [make_set(B, 1, L, L, gen) for _ in range(2)]
        outs = [torch.empty((B, H, D), device="cuda", dtype=DTYPE) for _ in range(2)]
        ts, tl_ = [], []
        for _ in range(3):  # interleaved
            ts.append(bench([lambda s=s, o=o: run_ours(s, o) for s, o in zip(short, outs)]))
            tl_.append(bench([lambda s=s, o=o: run_ours(s, o) for s, o in zip(long, outs)]))
        rows.append(dict(B=B, L=L, us_short=sorted(ts)[1], us_long=sorted(tl_)[1],
                         short_over_long=sorted(ts)[1] / sorted(tl_)[1]))
        print(json.dumps(rows[-1]), flush=True)
        del short, long
        torch.cuda.empty_cache()
    return rows


def variants():
    """Named tile/pipeline variants (to choose the public constants; bits differ between some of them).

    ``mixed``/``decode``/``prefill`` are the production configs of the three step
    kinds (config.kernel_config); the others change one thing of one of them. In
    `sweep_rows` a name may end in ``@off`` (policy off instead of strict; the sweep's
    bucket equals the true length, so both walk the same positions).
    """
    import dataclasses

    from dhp_backend.ops import tiles as kcfg

    g = H // HKV
    kinds = {k: kcfg.kernel_config(D, g, "bfloat16", kind=k) for k in kcfg.STEP_KINDS}

    def v(kind, **kw):
        return dataclasses.replace(kinds[kind], **kw)

    out = dict(kinds)
    out.update({
        "decode_s1024": v("decode", split_kv=1024),
        "decode_s2048": v("decode", split_kv=2048),
        "decode_noprefetch": v("decode", prefetch=False),
        "prefill_s2048": v("prefill", split_kv=2048),
        "prefill_noprefetch": v("prefill", prefetch=False),
        "mixed_noprefetch": v("mixed", prefetch=False),
        "prefill_st3": v("prefill", num_stages=3),
        "mixed_bn32": v("mixed", block_n=32),
        # The 64-row wgmma decode tile (production before the 16-row mma.sync tile) and 16-row variants.
        "decode_m64": v("decode", block_m=64, block_q=64 // g, resident=0),
        "decode_s4": v("decode", num_stages=4),
        "decode_w2": v("decode", num_warps=2, resident=4),
        # A 128-position KV step (different bits by design: every kind would change together).
        "decode_bn128": v("decode", block_n=128, num_stages=2, resident=2),
        "mixed_bn128": v("mixed", block_n=128),
        "prefill_bn128": v("prefill", block_n=128),
    })
    return out


KINDS_ORDER = ("mixed", "decode", "prefill")
SWEEP_SHAPES = (("decode", 1, 32768), ("decode", 16, 32768), ("decode", 64, 4096), ("decode", 16, 4096),
                ("decode", 256, 1024),
                ("prefill", 1, 4096))


def sweep_rows(gen, names=None, kinds=None):
    """Each variant on each sweep shape, with FA3 timed alongside (ratio ``fa3_over``
    = FA3 time / variant time, > 1 is faster than FA3). Every variant's output is
    checked against SDPA before it is timed; a wrong or failing variant gets NaN."""
    from dhp_backend.ops import tiles as kcfg

    rows = []
    vs = variants()
    names = names or list(vs) + [f"{k}@off" for k in KINDS_ORDER]
    for kind, B, ctx in SWEEP_SHAPES:
        if kinds and kind not in kinds:
            continue
        q_len = 1 if kind == "decode" else ctx
        sets = [make_set(B, q_len, ctx, ctx, gen) for _ in range(2)]
        outs = [torch.empty((s["T"], H, D), device="cuda", dtype=DTYPE) for s in sets]
        d0 = dense_kv(sets[0], B, ctx)
        ref = sdpa_decode(sets[0]["q"], *d0) if kind == "decode" else sdpa_prefill(sets[0]["q"], *d0)
        del d0
        fa3 = [fa3_callable(s, q_len, ctx) for s in sets]
        t_fa3 = float("nan")
        if all(f is not None for f in fa3) and rel(fa3[0](), ref) < 2e-2:
            t_fa3 = bench(fa3)
        del fa3
        base_out = {}
        for name in names:
            cfg_name, _, policy = name.partition("@")
            cfg, policy = vs[cfg_name], policy or "strict"
            if policy == "off" and cfg_name in KINDS_ORDER:
                # The production config of policy off's binary (config.kernel_config).
                cfg = kcfg.kernel_config(D, H // HKV, "bfloat16", kind=cfg_name, const_time=False)
            if kind == "prefill" and cfg.block_m < 64:
                continue  # decode-only tiles: a prefill on mma.sync tiles is not a candidate
            t = err = float("nan")
            same = None
            try:
                outs[0].fill_(float("nan"))
                o = run_ours(sets[0], outs[0], policy, _config=cfg)
                err = rel(o, ref)
                # Variants that change only pipelining/loop structure must give the bits of their kind.
                root = cfg_name.split("_")[0]
                if name in KINDS_ORDER:
                    base_out[name] = o.clone()
                elif root in base_out:
                    same = bool(torch.equal(o.view(torch.int16), base_out[root].view(torch.int16)))
                if err < 2e-2:
                    t = bench([lambda s=s, o=o, c=cfg, p=policy: run_ours(s, o, p, _config=c)
                               for s, o in zip(sets, outs)])
                else:
                    print(f"variant {name} WRONG on {kind} B={B} ctx={ctx}: rel err {err}", flush=True)
            except Exception as e:  # a variant that does not compile is a finding, not a crash
                print(f"variant {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(variant=name, kind=kind, B=B, ctx=ctx, us=t, rel_err=err, us_fa3=t_fa3,
                             fa3_over=t_fa3 / t, same_bits=same))
            print(json.dumps(rows[-1]), flush=True)
        del sets, outs, ref
        torch.cuda.empty_cache()
    return rows


def profile_one(name, gen, B=64, ctx=4096, seq_len=None, launches=3):
    """A few launches of one variant on one decode shape (to run under ncu).

    ``seq_len``: the true length of every request inside the bucket ``ctx``
    (default ctx): compare counters of the shortest and longest class (G1).
    """
    s = make_set(B, 1, ctx if seq_len is None else seq_len, ctx, gen)
    out = torch.empty((s["T"], H, D), device="cuda", dtype=DTYPE)
    cfg_name, _, policy = name.partition("@")
    for _ in range(launches):
        run_ours(s, out, policy or "strict", _config=variants()[cfg_name])
    torch.cuda.synchronize()


def inspect_binaries(out_dir):
    """HGMMA / branches / spills / division in the compiled kernels that ran."""
    from benchmarks.offline_sass import summarize
    from dhp_backend.ops.triton import kernels

    report = []
    shown = False
    for fn in (kernels.attention_kernel, kernels.merge_kernel):
        for v in fn.device_caches.values():
            for ck in v[0].values():
                info = summarize(ck)
                info["kernel"] = fn.__name__
                branches = info.pop("branches")
                info["n_branches"] = len(branches)
                report.append(info)
                print(json.dumps(info, default=str), flush=True)
                if fn is kernels.attention_kernel and not shown and info["hgmma"]:
                    shown = True
                    print("attention_kernel branches:", branches, flush=True)
                    if out_dir:
                        with open(os.path.join(out_dir, "attention_kernel.sass"), "w") as f:
                            f.write(ck.asm["sass"])
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time tile/split variants")
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--variants", help="comma-separated variant names for --sweep (default: all)")
    ap.add_argument("--sweep-kinds", help="comma-separated shape kinds for --sweep: decode, prefill (default: both)")
    ap.add_argument("--profile", metavar="VARIANT", help="only launch VARIANT (NAME[@POLICY]) a few times (for ncu)")
    ap.add_argument("--profile-shape", default="64,4096,4096", help="B,bucket,true length for --profile")
    ap.add_argument("--skip-padding", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.profile:
        B, L, n = (int(x) for x in args.profile_shape.split(","))
        profile_one(args.profile, gen, B=B, ctx=L, seq_len=n)
        return 0
    props = torch.cuda.get_device_properties(0)
    res = dict(date=time.strftime("%Y-%m-%d"), device=props.name, sms=props.multi_processor_count,
               torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(res), flush=True)
    res["copy_GBps"] = copy_bandwidth()
    print(f"device copy bandwidth (read+write): {res['copy_GBps']:.0f} GB/s", flush=True)
    if not args.skip_shapes:
        res["shapes"] = shape_rows(args, gen)
    res["padding"] = [] if args.skip_padding else padding_rows(gen)
    if args.sweep:
        res["sweep"] = sweep_rows(gen, args.variants.split(",") if args.variants else None,
                                  args.sweep_kinds.split(",") if args.sweep_kinds else None)
    try:
        res["binaries"] = inspect_binaries(args.out)
    except Exception as e:  # noqa: BLE001 - the timing table matters more
        print(f"binary inspection failed: {type(e).__name__}: {e}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "quick_kernel_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("\n| shape | B | ctx | ours us | FA3 us | ours/FA3 | SDPA us | ours/SDPA | ours KV GB/s | rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res.get("shapes", []):
        fa3 = "not available" if math.isnan(r["us_fa3"]) else f"{r['us_fa3']:.1f}"
        print(f"| {r['kind']} | {r['B']} | {r['ctx']} | {r['us_ours']:.1f} | {fa3} | {r['ours_over_fa3']:.2f} | "
              f"{r['us_sdpa']:.1f} | {r['ratio']:.2f} | {r['kv_GBps_ours']:.0f} | {r['rel_err']:.1e} |")
    if res.get("sweep"):
        names = list(dict.fromkeys(r["variant"] for r in res["sweep"]))
        heads = " | ".join(f"{k} B={b} ctx={c}" for k, b, c in SWEEP_SHAPES)
        print("\n| variant (us; FA3 time / ours) | " + heads + " |")
        print("| --- |" + " --- |" * len(SWEEP_SHAPES))
        fa3 = {(r["kind"], r["B"], r["ctx"]): r["us_fa3"] for r in res["sweep"]}
        print("| FA3 | " + " | ".join(f"{fa3.get(sh, float('nan')):.1f}" for sh in SWEEP_SHAPES) + " |")
        for n in names:
            t = {(r["kind"], r["B"], r["ctx"]): r for r in res["sweep"] if r["variant"] == n}
            cells = []
            for sh in SWEEP_SHAPES:
                r = t.get(sh)
                differs = " ≠bits" if r is not None and r.get("same_bits") is False else ""
                cells.append("-" if r is None else f"{r['us']:.1f} ({r['fa3_over']:.2f}){differs}")
            print(f"| {n} | " + " | ".join(cells) + " |")
    for r in res["padding"]:
        print(f"padding B={r['B']} L={r['L']}: short {r['us_short']:.1f} us, long {r['us_long']:.1f} us, "
              f"ratio {r['short_over_long']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
