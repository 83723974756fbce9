"""Plan once, run many: one step's implementation, kernel, binary and launch geometry.

`plan_step` decides, from the public step geometry only, everything a step of
`ops.paged_attention` runs on: the path (`dispatch.choose_path`: the constant-time
Triton kernels or the reference, with the policy's refusal of a fallback), the
kernel the Triton path runs the step on (the Triton kernels or a csrc Hopper
kernel, `step_kernel`), its binary, and its grid and split geometry
(`geometry.triton_geometry`; the csrc decode kernel's variant, split mode,
schedule). `run` executes a `StepPlan` on the step's tensors.

The inputs are public (design.md section 2): the layer's `ProblemSpec`, the
policy, ``num_tokens`` and the number of requests, the block table's width, the
bucket's mode (one L, per-request buckets, true lengths) and under one L its
value, and the device's SM count. So a plan is the same for every step of the same
geometry, and every layer of a step shares it: the vLLM adapter plans once per
step in its metadata builder and each layer's ``forward`` runs the plan. A plan
holds no tensors: under CUDA-graph capture the plan of the captured step is the
plan of every replay of that graph (same geometry), while the tensors it reads
are the runner's persistent buffers, refilled in place.

`ops.paged_attention` (the seam for callers outside vLLM) validates its
arguments, plans (cached per geometry) and runs, on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

import torch

from dhp_backend.config import Policy
from dhp_backend.ops import cuda_build, dispatch, geometry
from dhp_backend.ops.dispatch import PathChoice, ProblemSpec

logger = logging.getLogger("dhp_backend")

REFERENCE = dispatch.REFERENCE
TRITON = dispatch.TRITON
CUDA_PREFILL = "cuda_prefill"        # policy off, prefill and mixed steps: csrc/prefill_sm90.cu, v2 binary
CUDA_PREFILL_CT = "cuda_prefill_ct"  # strict/request, prefill and mixed steps: v2_ct binary
CUDA_DECODE = "cuda_decode"          # policy off, decode steps: csrc/decode_sm90.cu
CUDA_DECODE_CT = "cuda_decode_ct"    # strict/request, decode steps: its constant-time binaries
KERNELS = (REFERENCE, TRITON, CUDA_PREFILL, CUDA_PREFILL_CT, CUDA_DECODE, CUDA_DECODE_CT)
# The csrc library (`cuda_build`) each csrc kernel's binaries live in.
CSRC_LIBRARY = {CUDA_DECODE: cuda_build.DECODE_LIBRARY, CUDA_DECODE_CT: cuda_build.DECODE_LIBRARY,
                CUDA_PREFILL: cuda_build.PREFILL_LIBRARY, CUDA_PREFILL_CT: cuda_build.PREFILL_LIBRARY}

_BUCKET_MODES = {geometry.SCALAR_BUCKET: "one bucket L", geometry.PER_REQUEST_BUCKETS: "per-request buckets",
                 geometry.TRUE_LENGTHS: "true lengths"}


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """The csrc decode kernel's launch (`cuda_decode.decode_sm90`'s choices, made here once)."""

    variant: str
    split: bool        # split states to the workspace and a merge, else fold mode
    n_split_grid: int
    spp: int           # split mode's splits per CTA
    longest_first: bool  # fold mode's longest-first schedule (policy off only)
    # Split mode's dealing from the true lengths (policy off; cuda_decode.ROUTE_DEALT, `dealable`): the
    # slots and CTA cost its model deals over, 0 for the fixed dealing. `run` deals only for a step
    # whose layers share the dealing's table (``deal_step``).
    deal_slots: int = 0
    deal_cost: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How one step of one layer shape runs; public values only, no tensors."""

    spec: ProblemSpec
    policy: Policy
    path: PathChoice           # reference or triton, and why
    kernel: str                # one of KERNELS
    num_tokens: int
    num_reqs: int
    capacity: int              # block_table.shape[1] * block_size: the table's reach
    bucket_mode: int           # geometry.SCALAR_BUCKET | PER_REQUEST_BUCKETS | TRUE_LENGTHS
    l_scalar: int              # the bucket L under SCALAR_BUCKET, else 0
    triton: geometry.TritonGeometry | None = None  # kernel == triton, a step with tokens and requests
    decode: DecodeLaunch | None = None             # kernel cuda_decode[_ct], planned on the GPU
    prefill_variant: str | None = None             # kernel cuda_prefill[_ct]

    @property
    def constant_time(self) -> bool:
        return self.path.constant_time and self.policy.is_constant_time

    def binary(self) -> str:
        """The binary the step runs, in words."""
        if self.kernel == REFERENCE:
            return "PyTorch reference (ops/reference.py)" + "".join(f", {f}" for f in self.spec.features)
        if self.kernel == TRITON:
            ct = "CONST_TIME" if self.policy.is_constant_time else "policy-off"
            if self.triton is None:
                ct += "".join(f", {f}" for f in self.spec.features)
                return f"Triton attention_kernel, {ct} (no launch: the step has no tokens or requests)"
            c = self.triton.cfg
            ct += "".join(f", {f}" for f in self.spec.features)
            return (f"Triton attention_kernel, {ct}, {self.triton.kind} tile (BLOCK_M {c.block_m}, BLOCK_Q "
                    f"{c.block_q}, BLOCK_N {c.block_n}, {c.num_warps} warps, {c.num_stages} stages)"
                    + (" + merge_kernel" if self.triton.split else ""))
        features = "".join(f", {f}" for f in self.spec.features)
        if self.kernel in (CUDA_PREFILL, CUDA_PREFILL_CT):
            return f"csrc/prefill_sm90.cu{self._library(cuda_build.PREFILL_LIBRARY)}, {self.prefill_variant} " \
                   f"binary{features}"
        ct = " (constant-time walk)" if self.kernel == CUDA_DECODE_CT else ""
        variant = self.decode.variant if self.decode else "variant chosen on the GPU"
        return f"csrc/decode_sm90.cu{self._library(cuda_build.DECODE_LIBRARY)}, {variant}{ct}{features}"

    def _library(self, library: tuple[str, str]) -> str:
        """" (library <name>)" where the layer's csrc library is not the plain one (a feature library or one of
        another head size, cuda_build.feature_library), else ""."""
        from dhp_backend.ops import cuda_common

        name = cuda_build.feature_library(library, **cuda_common.spec_features(self.spec))[0]
        return "" if name == library[0] else f" (library {name})"

    def launch(self) -> dict:
        """The grid and split geometry the plan fixed (empty where the kernel decides inside)."""
        if self.triton is not None:
            g = self.triton
            return {"grid": list(g.grid(self.spec.num_kv_heads)), "tiling": "token" if g.token_tiles else "request",
                    "splits": g.n_split_grid, "split_mode": "split" if g.split else "fold",
                    "splits_per_program": g.spp, "extent": g.ext_grid}
        if self.decode is not None:
            d = self.decode
            return {"ctas": [self.num_tokens, self.spec.num_kv_heads], "splits": d.n_split_grid,
                    "split_mode": "split" if d.split else "fold", "splits_per_cta": d.spp,
                    "longest_first": d.longest_first,
                    "dealing": "from the true lengths, once a step" if d.deal_slots else "fixed"}
        return {}

    def describe(self) -> str:
        launch = ", ".join(f"{k} {v}" for k, v in self.launch().items())
        bucket = _BUCKET_MODES[self.bucket_mode] + (f" = {self.l_scalar}" if self.l_scalar else "")
        return (f"{self.kernel}: {self.binary()}; {self.num_tokens} tokens, {self.num_reqs} requests, {bucket}"
                + (f"; {launch}" if launch else ""))


