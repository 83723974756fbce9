"""ops.cuda_decode without a GPU: argument validation says what is wrong and what
is accepted; ops.step_kernel routes exactly the policy-off decode steps to it; the
csrc kernel compiles for sm_90a where nvcc exists."""

import types

import numpy as np
import pytest
from csrc_signature import c_signature
import torch

from dhp_backend.ops import cuda_build, dispatch, plan, step_kernel
from dhp_backend.ops.cuda_decode import decode_sm90, validate


def cpu_step(H=32, Hkv=8, D=128, bs=16, dtype=torch.bfloat16, T=4):
    q = torch.zeros(T, H, D, dtype=dtype)
    kc = torch.zeros(4, Hkv, bs, D, dtype=dtype)
    return (q, kc, kc.clone(), torch.zeros(T, 4, dtype=torch.int32), torch.arange(T + 1, dtype=torch.int32),
            torch.full((T,), 10, dtype=torch.int32), torch.zeros_like(q))


def test_cpu_tensors_refused_with_the_accepted_device():
    with pytest.raises(ValueError, match=r"cuda_decode: query's device is cpu; accepted: a CUDA device"):
        decode_sm90(*cpu_step(), scale=0.1)


@pytest.mark.parametrize("kw,pattern", [
    (dict(D=112), r"query's shape is \(4, 32, 112\); accepted: \[num_tokens, num_heads, D\] with D in \{64, 80, 96, 128, 256\}"),
    (dict(bs=8), r"the block size is 8; accepted: 16, 32, 64, 128"),
    (dict(dtype=torch.float32), r"query's dtype is torch.float32; accepted: torch.bfloat16 or torch.float16"),
    (dict(Hkv=5), r"the number of KV heads is 5 for 32 query heads; accepted: a divisor"),
    (dict(H=32, Hkv=1), r"the number of KV heads is 1 for 32 query heads; accepted: at most 16"),
])
def test_shapes_refused(monkeypatch, kw, pattern):
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=pattern):
        validate(*cpu_step(**kw), num_tokens=4)


def test_variant_and_mode_refused(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"variant is 'fast'; accepted: auto, v2$"):
        decode_sm90(*cpu_step(), scale=0.1, variant="fast")
    with pytest.raises(ValueError, match=r"mode is 'both'; accepted: None, 'fold', 'split'"):
        decode_sm90(*cpu_step(), scale=0.1, mode="both")
    with pytest.raises(ValueError, match=r"order is 'yes'; accepted: None \(by longest_first\), True, False"):
        decode_sm90(*cpu_step(), scale=0.1, order="yes")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"spp is .*; accepted: None or an int >= 1"):
            decode_sm90(*cpu_step(), scale=0.1, spp=bad)
    for bad in (-1, 2.0, True, "264"):
        with pytest.raises(ValueError, match=r"deal is .*; accepted: None or an int >= 0"):
            decode_sm90(*cpu_step(), scale=0.1, deal=bad)
    for bad in (float("nan"), float("inf"), False, "0.1"):
        with pytest.raises(ValueError, match=r"deal_cost is .*; accepted: None or a finite number"):
            decode_sm90(*cpu_step(), scale=0.1, deal_cost=bad)
    for bad in (True, 1.5, "7"):
        with pytest.raises(ValueError, match=r"deal_step is .*; accepted: None or an int"):
            decode_sm90(*cpu_step(), scale=0.1, deal_step=bad)


SPEC = dispatch.ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                            block_size=16, causal=True, device_capability=(9, 0))


