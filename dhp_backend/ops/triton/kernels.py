"""The constant-time Triton kernels: paged attention over a packed step, and the split merge.

Read docs/kernels.md for the design and the constant-time argument; the comments
here say why each line is the way it is.

Two kernels:

- `attention_kernel`: one program per (query tile, KV head, split chunk). A query
  tile holds BLOCK_Q tokens x GROUP query heads of one request (the heads that
  share the KV head), so K/V are read once per tile. The program walks the KV
  positions of its splits in BLOCK_N steps, each split with a fresh online-softmax
  state. With ``WRITE_PARTIALS`` false it folds each split into a running state
  with `fold` and writes the normalised output; with ``WRITE_PARTIALS`` true it
  stores each split's state to the workspace instead.
- `merge_kernel`: folds the stored split states of one (token, head) row left to
  right with the same `fold`, then normalises with the same `finalize`.

Both modes apply the identical sequence of operations to every row, so the output
bits do not depend on which mode the host picked (that choice follows the batch).

Three model features, each a constexpr (a plain layer's binaries are the code
they were; a layer with a feature gets binaries of its own): ``SOFTCAP`` (the
logits soft-cap, `soft_cap`), ``HAS_SINKS`` (attention sinks, `fold_sink`) and
``WINDOW`` (a sliding window: row at position q sees q - WINDOW < p <= q).
Under the constant-time policies all are public model parameters: the cap and
the window are compile-time constants and the sinks are read at addresses that
depend on the head only, once per row; none adds a branch, a trip count or an
address that follows the true lengths or the data. The window's *position*
follows the true length, so under those policies it is a selection only and the
walk stays the whole bucket; under policy ``off`` the walk starts at the window.
Under the constant-time policies the steps past the true length (dead) and, per row,
the steps wholly below the window run unmasked on what the reserved pages hold; the
state they evolve is dropped by selection (the split keeps its last live step's; a
row's below-window state is put back to the neutral one with a finite filler), so
their operands are a live step's and the bits are the masked walk's.

Constant time: every loop bound below is derived from the public bucket L (or,
under policy ``off``, the true length), the public step geometry, or constexprs.
Masking of scores and values is by selection (`tl.where`, `keep_if`), never by branches or
multiplication (the integer bounds of a dead or below-window step are moved by max /
multiply: `kv_step` and the split loop).
Addresses follow the address rule (design.md section 2, `position_blocks`): a
request reads its own reserved block-table line up to its bucket, in walk order,
whatever its true length is.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Lowest finite fp32: the running max starts here (finite, so that a row whose
# scores are all -inf gives exp2(-inf - M_INIT) = 0 and never inf - inf).
M_INIT = tl.constexpr(-3.4028234663852886e38)
LOG2E = tl.constexpr(1.4426950408889634)  # the kernels' scores are in log2 units (exp2)
TWO_LOG2E = tl.constexpr(2.8853900817779268)


@triton.jit
def soft_cap(x, SOFTCAP: tl.constexpr):
    """The soft-capped score in log2 units, ``SOFTCAP * tanh(x) * log2(e)``, of
    ``x = scale * q.k / SOFTCAP`` (the host folds 1 / SOFTCAP into the scale).

    tanh(x) = 1 - 2 / (e^{2x} + 1), vLLM's form: it saturates to +-1 for large
    |x| (e^{2x} = inf gives 1, 0 gives -1) where (e^x - e^-x) / (e^x + e^-x)
    would give inf / inf. Elementwise and branch-free: the same instructions for
    every score, whatever its value. ``/`` on fp32 is div.full.f32 (approximate,
    no IEEE slow path), as in `finalize`.
    """
    t = 1.0 - 2.0 / (tl.exp2(x * TWO_LOG2E) + 1.0)
    return t * (SOFTCAP * LOG2E)


@triton.jit
def fold_sink(m, l, acc, sinks_ptr, head, mask):
    """Fold the attention sink of each row's head into its final state: one more
    logit, ``sinks[head]`` (natural units, any float dtype, as vLLM's), with
    weight ``e^{sink}`` in the denominator and no value row (acc_b = 0).

    Applied once per row after the last split, by `attention_kernel` in fold mode
    and by `merge_kernel` in split mode with this one function, so both modes
    give the same bits. A sink of -inf is an exact no-op (beta = 0). The address
    depends on the head only (public); ``mask`` only marks the merge kernel's
    constexpr head padding (those lanes get a neutral -inf sink).
    """
    m_s = tl.load(sinks_ptr + head, mask=mask, other=float("-inf")).to(tl.float32) * LOG2E
    return fold(m, l, acc, m_s, tl.full(m_s.shape, 1.0, tl.float32), tl.zeros_like(acc))


@triton.jit
def fold(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Combine two online-softmax states (a first, then b). m, l: [M]; acc: [M, D].

    Shared by the in-program split loop and the merge kernel so both compute the
    same bits. Explicit fma so that no compiler contraction choice can differ
    between the two kernels. Exact no-op for a neutral b (m_b = M_INIT, l_b = 0,
    acc_b = 0): m = m_a, alpha = 1 exactly (selected, not trusted to ex2(0)),
    beta = ex2(M_INIT - m_a) = 0 or 1 with l_b = acc_b = 0.
    """
    m = tl.maximum(m_a, m_b)
    alpha = tl.where(m_a == m, 1.0, tl.exp2(m_a - m))
    beta = tl.where(m_b == m, 1.0, tl.exp2(m_b - m))
    l = tl.fma(l_a, alpha, l_b * beta)
    alpha2 = tl.broadcast_to(alpha[:, None], acc_a.shape)
    beta2 = tl.broadcast_to(beta[:, None], acc_b.shape)
    acc = tl.fma(acc_a, alpha2, acc_b * beta2)
    return m, l, acc


@triton.jit
def finalize(acc, l):
    """acc / l with an approximate reciprocal (no IEEE division slow path).

    Rows that saw no position (l == 0: padding rows, fully masked rows) give
    exactly 0, by selecting the divisor rather than branching.
    """
    inv = 1.0 / tl.where(l > 0.0, l, 1.0)
    return acc * tl.broadcast_to(inv[:, None], acc.shape)


@triton.jit
def filler_of(x, CAP: tl.constexpr):
    """|x| where it is at most CAP, else 0 (inf and NaN included): finite and non-negative, what a
    constant-time kernel stores or carries where the masked form left zeros, so that a product
    by +0 gives +0 exactly (the csrc kernels' `ct::filler_of`, docs/kernels.md section 2)."""
    f = tl.abs(x)
    return tl.where(f <= CAP, f, 0.0)


@triton.jit
def keep_if(c, a, b, INTERPRET: tl.constexpr):
    """``c ? a : b`` for fp32 tensors a, b of one shape and a condition c that follows a secret
    (a scalar, or per row: ``c[:, None]``), as one LOP3 per element ((a & m) | (b & ~m), m = -c)
    in inline PTX: opaque to LLVM and ptxas, so it cannot become moves guarded by c (an instruction
    issued or not by a secret; the csrc kernels' `ct::select_f32`, docs/kernels.md section 2).
    ``INTERPRET`` (a constexpr, the CPU interpreter, which runs no PTX): `tl.where`, the same bits."""
    if INTERPRET:
        return tl.where(c, a, b)
    m = tl.zeros(a.shape, tl.int32) - c.to(tl.int32)
    r = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r",
                                  [a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True), m],
                                  dtype=tl.int32, is_pure=True, pack=1)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def halve(x, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """[BLOCK_M, WIDTH] -> [BLOCK_M, WIDTH // 2]: column pairs (2i, 2i + 1) added."""
    a, b = tl.split(tl.reshape(x, [BLOCK_M, WIDTH // 2, 2]))
    return a + b


@triton.jit
def row_sum(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of each row of p [BLOCK_M, BLOCK_N] in one fixed association, whatever the layout.

    A plain `tl.sum` adds a thread's own elements first, then across lanes, then
    across warps, so its association follows the MMA layout: a 64-row wgmma tile
    keeps a row in one warp, a 16-row mma.sync tile on 4 warps spreads it over the
    warps. Here each 8-column group is summed first (in every MMA layout those are
    two columns per thread on the same 4 lanes, so the same adds), then the
    groups are added pairwise in an explicit tree (`tl.split`, data movement only).
    So every tile config gives the same bits for l (tests/test_triton_gpu.py).
    """
    x = tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N // 8, 8]), axis=2)
    # Constexpr shape facts (BLOCK_N): resolved at compile time, no branch; the
    # same adds for every row and every tile, whatever the data.
    if BLOCK_N >= 128:
        x = halve(x, BLOCK_M, 16)
    if BLOCK_N >= 64:
        x = halve(x, BLOCK_M, 8)
    if BLOCK_N >= 32:
        x = halve(x, BLOCK_M, 4)
    a, b = tl.split(x)
    return a + b


@triton.jit
def store_rows(ptrs, x, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Store a [rows, HEAD_PAD] tile; only the constexpr head padding is masked."""
    if HEAD == HEAD_PAD:
        tl.store(ptrs, x)
    else:
        offs_d = tl.arange(0, HEAD_PAD)
        tl.store(ptrs, x, mask=tl.broadcast_to((offs_d < HEAD)[None, :], x.shape))


@triton.jit
def locate(tile, qsl_ptr, num_reqs, num_tokens, search_trips, token_tiles,
           BLOCK_Q: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Map a query-tile index to (request, first query row) with a fixed-work search.

    Two tilings, chosen on the host from the public step geometry (launch.plan):
    - request tiles (``token_tiles == 0``): request r owns tile indices
      [key(r), key(r+1)) with key(r) = qsl[r] // BLOCK_Q + r, which covers its
      ceil(q_len / BLOCK_Q) q-blocks of BLOCK_Q rows plus at most one surplus tile;
    - token tiles (``token_tiles == 1``): tile t holds query token t alone
      (key(r) = qsl[r]); fewer tiles when most requests have one query token
      (a decode step: num_tokens tiles instead of num_tokens // BLOCK_Q + R + 1).
    Index num_reqs is the pseudo-request of padding rows [qsl[R], num_tokens).
    The search counts keys <= tile over all R requests in vector chunks: its trip
    count is ceil(R / SEARCH_BLOCK) whatever the query lengths are; the tiling
    flag only selects values.

    Returns (r, is_pad, q_start, q_end, qi0, rows_q): the tile's rows are query
    indices qi0 + [0, rows_q) of request r (rows_q = BLOCK_Q or 1).
    """
    cnt = 0
    for c in range(0, search_trips):
        idx = c * SEARCH_BLOCK + tl.arange(0, SEARCH_BLOCK) + 1
        ok = idx <= num_reqs
        qs = tl.load(qsl_ptr + idx, mask=ok, other=0)
        key = tl.where(token_tiles != 0, qs, qs // BLOCK_Q + idx)
        cnt += tl.sum(tl.where(ok & (key <= tile), 1, 0), axis=0)
    r = cnt
    is_pad = r >= num_reqs
    q_start = tl.load(qsl_ptr + r)
    q_next = tl.load(qsl_ptr + tl.minimum(r + 1, num_reqs))
    q_end = tl.where(is_pad, num_tokens, q_next)
    qi0 = tl.where(token_tiles != 0, tile - q_start, (tile - (q_start // BLOCK_Q + r)) * BLOCK_Q)
    rows_q = tl.where(token_tiles != 0, 1, BLOCK_Q)
    return r, is_pad, q_start, q_end, qi0, rows_q


@triton.jit
def position_blocks(pos, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                    BLOCK_SIZE: tl.constexpr, CONST_TIME: tl.constexpr):
    """Physical block of each KV position in ``pos`` (any shape).

    Constant-time policies (the address rule, design.md section 2): request
    ``r_row``'s logical block lb is read from ``block_table[r_row, min(lb,
    n_pages - 1)]``, ``n_pages = ceil(L / BLOCK_SIZE)`` of its public bucket L,
    for every position, real or padding. The caller reserved those pages for the
    request (distinct, valid: `ops.paged_attention` checks it), so padding reads
    memory the request owns and a short and a long request of one bucket read the
    very same table line and the very same pages, in the same order. The clamp is
    a function of the bucket only (the tile's rounding past the last reserved page
    re-reads that page). Nothing here depends on ``seq_len``: the scores and V rows
    of padding positions are removed by selection in `kv_step`.

    Policy off (not constant-time): positions past the true length read block 0
    (in range; its scores are selected away and V is not read there, see
    `kv_step`), table columns past the table's width are not read.
    """
    lb = pos // BLOCK_SIZE
    # CONST_TIME is a constexpr: one binary per policy class, no branch.
    if CONST_TIME:
        col = tl.minimum(lb, n_pages - 1)
        return tl.load(bt_ptr + r_row.to(tl.int64) * bt_stride + col).to(tl.int64)
    else:
        entry = tl.load(bt_ptr + r_row.to(tl.int64) * bt_stride + lb, mask=lb < max_blocks, other=0)
        return tl.where(pos < seq_len, entry, 0).to(tl.int64)


@triton.jit
def tile_blocks(j, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONST_TIME: tl.constexpr):
    """`position_blocks` for the BLOCK_N positions of KV step j."""
    pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
    return position_blocks(pos, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks, BLOCK_SIZE, CONST_TIME)


@triton.jit
def split_blocks(s, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                 TILES_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 CONST_TIME: tl.constexpr):
    """`position_blocks` for all steps of split s at once: [TILES_PER_SPLIT, BLOCK_N]."""
    pos = (s * TILES_PER_SPLIT + tl.arange(0, TILES_PER_SPLIT))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return position_blocks(pos, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks, BLOCK_SIZE, CONST_TIME)


@triton.jit
def kv_step(q, m_i, l_i, acc, j, bid, kvh, seq_len, limit,
            k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s, qk_scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, FP32: tl.constexpr, UPCAST_DOT: tl.constexpr,
            CONST_TIME: tl.constexpr, zero_ptr, SOFTCAP: tl.constexpr,
            lo, lo_tile, WINDOW: tl.constexpr, dead):
    """One BLOCK_N step of online softmax at absolute KV positions j*BLOCK_N + [0, BLOCK_N),
    reading K/V from blocks ``bid`` (see `tile_blocks`).

    Always the same loads and arithmetic; what must not count is removed by
    selection: scores -> -inf, V rows past seq_len -> 0, so stale NaN/inf in
    reused or reserved-but-unwritten pages never reaches the output through 0 * NaN.

    ``CONST_TIME`` (the constant-time policies): V is read from the block for every
    position and the rows past seq_len are selected to 0. That select costs a
    shared-memory round trip of the V tile (Triton reads the cp.async tile into
    registers, selects, writes it back for the wgmma): 14-23 % of a decode step
    on an H200. Policy off (not constant-time by contract) instead points the V
    rows past seq_len at a row of zeros (``zero_ptr``, never written), so the tile
    arrives already clean and goes to the wgmma untouched. Same bits: those rows
    are 0 either way.

    ``WINDOW`` (a constexpr, 0 = none): row i also needs ``pos >= lo[i]`` (its
    window's lower bound). V rows below ``lo_tile`` (the lowest ``lo`` of the
    tile's rows) are seen by no row: they are cleaned like those past seq_len, so
    pages that fell out of the window (vLLM's null block under ``off``) never
    reach the output through 0 * NaN, and every policy multiplies the same zeros.

    ``dead`` (``CONST_TIME`` only: a scalar, the step lies wholly at or past the
    request's true length): the step runs on what the reserved pages hold, scores
    unmasked and V rows kept, so that its operands are a live step's; the state it
    evolves is never used (the split loop keeps the state of its last live step by
    selection). Masked to zeros, a short request's dead steps fed the tensor cores
    zeros where a long request's fed data, and the step's time followed the true
    length through the card's power management (G4, H200, 2026-11-28, prefill B4
    q64 L 4096, short vs long +0.070 %, t -44; the csrc kernels' remedy since 73d2f15,
    docs/kernels.md section 2).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    pos = j * BLOCK_N + offs_n
    if CONST_TIME:
        # A dead step's bounds moved out of the way by arithmetic (max, multiply), not by
        # `attend | dead`: ptxas made that a guarded FSEL (`@!P FSEL`) on the dead predicate,
        # an instruction issued or not by a secret, which G2 fails (audit/guarded.py).
        d_big = dead.to(tl.int32) * 2147483647
        seq_len = tl.maximum(seq_len, d_big)
        limit = tl.maximum(limit, d_big)
        if WINDOW > 0:
            lo = lo - dead.to(tl.int32) * 1073741824
            lo_tile = lo_tile - dead.to(tl.int32) * 1073741824
    real = pos < seq_len
    if WINDOW > 0:
        real = real & (pos >= lo_tile)
    slot = (pos % BLOCK_SIZE).to(tl.int64)

    k_ptrs = k_ptr + bid[None, :] * sk_b + kvh * sk_h + slot[None, :] * sk_s + offs_d[:, None]
    v_ptrs = v_ptr + bid[:, None] * sv_b + kvh * sv_h + slot[:, None] * sv_s + offs_d[None, :]
    # Constexpr (one binary per policy class, no branch). Policy off only: V
    # addresses then follow the true length, as its trip counts already do.
    if not CONST_TIME:
        v_ptrs = tl.where(real[:, None], v_ptrs, zero_ptr + offs_d[None, :])
    if HEAD == HEAD_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        # The head-dim mask is a constexpr shape fact, the same for every tile.
        k = tl.load(k_ptrs, mask=(offs_d < HEAD)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(offs_d < HEAD)[None, :], other=0.0)

    if FP32:
        qk = tl.dot(q, k, input_precision="ieee")
    elif UPCAST_DOT:
        # Interpreter only: its dot cannot multiply bf16. bf16 products are exact
        # in fp32 and accumulate in fp32 on the GPU too, so this models the MMA.
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32))
    else:
        qk = tl.dot(q, k)
    # SOFTCAP: a constexpr (the model's public cap; 0 = none), one binary per cap.
    # The cap applies to every score before the mask, as in vLLM: positions are
    # removed after it by the same selection.
    # (The mask is built first, as it always was: the plain binaries' PTX keeps its order.)
    attend = pos[None, :] < limit[:, None]
    if WINDOW > 0:
        # The window's lower bound, selected like the causal limit (lo follows the
        # true length: a selection, never a bound of the walk under CONST_TIME).
        attend = attend & (pos[None, :] >= lo[:, None])
    if SOFTCAP > 0:
        sc = soft_cap(qk * qk_scale, SOFTCAP)
    else:
        sc = qk * qk_scale
    s = tl.where(attend, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Selected, not trusted: alpha is exactly 1 when the max did not move, so a
    # fully masked step is an exact no-op and policies give identical bits.
    alpha = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_new))
    p = tl.exp2(s - m_new[:, None])
    l_new = tl.fma(l_i, alpha, row_sum(p, BLOCK_M, BLOCK_N))
    if CONST_TIME:
        v = tl.where(real[:, None], v, tl.zeros_like(v))
    acc = acc * tl.broadcast_to(alpha[:, None], acc.shape)
    if FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    elif UPCAST_DOT:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_new, acc


@triton.jit(do_not_specialize=[
    "num_reqs", "num_tokens", "q_rows", "l_scalar", "l_mode", "pad_l", "search_trips",
    "n_split_grid", "chunk_stride", "token_tiles", "max_blocks", "bt_stride",
])
def attention_kernel(
    q_ptr, sq_t, sq_h,
    k_ptr, sk_b, sk_h, sk_s,
    v_ptr, sv_b, sv_h, sv_s,
    out_ptr, so_t, so_h,
    bt_ptr, bt_stride, qsl_ptr, seq_ptr, bucket_ptr,
    ws_acc_ptr, ws_m_ptr, ws_l_ptr, sink_ptr, sink_out_ptr, zero_ptr,
    qk_scale,
    num_reqs, num_tokens, q_rows, num_heads,
    l_scalar, l_mode, pad_l, search_trips,
    n_split_grid, chunk_stride, token_tiles,
    max_blocks,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    FP32: tl.constexpr, UPCAST_DOT: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    SINK_SLOTS: tl.constexpr, SINK_ROWS: tl.constexpr, SINK_WIDTH: tl.constexpr,
    PREFETCH: tl.constexpr, WRITE_PARTIALS: tl.constexpr, CONST_TIME: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, HAS_SINKS: tl.constexpr = False, attn_sinks_ptr=None,
    WINDOW: tl.constexpr = 0, INTERPRET: tl.constexpr = False,
):
    """See the module docstring. Runtime ints that follow the batch are not
    specialised, so every batch runs one and the same binary.

    ``qk_scale``: ``scale * log2(e)``; with ``SOFTCAP > 0``, ``scale / SOFTCAP``
    (`soft_cap` turns the capped score into log2 units). ``attn_sinks_ptr``: the
    per-head sinks when ``HAS_SINKS`` (None otherwise: not a parameter of the
    plain binaries). Not to be confused with ``sink_ptr``, the scratch rows that
    absorb the stores of rows outside the request. ``WINDOW``: the sliding
    window W (0 = none; causal only).

    l_mode: 0 = one public bucket ``l_scalar`` for every request (strict, batch,
    request with an int); 1 = per-request public buckets in ``bucket_ptr``
    (request); 2 = true lengths (off, with the causal trim; not constant-time).
    """
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)

    r, is_pad, q_start, q_end, qi0, rows_q = locate(tile, qsl_ptr, num_reqs, num_tokens, search_trips,
                                                    token_tiles, BLOCK_Q, SEARCH_BLOCK)
    # The padding pseudo-request has no block-table row of its own: it uses the
    # last real row (the host guarantees num_reqs >= 1) for its page walk only.
    r_row = tl.minimum(r, num_reqs - 1)
    row_len = tl.load(seq_ptr + r_row)
    seq_len = tl.where(is_pad, 0, row_len)
    # Which pages the walk reads: the padding pseudo-request reads the pages of
    # the last request (re-reads of pages another tile reads in the same step),
    # never pages of its own; its output is masked by seq_len = 0.
    q_len = q_end - q_start

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    row_tok = offs_m // GROUP
    qi = qi0 + row_tok
    head = kvh * GROUP + offs_m % GROUP
    row_valid = (row_tok < rows_q) & (qi < q_len)
    tok = q_start + qi
    # Q rows are loaded for every row of the tile, valid or not, at an in-range
    # address (mod the public row count): the load count never follows q_len.
    tok_ld = (tok % q_rows).to(tl.int64)
    q_ptrs = q_ptr + tok_ld[:, None] * sq_t + head[:, None].to(tl.int64) * sq_h + offs_d[None, :]
    if HEAD == HEAD_PAD:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(offs_d < HEAD)[None, :], other=0.0)

    # Attendable positions of each row: p < limit (0 for rows outside the request).
    if CAUSAL:
        limit = seq_len - q_len + qi + 1
    else:
        limit = tl.zeros_like(qi) + seq_len
    limit = tl.where(row_valid, limit, 0)
    lo = limit
    lo_tile = limit
    first_tile = 0
    if WINDOW > 0:
        tl.static_assert(CAUSAL, "a sliding window is defined for causal attention only")
        # Row at position q = limit - 1 sees q - WINDOW < p: p >= limit - WINDOW
        # (rows outside the request have limit 0 and see nothing either way).
        lo = limit - WINDOW
        # The lowest bound of the tile's real rows (its first row, qi0): no row
        # of the tile sees a position below it.
        lo_tile = seq_len - q_len + qi0 + 1 - WINDOW
        if not CONST_TIME:
            # Policy off (true lengths): the walk starts at the first KV step that
            # holds a visible position. The steps and splits skipped are exact no-ops
            # of the full walk (every score -inf: m stays, alpha and beta are selected
            # 1, p = 0, V rows cleaned), so both walks give the same bits. Gated on
            # l_mode too, so the binary under a public bucket keeps the full walk.
            first_tile = tl.where(l_mode == 2, tl.maximum(lo_tile, 0) // BLOCK_N, 0)

    # The KV extent this tile walks: public under strict/batch/request.
    bkt = tl.load(bucket_ptr + r_row)
    if CAUSAL:
        trimmed = tl.minimum(seq_len, seq_len - q_len + qi0 + rows_q)
    else:
        trimmed = seq_len
    trimmed = tl.where(qi0 < q_len, trimmed, 0)
    ext = tl.where(l_mode == 0, l_scalar,
                   tl.where(l_mode == 1, tl.where(is_pad, pad_l, bkt), trimmed))
    n_kv = (ext + BLOCK_N - 1) // BLOCK_N
    # Pages of r_row's bucket (the address rule; `position_blocks`): a function of
    # the public bucket only. Policy off does not use it.
    page_ext = tl.where(l_mode == 0, l_scalar, bkt)
    n_pages = tl.maximum((page_ext + BLOCK_SIZE - 1) // BLOCK_SIZE, 1)
    n_split = (n_kv + TILES_PER_SPLIT - 1) // TILES_PER_SPLIT

    # Split mode deals the splits to the chunks round robin (chunk c: c, c + chunks,
    # ...; chunk_stride = chunks): a walk shorter than the grid's n_split_grid (a
    # per-request bucket, policy off's true lengths, in a max_model_len-wide table)
    # gets as many programs as it has splits. Every split's state depends only on
    # its own positions, so the assignment never shows in the bits.
    if WRITE_PARTIALS:
        s_lo = chunk
        s_hi = n_split_grid
        s_step = chunk_stride
    else:
        # chunk = 0 and chunk_stride = n_split_grid here: a runtime 0, the expression
        # of the contiguous schedule, so that the fold binaries stay the code they
        # were (byte-identical SASS offline). With a literal 0 they compiled to
        # other code, and vLLM strict-BI, which runs them, measured 5 % slower on
        # the H200 in two runs (16c24d2).
        s_lo = chunk * chunk_stride
        s_hi = n_split
        s_step = 1
        if WINDOW > 0:
            if not CONST_TIME:
                # The first split holding the window (the splits before it fold as
                # neutral states: exact no-ops, `fold`).
                s_lo = s_lo + first_tile // TILES_PER_SPLIT

    m_run = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if WRITE_PARTIALS:
        if CONST_TIME:
            # What an idle row of a split stores instead of a zero accumulator (the split loop
            # below): |q|, finite. The same for every split of the program, so made once.
            q_filler = filler_of(q.to(tl.float32), 3.4028234663852886e38)
    row_out = tok.to(tl.int64) * num_heads + head
    # Rows outside the request are not masked off at the stores: they are sent to
    # a scratch "sink" instead, so every tile executes the same stores with all
    # lanes active (store instructions, requests and sectors do not follow q_len).
    sink_row = ((tile % SINK_SLOTS) * BLOCK_M + offs_m).to(tl.int64)
    sink_acc = sink_ptr + sink_row[:, None] * SINK_WIDTH + offs_d[None, :]
    sink_ml = sink_ptr + SINK_ROWS * SINK_WIDTH + sink_row
    split_stride = num_tokens.to(tl.int64) * num_heads
    # PREFETCH: the block ids of a whole split are read one split ahead (carried
    # by the outer loop), so the inner loop's K/V loads depend on no load of the
    # same loop and the software pipeliner can issue them early; the table read
    # is never waited on per step. The one look-ahead past the last split is a
    # fixed, public surplus read.
    rows_t = tl.arange(0, TILES_PER_SPLIT)
    if PREFETCH:
        ids_next = split_blocks(s_lo, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                                TILES_PER_SPLIT, BLOCK_N, BLOCK_SIZE, CONST_TIME)
    # Public trip count: s_lo, s_lo + s_step, ... below s_hi from the program id and
    # the host plan (split mode) or [0, ceil(ceil(L / BLOCK_N) / TILES_PER_SPLIT)) from
    # L = l_scalar (fold mode); audit rule "split-loop".
    for s in range(s_lo, s_hi, s_step):
        # Every split starts from a fresh state, so its partial result is the same
        # whether it is folded here or stored and folded by merge_kernel.
        m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        j_lo = s * TILES_PER_SPLIT
        j_hi = tl.minimum(j_lo + TILES_PER_SPLIT, n_kv)
        j_split = j_lo
        if PREFETCH:
            ids = ids_next
            ids_next = split_blocks(s + s_step, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                                    TILES_PER_SPLIT, BLOCK_N, BLOCK_SIZE, CONST_TIME)
        if WINDOW > 0:
            if not CONST_TIME:
                # Policy off: this split's steps from the window on. A split wholly
                # below the window runs none and stores (split mode) the neutral
                # state its masked steps would have left: the same bits.
                j_lo = tl.maximum(j_lo, first_tile)
        if CONST_TIME:
            # The split's state at its last live step (a step holding a position below the
            # true length): dead steps (a suffix of the walk) run unmasked (`kv_step`) and
            # their state is dropped here by selection. In the masked form they were exact
            # no-ops, so this is the state the split ended with before: the same bits.
            m_c = m_i
            l_c = l_i
            acc_c = acc
        # Public trip count: this split's KV steps below ceil(L / BLOCK_N); audit rule "kv-loop".
        for j in range(j_lo, j_hi):
            if PREFETCH:
                # Row j - j_lo of the split's ids, by selection (exact for integers).
                bid = tl.sum(tl.where((rows_t == j - j_split)[:, None], ids, 0), axis=0)
            else:
                bid = tile_blocks(j, r_row, n_pages, seq_len, bt_ptr, bt_stride, max_blocks,
                                  BLOCK_N, BLOCK_SIZE, CONST_TIME)
            lo_j = lo
            lo_tile_j = lo_tile
            if CONST_TIME:
                if WINDOW > 0:
                    # A step wholly below a row's window runs unmasked for that row (its lower
                    # bound moved out of the way by arithmetic, as a dead step's), and V is kept
                    # where the step lies below every row's window; the row's state evolves on
                    # what the pages hold and is put back to the neutral one after the row's
                    # last such step (below). Masked, the walk's prefix fed zeros where a short
                    # request's dead suffix fed data (the csrc kernels' G4 leak, docs/kernels.md
                    # section 7, "the below-window steps"). A row's below step is never dead (the
                    # window ends at the true length): one offset of 2^30 at most. (A tile wholly
                    # outside its request may see both on lo_tile, which is then >= 0: no overflow.)
                    below = (j + 1) * BLOCK_N <= lo
                    lo_j = lo - below.to(tl.int32) * 1073741824
                    lo_tile_j = lo_tile - ((j + 1) * BLOCK_N <= lo_tile).to(tl.int32) * 1073741824
            m_i, l_i, acc = kv_step(q, m_i, l_i, acc, j, bid, kvh, seq_len, limit,
                                    k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s, qk_scale,
                                    BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD, HEAD_PAD, FP32, UPCAST_DOT, CONST_TIME,
                                    zero_ptr, SOFTCAP, lo_j, lo_tile_j, WINDOW, j * BLOCK_N >= seq_len)
            if CONST_TIME:
                if WINDOW > 0:
                    # After a row's last step below its window, or at the split's end inside that
                    # run, its state goes back to the neutral one (m = M_INIT, l = 0) with a
                    # filler where the masked form left zeros: |acc| capped at 1e30 (0 beyond and
                    # for NaN). The row's next step with a position multiplies it by alpha =
                    # exp2(M_INIT - m) = +0 (finite, non-negative: +0 exactly). A split that ends in
                    # the run is idle for the row: split mode stores |q| for it (below), fold mode
                    # folds the filler with coefficient 1 into a run still at M_INIT, which the first
                    # live split's alpha = +0 wipes. So the masked form's bits.
                    # The selections by `keep_if` (a per-row condition that follows the true
                    # length): as `tl.where`, ptxas made the filler's select a move guarded by
                    # it (`@P FSEL`), which G2 fails.
                    reset = below & (((j + 2) * BLOCK_N > lo) | (j + 1 == j_hi))
                    m_i = keep_if(reset, tl.full([BLOCK_M], M_INIT, tl.float32), m_i, INTERPRET)
                    l_i = keep_if(reset, tl.zeros([BLOCK_M], tl.float32), l_i, INTERPRET)
                    acc = keep_if(reset[:, None], filler_of(acc, 1.0e30), acc, INTERPRET)
                live = j * BLOCK_N < seq_len  # follows the true length: selections only
                m_c = keep_if(live, m_i, m_c, INTERPRET)
                l_c = keep_if(live, l_i, l_c, INTERPRET)
                acc_c = keep_if(live, acc, acc_c, INTERPRET)
        if CONST_TIME:
            m_i = m_c
            l_i = l_c
            acc = acc_c
        # WRITE_PARTIALS: the host's split-mode choice from public geometry, a
        # constexpr so that the fold-mode running state costs no registers here.
        if WRITE_PARTIALS:
            base = split_stride * s
            if CONST_TIME:
                # A row that attends no position of this split (it lies past the row's end,
                # or below its window) stores the neutral m = M_INIT and l = 0 with |q| in
                # place of its zero accumulator: `fold` multiplies it by beta = 0 when a
                # live split has moved the max (a row with positions always has one), or
                # a live split's alpha = 0 wipes it when it came first (a window's dead
                # prefix); non-negative and finite, so every product is +0 as with zeros:
                # the same bits. Zeros written and read back for one length class only
                # made the csrc CT decode's short request faster than a long one (G4,
                # H200, +0.017 %, t -9; docs/kernels.md section 2). Rows outside the
                # request store to the sink (never merged; their count in a tile follows
                # q_len), so they get the filler too; a stored row with limit 0 (the padding
                # pseudo-request's) has no live split to absorb it and keeps zeros.
                idle = limit <= j_split * BLOCK_N
                if WINDOW > 0:
                    idle = idle | (lo >= j_hi * BLOCK_N)
                acc = tl.where((idle & ((limit > 0) | ~row_valid))[:, None], q_filler, acc)
            a_ptrs = tl.where(row_valid[:, None], ws_acc_ptr + (base + row_out)[:, None] * HEAD + offs_d[None, :],
                              sink_acc)
            store_rows(a_ptrs, acc, HEAD, HEAD_PAD)
            tl.store(tl.where(row_valid, ws_m_ptr + base + row_out, sink_ml), m_i)
            tl.store(tl.where(row_valid, ws_l_ptr + base + row_out, sink_ml), l_i)
        else:
            m_run, l_run, acc_run = fold(m_run, l_run, acc_run, m_i, l_i, acc)

    # Same constexpr: fold mode stores the result here, split mode leaves it to merge_kernel.
    if not WRITE_PARTIALS:
        # HAS_SINKS: constexpr (the model's); the same fold `merge_kernel` applies.
        if HAS_SINKS:
            m_run, l_run, acc_run = fold_sink(m_run, l_run, acc_run, attn_sinks_ptr, head, head < num_heads)
        o = finalize(acc_run, l_run)
        o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * so_t + head[:, None].to(tl.int64) * so_h + offs_d[None, :]
        o_ptrs = tl.where(row_valid[:, None], o_ptrs,
                          sink_out_ptr + sink_row[:, None] * SINK_WIDTH + offs_d[None, :])
        store_rows(o_ptrs, o.to(out_ptr.dtype.element_ty), HEAD, HEAD_PAD)


@triton.jit(do_not_specialize=["num_tokens", "n_split_grid"])
def merge_kernel(
    ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, so_t, so_h,
    num_tokens, num_heads, n_split_grid,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr = False, sinks_ptr=None,
):
    """Fold the split states of one token's GROUP query heads of one KV head, left
    to right, then (``HAS_SINKS``, a constexpr) the heads' attention sinks
    (`fold_sink`, as `attention_kernel`'s fold mode does), then normalise.

    Trip count ceil(n_split_grid / UNROLL) (public); splits past n_split_grid are
    loaded as neutral states, an exact no-op in `fold`. UNROLL independent loads
    per trip keep several in flight.
    """
    tok = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    gmask = offs_g < GROUP
    mask2 = gmask[:, None] & (offs_d < HEAD)[None, :]
    head = kvh * GROUP + offs_g
    row = tok.to(tl.int64) * num_heads + head
    split_stride = num_tokens.to(tl.int64) * num_heads
    m = tl.full([GROUP_PAD], M_INIT, tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    # Public trip count: the number of splits of the launch plan ("merge-loop").
    for c in range(0, (n_split_grid + UNROLL - 1) // UNROLL):
        for k in tl.static_range(UNROLL):
            s = tl.zeros([GROUP_PAD], tl.int32) + (c * UNROLL + k)
            ok = (s < n_split_grid) & gmask
            base = s.to(tl.int64) * split_stride + row
            a = tl.load(ws_acc_ptr + base[:, None] * HEAD + offs_d[None, :], mask=ok[:, None] & mask2, other=0.0)
            mb = tl.load(ws_m_ptr + base, mask=ok, other=M_INIT)
            lb = tl.load(ws_l_ptr + base, mask=ok, other=0.0)
            m, l, acc = fold(m, l, acc, mb, lb, a)
    if HAS_SINKS:
        m, l, acc = fold_sink(m, l, acc, sinks_ptr, head, gmask)
    o = finalize(acc, l)
    o_ptrs = out_ptr + tok.to(tl.int64) * so_t + head[:, None].to(tl.int64) * so_h + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask2)
