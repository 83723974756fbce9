"""Length buckets: the L that a policy lets timing depend on (design.md section 2).

The bucket is computed by the caller from *public* information (the model's
max_model_len, and for `request` each request's length rounded up to a
power of two, which is what those policies declare public) and passed to
`ops.paged_attention`. Kernels round it up to their own tile internally; the
tile is public too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dhp_backend.config import Policy


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def next_pow2_tensor(lengths: torch.Tensor) -> torch.Tensor:
    """Element-wise next power of two of an int32 tensor, on its device.

    Pure integer bit arithmetic (no floats, no host sync), so it is exact, runs
    inside CUDA-graph capture, and costs the same for every value.
    """
    x = lengths.to(torch.int32).clamp(min=1) - 1
    for shift in (1, 2, 4, 8, 16):
        x = x | (x >> shift)
    return x + 1


def reserved_tokens(policy: Policy | str, seq_len: int, max_model_len: int) -> int:
    """Tokens of KV pages the engine must hold for a request of length ``seq_len``
    before a step runs it (the address rule, design.md section 2).

    Under a constant-time policy a kernel reads exactly the pages
    ``block_table[r, 0 : ceil(L_r / block_size)]`` whatever the true length is, so
    those pages must exist and belong to the request: ``strict`` reserves
    ``max_model_len`` from the first step; ``request`` its length's next power of
    two (capped at ``max_model_len``), reserved again each time the length crosses
    one; ``off`` only what the true length needs.
    """
    policy = Policy.parse(policy)
    if max_model_len <= 0:
        raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
    seq_len = max(0, int(seq_len))
    if policy is Policy.STRICT:
        return int(max_model_len)
    if policy is Policy.REQUEST:
        return min(next_pow2(seq_len), int(max_model_len))
    return min(seq_len, int(max_model_len))


def bucket_for_step(
    policy: Policy | str,
    *,
    max_model_len: int,
    seq_lens: Sequence[int] | torch.Tensor | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> int | torch.Tensor | None:
    """The bucket argument of `ops.paged_attention` for one step.

    - ``strict``: ``max_model_len`` (an int).
    - ``request``: per-request next power of two capped at ``max_model_len``, as
      an int32 tensor on the device of ``seq_lens`` (computed there, no sync).
      With ``out`` (int32, at least ``len(seq_lens)`` long) the result is written
      into ``out[:len(seq_lens)]`` and that view is returned: a persistent buffer
      is what a CUDA graph captured once can read on every replay.
    - ``off``: ``None`` (true lengths).
    """
    policy = Policy.parse(policy)
    if max_model_len <= 0:
        raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
    if policy is Policy.STRICT:
        return int(max_model_len)
    if policy is Policy.OFF:
        return None
    # request
    if seq_lens is None:
        raise ValueError("bucket_for_step(request): pass seq_lens (per-request lengths)")
    lens = seq_lens if isinstance(seq_lens, torch.Tensor) else torch.tensor(list(seq_lens))
    result = next_pow2_tensor(lens).clamp(max=int(max_model_len)).to(torch.int32)
    if out is None:
        return result
    if out.dtype != torch.int32 or out.dim() != 1 or out.shape[0] < result.shape[0]:
        raise ValueError(f"bucket_for_step: out must be a 1-D int32 tensor of at least {result.shape[0]} "
                         f"entries, got {out.dtype} of shape {tuple(out.shape)}")
    view = out[:result.shape[0]]
    view.copy_(result)
    return view