def plan_step(spec: ProblemSpec, policy: Policy | str, *, num_tokens: int, num_reqs: int, max_blocks: int,
              bucket_l: int | None = None, path: str = "auto", allow_fallback: bool = False,
              device: torch.device | None = None, num_sms: int | None = None) -> StepPlan:
    """The plan of a step of ``spec`` under ``policy`` (raises `dispatch.FallbackRefused`
    or ValueError as `dispatch.choose_path` does).

    ``max_blocks``: the block table's width (``block_table.shape[1]``). ``bucket_l``:
    the step's one bucket L when the bucket is an int (strict; request given one
    int), None for per-request buckets and under ``off``. ``num_sms``: the device's
    SM count (default: of ``device``, or of the current device of ``spec``'s type).
    """
    policy = Policy.parse(policy)
    if num_sms is None:
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if spec.device_type == "cuda"
                      else torch.device(spec.device_type))
        num_sms = geometry.num_sms_of(device)
    index = device.index if device is not None and device.type == "cuda" else None
    return _plan(spec, policy, int(num_tokens), int(num_reqs), int(max_blocks),
                 None if bucket_l is None else int(bucket_l), path, allow_fallback, int(num_sms), index)


@functools.lru_cache(maxsize=4096)
def _plan(spec, policy, num_tokens, num_reqs, max_blocks, bucket_l, path, allow_fallback, num_sms,
          device_index) -> StepPlan:
    if policy is Policy.OFF:
        if bucket_l is not None:
            raise ValueError(f"plan_step: bucket_l is {bucket_l}; accepted: None under policy 'off' "
                             "(true lengths are used)")
        mode = geometry.TRUE_LENGTHS
    else:
        mode = geometry.PER_REQUEST_BUCKETS if bucket_l is None else geometry.SCALAR_BUCKET
    choice = _choose_path(spec, policy, path, allow_fallback)
    kernel = choice.name
    if path == "auto" and choice.name == TRITON:
        kernel = step_kernel(spec, policy, num_tokens, num_reqs)
    capacity = max_blocks * spec.block_size
    plan = StepPlan(spec=spec, policy=policy, path=choice, kernel=kernel, num_tokens=num_tokens, num_reqs=num_reqs,
                    capacity=capacity, bucket_mode=mode, l_scalar=bucket_l or 0)
    if kernel == TRITON and num_tokens and num_reqs:
        return dataclasses.replace(plan, triton=geometry.triton_geometry(
            num_tokens=num_tokens, num_reqs=num_reqs, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size, dtype_name=spec.dtype, const_time=policy.is_constant_time, l_mode=mode,
            l_scalar=bucket_l or 0, capacity=capacity, num_sms=num_sms))
    if kernel in (CUDA_PREFILL, CUDA_PREFILL_CT):
        from dhp_backend.ops.cuda_prefill import V2, V2_CT

        return dataclasses.replace(plan, prefill_variant=V2_CT if kernel == CUDA_PREFILL_CT else V2)
    if kernel in (CUDA_DECODE, CUDA_DECODE_CT) and torch.cuda.is_available():
        return dataclasses.replace(plan, decode=_decode_launch(plan, device_index))
    return plan


