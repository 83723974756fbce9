"""Launch geometry from the public step geometry: step kind, tiling, grid, split mode.

Shared by the Triton launcher and the csrc decode kernel (which runs the Triton
launcher's split geometry so that its bits equal the Triton kernels'), and by
the step planner (`dhp_backend.ops.plan`). Everything here is a function of
public values only: the model shape, the step geometry (``num_tokens``, number
of requests), the bucket L, the cache and block-table sizes and the device's SM
count. Nothing reads a tensor's values on the host (no sync; safe under
CUDA-graph capture).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dhp_backend.ops import workspace as wsp
from dhp_backend.ops import tiles as kcfg

_CPU_SMS = 4  # interpreter: a small "device" so that tests reach the split path


@functools.lru_cache(maxsize=None)
def num_sms_of(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_SMS


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


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
    a_end = round_up(n * head_size, 16)
    m_end = a_end + round_up(n, 16)
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
    chunks by `split_dealing` (the least modelled time over whole waves of
    resident programs, the last split counted by its fill); a dealing of one
    chunk is fold mode's walk, so the plan takes fold mode then.
    """
    token = token_tiling(num_tokens=num_tokens, num_reqs=num_reqs, block_q=cfg.block_q, tiling=tiling)
    num_tiles = num_tokens if token else request_tiles(num_tokens, num_reqs, cfg.block_q)
    n_kv_grid = cdiv(ext_grid, cfg.block_n)
    n_split_grid = max(1, cdiv(n_kv_grid, cfg.tiles_per_split))
    programs = num_tiles * num_kv_heads
    rows = n_split_grid * num_tokens * num_heads
    ws_floats = round_up(rows * head_size, 16) + round_up(rows, 16) + rows
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
        spp, chunks = split_dealing(n_split_grid, programs, slots, ext_grid - (n_split_grid - 1) * cfg.split_kv,
                                    cfg.split_kv)
        # One chunk: every program walks its whole row, as in fold mode, and stores every split's state
        # for the merge besides. Fold mode does the same walk without them (same bits): measured on an
        # H200 (csrc decode, docs/perf-notes.md lever 61) B32 32K 1042 -> 965 us, head 256 B16 32K
        # 1020 -> 966 us. A forced "split" keeps split mode (tests).
        if chunks == 1 and mode is None:
            split = False
    if not split:
        chunks, spp = 1, n_split_grid
    return dict(num_tiles=num_tiles, token_tiles=token, n_split_grid=n_split_grid, split=split, chunks=chunks,
                spp=spp)


# A CTA's own cost (Q load, barrier set-up, the split state's store), in walks of one
# split: measured on an H200 (2026-11-28, `benchmarks.cuda_decode` with `spp1` against
# the plan's dealing, docs/perf-notes.md lever 60): 2.3-2.5 us a CTA against 15.5 us a
# 512-position split at head 256 (one CTA an SM), 0.5-1.2 us against ~17 at head 128.
CTA_COST_IN_SPLITS = 0.1


@functools.lru_cache(maxsize=4096)
def split_dealing(n_split: int, programs: int, slots: int, last_positions: int, split: int) -> tuple[int, int]:
    """Split mode's dealing: (splits per program, chunks), chunk c taking splits c,
    c + chunks, ... (the kernels' order), for ``programs`` (tiles x KV heads) on
    ``slots`` resident CTAs, each row's splits all full except the last, which holds
    ``last_positions`` of ``split`` (the grid's extent past the last split boundary).

    The time of a dealing is modelled as whole waves of CTAs in launch order (chunk
    by chunk), each wave as long as its first CTA's work (chunk work does not grow
    with c) plus `CTA_COST_IN_SPLITS`. The last split's fill matters: an extent just
    past a boundary (a table of 8208 positions: 17 splits, the last with 16) made
    the count of whole splits the dealing's unit, and B1 at head 256 took two
    splits a CTA on 72 of 132 SMs instead of one on all (0.77 -> 1.18x FA3, perf-notes
    lever 60). Ties go to fewer chunks (fewer CTAs). Public values only."""
    last = last_positions / split
    best = None
    for ch in sorted({cdiv(n_split, s) for s in range(1, n_split + 1)}, reverse=True):
        t, k = 0.0, 0
        while k * slots < programs * ch:
            c = (k * slots) // programs  # the wave's first CTA's chunk: the wave's longest
            work = len(range(c, n_split, ch)) - ((1.0 - last) if (n_split - 1 - c) % ch == 0 else 0.0)
            t += work + CTA_COST_IN_SPLITS
            k += 1
        if best is None or t <= best[0] + 1e-9:
            best = (t, ch)
    chunks = best[1]
    return cdiv(n_split, chunks), chunks


