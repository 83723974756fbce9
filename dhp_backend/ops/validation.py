"""Checks of the seam's tensor values, shared by `ops.paged_attention` and the csrc kernel wrappers.

Every error names the argument, what it was and what is accepted, as
``paged_attention: <arg> is <got>; accepted: <accepted>``.
"""

from __future__ import annotations

import torch


def fail(arg: str, got: object, accepted: str) -> None:
    raise ValueError(f"paged_attention: {arg} is {got}; accepted: {accepted}")


def check_values(query_start_loc, seq_lens, block_table, bucket, num_tokens, num_blocks, block_size):
    """The facts about tensor *values* that `ops.paged_attention` promises to check
    (``check_values=True``): offsets, lengths against buckets and the table, block
    ids in range, and under a constant-time policy distinct pages up to each bucket
    (the address rule). Reads the metadata on the host (a device sync)."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0:
        fail("query_start_loc[0]", str(qsl[0]), "0")
    for r, s in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            fail(f"query_start_loc[{r + 1}]", f"{qsl[r + 1]} < query_start_loc[{r}] = {qsl[r]}",
                 "a non-decreasing sequence")
        if s < 0:
            fail(f"seq_lens[{r}]", str(s), "a length >= 0")
        if q_len > s:
            fail(f"seq_lens[{r}]", f"{s}, shorter than its query ({q_len} tokens)",
                 "seq_len >= query length (seq_len counts the cached context plus the new tokens)")
    if qsl[-1] > num_tokens:
        fail("query_start_loc[-1]", str(qsl[-1]), f"at most num_tokens = {num_tokens}")
    # One host copy of the buckets serves both the length checks and the address rule's.
    buckets = None
    if bucket is not None:
        buckets = bucket.tolist() if isinstance(bucket, torch.Tensor) else [bucket] * len(lens)
        table_capacity = block_table.shape[1] * block_size
        for r, (s, b) in enumerate(zip(lens, buckets)):
            if s > b:
                fail(f"seq_lens[{r}]", f"{s}, above its bucket {b}",
                     "lengths at most the policy's bucket (raise max_model_len or use another policy)")
            if b > table_capacity:
                fail(f"bucket[{r}]", str(b), f"at most block_table.shape[1] * block_size = {table_capacity}")
    table = block_table.cpu()
    for r, s in enumerate(lens):
        n = -(-s // block_size)
        if n > table.shape[1]:
            fail(f"seq_lens[{r}]", f"{s}, which needs {n} blocks",
                 f"at most block_table.shape[1] = {table.shape[1]} blocks of {block_size}")
        if buckets is not None:
            # The address rule: a constant-time kernel reads every page up to the bucket.
            n = max(n, -(-int(buckets[r]) // block_size))
        if not n:
            continue
        row = table[r, :n]
        bad = ((row < 0) | (row >= num_blocks)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            why = ("" if j * block_size < s else
                   f" (column {j} lies past the request's true length but below its bucket "
                   f"{buckets[r]}: under a constant-time policy the kernels read the request's pages "
                   "up to its bucket, so the caller must reserve them)")
            fail(f"block_table[{r}, {j}]", str(int(row[j])),
                 f"a block id in [0, {num_blocks}) (the cache has {num_blocks} blocks){why}")
        if buckets is not None:
            uniq, counts = torch.unique(row, return_counts=True)
            if bool((counts > 1).any()):
                page = int(uniq[counts > 1][0])
                cols = (row == page).nonzero().flatten().tolist()
                fail(f"block_table[{r}, :{n}]", f"page {page} at columns {cols}",
                     f"distinct pages up to the bucket ({n} pages of {block_size} for bucket {buckets[r]}): "
                     "under a constant-time policy every position up to the bucket reads its own page of "
                     "the request (the address rule); reserve real pages for the request up to its bucket")
