"""Batch builders shared by the Triton tests (interpreter and GPU); holds no tests.

A "request" is its own query rows and K/V content; `assemble` lays any list of
requests into one packed step with a fresh paged cache, random physical blocks,
stale garbage (NaN/inf) everywhere no request has written, and NaN-poisoned
padding query rows. Every request owns distinct pages for the table's whole
width (the address rule: the engine reserves them up to the bucket), and the
pages past its length hold that garbage. So what a
request's output may depend on is exactly its own data.
"""

from __future__ import annotations

import dataclasses

import torch

from dhp_backend.ops.buckets import bucket_for_step
from dhp_backend.ops.reference import paged_attention_reference
from dhp_backend.testing.requests import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(q_len: int, seq_len: int, *, H: int, Hkv: int, D: int, dtype, gen: torch.Generator,
                 scale: float = 1.0) -> Request:
    """Random request on ``gen``'s device."""
    assert 0 <= q_len <= seq_len
    dev = gen.device

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    return Request(q=rnd(q_len, H, D), k=rnd(seq_len, Hkv, D), v=rnd(seq_len, Hkv, D))


def random_requests(rng, gen: torch.Generator, n: int, H: int, Hkv: int, dtype, *, max_len: int,
                    D: int = 128) -> list[Request]:
    """``n`` random requests of head size ``D`` and 1..max_len positions: whole prompts (two thirds) and
    chunks on cached context (the csrc kernels' GPU tests)."""
    reqs = []
    for _ in range(n):
        seq = rng.randint(1, max_len)
        q = rng.choice([seq, seq, rng.randint(1, seq)])
        reqs.append(make_request(q, seq, H=H, Hkv=Hkv, D=D, dtype=dtype, gen=gen))
    return reqs


@dataclasses.dataclass
class Step:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_tokens: int
    capacity: int  # block_table.shape[1] * block_size

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table,
                self.query_start_loc, self.seq_lens)

    def bucket(self, policy: str):
        return bucket_for_step(policy, max_model_len=self.capacity, seq_lens=self.seq_lens)


def _garbage(shape, gen, dtype):
    """Stale cache content: NaN, with +-inf and large finite values mixed in."""
    dev = gen.device
    sel = torch.rand(shape, generator=gen, device=dev)
    g = torch.full(shape, float("nan"), device=dev)
    g[sel < 0.2] = float("inf")
    g[(sel >= 0.2) & (sel < 0.3)] = -float("inf")
    g[(sel >= 0.3) & (sel < 0.4)] = 6.0e4
    return g.to(dtype)


def assemble(reqs: list[Request], *, block_size: int, H: int | None = None, Hkv: int | None = None,
             D: int | None = None, dtype=None, pad_tokens: int = 0, extra_rows: int = 0,
             spare_blocks: int = 5, extra_table_cols: int = 1, gen: torch.Generator,
             max_blocks: int | None = None) -> Step:
    """Pack ``reqs`` into one step on ``gen``'s device (see module docstring)."""
    dev = gen.device
    if reqs:
        H, D = reqs[0].q.shape[1:]
        Hkv = reqs[0].k.shape[1]
        dtype = reqs[0].q.dtype
    nblk = [cdiv(r.seq_len, block_size) for r in reqs]
    if max_blocks is None:
        max_blocks = max(nblk + [1]) + extra_table_cols
    num_blocks = len(reqs) * max_blocks + spare_blocks
    kc = _garbage((num_blocks, Hkv, block_size, D), gen, dtype)
    vc = _garbage((num_blocks, Hkv, block_size, D), gen, dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    table = torch.zeros((len(reqs), max_blocks), device=dev, dtype=torch.int32)
    kv_k, kv_v = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)  # [blocks, slot, Hkv, D] views
    used = 0
    for i, r in enumerate(reqs):
        table[i] = perm[used: used + max_blocks].to(torch.int32)
        ids = perm[used: used + nblk[i]]
        used += max_blocks
        if r.seq_len:
            pos = torch.arange(r.seq_len, device=dev)
            blk, slot = ids[pos // block_size], pos % block_size
            kv_k[blk, slot] = r.k
            kv_v[blk, slot] = r.v
    q_lens = [r.q_len for r in reqs]
    n_real = sum(q_lens)
    num_tokens = n_real + pad_tokens
    query = torch.full((num_tokens + extra_rows, H, D), float("nan"), dtype=dtype, device=dev)
    if n_real:
        query[:n_real] = torch.cat([r.q for r in reqs])
    qsl = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(),
                       dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32, device=dev)
    return Step(query=query, key_cache=kc, value_cache=vc, block_table=table, query_start_loc=qsl,
                seq_lens=seq_lens, num_tokens=num_tokens, capacity=max_blocks * block_size)


