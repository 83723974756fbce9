"""Secret classes for the audit gates: inputs that share every public parameter.

A *shape* fixes what the contract calls public (design.md section 2): model
shape, dtype, block size, the step geometry (requests, query tokens per
request), the policy and its bucket L, and the paged cache: its size
(``num_blocks``) and the block table, built by `dhp_backend.testing.pages`
under the address rule. Every request of every class reserves the bucket:
``block_table[r, :ceil(L / block_size)]`` holds distinct real pages of request
r in the shape's ``layout`` (``consecutive`` as in a fresh engine, ``random``,
or ``churned``: vLLM's own block pool after a serving run). The table is the
same for every class of a shape, so a short and a long request read the very
same pages; the cache has at least 25,000 blocks and more than the step's
pages (`default_num_blocks`), so pages do not repeat within a step.

A *class* picks the secrets inside a shape: the data (Q, K, V values) and each
request's true length below the bucket. The gates compare two classes of one
shape:

- gating pairs (G1 counters and G4 timing pass/fail): ``short`` vs ``long``
  (the shortest and the longest true length that the policy puts in bucket L:
  `true_length`) and ``random`` vs ``random2`` (fresh data, same lengths);
- reported pairs (degenerate data: measured, not gating): ``random`` vs
  ``zeros`` and ``constant`` by default, ``extreme`` (large magnitudes) and
  ``skewed`` (one key dominates every softmax row) on request.

A shape may carry a layer's attention features (`audit.features`: a sliding
window, a logits soft-cap, attention sinks), public model configuration that
selects the binary (such layers run the Triton kernels, `plan.step_kernel`).
The classes do not change with them: under ``strict``/``request`` a windowed
layer's kernel walks the whole bucket as a plain one does (docs/kernels.md
section 6), so every request still reserves its bucket in distinct pages (what
the seam's value check demands of windowed layers too), and the short and long
classes put the window at different secret positions in the same walk. The
sinks are one seeded ``[num_heads]`` float32 tensor per shape (`sinks`), shared
by every class: a model weight.

`make_inputs` builds one input set on a device; `launch` runs it through the
seam exactly as the vLLM adapter does (no host-side value checks, the bucket
from the policy, computed once per input set: under ``request`` a persistent
int32 tensor, as the adapter's buffer that a CUDA graph replays). Nothing here
knows about kernel internals.
"""

from __future__ import annotations

import dataclasses

import torch

from dhp_backend.audit import features as feats

GATING_PAIRS = (("short", "long"), ("random", "random2"))
REPORTED_PAIRS = (("random", "zeros"), ("random", "constant"))
EXTRA_PAIRS = (("random", "extreme"), ("random", "skewed"))  # reported when asked for
CLASSES = ("random", "random2", "short", "long", "long2", "zeros", "constant", "extreme", "skewed")
# Diagnostic length classes, in no default pair: ``at<N>`` is "random"'s data with true length N
# (N inside the bucket; under request with the bucket's power of two). They place a short
# request's end anywhere in the walk: e.g. prefill request's short (2049 of 4096, q 64) ends one
# position into a 128-position step of the csrc prefill binary and its chunk straddles the step
# boundary, where ``at2176`` ends on one as "long" does (`--pairs at2176:long`).
AT_PREFIX = "at"


def is_class(cls: str) -> bool:
    """A class name: one of `CLASSES` or ``at<N>`` (N a positive integer)."""
    return cls in CLASSES or _at_length(cls) is not None


def _at_length(cls: str) -> int | None:
    rest = cls[len(AT_PREFIX):] if cls.startswith(AT_PREFIX) else ""
    return int(rest) if rest.isdigit() and int(rest) > 0 else None


def accepted_classes() -> str:
    return ", ".join(CLASSES) + f", {AT_PREFIX}<N> (true length N, random data)"


