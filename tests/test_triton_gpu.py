"""The Triton kernels on a CUDA GPU: accuracy over many random steps, bitwise
repeatability, batch invariance over batch sizes 1..256, identical bits across
policies and split modes, and prefill-vs-decode bits.

Run in its own process (``pytest tests/test_triton_gpu.py -m gpu``): the
interpreter tests set TRITON_INTERPRET=1 for the whole process. With
DHP_REPORT_DIR set, the per-spec errors are written there as a table.
"""

import os
import random

import pytest
import torch

from triton_steps import (
    Request, assemble, bits, cdiv, check_written, drop_pages_below_window, make_request, poisoned_out, random_sinks,
    rank_step, reference, rel_err,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (name, H, Hkv, D, block_size, dtypes)
CONFIGS = [
    ("llama3-8b", 32, 8, 128, 16, (torch.bfloat16, torch.float16)),
    ("mha-d128", 16, 16, 128, 16, (torch.float16,)),
    ("gqa8-d64-bs32", 16, 2, 64, 32, (torch.bfloat16,)),
    ("mqa-d128-bs64", 8, 1, 128, 64, (torch.float16,)),
    ("g7-d128", 28, 4, 128, 16, (torch.bfloat16,)),
    ("d256-bs128", 8, 2, 256, 128, (torch.bfloat16,)),
    ("d80-bs32", 20, 4, 80, 32, (torch.float16,)),
    ("d96-g3", 12, 4, 96, 16, (torch.bfloat16,)),
]
POLICIES = ("strict", "request", "off")


@pytest.fixture(autouse=True)
def _compiled_not_interpreted(monkeypatch):
    """The kernels must be compiled, not interpreted: Triton decides when the
    kernel module is first imported, from TRITON_INTERPRET. tests/conftest.py
    sets that variable for every module named *triton*; drop it here, and skip
    if the interpreter tests already imported the kernels in this process."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import sys

    mod = sys.modules.get("dhp_backend.ops.triton.kernels")
    if mod is not None and type(mod.attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("the kernels were imported under the interpreter in this process; "
                    "run tests/test_triton_gpu.py in its own process")


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _run(step, *, policy, causal=True, mode=None, bucket="auto", tiling=None, config=None, **features):
    from dhp_backend.ops.triton import paged_attention_triton

    D = step.query.shape[2]
    out = poisoned_out(step)
    b = step.bucket(policy) if bucket == "auto" else bucket
    paged_attention_triton(*step.args(), out, scale=D ** -0.5, causal=causal, num_tokens=step.num_tokens,
                           policy=policy, bucket=b, _mode=mode, _tiling=tiling, _config=config, **features)
    return out


def _random_lens(rng, R, max_ctx):
    out = []
    for _ in range(R):
        kind = rng.random()
        if kind < 0.55:  # decode
            s = rng.randint(1, max_ctx)
            out.append((1, s))
        elif kind < 0.75:  # whole prompt
            q = rng.randint(1, min(512, max_ctx))
            out.append((q, q))
        else:  # prefill chunk on cached context
            q = rng.randint(1, min(256, max_ctx))
            out.append((q, rng.randint(q, max_ctx)))
    return out


def _specs():
    rng = random.Random(1234)
    specs = []
    for i in range(220):
        name, H, Hkv, D, BS, dtypes = CONFIGS[i % len(CONFIGS)]
        long = name == "llama3-8b" and i % 16 == 0
        max_ctx = 32768 if long else rng.choice([64, 300, 1500, 4096])
        R = rng.randint(1, 4 if long else 12)
        specs.append(dict(
            i=i, name=name, H=H, Hkv=Hkv, D=D, BS=BS, dtype=dtypes[(i // len(CONFIGS)) % len(dtypes)],
            causal=rng.random() < 0.9 or name not in ("llama3-8b", "gqa8-d64-bs32"),
            policy=rng.choice(POLICIES), lens=_random_lens(rng, R, max_ctx), pad=rng.choice([0, 0, 1, 3]),
        ))
    return specs


def test_random_specs_match_reference():
    rows = []
    failures = []
    for sp in _specs():
        g = _gen(sp["i"])
        reqs = [make_request(q, s, H=sp["H"], Hkv=sp["Hkv"], D=sp["D"], dtype=sp["dtype"], gen=g)
                for q, s in sp["lens"]]
        step = assemble(reqs, block_size=sp["BS"], pad_tokens=sp["pad"], gen=g)
        out = _run(step, policy=sp["policy"], causal=sp["causal"])
        check_written(step, out)
        ref = reference(step, scale=sp["D"] ** -0.5, causal=sp["causal"])
        n = int(step.query_start_loc[-1])
        err = rel_err(out, ref, n) if n else 0.0
        rows.append((sp["i"], sp["name"], str(sp["dtype"]).split(".")[-1], sp["policy"], sp["causal"],
                     len(sp["lens"]), n, max(s for _, s in sp["lens"]), err))
        if not err < TOL[sp["dtype"]]:
            failures.append(rows[-1])
    _report("accuracy.tsv", "i\tconfig\tdtype\tpolicy\tcausal\treqs\ttokens\tmax_seq\trel_err", rows)
    by = {}
    for r in rows:
        by.setdefault(r[2], []).append(r[-1])
    for dt, errs in sorted(by.items()):
        print(f"{dt}: {len(errs)} specs, max rel err {max(errs):.2e}, mean {sum(errs) / len(errs):.2e}")
    assert len(rows) >= 200
    assert not failures, failures[:5]


def test_fp32_matches_reference():
    g = _gen(77)
    reqs = [make_request(q, s, H=8, Hkv=2, D=128, dtype=torch.float32, gen=g)
            for q, s in [(1, 700), (33, 90), (1, 5)]]
    step = assemble(reqs, block_size=16, pad_tokens=2, gen=g)
    out = _run(step, policy="strict")
    check_written(step, out)
    assert rel_err(out, reference(step, scale=128 ** -0.5, causal=True), 35) < TOL[torch.float32]


def _llama_mixed_step(seed, dtype=torch.bfloat16):
    g = _gen(seed)
    # Small enough that the forced split mode fits the workspace.
    lens = [(1, 2000), (1, 4095), (1, 17), (100, 1200), (1, 3000), (64, 64), (1, 1)]
    reqs = [make_request(q, s, H=32, Hkv=8, D=128, dtype=dtype, gen=g) for q, s in lens]
    return assemble(reqs, block_size=16, pad_tokens=2, gen=g)


@pytest.mark.parametrize("mode", ["fold", "split"])
def test_bitwise_repeatable_100_runs(mode):
    step = _llama_mixed_step(5)
    first = bits(_run(step, policy="strict", mode=mode)).clone()
    for _ in range(99):
        assert torch.equal(bits(_run(step, policy="strict", mode=mode)), first)


def test_bits_equal_across_policies_and_modes():
    step = _llama_mixed_step(6)
    outs = [_run(step, policy=p, mode=m, tiling=t) for p in POLICIES for t in ("request", "token")
            for m in ("fold", "split", None)]
    for o in outs[1:]:
        assert torch.equal(bits(outs[0]), bits(o))


def _tile_configs(H, Hkv, D, dtype_name):
    """The production config of each step kind, plus the 64-row wgmma decode tile
    and 16-row tiles on 2 and 1 warps (the layouts a 16-row mma.sync tile can take)."""
    import dataclasses

    from dhp_backend.ops import tiles as kcfg

    g = H // Hkv
    cfgs = {k: kcfg.kernel_config(D, g, dtype_name, kind=k) for k in kcfg.STEP_KINDS}
    mixed = cfgs["mixed"]
    if mixed.block_m == 64:
        cfgs["decode-m64"] = dataclasses.replace(mixed, num_stages=3)
        m16 = dataclasses.replace(mixed, block_m=16, block_q=16 // g, num_stages=3)
        cfgs["m16-w2"] = dataclasses.replace(m16, num_warps=2)
        cfgs["m16-w1"] = dataclasses.replace(m16, num_warps=1)
    return cfgs


def test_bits_equal_across_step_kinds():
    """The decode (16-row mma.sync tile, 3 stages), mixed and prefill (128-row
    tile, 8 warps) configs, picked from the step geometry, and the 64-row decode
    tile compute every row with the same bits, in both tilings and split modes,
    on a step with decodes, a prompt and a chunk."""
    step = _llama_mixed_step(13)
    outs = []
    for kind, cfg in _tile_configs(32, 8, 128, "bfloat16").items():
        for tiling in ("request", "token"):
            for mode in ("fold", "split"):
                out = _run(step, policy="strict", mode=mode, tiling=tiling, config=cfg)
                check_written(step, out)
                outs.append(((kind, tiling, mode), bits(out).clone()))
    for key, o in outs[1:]:
        assert torch.equal(outs[0][1], o), f"{key} differs from {outs[0][0]}"


@pytest.mark.parametrize("shape", [(32, 8, 128, torch.bfloat16), (32, 8, 128, torch.float16),
                                   (16, 2, 64, torch.bfloat16), (16, 16, 128, torch.float16),
                                   (32, 2, 128, torch.bfloat16)],
                         ids=["g4-d128-bf16", "g4-d128-fp16", "g8-d64-bf16", "g1-d128-fp16",
                              "g16-d128-bf16"])
def test_split_states_bits_equal_across_tile_configs(shape):
    """Stronger than comparing bf16 outputs (which hide fp32 differences of an
    ulp or two): in split mode every config stores each split's fp32 state
    (acc, m, l) to the workspace; those must be bit-identical across tile configs
    (wgmma 64/128-row tiles, mma.sync 16-row tiles on 1, 2 or 4 warps), i.e.
    the same products, the same k16 accumulation order and the same row sums."""
    from dhp_backend.ops import workspace as wsp

    H, Hkv, D, dtype = shape
    g = _gen(21)
    lens = [(1, 2000), (1, 4095), (1, 17), (9, 1200), (1, 3000), (1, 1), (3, 700)]
    reqs = [make_request(q, s, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g) for q, s in lens]
    step = assemble(reqs, block_size=16, pad_tokens=1, gen=g)
    bucket = step.bucket("strict")
    ws, _, _ = wsp.reserve_workspace(step.query.device)
    dtype_name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    cfgs = _tile_configs(H, Hkv, D, dtype_name)
    first = None
    for kind, cfg in cfgs.items():
        n_split = cdiv(cdiv(bucket, cfg.block_n), cfg.tiles_per_split)
        n = n_split * step.num_tokens * H
        used = cdiv(n * D, 16) * 16 + cdiv(n, 16) * 16 + n
        for tiling in ("request", "token"):
            ws[:used].fill_(float("nan"))
            out = _run(step, policy="strict", mode="split", tiling=tiling, config=cfg)
            check_written(step, out)
            state = ws[:used].view(torch.int32).clone()
            assert not torch.isnan(ws[:D]).any(), "split 0 of token 0, head 0 was not written"
            if first is None:
                first = ((kind, tiling), state, bits(out).clone())
                continue
            assert torch.equal(first[1], state), f"split states of {kind}/{tiling} differ from {first[0]}"
            assert torch.equal(first[2], bits(out)), f"output of {kind}/{tiling} differs from {first[0]}"


@pytest.mark.parametrize("target_lens", [(7, 1800), (1, 1333)], ids=["chunk", "decode"])
def test_batch_invariance_sizes_1_to_256(target_lens):
    rng = random.Random(11)
    g = _gen(11)
    H, Hkv, D, BS = 32, 8, 128, 16
    dtype = torch.bfloat16
    pool = [make_request(*ql, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g) for ql in _random_lens(rng, 300, 2048)]
    target = make_request(*target_lens, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g)
    max_blocks = cdiv(2048, BS) + 1  # same table width in every step: same strict bucket

    def target_rows(others, pos, pad):
        reqs = others[:pos] + [target] + others[pos:]
        step = assemble(reqs, block_size=BS, pad_tokens=pad, gen=g, max_blocks=max_blocks)
        out = _run(step, policy="strict")
        check_written(step, out)
        start = sum(r.q_len for r in reqs[:pos])
        return bits(out[start: start + target.q_len]).clone()

    alone = target_rows([], 0, 0)
    sizes = list(range(1, 257))
    rng.shuffle(sizes)
    for B in sizes:
        others = rng.sample(pool, B - 1)
        got = target_rows(others, rng.randint(0, B - 1), rng.choice([0, 1, 5]))
        assert torch.equal(alone, got), f"batch size {B}"


def test_prefill_row_equals_decode_row():
    g = _gen(12)
    req = make_request(300, 1000, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=g)
    mb = cdiv(1000, 16) + 1
    out_pre = _run(assemble([req], block_size=16, gen=g, max_blocks=mb), policy="strict")
    ctx = 1000 - 300
    for i in (0, 1, 77, 299):
        dec = Request(q=req.q[i: i + 1], k=req.k[: ctx + i + 1], v=req.v[: ctx + i + 1])
        out_dec = _run(assemble([dec], block_size=16, gen=g, max_blocks=mb), policy="strict")
        assert torch.equal(bits(out_pre[i]), bits(out_dec[0])), f"row {i}"


def _report(name, header, rows):
    d = os.environ.get("DHP_REPORT_DIR")
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "w") as f:
        f.write(header + "\n")
        for r in rows:
            f.write("\t".join(f"{x:.3e}" if isinstance(x, float) else str(x) for x in r) + "\n")


@pytest.mark.parametrize("features", ["plain", "cap+sinks", "window+sinks"])
@pytest.mark.parametrize("policy", ["strict", "request", "off"])
def test_cuda_graph_replay_matches_eager(policy, features):
    """A step captured once replays correctly on new lengths and data (the CUDA-graph
    contract the adapter declares): replay bits == eager bits on the same inputs.

    Called through the seam as the vLLM adapter calls it (no host value checks),
    with the per-request bucket refilled in place under `request`.
    """
    from dhp_backend.ops import bucket_for_step, paged_attention
    from dhp_backend.ops.workspace import reserve_workspace

    reserve_workspace(torch.device("cuda", torch.cuda.current_device()))
    step = _llama_mixed_step(21)
    q, kc, vc, bt, qsl, sl = step.args()
    D = q.shape[2]
    cap = step.capacity
    req_buf = torch.empty(sl.shape[0], dtype=torch.int32, device="cuda")
    feats = {"plain": {}, "cap+sinks": dict(logits_soft_cap=30.0, sinks=random_sinks(q.shape[1], gen=_gen(23))),
             "window+sinks": dict(sliding_window=1024, sinks=random_sinks(q.shape[1], gen=_gen(23)))}[features]

    def bucket():
        if policy == "strict":
            return cap
        if policy == "off":
            return None
        return bucket_for_step("request", max_model_len=cap, seq_lens=sl, out=req_buf)

    out = poisoned_out(step)

    def launch(b):
        paged_attention(q, kc, vc, bt, qsl, sl, out, scale=D ** -0.5, causal=True, policy=policy, bucket=b,
                        num_tokens=step.num_tokens, path="triton", check_values=False, **feats)

    b = bucket()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        launch(b)
    torch.cuda.current_stream().wait_stream(side)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(b)

    # A new step with the same public geometry: shorter true lengths, new data, in place.
    g = _gen(22)
    sl.copy_(torch.tensor([900, 4000, 5, 150, 2999, 64, 1], dtype=torch.int32, device="cuda"))
    bucket()  # refills req_buf in place under `request`
    q[: step.num_tokens].copy_(torch.randn(q[: step.num_tokens].shape, generator=g, device="cuda").to(q.dtype))
    kc.copy_(torch.randn(kc.shape, generator=g, device="cuda").to(kc.dtype))
    vc.copy_(torch.randn(vc.shape, generator=g, device="cuda").to(vc.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    out.fill_(float("nan"))
    launch(bucket())
    torch.cuda.synchronize()
    check_written(step, replayed)
    assert torch.equal(bits(replayed), bits(out)), "graph replay differs from eager"
    assert not torch.equal(bits(replayed), bits(first)), "replay did not see the new inputs"


# --- model features: logits soft-cap and attention sinks (issue 31) ---------------------------
# Caps: 1.5 bites on every row of these random steps (scaled scores are O(1)), 30 and
# 50 (Gemma-2's) only on the largest scores.
FEATURE_CAPS = (None, 1.5, 30.0, 50.0)


def _feature_specs():
    rng = random.Random(4321)
    out = []
    for sp in _specs()[:64]:
        cap = FEATURE_CAPS[sp["i"] % len(FEATURE_CAPS)]
        sinks = cap is None or rng.random() < 0.5
        sink_dtype = rng.choice((torch.float32, sp["dtype"]))
        out.append(dict(sp, cap=cap, sinks=sinks, sink_dtype=sink_dtype))
    return out


def test_features_random_specs_match_reference():
    """Soft-cap and sinks on the Triton kernels vs the reference, over 64 random
    steps of every config, policy and step kind (as test_random_specs_match_reference)."""
    rows, failures = [], []
    for sp in _feature_specs():
        g = _gen(1000 + sp["i"])
        reqs = [make_request(q, s, H=sp["H"], Hkv=sp["Hkv"], D=sp["D"], dtype=sp["dtype"], gen=g)
                for q, s in sp["lens"]]
        step = assemble(reqs, block_size=sp["BS"], pad_tokens=sp["pad"], gen=g)
        feats = dict(logits_soft_cap=sp["cap"],
                     sinks=random_sinks(sp["H"], gen=g, dtype=sp["sink_dtype"]) if sp["sinks"] else None)
        out = _run(step, policy=sp["policy"], causal=sp["causal"], **feats)
        check_written(step, out)
        ref = reference(step, scale=sp["D"] ** -0.5, causal=sp["causal"], **feats)
        n = int(step.query_start_loc[-1])
        err = rel_err(out, ref, n) if n else 0.0
        rows.append((sp["i"], sp["name"], str(sp["dtype"]).split(".")[-1], sp["policy"], sp["cap"], sp["sinks"],
                     n, err))
        if not err < TOL[sp["dtype"]]:
            failures.append(rows[-1])
    _report("accuracy_features.tsv", "i\tconfig\tdtype\tpolicy\tcap\tsinks\ttokens\trel_err", rows)
    assert len(rows) == 64 and not failures, failures[:5]


FEATURES = {"cap": dict(logits_soft_cap=30.0), "sinks": dict(sinks="random"),
            "cap+sinks": dict(logits_soft_cap=50.0, sinks="random")}


def _features(name, H, seed):
    f = dict(FEATURES[name])
    if f.get("sinks") == "random":
        f["sinks"] = random_sinks(H, gen=_gen(seed))
    return f


@pytest.mark.parametrize("name", list(FEATURES))
def test_features_bits_equal_across_policies_modes_tilings_and_tile_configs(name):
    """The invariances of the plain kernels hold with the features: the same bits
    under every policy, split mode, tiling and step-kind tile config."""
    step = _llama_mixed_step(31)
    feats = _features(name, 32, 31)
    outs = [((p, t, m), _run(step, policy=p, mode=m, tiling=t, **feats)) for p in POLICIES
            for t in ("request", "token") for m in ("fold", "split", None)]
    for kind, cfg in _tile_configs(32, 8, 128, "bfloat16").items():
        for mode in ("fold", "split"):
            outs.append(((kind, mode), _run(step, policy="strict", mode=mode, config=cfg, **feats)))
    check_written(step, outs[0][1])
    ref = reference(step, scale=128 ** -0.5, causal=True, **feats)
    assert rel_err(outs[0][1], ref, int(step.query_start_loc[-1])) < TOL[torch.bfloat16]
    for key, o in outs[1:]:
        assert torch.equal(bits(outs[0][1]), bits(o)), f"{key} differs from {outs[0][0]}"


def test_sinks_of_minus_infinity_give_the_plain_bits():
    """The sink fold is exact for a head without a sink (-inf): the sinks binaries
    give the plain binaries' bits, in both split modes."""
    step = _llama_mixed_step(32)
    none = torch.full((32,), float("-inf"), device="cuda")
    for mode in ("fold", "split"):
        assert torch.equal(bits(_run(step, policy="strict", mode=mode)),
                           bits(_run(step, policy="strict", mode=mode, sinks=none))), mode


@pytest.mark.parametrize("target_lens", [(7, 1800), (1, 1333)], ids=["chunk", "decode"])
def test_features_batch_invariance(target_lens):
    rng = random.Random(33)
    g = _gen(33)
    H, Hkv, D, BS = 32, 8, 128, 16
    dtype = torch.bfloat16
    feats = _features("cap+sinks", H, 33)
    pool = [make_request(*ql, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g) for ql in _random_lens(rng, 300, 2048)]
    target = make_request(*target_lens, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=g)
    max_blocks = cdiv(2048, BS) + 1

    def target_rows(others, pos, pad):
        reqs = others[:pos] + [target] + others[pos:]
        step = assemble(reqs, block_size=BS, pad_tokens=pad, gen=g, max_blocks=max_blocks)
        out = _run(step, policy="strict", **feats)
        check_written(step, out)
        start = sum(r.q_len for r in reqs[:pos])
        return bits(out[start: start + target.q_len]).clone()

    alone = target_rows([], 0, 0)
    sizes = rng.sample(range(2, 257), 40)
    for B in sizes:
        got = target_rows(rng.sample(pool, B - 1), rng.randint(0, B - 1), rng.choice([0, 1, 5]))
        assert torch.equal(alone, got), f"batch size {B}"


def test_features_prefill_row_equals_decode_row():
    g = _gen(34)
    feats = _features("cap+sinks", 32, 34)
    req = make_request(300, 1000, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=g)
    mb = cdiv(1000, 16) + 1
    out_pre = _run(assemble([req], block_size=16, gen=g, max_blocks=mb), policy="strict", **feats)
    ctx = 1000 - 300
    for i in (0, 1, 77, 299):
        dec = Request(q=req.q[i: i + 1], k=req.k[: ctx + i + 1], v=req.v[: ctx + i + 1])
        out_dec = _run(assemble([dec], block_size=16, gen=g, max_blocks=mb), policy="strict", **feats)
        assert torch.equal(bits(out_pre[i]), bits(out_dec[0])), f"row {i}"


def test_features_route_by_head_size_through_the_seam():
    """Through ops.paged_attention on the GPU with the setting path: triton, a head-256 layer (Gemma-2) with a
    cap and sinks gives the Triton kernels' bits under every policy; with path auto the same features go to
    the csrc kernels' feature libraries at every head size the Triton kernels take, 256, 128, 96 and 64
    (tests/test_cuda_features_gpu.py and tests/test_cuda_head_sizes_gpu.py check their bits)."""
    from dhp_backend.ops import ProblemSpec, paged_attention, plan_step

    g = _gen(35)
    lens = [(1, 2000), (1, 17), (100, 1200), (64, 64), (1, 1)]
    step = assemble([make_request(q, s, H=16, Hkv=4, D=256, dtype=torch.bfloat16, gen=g) for q, s in lens],
                    block_size=16, pad_tokens=2, gen=g)
    feats = _features("cap+sinks", 16, 35)
    for policy in POLICIES:
        out = poisoned_out(step)
        paged_attention(*step.args(), out, scale=256 ** -0.5, causal=True, policy=policy,
                        bucket=step.bucket(policy), num_tokens=step.num_tokens, path="triton", **feats)
        assert torch.equal(bits(out), bits(_run(step, policy=policy, **feats))), policy
    for head_size, family in ((256, "cuda_"), (64, "cuda_"), (96, "cuda_"), (128, "cuda_")):
        spec = ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=head_size, num_heads=32, num_kv_heads=8,
                           block_size=16, device_capability=torch.cuda.get_device_capability(),
                           logits_soft_cap=50.0, sinks=True)
        for n, r in ((64, 64), (4096, 1), (300, 5)):
            for policy in POLICIES:
                p = plan_step(spec, policy, num_tokens=n, num_reqs=r, max_blocks=512,
                              bucket_l=8192 if policy == "strict" else None)
                assert p.kernel.startswith(family), (head_size, n, r, policy, p.describe())


