"""Paged prefill attention on Hopper from ``csrc/prefill_sm90.cu`` (policy ``off`` semantics).

The kernel issue 4's notes name as the route past Triton 3.6 on this chip: a TMA
producer warpgroup loading 16-token pages into 128-row shared-memory stages and
two consumer warpgroups on wgmma with explicit waits (docs/kernels.md).

What it is and is not, today:
- Semantics of `ops.paged_attention` under policy ``off`` (true lengths, causal
  with cached context, GQA/MQA), same argument layouts. Deterministic and batch
  invariant by construction: one CTA per (request, 128 query rows, head), no
  atomics, a fixed KV order.
- Not constant-time (it walks the true lengths).
- The Triton kernels' arithmetic. The ``compat`` binary repeats it operation for
  operation (64-position steps, 512-position splits folded, the same row-sum
  tree, ex2/div instructions and roundings: csrc/prefill_sm90.cu), so its rows
  have the Triton kernels' bits (GPU test) and `ops.paged_attention` may route
  policy-``off`` prefill steps to it without breaking the cross-step-kind bit
  equality that batch invariance rests on (`routes_prefill`). (FA3-like binaries,
  faster but with other bits, were measured and never routed: docs/perf-notes.md;
  the library does not build them.)
- Head size 128, fp16/bf16, block size 16/32/64/128, any number of query heads per
  KV head up to 128 (a ratio that is not a power of two, Qwen2.5's 7 or Qwen3-14B's
  5, fills its tile's token rows with the next power of two of head slots, the
  surplus slots computed and never stored), sm_90 only. Anything else
  is refused with a message saying what is accepted.

Writes rows ``[0, num_tokens)``: the requests' rows, and zeros for the padding
rows past ``query_start_loc[-1]`` (as the Triton kernels do); nothing beyond.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from dhp_backend.ops import workspace as wsp
from dhp_backend.ops.cuda_build import PREFILL_LIBRARY, load
from dhp_backend.ops.cuda_common import (BLOCK_SIZES, DTYPES, HEAD_SIZE, common_route_refusal, ct_bucket,  # noqa: F401
                                         launch_error, unavailable_reason, validate_common)
from dhp_backend.ops.validation import check_values


def _fail(what: str, got: str, accepted: str) -> None:
    raise ValueError(f"cuda_prefill: {what} is {got}; accepted: {accepted}")


# Shared-memory descriptor offsets of the transposed V operand (bytes): between
# the two 64-column halves, and between 8-row swizzle atoms (csrc/sm90_primitives.cuh;
# the swapped pair was measured wrong on the H200, cuda_prefill-cfd35f6.json).
V_DESC = (128 * 128, 1024)
# The Triton kernels' arithmetic (csrc: COMPAT), policy off: the csrc code of the binary.
# Its QK^T runs as one m64n128 wgmma batch per 128 positions (Triton's tile issues two
# m64n64 batches; the same products and bits, 4-5 % faster on an H200), with FA3's
# register split (producer warpgroup 24, consumers 240 instead of 40 / 232: ptxas
# spills 56 B per thread instead of 100), 1-2 % faster with the same bits (H200,
# cuda_prefill-2efc818-r240.json; 32 / 240 hung in setmaxnreg.inc).
COMPAT = "compat"
_CODES = {COMPAT: 33}
# The same arithmetic on the constant-time walk of the Triton kernels' CONST_TIME
# binaries (csrc: CT; policies strict / request): every tile walks its request's
# public bucket L_r over the request's reserved block-table line
# (block_table[r, :ceil(L_r / block_size)], the address rule of design.md section 2),
# selects instead of branches. Its QK^T is the m64n64 form (the n128 form spilled
# in this binary).
COMPAT_CT = "compat_ct"
_CT_CODES = {COMPAT_CT: 34}
# Every binary with the Triton kernels' bits under policy off.
COMPAT_VARIANTS = tuple(_CODES)
# Every binary with the Triton CONST_TIME kernels' bits (takes a bucket).
COMPAT_CT_VARIANTS = tuple(_CT_CODES)
_ALL_CODES = {**_CODES, **_CT_CODES}


def tile_tokens(group: int) -> int:
    """Query tokens per 128-row tile: 128 / (``group`` rounded up to a power of two),
    csrc ``Params::block_q``."""
    return 128 >> (max(1, group) - 1).bit_length()


def routes_prefill(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs policy-``off`` prefill steps of ``spec`` (a
    `dispatch.ProblemSpec`) on the ``compat`` binary, and why not. Cheap (no
    build): the build happens on the first such step. The setting ``path: triton``
    keeps every step on the Triton kernels (same bits)."""
    why = common_route_refusal(spec, "prefill_sm90.cu")
    if why:
        return False, why
    g = spec.num_heads // max(1, spec.num_kv_heads)
    if g > 128:
        return False, f"{g} query heads per KV head (more than 128)"
    return True, "policy off, prefill steps: csrc/prefill_sm90.cu (compat binary)"


