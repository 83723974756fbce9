"""Block tables built the way the engine builds them under the address rule.

Under a constant-time policy `ops.paged_attention` reads exactly the pages
``block_table[r, 0 : ceil(L_r / block_size)]`` of each request r (L_r its
bucket), whatever its true length is; the caller must hand it distinct, valid
pages that the request owns up to there (vLLM does, through the reservation in
`dhp_backend.vllm.reservation`). Benchmarks, the audit and tests build their
tables here, so that every one of them obeys the same rule.

Layouts (which physical pages a request gets, design.md section 3):

- ``consecutive``: requests take runs of adjacent pages in order, as in a fresh
  engine;
- ``random``: a uniformly random permutation of the cache's pages;
- ``churned``: the free-list order of vLLM's own block pool after requests of
  mixed lengths arrived and finished (`churned_order`).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence

import torch

LAYOUTS = ("consecutive", "random", "churned")
NULL_BLOCK = 0  # vLLM keeps block 0 as its null block: never handed to a request


def pages_for(tokens: int, block_size: int) -> int:
    """Pages that hold ``tokens`` positions."""
    return -(-int(tokens) // int(block_size))


def page_order(layout: str, num_blocks: int, *, seed: int = 0) -> list[int]:
    """The order in which pages 1..num_blocks-1 are handed out under ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r}; accepted: {', '.join(LAYOUTS)}")
    ids = list(range(1, num_blocks))
    if layout == "random":
        random.Random(seed).shuffle(ids)
    elif layout == "churned":
        ids = churned_order(num_blocks, seed=seed)
    return ids


# ---------------------------------------------------------------- the churned layout

CHURN_TURNOVER = 4.0  # blocks handed out during the run, in multiples of the cache
CHURN_STATS: dict = {}  # per `churned_order` arguments: what the run did (steps, requests, preemptions...)


def churned_order(num_blocks: int, *, seed: int = 0, block_size: int = 16, turnover: float = CHURN_TURNOVER,
                  prefix_caching: bool = True, max_running: int = 256, step_tokens: int = 8192) -> list[int]:
    """The order in which vLLM's own block pool hands out pages 1..num_blocks-1 after churn.

    Drives vLLM's real ``vllm.v1.core.block_pool.BlockPool`` (imported, not
    reimplemented: same results under vLLM 0.24 and 0.32, whose pools behave alike
    for these calls) through a saturated serving run, on the CPU and without a
    model: requests of mixed lengths (log-uniform prompts of 16 tokens up to
    ``max_len``, outputs of 8..2048 tokens, 40 % of them behind one of 8 shared system
    prompts) arrive while there is room, their prompts are allocated in chunks of
    what the step's token budget leaves and their decodes one block at a time as
    they cross block boundaries (``BlockPool.get_new_blocks``), in vLLM's step order
    (running requests in admission order, then new ones, then frees at the end of
    the step); with ``prefix_caching`` (vLLM's default) full blocks get hashes
    (``cache_full_blocks``) and later requests with the same system prompt hit them
    (``get_cached_block`` + ``touch``); finished or preempted requests release their
    blocks as vLLM's KV-cache manager does, ``free_blocks(reversed(blocks))``, so the
    pool's own policy decides where they go (blocks without a hash to the head of
    the free queue, cached ones to its tail); when a decode finds no free block,
    the most recently admitted request is preempted (and requeued, as vLLM's
    scheduler does). Once ``turnover x num_blocks`` blocks have been handed out,
    admissions stop, every running request finishes, and the free queue, head
    first, is the order returned (block 0, vLLM's null block, is never in it).

    ``max_len`` (the longest request) is ``min(32768, cache tokens / 8)``, so many
    requests share the cache; a step schedules at most ``step_tokens`` tokens (vLLM's
    ``max_num_batched_tokens``) and ``max_running`` requests. Deterministic for given
    arguments (vLLM 0.24 and 0.32 give the same order: tests/test_pages.py pins
    fingerprints); about 1 s for 60,000 blocks plus vLLM's import.

    Without vLLM (the bare GPU machine: vLLM arrives there only with the gpu-stack
    kit), the orders recorded with vLLM in `RECORDED_ORDERS` (the audit's default
    caches, seed 0) are loaded; other arguments raise ImportError.
    """
    key = (int(num_blocks), int(seed), int(block_size), float(turnover), bool(prefix_caching), int(max_running),
           int(step_tokens))
    try:
        import vllm.v1.core.block_pool  # noqa: F401
    except ImportError as e:
        order = _recorded_order(*key)
        if order is None:
            raise ImportError(f"churned_order({num_blocks}, seed={seed}): vLLM is not importable here ({e}) and "
                              f"{RECORDED_ORDERS} has no recorded order for these arguments; install vLLM (on the GPU "
                              "machine: the gpu-stack kit, scripts/device_run.sh) or use a recorded cache size") from e
        return order
    return list(_churned_order(*key))