# How a launch reads the length bound of each request (the kernels' L_MODE argument).
SCALAR_BUCKET, PER_REQUEST_BUCKETS, TRUE_LENGTHS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TritonGeometry:
    """One Triton launch, decided from public values: the compiled tile config and the grid."""

    cfg: kcfg.KernelConfig
    kind: str            # the tile config's step kind (config.STEP_KINDS), "given" for a forced config
    l_mode: int          # SCALAR_BUCKET, PER_REQUEST_BUCKETS or TRUE_LENGTHS
    l_scalar: int        # the bucket L under SCALAR_BUCKET, else 0
    ext_grid: int        # the extent the splits are laid out for
    num_tiles: int
    token_tiles: bool
    n_split_grid: int
    split: bool          # split states to the workspace, then a merge launch
    chunks: int
    spp: int             # splits per program

    def grid(self, num_kv_heads: int) -> tuple[int, int, int]:
        return (self.num_tiles, num_kv_heads, self.chunks)


def triton_geometry(*, num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                    dtype_name: str, const_time: bool, l_mode: int, l_scalar: int, capacity: int, num_sms: int,
                    mode: str | None = None, split_kv: int | None = None, config: kcfg.KernelConfig | None = None,
                    tiling: str | None = None) -> TritonGeometry:
    """The Triton launch of a step (``num_tokens > 0``, ``num_reqs > 0``).

    ``mode``/``split_kv``/``config``/``tiling`` are the launcher's test and
    benchmark hooks (`triton.launch.paged_attention_triton`); None picks.
    """
    group = num_heads // num_kv_heads
    kind = step_kind(num_tokens, num_reqs)
    cfg = config or kcfg.kernel_config(head_size, group, dtype_name, split_kv=split_kv, kind=kind,
                                       const_time=const_time)
    if config is not None:
        kind = "given"
    # Under per-request buckets or true lengths the host does not know the longest
    # extent without a sync, so split states are laid out for the table capacity;
    # splits past a tile's own extent are neutral (exact no-ops in the merge).
    ext_grid = l_scalar if l_mode == SCALAR_BUCKET else capacity
    if config is None and token_tiling(num_tokens=num_tokens, num_reqs=num_reqs, block_q=cfg.block_q,
                                       tiling=tiling):
        # A decode step (one query token per tile): the decode config's tile
        # (16 rows, same KV step and split size, same bits) runs it, and its
        # residency shapes the grid.
        cfg = kcfg.kernel_config(head_size, group, dtype_name, split_kv=split_kv, kind="decode",
                                 const_time=const_time)
        kind, tiling = "decode", "token"
    p = plan(num_tokens=num_tokens, num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_heads=num_heads,
             head_size=head_size, cfg=cfg, ext_grid=ext_grid, num_sms=num_sms, mode=mode, tiling=tiling)
    return TritonGeometry(cfg=cfg, kind=kind, l_mode=l_mode, l_scalar=l_scalar if l_mode == SCALAR_BUCKET else 0,
                          ext_grid=ext_grid, **p)
