"""Paged decode attention on Hopper from ``csrc/decode_sm90.cu``: policy ``off`` and the constant-time walk.

Decode steps (one query token per tile, the launcher's token tiling) are bytes: the
csrc kernel streams K/V pages by TMA from a producer warp into a ring of 64-position
stages; its consumer (two warps computing S and the softmax, two accumulating PV, P
through a two-slot ring) computes each row with the arithmetic contract of
docs/kernels.md section 7 (csrc/v2_arith.cuh: 128-position steps as two stages, FA3's
exponent form, per-lane row sums, splits of 512): a row's bits are those of the csrc
prefill kernel's row for the same position (`ops.cuda_prefill`; GPU test), so a
request's rows do not depend on which kernel, batch or policy computed them.

- Semantics of `ops.paged_attention` under policy ``off``: true lengths, causal
  with cached context (a request may have several query tokens, e.g. drafts),
  GQA/MQA with 1..64 query heads per KV head.
- Split-KV like the Triton launcher: the same `geometry.plan` (splits of 512
  positions at absolute multiples of 512; "split" mode writes each split's
  state to the shared workspace and a merge kernel folds them left to right,
  "fold" mode folds inside each CTA) — both give the same bits.
- Fold-mode launches of 1-4 waves run the step's walks longest first (a
  counting sort on the device; `longest_first`): timing only, same bits.
- Split-mode launches can deal the splits to CTAs on the device from the step's true
  lengths (csrc ``deal_kernel``: per request a chunk count, chosen by a model of the
  waves, written to a table in the workspace that the decode kernel reads an entry of
  per CTA; FA3 does the same in ``prepare_varlen_num_blocks``): the plan's fixed
  dealing, made from the table's width, suits uniform batches and not mixed ones
  (docs/perf-notes.md levers 68, 69). A step's layers share one table (``deal_step``:
  the launches after the one that made it read it). Timing only, same bits; `ops.plan`
  gives it to the vLLM adapter's steps when `ROUTE_DEALT` (off for now).
- Policy ``off`` walks the true lengths (not constant-time). With ``bucket``
  (the public length bucket of strict / request), the CT binaries walk the
  Triton CONST_TIME kernels' walk instead: every token to its bucket L_r over
  its request's reserved block-table line (``block_table[r, :ceil(L_r /
  block_size)]``, the address rule of design.md section 2: the caller reserves
  those pages), masks and V zeroing by selection, no longest-first order (csrc:
  kConstTime, consume_v2; GROUP <= 16). Same bits as policy ``off``
  (GPU test). `ops.paged_attention` runs decode steps of
  those policies on it (`routes_decode_ct`).
- Head size 256, 128, 96, 80 or 64 (one library per head size: cuda_build.feature_library; 80 and 96 on
  128-column tiles; 256 at one CTA per SM), fp16/bf16,
  block size 16/32/64/128, sm_90 only; anything else is
  refused with a message saying what is accepted.

Writes rows ``[0, num_tokens)``: the requests' rows, and zeros for the padding
rows past ``query_start_loc[-1]`` (as the Triton kernels do); nothing beyond.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math

import torch

from dhp_backend.ops import geometry
from dhp_backend.ops import workspace as wsp
from dhp_backend.ops.cuda_build import DECODE_LIBRARY, TILE_HEAD, feature_library, load
from dhp_backend.ops.cuda_common import (CSRC_MAX_GROUP, check_head_size, common_route_refusal, ct_bucket, feature_args,
                                         feature_pointers, launch_error, unavailable_reason, validate_common)
from dhp_backend.ops import tiles as kcfg
from dhp_backend.ops.validation import check_values

# Query heads per KV head: the 16 rows of the consumer's mma.sync tile (every csrc route,
# cuda_common.CSRC_MAX_GROUP: a layer runs all its steps on the csrc kernels or none).
MAX_GROUP = MAX_CT_GROUP = CSRC_MAX_GROUP
# The binaries (csrc: launch_variant) `ops.plan` and the CT walk route to. Each maps to
# (csrc variant code, CTAs per SM). Options in the code's high bits (8 x options + base 4):
# V pages by one TMA box holding both 64-column halves (kPairedV, 1), K/V loads with an L2
# evict_first policy so that the split states stay in L2 for the merge (kEvictFirst, 8), the
# consumer on a 16-row tile by warp-level mma.sync (kMmaSync, 16) split by role (kMmaPipe,
# 64), on the v2 arithmetic (kV2, 512). Two stages x two CTAs per SM. The compat consumers
# (the Triton kernels' arithmetic) measured in changes 18-35 are in git history.
_PAIRED_V, _EVICT_FIRST, _MMA_SYNC, _MMA_PIPE, _V2 = 1, 8, 16, 64, 512
V2 = "v2"
VARIANTS = {V2: (4 + 8 * (_PAIRED_V | _EVICT_FIRST | _MMA_SYNC | _MMA_PIPE | _V2), 2)}
# "auto" (the default): `pick_variant`.
AUTO = "auto"
DEFAULT_VARIANT = AUTO
MODES = (None, "fold", "split")
# The constant-time walk (csrc option kConstTime, with kBucketPerReq for per-request buckets).
CT_VARIANTS = (V2,)
CT_DEFAULT_VARIANT = V2
_CONST_TIME, _BUCKET_PER_REQ = 128, 256


def _fail(what: str, got: str, accepted: str) -> None:
    raise ValueError(f"cuda_decode: {what} is {got}; accepted: {accepted}")


def routes_decode_ct(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs decode steps of the constant-time policies
    (strict / request) of ``spec`` on the CT binaries, and why not: exactly where
    policy-``off`` decode steps run here (`routes_decode`): a layer's every step
    runs on the csrc kernels or none (their bits are not the Triton kernels')."""
    ok, why = routes_decode(spec)
    return (ok, "constant-time decode steps: csrc/decode_sm90.cu (CT binary)" if ok else why)


