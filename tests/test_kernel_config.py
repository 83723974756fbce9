"""The static tile configs and the launch plan (CPU only: no kernel runs here).

What must hold for the bits to be batch-invariant: every step kind keeps the
same KV step and split size, so that only the tile height, warps and pipelining
follow the step geometry. The GPU tests check the bits themselves.
"""

import dataclasses

import pytest

from dhp_backend.ops import tiles as kcfg
from dhp_backend.ops.geometry import split_dealing, plan, step_kind


@pytest.mark.parametrize("head,group,dtype", [(128, 4, "bfloat16"), (64, 8, "float16"), (128, 1, "float16"),
                                              (256, 8, "bfloat16"), (64, 4, "float32"), (128, 32, "bfloat16")])
def test_kinds_share_kv_step_and_split(head, group, dtype):
    cfgs = [kcfg.kernel_config(head, group, dtype, kind=k, const_time=ct)
            for k in kcfg.STEP_KINDS for ct in (True, False)]
    assert len({(c.block_n, c.split_kv, c.head_pad, c.fp32) for c in cfgs}) == 1
    for c in cfgs:
        assert c.block_m == c.block_q * group or (c.block_q == 1 and c.block_m >= group)
        assert c.split_kv % c.block_n == 0


def test_decode_tile_is_16_rows_for_small_groups():
    dec = kcfg.kernel_config(128, 4, "bfloat16", kind="decode")
    assert (dec.block_m, dec.block_q, dec.num_warps, dec.num_stages, dec.programs_per_sm) == (16, 4, 4, 3, 2)
    off = kcfg.kernel_config(128, 4, "bfloat16", kind="decode", const_time=False)
    assert (off.block_m, off.num_stages, off.programs_per_sm) == (16, 4, 2)
    # Policy class changes only the pipelining, never a tile shape.
    assert (off.block_m, off.block_n, off.num_warps) == (dec.block_m, dec.block_n, dec.num_warps)
    # Groups that do not fit 16 rows, fp32 and head 256 keep the 64-row decode tile.
    assert kcfg.kernel_config(128, 32, "bfloat16", kind="decode").block_m == 64
    assert kcfg.kernel_config(64, 4, "float32", kind="decode").block_m == 64
    assert kcfg.kernel_config(256, 4, "bfloat16", kind="decode").block_m == 64
    # The other kinds are unchanged by the policy class.
    for kind in ("mixed", "prefill"):
        assert kcfg.kernel_config(128, 4, "bfloat16", kind=kind) == \
            kcfg.kernel_config(128, 4, "bfloat16", kind=kind, const_time=False)


def test_bad_kind_and_split_are_explained():
    with pytest.raises(ValueError, match="accepted: decode, mixed, prefill"):
        kcfg.kernel_config(128, 4, "bfloat16", kind="chunked")
    with pytest.raises(ValueError, match="multiple of block_n"):
        kcfg.kernel_config(128, 4, "bfloat16", split_kv=100)


def test_plan_decode_step_uses_token_tiles_and_whole_waves():
    mixed = kcfg.kernel_config(128, 4, "bfloat16", kind=step_kind(16, 16))
    assert step_kind(16, 16) == "mixed" and step_kind(4096, 1) == "prefill"
    p = plan(num_tokens=16, num_reqs=16, num_kv_heads=8, num_heads=32, head_size=128, cfg=mixed,
             ext_grid=32768, num_sms=132)
    assert p["token_tiles"] and p["num_tiles"] == 16
    dec = kcfg.kernel_config(128, 4, "bfloat16", kind="decode")
    p = plan(num_tokens=16, num_reqs=16, num_kv_heads=8, num_heads=32, head_size=128, cfg=dec,
             ext_grid=32768, num_sms=132, tiling="token")
    assert p["split"] and p["n_split_grid"] == 64
    # 128 programs on 264 slots, 64 full splits a row: two chunks of 32 (one wave; the
    # fewest chunks among equal modelled times).
    assert (p["chunks"], p["spp"]) == (2, 32)
    assert p["chunks"] * p["spp"] >= 64


def test_split_dealing_counts_the_last_splits_fill():
    """An extent just past a split boundary (8208 positions: 16 full splits and one of
    16 positions) deals one split a CTA where the CTAs fit one wave but for the nearly
    empty last split's: head 256's B1 ran two splits a CTA on 72 of 132 SMs before
    (0.77x FA3; one a CTA: 1.18x, H200). Where the whole splits need more waves than
    CTAs of several splits do, those stay (B4 at head 256: four chunks, measured 1.06x
    against 0.96x one split a CTA)."""
    # head 256: one CTA an SM, 132 slots; 8 KV heads
    assert split_dealing(17, 8, 132, 16, 512) == (1, 17)      # B1 8208
    assert split_dealing(17, 16, 132, 16, 512) == (1, 17)     # B2 8208
    assert split_dealing(17, 32, 132, 16, 512) == (5, 4)      # B4 8208
    assert split_dealing(16, 8, 132, 512, 512) == (1, 16)     # B1 8192: one wave of whole splits
    # a full last split: the same as whole splits (B1 at 8K + 512)
    assert split_dealing(17, 8, 132, 512, 512) == (2, 9)
    # every dealing covers every split
    for n in (1, 2, 7, 17, 64, 257):
        for programs in (1, 8, 100, 263):
            spp, chunks = split_dealing(n, programs, 264, 100, 512)
            assert chunks * spp >= n and chunks == -(-n // spp)


def test_one_chunk_dealing_runs_fold_mode():
    """A dealing of one chunk walks each row whole in one program, as fold mode does,
    and would store every split's state for a merge besides: the plan takes fold mode
    (same bits; B32 32K 1042 -> 965 us on an H200, perf-notes lever 61). A forced
    "split" keeps split mode (the tests of the merge)."""
    # the csrc decode's residency (ops.cuda_decode.plan): two CTAs an SM, 264 slots
    dec = dataclasses.replace(kcfg.kernel_config(128, 4, "bfloat16", kind="decode"), resident=2)
    kw = dict(num_kv_heads=8, num_heads=32, head_size=128, cfg=dec, ext_grid=32768, num_sms=132, tiling="token")
    assert split_dealing(64, 256, 264, 512, 512) == (64, 1)       # B32: 256 programs on 264 slots
    p = plan(num_tokens=32, num_reqs=32, **kw)
    assert not p["split"] and (p["chunks"], p["spp"]) == (1, 64)
    p = plan(num_tokens=32, num_reqs=32, mode="split", **kw)
    assert p["split"] and (p["chunks"], p["spp"]) == (1, 64)
    p = plan(num_tokens=16, num_reqs=16, **kw)                     # two chunks: split mode stays
    assert p["split"] and p["chunks"] == 2
    p = plan(num_tokens=1, num_reqs=1, **kw)                       # B1: 32 chunks of two splits, one wave
    assert p["split"] and (p["chunks"], p["spp"]) == (32, 2)
