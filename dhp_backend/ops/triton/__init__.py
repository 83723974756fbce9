"""Constant-time Triton kernels for `ops.paged_attention` (issue 3).

This package's ``__init__`` stays import-cheap: `supports` answers *whether* a
shape is covered without importing Triton or torch (the dispatcher calls it at
start-up). The kernels (`kernels`) and their launcher (`launch`) are imported on
the first launch. docs/kernels.md describes the design.
"""

from __future__ import annotations

import importlib.util
import os

from dhp_backend.ops.tiles import (
    MAX_GROUP,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
)

MIN_CAPABILITY = (8, 0)  # Ampere and newer: bf16 MMA, what the kernels were written for


def supports(spec) -> tuple[bool, str]:
    """Whether the Triton kernels cover ``spec`` (a `dispatch.ProblemSpec`), and why not."""
    if spec.device_type == "cuda":
        cap = spec.device_capability
        if cap is not None and tuple(cap) < MIN_CAPABILITY:
            return False, (f"CUDA device capability {cap[0]}.{cap[1]} is below "
                           f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the oldest the Triton kernels target")
    elif spec.device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False, ("the Triton kernels run on CUDA devices; on the CPU only under the Triton "
                           "interpreter (TRITON_INTERPRET=1, for tests)")
    else:
        return False, f"device type {spec.device_type!r} is not covered (CUDA only)"
    if importlib.util.find_spec("triton") is None:
        return False, "the 'triton' package is not installed"
    if spec.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {spec.dtype} is not covered (covered: {', '.join(SUPPORTED_DTYPES)})"
    if spec.head_size not in SUPPORTED_HEAD_SIZES:
        return False, (f"head size {spec.head_size} is not covered "
                       f"(covered: {', '.join(map(str, SUPPORTED_HEAD_SIZES))})")
    if spec.block_size not in SUPPORTED_BLOCK_SIZES:
        return False, (f"KV block size {spec.block_size} is not covered "
                       f"(covered: {', '.join(map(str, SUPPORTED_BLOCK_SIZES))})")
    if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
        return False, f"{spec.num_heads} query heads do not divide into {spec.num_kv_heads} KV heads"
    if spec.gqa_ratio > MAX_GROUP:
        return False, f"{spec.gqa_ratio} query heads per KV head exceed the tile's {MAX_GROUP}"
    return True, "covered"


def paged_attention_triton(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, *,
                           scale, causal, num_tokens, policy, bucket, **features_and_test_hooks):
    """`ops.paged_attention` on the Triton kernels (arguments validated by the caller)."""
    from dhp_backend.ops.triton.launch import paged_attention_triton as _launch

    return _launch(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                   scale=scale, causal=causal, num_tokens=num_tokens, policy=policy, bucket=bucket,
                   **features_and_test_hooks)
