"""`paged_attention`: the seam between the kernels and the vLLM adapter.

Torch tensors in, the result written into a caller-provided tensor. It
validates everything it is given (cheap shape/dtype/device checks always;
value checks that need the host unless ``check_values=False``), plans the step
(`plan.plan_step`: the path, the kernel and binary, the launch geometry; cached
per step geometry) and runs the plan (`plan.run`). The reference path implements
exactly this function; every kernel path must compute the same thing.

Semantics, per request ``r`` with query rows ``query_start_loc[r]:query_start_loc[r+1]``
(``q_len`` rows) and total length ``seq_len = seq_lens[r]`` (cached context plus
the new tokens, whose K/V are already in the cache):

- its K/V position ``p`` (``0 <= p < seq_len``) lives in block
  ``block_table[r, p // block_size]`` at offset ``p % block_size``;
- query row ``i`` (0-based within the request) attends to positions
  ``p < seq_len - q_len + i + 1`` if ``causal``, else to all ``p < seq_len``;
- query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)`` (GQA/MQA);
- ``out[t] = softmax(scale * q[t] . K^T) V``, accumulated in float32, rounded
  once to ``out.dtype``;
- with ``logits_soft_cap = c``, each scaled score ``s`` becomes ``c * tanh(s / c)``
  before the mask and the softmax (vLLM's order: scale, cap, mask);
- with ``sinks``, query head ``h``'s softmax gets one more logit ``sinks[h]``
  that has no value row: ``out = sum_p e^{s_p} v_p / (e^{sinks[h]} + sum_p e^{s_p})``
  (gpt-oss's attention sinks, as vLLM's backends compute them);
- with ``sliding_window = W`` (causal only), query row ``i`` at absolute position
  ``q = seq_len - q_len + i`` attends to ``q - W < p <= q`` only (vLLM's window:
  it passes ``(W - 1, 0)`` to FlashAttention); positions below the window are
  never read by the reference and never influence a kernel's result, so vLLM's
  KV-cache manager may put its null block in their table entries (it does, for
  windowed layers) under ``off``;
- rows ``query_start_loc[-1]:num_tokens`` (padding beyond the last request) are
  set to zero; rows at and beyond ``num_tokens`` are not touched.

Nothing at or beyond ``seq_len`` (stale K/V in reused blocks, block-table
columns past the request's last block) may influence the result.

The address rule (design.md section 2). Under a constant-time policy every
path that claims constant time reads, for request ``r`` with bucket ``L_r``,
exactly the pages ``block_table[r, 0 : ceil(L_r / block_size)]`` in a fixed
order, whatever ``seq_len`` is: padding positions read memory the request owns
and are masked by selection. So the caller must provide valid, distinct pages
*owned by the request* up to each bucket — vLLM does, through the reservation
DHP installs in its scheduler (`dhp_backend.vllm.reservation`); other callers
build tables the same way (`dhp_backend.testing.pages.reserved_table`). The
value check (``check_values=True``) rejects a table that does not, with a
``ValueError``. Under ``off`` only the pages below ``seq_len`` are read.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from dhp_backend.config import Policy
from dhp_backend.ops import dispatch
from dhp_backend.ops.plan import plan_step, run
from dhp_backend.ops.validation import check_values as check_values_of
from dhp_backend.ops.validation import fail as _fail

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _check_tensor(arg: str, t: object, *, ndim: int, dtypes, device: torch.device | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(arg, f"of type {type(t).__name__}", "a torch.Tensor")
    if t.dim() != ndim:
        _fail(arg, f"{t.dim()}-D with shape {tuple(t.shape)}", f"a {ndim}-D tensor")
    if t.dtype not in dtypes:
        _fail(arg, f"of dtype {t.dtype}", " or ".join(str(d) for d in dtypes))
    if device is not None and t.device != device:
        _fail(arg, f"on device {t.device}", f"the device of query ({device})")
    return t


def _check_last_dim_contiguous(arg: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(arg, f"strided with strides {t.stride()} (last-dimension stride {t.stride(-1)})",
              "a tensor whose last dimension is contiguous (stride 1)")


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    policy: Policy | str = Policy.STRICT,
    bucket: int | torch.Tensor | None = None,
    max_model_len: int | None = None,
    num_tokens: int | None = None,
    path: str = "auto",
    allow_fallback: bool = False,
    check_values: bool = True,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention over a packed step of decodes, prefills and prefill chunks.

    Args:
        query: ``[T, num_heads, head_size]`` packed queries of all requests.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``,
            any strides with a contiguous last dimension (views into vLLM's cache).
        block_table: ``[num_reqs, max_blocks]`` int32 physical block ids.
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths.
        seq_lens: ``[num_reqs]`` int32 total lengths (context + this step's tokens).
        out: ``[>= num_tokens, num_heads, head_size]``, written in place and returned.
        scale: softmax scale (usually ``head_size ** -0.5``).
        causal: causal masking with cached context (see module docstring).
        policy: ``strict`` | ``request`` | ``off``.
        bucket: the length bucket L for the policy: an int for ``strict``,
            an int32 ``[num_reqs]`` tensor (or an int) for ``request``, ``None`` for
            ``off``. If omitted under ``strict``, ``max_model_len`` is used.
            See `dhp_backend.ops.buckets.bucket_for_step`. Under a constant-time
            policy ``block_table[r, :ceil(L_r / block_size)]`` must hold valid,
            distinct pages of request r (the address rule, module docstring).
        num_tokens: query rows to produce (default ``query.shape[0]``).
        path: ``auto`` | ``reference`` | ``triton``.
        allow_fallback: accept a non-constant-time path under a constant-time policy.
        check_values: also validate tensor *values* (offsets, lengths, block ids,
            no NaN or +inf in ``sinks``); this reads them on the host (a device
            sync). Callers that validated the same facts from host-side copies pass False.
        logits_soft_cap: ``None`` (or 0: vLLM's "no cap") or a finite positive cap
            ``c``: scores become ``c * tanh(s / c)`` (module docstring). A public
            model parameter: under a constant-time policy it selects a binary, never a
            branch, trip count or address.
        sinks: ``None`` or the per-head sink logits, ``[num_heads]`` float32 (or the
            query's dtype: vLLM hands gpt-oss's parameter in the model dtype), on the
            query's device, contiguous. Public model parameters, read at addresses
            that depend on the head only.
        sliding_window: ``None`` or the window ``W``, an int >= 1: row at position ``q``
            sees ``q - W < p <= q`` (module docstring). A ``W >= max_model_len`` (when
            given) is no window (`check_sliding_window`). Causal attention only. A public
            model parameter: it selects a binary. Under a constant-time policy the kernels
            still walk the whole bucket (the window's position follows the secret length);
            under ``off`` they start at the window.
    """
    if not isinstance(query, torch.Tensor):
        _fail("query", f"of type {type(query).__name__}", "a torch.Tensor")
    device = query.device
    if device.type == "meta":
        _fail("query", "on the meta device (no data)", "tensors on a CPU or CUDA device")
    # allow_fallback lowers the promise: only a real bool counts (a truthy string
    # such as "no" must never turn on the non-constant-time path).
    if not isinstance(allow_fallback, bool):
        _fail("allow_fallback", repr(allow_fallback), "True or False (a bool)")
    if not isinstance(check_values, bool):
        _fail("check_values", repr(check_values), "True or False (a bool)")
    if not isinstance(path, str) or path.strip().lower() not in ("auto",) + tuple(dispatch.PATHS):
        _fail("path", repr(path), "'auto', " + ", ".join(repr(p) for p in dispatch.PATHS) + " (any case)")
    path = path.strip().lower()
    _check_tensor("query", query, ndim=3, dtypes=SUPPORTED_DTYPES, device=None)
    _check_last_dim_contiguous("query", query)
    T, num_heads, head_size = query.shape
    if num_heads == 0 or head_size == 0:
        _fail("query", f"of shape {tuple(query.shape)}", "at least one head and head_size >= 1")

    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_tensor(name, cache, ndim=4, dtypes=(query.dtype,), device=device)
        _check_last_dim_contiguous(name, cache)
    if key_cache.shape != value_cache.shape:
        _fail("value_cache", f"of shape {tuple(value_cache.shape)}",
              f"the shape of key_cache {tuple(key_cache.shape)}")
    num_blocks, num_kv_heads, block_size, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        _fail("key_cache", f"of head size {cache_head_size} (shape {tuple(key_cache.shape)})",
              f"the head size of query ({head_size}); layout [num_blocks, num_kv_heads, block_size, head_size]")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        _fail("key_cache", f"with {num_kv_heads} KV heads for {num_heads} query heads",
              "a number of KV heads that divides the number of query heads (GQA/MQA)")
    if block_size == 0 or num_blocks == 0:
        _fail("key_cache", f"of shape {tuple(key_cache.shape)}", "at least one block of at least one slot")

    _check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    _check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    _check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        _fail("query_start_loc", f"of length {query_start_loc.shape[0]}",
              f"num_reqs + 1 = {num_reqs + 1} entries (seq_lens has {num_reqs})")
    if block_table.shape[0] < num_reqs:
        _fail("block_table", f"of shape {tuple(block_table.shape)}", f"at least num_reqs = {num_reqs} rows")

    _check_tensor("out", out, ndim=3, dtypes=(query.dtype,), device=device)
    _check_last_dim_contiguous("out", out)
    if num_tokens is None:
        num_tokens = T
    num_tokens = _as_int("num_tokens", num_tokens, f"an integer in [0, query.shape[0] = {T}]")
    if not 0 <= num_tokens <= T:
        _fail("num_tokens", repr(num_tokens), f"an integer in [0, query.shape[0] = {T}]")
    if tuple(out.shape[1:]) != (num_heads, head_size) or out.shape[0] < num_tokens:
        _fail("out", f"of shape {tuple(out.shape)}", f"[>= {num_tokens}, {num_heads}, {head_size}]")

    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and not scale.dtype.is_complex:
        scale = scale.item()
    if (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale))
            or scale <= 0):
        _fail("scale", repr(scale), "a finite positive real number (usually head_size ** -0.5)")
    if not isinstance(causal, bool):
        _fail("causal", repr(causal), "True or False")

    logits_soft_cap = check_soft_cap(logits_soft_cap)
    check_sinks(sinks, num_heads, query.dtype, device)
    sliding_window = check_sliding_window(sliding_window, max_model_len, causal=causal)

    policy = Policy.parse(policy, source="paged_attention: policy")
    bucket = _normalize_bucket(policy, bucket, max_model_len, num_reqs, device,
                               block_table.shape[1] * block_size)

    if check_values:
        check_values_of(query_start_loc, seq_lens, block_table, bucket, num_tokens, num_blocks, block_size)
        if sinks is not None:
            bad = torch.isnan(sinks) | (sinks == float("inf"))
            if bool(bad.any()):
                _fail("sinks", f"NaN or +inf at heads {bad.nonzero().flatten().tolist()}",
                      "finite per-head logits (-inf: no sink for that head)")

    spec = dispatch.ProblemSpec(
        device_type=device.type,
        dtype=_DTYPE_NAMES[query.dtype],
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        causal=causal,
        device_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks is not None,
        sliding_window=sliding_window,
    )
    step = plan_step(spec, policy, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=block_table.shape[1],
                     bucket_l=bucket if isinstance(bucket, int) else None, path=path,
                     allow_fallback=allow_fallback, device=device)
    return run(step, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
               scale=float(scale), causal=causal, bucket=bucket, sinks=sinks, sliding_window=sliding_window)