def _decode_launch(plan: StepPlan, device_index: int | None) -> DecodeLaunch:
    """What `cuda_decode.decode_sm90` picks by itself for this step (same functions,
    same inputs, on the step's device), fixed once per step."""
    from dhp_backend.ops import cuda_common, cuda_decode

    spec, n, reqs = plan.spec, plan.num_tokens, plan.num_reqs
    ct = plan.kernel == CUDA_DECODE_CT
    with torch.cuda.device(torch.cuda.current_device() if device_index is None else device_index):
        if ct:
            variant = cuda_decode.CT_DEFAULT_VARIANT
        else:
            variant = cuda_decode.pick_variant(n, reqs, spec.num_heads, spec.num_kv_heads, plan.capacity, spec.dtype,
                                               None)
        ext_grid = plan.l_scalar if ct and plan.bucket_mode == geometry.SCALAR_BUCKET else plan.capacity
        p = cuda_decode.plan(n, reqs, spec.num_heads, spec.num_kv_heads, ext_grid, spec.dtype, variant, None,
                             head=spec.head_size)
        longest = not ct and cuda_decode.longest_first(p, n, spec.num_kv_heads)
        deal_slots, deal_cost = 0, 0.0
        if cuda_decode.ROUTE_DEALT and cuda_decode.dealable(
                p, ct, None, n, reqs, cuda_decode._deal_max_reqs(**cuda_common.spec_features(spec))):
            deal_slots, deal_cost = p["slots"], geometry.CTA_COST_IN_SPLITS
    return DecodeLaunch(variant=variant, split=p["split"], n_split_grid=p["n_split_grid"], spp=p["spp"],
                        longest_first=bool(longest), deal_slots=deal_slots, deal_cost=deal_cost)


_deal_steps = itertools.count(1)