def test_step_kernel_routes_policy_off_decode_steps(with_nvcc):
    assert step_kernel(SPEC, "off", 64, 64) == plan.CUDA_DECODE  # 64 requests x 1 token
    assert step_kernel(SPEC, "off", 65, 64) == plan.CUDA_DECODE  # one request with 2 tokens: still token tiles
    assert step_kernel(SPEC, "off", 3 * 16, 16) == plan.CUDA_PREFILL  # 3 tokens each: request tiles (mixed)
    assert step_kernel(SPEC, "off", 4096, 1) == plan.CUDA_PREFILL
    assert step_kernel(SPEC, "off", 40 * 8, 40) == plan.CUDA_PREFILL  # mixed: the prefill kernel
    for policy in ("strict", "request"):
        assert step_kernel(SPEC, policy, 64, 64) == plan.CUDA_DECODE_CT  # constant-time: the CT binaries
    import dataclasses
    assert step_kernel(dataclasses.replace(SPEC, head_size=64), "off", 64, 64) == plan.CUDA_DECODE  # gpt-oss
    for head in (80, 96, 256):  # Phi-2, Phi-3, Gemma-2 / Gemma-3
        assert step_kernel(dataclasses.replace(SPEC, head_size=head), "off", 64, 64) == plan.CUDA_DECODE
    for other in (dict(head_size=112), dict(head_size=512), dict(dtype="float32"), dict(num_heads=128, num_kv_heads=1),
                  dict(device_capability=(8, 0))):
        assert step_kernel(dataclasses.replace(SPEC, **other), "off", 64, 64) == dispatch.TRITON, other


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="no nvcc on this machine (CI): built on the GPU machine")
def test_kernel_builds_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("DHP_CUDA_CACHE", str(tmp_path))
    built = cuda_build.build(*cuda_build.DECODE_LIBRARY)
    assert built.state == "built" and built.path.is_file() and built.path.stat().st_size > 100_000


def test_longest_first_only_in_fold_mode_past_one_wave():
    from dhp_backend.ops.cuda_decode import longest_first

    fold = {"split": False, "slots": 264}
    assert longest_first(fold, 64, 8)  # 512 CTAs: ~2 waves, a late long walk is a long tail
    assert longest_first(fold, 132, 8)  # exactly 4 waves
    assert not longest_first(fold, 133, 8)  # past 4 waves the tail is short: not worth the launch
    assert not longest_first(fold, 33, 8)  # 264 CTAs: one wave, nothing to reorder
    assert not longest_first({"split": True, "slots": 264}, 256, 8)  # split mode has its own chunking


