"""The csrc Hopper kernels at the head sizes other than 128, on their own libraries
(`cuda_build.feature_library` head=, csrc/v2_arith.cuh DHP_HEAD), on an sm_90 GPU:

- head 64 (gpt-oss: 64 query / 8 KV heads, sinks on every layer, a window of 128 on alternating layers):
  tiles of one 64-column half;
- head 96 (Phi-3-mini / Phi-3.5-mini: 32 query and 32 KV heads, Phi-3-mini-4k's window of 2047): head-128
  tiles whose columns 96-127 the TMA fills with zeros, stores that stop at column 96;
- head 80 (Phi-2: 32 query and 32 KV heads, no window): as 96, with 48 zero columns;
- head 256 (Gemma-2 9B, Gemma-3 12B: 16 query / 8 KV heads, a soft cap of 50, windows of 4096 / 1024): tiles
  of four halves; the policy-off prefill on two consumer warpgroups with their running states in the
  workspace, one slot per SM (consume_v2_serial), the constant-time prefill on one of 64 rows (consume_v2_ct).

The same contract as head 128 (docs/kernels.md section 7), each checked at every head size here:

- accuracy against the reference over random packed steps, plain and with the models' features (and a
  cap), the model's heads, GQA 7, MHA / GQA 8, fp16 and bf16, block sizes 16-128 (a store past a row's D
  columns lands in the next head's row, or for the last head in the rows past num_tokens, which must
  stay NaN);
- every prefill row's bits equal the decode kernel's for the same position (split and fold mode), chunked
  prefill and decode steps give the whole prefill's bits;
- the constant-time walks (v2_ct, the decode CT binaries; one bucket and per-request buckets, on tables that
  obey the address rule) give policy off's bits;
- under policy off a window's dropped pages may be vLLM's null block (NaN/inf): the same bits;
- ops.paged_attention runs a head-64 / 80 / 96 / 256 layer on the csrc kernels under every policy, with off's bits.

Needs nvcc (the libraries are built on first use). Run: ``pytest -m gpu tests/test_cuda_head_sizes_gpu.py``.
"""

import random

import pytest
import torch

from triton_steps import (Request, assemble, bits, csrc_decode, csrc_prefill, drop_pages_below_window,
                          feature_tensors, make_request, next_pow2, random_requests, reference, rel_err, reserved_step)

from dhp_backend.ops import paged_attention
from dhp_backend.ops.cuda_build import find_nvcc
from dhp_backend.ops.cuda_prefill import V2, V2_CT, unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or unavailable_reason() is not None,
                       reason="needs an sm_90 GPU"),
    pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc to build csrc/"),
]

# Per head size: the model's (query heads, KV heads) and its windowed layer's features.
MODELS = {64: dict(name="gpt-oss", H=64, Hkv=8, local=dict(sliding_window=128, sinks="model")),
          80: dict(name="phi2", H=32, Hkv=32, local=dict()),
          96: dict(name="phi3", H=32, Hkv=32, local=dict(sliding_window=2047)),
          # Gemma-2 9B / Gemma-3 12B: 16 / 8 heads; Gemma-2's cap of 50 with Gemma-3's window of 1024
          256: dict(name="gemma", H=16, Hkv=8, local=dict(sliding_window=1024, logits_soft_cap=50.0))}
HEADS = list(MODELS)
SCALE = 0.125
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
FEATURES = [
    ("plain", dict()),
    ("sinks", dict(sinks="model")),  # gpt-oss's full layers
    ("W128+sinks", dict(sliding_window=128, sinks="model")),  # its local layers
    ("W2047", dict(sliding_window=2047)),  # Phi-3-mini-4k
    ("W100", dict(sliding_window=100)),
    ("cap50+W300+sinks", dict(logits_soft_cap=50.0, sliding_window=300, sinks="f32")),
]


def shapes(D, second):
    """(H, Hkv) of the model of head size D, then of GQA 7, then ``second``."""
    m = MODELS[D]
    return [(m["H"], m["Hkv"]), (28, 4), second]