def new_deal_step() -> int:
    """A new step identity for `run`'s ``deal_step`` (the vLLM adapter's metadata builder: one a step)."""
    return next(_deal_steps)


@functools.lru_cache(maxsize=None)
def _choose_path(spec, policy, requested, allow_fallback) -> PathChoice:
    # (the engine says which path each layer kind takes in its start-up report, dhp_backend/startup_report.py)
    return dispatch.choose_path(spec, policy, requested=requested, allow_fallback=allow_fallback)


def clear_caches() -> None:
    """Forget the cached plans, path choices and csrc routes (tests that change
    what a plan depends on: TRITON_INTERPRET, nvcc on the PATH)."""
    _plan.cache_clear()
    _choose_path.cache_clear()
    _cuda_routes.cache_clear()
    _PREPARED.clear()


_PREPARED: dict = {}


def prepare_kernels(spec: ProblemSpec, requested: str = "auto") -> list:
    """Once per (layer geometry, requested path) and process: every layer of a model shares the answer."""
    key = (spec, requested)
    if key not in _PREPARED:
        _PREPARED[key] = _prepare_kernels(spec, requested)
    return _PREPARED[key]


def _prepare_kernels(spec: ProblemSpec, requested: str) -> list:
    """Build (or find in the cache) the csrc libraries this layer's steps can route to, now: at engine
    start-up, before vLLM profiles memory and captures CUDA graphs, so the first step never waits for nvcc
    inside a capture. A build logs itself as it happens (`cuda_build`); where each step kind runs and
    whether its library was built now or found in the cache is the start-up report's
    (`dhp_backend.startup_report`, from the returned builds). A library that fails to build is refused to
    every route for this process (`cuda_common.mark_build_failed`), and so is the other library: the
    layer's every step runs on the Triton kernels (a layer never mixes families), and the failure is
    logged once with nvcc's message. No nvcc: nothing is
    built and the routes say why (`cuda_common.common_route_refusal`). Returns the builds."""
    from dhp_backend.ops import cuda_common

    if spec.device_type != "cuda" or requested == TRITON or requested == REFERENCE:
        return []
    wanted = []
    for kind, library in CSRC_LIBRARY.items():
        if library not in wanted and _cuda_routes(spec, kind)[0]:
            wanted.append(library)
    built = []
    for library in wanted:
        try:  # a layer with a window, a soft-cap or sinks: its feature library (cuda_build.feature_library)
            b = cuda_build.build(*cuda_build.feature_library(library, **cuda_common.spec_features(spec)))
        except cuda_build.CudaBuildError as e:
            cuda_common.mark_build_failed(library[1], str(e).splitlines()[0])
            _cuda_routes.cache_clear()
            _plan.cache_clear()
            logger.error("DHP: csrc/%s failed to build; every step of these layers runs on the Triton kernels: %s",
                         library[1], e)
            break  # the other library would be refused too
        built.append(b)
    return built


@functools.lru_cache(maxsize=None)
def _cuda_routes(spec, kind: str) -> tuple[bool, str]:
    """Whether steps of ``kind`` (a csrc kernel) of ``spec`` may run on it, and why (not)."""
    if kind == CUDA_PREFILL:
        from dhp_backend.ops.cuda_prefill import routes_prefill as routes
    elif kind == CUDA_PREFILL_CT:
        from dhp_backend.ops.cuda_prefill import routes_prefill_ct as routes
    elif kind == CUDA_DECODE_CT:
        from dhp_backend.ops.cuda_decode import routes_decode_ct as routes
    else:
        from dhp_backend.ops.cuda_decode import routes_decode as routes
    return routes(spec)


def step_kernel(spec: ProblemSpec, policy: Policy | str, num_tokens: int, num_reqs: int) -> str:
    """Which kernel the Triton path (path ``auto``) runs a step on, from the public
    step geometry. A layer runs **every** step on one family of kernels:

    - the csrc Hopper kernels, where both take the layer (`cuda_prefill.routes_prefill`,
      `cuda_decode.routes_decode`: sm_90, head size 256, 128, 96, 80 or 64, at most
      `cuda_common.CSRC_MAX_GROUP` query heads per KV head, nvcc; sliding windows,
      soft-caps and sinks on their feature libraries): decode steps (the launcher's
      token tiles, `geometry.decode_step`) on
      ``cuda_decode`` (``cuda_decode_ct`` under strict / request), prefill and mixed
      steps on ``cuda_prefill`` (``cuda_prefill_ct``);
    - else the Triton kernels (``triton``) for every step.

    The csrc kernels share one arithmetic (docs/kernels.md section 7), the Triton
    kernels another: a row's bits are the same whatever step kind, batch or policy
    computed it within a family (GPU tests), and a layer never mixes families, so
    batch invariance holds across steps. Which family runs a layer depends on its
    public configuration and the device only, not on the step."""
    return step_route(spec, policy, num_tokens, num_reqs)[0]


