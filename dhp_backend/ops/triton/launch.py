"""Host side of the Triton path: grid, split mode, workspace, and the launches.

Everything decided here is a function of public values only: the model shape,
the step geometry (``num_tokens``, number of requests), the bucket L, the cache
and block-table sizes and the device's SM count. Nothing reads a tensor's values
on the host (no sync; safe under CUDA-graph capture once the workspace exists).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from dhp_backend.config import Policy
from dhp_backend.ops.triton import config as kcfg
from dhp_backend.ops.triton import kernels
from dhp_backend.ops.triton import workspace as wsp

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MERGE_UNROLL = 8
_CPU_SMS = 4  # interpreter: a small "device" so that tests reach the split path


@functools.lru_cache(maxsize=None)
def num_sms_of(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_SMS


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def step_kind(num_tokens: int, num_reqs: int) -> str:
    """"prefill" when the step has many query tokens per request, else "mixed"
    (the plan turns a "mixed" step into "decode" when it picks token tiles). From
    the public step geometry only; the kinds give the same bits (config.STEP_KINDS)."""
    return "prefill" if num_tokens >= kcfg.PREFILL_TOKENS_PER_REQUEST * max(1, num_reqs) else "mixed"


def request_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Tile count of the request tiling (see `plan`): a public bound, one tile per
    block_q tokens plus one per request and the padding pseudo-request's."""
    return num_tokens // block_q + num_reqs + 1


def token_tiling(*, num_tokens: int, num_reqs: int, block_q: int, tiling: str | None = None) -> bool:
    """Whether a step runs token tiles (see `plan`): the smaller tile count wins,
    or ``tiling`` ("token"/"request") forces one."""
    if tiling is None:
        return num_tokens < request_tiles(num_tokens, num_reqs, block_q)
    if tiling in ("token", "request"):
        return tiling == "token"
    raise ValueError(f"tiling: {tiling!r}; accepted: None, 'token', 'request'")


def decode_step(num_tokens: int, num_reqs: int, *, head_size: int, group: int, dtype_name: str) -> bool:
    """Whether the launcher runs a step on token tiles (one query token per tile:
    a decode step), by `token_tiling` with the step kind's tile. Public geometry only."""
    cfg = kcfg.kernel_config(head_size, group, dtype_name, kind=step_kind(num_tokens, num_reqs))
    return token_tiling(num_tokens=num_tokens, num_reqs=num_reqs, block_q=cfg.block_q)


def split_states(ws: torch.Tensor, n_split_grid: int, num_tokens: int, num_heads: int, head_size: int):
    """The split-mode slices of the workspace: (acc, m, l) for n_split_grid x
    num_tokens x num_heads rows, in the layout `kernels.merge_kernel` reads
    (row (s * num_tokens + token) * num_heads + head; acc rows of head_size).
    Slices start on 64-byte boundaries so that pointer-alignment specialisation
    is the same for every batch (one binary)."""
    n = n_split_grid * num_tokens * num_heads
    a_end = _round_up(n * head_size, 16)
    m_end = a_end + _round_up(n, 16)
    return ws[:a_end], ws[a_end:m_end], ws[m_end:m_end + n]


