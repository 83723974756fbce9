"""KV-page reservation in vLLM's scheduler: the address rule's half on the engine side.

Under a constant-time policy (``strict``, ``request``) DHP's kernels read exactly
the pages ``block_table[r, 0 : ceil(L_r / block_size)]`` of each request ``r``
whatever its true length (design.md section 2, "The address rule"). So vLLM must
have *allocated* those pages to the request before a step runs it.
`dhp_backend.ops.buckets.reserved_tokens` says how many tokens' pages:
``strict`` -> ``max_model_len`` from the first step; ``request`` -> the next power
of two of the length (capped at ``max_model_len``), reserved again each time the
length crosses one; ``off`` -> the true length (vLLM's own behaviour).

How it is done. vLLM's scheduler allocates in one place, in 0.24 and 0.32 alike:
``KVCacheManager.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens, ...)``,
which gives the request slots up to ``min(computed + new + lookahead,
max_model_len)`` tokens, or returns None when the blocks do not fit (a waiting
request then keeps waiting; a running one makes the scheduler preempt, vLLM's
normal path). The reservation raises ``num_lookahead_tokens`` (never lowers it:
spec decode passes its own) so that the allocation covers
``reserved_tokens(policy, n + lookahead, max_model_len)`` where ``n`` is the
length the step will run the request at. Everything else (admission, prefix
caching, freeing, preemption, the worker's block table) is vLLM's own code
seeing a request that needs more slots.

Installation, with no flag beyond ``--attention-backend DHP`` and the policy:
the plugin's ``register()`` calls `install`, which wraps ``Scheduler.__init__``
(``AsyncScheduler.__init__`` calls it) as soon as vLLM resolves its scheduler
class in the engine core (`compat.on_scheduler_class_resolved`: register()
stays cheap, the scheduler module is imported only where a scheduler is built).
After the original ``__init__``, `after_scheduler_init` checks whether this
engine runs DHP (`compat.engine_runs_dhp`) under a constant-time policy and, if
so, wraps that scheduler's ``kv_cache_manager.allocate_slots``; under every
policy the price goes into the process's start-up report
(`dhp_backend.vllm.report`). The engine refuses to start, naming the flag to
add, if the hook cannot be installed (a scheduler class or vLLM whose allocator lacks these
parameters), and also if the KV cache cannot hold one request's reservation at
``max_model_len`` (nothing could ever be scheduled).

Why not ``--scheduler-cls``: it is vLLM's supported way to swap the scheduler,
but it needs a user flag, and a class named there replaces vLLM's choice
between ``Scheduler`` and ``AsyncScheduler``; a plugin cannot set it (plugins see
no config). Nothing else in vLLM's scheduler or config is an allocation hook.

Windowed layers (sliding-window attention). vLLM's sliding-window manager frees
the blocks that fall out of a layer's window and puts its null block in their
table entries; DHP's kernels under a constant-time policy read every page up to
the bucket, out-of-window ones included (the window's position follows the
secret length). So under ``strict``/``request`` DHP's windowed layers declare
vLLM's full-attention KV management (`compat.manage_windowed_kv_as_full`, from
the impl: ``FullAttentionSpec(..., sliding_window=W)``, one KV-cache group with
the full layers where the pages match), and this reservation covers them like
any full layer: the window then saves no KV memory, which the price log says.
If a windowed layer's group still reaches the scheduler with the
sliding-window manager, the engine refuses to start (`reserve_on`). Under
``off`` nothing changes: vLLM's sliding-window manager keeps its memory saving;
the table entries of the pages it freed (its null block) lie below every row's
window, and no kernel lets them into a result.

Several KV-cache groups (layers of different page sizes): the lookahead is
raised for every group alike, and the figures of the price log are the first
group's. KV-connector loads that allocate without running a step
(``delay_cache_blocks``) are left alone: the request's pages are reserved at
the allocation of the step that runs it.
"""

from __future__ import annotations

import functools
import inspect
import logging

from dhp_backend.config import DHPConfig, Policy
from dhp_backend.ops.buckets import reserved_tokens
from dhp_backend.reservation_price import reservation_price

logger = logging.getLogger("dhp_backend")

OFF_FLAG = """--additional-config '{"dhp": {"policy": "off"}}'"""


class ReservationUnavailable(RuntimeError):
    """The address rule cannot be kept in this vLLM: the engine must not start."""


def refusal(policy: Policy, why: str) -> ReservationUnavailable:
    return ReservationUnavailable(
        f"DHP policy '{policy.value}' reads every KV page of a request up to its bucket, so vLLM's "
        f"scheduler must reserve those pages (design.md section 2, the address rule), but {why}. "
        f"Start the engine with {OFF_FLAG} (true lengths, not constant-time), or use a vLLM "
        "release the backend supports (0.24 to 0.32).")


# --- the hook ------------------------------------------------------------------

