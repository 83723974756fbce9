"""Random paged-attention problems and a float64 dense oracle, for tests.

A `PagedBatch` holds one step: per-request logical K/V (the truth), the packed
queries, and a paged cache into which the logical K/V were written through a
shuffled block table, on top of stale garbage (blocks are reused without
zeroing in vLLM). The oracle works from the logical tensors only, so it shares
no indexing code with what it checks.
"""

from __future__ import annotations

import dataclasses
import random

import torch

KINDS = ("decode", "prefill", "chunked", "mixed")


@dataclasses.dataclass
class Request:
    context: int  # cached tokens before this step
    q_len: int  # new tokens this step

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len


@dataclasses.dataclass
class PagedBatch:
    requests: list[Request]
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, Hkv, bs, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [R, W] int32
    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32
    keys: list[torch.Tensor]  # logical per request [seq_len, Hkv, D]
    values: list[torch.Tensor]
    num_tokens: int  # rows to compute (>= query_start_loc[-1]; extra rows are padding)
    scale: float
    causal: bool

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table,
                self.query_start_loc, self.seq_lens)


def random_requests(rng: random.Random, kind: str, num_reqs: int, max_len: int = 300) -> list[Request]:
    reqs = []
    for _ in range(num_reqs):
        k = rng.choice(("decode", "prefill", "chunked")) if kind == "mixed" else kind
        if k == "decode":
            reqs.append(Request(context=rng.randint(0, max_len - 1), q_len=1))
        elif k == "prefill":
            reqs.append(Request(context=0, q_len=rng.randint(1, min(96, max_len))))
        else:  # a prefill chunk on top of cached context
            reqs.append(Request(context=rng.randint(1, max_len // 2), q_len=rng.randint(2, 48)))
    return reqs


def make_batch(
    requests: list[Request],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    causal: bool = True,
    extra_blocks: int = 3,
    extra_columns: int = 2,
    pad_tokens: int = 0,
    garbage: str = "large",  # "large" | "nan" | "zero"
    device: str | torch.device = "cpu",
    shuffle_blocks: bool = True,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    blocks_needed = [-(-r.seq_len // block_size) for r in requests]
    width = max(blocks_needed, default=0) + extra_columns
    width = max(width, 1)
    # Every request owns distinct pages for the table's whole width, as the engine
    # reserves them up to the bucket (the address rule): any bucket up to
    # width * block_size is valid. The reserved pages past a request's length hold
    # stale garbage, as reused pages do in vLLM.
    num_blocks = 1 + len(requests) * width + extra_blocks  # block 0 is vLLM's null block
    ids = list(range(1, num_blocks))
    if shuffle_blocks:
        rng.shuffle(ids)

    # Stale garbage everywhere first: whatever sits past a request's length must
    # never reach the output.
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    if garbage == "nan":
        key_cache = torch.full(shape, float("nan"), dtype=dtype)
        value_cache = torch.full(shape, float("nan"), dtype=dtype)
    elif garbage == "zero":
        key_cache = torch.zeros(shape, dtype=dtype)
        value_cache = torch.zeros(shape, dtype=dtype)
    else:
        key_cache = (randn(*shape).float() * 50).to(dtype)
        value_cache = (randn(*shape).float() * 50).to(dtype)

    table = torch.zeros(len(requests), width, dtype=torch.int32)
    keys, values, queries = [], [], []
    cursor = 0
    for r, req in enumerate(requests):
        table[r] = torch.tensor(ids[cursor:cursor + width], dtype=torch.int32)
        mine = ids[cursor:cursor + blocks_needed[r]]
        cursor += width
        k = randn(req.seq_len, num_kv_heads, head_size)
        v = randn(req.seq_len, num_kv_heads, head_size)
        for p in range(req.seq_len):
            b, o = mine[p // block_size], p % block_size
            key_cache[b, :, o] = k[p]
            value_cache[b, :, o] = v[p]
        keys.append(k)
        values.append(v)
        queries.append(randn(req.q_len, num_heads, head_size))

    q_lens = [r.q_len for r in requests]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    query = torch.cat(queries + [randn(pad_tokens, num_heads, head_size)], dim=0) if (queries or pad_tokens) \
        else torch.empty(0, num_heads, head_size, dtype=dtype)
    dev = torch.device(device)
    return PagedBatch(
        requests=requests,
        query=query.to(dev),
        key_cache=key_cache.to(dev),
        value_cache=value_cache.to(dev),
        block_table=table.to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([r.seq_len for r in requests], dtype=torch.int32, device=dev),
        keys=keys,
        values=values,
        num_tokens=total + pad_tokens,
        scale=head_size ** -0.5,
        causal=causal,
    )


def oracle(batch: PagedBatch, *, logits_soft_cap: float | None = None,
           sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """float64 dense attention from the logical K/V; padding rows are zero.

    ``logits_soft_cap``: scores ``cap * tanh(s / cap)`` before the mask. ``sinks``
    ([num_heads]): one more logit per head in the denominator, no value row.
    ``sliding_window`` W (causal): query position i sees keys j with i - W < j <= i."""
    assert batch.causal or not sliding_window, "a window is defined for causal attention only"
    num_heads, head_size = batch.query.shape[1:]
    out = torch.zeros(batch.num_tokens, num_heads, head_size, dtype=torch.float64)
    q_all = batch.query.detach().cpu().double()
    start = 0
    for req, k, v in zip(batch.requests, batch.keys, batch.values):
        if req.q_len == 0:
            continue
        group = num_heads // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]: head h -> kv head h // group
        vv = v.double().repeat_interleave(group, dim=1)
        q = q_all[start:start + req.q_len]
        s = torch.einsum("qhd,khd->hqk", q, kk) * batch.scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        if batch.causal:
            i = torch.arange(req.q_len).unsqueeze(1)
            j = torch.arange(req.seq_len).unsqueeze(0)
            hidden = j > req.context + i
            if sliding_window:
                hidden = hidden | (j <= req.context + i - sliding_window)
            s = s.masked_fill(hidden, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.detach().cpu().double().view(-1, 1, 1)  # [Hq, 1, 1]
            m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
            w = torch.exp(s - m)
            p = w / (w.sum(dim=-1, keepdim=True) + torch.exp(sink - m))
        out[start:start + req.q_len] = torch.einsum("hqk,khd->qhd", p, vv)
        start += req.q_len
    return out


def assert_close_to_oracle(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    """Element-wise bound: one rounding to ``dtype`` plus float32 accumulation error."""
    got = out.detach().cpu().double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values in output"
    eps = torch.finfo(dtype).eps
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    tol = ref.abs() * eps + 2e-5 * scale
    err = (got - ref).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off; worst {err.max().item():.3e} "
        f"(tolerance there {tol.flatten()[err.argmax()].item():.3e})")
    denom = ref.norm().item()
    return (got - ref).norm().item() / denom if denom else 0.0


def drop_pages_below_window(batch: PagedBatch, window: int) -> PagedBatch:
    """The block table vLLM hands a windowed layer: the pages wholly below the window
    of each request's first query row (``context - window + 1``, vLLM's
    ``get_num_skipped_tokens``) point at its null block 0, here full of NaN (make_batch
    never gives block 0 to a request)."""
    table = batch.block_table.clone()
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    key_cache[0] = float("nan")
    value_cache[0] = float("nan")
    bs = key_cache.shape[2]
    for r, req in enumerate(batch.requests):
        table[r, :max(0, req.context - window + 1) // bs] = 0
    return dataclasses.replace(batch, block_table=table, key_cache=key_cache, value_cache=value_cache)