def plan(*, num_tokens: int, num_reqs: int, num_kv_heads: int, num_heads: int, head_size: int,
         cfg: kcfg.KernelConfig, ext_grid: int, num_sms: int, mode: str | None = None,
         tiling: str | None = None) -> dict:
    """Grid, tiling and split mode for one launch, from public values only.

    Tiling: request tiles bound the query tiles of any split of ``num_tokens``
    rows among the requests, ``num_tokens // BLOCK_Q + num_reqs + 1`` (plus the
    padding pseudo-request), whatever the secret query lengths are; token tiles
    (one query token per tile) are ``num_tokens``. The smaller count wins (token
    tiles for decode steps). ``tiling``: None picks; "request"/"token" force one
    (tests). Both give the same bits: a row's arithmetic does not depend on its
    tile-mates.

    ``mode``: None picks by occupancy; "fold" (all splits in one program) or
    "split" (split states written to the workspace, then merged) force one
    (tests). Both give the same bits. In split mode the splits are dealt to
    chunks so that the grid fills whole waves of resident programs (the time is
    waves x splits per program).
    """
    token = token_tiling(num_tokens=num_tokens, num_reqs=num_reqs, block_q=cfg.block_q, tiling=tiling)
    num_tiles = num_tokens if token else request_tiles(num_tokens, num_reqs, cfg.block_q)
    n_kv_grid = _cdiv(ext_grid, cfg.block_n)
    n_split_grid = max(1, _cdiv(n_kv_grid, cfg.tiles_per_split))
    programs = num_tiles * num_kv_heads
    rows = n_split_grid * num_tokens * num_heads
    ws_floats = _round_up(rows * head_size, 16) + _round_up(rows, 16) + rows
    fits = ws_floats <= wsp.SPLIT_FLOATS
    slots = cfg.programs_per_sm * num_sms
    if mode is None:
        split = n_split_grid > 1 and programs < slots and fits
    elif mode == "split":
        if not fits:
            raise ValueError(f"split mode needs {ws_floats} workspace floats > {wsp.SPLIT_FLOATS}")
        split = True
    elif mode == "fold":
        split = False
    else:
        raise ValueError(f"mode: {mode!r}; accepted: None, 'fold', 'split'")
    if split:
        # Fewest (waves x splits per program); ties go to fewer programs.
        best = None
        for spp in range(1, n_split_grid + 1):
            chunks = _cdiv(n_split_grid, spp)
            cost = _cdiv(programs * chunks, slots) * spp
            if best is None or cost <= best[0]:
                best = (cost, spp, chunks)
        _, spp, chunks = best
    else:
        chunks, spp = 1, n_split_grid
    return dict(num_tiles=num_tiles, token_tiles=token, n_split_grid=n_split_grid, split=split, chunks=chunks,
                spp=spp)


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
) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (already validated there).

    ``_mode``/``_split_kv``/``_config``/``_tiling`` are test and benchmark hooks
    (force the split mode; a smaller split size so short sequences cross split
    boundaries under the interpreter; another tile config to compare; force the
    tiling).
    """
    policy = Policy.parse(policy)
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
    dtype_name = _DTYPE_NAMES[query.dtype]
    const_time = policy is not Policy.OFF
    cfg = _config or kcfg.kernel_config(head_size, group, dtype_name, split_kv=_split_kv,
                                        kind=step_kind(num_tokens, num_reqs), const_time=const_time)
    capacity = block_table.shape[1] * block_size

    if policy is Policy.OFF:
        l_mode, l_scalar, bucket_t = 2, 0, seq_lens
    elif isinstance(bucket, torch.Tensor):
        l_mode, l_scalar, bucket_t = 1, 0, bucket
    else:
        if bucket is None:
            raise ValueError(f"policy {policy.value!r} needs a bucket")
        l_mode, l_scalar, bucket_t = 0, int(bucket), seq_lens
    # Under per-request buckets or true lengths the host does not know the longest
    # extent without a sync, so split states are laid out for the table capacity;
    # splits past a tile's own extent are neutral (exact no-ops in the merge).
    ext_grid = l_scalar if l_mode == 0 else capacity

    device = query.device
    if _config is None and token_tiling(num_tokens=num_tokens, num_reqs=num_reqs, block_q=cfg.block_q,
                                        tiling=_tiling):
        # A decode step (one query token per tile): the decode config's tile
        # (16 rows, same KV step and split size, same bits) runs it, and its
        # residency shapes the grid.
        cfg = kcfg.kernel_config(head_size, group, dtype_name, split_kv=_split_kv, kind="decode",
                                 const_time=const_time)
        _tiling = "token"
    p = plan(num_tokens=num_tokens, num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_heads=num_heads,
             head_size=head_size, cfg=cfg, ext_grid=ext_grid, num_sms=num_sms_of(device), mode=_mode,
             tiling=_tiling)

    ws, sink, zero = wsp.reserve_workspace(device)
    if p["split"]:
        ws_acc, ws_m, ws_l = split_states(ws, p["n_split_grid"], num_tokens, num_heads, head_size)
    else:
        ws_acc = ws_m = ws_l = ws  # never dereferenced: WRITE_PARTIALS is false

    grid = (p["num_tiles"], num_kv_heads, p["chunks"])
    kernels.attention_kernel[grid](
        query, query.stride(0), query.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out, out.stride(0), out.stride(1),
        block_table, block_table.stride(0), query_start_loc, seq_lens, bucket_t,
        ws_acc, ws_m, ws_l, sink, sink.view(out.dtype), zero.view(value_cache.dtype),
        float(scale) * math.log2(math.e),
        num_reqs, num_tokens, q_rows, num_heads,
        l_scalar, l_mode, 0, _cdiv(num_reqs, kcfg.SEARCH_BLOCK),
        p["n_split_grid"], p["chunks"] if p["split"] else p["spp"], 1 if p["token_tiles"] else 0,
        block_table.shape[1],
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.tiles_per_split, BLOCK_SIZE=block_size,
        HEAD=head_size, HEAD_PAD=cfg.head_pad, CAUSAL=bool(causal),
        FP32=cfg.fp32, UPCAST_DOT=_interpreting() and query.dtype == torch.bfloat16,
        SEARCH_BLOCK=kcfg.SEARCH_BLOCK,
        SINK_SLOTS=wsp.SINK_SLOTS, SINK_ROWS=wsp.SINK_ROWS, SINK_WIDTH=wsp.SINK_WIDTH,
        PREFETCH=cfg.prefetch, WRITE_PARTIALS=bool(p["split"]), CONST_TIME=const_time,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if p["split"]:
        kernels.merge_kernel[(num_tokens, num_kv_heads)](
            ws_acc, ws_m, ws_l, out, out.stride(0), out.stride(1),
            num_tokens, num_heads, p["n_split_grid"],
            GROUP=group, GROUP_PAD=kcfg.next_pow2(group),
            HEAD=head_size, HEAD_PAD=cfg.head_pad, UNROLL=MERGE_UNROLL,
            num_warps=4,
        )
    return out
