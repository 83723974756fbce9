"""What the csrc kernels (`cuda_prefill`, `cuda_decode`) share on the host side:
the problems they accept, the device they need, the argument checks, and the
meaning of their C entry points' error codes."""

from __future__ import annotations

import functools
import math

import torch

from dhp_backend.ops.cuda_build import HEAD_SIZES  # one library per head size

BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16)
# Query heads per KV head a csrc route takes: the 16 rows of the decode consumer's
# mma.sync tile. The same limit for every csrc route, because a layer runs all its
# steps on the csrc kernels (the arithmetic of docs/kernels.md section 7) or all on
# the Triton kernels (their own arithmetic): never some of each (`ops.plan.step_route`).
CSRC_MAX_GROUP = 16

# The C entry points' negative return codes (csrc/*.cu; positive: a cudaError_t).
_LAUNCH_ERRORS = {
    -1: "cuTensorMapEncodeTiled not found in the driver",
    -2: "the TMA map of query was rejected",
    -3: "the TMA map of key_cache was rejected",
    -4: "the TMA map of value_cache was rejected",
    -5: "unknown variant",
    -6: "the grid is too large",
    -7: "query heads per KV head outside what the kernel accepts",
    -8: "the constant-time walk's arguments are out of range (requests, rows, table, bucket mode, sink)",
    -9: "the split-state workspace is not 16-byte aligned",
    -10: "the window / soft-cap / sinks arguments do not match the library's features (cuda_build.feature_library)",
    -11: "the running-state workspace (head 256, policy off) is missing, empty or not 16-byte aligned",
    -12: "the dealt split schedule's arguments are out of range (deal_slots < 0, or more requests than the "
         "library's dhp_decode_sm90_deal_max_reqs, more grid rows than its dhp_decode_sm90_deal_max_rows, or "
         "no 16-byte aligned table)",
}


def check_head_size(who: str, built: int, wanted: int) -> None:
    """A loaded library's head size (its ``*_head_size()`` export, csrc/v2_arith.cuh DHP_HEAD) is the one it
    was loaded for: a library built for another head would read the wrong columns."""
    if built != wanted:
        raise RuntimeError(f"{who}: the library loaded for head size {wanted} was built for head size {built}; "
                           "accepted: the library of the query's head size (cuda_build.feature_library head=)")


def launch_error(rc: int) -> str:
    return _LAUNCH_ERRORS.get(rc, f"CUDA error {rc}")


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the csrc kernels cannot run here (None when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    return _capability_reason(torch.cuda.current_device() if device is None else torch.device(device).index)


@functools.lru_cache(maxsize=None)
def _capability_reason(index: int | None) -> str | None:
    # Once per device, not per launch.
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}; the kernel is built for sm_90a (H100/H200) only"
    return None


_BUILD_FAILED: dict[str, str] = {}  # csrc source -> why its library failed to build in this process


def mark_build_failed(source: str, why: str) -> None:
    """Refuse ``csrc/<source>`` to every route of this process (`plan.prepare_kernels`: its build failed)."""
    _BUILD_FAILED[source] = why


def common_route_refusal(spec, source: str) -> str | None:
    """Why a problem (`dispatch.ProblemSpec`) cannot go to a csrc kernel for any
    of the reasons the kernels share (None when nothing shared stands in the way)."""
    if spec.device_type != "cuda" or tuple(spec.device_capability or ()) != (9, 0):
        return "not an sm_90 GPU"
    if spec.head_size not in HEAD_SIZES:
        return f"head size {spec.head_size} (the csrc kernels have {', '.join(map(str, HEAD_SIZES))})"
    if spec.dtype not in ("bfloat16", "float16"):
        return f"dtype {spec.dtype}"
    if spec.block_size not in BLOCK_SIZES:
        return f"block size {spec.block_size}"
    from dhp_backend.ops.cuda_build import find_nvcc
    if find_nvcc() is None:
        return (f"no nvcc to build csrc/{source} (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, "
                "PATH; the csrc Hopper kernels are faster: install the CUDA toolkit >= 12.5)")
    g = spec.num_heads // max(1, spec.num_kv_heads)
    if g > CSRC_MAX_GROUP:
        return (f"{g} query heads per KV head (the csrc kernels take at most {CSRC_MAX_GROUP}: the decode "
                "consumer's mma.sync tile)")
    # One library failing refuses both: a layer's steps all run on the csrc kernels or none.
    for failed, why in _BUILD_FAILED.items():
        return f"csrc/{failed} failed to build ({why}); a layer runs every step on the csrc kernels or none"
    return None


