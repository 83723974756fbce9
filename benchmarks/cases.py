"""The shapes `benchmarks.harness` times, and the work each one represents.

A `Case` is one attention step: per request, its query length and its total
length (cached context plus the new tokens, as ``seq_lens`` in
`ops.paged_attention`). Families group the cases that the summary and the plots
read together:

- ``decode``: Llama-3-8B attention (32 query / 8 KV heads, head 128, block 16,
  bf16), batches 1..256 at contexts 1K..32K, one new token per request.
- ``prefill``: one request of S tokens (no cached context), causal and not.
  A single request on purpose: the anchors' grids then come from the sequence
  alone, not from how a batch happens to be split.
- ``mixed``: a chunked-prefill step, 63 decodes at 4K plus one 2048-token chunk
  on 4K of cached context (vLLM orders decodes first).
- ``head64``: head size 64, fp16, 16 query = 16 KV heads, 16 requests of 2048 tokens, non-causal.
- ``prefill_gqa7``: the Qwen2.5-7B attention (28 query / 4 KV heads), two causal
  requests of S >= 4K tokens (issue 30's GQA-7 target).
- ``gqa``: decode B16 at 4K with one and with eight query heads per KV head.
- ``strict``: decode and prefill at max_model_len 8K and 32K with the true
  lengths well below it: DHP ``strict`` walks L = max_model_len, so its
  executed (padded) work is counted apart from the useful work.

- ``features`` (on request only: ``--cases features``; never in the default
  list): steps of layers with a model feature, the shapes of the models that
  have it, timed against FA3 with the same feature (issue 31): a sliding window
  (Mistral-7B: 32/8 heads, head 128, W 4096), the logits soft-cap 50
  (Gemma-2-9B: 16/8 heads, head 256), both (a Gemma-2 local layer), attention
  sinks with and without a window of 128 (gpt-oss: 64/8 heads, head 64), a window of
  2047 at head 96 (Phi-3-mini-4k: 32/32 heads).

Outside ``strict``, ``max_model_len`` is the smallest power of two that holds
the longest sequence, so ``strict`` and ``batch`` walk the same L there. A case's
window is below its ``max_model_len`` (a window at or above it is no window,
`ops.attention.check_sliding_window`, and such a case would time plain attention).

Work counts (per step; ``e`` = bytes per element):
- useful bytes = K+V of the true lengths (each cached position read once) + Q + O;
- useful FLOPs = 4 * Hq * d * (keys attended, summed over query rows); a causal
  row ``i`` of a request with context ``c`` attends ``c + i + 1`` keys;
- executed (DHP under ``strict``/``batch``/``request``): every query row walks
  its request's bucket L (constant time, no causal skipping), so the K/V bytes
  and the keys per row are L instead of the true length. Under ``off`` DHP
  walks the true lengths: executed = useful.

With a sliding window W (query row at absolute position ``p = c + i`` sees keys
``p - W < k <= p``), useful work counts the window only:
- useful keys of a causal row = ``min(W, c + i + 1)``; summed over a request's
  rows ``i = 0..q-1`` that is ``sum_{k=c+1}^{c+q} min(W, k)``;
- useful K/V bytes = the positions some row sees, ``[max(0, c - W + 1), s)``:
  ``min(s, W + q - 1)`` positions (a decode: ``min(s, W)``).
Executed work under ``strict``/``request`` is unchanged by the window: the
window's position follows the secret true length, so the constant-time
kernels still walk every position of the bucket L and apply the window by
selection (`dhp_backend.ops.triton.kernels`: under a constant-time policy the
window is a mask, never a bound of the walk). Executed minus useful is the
price of the address rule on a windowed layer. Under ``off`` the kernels start
their walk at the window (rounded down to a KV tile), so executed ~ useful.
The soft-cap (one tanh per score) and the sinks (one more logit per row) are
not counted as FLOPs: the count stays 4 * Hq * d per attended key.
"""

from __future__ import annotations

import dataclasses

from dhp_backend.ops.buckets import next_pow2

LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": "bfloat16"}
TINY = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16, "dtype": "bfloat16"}
# The features family's model shapes (issue 31).
MISTRAL = LLAMA  # Mistral-7B-v0.1: 32 query / 8 KV heads, head 128, window 4096
GEMMA2 = {**LLAMA, "num_heads": 16, "num_kv_heads": 8, "head_size": 256}  # Gemma-2-9B
GPT_OSS = {**LLAMA, "num_heads": 64, "num_kv_heads": 8, "head_size": 64}  # gpt-oss
PHI3 = {**LLAMA, "num_heads": 32, "num_kv_heads": 32, "head_size": 96}  # Phi-3-mini, Phi-3.5-mini
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
PREFILL_LENGTHS = (1024, 2048, 4096, 8192, 16384)
STRICT_MAX_MODEL_LENS = (8192, 32768)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str  # decode | prefill | prefill_gqa7 | mixed | head64 | gqa | strict | features (module docstring)
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    causal: bool
    max_model_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    anchors: tuple[str, ...] | None = None  # None: every anchor
    note: str = ""
    # Model features (None/False: none), as `ops.paged_attention` takes them.
    sliding_window: int | None = None  # W: the row at position p sees keys p - W < k <= p
    logits_soft_cap: float | None = None  # scores become cap * tanh(s / cap)
    sinks: bool = False  # a per-head sink logit joins the softmax (`inputs.build_set` draws it)

    @property
    def features(self) -> tuple[str, ...]:
        """The features of the step, by their `ops.paged_attention` argument names."""
        return tuple(name for name, on in (("sliding_window", self.sliding_window is not None),
                                           ("logits_soft_cap", bool(self.logits_soft_cap)),
                                           ("sinks", self.sinks)) if on)

    @property
    def kind(self) -> str:
        """decode (one token per request), prefill (no cached context) or mixed."""
        if all(q == 1 for q in self.q_lens):
            return "decode"
        if all(q == s for q, s in zip(self.q_lens, self.seq_lens)):
            return "prefill"
        return "mixed"

    @property
    def bound(self) -> str:
        """What limits the step: decode reads K/V once per token (memory); the rest is compute."""
        return "memory" if self.kind == "decode" else "compute"

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def describe(self) -> dict:
        """The JSON form: every field plus the derived ones, the per-request lists compressed."""
        d = dataclasses.asdict(self)
        for key in ("q_lens", "seq_lens"):
            vals = d[key]
            d[key] = vals if len(set(vals)) > 1 and len(vals) <= 8 else _runs(vals)
        d.update(kind=self.kind, bound=self.bound, num_reqs=self.num_reqs, num_tokens=self.num_tokens,
                 max_seq_len=self.max_seq_len, useful=work(self, "off"))
        return d


def _runs(vals) -> list[list[int]]:
    """[[value, count], ...] for consecutive equal values (256 equal lengths stay short in the JSON)."""
    out: list[list[int]] = []
    for v in vals:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def case(name, family, q_lens, seq_lens, *, causal=True, max_model_len=None, shape=None, **kw) -> Case:
    shape = {**LLAMA, **(shape or {})}
    q_lens, seq_lens = tuple(q_lens), tuple(seq_lens)
    if len(q_lens) != len(seq_lens) or any(q > s or q < 1 for q, s in zip(q_lens, seq_lens)):
        raise ValueError(f"case {name}: query lengths {q_lens} must be 1..seq_len for seq_lens {seq_lens}")
    if max_model_len is None:
        max_model_len = next_pow2(max(seq_lens))
    _check_window(name, kw.get("sliding_window"), max_model_len, causal)
    return Case(name=name, family=family, q_lens=q_lens, seq_lens=seq_lens, causal=causal,
                max_model_len=max_model_len, **shape, **kw)


def _check_window(name: str, w, max_model_len: int, causal: bool) -> None:
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 1 <= w < max_model_len
                          or not causal):
        raise ValueError(f"case {name}: sliding_window {w!r}; accepted: None, or an int in [1, max_model_len = "
                         f"{max_model_len}) on a causal case (a window at or above max_model_len is no window)")