def check_soft_cap(cap) -> float | None:
    """None for no cap (``None`` or 0, vLLM's two spellings), else the cap as a float."""
    if cap is None:
        return None
    if isinstance(cap, torch.Tensor) and cap.dim() == 0 and cap.dtype.is_floating_point:
        cap = cap.item()
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(float(cap)) or cap < 0:
        _fail("logits_soft_cap", repr(cap), "None (or 0) for no cap, or a finite positive real number")
    return float(cap) if cap > 0 else None


def check_sliding_window(window, max_model_len=None, *, causal: bool = True) -> int | None:
    """The window as the kernels take it: None for no window, else an int >= 1.

    The one place where a window that cannot bite becomes no window: ``W >=
    max_model_len`` (Phi-3.5-mini's 262,144 in a 131,072 context) is None, so such a
    layer runs the plain binaries (and the csrc kernels). vLLM's "no window" spellings
    (``None``, ``-1``) are None too. With ``causal=False`` a window that remains is
    refused: vLLM's window is the causal lower bound only. Callers that build a
    `ProblemSpec` themselves (the vLLM adapter) normalise with this function and pass
    the same value to ``ProblemSpec.sliding_window`` and ``plan.run``."""
    if window is None:
        return None
    accepted = "None (or -1) for no window, or an int W >= 1 (row at position q sees keys q - W < p <= q)"
    if isinstance(window, bool) or (isinstance(window, torch.Tensor) and window.dtype == torch.bool):
        _fail("sliding_window", repr(window), accepted)
    window = _as_int("sliding_window", window, accepted)
    if window == -1:
        return None
    if window < 1:
        _fail("sliding_window", repr(window), accepted)
    if max_model_len is not None:
        max_model_len = _as_int("max_model_len", max_model_len, "a positive integer")
        if window >= max_model_len:
            return None  # every position of every request is in the window
    if not causal:
        _fail("sliding_window", f"{window} with causal=False",
              "a window on causal attention only (None, or a W >= max_model_len, for non-causal attention)")
    return window