def layer_family(spec: ProblemSpec) -> tuple[bool, str]:
    """Whether ``spec``'s layers run on the csrc kernels (every step), and why (not)."""
    if spec.device_type != "cuda":
        return False, "the csrc kernels run on CUDA devices only"
    # (windows, soft-caps and sinks run on the csrc feature libraries, cuda_build.feature_library.)
    for kind in (CUDA_PREFILL, CUDA_DECODE):
        ok, why = _cuda_routes(spec, kind)
        if not ok:
            return False, why
    return True, "the csrc kernels take every step of this layer"


def step_route(spec: ProblemSpec, policy: Policy | str, num_tokens: int, num_reqs: int) -> tuple[str, str]:
    """`step_kernel`'s answer and why, in words (the start-up report and ``dhp-backend info`` print it)."""
    ok, why = layer_family(spec)
    if not ok:
        return TRITON, why
    group = spec.num_heads // max(1, spec.num_kv_heads)
    decode = geometry.step_kind(num_tokens, num_reqs) != "prefill" and geometry.decode_step(
        num_tokens, num_reqs, head_size=spec.head_size, group=group, dtype_name=spec.dtype)
    ct = Policy.parse(policy) is not Policy.OFF
    kind = (CUDA_DECODE_CT if ct else CUDA_DECODE) if decode else (CUDA_PREFILL_CT if ct else CUDA_PREFILL)
    ok, why = _cuda_routes(spec, kind)
    return (kind, why) if ok else (TRITON, why)


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def run(plan: StepPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
        scale: float, causal: bool, bucket: int | torch.Tensor | None,
        sinks: torch.Tensor | None = None, sliding_window: int | None = None,
        deal_step: int | None = None) -> torch.Tensor:
    """Run ``plan`` on one step's tensors (the layouts of `ops.paged_attention`);
    writes ``out[:plan.num_tokens]`` and returns ``out``. The logits soft-cap is
    the plan's (``plan.spec.logits_soft_cap``); ``sinks`` (``[num_heads]``) must be
    given exactly when ``plan.spec.sinks``; ``sliding_window`` must be the plan's
    ``spec.sliding_window`` (both normalised by `ops.attention.check_sliding_window`).
    ``deal_step`` (`new_deal_step`, one per step's metadata): the step's launches share one dealing
    table, so a policy-off split-mode decode launch the plan deals (``plan.decode.deal_slots``) takes
    the dealt schedule, its first launch making the table (`cuda_decode.decode_sm90`); None keeps the
    fixed dealing (a single launch would make the table each time: `ops.paged_attention`).

    Checks that the tensors have the geometry the plan was made for (cheap: shapes,
    dtype, device type, the bucket's kind; no device values are read) and raises
    ValueError naming the difference otherwise. The values themselves are the
    caller's to check (`validation.check_values`, or ``ops.paged_attention``'s
    ``check_values``).
    """
    _check_plan_fits(plan, query, key_cache, block_table, seq_lens, out, bucket)
    if (sinks is not None) != plan.spec.sinks:
        raise ValueError(f"plan.run: sinks is {'a tensor' if sinks is not None else 'None'}; accepted: "
                         f"{'a [num_heads] tensor' if plan.spec.sinks else 'None'}, as the plan was made for "
                         f"(ProblemSpec.sinks = {plan.spec.sinks})")
    if sliding_window != plan.spec.sliding_window:
        raise ValueError(f"plan.run: sliding_window is {sliding_window!r}; accepted: {plan.spec.sliding_window!r}, "
                         "the ProblemSpec.sliding_window the plan was made for (normalise the model's window once "
                         "with ops.attention.check_sliding_window and pass the result to both)")
    if sliding_window is not None and not causal:
        raise ValueError(f"plan.run: causal is False with sliding_window {sliding_window}; accepted: causal=True "
                         "for a windowed layer (the window is the causal lower bound)")
    args = (query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out)
    n, kernel = plan.num_tokens, plan.kernel
    features = dict(logits_soft_cap=plan.spec.logits_soft_cap, sinks=sinks, sliding_window=sliding_window)
    if kernel == REFERENCE:
        from dhp_backend.ops.reference import paged_attention_reference

        return paged_attention_reference(*args, scale=scale, causal=causal, policy=plan.policy, bucket=bucket,
                                         num_tokens=n, **features)
    if kernel == TRITON:
        from dhp_backend.ops.triton.launch import launch

        return launch(plan.triton, *args, scale=scale, causal=causal, num_tokens=n, policy=plan.policy,
                      bucket=bucket, **features)
    csrc_features = dict(sliding_window=sliding_window, logits_soft_cap=plan.spec.logits_soft_cap or None,
                         sinks=sinks)
    if kernel in (CUDA_PREFILL, CUDA_PREFILL_CT):
        from dhp_backend.ops.cuda_prefill import prefill_sm90

        # policy off walks the true lengths; a constant-time policy's public bucket is the walk's extent
        return prefill_sm90(*args, scale=scale, causal=causal, num_tokens=n, variant=plan.prefill_variant,
                            bucket=bucket if kernel == CUDA_PREFILL_CT else None, check=False, **csrc_features)
    from dhp_backend.ops.cuda_decode import decode_sm90

    launch_args = {}
    if plan.decode is not None:
        d = plan.decode
        launch_args = dict(variant=d.variant, mode="split" if d.split else "fold", order=d.longest_first,
                           spp=d.spp if d.split else None)
        if d.deal_slots and deal_step is not None:  # (the plan's spp is decode_sm90's own: not forced)
            launch_args.update(spp=None, deal=d.deal_slots, deal_cost=d.deal_cost, deal_step=deal_step)
    return decode_sm90(*args, scale=scale, causal=causal, num_tokens=n,
                       bucket=bucket if kernel == CUDA_DECODE_CT else None, check=False, **launch_args,
                       **csrc_features)