def test_dealt_schedule_only_for_policy_off_split_launches_it_can_read():
    """The device's dealing (csrc deal_kernel) runs policy-off split-mode launches whose dealing is not
    forced (`dealable`), at most the requests a dealt launch reads and the rows the workspace's table
    holds, when asked (``deal``: its slots, with the model's CTA cost); the fixed dealing elsewhere; a
    forced dealing of a step with more requests than a dealt launch reads is refused, naming the limit."""
    from dhp_backend.ops import cuda_decode
    from dhp_backend.ops.cuda_decode import deal_args, dealable
    from dhp_backend.ops.geometry import CTA_COST_IN_SPLITS

    split, fold = {"split": True, "slots": 264, "chunks": 2}, {"split": False, "slots": 264, "chunks": 1}
    assert deal_args(split, False, None, 16, 16, 256, None, None) == (0, 0.0)  # not asked: the fixed dealing
    assert deal_args(split, False, None, 16, 16, 256, 264, None) == (264, CTA_COST_IN_SPLITS)
    assert deal_args(split, False, None, 256, 256, 256, 264, None) == (264, CTA_COST_IN_SPLITS)
    assert not dealable(split, False, None, 257, 257, 256)  # more requests than it reads
    assert not dealable(split, False, None, 40000, 200, 256)  # 80000 grid rows
    rows = cuda_decode.wsp.DEAL_TABLE_ROWS  # the table's rows: num_tokens x the plan's chunks
    assert dealable(split, False, None, rows // 2, 200, 256)
    assert deal_args(split, False, None, rows // 2 + 1, 200, 256, 264, None) == (0, 0.0)
    assert deal_args(split, True, None, 16, 16, 256, 264, None) == (0, 0.0)  # constant time: no true lengths
    assert deal_args(split, False, 8, 16, 16, 256, 264, None) == (0, 0.0)  # spp forced: the fixed dealing
    assert deal_args(fold, False, None, 16, 16, 256, 264, None) == (0, 0.0)  # fold mode: one CTA a row
    assert deal_args(split, False, None, 16, 16, 256, 0, None) == (0, 0.0)  # forced off
    assert deal_args(split, False, None, 16, 16, 256, 100, 0.5) == (100, 0.5)
    with pytest.raises(ValueError, match=r"deal is 100 for a step of 300 requests; accepted: None or 0 for "
                                         r"steps of more than 256 requests"):
        deal_args(split, False, None, 300, 300, 256, 100, None)


def test_run_deals_the_steps_whose_layers_share_the_table(monkeypatch):
    """`plan.run` gives a planned dealing (DecodeLaunch.deal_slots) to decode_sm90 with the step's
    deal_step, and the plan's split count unforced; without a deal_step (ops.paged_attention's single
    launches) and for a plan with the fixed dealing it passes the plan's fixed launch."""
    import dataclasses

    from dhp_backend.ops import cuda_decode, plan as plan_mod

    assert cuda_decode.ROUTE_DEALT is False  # until the vLLM path with it has run on a GPU (perf-notes lever 69)
    seen = []
    monkeypatch.setattr(cuda_decode, "decode_sm90", lambda *a, **k: seen.append(k) or a[6])
    monkeypatch.setattr(plan_mod, "_check_plan_fits", lambda *a: None)  # (a CUDA plan, CPU tensors)
    step = cpu_step()
    p = plan_mod.StepPlan(spec=SPEC, policy=plan_mod.Policy.OFF, path=None, kernel=plan_mod.CUDA_DECODE,
                          num_tokens=step[0].shape[0], num_reqs=step[5].shape[0], capacity=64,
                          bucket_mode=plan_mod.geometry.TRUE_LENGTHS, l_scalar=0)
    fixed = plan_mod.DecodeLaunch(variant="v2", split=True, n_split_grid=8, spp=4, longest_first=False)
    dealt = dataclasses.replace(fixed, deal_slots=264, deal_cost=1.5)
    for launch, step_id, want in ((dealt, 5, dict(spp=None, deal=264, deal_cost=1.5, deal_step=5)),
                                  (dealt, None, dict(spp=4)), (fixed, 5, dict(spp=4))):
        seen.clear()
        plan_mod.run(dataclasses.replace(p, decode=launch), *step, scale=0.1, causal=True, bucket=None,
                     deal_step=step_id)
        got = {k: seen[0].get(k) for k in ("spp", "deal", "deal_cost", "deal_step")}
        assert got == {**dict(deal=None, deal_cost=None, deal_step=None), **want}, (launch, step_id)
    assert plan_mod.new_deal_step() != plan_mod.new_deal_step()
    assert dealt.deal_slots and "true lengths" in dataclasses.replace(p, decode=dealt).launch()["dealing"]


def _select_ex2(a, m):
    """compat_arith.select_ex2 in float32: a == m ? 1 : 2^(a - m)."""
    with np.errstate(all="ignore"):
        return np.where(a == m, np.float32(1), np.exp2((a - m).astype(np.float32))).astype(np.float32)


def _coefficients_sequential(m):
    """merge_kernel's fold_stats chain: the (al, be) of each split, left to right from kMInit."""
    mr, al, be = np.float32(-3.4028234663852886e38), [], []
    for ms in m:
        m2 = np.fmax(mr, ms)
        al.append(_select_ex2(mr, m2))
        be.append(_select_ex2(ms, m2))
        mr = m2
    return np.array(al, np.float32), np.array(be, np.float32)


def _coefficients_scanned(m, chunk=64):
    """The latency-scheduled merge_kernel: per chunk of splits, the running max by a
    32-lane Hillis-Steele scan (shfl_up) with a carry, then every (al, be) at once."""
    carry, al, be = np.float32(-3.4028234663852886e38), [], []
    for c0 in range(0, len(m), chunk):
        mc, start = m[c0:c0 + chunk], carry  # start: the running max before this chunk (mr_carry)
        mr = np.empty_like(mc)
        for base in range(0, len(mc), 32):
            v = np.full(32, -np.inf, np.float32)
            n = min(32, len(mc) - base)
            v[:n] = mc[base:base + n]
            o = 1
            while o < 32:
                v = np.concatenate([v[:o], np.fmax(v[o:], v[:-o])])  # lanes >= o take fmax(own, lane - o)
                o *= 2
            v = np.fmax(v, carry)
            mr[base:base + n] = v[:n]
            carry = v[31]
        before = np.concatenate([[start], mr[:-1]]).astype(np.float32)
        al.append(_select_ex2(before, mr))
        be.append(_select_ex2(mc, mr))
    return np.concatenate(al), np.concatenate(be)


@pytest.mark.parametrize("seed", range(6))
def test_merge_coefficients_scanned_equal_the_sequential_fold(seed):
    """The decode merge computes the running max by a scan and every split's fold
    coefficients at once; the coefficients must be the sequential fold's, bit for
    bit, also with NaN states, zeros of both signs, -inf and repeated maxima."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 7, 31, 32, 33, 64, 65, 100, 130]))
    m = (rng.standard_normal(n) * 4).astype(np.float32)
    special = np.array([np.nan, 0.0, -0.0, -np.inf, -3.4028234663852886e38, m.max() if n else 0], np.float32)
    mask = rng.random(n) < 0.3
    m[mask] = rng.choice(special, mask.sum())
    seq, scan = _coefficients_sequential(m), _coefficients_scanned(m)
    for a, b in zip(seq, scan):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (m, a, b)


def test_pick_variant_is_the_one_binary_family(monkeypatch):
    from dhp_backend.ops import cuda_decode

    for B, ctx, group in ((256, 16384, 4), (1, 4096, 4), (16, 32768, 16)):
        assert cuda_decode.pick_variant(B, B, 8 * group, 8, ctx, "bfloat16", None) == cuda_decode.V2
    assert tuple(cuda_decode.VARIANTS) == cuda_decode.CT_VARIANTS == (cuda_decode.V2,)


def test_constant_time_arguments_refused(monkeypatch):
    """With a bucket (the constant-time walk): no longest-first order (it sorts by the
    true lengths), GROUP <= 16, and a bucket the table can hold; each refusal says what
    is accepted."""
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"order is True with a bucket; accepted: None or False"):
        decode_sm90(*cpu_step(), scale=0.1, order=True, bucket=64)
    with pytest.raises(ValueError, match=r"the number of KV heads is 1 for 32 query heads; "
                                         r"accepted: at most 16 query heads per KV head"):
        decode_sm90(*cpu_step(Hkv=1), scale=0.1, bucket=64)
    with pytest.raises(ValueError, match=r"bucket is 65; accepted: an int in \[1, block_table.shape\[1\] \* "
                                         r"block_size = 64\]"):
        decode_sm90(*cpu_step(), scale=0.1, bucket=65)
    with pytest.raises(ValueError, match=r"bucket is a torch.int64 tensor of shape \(4,\)"):
        decode_sm90(*cpu_step(), scale=0.1, bucket=torch.full((4,), 64, dtype=torch.int64))


def test_step_kernel_routes_constant_time_decode_steps(with_nvcc):
    """Decode steps of strict/request go to cuda_decode_ct where the group fits its
    tile; mixed steps to the csrc prefill kernel's CT binary; policy off's decode steps
    on cuda_decode; a group the tile does not hold keeps every step on Triton."""
    import dataclasses
    for policy in ("strict", "request"):
        assert step_kernel(SPEC, policy, 64, 64) == plan.CUDA_DECODE_CT
        assert step_kernel(SPEC, policy, 40 * 8, 40) == plan.CUDA_PREFILL_CT  # mixed: request tiles
        assert step_kernel(dataclasses.replace(SPEC, num_heads=64, num_kv_heads=2), policy, 64, 64) \
            == dispatch.TRITON  # GROUP 32: no mma.sync tile for it
    assert step_kernel(SPEC, "off", 64, 64) == plan.CUDA_DECODE


def test_entry_argtypes_follow_the_c_signature(monkeypatch):
    """The ctypes argument list of dhp_decode_sm90 is the C entry point's, parameter for
    parameter (a stale list would pass wrong values to the kernel, not fail)."""
    from dhp_backend.ops import cuda_decode

    fn = types.SimpleNamespace()
    rows = [cuda_decode.wsp.DEAL_TABLE_ROWS]
    monkeypatch.setattr(cuda_decode, "load", lambda *a, **k: types.SimpleNamespace(
        dhp_decode_sm90=fn, dhp_decode_sm90_head_size=lambda: 128, dhp_decode_sm90_deal_max_rows=lambda: rows[0]))
    cuda_decode._entry.cache_clear()
    try:
        assert cuda_decode._entry() is fn
        assert fn.argtypes == c_signature("decode_sm90.cu", "dhp_decode_sm90")
        # A library whose dealing table is not the workspace's is refused, naming both sizes.
        cuda_decode._entry.cache_clear()
        rows[0] = 2 * cuda_decode.wsp.DEAL_TABLE_ROWS
        with pytest.raises(RuntimeError, match=rf"table holds {rows[0]} rows, the workspace's "
                                               rf"{cuda_decode.wsp.DEAL_TABLE_ROWS}"):
            cuda_decode._entry()
    finally:
        cuda_decode._entry.cache_clear()

