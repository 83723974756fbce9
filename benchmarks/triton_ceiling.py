"""What Triton reaches on Hopper when it may use TMA and automatic warp specialisation.

    python -m benchmarks.triton_ceiling [--out DIR] [--seq 4096]

A measurement for issue 4's "show precisely what stands in the way", not a
production kernel: policy off semantics only (true lengths, no
constant-time structure), one request, causal or full, Llama-3-8B heads.

Why it exists: DHP's kernels gather K/V with `cp.async` (pointer loads) and
Triton 3.6 pipelines them in the same warps that run the softmax; FA3 loads
with TMA in a producer warpgroup and overlaps. Triton 3.6 has a Hopper
warp-specialisation pass (`tl.range(..., warp_specialize=True)`), but offline
compiles (sm_90) show it only applies with ``num_warps=4`` (it then runs 12
warps: one producer and two 64-row consumer warpgroups), only when the loop's
loads are tensor-descriptor (TMA) loads, and that it aborts ("Unexpected op")
when one loop iteration holds two K or two V descriptor loads with their own
dots. A paged cache with 16-token pages gives a TMA box of at most one page, so
the variants below are the shapes that pass the compiler:

- ``dense_ws``: contiguous K/V (identity block table), one 128-row box per KV
  step: the tutorial structure, the ceiling of Triton here. ``dense_ws_full``:
  causal over the whole sequence (same trip count in every program).
- ``dense_nows``: the same kernel without warp specialisation (8 warps).
- ``dense16_ws``: contiguous, 16-row boxes (a page's size) without the table.
- ``paged16_ws``: one 16-token page per KV step (box 16 x D), any block table;
  ``paged16_nows`` without warp specialisation.
- ``paged32_ws``: two pages per KV step, joined in registers into one 32-row tile.

Measured on an H200 (docs/perf-notes.md change 16): dense_ws full attention is
0.90-0.98 of FA3; every other warp-specialised variant (causal mask, 16-row
boxes, joined pages) gives wrong results or NaN on the GPU while the
interpreter and the non-WS builds of the same code are right.

Every variant is checked against SDPA before it is timed, next to FA3 on the
same tensors (NHD pages, vLLM's layout, as FA3 takes them).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from benchmarks.timer import CudaTimer

H, HKV, D, BS = 32, 8, 128, 16
GROUP = H // HKV
BLOCK_M = 128
LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(q, k_t, v, m_i, l_i, acc, qk_scale, pos, rows, MASK: tl.constexpr):
    """One online-softmax step on a [BLOCK_M, n] score tile (k_t is K transposed)."""
    qk = tl.dot(q, k_t)
    if MASK:
        qk = tl.where(pos[None, :] <= rows[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _page_row(bt_ptr, page):
    # Row of the [num_blocks * BS, HKV * D] view where a page starts.
    return tl.load(bt_ptr + page) * 16


@triton.jit
def _two_pages(desc, r0, r1, col, BN: tl.constexpr, D: tl.constexpr):
    # Pages at rows r0 and r1 stacked into one [BN, D] tile (in registers).
    return tl.reshape(tl.permute(tl.join(desc.load([r0, col]), desc.load([r1, col])), (2, 0, 1)), (BN, D))


@triton.jit
def _kv_tile(kd, vd, bt_ptr, it, kvh, BN: tl.constexpr, D: tl.constexpr, PAGED: tl.constexpr,
             JOIN: tl.constexpr):
    """K^T and V of KV step ``it``: pages through the block table (PAGED; JOIN: two
    16-row pages joined in registers) or BN contiguous rows (identity table)."""
    if PAGED:
        if JOIN:
            r0 = _page_row(bt_ptr, it * 2)
            r1 = _page_row(bt_ptr, it * 2 + 1)
            k_t = _two_pages(kd, r0, r1, kvh * D, BN, D).T
            v = _two_pages(vd, r0, r1, kvh * D, BN, D)
        else:
            r0 = _page_row(bt_ptr, it)
            k_t = kd.load([r0, kvh * D]).T
            v = vd.load([r0, kvh * D])
    else:
        k_t = kd.load([it * BN, kvh * D]).T
        v = vd.load([it * BN, kvh * D])
    return k_t, v


@triton.jit
def ceiling_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, S, num_blocks, qk_scale,
                   BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
                   CAUSAL: tl.constexpr, PAGED: tl.constexpr, JOIN: tl.constexpr, WS: tl.constexpr,
                   FULL: tl.constexpr):
    """One 128-row query tile of one head (see `_kv_tile` for PAGED/JOIN).

    Causal: one masked loop up to the tile's diagonal; with FULL, over the whole
    sequence (the same trip count in every program, twice the work). A second
    loop for the diagonal tile alone (plain or warp-specialised) makes Triton
    3.6's Hopper pass abort (a dominance assertion, offline sm_90 compile)."""
    n_m = tl.cdiv(S, BM)
    start_m = n_m - 1 - tl.program_id(0)  # heavy causal tiles first
    h = tl.program_id(1)
    kvh = h // GROUP
    H: tl.constexpr = HKV * GROUP
    qd = tl.make_tensor_descriptor(q_ptr, shape=[S, H * D], strides=[H * D, 1], block_shape=[BM, D])
    od = tl.make_tensor_descriptor(o_ptr, shape=[S, H * D], strides=[H * D, 1], block_shape=[BM, D])
    box: tl.constexpr = 16 if PAGED else BN
    kd = tl.make_tensor_descriptor(k_ptr, shape=[num_blocks * 16, HKV * D], strides=[HKV * D, 1],
                                   block_shape=[box, D])
    vd = tl.make_tensor_descriptor(v_ptr, shape=[num_blocks * 16, HKV * D], strides=[HKV * D, 1],
                                   block_shape=[box, D])
    q = qd.load([start_m * BM, h * D])
    rows = start_m * BM + tl.arange(0, BM)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if CAUSAL and not FULL:
        hi = (start_m + 1) * BM
    else:
        hi = S
    for it in tl.range(0, hi // BN, warp_specialize=WS):
        k_t, v = _kv_tile(kd, vd, bt_ptr, it, kvh, BN, D, PAGED, JOIN)
        m_i, l_i, acc = _softmax_step(q, k_t, v, m_i, l_i, acc, qk_scale, it * BN + tl.arange(0, BN), rows,
                                      CAUSAL)
    od.store([start_m * BM, h * D], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


def _v(bn, paged=False, join=False, ws=True, warps=4, stages=2, full=False):
    return dict(BN=bn, PAGED=paged, JOIN=join, WS=ws, FULL=full, num_warps=warps, num_stages=stages)


# Warp-specialised variants run num_warps=4 (the pass's condition; 12 warps result).
# dense_ws_s3 is out of shared memory (262,680 B > 232,448 B on an H200).
VARIANTS = {
    "dense_ws": _v(128),
    "dense_ws_full": _v(128, full=True),
    "dense_nows": _v(128, ws=False, warps=8),
    "dense16_ws": _v(16, stages=3),
    "paged16_ws": _v(16, paged=True, stages=3),
    "paged32_ws": _v(32, paged=True, join=True, stages=3),
    "paged16_nows": _v(16, paged=True, ws=False, warps=8, stages=3),
}


def compile_offline(name, causal=True):
    """Compile one variant for sm_90 without a GPU (to check the pass applies)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    v = dict(VARIANTS[name])
    opts = {"num_warps": v.pop("num_warps"), "num_stages": v.pop("num_stages")}
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "bt_ptr": "*i32",
           "S": "i32", "num_blocks": "i32", "qk_scale": "fp32"}
    const = dict(BM=BLOCK_M, D=D, HKV=HKV, GROUP=GROUP, CAUSAL=causal, **v)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    return triton.compile(ASTSource(ceiling_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


def run_variant(name, q, kc, vc, table, out, causal):
    """q [S, H, D]; kc/vc NHD pages [num_blocks, BS, HKV, D]; table [max_blocks] (one request)."""
    S = q.shape[0]
    grid = (triton.cdiv(S, BLOCK_M), H)
    ceiling_kernel[grid](q, kc, vc, out, table, S, kc.shape[0], D ** -0.5 * LOG2E,
                         BM=BLOCK_M, D=D, HKV=HKV, GROUP=GROUP, CAUSAL=causal, **VARIANTS[name])
    return out


def make_inputs(S, gen, contiguous, device="cuda", dtype=torch.bfloat16):
    nb = S // BS
    num_blocks = nb + 64
    kc = torch.randn(num_blocks, BS, HKV, D, generator=gen, device=device).to(dtype)
    vc = torch.randn(num_blocks, BS, HKV, D, generator=gen, device=device).to(dtype)
    if contiguous:
        table = torch.arange(nb, device=device, dtype=torch.int32)
    else:
        table = torch.randperm(num_blocks, generator=gen, device=device)[:nb].to(torch.int32)
    q = torch.randn(S, H, D, generator=gen, device=device).to(dtype)
    return dict(q=q, kc=kc, vc=vc, table=table)


def check_interpreted(S=128):
    """Each variant's result against SDPA under the Triton CPU interpreter (set
    TRITON_INTERPRET=1 before triton is imported): fp16, since the interpreter's
    dot cannot multiply bf16. Returns {(variant, table, causal): relative error}."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    gen = torch.Generator().manual_seed(0)
    errs = {}
    for contiguous in (True, False):
        s = make_inputs(S, gen, contiguous, device="cpu", dtype=torch.float16)
        for causal in (True, False):
            ref = sdpa_ref(s, causal).float()
            for name, v in VARIANTS.items():
                if v["PAGED"] or contiguous:
                    out = run_variant(name, s["q"], s["kc"], s["vc"], s["table"], torch.empty_like(s["q"]), causal)
                    key = (name, "identity" if contiguous else "random", causal)
                    errs[key] = float((out.float() - ref).norm() / ref.norm())
    return errs


def sdpa_ref(s, causal):
    S = s["q"].shape[0]
    ids = s["table"].long()
    k = s["kc"][ids].reshape(-1, HKV, D)[:S].transpose(0, 1).repeat_interleave(GROUP, 0)
    v = s["vc"][ids].reshape(-1, HKV, D)[:S].transpose(0, 1).repeat_interleave(GROUP, 0)
    o = torch.nn.functional.scaled_dot_product_attention(s["q"].transpose(0, 1), k, v, is_causal=causal,
                                                         scale=D ** -0.5)
    return o.transpose(0, 1)


def fa3_fn(s, causal):
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - anchor absent: the row says so
        return None
    S = s["q"].shape[0]
    cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
    sl = torch.tensor([S], device="cuda", dtype=torch.int32)
    out = torch.empty_like(s["q"])
    bt = s["table"][None, :]
    return lambda: flash_attn_varlen_func(s["q"], s["kc"], s["vc"], max_seqlen_q=S, cu_seqlens_q=cu,
                                          max_seqlen_k=S, seqused_k=sl, causal=causal, softmax_scale=D ** -0.5,
                                          block_table=bt, fa_version=3, out=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (Hopper); on a CPU, tests/test_triton_ceiling.py checks the kernels "
                 "in the interpreter")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # The harness's timer: CUDA events per launch, rotating over the sets, each
    # chunk queued behind a GPU spin so that host enqueue time is not measured.
    timer = CudaTimer(reps=90, warmup=3)
    rows = []
    total = len(args.seq) * 2 * 2 * (len(names) + 1)
    done = 0
    t0 = time.time()
    for S in args.seq:
        for causal in (True, False):
            flop = 4 * H * D * (S * (S + 1) / 2 if causal else S * S)
            for contiguous in (True, False):
                # Three sets rotate: each holds 2 x S x 8 x 128 x 2 B of K/V, 3 sets > L2 at S >= 8K.
                sets = [make_inputs(S, gen, contiguous) for _ in range(3)]
                ref = sdpa_ref(sets[0], causal).float()
                cands = [("fa3", fa3_fn)] + [(n, None) for n in names]
                for name, mk in cands:
                    done += 1
                    row = dict(variant=name, S=S, causal=causal, table="identity" if contiguous else "random",
                               us=float("nan"), tflops=float("nan"), rel_err=float("nan"))
                    if name != "fa3" and not VARIANTS[name]["PAGED"] and not contiguous:
                        continue  # dense variants read rows, not pages: identity table only
                    try:
                        if mk is not None:
                            fns = [mk(s, causal) for s in sets]
                            if fns[0] is None:
                                row["error"] = "not available"
                                raise LookupError
                        else:
                            outs = [torch.empty_like(s["q"]) for s in sets]
                            fns = [lambda s=s, o=o, n=name: run_variant(n, s["q"], s["kc"], s["vc"], s["table"],
                                                                        o, causal) for s, o in zip(sets, outs)]
                        o = fns[0]()
                        torch.cuda.synchronize()
                        err = float((o.float() - ref).norm() / ref.norm())
                        row["rel_err"] = err
                        if err < 2e-2:
                            row["us"] = timer.measure(fns).median_ms * 1e3
                            row["tflops"] = flop / row["us"] / 1e6
                        else:
                            row["error"] = "wrong result"
                    except LookupError:
                        pass
                    except Exception as e:  # noqa: BLE001 - a variant that fails is a finding
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(f"[{done}/{total} {time.time() - t0:5.0f}s] " + json.dumps(row), flush=True)
                del sets
                torch.cuda.empty_cache()
    # Ratios to FA3 on the same shape and table.
    fa3 = {(r["S"], r["causal"], r["table"]): r["us"] for r in rows if r["variant"] == "fa3"}
    for r in rows:
        r["fa3_over"] = fa3.get((r["S"], r["causal"], r["table"]), float("nan")) / r["us"]
    print(f"\n{'variant':15s} {'S':>6s} {'causal':>6s} {'table':>8s} {'us':>9s} {'TFLOP/s':>8s} {'x FA3':>6s}")
    for r in rows:
        print(f"{r['variant']:15s} {r['S']:6d} {str(r['causal']):>6s} {r['table']:>8s} {r['us']:9.1f} "
              f"{r['tflops']:8.1f} {r['fa3_over']:6.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                    commit=os.environ.get("DHP_COMMIT", ""), date=time.strftime("%Y-%m-%d"))
        with open(os.path.join(args.out, "triton_ceiling.json"), "w") as f:
            # NaN (untimed rows) as null: strict JSON readers reject NaN.
            clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
            json.dump(dict(meta=meta, rows=clean), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