def _check_plan_fits(plan: StepPlan, query, key_cache, block_table, seq_lens, out, bucket) -> None:
    spec = plan.spec
    facts = (
        ("query's device type", query.device.type, spec.device_type),
        ("query's dtype", query.dtype, _DTYPES.get(spec.dtype)),
        ("query's heads and head size", tuple(query.shape[1:]), (spec.num_heads, spec.head_size)),
        ("key_cache's KV heads and block size", tuple(key_cache.shape[1:3]), (spec.num_kv_heads, spec.block_size)),
        ("the number of requests (seq_lens)", seq_lens.shape[0], plan.num_reqs),
        ("block_table.shape[1] * block_size", block_table.shape[1] * key_cache.shape[2], plan.capacity),
    )
    for what, got, planned in facts:
        if got != planned:
            raise ValueError(f"plan.run: {what} is {got}; accepted: {planned}, the step geometry the plan was "
                             "made for (plan the step with ops.plan.plan_step)")
    if query.shape[0] < plan.num_tokens or out.shape[0] < plan.num_tokens:
        raise ValueError(f"plan.run: query/out of {query.shape[0]}/{out.shape[0]} rows; accepted: at least the "
                         f"plan's num_tokens = {plan.num_tokens}")
    mode = (geometry.TRUE_LENGTHS if bucket is None else
            geometry.PER_REQUEST_BUCKETS if isinstance(bucket, torch.Tensor) else geometry.SCALAR_BUCKET)
    if mode != plan.bucket_mode or (mode == geometry.SCALAR_BUCKET and int(bucket) != plan.l_scalar):
        got = "a per-request tensor" if mode == geometry.PER_REQUEST_BUCKETS else repr(bucket)
        want = _BUCKET_MODES[plan.bucket_mode] + (f" = {plan.l_scalar}" if plan.l_scalar else "")
        raise ValueError(f"plan.run: bucket is {got}; accepted: {want}, as the plan was made for")