RECORDED_ORDERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "audit", "data",
                               "churned-orders.npz")
DEFAULT_CHURN = {"block_size": 16, "turnover": CHURN_TURNOVER, "prefix_caching": True, "max_running": 256,
                 "step_tokens": 8192}


def _recorded_key(num_blocks: int, seed: int) -> str:
    return f"n{num_blocks}_s{seed}"


def _recorded_order(num_blocks, seed, block_size, turnover, prefix_caching, max_running, step_tokens):
    """An order from `RECORDED_ORDERS` (None when not recorded for these arguments)."""
    import json

    import numpy as np

    if (dict(block_size=block_size, turnover=turnover, prefix_caching=prefix_caching, max_running=max_running,
             step_tokens=step_tokens) != DEFAULT_CHURN or not os.path.exists(RECORDED_ORDERS)):
        return None
    with np.load(RECORDED_ORDERS, allow_pickle=False) as z:
        name = _recorded_key(num_blocks, seed)
        if name not in z.files:
            return None
        meta = json.loads(str(z["meta"]))
        order = np.cumsum(z[name].astype(np.int64)).tolist()  # stored as differences: runs compress well
    info = meta["orders"][name]
    if churn_fingerprint(order) != info["fingerprint"]:
        raise RuntimeError(f"{RECORDED_ORDERS}: order {name} does not match its recorded fingerprint")
    CHURN_STATS[(num_blocks, seed, block_size, turnover, prefix_caching, max_running, step_tokens)] = {
        **info["stats"], "vllm": meta["vllm"], "source": f"recorded ({os.path.basename(RECORDED_ORDERS)}, "
                                                          f"made with vLLM {meta['vllm']})"}
    return order


def record_orders(sizes: Sequence[int], seeds: Sequence[int] = (0,), path: str = RECORDED_ORDERS) -> dict:
    """Write `RECORDED_ORDERS`: the churned orders of ``sizes`` x ``seeds`` made with this machine's vLLM.

    ``python -c "from dhp_backend.testing import pages; pages.record_orders([25000, 34816])"``
    (the audit's default caches: decode B16 and prefill B4 at L 4096 / 32768)."""
    import json

    import numpy as np

    arrays, meta = {}, {"vllm": vllm_version(), "params": DEFAULT_CHURN, "orders": {}}
    for n in sizes:
        for seed in seeds:
            order = churned_order(n, seed=seed)
            name = _recorded_key(n, seed)
            arrays[name] = np.diff(np.asarray(order, dtype=np.int32), prepend=0).astype(np.int32)
            stats = CHURN_STATS[(n, seed, *DEFAULT_CHURN.values())]
            meta["orders"][name] = {"fingerprint": churn_fingerprint(order),
                                    "stats": {k: v for k, v in stats.items() if k not in ("vllm", "source")}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)
    return meta


def churn_fingerprint(order: Sequence[int]) -> str:
    """A short digest of a page order (reports name the churned layout they ran on)."""
    import hashlib

    return hashlib.sha256(",".join(map(str, order)).encode()).hexdigest()[:16]


def vllm_version() -> str | None:
    """The vLLM whose block pool `churned_order` drives (None if vLLM is absent)."""
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except ImportError:
        return None


class _Req:
    __slots__ = ("uid", "prompt", "out", "block_hashes", "blocks", "n_cached", "computed", "tp", "gen",
                 "done_prefill", "n_admit")

    def __init__(self, uid: int, prompt: int, out: int, block_hashes: list) -> None:
        self.uid, self.prompt, self.out, self.block_hashes = uid, prompt, out, block_hashes
        self.blocks: list = []
        self.n_cached = 0  # blocks whose hashes the pool holds (prefix hits + cache_full_blocks)
        self.computed = 0  # tokens whose KV is in the blocks
        self.tp = -1  # step of the last prefill chunk
        self.gen = 0  # bumped on preemption: the request's pending events are stale
        self.done_prefill = False
        self.n_admit = 0  # its place in the running list (vLLM schedules running requests in this order)