# The null pair: "long2" is "long" again (same data, lengths, table; its own length
# tensor, output buffer and CUDA graph). What the harness measures between them is
# what separate buffers and graphs cost, not a secret: the floor under every pair.
NULL_PAIRS = (("long", "long2"),)
POLICIES = ("strict", "request", "off")
LAYOUTS = ("consecutive", "random", "churned")
MIN_CACHE_BLOCKS = 25_000  # design.md section 3: a realistic cache (pages do not repeat and hit L2)
CONSTANT = 0.5  # the value of every Q, K and V element in class "constant"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_num_blocks(batch: int, bucket: int, block_size: int) -> int:
    """The audit's cache size: at least `MIN_CACHE_BLOCKS`, and never fewer than
    ``(batch + 1) * bucket / block_size`` (the step's reserved pages and as many again as one request's)."""
    return max(MIN_CACHE_BLOCKS, (batch + 1) * -(-bucket // block_size))


@dataclasses.dataclass(frozen=True)
class Shape:
    """The public parameters of one audited launch."""

    batch: int = 16  # requests
    bucket: int = 4096  # L (max_model_len; under request every class's lengths share this power of two)
    q_len: int = 1  # query tokens per request (1 = decode; more = a prefill chunk on a context)
    num_heads: int = feats.DEFAULT_GEOMETRY[0]
    num_kv_heads: int = feats.DEFAULT_GEOMETRY[1]
    head_size: int = feats.DEFAULT_GEOMETRY[2]
    block_size: int = 16
    dtype: str = "bfloat16"
    policy: str = "strict"
    causal: bool = True
    layout: str = "random"  # the physical page layout of the block table (testing.pages.LAYOUTS)
    num_blocks: int = 0  # blocks in the cache; 0 = default_num_blocks
    # The layer's attention features (public model configuration, `audit.features`); zero = none.
    sliding_window: int = 0  # W: the row at position q sees keys q - W < p <= q (causal only)
    logits_soft_cap: float = 0.0  # C: scores become C tanh(s / C)
    sinks: bool = False  # a seeded per-head sink logit (`sinks`), the same for every class
    # The kernel family (`audit.features` PATHS): "auto", what the dispatcher runs on this device, or
    # "triton", the Triton CONST_TIME kernels forced (what a GPU without the csrc kernels runs).
    path: str = "auto"

    def __post_init__(self):
        if feats.of(self).sliding_window and not self.causal:  # validates the three fields, too
            raise ValueError(f"sliding_window is {self.sliding_window} with causal=False; accepted: a window on "
                             "causal attention only")

    @property
    def blocks(self) -> int:
        return self.num_blocks or default_num_blocks(self.batch, self.bucket, self.block_size)

    @property
    def width(self) -> int:
        """Block-table width: the bucket's pages."""
        return -(-self.bucket // self.block_size)

    @property
    def step(self) -> str:
        return "decode" if self.q_len == 1 else "prefill"

    @property
    def key(self) -> str:
        return (f"B{self.batch}-L{self.bucket}-q{self.q_len}-h{self.num_heads}x{self.num_kv_heads}-d{self.head_size}"
                f"-bs{self.block_size}-{self.dtype}-{self.policy}-{self.layout}"
                + (f"-nb{self.num_blocks}" if self.num_blocks else "") + feats.of(self).key)

    @property
    def features(self) -> str:
        """The features as ``--features`` spells them, "" for none (a report row's ``features``)."""
        return feats.of(self).label


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def true_length(shape: Shape, cls: str) -> int:
    """Every request's true total length under a class (secret, inside the bucket).

    ``strict`` and ``off``: short = the query length (the shortest a request with
    q_len new tokens can be), long = L. ``request``: the bucket is each request's
    next power of two (capped at L), so short is the shortest length that still
    has bucket L: half the power of two plus one. Data classes: 3L/4 (bucket L
    under every policy).
    """
    if cls == "short":
        if shape.policy == "request":
            return max(shape.q_len, _next_pow2(shape.bucket) // 2 + 1)
        return shape.q_len
    n = _at_length(cls)
    if n is not None:
        lo, hi = true_length(shape, "short"), shape.bucket
        if not lo <= n <= hi:
            raise ValueError(f"class {cls!r}: true length {n} outside [{lo}, {hi}], the lengths that share this "
                             f"shape's bucket under policy {shape.policy!r}")
        return n
    if cls in ("long", "long2"):
        return shape.bucket
    return max(shape.q_len, (3 * shape.bucket) // 4)


def reserved_tokens(shape: Shape) -> int:
    """What every request of every class owns: its bucket (the same pages for short and long)."""
    return shape.bucket


def block_table(shape: Shape, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The shape's block table (public: the same for every class): `testing.pages.reserved_table` with
    every request reserving the bucket, pages handed out in the shape's layout."""
    from dhp_backend.testing import pages

    return pages.reserved_table([reserved_tokens(shape)] * shape.batch, block_size=shape.block_size,
                                num_blocks=shape.blocks, width=shape.width, layout=shape.layout, seed=seed,
                                device=device)


def data_key(cls: str) -> str:
    """Classes with the same data: short, long, at<N> and random differ only in lengths."""
    return "random" if cls in ("short", "long", "long2") or _at_length(cls) is not None else cls


def data_copy_bytes(shape: Shape) -> int:
    """Bytes the timing gate copies before each launch of a class with its own data (its buffers are shared
    with the other class of the pair): the Q rows and the step's K and V pages."""
    item = _DTYPES[shape.dtype].itemsize
    page = shape.num_kv_heads * shape.block_size * shape.head_size * item
    return 2 * shape.batch * shape.width * page + shape.batch * shape.q_len * shape.num_heads * shape.head_size * item


def _make_data(shape: Shape, kind: str, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = _DTYPES[shape.dtype]
    gen = torch.Generator(device=device).manual_seed(seed + 1 + (7919 if kind == "random2" else 0))
    kv_shape = (shape.blocks, shape.num_kv_heads, shape.block_size, shape.head_size)
    q_shape = (shape.batch * shape.q_len, shape.num_heads, shape.head_size)

    def randn(s):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32)

    if kind == "zeros":
        q, k, v = (torch.zeros(s, device=device) for s in (q_shape, kv_shape, kv_shape))
    elif kind == "constant":
        q, k, v = (torch.full(s, CONSTANT, device=device) for s in (q_shape, kv_shape, kv_shape))
    elif kind == "extreme":
        # large magnitudes that keep the scaled scores finite in fp32 and the values in range
        big = 1.0e4 if dt != torch.float16 else 6.0e2
        q, k, v = randn(q_shape) * 8, randn(kv_shape) * 8, randn(kv_shape) * big
    elif kind == "skewed":
        # every query row aligned with one key direction: one position dominates each softmax row
        direction = randn((shape.head_size,))
        direction = direction / direction.norm()
        q = direction.expand(q_shape) * 40.0
        k = randn(kv_shape) * 0.01
        k[:, :, 0, :] = direction * 40.0  # the first slot of every block
        v = randn(kv_shape)
    else:
        q, k, v = randn(q_shape), randn(kv_shape), randn(kv_shape)
    return q.to(dtype=dt).contiguous(), k.to(dtype=dt), v.to(dtype=dt)


def make_inputs(shape: Shape, cls: str, *, seed: int = 0, device: str | torch.device = "cuda",
                shared: dict | None = None) -> dict:
    """One input set of ``shape`` in class ``cls`` (tensors on ``device``).

    The block table (`block_table`, seeded by ``seed``) and the cache size depend on
    the shape only; the data on the class (short, long and random share theirs);
    the lengths on the class and the policy. ``shared``: a dict that keeps tables
    and data between calls, so classes of one shape (and shapes that differ only in
    the policy) use the very same tensors: nothing here writes them.
    """
    if not is_class(cls):
        raise ValueError(f"class {cls!r}; accepted: {accepted_classes()}")
    if shape.policy not in POLICIES:
        raise ValueError(f"policy {shape.policy!r}; accepted: {', '.join(POLICIES)}")
    shared = {} if shared is None else shared
    dev = str(device)
    geometry = (shape.batch, shape.bucket, shape.q_len, shape.num_heads, shape.num_kv_heads, shape.head_size,
                shape.block_size, shape.dtype, shape.blocks, seed, dev)
    tkey = ("table", geometry, shape.layout)
    if tkey not in shared:
        shared[tkey] = block_table(shape, seed=seed, device=device)
    dkey = ("data", geometry, data_key(cls))
    if dkey not in shared:
        shared[dkey] = _make_data(shape, data_key(cls), seed, device)
    q, k, v = shared[dkey]
    T = shape.batch * shape.q_len
    qsl = torch.arange(0, T + 1, shape.q_len, dtype=torch.int32, device=device)
    sl = torch.full((shape.batch,), true_length(shape, cls), dtype=torch.int32, device=device)
    skey = ("sinks", shape.num_heads, seed, dev)
    if shape.sinks and skey not in shared:
        shared[skey] = sinks(shape, seed=seed, device=device)
    inputs = {"query": q, "key_cache": k, "value_cache": v, "block_table": shared[tkey], "query_start_loc": qsl,
              "seq_lens": sl, "num_tokens": T, "shape": shape, "cls": cls,
              "sinks": shared[skey] if shape.sinks else None}
    inputs["bucket"] = bucket(inputs)
    return inputs


def sinks(shape: Shape, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The shape's per-head sink logits, ``[num_heads]`` float32, seeded: a model weight (public), the same
    tensor for every class of a shape."""
    gen = torch.Generator(device=device).manual_seed(seed + 104_729)
    return torch.randn((shape.num_heads,), generator=gen, device=device, dtype=torch.float32)


def problem_spec(shape: Shape, *, device_type: str = "cuda", device_capability=None):
    """The seam's `ProblemSpec` of a shape's launches (its features included), for the gates that say which
    path and kernel ran (`dispatch.choose_path`, `plan.step_kernel`)."""
    from dhp_backend.ops import dispatch

    return dispatch.ProblemSpec(device_type=device_type, dtype=shape.dtype, head_size=shape.head_size,
                                num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                block_size=shape.block_size, causal=shape.causal, device_capability=device_capability,
                                logits_soft_cap=shape.logits_soft_cap or None, sinks=shape.sinks,
                                sliding_window=shape.sliding_window or None)


def bucket(inputs: dict):
    """The policy's bucket for an input set, as the adapter computes it (``request``: an int32 tensor
    on the inputs' device, computed there from the lengths)."""
    from dhp_backend.ops import bucket_for_step

    shape: Shape = inputs["shape"]
    return bucket_for_step(shape.policy, max_model_len=shape.bucket, seq_lens=inputs["seq_lens"])


def route(shape: Shape, *, device_capability=None):
    """The path (`dispatch.PathChoice`) and the step's kernel the seam runs ``shape``'s launches on, as
    `plan.plan_step` picks them: the shape's forced path, or the dispatcher's choice and `plan.step_kernel`."""
    from dhp_backend.ops import dispatch
    from dhp_backend.ops.plan import step_kernel

    spec = problem_spec(shape, device_capability=device_capability)
    choice = dispatch.choose_path(spec, shape.policy, requested=shape.path, allow_fallback=True)
    if shape.path == "auto" and choice.name == dispatch.TRITON:
        return choice, step_kernel(spec, shape.policy, shape.batch * shape.q_len, shape.batch)
    return choice, choice.name


def launch(inputs: dict, out: torch.Tensor, *, path: str | None = None, bucket_value=None) -> torch.Tensor:
    """One attention launch through the seam, as the vLLM adapter calls it (on the shape's path unless
    ``path`` names another)."""
    from dhp_backend.ops import paged_attention

    shape: Shape = inputs["shape"]
    path = shape.path if path is None else path
    b = inputs.get("bucket") if bucket_value is None else bucket_value
    return paged_attention(inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_table"],
                           inputs["query_start_loc"], inputs["seq_lens"], out,
                           scale=shape.head_size ** -0.5, causal=shape.causal, policy=shape.policy, bucket=b,
                           num_tokens=inputs["num_tokens"], path=path, allow_fallback=True, check_values=False,
                           logits_soft_cap=shape.logits_soft_cap or None, sinks=inputs.get("sinks"),
                           sliding_window=shape.sliding_window or None)


def empty_out(inputs: dict) -> torch.Tensor:
    q = inputs["query"]
    return torch.empty_like(q)