def routes_decode(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs policy-``off`` decode steps of ``spec`` (a
    `dispatch.ProblemSpec`) here, and why not. The setting ``path: triton`` keeps
    every step of the layer on the Triton kernels."""
    why = common_route_refusal(spec, "decode_sm90.cu")  # device, nvcc, shape, group, builds
    return (False, why) if why else (True, "policy off, decode steps: csrc/decode_sm90.cu")


@functools.lru_cache(maxsize=None)
def _entry(window: bool = False, softcap: bool = False, sinks: bool = False, head: int = 128):
    # Loaded, checked and typed once per library (features, head size), not per launch.
    lib = load(*feature_library(DECODE_LIBRARY, window=window, softcap=softcap, sinks=sinks, head=head))
    check_head_size("cuda_decode", lib.dhp_decode_sm90_head_size(), head)
    fn = lib.dhp_decode_sm90
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32, i32, i32, p, p, p, i32, i32, p,
                   i32, p, i32,  # CT: l_scalar, bucket, max_blocks
                   i32, ctypes.c_float, ctypes.c_float, p,  # features: window, cap_pre, cap_post, sinks
                   i32, ctypes.c_float, p, i32,  # the dealt schedule: deal_slots, deal_cost, deal_table, deal_fill
                   p]
    fn.restype = i32
    rows = lib.dhp_decode_sm90_deal_max_rows()
    if rows != wsp.DEAL_TABLE_ROWS:  # the table's size in the workspace is the library's limit
        raise RuntimeError(f"cuda_decode: the library's dealt-schedule table holds {rows} rows, the workspace's "
                           f"{wsp.DEAL_TABLE_ROWS}; rebuild the csrc libraries (dhp-backend build)")
    return fn


@functools.lru_cache(maxsize=None)
def _deal_max_reqs(window: bool = False, softcap: bool = False, sinks: bool = False, head: int = 128) -> int:
    """The most requests a dealt launch reads (csrc kDealMaxReqs, exported by the library)."""
    return load(*feature_library(DECODE_LIBRARY, window=window, softcap=softcap, sinks=sinks,
                                 head=head)).dhp_decode_sm90_deal_max_reqs()


def validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens) -> None:
    """Shapes, dtypes, devices and strides (no device values are read)."""
    validate_common("cuda_decode", query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                    num_tokens)
    H, Hkv = query.shape[1], key_cache.shape[1]
    if H // Hkv > MAX_GROUP:
        _fail("the number of KV heads", f"{Hkv} for {H} query heads",
              f"at most {MAX_GROUP} query heads per KV head (the consumer's 16-row mma.sync tile holds a "
              "token's group)")
    if num_tokens > 65535:
        _fail("num_tokens", str(num_tokens), "at most 65535 (one CTA row per token)")


def plan(num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int, capacity: int, dtype_name: str,
         variant: str, mode: str | None, head: int = 128) -> dict:
    """Split mode and chunks by the Triton launcher's `geometry.plan` (token tiles,
    the variant's residency), from public values only; plus ``slots``, the CTAs one wave holds.
    ``head``: the layer's head size (its library's tiles: `TILE_HEAD`)."""
    cfg = kcfg.kernel_config(128, num_heads // num_kv_heads, dtype_name, kind="decode", const_time=False)
    code, resident = VARIANTS[variant]
    if num_heads // num_kv_heads > 8:
        resident = min(resident, 2)  # the csrc fallback for groups without the small Q tile
    tile_head = TILE_HEAD[head]
    if tile_head == 256:
        resident = 1  # csrc launch_v2: head 256's stages hold twice the bytes, one CTA per SM
    cfg = dataclasses.replace(cfg, resident=resident)
    num_sms = geometry.num_sms_of(torch.device("cuda", torch.cuda.current_device()))
    # The split states' rows are the library's tile head (128 for heads 64-128: a head-64 launch stores
    # half of each; 256 for head 256), so the heads of the 128-column tiles share one grid.
    p = geometry.plan(num_tokens=num_tokens, num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_heads=num_heads,
                    head_size=max(tile_head, 128), cfg=cfg, ext_grid=capacity, num_sms=num_sms, mode=mode,
                    tiling="token")
    return dict(p, slots=cfg.programs_per_sm * num_sms)


# The longest-first schedule costs a small launch (~4 us on an H200) and pays where a
# long walk started late leaves a tail: measured (docs/perf-notes.md, change 19) on
# random lengths at 2-4 waves (B64 4K-32K: 0.79 -> 0.98 of FA3, B128 512-4K: 0.90 ->
# 0.98), a loss at ~8 waves (B256 256-2K: 0.95 -> 0.94) where the tail is short.
LONGEST_FIRST_MAX_WAVES = 4


def longest_first(p: dict, num_tokens: int, num_kv_heads: int) -> bool:
    """Whether a fold-mode launch takes the longest-first schedule (csrc:
    order_kernel): when its CTAs (one per token and KV head) fill more than one
    wave of the GPU's slots and at most `LONGEST_FIRST_MAX_WAVES`."""
    ctas = num_tokens * num_kv_heads
    return not p["split"] and p["slots"] < ctas <= LONGEST_FIRST_MAX_WAVES * p["slots"]