def decode(B, ctx, family="decode", name=None, **kw) -> Case:
    return case(name or f"decode B{B} ctx{ctx}", family, [1] * B, [ctx] * B, **kw)


def prefill(S, causal, family="prefill", name=None, batch=1, **kw) -> Case:
    mask = "causal" if causal else "noncausal"
    return case(name or f"prefill S{S} {mask}", family, [S] * batch, [S] * batch, causal=causal, **kw)


def mixed(chunk=2048, chunk_context=4096, decodes=63, decode_ctx=4096, family="mixed", name=None, **kw) -> Case:
    return case(name or f"mixed chunk{chunk}@ctx{chunk_context} + {decodes} decodes@{decode_ctx}", family,
                [1] * decodes + [chunk], [decode_ctx] * decodes + [chunk_context + chunk],
                note=kw.pop("note", "decodes first, then the chunk (vLLM's order)"), **kw)


# Anchors worth timing where only DHP strict differs (the other DHP policies repeat
# the decode/prefill rows of the same shape).
STRICT_ANCHORS = ("fa3", "flashinfer", "dhp_off", "dhp_strict")


def strict(base: Case, max_model_len: int) -> Case:
    return dataclasses.replace(base, name=f"strict {base.name} M{max_model_len}", family="strict",
                               max_model_len=max_model_len, anchors=STRICT_ANCHORS,
                               note=f"max_model_len {max_model_len}: DHP strict walks L={max_model_len}")


def gpu_cases(quick: bool = False) -> list[Case]:
    """The GPU shape list (``quick``: a subset for a fast pass)."""
    batches, contexts, lengths = DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_LENGTHS
    if quick:
        batches, contexts, lengths = (1, 16, 64), (4096, 32768), (4096,)
    cases = [decode(B, ctx) for ctx in contexts for B in batches]
    cases += [prefill(S, causal) for causal in (True, False) for S in lengths]
    cases.append(mixed())
    # Qwen2.5-7B's attention (28 query / 4 KV heads: GQA 7, not a power of two), as issue 30 measured it
    cases += [prefill(S, True, family="prefill_gqa7", batch=2, name=f"prefill B2 S{S} causal Hq28 Hkv4 (Qwen2.5-7B)",
                      shape={"num_heads": 28, "num_kv_heads": 4}) for S in lengths if S >= 4096]
    if not quick:
        cases.append(prefill(2048, False, family="head64", batch=16,
                             name="head64 fp16 B16 H16 S2048 noncausal",
                             shape={"num_heads": 16, "num_kv_heads": 16, "head_size": 64, "dtype": "float16"},
                             note="16 requests of 2048 tokens"))
        cases += [decode(16, 4096, family="gqa", name=f"gqa{32 // kv} decode B16 ctx4096 (Hq32 Hkv{kv})",
                         shape={"num_kv_heads": kv}) for kv in (32, 4)]
    strict_bases = [decode(16, 4096), prefill(4096, True)] + ([] if quick else [decode(1, 4096)])
    cases += [strict(b, m) for b in strict_bases for m in STRICT_MAX_MODEL_LENS
              if not (quick and m != max(STRICT_MAX_MODEL_LENS))]
    return cases


FEATURES = "features"
# Families run only when named (``--cases features``): never part of the default list.
ON_REQUEST = (FEATURES,)
WINDOW_MISTRAL, CAP_GEMMA2, WINDOW_GPT_OSS, WINDOW_PHI3, WINDOW_GEMMA3 = 4096, 50.0, 128, 2047, 1024


def _tag(c: Case) -> str:
    parts = []
    if c.sliding_window is not None:
        parts.append(f"W{c.sliding_window}")
    if c.logits_soft_cap:
        parts.append(f"cap{c.logits_soft_cap:g}")
    if c.sinks:
        parts.append("sinks")
    return " ".join(parts) or "plain"