def check_sinks(sinks, num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
    if sinks is None:
        return
    dtypes = (torch.float32,) if dtype == torch.float32 else (torch.float32, dtype)
    _check_tensor("sinks", sinks, ndim=1, dtypes=dtypes, device=device)
    if sinks.shape[0] != num_heads:
        _fail("sinks", f"of shape {tuple(sinks.shape)}", f"one logit per query head: [{num_heads}]")
    if sinks.stride(0) != 1:
        _fail("sinks", f"strided with stride {sinks.stride(0)}", "a contiguous tensor")


def _as_int(arg: str, value, accepted: str) -> int:
    """An integer argument: Python, NumPy or 0-d integer tensor, never a bool or a float."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        _fail(arg, repr(value), accepted)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex:
            _fail(arg, repr(value), accepted)
        return int(value.item())
    try:
        return operator.index(value)
    except TypeError:
        _fail(arg, repr(value), accepted)


def _normalize_bucket(policy, bucket, max_model_len, num_reqs, device, table_capacity):
    """Check the bucket against the policy; return an int, an int32 tensor, or None."""
    if max_model_len is not None:
        max_model_len = _as_int("max_model_len", max_model_len, "a positive integer")
        if max_model_len <= 0:
            _fail("max_model_len", repr(max_model_len), "a positive integer")
    if policy is Policy.OFF:
        if bucket is not None:
            _fail("bucket", repr(bucket), "None under policy 'off' (true lengths are used)")
        return None
    if bucket is None and policy is Policy.STRICT and max_model_len is not None:
        bucket = max_model_len
    if policy is Policy.REQUEST and isinstance(bucket, torch.Tensor):
        _check_tensor("bucket", bucket, ndim=1, dtypes=(torch.int32,), device=device)
        if bucket.shape[0] != num_reqs:
            _fail("bucket", f"of length {bucket.shape[0]}", f"one entry per request ({num_reqs})")
        return bucket
    want = ("a positive integer or an int32 tensor of per-request buckets" if policy is Policy.REQUEST
            else "a positive integer (the length bucket L)")
    if bucket is None:
        _fail("bucket", repr(bucket), f"{want} under policy '{policy.value}'")
    bucket = _as_int("bucket", bucket, f"{want} under policy '{policy.value}'")
    if bucket <= 0:
        _fail("bucket", repr(bucket), f"{want} under policy '{policy.value}'")
    if bucket > table_capacity:
        _fail("bucket", str(bucket),
              f"at most block_table.shape[1] * block_size = {table_capacity} (the kernels read the "
              "block table up to the bucket)")
    return int(bucket)