def prefill(step, feats, *, variant=V2, bucket=None):
    return csrc_prefill(step, feats, scale=SCALE, variant=variant, bucket=bucket)


def decode(step, feats, *, mode=None, bucket=None):
    return csrc_decode(step, feats, scale=SCALE, mode=mode, bucket=bucket)


@pytest.mark.parametrize("name,feats", FEATURES, ids=[n for n, _ in FEATURES])
@pytest.mark.parametrize("shape,dtype,bs", [(0, torch.bfloat16, 16), (1, torch.float16, 64), (2, torch.bfloat16, 128),
                                            (3, torch.float16, 32)], ids=["model", "gqa7", "mha", "gqa8-fp16"])
@pytest.mark.parametrize("D", HEADS)
def test_matches_reference_and_the_decode_kernel_bits(name, feats, shape, dtype, bs, D):
    H, Hkv = (shapes(D, (16, 16)) + [(16, 2)])[shape]
    rng = random.Random(hash((name, H, bs, D)) & 0xFFFF)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    feats = feature_tensors(feats, H, 1, dtype)
    for trial in range(3):
        reqs = random_requests(rng, gen, rng.randint(1, 4), H, Hkv, dtype, max_len=1400, D=D)
        step = assemble(reqs, block_size=bs, gen=gen, pad_tokens=rng.choice([0, 5]), extra_rows=3)
        n = int(step.query_start_loc[-1])
        what = f"{name} trial {trial} {[(r.q_len, r.seq_len) for r in reqs]}"
        ref = reference(step, scale=SCALE, causal=True, **{k: (v.float() if k == "sinks" else v)
                                                           for k, v in feats.items()})
        out = prefill(step, feats)
        assert rel_err(out, ref, n) < TOL[dtype], what
        assert (out[n: step.num_tokens] == 0).all(), f"padding rows must be zero: {what}"
        assert torch.isnan(out[step.num_tokens:].float()).all(), f"rows at/after num_tokens written: {what}"
        for mode in (None, "fold"):  # None: split mode where the launcher picks it (few tokens)
            got = decode(step, feats, mode=mode)
            assert torch.isnan(got[step.num_tokens:].float()).all(), f"decode/{mode} wrote past num_tokens: {what}"
            assert torch.equal(bits(got[: step.num_tokens]), bits(out[: step.num_tokens])), \
                f"decode/{mode} differs from the prefill: {what}"
        assert torch.equal(bits(prefill(step, feats)[:n]), bits(out[:n])), f"not repeatable: {what}"


@pytest.mark.parametrize("D", HEADS)
def test_chunked_prefill_and_decode_give_the_whole_prefill_bits(D):
    gen = torch.Generator(device="cuda").manual_seed(23)
    m = MODELS[D]
    for feats in (dict(), feature_tensors(dict(sliding_window=128, sinks="model"), m["H"], 4, torch.bfloat16),
                  feature_tensors(m["local"], m["H"], 4, torch.bfloat16)):
        full = make_request(2100, 2100, H=m["H"], Hkv=m["Hkv"], D=D, dtype=torch.bfloat16, gen=gen)
        whole = prefill(assemble([full], block_size=16, gen=gen), feats)[:2100]
        for a, b in ((0, 1), (127, 128), (128, 600), (511, 1024), (1024, 2100), (1700, 2100)):
            chunk = Request(q=full.q[a:b], k=full.k[:b], v=full.v[:b])
            got = prefill(assemble([chunk], block_size=16, gen=gen), feats)[: b - a]
            assert torch.equal(bits(got), bits(whole[a:b])), f"chunk [{a}, {b}) {sorted(feats)}"
        positions = (0, 1, 127, 128, 129, 511, 512, 1023, 1024, 1025, 2099)
        step = assemble([Request(q=full.q[p: p + 1], k=full.k[: p + 1], v=full.v[: p + 1]) for p in positions],
                        block_size=16, gen=gen)
        for mode in ("split", "fold"):
            got = decode(step, feats, mode=mode)[: len(positions)]
            assert torch.equal(bits(got), bits(whole[list(positions)])), f"decode/{mode} {sorted(feats)}"


