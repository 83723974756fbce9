"""The start-up report: one block that says what DHP does in a process, worded in one place.

What the block holds (`StartupReport`): DHP's and vLLM's versions, the policy and
its bucket, the effective settings and where they came from, the deterministic
mode; per layer kind (shape and features: soft-cap, sinks) the path, and for a
step of each kind (decode, prefill, mixed) the kernel it runs on and how that
kernel came to be (built now, found in the build cache, Triton's JIT, the
reference, and why not a csrc kernel); the CUDA-graph mode; the KV-page
reservation the policy makes, how many requests the KV cache holds at once,
and what the other policies would give (`dhp_backend.reservation_price`).

Two callers, one renderer (`render`): the engine, which collects the facts as
they arrive in each of its processes and emits one block per process
(`dhp_backend.vllm.report` says which process prints what), and
``dhp-backend info``, which plans the same things for a given shape and
configuration without starting an engine. A fact that another process knows
is not guessed: the block says whose block has it (`StartupReport.notes`).

This module imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
import os

from dhp_backend import __version__
from dhp_backend.config import DHPConfig, Policy

STEP_KINDS = ("decode", "prefill", "mixed")
# What the timing gate measured of the Triton CONST_TIME kernels on a GPU (the csrc kernels pass it
# on the cells measured): said on every constant-time step routed to them, so that a user who asked
# for constant time learns where it is not verified.
TRITON_CT_TIMING = ("its timing is NOT verified constant: the Triton CONST_TIME kernels fail the timing gate G4 "
                    "on an H200 (a short request's step slower by 0.01-0.07 %; "
                    "docs/audit/2026-11-28-timing-h200-triton.md), the csrc kernels pass it")
HEADER = "start-up report"  # every block's first line has it (tests count blocks by it)


def example_steps(max_model_len: int) -> dict[str, list[tuple[int, int]]]:
    """(context, query length) per request for a representative step of each kind, every
    request no longer than max_model_len (the strict bucket)."""
    ctx = max(0, min(1000, max_model_len - 64 if max_model_len > 64 else max_model_len - 1))
    chunk = min(512, max(1, max_model_len // 4))
    return {
        "decode": [(ctx, 1)] * 8,
        "prefill": [(0, min(2048, max_model_len))],
        "mixed": [(min(max_model_len - chunk, 2 * chunk), chunk)] + [(ctx, 1)] * 4,
    }


@dataclasses.dataclass(frozen=True)
class StepRoute:
    """Where a step of one kind runs, and how its binary came to be."""

    kernel: str  # an `ops.plan.KERNELS` name, or REFUSED / CANNOT RUN
    binary: str
    state: str


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """The layers of one shape and feature set (a `ProblemSpec`)."""

    spec: object  # dhp_backend.ops.ProblemSpec
    path: str     # PathChoice.describe()
    routes: dict  # step kind -> StepRoute
    layers: int | None = None  # how many of the model's layers; None: a shape (`dhp-backend info`)
    device_memory_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StartupReport:
    process: str       # which process this is, in words
    config: DHPConfig
    max_model_len: int
    deterministic: str  # `describe_deterministic`
    vllm: str | None = None
    layer_kinds: tuple[LayerKind, ...] | None = None  # None: another process's block has them
    cuda_graphs: str | None = None                     # `describe_cuda_graphs`; None: another process's
    reservation: dict | None = None                    # `reservation_price.reservation_price`; None: another's
    notes: tuple[str, ...] = ()  # what another process's block says instead; where a figure came from
    version: str = __version__


def describe_bucket(policy: Policy, max_model_len: int) -> str:
    if policy is Policy.STRICT:
        return f"bucket L = max_model_len = {max_model_len} (timing reveals only the step geometry)"
    if policy is Policy.REQUEST:
        return (f"bucket L = each request's next power of two, capped at max_model_len = {max_model_len} "
                "(timing may reveal the log2 of each request's length)")
    return "true lengths (not constant-time; still deterministic and batch-invariant)"


def describe_deterministic(enabled: bool, *, batch_invariant: bool | None, cpu: bool | None) -> str:
    """The deterministic mode. ``batch_invariant``: vLLM's batch-invariant mode is on; ``cpu``: vLLM runs on
    its CPU platform (None, both: not known here, as in ``dhp-backend info``)."""
    if not enabled:
        return ("off (DHP's attention is deterministic and batch-invariant under every policy; the rest of the "
                "engine is vLLM's own)")
    if cpu:
        return ("on, DHP attention only: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) does not run on "
                "CPUs, so the engine's own matmuls are not made batch-invariant by vLLM (README, 'Golden "
                "outputs', says which invariances the tests show on CPU)")
    if batch_invariant:
        return "on: DHP attention + vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)"
    return ("on: DHP attention + vLLM's batch-invariant mode, which a GPU engine needs VLLM_BATCH_INVARIANT=1 "
            "for (it refuses to start without it)")


def describe_cuda_graphs(dhp_levels: dict[str, str], vllm_mode: str | None) -> str:
    """``dhp_levels``: DHP's declared support (ALWAYS / NEVER) -> the path that decided it; ``vllm_mode``:
    the engine's resolved ``cudagraph_mode`` (None: no engine)."""
    said = {"ALWAYS": "DHP's attention can be captured in full CUDA graphs",
            "NEVER": "DHP's attention runs eagerly between captured pieces"}
    dhp = "; ".join(f"{said.get(level, level)} (declared {level}: path {path})"
                    for level, path in sorted(dhp_levels.items()))
    if vllm_mode is None:
        return f"{dhp}; the engine's mode is vLLM's (--enforce-eager: none)"
    return f"vLLM's mode {vllm_mode}; {dhp}"