def featured(base: Case, model: str, note: str | None = None, **features) -> Case:
    """``base`` as a step of a layer with ``features`` (family ``features``), named after the model."""
    c = dataclasses.replace(base, family=FEATURES, **features)
    _check_window(base.name, c.sliding_window, c.max_model_len, c.causal)
    return dataclasses.replace(c, name=f"{model} {_tag(c)} {base.name}",
                               note="; ".join(x for x in (note or f"{model}-like layer", base.note) if x))


def feature_cases(quick: bool = False) -> list[Case]:
    """The ``features`` family on the GPU (``quick``: six of them). Every case has FA3 with the same
    features; B16 decodes and single-request prefills, as the plain families."""
    swa = {"sliding_window": WINDOW_MISTRAL}
    cap = {"logits_soft_cap": CAP_GEMMA2}
    local = {**swa, **cap}  # a Gemma-2 local layer: window 4096 and the cap
    sink = {"sinks": True}
    sink_w = {**sink, "sliding_window": WINDOW_GPT_OSS}
    m7, g2, oss, phi = {"shape": MISTRAL}, {"shape": GEMMA2}, {"shape": GPT_OSS}, {"shape": PHI3}
    phi_w = {"sliding_window": WINDOW_PHI3}
    cases = [  # (in the quick subset, case)
        (True, featured(decode(16, 16384, **m7), "mistral", **swa)),
        (False, featured(decode(16, 32768, **m7), "mistral", **swa)),
        (True, featured(prefill(8192, True, **m7), "mistral", **swa)),
        (False, featured(mixed(chunk=2048, chunk_context=6144, decodes=15, decode_ctx=16384, **m7), "mistral",
                         **swa)),
        (True, featured(decode(16, 8192, **g2), "gemma2", **cap)),
        (False, featured(prefill(4096, True, **g2), "gemma2", **cap)),
        (True, featured(decode(16, 8192, **g2), "gemma2-local", **local)),
        (False, featured(prefill(8192, True, **g2), "gemma2-local", **local)),
        # Gemma-3 12B's local layers (its attention shape is Gemma-2 9B's: 16 / 8 heads of 256; no cap)
        (False, featured(decode(16, 8192, **g2), "gemma3-local", sliding_window=WINDOW_GEMMA3)),
        (False, featured(prefill(8192, True, **g2), "gemma3-local", sliding_window=WINDOW_GEMMA3)),
        (True, featured(decode(16, 8192, **oss), "gpt-oss", **sink_w)),
        (False, featured(decode(16, 8192, **oss), "gpt-oss", **sink)),
        (True, featured(prefill(4096, True, **oss), "gpt-oss", **sink_w)),
        (False, featured(prefill(4096, True, **oss), "gpt-oss", **sink)),
        (True, featured(decode(16, 4096, **phi), "phi3", **phi_w)),
        (True, featured(prefill(4096, True, **phi), "phi3", **phi_w)),
        # FA3 (vllm_flash_attn, fa_version 3) gave wrong results at hdim 96 once the window bites at
        # S 4096 and 8192 (rel. err. 0.04-0.05, H200, vLLM 0.24): at S 2048 a window of 2047 masks one
        # key per row at most, and FA3 is right there
        (False, featured(prefill(2048, True, **phi), "phi3", **phi_w)),
    ]
    return [c for in_quick, c in cases if in_quick or not quick]


def cpu_feature_cases() -> list[Case]:
    """Tiny ``features`` steps for a CPU run: every feature, each window shorter than the context (the
    cap and the sinks in separate cases, as in the models: under a cap's scores a sink would weigh
    nothing, `inputs.build_set`)."""
    return [
        featured(decode(2, 64, shape=TINY), "tiny", "tiny shape", sliding_window=24, logits_soft_cap=CAP_GEMMA2),
        featured(prefill(32, True, shape=TINY), "tiny", "tiny shape", sliding_window=8, sinks=True),
    ]