def reserved_step(reqs: list[Request], policy: str, *, block_size: int, width: int, gen: torch.Generator,
                  pad_tokens: int = 0, extra_rows: int = 0, spare_blocks: int = 5) -> Step:
    """`assemble`'s step with a block table that obeys the address rule for ``policy``
    (max_model_len = the table's capacity, ``width`` pages): request r owns distinct
    random pages up to its reservation (`buckets.reserved_tokens`), its K/V in the first
    seq_len positions, NaN/inf garbage in the rest of its pages and in every other page
    (block 0, vLLM's null block, fills the columns past the reservation)."""
    from dhp_backend.ops.buckets import reserved_tokens
    from dhp_backend.testing.pages import pages_for, reserved_table

    step = assemble(reqs, block_size=block_size, gen=gen, pad_tokens=pad_tokens, extra_rows=extra_rows,
                    max_blocks=width)
    capacity = width * block_size
    reserve = [reserved_tokens(policy, r.seq_len, capacity) for r in reqs]
    num_blocks = 1 + sum(pages_for(t, block_size) for t in reserve) + spare_blocks
    table = reserved_table(reserve, block_size=block_size, num_blocks=num_blocks, width=width,
                           seed=int(torch.randint(1 << 30, (1,), generator=gen, device=gen.device)),
                           device=gen.device)
    kc = _garbage((num_blocks,) + tuple(step.key_cache.shape[1:]), gen, step.key_cache.dtype)
    vc = _garbage(tuple(kc.shape), gen, kc.dtype)
    for i, r in enumerate(reqs):
        if r.seq_len:
            pos = torch.arange(r.seq_len, device=gen.device)
            blk, slot = table[i, pos // block_size].long(), pos % block_size
            kc.permute(0, 2, 1, 3)[blk, slot] = r.k
            vc.permute(0, 2, 1, 3)[blk, slot] = r.v
    return dataclasses.replace(step, key_cache=kc, value_cache=vc, block_table=table, capacity=capacity)


def rank_step(step: Step, tp: int, rank: int) -> tuple[Step, slice]:
    """The step rank ``rank`` of ``tp`` computes, and which query heads of ``step`` it holds.

    vLLM's split (QKVParallelLinear): the query heads in ``tp`` contiguous slices; the KV
    heads too when there are at least ``tp`` of them, so each rank keeps whole GQA groups;
    else each rank holds one KV head, rank r the head ``r // (tp // num_kv_heads)``
    (replicated). The rank's cache holds only its KV heads (vLLM allocates it per rank)."""
    from integration.tp_run import heads_per_rank

    H, Hkv = step.query.shape[1], step.key_cache.shape[1]
    hq, hkv = heads_per_rank(H, Hkv, tp)
    kv0 = rank * hkv if Hkv >= tp else rank // (tp // Hkv)
    heads, kv = slice(rank * hq, (rank + 1) * hq), slice(kv0, kv0 + hkv)
    return dataclasses.replace(step, query=step.query[:, heads].contiguous(),
                               key_cache=step.key_cache[:, kv].contiguous(),
                               value_cache=step.value_cache[:, kv].contiguous()), heads
def drop_pages_below_window(step: Step, window: int, *, gen: torch.Generator) -> Step:
    """The step's block table as vLLM hands it to a windowed layer under policy off:
    the pages wholly below the window of each request's first query row (its
    ``get_num_skipped_tokens``: ``context - window + 1`` positions) hold the null
    block 0, here full of NaN/inf garbage. (Block 0's own content, if a request
    owned it, moves to a new block.)"""
    kc, vc, table = step.key_cache, step.value_cache, step.block_table.clone()
    moved = kc.shape[0]
    kc = torch.cat([kc, kc[:1]])
    vc = torch.cat([vc, vc[:1]])
    table[table == 0] = moved
    kc[0] = _garbage(tuple(kc.shape[1:]), gen, kc.dtype)
    vc[0] = _garbage(tuple(vc.shape[1:]), gen, vc.dtype)
    bs = kc.shape[2]
    q_lens = (step.query_start_loc[1:] - step.query_start_loc[:-1]).tolist()
    for r, (q_len, seq_len) in enumerate(zip(q_lens, step.seq_lens.tolist())):
        table[r, :max(0, seq_len - q_len - window + 1) // bs] = 0
    return dataclasses.replace(step, key_cache=kc, value_cache=vc, block_table=table)


def poison_pages_below_window(step: Step, window: int, *, gen: torch.Generator) -> Step:
    """The step with the content of the pages wholly below each request's window (the
    pages `drop_pages_below_window` hands to the null block) replaced by NaN/inf garbage,
    its block table unchanged: the request still owns them, as under a constant-time
    policy, whose walk reads every page up to the bucket (the address rule)."""
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    bs = kc.shape[2]
    q_lens = (step.query_start_loc[1:] - step.query_start_loc[:-1]).tolist()
    for r, (q_len, seq_len) in enumerate(zip(q_lens, step.seq_lens.tolist())):
        for b in step.block_table[r, :max(0, seq_len - q_len - window + 1) // bs].tolist():
            kc[b] = _garbage(tuple(kc.shape[1:]), gen, kc.dtype)
            vc[b] = _garbage(tuple(vc.shape[1:]), gen, vc.dtype)
    return dataclasses.replace(step, key_cache=kc, value_cache=vc)


def reference(step: Step, *, scale: float, causal: bool, logits_soft_cap: float | None = None,
              sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The reference in float32 on the step's own inputs (upcast)."""
    q, kc, vc, bt, qsl, sl = step.args()
    out = torch.full((q.shape[0],) + tuple(q.shape[1:]), float("nan"), dtype=torch.float32, device=q.device)
    return paged_attention_reference(q.float(), kc.float(), vc.float(), bt, qsl, sl, out,
                                     scale=scale, causal=causal, num_tokens=step.num_tokens,
                                     logits_soft_cap=logits_soft_cap, sinks=sinks, sliding_window=sliding_window)


def random_sinks(num_heads: int, *, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Per-head sink logits as gpt-oss's are spread (a few units around 0), one head at -inf (no sink)."""
    sinks = torch.randn(num_heads, generator=gen, device=gen.device) * 2.0
    sinks[num_heads // 2] = float("-inf")
    return sinks.to(dtype)


def feature_tensors(feats: dict, H: int, seed: int, dtype) -> dict:
    """A test's model features as the launchers take them: ``sinks="f32"`` / ``"model"`` become a [H]
    `random_sinks` tensor on the GPU, float32 or the model dtype ``dtype``; the rest as given."""
    f = dict(feats)
    if "sinks" in f:
        dtype = torch.float32 if f["sinks"] == "f32" else dtype
        f["sinks"] = random_sinks(H, gen=torch.Generator(device="cuda").manual_seed(seed), dtype=dtype)
    return f


def csrc_prefill(step: Step, feats: dict, *, scale: float, variant: str = "v2", bucket=None) -> torch.Tensor:
    """Every row of ``step`` through the csrc prefill kernel (rows past num_tokens left NaN)."""
    from dhp_backend.ops.cuda_prefill import prefill_sm90

    out = torch.full_like(step.query, float("nan"))
    return prefill_sm90(*step.args(), out, scale=scale, causal=True, num_tokens=step.num_tokens, variant=variant,
                        bucket=bucket, **feats)


def csrc_decode(step: Step, feats: dict, *, scale: float, mode=None, bucket=None) -> torch.Tensor:
    """Every row of ``step`` through the csrc decode kernel (each query token its own CTA row)."""
    from dhp_backend.ops.cuda_decode import decode_sm90

    out = torch.full_like(step.query, float("nan"))
    return decode_sm90(*step.args(), out, scale=scale, causal=True, num_tokens=step.num_tokens, mode=mode,
                       bucket=bucket, **feats)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def poisoned_out(step: Step, extra: int = 3) -> torch.Tensor:
    q = step.query
    return torch.full((max(step.num_tokens + extra, q.shape[0]),) + tuple(q.shape[1:]), float("nan"),
                      dtype=q.dtype, device=q.device)


def check_written(step: Step, out: torch.Tensor) -> None:
    """Every row below num_tokens written (finite), padding rows exactly 0, rows beyond untouched."""
    n_real = int(step.query_start_loc[-1])
    assert torch.isfinite(out[: step.num_tokens].float()).all(), "unwritten or non-finite output rows"
    assert (out[n_real: step.num_tokens] == 0).all(), "padding rows must be zero"
    assert torch.isnan(out[step.num_tokens:].float()).all(), "rows at/after num_tokens were touched"


def rel_err(out: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    d = (out[:n].float() - ref[:n]).norm()
    return float(d / ref[:n].norm().clamp_min(1e-30))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