def validate_common(who: str, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                    num_tokens) -> None:
    """Shapes, dtypes, devices and strides every csrc kernel needs (no device values are read)."""
    def fail(what: str, got: str, accepted: str) -> None:
        raise ValueError(f"{who}: {what} is {got}; accepted: {accepted}")

    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out),
                    ("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            fail(name, f"a {type(t).__name__}", "a torch.Tensor")
        if t.device.type != "cuda":
            fail(f"{name}'s device", str(t.device), "a CUDA device (sm_90)")
    if query.dim() != 3 or query.shape[2] not in HEAD_SIZES:
        fail("query's shape", str(tuple(query.shape)),
             f"[num_tokens, num_heads, D] with D in {{{', '.join(map(str, HEAD_SIZES))}}}")
    if query.dtype not in DTYPES:
        fail("query's dtype", str(query.dtype), "torch.bfloat16 or torch.float16")
    T, H, D = query.shape
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != 4 or t.shape[3] != D or t.dtype != query.dtype:
            fail(f"{name} ({t.dtype}, shape {tuple(t.shape)})", "not matching the query",
                 f"[num_blocks, num_kv_heads, block_size, {D}] in {query.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        fail("value_cache", f"shape {tuple(value_cache.shape)} strides {value_cache.stride()}",
             f"key_cache's shape {tuple(key_cache.shape)} and strides {key_cache.stride()}")
    nb, Hkv, bs, _ = key_cache.shape
    if bs not in BLOCK_SIZES:
        fail("the block size", str(bs), ", ".join(map(str, BLOCK_SIZES)))
    if Hkv == 0 or H % Hkv:
        fail("the number of KV heads", f"{Hkv} for {H} query heads", "a divisor of the number of query heads")
    if not isinstance(num_tokens, int) or not 0 <= num_tokens <= T:
        fail("num_tokens", repr(num_tokens), f"an int in [0, query.shape[0] = {T}]")
    if out.shape[1:] != query.shape[1:] or out.dtype != query.dtype or out.shape[0] < num_tokens:
        fail("out", f"{out.dtype} of shape {tuple(out.shape)}", f"{query.dtype} of shape [>= {num_tokens}, {H}, {D}]")
    for name, t in (("query", query), ("out", out)):
        if t.stride(-1) != 1 or t.stride(-2) != D:
            fail(f"{name}'s strides", str(t.stride()),
                 f"contiguous head rows ([..., H, {D}] with strides (..., {D}, 1))")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            fail(f"{name}'s address/strides", f"{t.data_ptr():#x} / {t.stride()}",
                 "16-byte aligned base and strides (a TMA requirement)")
    if key_cache.stride(-1) != 1:
        fail("key_cache's strides", str(key_cache.stride()), "a contiguous last dimension (any other strides "
             "that are multiples of 16 bytes, e.g. vLLM's K/V-interleaved cache views)")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            fail(f"{name}'s dtype", str(t.dtype), "torch.int32")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        fail("block_table", f"shape {tuple(block_table.shape)} strides {block_table.stride()}",
             "[num_seqs, max_blocks] with contiguous rows")
    n = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (n + 1,) or block_table.shape[0] < n:
        fail("the metadata", f"seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)}, "
             f"block_table {tuple(block_table.shape)}", "[n], [n + 1] and [>= n, max_blocks]")
    if not seq_lens.is_contiguous() or not query_start_loc.is_contiguous():
        fail("seq_lens/query_start_loc", "strided", "contiguous int32 vectors")


def ct_bucket(who: str, bucket, num_seqs: int, capacity: int, device) -> tuple[int, int, torch.Tensor | None]:
    """(l_mode, l_scalar, per-request tensor) of a constant-time walk, as the Triton
    launcher's: an int bucket L in [1, capacity] (l_mode 0), or an int32 tensor of
    ``num_seqs`` per-request buckets on ``device`` (l_mode 1)."""
    if isinstance(bucket, torch.Tensor):
        if bucket.dtype != torch.int32 or bucket.dim() != 1 or bucket.shape[0] != num_seqs or bucket.device != device:
            raise ValueError(f"{who}: bucket is a {bucket.dtype} tensor of shape {tuple(bucket.shape)} on "
                             f"{bucket.device}; accepted: an int, or an int32 tensor of {num_seqs} per-request "
                             f"buckets on {device}")
        return 1, 0, bucket
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 < bucket <= capacity:
        raise ValueError(f"{who}: bucket is {bucket!r}; accepted: an int in [1, block_table.shape[1] * block_size "
                         f"= {capacity}]")
    return 0, int(bucket), None


def soft_cap_constants(scale: float, cap: float, head: int) -> tuple[float, float]:
    """``(pre, post)`` of csrc/v2_arith.cuh ``soft_cap`` for a library of head size ``head``: its form
    follows the head (``kTanhCap``, measured by G4: docs/audit/2026-11-28-timing-h200-csrc-cap.md).
    Head 256: tanh.approx(s * pre) * post, pre = scale / c. Every other head: the saturating form
    (1 - 2 / (2^(s * pre) + 1)) * post, pre = 2 * scale * log2(e) / c. post = c * log2(e) in both."""
    log2e = math.log2(math.e)
    pre = float(scale) / float(cap) if int(head) == 256 else 2.0 * float(scale) * log2e / float(cap)
    return pre, float(cap) * log2e


def feature_args(who: str, scale: float, causal: bool, sliding_window, logits_soft_cap,
                 sinks=None, query=None) -> tuple[dict, tuple]:
    """The model features of a csrc launch: ``feature_library``'s keywords (which library has the
    binaries) and the C entry points' trailing arguments ``(window, cap_pre, cap_post, sinks)``.

    The window W (an int >= 1, causal only; None: none) is passed as it is: the query at position i
    sees keys j with i - W < j <= i (vLLM's window). A soft cap c > 0 (None: none) becomes
    the two constants of `soft_cap_constants` (the library's head size picks the form): csrc/v2_arith.cuh
    ``soft_cap`` computes c * tanh(s * scale / c) in log2 units from them, the same two constants for
    both kernels (equal bits). ``sinks`` (None: none) is a [num_heads] tensor on the query's device,
    float32 or the query's dtype (``ops.attention.check_sinks``' rule), passed as float32: the kernels
    fold the sink's state (m = sinks[h] * log2 e, l = 1) into each row after its last split. The
    library's head size is the query's (128 when no query is given). The returned tail holds the
    float32 tensor: keep it alive until the launch is queued."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"{who}: sliding_window is {sliding_window!r}; accepted: None or an int >= 1 "
                             "(ops.attention.check_sliding_window normalises a model's value)")
        if not causal:
            raise ValueError(f"{who}: sliding_window {sliding_window} with causal=False; accepted: causal=True "
                             "(the window is the causal lower bound)")
    cap_pre = cap_post = 0.0
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) or not (
                0 < float(logits_soft_cap) < float("inf")):
            raise ValueError(f"{who}: logits_soft_cap is {logits_soft_cap!r}; accepted: None or a finite "
                             "number > 0")
        cap_pre, cap_post = soft_cap_constants(scale, logits_soft_cap, 128 if query is None else query.shape[-1])
    sinks_f32 = None
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or query is None or sinks.dim() != 1 or \
                sinks.shape[0] != query.shape[1] or sinks.device != query.device or \
                sinks.dtype not in (torch.float32, query.dtype):
            got = (f"a {sinks.dtype} tensor of shape {tuple(sinks.shape)} on {sinks.device}"
                   if isinstance(sinks, torch.Tensor) else f"a {type(sinks).__name__}")
            raise ValueError(f"{who}: sinks is {got}; accepted: None or a [num_heads] tensor on the query's "
                             "device, float32 or the query's dtype")
        sinks_f32 = sinks.to(torch.float32).contiguous()
    library = dict(window=sliding_window is not None, softcap=logits_soft_cap is not None,
                   sinks=sinks_f32 is not None, head=128 if query is None else int(query.shape[-1]))
    return library, (int(sliding_window or 0), cap_pre, cap_post, sinks_f32)


def feature_pointers(tail: tuple) -> tuple:
    """`feature_args`' tail as the C entry points take it (the sinks tensor as its address, or null)."""
    window, cap_pre, cap_post, sinks = tail
    return window, cap_pre, cap_post, None if sinks is None else sinks.data_ptr()


def spec_features(spec) -> dict:
    """``feature_library``'s keywords for a layer (`dispatch.ProblemSpec`): its features and head size."""
    return dict(window=spec.sliding_window is not None, softcap=bool(spec.logits_soft_cap), sinks=bool(spec.sinks),
                head=int(spec.head_size))