def cpu_cases() -> list[Case]:
    """Tiny shapes for a CPU run (Triton interpreter or the reference path): the pipeline, not speed."""
    return [
        decode(2, 64, shape=TINY),
        prefill(32, True, shape=TINY),
        strict(decode(2, 64, shape=TINY), 128),
    ]


def select(cases: list[Case], patterns: str | None) -> list[Case]:
    """Cases whose name or family contains any of the comma-separated ``patterns``.

    A case of a family run on request (`ON_REQUEST`: ``features``) is selected
    only by its family's name or by a pattern its name starts with (its model:
    ``gemma2``, ``mistral w4096 decode``...), so that ``--cases decode`` times
    what it always did. Without ``patterns``: every case not on request."""
    if not patterns:
        return [c for c in cases if c.family not in ON_REQUEST]
    pats = [p.strip().lower() for p in patterns.split(",") if p.strip()]

    def picks(p: str, c: Case) -> bool:
        if c.family in ON_REQUEST:
            return p == c.family or c.name.lower().startswith(p)
        return p in c.name.lower() or p == c.family

    return [c for c in cases if any(picks(p, c) for p in pats)]


# ------------------------------------------------------------------ work counts

def buckets(c: Case, policy: str) -> list[int] | None:
    """Per-request bucket L that DHP walks under ``policy`` (None under ``off``: true lengths)."""
    if policy == "off":
        return None
    if policy == "strict":
        return [c.max_model_len] * c.num_reqs
    if policy == "request":
        return [min(next_pow2(s), c.max_model_len) for s in c.seq_lens]
    raise ValueError(f"unknown policy {policy!r}")


def work(c: Case, policy: str = "off") -> dict:
    """Bytes and FLOPs of one step: useful (``off``) or executed under a DHP ``policy``."""
    e = c.elem_bytes
    kv_row = 2 * c.num_kv_heads * c.head_size * e  # K and V of one position
    qo = 2 * c.num_tokens * c.num_heads * c.head_size * e
    per_key = 4 * c.num_heads * c.head_size
    Ls = buckets(c, policy)
    W = c.sliding_window
    kv_bytes = keys = 0
    for r, (q, s) in enumerate(zip(c.q_lens, c.seq_lens)):
        ctx = s - q
        if Ls is None and W is not None:  # causal (`case` checks): rows see min(W, ctx + i + 1) keys
            kv_bytes += min(s, W + q - 1) * kv_row
            keys += windowed_keys(ctx, q, W)
        elif Ls is None:
            kv_bytes += s * kv_row
            keys += (q * ctx + q * (q + 1) // 2) if c.causal else q * s
        else:
            kv_bytes += Ls[r] * kv_row
            keys += q * Ls[r]
    return {"bytes": kv_bytes + qo, "flops": per_key * keys}


def windowed_keys(ctx: int, q: int, W: int) -> int:
    """``sum_{k=ctx+1}^{ctx+q} min(W, k)``: the keys a request's q causal rows on ctx
    cached positions see through a window W."""
    a, b = ctx + 1, ctx + q
    top = min(b, W)  # rows up to key count W see k keys, the rest W
    below = (top * (top + 1) // 2 - (a - 1) * a // 2) if top >= a else 0
    return below + W * (b - max(a - 1, W) if b > W else 0)


def cache_blocks(c: Case) -> int:
    """Blocks of one input set's cache: every request's reservation up to
    max_model_len (the address rule: under strict DHP reads them all) plus a spare
    request's worth, and vLLM's null block."""
    real = sum(-(-s // c.block_size) for s in c.seq_lens)
    return max(real + 1, (c.num_reqs + 1) * -(-c.max_model_len // c.block_size))


def set_bytes(c: Case) -> int:
    """Device bytes of one input set (cache, query, block table)."""
    cache = cache_blocks(c) * 2 * c.num_kv_heads * c.block_size * c.head_size * c.elem_bytes
    query = c.num_tokens * c.num_heads * c.head_size * c.elem_bytes
    table = c.num_reqs * -(-c.max_model_len // c.block_size) * 4
    return cache + query + table