def step_routes(spec, cfg: DHPConfig, max_model_len: int, builds=(), *, device=None,
                num_sms: int | None = None, unbuilt: str = "") -> dict[str, StepRoute]:
    """The kernel and binary of an example step of each kind (`example_steps`), planned as the engine
    plans it (`ops.plan.plan_step`), and how the binary came to be: ``builds`` are the libraries
    `ops.plan.prepare_kernels` built or found for this layer kind; ``unbuilt`` says what happens to a csrc
    library that is not among them (``dhp-backend info`` builds nothing)."""
    from dhp_backend.ops import bucket_for_step, plan_step
    from dhp_backend.ops.dispatch import FallbackRefused, choose_path
    from dhp_backend.ops.plan import CSRC_LIBRARY, REFERENCE, TRITON, step_route

    max_blocks = -(-max_model_len // spec.block_size)  # vLLM's block table covers max_model_len
    routes = {}
    for kind, step in example_steps(max_model_len).items():
        seq_lens = [c + q for c, q in step]
        bucket = bucket_for_step(cfg.policy, max_model_len=max_model_len, seq_lens=seq_lens,
                                 max_seq_len=max(seq_lens))
        try:
            plan = plan_step(spec, cfg.policy, num_tokens=sum(q for _, q in step), num_reqs=len(step),
                             max_blocks=max_blocks, bucket_l=bucket if isinstance(bucket, int) else None,
                             path=cfg.path, allow_fallback=cfg.allow_fallback, device=device, num_sms=num_sms)
        except FallbackRefused:
            allowed = choose_path(spec, cfg.policy, requested=cfg.path, allow_fallback=True)
            routes[kind] = StepRoute("REFUSED", "none", f"policy '{cfg.policy.value}' refuses the {allowed.name} "
                                     f"path ({allowed.reason}); the engine would not start")
            continue
        except ValueError as exc:  # a forced path that cannot run this case
            routes[kind] = StepRoute("CANNOT RUN", "none", f"forced path '{cfg.path}' cannot run this case: {exc}")
            continue
        if plan.kernel == REFERENCE:
            state = "nothing to build"
        elif plan.kernel == TRITON:
            state = "Triton's JIT (compiled at its first launch, kept in Triton's cache)"
            if cfg.path == TRITON:
                state += "; not a csrc kernel: the setting path=triton keeps every step on Triton"
            else:
                state += "; not a csrc kernel: " + step_route(spec, cfg.policy, plan.num_tokens, plan.num_reqs)[1]
            if cfg.policy is not Policy.OFF and spec.device_type == "cuda":
                state += "; " + TRITON_CT_TIMING
        else:
            source = CSRC_LIBRARY[plan.kernel][1]
            built = next((b for b in builds if b.source == source), None)
            if built is None:
                state = unbuilt or f"csrc/{source}: not built in this process"
            elif built.state == "cached":
                state = f"found in the build cache ({built.path})"
            else:
                state = f"{built.state} now in {built.seconds:.1f} s ({built.why})"
        routes[kind] = StepRoute(plan.kernel, plan.binary(), state)
    return routes


def _shape(spec) -> str:
    return (f"{spec.num_heads} query heads / {spec.num_kv_heads} KV heads, head size {spec.head_size}, block size "
            f"{spec.block_size}, {spec.dtype} on {spec.device_type}"
            + (f" (sm_{spec.device_capability[0]}{spec.device_capability[1]})" if spec.device_capability else ""))


def render(report: StartupReport) -> str:
    """The block, one line per fact (a multi-line log record in the engine; stdout in ``dhp-backend info``)."""
    # here, not at the top: dhp_backend.ops (under reservation_price) imports torch, which this module need not
    from dhp_backend.reservation_price import price_lines

    cfg = report.config
    vllm = f"vLLM {report.vllm}" if report.vllm else "vLLM not installed"
    lines = [f"DHP {report.version} {HEADER} ({vllm}; {report.process})",
             f"  policy: {cfg.policy.value}; {describe_bucket(cfg.policy, report.max_model_len)}",
             f"  settings: {cfg.describe()}",
             f"  deterministic mode: {report.deterministic}"]
    for kind in report.layer_kinds or ():
        spec = kind.spec
        count = "layers" if kind.layers is None else f"{kind.layers} layer{'s' if kind.layers != 1 else ''}"
        features = ", ".join(spec.features) or "none"
        lines.append(f"  {count}: {_shape(spec)}; features: {features}")
        lines.append(f"    path: {kind.path}")
        if kind.device_memory_bytes:
            lines.append(f"    device memory held beyond the KV cache: {kind.device_memory_bytes / 2**20:.1f} MiB")
        for step in STEP_KINDS:
            r = kind.routes[step]
            lines.append(f"    {step + ' steps:':15} {r.kernel}: {r.binary}; {r.state}")
    if report.cuda_graphs is not None:
        lines.append(f"  CUDA graphs: {report.cuda_graphs}")
    if report.reservation is not None:
        lines.extend(f"  {line}" for line in price_lines(report.reservation))
    lines.extend(f"  {line}" for line in report.notes)
    return "\n".join(lines)


def process_label(role: str) -> str:
    return f"pid {os.getpid()}, {role}"