@pytest.mark.parametrize("path", ["auto", "triton"])
@pytest.mark.parametrize("shape", [(32, 8), (8, 1)], ids=["llama3-8b-kv8", "mqa-kv1"])
def test_tensor_parallel_rank_bits_equal_the_head_slice(shape, path):
    """At TP = 2 a rank holds half the query heads and their KV heads (4 of Llama-3-8B's 8: whole
    GQA groups; an MQA model's one KV head, replicated, so the rank's group is half TP = 1's).
    Through the seam (path auto: the csrc kernels where they route) its output is the head slice
    of the TP = 1 output, bit for bit, in decode and mixed steps under every policy: attention
    never makes a model's bits depend on the TP size (its row-parallel matmuls do)."""
    from dhp_backend.ops import paged_attention

    H, Hkv = shape
    g = _gen(41)
    steps = {"decode": [(1, 1), (1, 700), (1, 1333), (1, 2048), (1, 90)],
             "mixed": [(1, 1800), (37, 37), (7, 900), (1, 3)]}
    for kind, lens in steps.items():
        reqs = [make_request(q, s, H=H, Hkv=Hkv, D=128, dtype=torch.bfloat16, gen=g) for q, s in lens]
        step = assemble(reqs, block_size=16, gen=g, max_blocks=160, pad_tokens=3)
        n = step.num_tokens
        for policy in POLICIES:
            def seam(s):
                out = poisoned_out(s)
                paged_attention(*s.args(), out, scale=128 ** -0.5, causal=True, policy=policy,
                                bucket=s.bucket(policy), max_model_len=s.capacity, num_tokens=n, path=path)
                check_written(s, out)
                return out[:n]

            full = seam(step)
            for rank in range(2):
                part, heads = rank_step(step, 2, rank)
                assert torch.equal(bits(seam(part)), bits(full[:, heads].contiguous())), (kind, policy, rank)
