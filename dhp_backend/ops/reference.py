"""PyTorch reference for `ops.paged_attention` (CPU and GPU).

Exact semantics, no performance claims, NOT constant-time: it loops over
requests on the host and its work follows the true lengths. It is the oracle
for the kernels and the fallback for shapes they do not cover.

Each request is computed on its own, from tensors whose shapes depend only on
that request, so its output does not depend on the rest of the batch (batch
invariant) and repeats bit for bit on the same device. Arithmetic is float32
whatever the input dtype; the result is rounded to ``out.dtype`` once.
"""

from __future__ import annotations

import torch


def gather_request_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """K or V of one request's positions ``[start, seq_len)`` as ``[num_kv_heads, seq_len - start, head_size]``.

    Reads only the blocks that hold those positions and slices off the rest of
    the first and last one, so nothing past the true length (nor below ``start``:
    pages a sliding window dropped, vLLM's null block) is ever used.
    """
    num_kv_heads, block_size, head_size = cache.shape[1:]
    b0 = start // block_size
    n = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_ids[b0:n].long())  # [n - b0, Hkv, bs, D]
    kv = blocks.transpose(0, 1).reshape(num_kv_heads, (n - b0) * block_size, head_size)
    return kv[:, start - b0 * block_size:seq_len - b0 * block_size]


def paged_attention_reference(
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
    policy=None,
    bucket=None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Arguments as `ops.paged_attention` (already validated). ``policy``/``bucket``
    do not change the result, only what a constant-time kernel may reveal.

    ``logits_soft_cap``: the scaled scores ``s = scale * q.k`` become
    ``cap * tanh(s / cap)`` before the mask and the softmax (vLLM's order: its
    Triton unified attention scales, caps, then masks). ``sinks`` (``[num_heads]``):
    head h's row softmax gets one more logit, ``sinks[h]``, with no value row:
    ``out = sum_p exp(s_p) v_p / (exp(sinks[h]) + sum_p exp(s_p))`` (gpt-oss;
    vLLM's unified attention starts the row max at the sink and its sum at 1).
    ``sliding_window`` W (causal): the row at position q keeps ``q - W < p <= q``, a
    lower bound masked like the causal upper one; the request's positions below its
    first row's window are not even gathered."""
    del policy, bucket
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()

    for r, seq_len in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        context = seq_len - q_len
        # The first position any row of the request sees (0 without a window).
        start = max(0, context - sliding_window + 1) if sliding_window else 0
        # float64: the reductions below run over the request's gathered length, which a chunked prefill
        # changes (a row computed in a chunk sees fewer masked columns than in the whole prompt), and
        # PyTorch's CPU kernels sum in an order that follows the shape. In float64 those orders differ
        # 2^29 times below a float32 (or 16-bit) output's last bit, so the rounded row does not see
        # them: prefill = chunked prefill = decode on the CPU engine (tests/test_golden.py).
        k = gather_request_kv(key_cache, block_table[r], seq_len, start).double()  # [Hkv, S - start, D]
        v = gather_request_kv(value_cache, block_table[r], seq_len, start).double()
        # query head h = kv_head * group + g  ->  [Hkv, group, q_len, D]
        q = query[q0:q1].double().reshape(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, G, q_len, S]
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        if causal:
            rows = torch.arange(q_len, device=query.device).unsqueeze(1)
            cols = torch.arange(start, seq_len, device=query.device).unsqueeze(0)
            hidden = cols > context + rows
            if sliding_window:
                hidden = hidden | (cols <= context + rows - sliding_window)
            scores = scores.masked_fill(hidden, float("-inf"))
        elif sliding_window:
            raise ValueError("paged_attention_reference: sliding_window needs causal=True")
        if sinks is not None:
            # The sink joins the row as one extra logit whose value row is zero.
            sink = sinks.to(scores.dtype).reshape(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.unsqueeze(1))  # [Hkv, G, q_len, D]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(out.dtype)

    if qsl[-1] < num_tokens:
        out[qsl[-1]:num_tokens].zero_()
    return out
