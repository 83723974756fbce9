"""Host side of the Triton path: the launches of a planned geometry.

The geometry (tile config, grid, split mode) is decided from public values only
(`dhp_backend.ops.geometry.triton_geometry`, once per step by the step plan);
this module turns it into the attention launch and, in split mode, the merge
launch. Nothing reads a tensor's values on the host (no sync; safe under
CUDA-graph capture once the workspace exists).
"""

from __future__ import annotations

import math
import os

import torch

from dhp_backend.config import Policy
from dhp_backend.ops import geometry
from dhp_backend.ops import workspace as wsp
from dhp_backend.ops import tiles as kcfg
from dhp_backend.ops.triton import kernels

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MERGE_UNROLL = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def bucket_mode(policy: Policy, bucket: int | torch.Tensor | None) -> tuple[int, int]:
    """(l_mode, l_scalar) of a step: true lengths under ``off``, per-request buckets
    for a tensor, one bucket L for an int."""
    if policy is Policy.OFF:
        return geometry.TRUE_LENGTHS, 0
    if isinstance(bucket, torch.Tensor):
        return geometry.PER_REQUEST_BUCKETS, 0
    if bucket is None:
        raise ValueError(f"policy {policy.value!r} needs a bucket")
    return geometry.SCALAR_BUCKET, int(bucket)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    num_tokens: int,
    policy: Policy | str,
    bucket: int | torch.Tensor | None,
    _mode: str | None = None,
    _split_kv: int | None = None,
    _config: kcfg.KernelConfig | None = None,
    _tiling: str | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (already validated there): plans the
    launch's geometry, then `launch` runs it.

    ``_mode``/``_split_kv``/``_config``/``_tiling`` are test and benchmark hooks
    (force the split mode; a smaller split size so short sequences cross split
    boundaries under the interpreter; another tile config to compare; force the
    tiling).
    """
    policy = Policy.parse(policy)
    num_reqs = seq_lens.shape[0]
    g = None
    if num_tokens and num_reqs:
        l_mode, l_scalar = bucket_mode(policy, bucket)
        g = geometry.triton_geometry(
            num_tokens=num_tokens, num_reqs=num_reqs, num_heads=query.shape[1], num_kv_heads=key_cache.shape[1],
            head_size=query.shape[2], dtype_name=_DTYPE_NAMES[query.dtype], const_time=policy is not Policy.OFF,
            l_mode=l_mode, l_scalar=l_scalar, capacity=block_table.shape[1] * key_cache.shape[2],
            num_sms=geometry.num_sms_of(query.device), mode=_mode, split_kv=_split_kv, config=_config,
            tiling=_tiling)
    return launch(g, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, scale=scale,
                  causal=causal, num_tokens=num_tokens, policy=policy, bucket=bucket,
                  logits_soft_cap=logits_soft_cap, sinks=sinks, sliding_window=sliding_window)


def launch(g: geometry.TritonGeometry | None, query, key_cache, value_cache, block_table, query_start_loc,
           seq_lens, out, *, scale: float, causal: bool, num_tokens: int, policy: Policy,
           bucket: int | torch.Tensor | None, logits_soft_cap: float | None = None,
           sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Run a step on the Triton kernels with geometry ``g`` (None: a step without
    tokens or requests, which has no launch).

    ``logits_soft_cap``, ``sinks`` and ``sliding_window`` select the kernels'
    SOFTCAP / HAS_SINKS / WINDOW binaries only when given: a plain step passes
    what it always passed. The window must already be normalised
    (`ops.attention.check_sliding_window`: an int >= 1, causal only)."""
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    if num_reqs == 0:
        # Public geometry: a step without requests is all padding.
        out[:num_tokens].zero_()
        return out

    q_rows, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    const_time = policy is not Policy.OFF
    bucket_t = bucket if g.l_mode == geometry.PER_REQUEST_BUCKETS else seq_lens
    cfg = g.cfg

    # The model features as the kernels' constexprs; nothing at all for a plain
    # step, so that it compiles to (and caches) the very binaries it always did.
    features = {}
    if logits_soft_cap:
        features["SOFTCAP"] = float(logits_soft_cap)
    if sinks is not None:
        features.update(HAS_SINKS=True, attn_sinks_ptr=sinks)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1 \
                or not causal:
            raise ValueError(f"launch: sliding_window is {sliding_window!r} (causal={causal}); accepted: an int >= 1 "
                             "on causal attention (ops.attention.check_sliding_window)")
        features["WINDOW"] = sliding_window  # one binary per window size (a model has one or two)

    ws, sink, zero = wsp.reserve_workspace(query.device)
    if g.split:
        ws_acc, ws_m, ws_l = geometry.split_states(ws, g.n_split_grid, num_tokens, num_heads, head_size)
    else:
        ws_acc = ws_m = ws_l = ws  # never dereferenced: WRITE_PARTIALS is false

    kernels.attention_kernel[g.grid(num_kv_heads)](
        query, query.stride(0), query.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out, out.stride(0), out.stride(1),
        block_table, block_table.stride(0), query_start_loc, seq_lens, bucket_t,
        ws_acc, ws_m, ws_l, sink, sink.view(out.dtype), zero.view(value_cache.dtype),
        # With a cap the kernel takes s / cap in natural units (kernels.soft_cap).
        float(scale) / logits_soft_cap if logits_soft_cap else float(scale) * math.log2(math.e),
        num_reqs, num_tokens, q_rows, num_heads,
        g.l_scalar, g.l_mode, 0, geometry.cdiv(num_reqs, kcfg.SEARCH_BLOCK),
        g.n_split_grid, g.chunks if g.split else g.spp, 1 if g.token_tiles else 0,
        block_table.shape[1],
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.tiles_per_split, BLOCK_SIZE=block_size,
        HEAD=head_size, HEAD_PAD=cfg.head_pad, CAUSAL=bool(causal),
        FP32=cfg.fp32, UPCAST_DOT=_interpreting() and query.dtype == torch.bfloat16, INTERPRET=_interpreting(),
        SEARCH_BLOCK=kcfg.SEARCH_BLOCK,
        SINK_SLOTS=wsp.SINK_SLOTS, SINK_ROWS=wsp.SINK_ROWS, SINK_WIDTH=wsp.SINK_WIDTH,
        PREFETCH=cfg.prefetch, WRITE_PARTIALS=bool(g.split), CONST_TIME=const_time,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **features,
    )
    if g.split:
        kernels.merge_kernel[(num_tokens, num_kv_heads)](
            ws_acc, ws_m, ws_l, out, out.stride(0), out.stride(1),
            num_tokens, num_heads, g.n_split_grid,
            GROUP=group, GROUP_PAD=kcfg.next_pow2(group),
            HEAD=head_size, HEAD_PAD=cfg.head_pad, UNROLL=MERGE_UNROLL,
            num_warps=4, **({} if sinks is None else dict(HAS_SINKS=True, sinks_ptr=sinks)),
        )
    return out