# --- model features: sliding windows (issue 31) --------------------------------------------
# (name, H, Hkv, D, block_size, window, sinks): the models' shapes and windows
WINDOW_CONFIGS = [
    ("mistral-7b-w4096", 32, 8, 128, 16, 4096, False),
    ("gemma3-12b-w1024", 16, 8, 256, 16, 1024, False),
    ("gpt-oss-w128-sinks", 64, 8, 64, 16, 128, True),
    ("llama-shape-w128-bs64", 32, 8, 128, 64, 128, False),
]


def _window_specs():
    rng = random.Random(2468)
    out = []
    for i in range(48):
        name, H, Hkv, D, BS, W, sinks = WINDOW_CONFIGS[i % len(WINDOW_CONFIGS)]
        max_ctx = rng.choice([W // 2 + 1, W + 300, 8192])
        out.append(dict(i=i, name=name, H=H, Hkv=Hkv, D=D, BS=BS, W=W, sinks=sinks, policy=POLICIES[i % 3],
                        lens=_random_lens(rng, rng.randint(1, 6), max_ctx), pad=rng.choice([0, 0, 1, 3]),
                        cap=rng.choice((None, None, 50.0)), null_pages=i % 3 == 2 and rng.random() < 0.7))
    return out


def test_window_random_specs_match_reference():
    """Windowed layers of Mistral, Gemma-3, gpt-oss (with sinks) shapes in bf16 vs
    the reference, contexts up to 8192 (below, around and far past the window),
    every policy and step kind; under off often with vLLM's null pages below the
    window."""
    rows, failures = [], []
    for sp in _window_specs():
        g = _gen(3000 + sp["i"])
        reqs = [make_request(q, s, H=sp["H"], Hkv=sp["Hkv"], D=sp["D"], dtype=torch.bfloat16, gen=g)
                for q, s in sp["lens"]]
        step = assemble(reqs, block_size=sp["BS"], pad_tokens=sp["pad"], gen=g)
        feats = dict(sliding_window=sp["W"], logits_soft_cap=sp["cap"],
                     sinks=random_sinks(sp["H"], gen=g) if sp["sinks"] else None)
        if sp["null_pages"]:
            step = drop_pages_below_window(step, sp["W"], gen=g)
        out = _run(step, policy=sp["policy"], **feats)
        check_written(step, out)
        ref = reference(step, scale=sp["D"] ** -0.5, causal=True, **feats)
        n = int(step.query_start_loc[-1])
        err = rel_err(out, ref, n) if n else 0.0
        rows.append((sp["i"], sp["name"], sp["policy"], sp["null_pages"], sp["cap"], n,
                     max(s for _, s in sp["lens"]), err))
        if not err < TOL[torch.bfloat16]:
            failures.append(rows[-1])
    _report("accuracy_window.tsv", "i\tconfig\tpolicy\tnull_pages\tcap\ttokens\tmax_seq\trel_err", rows)
    assert len(rows) == 48 and not failures, failures[:5]


@pytest.mark.parametrize("window", [128, 1024, 4096])
def test_window_bits_equal_across_policies_modes_tilings_tile_configs_and_null_pages(window):
    """The plain kernels' invariances with a window: the same bits under every
    policy (off's walk from the window, strict/request's whole bucket), split mode,
    tiling and tile config, and under off with the null block below the window."""
    step = _llama_mixed_step(41)
    feats = dict(sliding_window=window, sinks=random_sinks(32, gen=_gen(41)))
    outs = [((p, t, m), _run(step, policy=p, mode=m, tiling=t, **feats)) for p in POLICIES
            for t in ("request", "token") for m in ("fold", "split", None)]
    for kind, cfg in _tile_configs(32, 8, 128, "bfloat16").items():
        for mode in ("fold", "split"):
            outs.append(((kind, mode), _run(step, policy="strict", mode=mode, config=cfg, **feats)))
    dropped = drop_pages_below_window(step, window, gen=_gen(42))
    for t in ("request", "token"):
        for m in ("fold", "split"):
            outs.append((("off, null pages", t, m), _run(dropped, policy="off", mode=m, tiling=t, **feats)))
    check_written(step, outs[0][1])
    ref = reference(step, scale=128 ** -0.5, causal=True, **feats)
    assert rel_err(outs[0][1], ref, int(step.query_start_loc[-1])) < TOL[torch.bfloat16]
    for key, o in outs[1:]:
        assert torch.equal(bits(outs[0][1]), bits(o)), f"{key} differs from {outs[0][0]}"


def test_window_past_the_context_gives_the_plain_bits():
    step = _llama_mixed_step(43)
    for policy in POLICIES:
        for mode in ("fold", "split"):
            assert torch.equal(bits(_run(step, policy=policy, mode=mode)),
                               bits(_run(step, policy=policy, mode=mode, sliding_window=4096))), (policy, mode)


@pytest.mark.parametrize("target_lens", [(7, 1800), (1, 1333)], ids=["chunk", "decode"])
@pytest.mark.parametrize("policy", ["strict", "off"])
def test_window_batch_invariance(target_lens, policy):
    rng = random.Random(44)
    g = _gen(44)
    H, Hkv, D, BS, W = 32, 8, 128, 16, 1024
    feats = dict(sliding_window=W)
    pool = [make_request(*ql, H=H, Hkv=Hkv, D=D, dtype=torch.bfloat16, gen=g) for ql in _random_lens(rng, 300, 2048)]
    target = make_request(*target_lens, H=H, Hkv=Hkv, D=D, dtype=torch.bfloat16, gen=g)
    max_blocks = cdiv(2048, BS) + 1

    def target_rows(others, pos, pad):
        reqs = others[:pos] + [target] + others[pos:]
        step = assemble(reqs, block_size=BS, pad_tokens=pad, gen=g, max_blocks=max_blocks)
        if policy == "off":
            step = drop_pages_below_window(step, W, gen=g)
        out = _run(step, policy=policy, **feats)
        check_written(step, out)
        start = sum(r.q_len for r in reqs[:pos])
        return bits(out[start: start + target.q_len]).clone()

    alone = target_rows([], 0, 0)
    for B in rng.sample(range(2, 257), 40):
        got = target_rows(rng.sample(pool, B - 1), rng.randint(0, B - 1), rng.choice([0, 1, 5]))
        assert torch.equal(alone, got), f"batch size {B}"


@pytest.mark.parametrize("window", [128, 1024])
def test_window_prefill_row_equals_decode_row_and_chunk_row(window):
    """A row's bits do not depend on the step it is computed in: a 300-token prompt
    on a 1700-token context, its rows as decodes and as chunks starting mid-tile,
    under strict and under off with the null pages below each step's window."""
    g = _gen(45)
    feats = dict(sliding_window=window)
    req = make_request(300, 2000, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=g)
    mb = cdiv(2000, 16) + 1
    ctx = 2000 - 300
    out_pre = _run(assemble([req], block_size=16, gen=g, max_blocks=mb), policy="strict", **feats)
    for policy in ("strict", "off"):
        def run(r):
            step = assemble([r], block_size=16, gen=g, max_blocks=mb)
            if policy == "off":
                step = drop_pages_below_window(step, window, gen=g)
            return _run(step, policy=policy, **feats)

        for i in (0, 1, 77, 299):
            out_dec = run(Request(q=req.q[i: i + 1], k=req.k[: ctx + i + 1], v=req.v[: ctx + i + 1]))
            assert torch.equal(bits(out_pre[i]), bits(out_dec[0])), f"{policy}: row {i} as a decode"
        for a, b in ((77, 200), (13, 14), (150, 300)):
            out_chunk = run(Request(q=req.q[a:b], k=req.k[: ctx + b], v=req.v[: ctx + b]))
            assert torch.equal(bits(out_pre[a:b]), bits(out_chunk[: b - a])), f"{policy}: rows {a}:{b} as a chunk"


def _median_ms(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def test_window_off_short_walk_gives_strict_bits_at_8k():
    """Policy off walks the window only, strict the whole bucket (what it pays for not
    revealing where the window is): the same bits on a decode step at 8192 with window
    128. The three times are reported (DHP_REPORT_DIR, window_walk_ms.tsv), never
    asserted: tests do not assert on time."""
    from dhp_backend.ops.triton import paged_attention_triton

    g = _gen(46)
    reqs = [make_request(1, 8192 - 7 * i, H=32, Hkv=8, D=128, dtype=torch.bfloat16, gen=g) for i in range(32)]
    step = assemble(reqs, block_size=16, gen=g)
    out = poisoned_out(step)

    def timed(policy, **feats):
        return _median_ms(lambda: paged_attention_triton(
            *step.args(), out, scale=128 ** -0.5, causal=True, num_tokens=step.num_tokens, policy=policy,
            bucket=step.bucket(policy), **feats))

    feats = dict(sliding_window=128)
    off, strict, plain_off = timed("off", **feats), timed("strict", **feats), timed("off")
    _report("window_walk_ms.tsv", "off_window128\tstrict_window128\toff_plain", [(off, strict, plain_off)])
    print(f"decode 32 x 8192, window 128: off {off:.3f} ms, strict {strict:.3f} ms, off without window "
          f"{plain_off:.3f} ms")
    assert torch.equal(bits(_run(step, policy="off", **feats)), bits(_run(step, policy="strict", **feats)))


def test_window_through_the_seam_on_the_triton_path():
    """A windowed layer through ops.paged_attention with the setting path: triton gives the Triton kernels'
    bits under every policy; path auto plans a windowed head-256, 128, 96 or 64 layer on the csrc window
    library (tests/test_cuda_features_gpu.py, test_cuda_head_sizes_gpu.py: their bits)."""
    import dataclasses

    from dhp_backend.ops import ProblemSpec, paged_attention, plan_step

    step = _llama_mixed_step(47)
    for policy in POLICIES:
        out = poisoned_out(step)
        paged_attention(*step.args(), out, scale=128 ** -0.5, causal=True, policy=policy,
                        bucket=step.bucket(policy), num_tokens=step.num_tokens, sliding_window=1024,
                        max_model_len=step.capacity, path="triton")
        assert torch.equal(bits(out), bits(_run(step, policy=policy, sliding_window=1024))), policy
    spec = ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=256, num_heads=32, num_kv_heads=8,
                       block_size=16, device_capability=torch.cuda.get_device_capability(), sliding_window=4096)
    for head_size, family in ((256, "cuda_"), (128, "cuda_"), (96, "cuda_"), (64, "cuda_")):
        for n, r in ((64, 64), (4096, 1), (300, 5)):
            for policy in POLICIES:
                p = plan_step(dataclasses.replace(spec, head_size=head_size), policy, num_tokens=n, num_reqs=r,
                              max_blocks=512, bucket_l=8192 if policy == "strict" else None)
                assert p.kernel.startswith(family) and "sliding window 4096" in p.binary(), (
                    head_size, n, r, policy, p.describe())