@pytest.mark.parametrize("name,feats", FEATURES, ids=[n for n, _ in FEATURES])
@pytest.mark.parametrize("shape,bs", [(0, 16), (1, 32)], ids=["model", "gqa7"])
@pytest.mark.parametrize("D", HEADS)
def test_constant_time_walks_have_the_policy_off_bits(name, feats, shape, bs, D):
    H, Hkv = shapes(D, None)[shape]
    rng = random.Random(hash((name, H, D)) & 0xFFFF)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    feats = feature_tensors(feats, H, 3, torch.bfloat16)
    for trial in range(2):
        reqs = random_requests(rng, gen, rng.randint(1, 4), H, Hkv, torch.bfloat16, max_len=900, D=D)
        width = -(-max(max(r.seq_len for r in reqs), 1100) // bs) + 1
        for policy in ("strict", "request"):
            step = reserved_step(reqs, policy, block_size=bs, width=width, gen=gen, pad_tokens=5, extra_rows=3)
            off = bits(prefill(step, feats)[: step.num_tokens])
            bucket = step.capacity if policy == "strict" else torch.tensor(
                [min(step.capacity, next_pow2(r.seq_len)) for r in reqs], dtype=torch.int32, device="cuda")
            what = f"{name} {policy} {[(r.q_len, r.seq_len) for r in reqs]}"
            got = prefill(step, feats, variant=V2_CT, bucket=bucket)
            assert torch.equal(bits(got[: step.num_tokens]), off), f"v2_ct: {what}"
            for mode in (None, "fold"):
                dec = decode(step, feats, mode=mode, bucket=bucket)
                assert torch.equal(bits(dec[: step.num_tokens]), off), f"decode CT/{mode}: {what}"


@pytest.mark.parametrize("D", HEADS)
def test_constant_time_walks_keep_the_bits_where_a_chunk_ends_one_position_into_a_step(D):
    """The timing gate's request classes (a 64-token chunk ending at 2049, 2176 and 4096 of a 4096 bucket):
    at 2049 the chunk's last step holds one real position, so that step lies wholly past the causal
    limit of every row but the last (kDeadPastLimitCT: such a step runs as a dead step for those rows
    in head 64's window libraries). The model's windowed layer and a plain one, both policies: off's bits."""
    m = MODELS[D]
    rng = random.Random(2049 + D)
    gen = torch.Generator(device="cuda").manual_seed(rng.randint(0, 1 << 30))
    for feats in (m["local"], dict()):
        ft = feature_tensors(feats, m["H"], 7, torch.bfloat16)
        reqs = [make_request(64, s, H=m["H"], Hkv=m["Hkv"], D=D, dtype=torch.bfloat16, gen=gen)
                for s in (2049, 2176, 4096, 129)]
        for policy in ("strict", "request"):
            step = reserved_step(reqs, policy, block_size=16, width=4096 // 16 + 1, gen=gen, pad_tokens=3)
            off = bits(prefill(step, ft)[: step.num_tokens])
            bucket = step.capacity if policy == "strict" else torch.tensor(
                [min(step.capacity, next_pow2(r.seq_len)) for r in reqs], dtype=torch.int32, device="cuda")
            got = prefill(step, ft, variant=V2_CT, bucket=bucket)
            assert torch.equal(bits(got[: step.num_tokens]), off), f"v2_ct {sorted(feats)} {policy}"
            for mode in (None, "fold"):
                dec = decode(step, ft, mode=mode, bucket=bucket)
                assert torch.equal(bits(dec[: step.num_tokens]), off), f"decode CT/{mode} {sorted(feats)} {policy}"


@pytest.mark.parametrize("D", HEADS)
def test_null_pages_below_the_window_change_no_bit(D):
    rng = random.Random(D)
    m = MODELS[D]
    feats = feature_tensors(dict(sliding_window=128, sinks="model"), m["H"], 2, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(17)
    for bs in (16, 64):
        reqs = [make_request(rng.randint(1, 300), rng.randint(1500, 3000), H=m["H"], Hkv=m["Hkv"], D=D,
                             dtype=torch.bfloat16, gen=gen) for _ in range(4)]
        step = assemble(reqs, block_size=bs, gen=gen)
        dropped = drop_pages_below_window(step, 128, gen=gen)
        assert (dropped.block_table == 0).any()
        full = bits(prefill(step, feats)[: step.num_tokens])
        assert torch.equal(bits(prefill(dropped, feats)[: step.num_tokens]), full), f"prefill, bs {bs}"
        for mode in (None, "fold"):
            assert torch.equal(bits(decode(dropped, feats, mode=mode)[: step.num_tokens]), full), f"decode/{mode}"


@pytest.mark.parametrize("D", HEADS)
def test_paged_attention_runs_the_layers_on_the_csrc_kernels(monkeypatch, D):
    """ops.paged_attention (path auto): a gpt-oss local layer (head 64, window 128, sinks), a Phi-2 layer
    (head 80), a Phi-3-mini-4k layer (head 96, window 2047) or a Gemma layer (head 256, window 1024, cap 50)
    runs its prefill, mixed and decode steps on the csrc kernels under every policy, with policy off's bits."""
    from dhp_backend.ops import cuda_decode, cuda_prefill

    calls = []
    for module, fn in ((cuda_prefill, "prefill_sm90"), (cuda_decode, "decode_sm90")):
        real = getattr(module, fn)

        def spy(*a, _real=real, _name=fn, **k):
            calls.append((_name, a[0].shape[2]))
            return _real(*a, **k)

        monkeypatch.setattr(module, fn, spy)
    m = MODELS[D]
    feats = feature_tensors(m["local"], m["H"], 5, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(31)
    mixed = [make_request(q, s, H=m["H"], Hkv=m["Hkv"], D=D, dtype=torch.bfloat16, gen=gen)
             for q, s in ((600, 1500), (1, 900), (1, 2500))]
    decodes = [make_request(1, s, H=m["H"], Hkv=m["Hkv"], D=D, dtype=torch.bfloat16, gen=gen) for s in (17, 1200, 3000)]
    for batch, kernel in ((mixed, "prefill_sm90"), (decodes, "decode_sm90")):
        off = None
        for policy in ("off", "strict", "request"):
            step = reserved_step(batch, policy, block_size=16, width=256, gen=gen,
                                 pad_tokens=4 if kernel == "prefill_sm90" else 0)
            calls.clear()
            out = torch.full_like(step.query, float("nan"))
            paged_attention(*step.args(), out, scale=SCALE, causal=True, policy=policy, bucket=step.bucket(policy),
                            num_tokens=step.num_tokens, max_model_len=step.capacity, **feats)
            assert calls == [(kernel, D)], (policy, calls)
            got = bits(out[: step.num_tokens])
            off = got if off is None else off
            assert torch.equal(got, off), f"{policy} differs from off"


def test_the_head_256_running_states_have_a_slot_per_sm_id():
    """The head-256 policy-off prefill keeps each SM's running states in slot %smid of the workspace's
    split area (csrc kRunGlobal; the kernel traps on an id past the slots): this device's %nsmid fits."""
    from dhp_backend.ops import cuda_prefill

    dev = torch.device("cuda", torch.cuda.current_device())
    ptr, slots = cuda_prefill.run_state(dev, dict(head=256))
    bound = cuda_prefill.sm_id_bound(dev)
    assert ptr is not None and ptr % 16 == 0
    assert torch.cuda.get_device_properties(dev).multi_processor_count <= bound <= slots, (bound, slots)
