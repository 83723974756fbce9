"""Which implementation runs a given problem, and why.

A *path* is one implementation of `ops.paged_attention`. Each declares whether
it is constant-time; under a constant-time policy a path that is not is refused
unless the user explicitly allowed the fallback. The choice depends only on the
problem's static shape (dtype, head size, block size, heads, device), so it is
made once per layer at start-up and logged; the per-step part of the choice
(which kernel and binary run the step) is `dhp_backend.ops.plan`'s.
"""

from __future__ import annotations

import dataclasses
import logging

from dhp_backend.config import Policy

logger = logging.getLogger("dhp_backend")

REFERENCE = "reference"
TRITON = "triton"
PATHS = (REFERENCE, TRITON)  # the forced-path choices besides "auto"


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """Static (public) description of an attention problem."""

    device_type: str  # "cuda" or "cpu"
    dtype: str  # "float16" | "bfloat16" | "float32"
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    causal: bool = True
    device_capability: tuple[int, int] | None = None  # CUDA only
    # The model's attention features (public model configuration, one value per layer):
    logits_soft_cap: float | None = None  # cap * tanh(s / cap) on the scaled scores (Gemma-2)
    sinks: bool = False  # a per-head learned logit in the softmax denominator (gpt-oss)
    # Query position i sees keys j with i - W < j <= i (Mistral, Gemma-2/3, gpt-oss); None: no window.
    # A window >= max_model_len is no window: `ops.attention.check_sliding_window` normalises it to None.
    sliding_window: int | None = None

    def __post_init__(self):
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"ProblemSpec: sliding_window is {w!r}; accepted: None (no window) or an int >= 1 "
                             "(ops.attention.check_sliding_window validates and normalises a model's value)")
        if w is not None and not self.causal:
            raise ValueError(f"ProblemSpec: sliding_window is {w} with causal=False; accepted: a window on causal "
                             "attention only (None for non-causal layers)")

    @property
    def features(self) -> tuple[str, ...]:
        """The attention features beyond plain causal GQA this layer uses, in words."""
        return ((f"logits soft-cap {self.logits_soft_cap:g}",) if self.logits_soft_cap else ()) + (
            ("attention sinks",) if self.sinks else ()) + (
            (f"sliding window {self.sliding_window}",) if self.sliding_window else ())

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class PathChoice:
    name: str
    constant_time: bool
    reason: str  # why this path (and why not the better one)

    def describe(self) -> str:
        ct = "constant-time capable" if self.constant_time else "NOT constant-time"
        return f"{self.name} ({ct}): {self.reason}"


class FallbackRefused(ValueError):
    """A constant-time policy would have to run a path that is not constant-time."""


def _triton_supports(spec: ProblemSpec) -> tuple[bool, str]:
    from dhp_backend.ops import triton as triton_pkg  # cheap: no Triton import

    return triton_pkg.supports(spec)


def choose_path(
    spec: ProblemSpec,
    policy: Policy | str,
    *,
    requested: str = "auto",
    allow_fallback: bool = False,
) -> PathChoice:
    """Pick the path for ``spec``; raise `FallbackRefused` or `ValueError` with the reason."""
    policy = Policy.parse(policy)
    if requested not in ("auto", REFERENCE, TRITON):
        raise ValueError(f"path: unknown path {requested!r}; accepted: 'auto', 'reference', 'triton'")

    ok, why_not = _triton_supports(spec)
    if requested == TRITON:
        if not ok:
            raise ValueError(f"path='triton' was requested but the Triton kernels do not cover this problem: {why_not}")
        return PathChoice(TRITON, True, "requested explicitly")
    if requested == "auto" and ok:
        # The family's name is Triton's (the setting path=triton forces those kernels), but under "auto" each
        # step is routed further (plan.step_kernel): to a csrc Hopper kernel where one applies. Said here, since
        # readers of a start-up report or a trace took "triton" for the kernel that ran.
        return PathChoice(TRITON, True, "shape covered by the GPU kernels: each step runs a csrc Hopper kernel "
                                        "where one applies (sm_90 with nvcc), else the constant-time Triton "
                                        "kernel; the step lines (start-up report) and 'kernel' events (trace) "
                                        "name it")

    reason = "requested explicitly" if requested == REFERENCE else f"fallback: {why_not}"
    choice = PathChoice(REFERENCE, False, reason)
    if policy.is_constant_time and not allow_fallback:
        raise FallbackRefused(
            f"DHP policy '{policy.value}' promises constant-time attention, but this problem "
            f"({_describe_spec(spec)}) would run the PyTorch reference path, which is not "
            f"constant-time ({reason}). Either use a supported shape, choose policy 'off', or "
            "accept the fallback explicitly with --additional-config "
            "'{\"dhp\": {\"allow_fallback\": true}}' (or DHP_ALLOW_FALLBACK=1)."
        )
    return choice


def _describe_spec(spec: ProblemSpec) -> str:
    return (
        f"{spec.device_type}, {spec.dtype}, head_size={spec.head_size}, heads={spec.num_heads}/"
        f"{spec.num_kv_heads} kv, block_size={spec.block_size}, causal={spec.causal}"
        + "".join(f", {f}" for f in spec.features)
    )


def graph_capturable(choice: PathChoice, policy: Policy | str) -> bool:
    """Whether a launch on ``choice`` can be captured in a CUDA graph and replayed.

    The Triton path reads every length from device memory and sizes its grid
    from the step geometry and the bucket; under ``strict`` the bucket is a
    constant, under ``request``/``off`` it lives on the device. The reference
    path reads lengths on the host (a sync): never.
    """
    Policy.parse(policy)
    return choice.name == TRITON


def prepare_path(choice: PathChoice, device) -> int:
    """Allocate, now, whatever ``choice`` needs on ``device``; return the bytes held.

    Called at start-up (before vLLM's memory profiling and graph capture), so
    nothing is allocated per step and the engine sizes its KV cache around it.
    """
    if choice.name == TRITON and getattr(device, "type", str(device)) == "cuda":
        from dhp_backend.ops import workspace

        workspace.reserve_workspace(device)
        return workspace.WORKSPACE_BYTES
    return 0