# Whether `ops.plan` gives the dealt schedule to the policy-off split-mode decode launches of the steps
# whose layers share one dealing table (`plan.run` with a ``deal_step``: the vLLM adapter's steps).
# Measured on an H200 (docs/bench/decode-dealt-h200.md, perf-notes lever 69), the table made once
# before the launch: uniform lengths at the fixed dealing's speed (-0.5 .. +0.7 us at B1-B16, B24
# +3-4 us), mixed lengths 1.07x FA3 at B16 4K-32K where the fixed dealing runs 0.90x, 1.24-1.28x at
# B8 against 0.97-0.99x; made in every launch (deal_kernel, 2.8-4.3 us) it would cost the uniform
# rows that, so `ops.paged_attention`'s single launches keep the fixed dealing. Off until the vLLM
# path with it has run on a GPU (integration.gpu_e2e dhp-off-graphs-4k, the e2e throughput run):
# the launches' table sharing is tested on the GPU (tests/test_cuda_decode_gpu.py), not yet in vLLM.
ROUTE_DEALT = False


def dealable(p: dict, ct: bool, spp: int | None, num_tokens: int, num_reqs: int, max_reqs: int) -> bool:
    """Whether the dealt schedule can run a launch of plan ``p``: policy off (its lengths are not secret),
    split mode whose dealing is not forced (``spp``), at most ``max_reqs`` requests (csrc kDealMaxReqs)
    and `workspace.DEAL_TABLE_ROWS` grid rows (``num_tokens`` x the plan's chunks, one table entry each)."""
    return (bool(p["split"]) and not ct and spp is None and num_reqs <= max_reqs
            and num_tokens * p["chunks"] <= wsp.DEAL_TABLE_ROWS)