def lookahead_tokens(policy: Policy, num_main_tokens: int, num_lookahead: int, max_model_len: int) -> int:
    """The ``num_lookahead_tokens`` that makes ``allocate_slots`` cover the reservation.

    ``num_main_tokens``: the request's length once this step's tokens are in
    (computed + prefix hit + external + new); ``num_lookahead``: what the
    scheduler asked for (speculative slots). vLLM caps the allocation at
    ``max_model_len`` itself.
    """
    num_lookahead = max(0, int(num_lookahead or 0))
    target = reserved_tokens(policy, num_main_tokens + num_lookahead, max_model_len)
    return max(num_lookahead, target - num_main_tokens)


#: the counts that add up to the length a step runs a request at (besides its computed tokens)
ALLOCATE_COUNTS = ("num_new_computed_tokens", "num_external_computed_tokens", "num_new_tokens")


class ReservingAllocateSlots:
    """Stands in for one ``KVCacheManager.allocate_slots`` bound method.

    Arguments are mapped to parameter names once, from ``inspect.signature`` of
    the original, so positional and keyword calls both work; each call costs a
    dict and a few additions, about a microsecond (the scheduler calls it per
    scheduled request per step). ``_target`` is `reserved_tokens` for the
    policy, inlined (tests check they agree).
    """

    def __init__(self, original, policy: Policy, max_model_len: int):
        policy = Policy.parse(policy)
        sig = inspect.signature(original)
        params = sig.parameters
        missing = [name for name in ("request", "num_new_tokens", "num_lookahead_tokens") if name not in params]
        if missing:
            raise refusal(policy, f"this vLLM's KVCacheManager.allocate_slots{sig} has no parameter "
                                  f"{', '.join(missing)}")
        odd = [name for name, p in params.items()
               if name in ("request", "num_lookahead_tokens") and p.kind is p.POSITIONAL_ONLY]
        if odd:
            raise refusal(policy, f"this vLLM's KVCacheManager.allocate_slots{sig} takes {odd} positionally only")
        self.original = original
        self.policy = policy
        self.max_model_len = int(max_model_len)
        self._positional = [name for name, p in params.items()
                            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        nonzero = {name: p.default for name, p in params.items()
                   if name in ALLOCATE_COUNTS + ("num_lookahead_tokens",) and p.default not in (0, p.empty)}
        if nonzero:  # the hot path below takes an omitted count as 0
            raise refusal(self.policy, f"this vLLM's KVCacheManager.allocate_slots{sig} has defaults {nonzero}")
        mml = self.max_model_len
        if self.policy is Policy.STRICT:
            self._target = lambda n: mml
        elif self.policy is Policy.REQUEST:
            self._target = lambda n: min(1 << (n - 1).bit_length() if n > 1 else 1, mml)
        else:
            self._target = lambda n: min(n, mml)
        self._counts = tuple(name for name in ALLOCATE_COUNTS if name in params)
        # parameters that cannot be passed by keyword (none in vLLM 0.24/0.32)
        self._positional_only = tuple(name for name, p in params.items() if p.kind is p.POSITIONAL_ONLY)

    def __call__(self, *args, **kwargs):
        if len(args) > len(self._positional):
            return self.original(*args, **kwargs)  # vLLM says what is wrong with the call
        call = dict(zip(self._positional, args))
        if not call.keys().isdisjoint(kwargs) or ("request" not in call and "request" not in kwargs):
            return self.original(*args, **kwargs)
        call.update(kwargs)
        if not call.get("delay_cache_blocks", False):
            # (a KV-connector load that runs no step now is left alone: the
            # allocation of the step that runs the request reserves)
            n_main = call["request"].num_computed_tokens
            for name in self._counts:
                n_main += call.get(name, 0) or 0
            lookahead = call.get("num_lookahead_tokens", 0) or 0
            call["num_lookahead_tokens"] = max(lookahead, self._target(n_main + lookahead) - n_main)
        if self._positional_only:
            return self.original(*(call.pop(name) for name in self._positional_only if name in call), **call)
        return self.original(**call)

    def __repr__(self) -> str:
        return f"<DHP reservation ({self.policy.value}) around {self.original!r}>"


def reserve_on(scheduler, policy: Policy) -> ReservingAllocateSlots | None:
    """Wrap ``scheduler.kv_cache_manager.allocate_slots`` (idempotent).

    Returns the wrapper, or None for a scheduler without a KV cache (nothing
    to reserve). Raises `ReservationUnavailable` if the hook cannot be made.
    """
    from dhp_backend.vllm import compat

    policy = Policy.parse(policy)
    manager = getattr(scheduler, "kv_cache_manager", None)
    allocate = getattr(manager, "allocate_slots", None)
    if manager is None or allocate is None:
        raise refusal(policy, f"{type(scheduler).__name__} has no kv_cache_manager.allocate_slots")
    if isinstance(allocate, ReservingAllocateSlots):
        return allocate
    max_model_len = _max_model_len(scheduler)
    wrapper = ReservingAllocateSlots(allocate, policy, max_model_len)  # refuses an allocator it cannot drive
    geometry = compat.kv_cache_geometry(scheduler)
    if geometry.num_groups == 0:
        return None  # no KV cache (an encoder-only model): no pages to reserve
    if geometry.freed_windows:
        raise refusal(policy, f"this engine's KV cache manages layers of window "
                              f"{', '.join(map(str, geometry.freed_windows))} with vLLM's sliding-window "
                              "manager, which frees the pages that fall out of the window (DHP's layers ask "
                              "for full-attention management: is a layer of this model not vLLM's Attention?)")
    full = -(-max_model_len // geometry.block_size)
    if geometry.usable_blocks < full:
        # vLLM's own start-up check counts the null block in; a reservation cannot.
        raise ReservationUnavailable(
            f"DHP policy '{policy.value}': a request of max_model_len={max_model_len} tokens reserves {full} "
            f"blocks of {geometry.block_size}, but the KV cache has only {geometry.usable_blocks} usable blocks "
            f"({geometry.num_blocks} minus vLLM's null block), so no such request could ever be scheduled. "
            f"Lower --max-model-len to {geometry.usable_blocks * geometry.block_size} or less, or give the KV "
            "cache more memory.")
    manager.allocate_slots = wrapper
    return wrapper


def _max_model_len(scheduler, vllm_config=None) -> int:
    manager = getattr(scheduler, "kv_cache_manager", None)
    return int(getattr(manager, "max_model_len", 0)
               or (vllm_config if vllm_config is not None else scheduler.vllm_config).model_config.max_model_len)


def scheduler_price(scheduler, policy: Policy, vllm_config=None) -> dict | None:
    """`reservation_price` for this scheduler's KV cache, with ``"groups"`` (KV-cache groups); None
    for a scheduler without vLLM's KV-cache manager or without a KV cache."""
    from dhp_backend.vllm import compat

    if getattr(scheduler, "kv_cache_manager", None) is None:
        return None
    geometry = compat.kv_cache_geometry(scheduler)
    if geometry.num_groups == 0:
        return None
    price = reservation_price(policy, max_model_len=_max_model_len(scheduler, vllm_config),
                              block_size=geometry.block_size, num_blocks=geometry.num_blocks)
    price["groups"] = geometry.num_groups
    price["kept_windows"] = list(geometry.kept_windows)
    return price


def after_scheduler_init(scheduler, vllm_config=None) -> None:
    """Install the reservation on a freshly built scheduler if this engine needs it, and hand the
    price to this process's start-up report (`dhp_backend.vllm.report`), which is then complete here."""
    from dhp_backend.vllm import compat, report

    if vllm_config is None:
        vllm_config = getattr(scheduler, "vllm_config", None)
    if vllm_config is None or not compat.engine_runs_dhp(vllm_config):
        return
    cfg = DHPConfig.from_sources(getattr(vllm_config, "additional_config", None))
    if cfg.policy.is_constant_time:
        reserve_on(scheduler, cfg.policy)
    report.scheduler_ready(vllm_config, scheduler_price(scheduler, cfg.policy, vllm_config))


def wrap_scheduler_class(cls: type) -> None:
    """Make ``cls.__init__`` call `after_scheduler_init` when it is done (idempotent).

    vLLM builds every scheduler as ``cls(vllm_config=..., kv_cache_config=..., ...)``
    (`SchedulerInterface`); the config is taken from there, so a class that
    keeps no ``vllm_config`` attribute is still judged.
    """
    init = cls.__dict__.get("__init__") or cls.__init__  # an inherited one is shadowed, not replaced
    if getattr(init, "_dhp_reservation", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        after_scheduler_init(self, kwargs.get("vllm_config", args[0] if args else None))

    __init__._dhp_reservation = True
    cls.__init__ = __init__


def _wrap_vllm_scheduler(resolved: type | None = None) -> None:
    """vLLM's ``Scheduler`` (its subclasses ``AsyncScheduler`` & co. call its ``__init__``),
    and a ``--scheduler-cls`` class that is no subclass of it: DHP under a
    constant-time policy then refuses to start unless that class has vLLM's
    ``kv_cache_manager.allocate_slots`` to reserve through."""
    from dhp_backend.vllm import compat

    scheduler_cls = compat.scheduler_class()
    wrap_scheduler_class(scheduler_cls)
    if isinstance(resolved, type) and not issubclass(resolved, scheduler_cls):
        wrap_scheduler_class(resolved)


def install() -> None:
    """Called by the plugin's ``register()`` in every vLLM process; cheap and idempotent.

    Wraps vLLM's ``Scheduler.__init__`` now if its module is already imported,
    else when vLLM resolves the scheduler class (the engine core does it right
    after loading plugins, then builds the scheduler).
    """
    from dhp_backend.vllm import compat

    loaded = compat.loaded_scheduler_class()
    if loaded is not None:
        wrap_scheduler_class(loaded)
    try:
        compat.on_scheduler_class_resolved(_wrap_vllm_scheduler)
    except (ImportError, AttributeError, RuntimeError) as exc:  # a vLLM that resolves it elsewhere
        logger.debug("DHP: no scheduler-class hook (%s); wrapping vLLM's Scheduler now", exc)
        _wrap_vllm_scheduler()