def routes_prefill_ct(spec) -> tuple[bool, str]:
    """Whether `ops.plan` runs prefill steps of the constant-time policies on the
    ``compat_ct`` binary, and why not: wherever the csrc prefill kernel runs (its
    G1 and G2 gates pass: docs/audit)."""
    ok, why = routes_prefill(spec)
    if not ok:
        return False, why
    return True, "constant-time prefill steps: csrc/prefill_sm90.cu (compat_ct binary)"


@functools.lru_cache(maxsize=None)
def _entry():
    # Loaded and typed once, not per launch.
    fn = load(*PREFILL_LIBRARY).dhp_prefill_sm90
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    u32 = ctypes.c_uint
    fn.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32, i32, i32, u32, u32,
                   i32, i32, p, i32, i32, u32, p,  # CT: l_mode, l_scalar, bucket, max_blocks, q_rows, q_magic, sink
                   p]
    fn.restype = i32
    return fn


def validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens) -> None:
    """Shapes, dtypes, devices and strides (no device values are read)."""
    validate_common("cuda_prefill", query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                    num_tokens)
    H, Hkv = query.shape[1], key_cache.shape[1]
    if H // Hkv > 128:
        _fail("the number of KV heads", f"{Hkv} for {H} query heads",
              "a divisor of the number of query heads with a ratio <= 128 (a tile packs 128 / slots tokens x "
              "slots heads, slots = the ratio's next power of two)")
    n = seq_lens.shape[0]
    block_q = tile_tokens(H // Hkv)
    if num_tokens // block_q + n + 1 > 65535:
        _fail("the step", f"{num_tokens} tokens and {n} requests",
              f"num_tokens / {block_q} + num_seqs + 1 <= 65535 tiles")


def prefill_sm90(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, *, scale: float,
                 causal: bool = True, num_tokens: int | None = None, variant: str = COMPAT,
                 bucket: int | torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (``num_tokens`` defaults to ``query.shape[0]``).

    ``variant`` picks `COMPAT` (the Triton kernels' bits) or
    `COMPAT_CT` (the same bits on the constant-time walk to ``bucket``: the public
    length bucket L of the policy, an int or per-request int32 buckets; required
    by `COMPAT_CT` and refused by the others; request r then reads
    ``block_table[r, :ceil(L_r / block_size)]`` whatever its length, pages the
    caller must have reserved for it: design.md section 2).
    ``check`` reads the metadata on the host first (the facts `ops.paged_attention`
    checks with ``check_values``: offsets, lengths, block ids; a device sync).
    """
    num_tokens = query.shape[0] if num_tokens is None else num_tokens
    validate(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, num_tokens)
    if variant not in _ALL_CODES:
        _fail("variant", repr(variant), ", ".join(_ALL_CODES))
    ct = variant in _CT_CODES
    if ct != (bucket is not None):
        _fail("bucket", "given" if bucket is not None else "missing",
              f"a bucket with variant {COMPAT_CT!r} and none with the others")
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
        launch = _entry()
        rc = launch(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                    key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), nb, out.data_ptr(), out.stride(0),
                    out.stride(1), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
                    query_start_loc.data_ptr(), seq_lens.shape[0], T, num_tokens, H, Hkv, bs,
                    float(scale) * math.log2(math.e),  # qk_scale as the Triton launcher computes it
                    int(bool(causal)), int(query.dtype == torch.bfloat16), _ALL_CODES[variant], V_DESC[0], V_DESC[1],
                    *ct_args, stream)
    if rc != 0:
        raise RuntimeError(f"cuda_prefill: launch failed: {launch_error(rc)}")
    return out