# What each device's dealing table holds: (the step it was made for, the CUDA-graph capture it was made
# in or 0, the launch geometry) of the last dealt launch that made it (`decode_sm90`); a launch of the
# same step, capture and geometry reads it. (A graph captured after an eager run of the same step makes
# its own table: its replays cannot count on a table the eager run left.)
_deal_table_holds: dict = {}


@functools.lru_cache(maxsize=None)
def _capture_fn(window: bool = False, softcap: bool = False, sinks: bool = False, head: int = 128):
    fn = load(*feature_library(DECODE_LIBRARY, window=window, softcap=softcap, sinks=sinks,
                               head=head)).dhp_decode_sm90_capture_id
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_ulonglong
    return fn


def _capture_id(library: dict, stream: int) -> int:
    """The capture sequence of ``stream``'s CUDA-graph capture, 0 outside one (csrc)."""
    return int(_capture_fn(**library)(ctypes.c_void_p(stream)))


def deal_args(p: dict, ct: bool, spp: int | None, num_tokens: int, num_reqs: int, max_reqs: int,
              deal: int | None, deal_cost: float | None) -> tuple[int, float]:
    """(deal_slots, deal_cost) of a launch: the dealt schedule (csrc ``deal_kernel``: the finest
    dealing of the step's true lengths that fits one wave of ``deal`` slots, or the plan's, by a model
    of the waves with ``deal_cost``, default `geometry.CTA_COST_IN_SPLITS`) where `dealable`; (0, 0.0)
    keeps the plan's fixed dealing (``deal`` None or 0, or not dealable). A ``deal`` for a step of more
    requests than a dealt launch reads is refused. Same bits either way."""
    if deal and num_reqs > max_reqs:
        _fail("deal", f"{deal} for a step of {num_reqs} requests",
              f"None or 0 for steps of more than {max_reqs} requests (the most a dealt launch reads)")
    if not deal or not dealable(p, ct, spp, num_tokens, num_reqs, max_reqs):
        return 0, 0.0
    return deal, geometry.CTA_COST_IN_SPLITS if deal_cost is None else float(deal_cost)


def pick_variant(num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int, capacity: int, dtype_name: str,
                 mode: str | None) -> str:
    """The "auto" variant of a launch: `V2`, the one binary family (policy off). The
    arguments are the launch's public geometry, for a choice among binaries of equal
    bits (two and three CTAs per SM were measured: change 26)."""
    return V2


