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


def churned_order(num_blocks: int, *, seed: int = 0) -> list[int]:
    """Free-list order of a block pool after churn (filled in by the G4 work)."""
    raise NotImplementedError("churned layout: not built yet")


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
