"""Input sets of a case (a paged cache in DHP's layout, random data) and the float32 reference.

Every anchor reads the same sets: the same K/V/Q values, each converted to the
anchor's native layout outside the timed region. A case has several sets when
one is smaller than twice the L2 cache, so that rotating among them makes every
launch read from DRAM, as a step of a real engine does.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dhp_backend.testing.pages import reserved_table

from benchmarks import cases as C

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class InputSet:
    """One step's tensors. ``kv`` is vLLM's DHP cache ``[num_blocks, Hkv, block, 2*d]``;
    ``key_cache``/``value_cache`` are its K and V halves, the views DHP reads."""

    query: torch.Tensor  # [T, Hq, d]
    kv: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, Hkv, block, d] (strided view)
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [R, ceil(max_model_len / block)]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    # float32 [Hq] sink logits when the case has sinks (values exact in bf16, so the
    # anchors that take them in the model's dtype, FA3, get the very same values).
    sinks: torch.Tensor | None = None


def build_set(c: C.Case, gen: torch.Generator, device: torch.device) -> InputSet:
    """Random data (never zeros) with each request's blocks at random places in the cache."""
    dt = TORCH_DTYPES[c.dtype]
    nb = C.cache_blocks(c)
    D, bs = c.head_size, c.block_size
    kv = torch.empty(nb, c.num_kv_heads, bs, 2 * D, dtype=dt, device=device).normal_(generator=gen)
    query = torch.empty(c.num_tokens, c.num_heads, D, dtype=dt, device=device).normal_(generator=gen)
    if c.logits_soft_cap:
        # Scaled scores of unit queries and keys are ~N(0, 1), where cap * tanh(s / cap) = s to 1e-4: an
        # anchor that dropped the cap would pass the check. Queries scaled by the cap make the scores
        # ~N(0, cap^2), so the cap bends a third of them (the values do not change the work).
        query.mul_(c.logits_soft_cap)
    width = -(-c.max_model_len // bs)
    # Every request owns distinct pages up to max_model_len, as the engine reserves
    # them under strict (the address rule: DHP reads them all under a constant-time
    # policy, the other anchors stop at seq_len). The largest reservation any
    # policy makes, so one table serves every policy.
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=gen.device).item())
    table = reserved_table([c.max_model_len] * c.num_reqs, block_size=bs, num_blocks=nb, width=width,
                           layout="random", seed=seed, device=device)
    qsl = [0]
    for q in c.q_lens:
        qsl.append(qsl[-1] + q)
    sinks = None
    if c.sinks:
        # Per-head logits ~N(0, 1), as learned ones, offset by ln(keys a row sees) so that a
        # sink holds about half of its row's softmax mass, as gpt-oss's sinks are there to
        # do; at N(0, 1) alone it would hold 1 / keys, below the check's tolerance, and an
        # anchor that dropped the sinks would pass. Drawn after the cache and the queries.
        seen = min(c.sliding_window or c.max_seq_len, c.max_seq_len)
        sinks = torch.empty(c.num_heads, dtype=torch.float32, device=device).normal_(generator=gen)
        sinks = (sinks + math.log(seen)).to(torch.bfloat16).float()
    return InputSet(
        query=query, kv=kv, key_cache=kv[..., :D], value_cache=kv[..., D:], block_table=table,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(c.seq_lens, dtype=torch.int32, device=device), sinks=sinks,
    )


def rotation(c: C.Case, l2_bytes: int, max_sets: int) -> int:
    """How many sets to rotate: enough that their useful bytes exceed twice the L2 cache."""
    useful = C.work(c)["bytes"]
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / max(useful, 1))))


def plan_memory(c: C.Case, wanted_sets: int, free_bytes: int | None) -> tuple[int, str | None]:
    """(sets to build, None) or (0, why the case does not fit).

    The peak is the sets plus one anchor's copy of them in its native layout (the
    anchors are prepared one at a time and freed; SDPA's dense K/V is at most
    that), plus headroom: 2 GiB for workspaces (FlashInfer's 394 MiB, DHP's
    64 MiB), the reference's per-request float32 K/V and score chunk, and a few
    float32 copies of the output.
    """
    if free_bytes is None:
        return wanted_sets, None
    one = C.set_bytes(c)
    headroom = 2 * 2**30 + 8 * c.num_tokens * c.num_heads * c.head_size * 4
    budget = 0.9 * free_bytes - headroom
    fits = int(budget // (2 * one))
    if fits < 1:
        return 0, (f"does not fit: one input set is {one / 2**30:.1f} GiB, and an anchor's copy doubles it "
                   f"(+{headroom / 2**30:.1f} GiB headroom); {free_bytes / 2**30:.1f} GiB free")
    return min(wanted_sets, fits), None


def reference(c: C.Case, s: InputSet, *, max_scores: int = 2**27) -> torch.Tensor:
    """`ops.paged_attention` in float32 on the same data, chunked over query rows.

    Same semantics as `ops.reference` (which it reuses for the gather), the
    case's features included (soft-cap on the scaled scores, then the causal and
    window masks, then the sink as one more logit of the softmax), but the
    scores of a long prefill are computed a chunk of rows at a time
    (``max_scores`` floats at most) instead of all at once.
    """
    from dhp_backend.ops.reference import gather_request_kv

    Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_size
    G = Hq // Hkv
    scale = D ** -0.5
    cap, W = c.logits_soft_cap, c.sliding_window
    out = torch.empty(c.num_tokens, Hq, D, dtype=torch.float32, device=s.query.device)
    with _fp32_matmul():
        q0 = 0
        for r, (q_len, seq_len) in enumerate(zip(c.q_lens, c.seq_lens)):
            ctx = seq_len - q_len
            start = max(0, ctx - W + 1) if W else 0  # the first position any row sees
            k = gather_request_kv(s.key_cache, s.block_table[r], seq_len, start).float().unsqueeze(1)  # [Hkv,1,S,D]
            v = gather_request_kv(s.value_cache, s.block_table[r], seq_len, start).float().unsqueeze(1)
            rows = max(1, max_scores // (Hq * (seq_len - start)))
            for a in range(0, q_len, rows):
                b = min(q_len, a + rows)
                q = s.query[q0 + a:q0 + b].float().view(b - a, Hkv, G, D).permute(1, 2, 0, 3)
                scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, G, rows, S - start]
                if cap:
                    scores = torch.tanh(scores / cap) * cap
                if c.causal:
                    i = torch.arange(a, b, device=q.device).unsqueeze(1)
                    p = torch.arange(start, seq_len, device=q.device).unsqueeze(0)
                    hidden = p > ctx + i
                    if W:
                        hidden |= p <= ctx + i - W
                    scores.masked_fill_(hidden, float("-inf"))
                if s.sinks is not None:
                    sink = s.sinks.float().view(Hkv, G, 1, 1).expand(-1, -1, b - a, 1)
                    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
                else:
                    probs = torch.softmax(scores, dim=-1)
                o = torch.matmul(probs, v)  # [Hkv, G, rows, D]
                out[q0 + a:q0 + b] = o.permute(2, 0, 1, 3).reshape(b - a, Hq, D)
            q0 += q_len
    return out


class _fp32_matmul:
    """True float32 matmuls for the reference (no TF32), restored afterwards."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the step's rows; inf for a wrong shape or non-finite output."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    o = out.float()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - ref).norm() / ref.norm())