def decode_sm90(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, *, scale: float,
                causal: bool = True, num_tokens: int | None = None, variant: str = DEFAULT_VARIANT,
                mode: str | None = None, order: bool | None = None, check: bool = True,
                bucket: int | torch.Tensor | None = None, spp: int | None = None,
                deal: int | None = None, deal_cost: float | None = None, deal_step: int | None = None,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (``num_tokens`` defaults to ``query.shape[0]``).

    ``variant``: "auto" (`pick_variant`) or one of `VARIANTS` (residency; same bits). ``mode``: None picks
    split or fold by occupancy as the Triton launcher does; "split"/"fold" force
    one (tests; same bits). ``order``: fold mode's longest-first schedule, None =
    by `longest_first`, True/False force it (split mode ignores it; timing only,
    same bits). ``check`` reads the metadata on the host first (the facts
    `ops.paged_attention` checks with ``check_values``; a device sync).
    ``bucket``: None walks the true lengths (policy off); an int L or int32
    per-request buckets run the constant-time walk to it (policies strict /
    request; variants `CT_VARIANTS`, "auto" = `CT_DEFAULT_VARIANT`; ``order`` must
    not be True: the longest-first order sorts by the true lengths). Request r then
    reads ``block_table[r, :ceil(L_r / block_size)]`` whatever its length: the
    caller must have reserved those pages for it (design.md section 2;
    `ops.paged_attention` checks it).
    ``spp``: split mode's splits per CTA, forced (None: `plan`'s choice; a launch
    that `plan` puts in fold mode ignores it): how the splits are dealt to CTAs,
    timing only, same bits (every split's state is stored and merged left to right).
    ``deal`` / ``deal_cost``: the dealt schedule's slots (0: the plan's fixed dealing) and its
    model's CTA cost (None or 0: the fixed dealing; timing only, same bits). ``deal_step``: the step's
    identity (an int the caller gives each step's metadata once, e.g. `plan.new_deal_step`): a dealt
    launch reads the device's dealing table instead of making it again when the last table made on
    this device was made by a launch of the same ``deal_step``, the same ``num_tokens`` and split
    geometry (a step's layers share the metadata, so its later layers read the first one's table).
    Every launch that makes the table records what it holds; under CUDA-graph capture that happens
    as the launches are captured, in the order they replay.
    ``sliding_window`` / ``logits_soft_cap`` / ``sinks``: as `cuda_prefill.prefill_sm90` (the feature
    library's binaries; policy off walks and merges the splits from the one holding the window's
    first position on).
    """
    num_tokens = query.shape[0] if num_tokens is None else num_tokens
    validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens)
    if variant != AUTO and variant not in VARIANTS:
        _fail("variant", repr(variant), ", ".join([AUTO, *VARIANTS]))
    if mode not in MODES:
        _fail("mode", repr(mode), "None, 'fold', 'split'")
    if order not in (None, True, False):
        _fail("order", repr(order), "None (by longest_first), True, False")
    if spp is not None and (isinstance(spp, bool) or not isinstance(spp, int) or spp < 1):
        _fail("spp", repr(spp), "None or an int >= 1 (split mode's splits per CTA)")
    if deal is not None and (isinstance(deal, bool) or not isinstance(deal, int) or deal < 0):
        _fail("deal", repr(deal), "None or an int >= 0 (the dealt schedule's resident CTAs; 0: the fixed dealing)")
    if deal_cost is not None and (isinstance(deal_cost, bool) or not isinstance(deal_cost, (int, float))
                                  or not math.isfinite(deal_cost)):
        _fail("deal_cost", repr(deal_cost), "None or a finite number (the dealing model's CTA cost, in splits)")
    if deal_step is not None and (isinstance(deal_step, bool) or not isinstance(deal_step, int)):
        _fail("deal_step", repr(deal_step), "None or an int (the step's identity: its layers share one dealing)")
    library, feature_tail = feature_args("cuda_decode", scale, causal, sliding_window, logits_soft_cap,
                                          sinks, query)
    ct = bucket is not None
    if ct:
        l_mode, l_scalar, bucket_t = ct_bucket("cuda_decode", bucket, seq_lens.shape[0],
                                               block_table.shape[1] * key_cache.shape[2], query.device)
        if variant == AUTO:
            variant = CT_DEFAULT_VARIANT
        if variant not in CT_VARIANTS:
            _fail("variant", f"{variant!r} with a bucket (the constant-time walk)", ", ".join([AUTO, *CT_VARIANTS]))
        if order:
            _fail("order", "True with a bucket", "None or False (the longest-first order sorts by the true lengths)")
    reason = unavailable_reason(query.device)
    if reason:
        raise RuntimeError(f"cuda_decode: cannot run here: {reason}")
    if check:
        check_values(query_start_loc, seq_lens, block_table, bucket, num_tokens, key_cache.shape[0],
                      key_cache.shape[2])
    if num_tokens == 0:
        return out
    if ct and seq_lens.shape[0] == 0:  # public geometry: a step without requests is all padding
        out[:num_tokens].zero_()
        return out
    T, H, D = query.shape
    nb, Hkv, bs, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    dtype_name = "bfloat16" if query.dtype == torch.bfloat16 else "float16"
    with torch.cuda.device(query.device):
        if variant == AUTO:
            variant = pick_variant(num_tokens, num_reqs, H, Hkv, block_table.shape[1] * bs, dtype_name, mode)
        # The grid's extent: the table's capacity, or under one bucket the bucket
        # itself (the Triton launcher's ext_grid).
        ext_grid = l_scalar if ct and l_mode == 0 else block_table.shape[1] * bs
        p = plan(num_tokens, num_reqs, H, Hkv, ext_grid, dtype_name, variant, mode, head=D)
        null = ctypes.c_void_p(0)
        ws_acc = ws_m = ws_l = order_ws = null
        spp_arg = 0  # fold mode
        if p["split"]:
            ws, _, _ = wsp.reserve_workspace(query.device)
            acc, m, l = geometry.split_states(ws, p["n_split_grid"], num_tokens, H, TILE_HEAD[D])
            ws_acc, ws_m, ws_l = acc.data_ptr(), m.data_ptr(), l.data_ptr()
            spp_arg = p["spp"] if spp is None else min(spp, p["n_split_grid"])
        elif not ct and (order or (order is None and longest_first(p, num_tokens, Hkv))):
            # Fold mode leaves the split area unused: its head holds the schedule
            # ((token, request) int32 pairs, written and read in stream order by this launch).
            ws, _, _ = wsp.reserve_workspace(query.device)
            order_ws = ws[: 2 * num_tokens].view(torch.int32).data_ptr()
        code = VARIANTS[variant][0]
        deal_slots, deal_c = deal_args(p, ct, spp, num_tokens, num_reqs, _deal_max_reqs(**library), deal,
                                       deal_cost)
        stream = torch.cuda.current_stream().cuda_stream
        deal_ptrs = (null, 0)
        if deal_slots:
            # A table holds a dealing of one step's tokens over one grid (num_tokens x chunks rows); any
            # dealing of the step is a valid one (same bits), so the launch's own deal arguments need
            # not match. Made here unless this device's last one was made for this step and grid.
            capture = _capture_id(library, stream)
            holds = (deal_step, capture, num_tokens, p["n_split_grid"], spp_arg)
            reuse = deal_step is not None and _deal_table_holds.get(query.device) == holds
            _deal_table_holds.pop(query.device, None)  # recorded once the launch is in (below)
            deal_ptrs = (wsp.deal_table(query.device).data_ptr(), 0 if reuse else 1)
        ct_args = (0, null, 0)
        if ct:
            code += 8 * (_CONST_TIME + (_BUCKET_PER_REQ if l_mode == 1 else 0))
            ct_args = (l_scalar, null if bucket_t is None else bucket_t.data_ptr(), block_table.shape[1])
        rc = _entry(**library)(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(),
                      value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), nb,
                      out.data_ptr(), out.stride(0), out.stride(1), block_table.data_ptr(), block_table.stride(0),
                      seq_lens.data_ptr(), query_start_loc.data_ptr(), num_reqs, T, num_tokens, H, Hkv, bs,
                      float(scale) * math.log2(math.e),  # qk_scale as the Triton launcher computes it
                      int(bool(causal)), int(query.dtype == torch.bfloat16), code, ws_acc, ws_m,
                      ws_l, p["n_split_grid"], spp_arg, order_ws, *ct_args, *feature_pointers(feature_tail),
                      deal_slots, deal_c, *deal_ptrs, stream)
    if rc != 0:
        raise RuntimeError(f"cuda_decode: launch failed: {launch_error(rc)}")
    if deal_slots:
        _deal_table_holds[query.device] = holds
    return out
