"""Paged prefill attention on Hopper from ``csrc/prefill_sm90.cu``: policy ``off`` and the constant-time walk.

A TMA producer warpgroup (its four warps each loading a share of every 128-position
K and V stage) and two consumer warpgroups on wgmma with FA3's schedules (the QK^T
of step t + 1 issued ahead of the PV of step t, the two warpgroups taking turns),
docs/kernels.md.

- Semantics of `ops.paged_attention` (true lengths under policy ``off``, causal
  with cached context, GQA/MQA), same argument layouts. One CTA per (request,
  tile of query rows, KV head), no atomics, a fixed KV order.
- The arithmetic contract of docs/kernels.md section 7 (csrc/v2_arith.cuh): steps
  of 128 positions at absolute multiples of 128, FA3's exponent form, per-lane row
  sums, splits of 512 folded in order. The csrc decode kernel computes a row with
  the same operations, so a request's rows have the same bits whether a prefill,
  a chunk, a mixed step or a decode step computed them (GPU test); the Triton
  kernels (layers the csrc kernels do not take) have an arithmetic of their own,
  so `ops.plan` runs a layer's every step on one family.
- `V2` (policy off) packs GROUP heads x floor(128 / GROUP) tokens into a tile's
  128 rows (GQA 7: 18 tokens, 126 rows); `V2_CT` walks each request to its public
  bucket (policies strict / request) with the slotted tile (128 >> ceil(log2
  GROUP) tokens). A row's bits do not depend on its tile.
- Head size 256, 128, 96, 80 or 64 (one library per head size; 80 and 96 on 128-column tiles; 256 with
  one stage of K and V, its policy-off running states in the workspace's split area: `run_state`), fp16/bf16, block size
  16/32/64/128, up to 16 query heads per KV
  head (`cuda_common.CSRC_MAX_GROUP`: the decode kernel's limit, the family's),
  sm_90 only. Anything else is refused with a message saying what is accepted.

Writes rows ``[0, num_tokens)``: the requests' rows, and zeros for the padding
rows past ``query_start_loc[-1]`` (as the Triton kernels do); nothing beyond.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from dhp_backend.ops import workspace as wsp
from dhp_backend.ops.cuda_build import PREFILL_LIBRARY, feature_library, load
from dhp_backend.ops.cuda_common import (BLOCK_SIZES, CSRC_MAX_GROUP, DTYPES, HEAD_SIZES,  # noqa: F401
                                         check_head_size, common_route_refusal, ct_bucket, feature_args, feature_pointers,
                                         launch_error, unavailable_reason, validate_common)
from dhp_backend.ops.validation import check_values


def _fail(what: str, got: str, accepted: str) -> None:
    raise ValueError(f"cuda_prefill: {what} is {got}; accepted: {accepted}")


# Shared-memory descriptor offsets of the transposed V operand (bytes): between
# the two 64-column halves, and between 8-row swizzle atoms (csrc/sm90_primitives.cuh;
# the swapped pair was measured wrong on the H200, cuda_prefill-cfd35f6.json).
V_DESC = (128 * 128, 1024)
# The binaries (csrc: launch_variant): policy off, and the constant-time walk of the
# policies strict / request (every tile walks its request's public bucket L_r over the
# request's reserved block-table line, block_table[r, :ceil(L_r / block_size)], the
# address rule of design.md section 2; selects instead of branches). The same bits.
V2 = "v2"
_CODES = {V2: 60}
V2_CT = "v2_ct"
_CT_CODES = {V2_CT: 61}
_ALL_CODES = {**_CODES, **_CT_CODES}


def tile_tokens(group: int, head: int = 128) -> int:
    """Query tokens per tile of the constant-time walk: its rows (128; 64 at head 256, csrc
    ``kRows``) / (``group`` rounded up to a power of two), csrc ``Params::block_q`` (policy off
    packs more: 128 // group, 192 // group at head 64; the fewer tokens bound the grid)."""
    rows = 64 if head == 256 else 128
    return rows >> (max(1, group) - 1).bit_length()


def routes_prefill(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs policy-``off`` prefill and mixed steps of ``spec`` (a
    `dispatch.ProblemSpec`) on the `V2` binary, and why not (cheap: no build). The
    setting ``path: triton`` keeps every step of the layer on the Triton kernels."""
    why = common_route_refusal(spec, "prefill_sm90.cu")
    if why:
        return False, why
    return True, "policy off, prefill and mixed steps: csrc/prefill_sm90.cu (v2 binary)"


def routes_prefill_ct(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs prefill and mixed steps of the constant-time policies on
    the `V2_CT` binary, and why not: exactly where `routes_prefill` says yes."""
    ok, why = routes_prefill(spec)
    if not ok:
        return False, why
    return True, "constant-time prefill and mixed steps: csrc/prefill_sm90.cu (v2_ct binary)"


# Head 256, policy off: two consumer warpgroups whose running (folded) states do not fit in shared
# memory beside Q and the K / V stages; each SM's CTA keeps them in its slot of the workspace's split
# area (csrc kRunGlobal): 2 warpgroups x 64 rows x 256 fp32, one slot per SM id (sm_90: at most 144).
# (The kernel keeps the first quarter of each thread's state in shared memory, kRunSmemF4: that part of
# a slot stays unused; the slot's layout is the whole state's.)
RUN_HEAD = 256
RUN_SLOT_BYTES = 2 * 64 * 256 * 4


@functools.lru_cache(maxsize=None)
def _library(window: bool = False, softcap: bool = False, sinks: bool = False, head: int = 128):
    # Loaded and checked once per library (features, head size), not per launch.
    lib = load(*feature_library(PREFILL_LIBRARY, window=window, softcap=softcap, sinks=sinks, head=head))
    check_head_size("cuda_prefill", lib.dhp_prefill_sm90_head_size(), head)
    return lib


@functools.lru_cache(maxsize=None)
def _entry(window: bool = False, softcap: bool = False, sinks: bool = False, head: int = 128):
    # Typed once per library.
    fn = _library(window=window, softcap=softcap, sinks=sinks, head=head).dhp_prefill_sm90
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    u32 = ctypes.c_uint
    fn.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32, i32, i32, u32, u32,
                   i32, i32, p, i32, i32, u32, p,  # CT: l_mode, l_scalar, bucket, max_blocks, q_rows, q_magic, sink
                   i32, ctypes.c_float, ctypes.c_float, p,  # features: window, cap_pre, cap_post, sinks
                   p, i32,  # run, run_slots (head 256, policy off)
                   p]
    fn.restype = i32
    return fn


def run_state(device: torch.device, library: dict) -> tuple[int | None, int]:
    """The policy-off running-state area of a launch on ``library`` (`_library`'s arguments) and its
    slots: (pointer, slots) at head 256 (`RUN_HEAD`: the workspace's split area, 495 slots of
    `RUN_SLOT_BYTES`), (None, 0) otherwise. No device read (CUDA-graph capture safe): sm_90 has at most
    144 SM ids (`sm_id_bound`, checked by a GPU test); the kernel traps on an id past the slots."""
    if library.get("head", 128) != RUN_HEAD:
        return None, 0
    area = wsp.reserve_workspace(device)[0]
    return area.data_ptr(), area.numel() * area.element_size() // RUN_SLOT_BYTES


def sm_id_bound(device: torch.device) -> int:
    """%nsmid of ``device`` (the SM ids' bound, gaps included), read by a one-thread kernel (a sync)."""
    with torch.cuda.device(device):
        out = torch.zeros(1, dtype=torch.int32, device=device)
        fn = _library(head=RUN_HEAD).dhp_prefill_sm90_nsmid
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        rc = fn(out.data_ptr(), torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuda_prefill: reading %nsmid failed: {launch_error(rc)}")
        return int(out.item())


def validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens) -> None:
    """Shapes, dtypes, devices and strides (no device values are read)."""
    validate_common("cuda_prefill", query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                    num_tokens)
    H, Hkv = query.shape[1], key_cache.shape[1]
    if H // Hkv > CSRC_MAX_GROUP:
        _fail("the number of KV heads", f"{Hkv} for {H} query heads",
              f"a divisor of the number of query heads with a ratio <= {CSRC_MAX_GROUP} (the csrc kernels' limit, "
              "cuda_common.CSRC_MAX_GROUP)")
    n = seq_lens.shape[0]
    block_q = tile_tokens(H // Hkv, query.shape[2])
    if num_tokens // block_q + n + 1 > 65535:
        _fail("the step", f"{num_tokens} tokens and {n} requests",
              f"num_tokens / {block_q} + num_seqs + 1 <= 65535 tiles")


def prefill_sm90(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, *, scale: float,
                 causal: bool = True, num_tokens: int | None = None, variant: str = V2,
                 bucket: int | torch.Tensor | None = None, check: bool = True,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (``num_tokens`` defaults to ``query.shape[0]``).

    ``variant`` picks `V2` (policy off) or `V2_CT` (the same bits on the
    constant-time walk to ``bucket``: the public length bucket L of the policy, an
    int or per-request int32 buckets; required by `V2_CT` and refused by `V2`; request r then reads
    ``block_table[r, :ceil(L_r / block_size)]`` whatever its length, pages the
    caller must have reserved for it: design.md section 2).
    ``check`` reads the metadata on the host first (the facts `ops.paged_attention`
    checks with ``check_values``: offsets, lengths, block ids; a device sync).
    ``sliding_window`` (W: the query at position i sees keys j with i - W < j <= i) and
    ``logits_soft_cap`` (c * tanh(s / c) on the scaled scores) and ``sinks`` (a [num_heads] logit
    per head in the softmax denominator, float32 or the query's dtype) run the binaries of the
    feature library (`cuda_build.feature_library`); policy off walks only the window, the
    constant-time walk the whole bucket (the window's position follows the true length).
    """
    num_tokens = query.shape[0] if num_tokens is None else num_tokens
    validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens)
    if variant not in _ALL_CODES:
        _fail("variant", repr(variant), ", ".join(_ALL_CODES))
    library, feature_tail = feature_args("cuda_prefill", scale, causal, sliding_window, logits_soft_cap,
                                          sinks, query)
    ct = variant in _CT_CODES
    if ct != (bucket is not None):
        _fail("bucket", "given" if bucket is not None else "missing",
              f"a bucket with variant {V2_CT!r} and none with {V2!r}")
    if ct:
        l_mode, l_scalar, bucket_t = ct_bucket("cuda_prefill", bucket, seq_lens.shape[0],
                                               block_table.shape[1] * key_cache.shape[2], query.device)
    reason = unavailable_reason(query.device)
    if reason:
        raise RuntimeError(f"cuda_prefill: cannot run here: {reason}")
    if check:
        check_values(query_start_loc, seq_lens, block_table, bucket, num_tokens, key_cache.shape[0],
                      key_cache.shape[2])
    T, H, D = query.shape
    nb, Hkv, bs, _ = key_cache.shape
    ct_args = (0, 0, None, 0, 0, 0, None)
    run_args = (None, 0) if ct else run_state(query.device, library)
    if ct:
        if num_tokens == 0:
            return out
        if seq_lens.shape[0] == 0:  # public geometry: a step without requests is all padding
            out[:num_tokens].zero_()
            return out
        sink = wsp.reserve_workspace(query.device)[1]
        ct_args = (l_mode, l_scalar, None if bucket_t is None else bucket_t.data_ptr(), block_table.shape[1],
                   T, (2**32 - 1) // T, sink.data_ptr())
    with torch.cuda.device(query.device):
        stream = torch.cuda.current_stream().cuda_stream
        launch = _entry(**library)
        rc = launch(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                    key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), nb, out.data_ptr(), out.stride(0),
                    out.stride(1), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
                    query_start_loc.data_ptr(), seq_lens.shape[0], T, num_tokens, H, Hkv, bs,
                    float(scale) * math.log2(math.e),  # qk_scale: the decode launcher's value, for equal bits
                    int(bool(causal)), int(query.dtype == torch.bfloat16), _ALL_CODES[variant], V_DESC[0], V_DESC[1],
                    *ct_args, *feature_pointers(feature_tail), *run_args, stream)
    if rc != 0:
        raise RuntimeError(f"cuda_prefill: launch failed: {launch_error(rc)}")
    return out