@functools.lru_cache(maxsize=8)
def _churned_order(num_blocks: int, seed: int, block_size: int, turnover: float, prefix_caching: bool,
                   max_running: int, step_tokens: int) -> tuple[int, ...]:
    import heapq
    import math
    import struct

    from vllm.v1.core.block_pool import BlockPool

    if num_blocks < 2:
        raise ValueError(f"num_blocks: {num_blocks}; the pool needs the null block and at least one page")
    bs = block_size
    pool = BlockPool(num_blocks, prefix_caching, bs)
    rng = random.Random(seed)
    cap_tokens = (num_blocks - 1) * bs
    max_len = max(bs, min(32768, cap_tokens // 8))  # one request alone always fits
    systems = [int(math.exp(rng.uniform(math.log(64), math.log(max(65, min(4096, max_len // 4))))))
               for _ in range(8)]

    def log_uniform(lo: int, hi: int) -> int:
        return lo if hi <= lo else int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))

    uid = 0

    def new_request() -> _Req:
        nonlocal uid
        uid += 1
        out = log_uniform(8, min(2048, max_len // 2))
        sys_id = rng.randrange(len(systems)) if rng.random() < 0.4 else -1
        lo = systems[sys_id] + 16 if sys_id >= 0 else 16
        prompt = log_uniform(min(lo, max_len - out), max_len - out)
        n_hash = (prompt + out) // bs + 1
        sys_pages = systems[sys_id] // bs if sys_id >= 0 else 0
        hashes = [struct.pack(">Bii", 1, sys_id, i) if i < sys_pages else struct.pack(">Bqi", 2, uid, i)
                  for i in range(n_hash)]
        return _Req(uid, prompt, out, hashes)

    handed_out = 0
    budget = turnover * num_blocks
    waiting: list[_Req] = []
    running: dict[int, _Req] = {}  # admission order = vLLM's running list
    prefilling: dict[int, _Req] = {}  # running requests whose prompt is not all in the cache yet
    heap: list = []  # (step, kind: 0 allocation / 1 finish, admission index, push index, request, gen)
    pushed = 0
    admitted = preemptions = hit_blocks = 0
    admit_due = True

    def push(t: int, kind: int, r: _Req) -> None:
        nonlocal pushed
        heapq.heappush(heap, (t, kind, r.n_admit, pushed, r, r.gen))
        pushed += 1

    def cache_full(r: _Req, tokens: int) -> None:
        if prefix_caching:
            full = min(len(r.blocks), tokens // bs)
            if full > r.n_cached:
                pool.cache_full_blocks(r, r.blocks, r.n_cached, full, bs, 0)
                r.n_cached = full

    def release(r: _Req) -> None:
        nonlocal admit_due
        cache_full(r, r.computed)
        pool.free_blocks(reversed(r.blocks))  # as vLLM's SingleTypeKVCacheManager.free
        r.blocks, r.n_cached = [], 0
        running.pop(r.uid, None)
        prefilling.pop(r.uid, None)
        admit_due = True

    def preempt(r: _Req) -> None:
        nonlocal preemptions
        preemptions += 1
        release(r)
        r.gen += 1
        if r.done_prefill:  # recompute preemption: it comes back with what it generated so far as prompt
            made = r.computed - r.prompt
            r.prompt, r.out = r.computed, max(1, r.out - made)
        r.computed, r.done_prefill, r.tp = 0, False, -1
        waiting.insert(0, r)

    def allocate(r: _Req, tokens: int) -> bool:
        """Blocks for ``tokens`` tokens; preempts the newest requests for room (False: ``r`` itself was)."""
        nonlocal handed_out
        n = -(-tokens // bs) - len(r.blocks)
        if n <= 0:
            return True
        while pool.get_num_free_blocks() < n:
            victim = running[next(reversed(running))]
            preempt(victim)
            if victim is r:
                return False
        r.blocks += pool.get_new_blocks(n)
        handed_out += n
        return True

    def prefill_step(r: _Req, t: int, tokens: int) -> int:
        """A prefill chunk of at most ``tokens`` tokens; the tokens it used."""
        end = min(r.prompt, r.computed + tokens)
        cache_full(r, r.computed)
        if end <= r.computed or not allocate(r, end):
            return 0
        used, r.computed = end - r.computed, end
        if end >= r.prompt:
            prefilling.pop(r.uid, None)
            r.done_prefill, r.tp = True, t
            decode_next(r)
        return used

    def decode_next(r: _Req) -> None:
        """Next event of a decoding request: the step its length crosses a block boundary, or its finish."""
        t_block = r.tp + len(r.blocks) * bs + 1 - r.prompt
        t_finish = r.tp + r.out
        if t_block <= t_finish:
            push(t_block, 0, r)
        else:
            push(t_finish, 1, r)

    def decode_step(r: _Req, t: int) -> None:
        length = r.prompt + (t - r.tp)
        r.computed = length - 1
        cache_full(r, r.computed)
        if allocate(r, length):
            r.computed = length
            decode_next(r)

    def admit(t: int, tokens: int) -> None:
        nonlocal admitted, hit_blocks
        while waiting and len(running) < max_running and tokens > 0:
            r = waiting[0]
            hits = []
            if prefix_caching:
                for i in range((r.prompt - 1) // bs):
                    got = pool.get_cached_block(r.block_hashes[i], [0])
                    if not got:
                        break
                    hits.append(got[0])
            first = min(r.prompt, len(hits) * bs + tokens)
            need = -(-first // bs) - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
            if pool.get_num_free_blocks() < need:
                return  # first come, first served: the head waits for room
            waiting.pop(0)
            pool.touch(hits)
            hit_blocks += len(hits)
            r.blocks, r.n_cached, r.computed = hits, len(hits), len(hits) * bs
            admitted += 1
            r.n_admit = admitted
            running[r.uid] = r
            prefilling[r.uid] = r
            tokens -= prefill_step(r, t, tokens)

    t = -1
    while True:
        admitting = handed_out < budget
        if admitting:
            while len(waiting) < 8:
                waiting.append(new_request())
        nxt = heap[0][0] if heap else None
        if prefilling or (admitting and admit_due and waiting):
            nxt = t + 1 if nxt is None else min(nxt, t + 1)
        if nxt is None:
            break
        if nxt > 100 * (budget + num_blocks):
            raise RuntimeError("churned_order: the simulated engine makes no progress")  # a bug, not a layout
        t = nxt
        # One engine step, as vLLM's scheduler orders it: the running requests in admission order
        # (decodes take one token each, partial prefills a chunk of what the step's token budget
        # leaves), then new requests while budget and blocks last; finished requests free their
        # blocks at the end of the step.
        due = []
        while heap and heap[0][0] == t and heap[0][1] == 0:
            e = heapq.heappop(heap)
            if e[5] == e[4].gen and e[4].uid in running:
                due.append(e[4])
        due += [r for r in prefilling.values() if r not in due]
        due.sort(key=lambda r: r.n_admit)
        tokens = step_tokens - sum(1 for r in running.values() if r.done_prefill)
        for r in due:
            if r.uid not in running:  # preempted earlier in this step
                continue
            if r.done_prefill:
                decode_step(r, t)
            elif tokens > 0:
                tokens -= prefill_step(r, t, tokens)
        if admitting:
            admit_due = False
            admit(t, tokens)
        while heap and heap[0][0] == t:
            e = heapq.heappop(heap)
            kind, r, gen = e[1], e[4], e[5]
            if gen != r.gen or r.uid not in running:
                continue
            if kind == 0:  # queued for this step by a later one of its requests: runs next step
                push(t + 1, 0, r)
                continue
            r.computed = r.prompt + r.out
            release(r)
    CHURN_STATS[(num_blocks, seed, block_size, turnover, prefix_caching, max_running, step_tokens)] = {
        "steps": t + 1, "requests": admitted, "preemptions": preemptions, "prefix_hit_blocks": hit_blocks,
        "handed_out": handed_out, "vllm": vllm_version(), "source": f"vLLM {vllm_version()} BlockPool (live)"}
    order = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    if len(order) != num_blocks - 1 or 0 in order:
        raise RuntimeError(f"churned_order: the drained pool holds {len(order)} free blocks, expected "
                           f"{num_blocks - 1} (block 0 is the null block)")
    return order


def reserved_table(
    reserved_tokens: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    width: int | None = None,
    layout: str = "random",
    seed: int = 0,
    order: Sequence[int] | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """An int32 ``[R, width]`` block table whose row r holds distinct real pages
    for its first ``pages_for(reserved_tokens[r], block_size)`` columns (the pages
    request r owns up to its bucket); the columns after those hold the null block
    (never read under a constant-time policy). No page is given to two requests.

    ``order`` (optional) is the page hand-out order; by default `page_order`.
    Raises ValueError when the cache is too small for the reservations.
    """
    need = [pages_for(t, block_size) for t in reserved_tokens]
    if width is None:
        width = max(need, default=1) or 1
    if any(n > width for n in need):
        raise ValueError(f"width {width} is narrower than the largest reservation ({max(need)} pages)")
    ids = list(order) if order is not None else page_order(layout, num_blocks, seed=seed)
    if sum(need) > len(ids):
        raise ValueError(f"the cache's {num_blocks} blocks (block 0 is the null block) cannot hold "
                         f"reservations of {sum(need)} pages")
    table = torch.full((len(need), width), NULL_BLOCK, dtype=torch.int32)
    cursor = 0
    for r, n in enumerate(need):
        if n:
            table[r, :n] = torch.tensor(ids[cursor:cursor + n], dtype=torch.int32)
        cursor += n
    return table.to(device)
