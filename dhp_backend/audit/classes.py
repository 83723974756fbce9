"""Secret classes for the audit gates: inputs that share every public parameter.

A *shape* fixes what the contract calls public (design.md section 2): model
shape, dtype, block size, the step geometry (requests, scheduled tokens), the
policy and its bucket, and the cache/table sizes. A *class* picks the secrets
inside it: the data (Q, K, V values) and each request's true length below the
bucket. The gates compare two classes of one shape:

- G1 (counters) and G4 (timing) pass/fail pairs: ``random`` vs ``random2``
  (fresh data, same lengths) and ``short`` vs ``long`` (true length 1 vs L);
- reported degenerate-data pairs: ``random`` vs ``zeros``, ``extreme``
  (large magnitudes) and ``skewed`` (one key dominates every softmax row).

`make_inputs` builds one input set on a device; `launch` runs it through the
seam exactly as the vLLM adapter does (no host-side value checks, bucket from
the policy). Nothing here knows about kernel internals.
"""

from __future__ import annotations

import dataclasses

import torch

GATING_PAIRS = (("random", "random2"), ("short", "long"))
REPORTED_PAIRS = (("random", "zeros"), ("random", "extreme"), ("random", "skewed"))
CLASSES = ("random", "random2", "short", "long", "zeros", "extreme", "skewed")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The public parameters of one audited launch."""

    batch: int = 16  # requests
    bucket: int = 4096  # L (strict: max_model_len); also the table capacity
    q_len: int = 1  # query tokens per request (1 = decode)
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    policy: str = "strict"
    causal: bool = True

    @property
    def key(self) -> str:
        return (f"B{self.batch}-L{self.bucket}-q{self.q_len}-h{self.num_heads}x{self.num_kv_heads}-d{self.head_size}"
                f"-bs{self.block_size}-{self.dtype}-{self.policy}")


def true_length(shape: Shape, cls: str) -> int:
    """Every request's true total length under a class (secret, below the bucket)."""
    if cls == "short":
        return shape.q_len  # the shortest a request with q_len new tokens can be
    if cls == "long":
        return shape.bucket
    return max(shape.q_len, (3 * shape.bucket) // 4)  # data classes: one fixed mid length


def make_inputs(shape: Shape, cls: str, *, seed: int = 0, device: str | torch.device = "cuda") -> dict:
    """One input set of ``shape`` in class ``cls`` (tensors on ``device``).

    The cache holds ``batch * ceil(bucket / block_size)`` blocks plus 16 spare, in a
    random permutation, so padding positions have real pages to read as decoys.
    """
    if cls not in CLASSES:
        raise ValueError(f"class {cls!r}; accepted: {', '.join(CLASSES)}")
    dt = _DTYPES[shape.dtype]
    # Two generators: the page layout (block table) is public and must be the same
    # for every class of a shape; only the data (and, for short/long, the lengths)
    # may differ. (A first version seeded both from the class, so random vs random2
    # also compared two public layouts: 0.18 % apart in time on an H200.)
    layout_gen = torch.Generator(device=device).manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1 + (7919 if cls == "random2" else 0))
    width = -(-shape.bucket // shape.block_size)
    num_blocks = shape.batch * width + 16
    kv_shape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_size)
    T = shape.batch * shape.q_len
    q_shape = (T, shape.num_heads, shape.head_size)

    def randn(s):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32)

    if cls == "zeros":
        q, k, v = torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape)
    elif cls == "extreme":
        # large magnitudes that keep the scaled scores finite in fp32 and the values in range
        big = 1.0e4 if dt != torch.float16 else 6.0e2
        q, k, v = randn(q_shape) * 8, randn(kv_shape) * 8, randn(kv_shape) * big
    elif cls == "skewed":
        # every query row aligned with one key direction: one position dominates each softmax row
        direction = randn((shape.head_size,))
        direction = direction / direction.norm()
        q = direction.expand(q_shape) * 40.0
        k = randn(kv_shape) * 0.01
        k[:, :, 0, :] = direction * 40.0  # the first slot of every block
        v = randn(kv_shape)
    else:
        q, k, v = randn(q_shape), randn(kv_shape), randn(kv_shape)
    perm = torch.randperm(num_blocks, generator=layout_gen, device=device)[: shape.batch * width]
    table = perm.view(shape.batch, width).to(torch.int32).contiguous()
    qsl = torch.arange(0, T + 1, shape.q_len, dtype=torch.int32, device=device)
    sl = torch.full((shape.batch,), true_length(shape, cls), dtype=torch.int32, device=device)
    return {"query": q.to(device=device, dtype=dt).contiguous(), "key_cache": k.to(device=device, dtype=dt),
            "value_cache": v.to(device=device, dtype=dt), "block_table": table, "query_start_loc": qsl,
            "seq_lens": sl, "num_tokens": T, "shape": shape, "cls": cls}


def bucket(inputs: dict):
    """The policy's bucket for an input set, as the adapter computes it."""
    from dhp_backend.ops import bucket_for_step

    shape: Shape = inputs["shape"]
    return bucket_for_step(shape.policy, max_model_len=shape.bucket, seq_lens=inputs["seq_lens"],
                           max_seq_len=int(true_length(shape, inputs["cls"])))


def launch(inputs: dict, out: torch.Tensor, *, path: str = "auto", bucket_value=None) -> torch.Tensor:
    """One attention launch through the seam, as the vLLM adapter calls it."""
    from dhp_backend.ops import paged_attention

    shape: Shape = inputs["shape"]
    b = bucket(inputs) if bucket_value is None else bucket_value
    return paged_attention(inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_table"],
                           inputs["query_start_loc"], inputs["seq_lens"], out,
                           scale=shape.head_size ** -0.5, causal=shape.causal, policy=shape.policy, bucket=b,
                           num_tokens=inputs["num_tokens"], path=path, allow_fallback=True, check_values=False)


def empty_out(inputs: dict) -> torch.Tensor:
    q = inputs["query"]
    return torch.empty_like(q)
