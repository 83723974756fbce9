"""The vLLM adapter: backend class, metadata, builder and per-layer impl.

It translates vLLM's per-step metadata into a plan of the step
(`dhp_backend.ops.plan_step`, once per step in the metadata builder, from the
step's public geometry) that every layer's ``forward`` runs (`dhp_backend.ops.run`),
and knows nothing of kernel internals. Version differences live in
`dhp_backend.vllm.compat`.

KV cache convention (both versions, see compat.kv_cache_layouts): each layer's
cache is a contiguous ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
tensor; the ``block_size * 2 * head_size`` run of one (block, kv head) holds the
block's K page (``[block_size, head_size]``) followed by its V page. This is
the page split CPU_ATTN uses too (CPU_ATTN orders elements inside its K page
for its SIMD ISA, so the two backends do not share cache bytes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from dhp_backend import __version__
from dhp_backend.config import KV_CACHE_DTYPES, DHPConfig, Policy
from dhp_backend.ops import (
    ProblemSpec,
    StepPlan,
    bucket_for_step,
    choose_path,
    graph_capturable,
    new_deal_step,
    plan_step,
    prepare_kernels,
    prepare_path,
    run,
)
from dhp_backend.ops.attention import check_sinks, check_sliding_window, check_soft_cap
from dhp_backend.ops.validation import check_values
from dhp_backend.vllm import compat, report

logger = logging.getLogger("dhp_backend")

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[num_blocks, num_kv_heads, block_size, head_size]`` of a layer's cache."""
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    if width != 2 * head_size:
        raise ValueError(
            f"DHP: KV cache of shape {tuple(kv_cache.shape)} does not hold K and V of head size "
            f"{head_size} (expected last dimension {2 * head_size})"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(
            f"DHP: KV cache with strides {kv_cache.stride()} is not in the LBHNC layout DHP "
            "declares; do not force another layout with VLLM_KV_CACHE_LAYOUT"
        )
    pages = kv_cache.view(num_blocks, num_kv_heads, 2, block_size, head_size)
    return pages[:, :, 0], pages[:, :, 1]


class DHPAttentionBackend(AttentionBackend):
    """Constant-time, deterministic, batch-invariant paged attention."""

    # The engine writes K/V through `do_kv_cache_update` before `forward`.
    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # Resolved with AttentionBackendEnum[...] in every worker; the alias
        # exists wherever our plugin ran, and we make sure of it here too.
        compat.install_alias()
        return compat.ALIAS

    @staticmethod
    def get_impl_cls() -> type[DHPAttentionImpl]:
        return DHPAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DHPMetadataBuilder]:
        return DHPMetadataBuilder

    # --- KV-cache layout: both APIs, one memory layout (see compat) ---------
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def supported_kv_cache_layouts(cls):
        return compat.kv_cache_layouts()

    @classmethod
    def get_required_kv_cache_layout(cls):  # 0.24: we need no global layout string
        return None

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The reference path takes any block size; the kernels' own limits are
        # applied by the dispatcher, which refuses or falls back explicitly.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any; the dispatcher decides kernel vs. reference

    # --- honest capability declarations ------------------------------------
    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # the promise: per-request bits independent of the batch

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # gpt-oss's attention sinks: every implementation of ops.paged_attention

    @classmethod
    def supports_sliding_window(cls) -> bool:
        # Per layer (vLLM hands the impl its window). Under a constant-time policy the
        # layer's KV cache is managed as full attention (`compat.manage_windowed_kv_as_full`).
        return True

    # The logits soft-cap has no hook: vLLM hands it to the impl, which accepts it.

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def is_mla(cls) -> bool:
        return False


@dataclasses.dataclass
class DHPMetadata:
    """What one step's attention needs; tensors are the runner's own buffers.

    ``plan`` is the step's plan for the group's layer shape: public values only,
    no tensors, so a CUDA graph captured with it replays correctly for every step
    of the same geometry (whose tensors are refilled in place)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    policy: Policy
    bucket: int | torch.Tensor | None
    max_model_len: int
    plan: StepPlan
    # The step's identity for the decode dealing's table (ops.plan.run's deal_step): the step's layers
    # share one table, made by the first launch that needs it (a captured graph makes its own).
    deal_step: int | None = None


def _problem_spec(*, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                  dtype: torch.dtype, logits_soft_cap: float | None = None, sinks: bool = False,
                  sliding_window: int | None = None) -> ProblemSpec:
    """The static problem of one attention layer on this process's platform (the
    features are the layer's; a KV-cache group's spec has none, see ``forward``)."""
    from vllm.platforms import current_platform

    device_type = current_platform.device_type
    cap = None
    if device_type == "cuda":
        c = current_platform.get_device_capability()
        cap = (c.major, c.minor) if c is not None else None
    return ProblemSpec(device_type=device_type, dtype=_DTYPE_NAMES.get(dtype, str(dtype)),
                       head_size=head_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       block_size=block_size, causal=True, device_capability=cap,
                       logits_soft_cap=logits_soft_cap, sinks=sinks, sliding_window=sliding_window)


def _group_spec(vllm_config: VllmConfig, kv_cache_spec) -> ProblemSpec:
    """The problem of the layers of one KV-cache group (their shared cache spec and the model's query heads)."""
    return _problem_spec(
        num_heads=vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config),
        num_kv_heads=kv_cache_spec.num_kv_heads, head_size=kv_cache_spec.head_size,
        block_size=kv_cache_spec.block_size, dtype=kv_cache_spec.dtype)


class DHPMetadataBuilder(AttentionMetadataBuilder[DHPMetadata]):
    # The real level depends on policy and path: see get_cudagraph_support.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """ALWAYS (full graphs of any mix of prefills and decodes) when the chosen
        path reads every length from device memory and the bucket does not change
        between steps; NEVER otherwise (vLLM then runs attention eagerly between
        captured pieces). See `dhp_backend.ops.graph_capturable`."""
        try:
            cfg = DHPConfig.from_sources(vllm_config.additional_config)
            spec = _group_spec(vllm_config, kv_cache_spec)
            # what would run (a refused fallback is reported by the impl at start-up)
            choice = choose_path(spec, cfg.policy, requested=cfg.path, allow_fallback=True)
        except Exception as exc:  # never fail graph planning over a question we can't answer
            logger.warning("DHP: CUDA-graph support unknown (%s); declaring NEVER", exc)
            return AttentionCGSupport.NEVER
        level = AttentionCGSupport.ALWAYS if graph_capturable(choice, cfg.policy) else AttentionCGSupport.NEVER
        report.record_cuda_graphs(level.name, choice.name)
        return level

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.dhp_config = DHPConfig.from_sources(vllm_config.additional_config)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.spec = _group_spec(vllm_config, kv_cache_spec)
        # Per-request buckets live in one persistent buffer, refilled in place each
        # step: a CUDA graph replays the addresses it captured.
        self._request_buckets = None
        if self.dhp_config.policy is Policy.REQUEST:
            max_reqs = int(getattr(vllm_config.scheduler_config, "max_num_seqs", 0) or 256)
            self._request_buckets = torch.empty(max_reqs, dtype=torch.int32, device=device)
        report.worker_ready(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DHPMetadata:
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor):
            raise NotImplementedError("DHP: per-request causal flags (drafter metadata) are not supported")
        policy = self.dhp_config.policy
        out = self._request_buckets
        if out is not None and out.shape[0] < cm.seq_lens.shape[0]:  # more requests than planned for
            out = self._request_buckets = torch.empty(cm.seq_lens.shape[0], dtype=torch.int32,
                                                      device=cm.seq_lens.device)
        bucket = bucket_for_step(policy, max_model_len=self.max_model_len,
                                 seq_lens=cm.seq_lens, max_seq_len=cm.max_seq_len, out=out)
        # One plan for every layer of the step, from its public geometry (a refused
        # fallback already stopped the engine in the impl's constructor).
        plan = plan_step(self.spec, policy, num_tokens=cm.num_actual_tokens, num_reqs=cm.seq_lens.shape[0],
                         max_blocks=cm.block_table_tensor.shape[1],
                         bucket_l=bucket if isinstance(bucket, int) else None, path=self.dhp_config.path,
                         allow_fallback=self.dhp_config.allow_fallback, device=self.device)
        return DHPMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=bool(cm.causal),
            policy=policy,
            bucket=bucket,
            max_model_len=self.max_model_len,
            plan=plan,
            deal_step=new_deal_step(),
        )


_LOGGED: set[tuple] = set()
_LOG_LOCK = threading.Lock()


def _once(key: tuple, fn) -> None:
    if key in _LOGGED:  # every forward passes here: no lock once logged
        return
    with _LOG_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    fn()


def _trace(path: str | None, event: dict) -> None:
    """Append one JSON line to the setting ``trace_file`` (tests use it to prove DHP ran)."""
    if not path:
        return
    event = {"pid": os.getpid(), "dhp_version": __version__, **event}
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


class DHPAttentionImpl(AttentionImpl[DHPMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        max_model_len = model_config.max_model_len if model_config is not None else None
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi slopes")
        # vLLM's two spellings of "no cap" are None and 0 (the seam's check maps both to None
        # and names a bad cap).
        logits_soft_cap = check_soft_cap(logits_soft_cap)
        # The layer's window: vLLM 0.24 and 0.32 hand an int W (per layer, or the model's
        # `sliding_window`) or None. The seam's check is the one place that decides what is
        # no window (None, -1, a W >= max_model_len) and names a bad one.
        sliding_window = check_sliding_window(sliding_window, max_model_len)
        sinks = extra_impl_args.pop("sinks", None)
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type!r} (only decoder self-attention)")
        if kv_cache_dtype not in DHPAttentionBackend.supported_kv_cache_dtypes:
            unsupported.append(f"KV-cache dtype {kv_cache_dtype!r} (accepted: "
                               f"{DHPAttentionBackend.supported_kv_cache_dtypes})")
        for name, value in extra_impl_args.items():
            if value is not None and value is not False:
                unsupported.append(f"{name}={value!r}")
        if unsupported:
            raise NotImplementedError("DHP attention backend does not support: " + "; ".join(unsupported))

        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # gpt-oss's sink logits: a parameter of the layer, filled when the weights
        # load (after this constructor), so only its shape is checked here and its
        # dtype and device at the first forward (`_check_sinks`).
        self.sinks = sinks
        self.logits_soft_cap = logits_soft_cap
        self.sliding_window = sliding_window
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)):
            raise NotImplementedError(
                f"DHP: attention sinks of {type(sinks).__name__} "
                f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else ''}; accepted: a [num_heads] = "
                f"[{num_heads}] tensor")
        self._sinks_checked = sinks is None
        self._sinks_f32: torch.Tensor | None = None
        self._sinks_f32_key: tuple | None = None

        self.dhp_config = DHPConfig.from_sources(vllm_config.additional_config)
        dtype = model_config.dtype if model_config is not None else torch.float16
        self.spec = _problem_spec(num_heads=num_heads, num_kv_heads=self.num_kv_heads, head_size=head_size,
                                  block_size=int(vllm_config.cache_config.block_size), dtype=dtype,
                                  logits_soft_cap=logits_soft_cap, sinks=sinks is not None,
                                  sliding_window=sliding_window)
        if self.dhp_config.check_values and self.spec.device_type == "cuda":
            compat.mark_worker_warmup()  # 0.24's warm-up requests are not the scheduler's (_check_step)
        if self.dhp_config.policy.is_constant_time:
            # The kernels read every page up to the bucket, out-of-window ones too: vLLM
            # must keep them (the address rule), not free them as it does for windows.
            compat.manage_windowed_kv_as_full(_kv_kept_in_full)
        # Decided once, at start-up: a refused fallback stops the engine here
        # with the reason, not mid-request.
        self.path_choice = choose_path(self.spec, self.dhp_config.policy,
                                       requested=self.dhp_config.path,
                                       allow_fallback=self.dhp_config.allow_fallback)
        # Whatever the path needs on the device is allocated now, before vLLM
        # profiles memory and captures graphs (never per step).
        device = (torch.device("cuda", torch.cuda.current_device()) if self.spec.device_type == "cuda"
                  else torch.device(self.spec.device_type))
        self.reserved_bytes = prepare_path(self.path_choice, device)
        # The csrc kernels this layer can route to are built (or found in the cache) now, visibly, not
        # inside the first CUDA-graph capture.
        builds = prepare_kernels(self.spec, self.dhp_config.path)
        self._cache_update_op = compat.kv_cache_update_op(self.spec.device_type)
        report.record_layer(self.spec, self.path_choice, self.reserved_bytes, builds)
        if self.dhp_config.policy is Policy.STRICT and vllm_config.cache_config.enable_prefix_caching:
            _once(("prefix-caching",), lambda: logger.warning(
                "DHP policy 'strict': prefix caching is on. The scheduler skips the compute of "
                "cached prefixes, which is a timing signal outside the attention kernel "
                "(disable with --no-enable-prefix-caching for full constant time)."))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None, *args, **kwargs):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("DHP: fused output quantisation is not supported")
        if attn_metadata is None or kv_cache.numel() == 0:
            # Profiling / dummy runs: nothing to attend to; keep the output defined.
            return output.zero_()
        md: DHPMetadata = attn_metadata
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        out3 = output.view(output.shape[0], self.num_heads, self.head_size)
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        plan = md.plan
        if not self._sinks_checked:
            self._check_sinks(query)
        if plan.spec != self.spec:
            # A layer whose shape differs from its KV-cache group's (query heads, dtype) or that
            # has a soft-cap, sinks or a window (the group's plan has none): its own plan, cached per geometry.
            plan = plan_step(self.spec, md.policy, num_tokens=plan.num_tokens, num_reqs=plan.num_reqs,
                             max_blocks=md.block_table.shape[1], bucket_l=plan.l_scalar or None,
                             path=self.dhp_config.path, allow_fallback=self.dhp_config.allow_fallback,
                             device=query.device)
        if self.dhp_config.check_values:
            _check_step(md, key_cache)
        run(plan, q3, key_cache, value_cache, md.block_table, md.query_start_loc, md.seq_lens, out3,
            scale=self.scale, causal=md.causal, bucket=md.bucket, sinks=self._sinks_for_kernels(),
            sliding_window=self.sliding_window, deal_step=md.deal_step)
        # once per setting (a process may run several engines: each its trace file) and window
        _once(("forward", self.path_choice.name, self.dhp_config, self.sliding_window), lambda: _trace(
            self.dhp_config.trace_file, {
                "event": "forward", "backend": "DHP", "path": self.path_choice.name,
                "policy": md.policy.value, "device": str(query.device),
                "dtype": str(query.dtype), "head_size": self.head_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "block_size": key_cache.shape[2], "sliding_window": self.sliding_window}))
        if plan.path.name == "triton":
            # Which kernel ran the step (the csrc kernels where they apply), once per kind.
            _once(("kernel", plan.kernel, self.dhp_config), lambda: _trace(self.dhp_config.trace_file, {
                "event": "kernel", "backend": "DHP", "path": plan.path.name, "kernel": plan.kernel,
                "policy": md.policy.value}))
        return output

    def _sinks_for_kernels(self) -> torch.Tensor | None:
        """The sinks in float32, converted once per weight version: the csrc kernels take float32 sinks and
        would convert a bf16 parameter (gpt-oss) at every launch, one more kernel per layer and step (in the
        CUDA graph too). bf16 / fp16 to float32 is exact, so every path gives the bits it gives with the
        parameter itself. A parameter updated in place (its version counter moves) or moved is converted
        again."""
        s = self.sinks
        if s is None or s.dtype == torch.float32:
            return s
        key = (s.data_ptr(), s.device, s.dtype, s._version)
        if key != self._sinks_f32_key:
            self._sinks_f32 = s.detach().to(torch.float32).contiguous()
            self._sinks_f32_key = key
        return self._sinks_f32

    def _check_sinks(self, query: torch.Tensor) -> None:
        """The sinks' dtype and device, once the weights are loaded: what the seam
        accepts (float32 or the model dtype, on the query's device, contiguous)."""
        try:
            check_sinks(self.sinks, self.num_heads, query.dtype, query.device)
        except ValueError as exc:
            raise NotImplementedError(f"DHP: {exc}") from None
        self._sinks_checked = True

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Scatter this step's K/V into their slots; slot -1 (padding) is skipped."""
        if kv_cache.numel() == 0:
            return
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        if self._cache_update_op is not None:
            # vLLM's op wants [blocks, slots, heads, head] and honours strides.
            self._cache_update_op(key, value, key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                                  slot_mapping, self.kv_cache_dtype, layer._k_scale, layer._v_scale)
            return
        n = slot_mapping.shape[0]
        slots = slot_mapping[:n]
        valid = slots >= 0
        slots = slots[valid]
        block_size = key_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, :, offsets] = key[:n][valid].to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value[:n][valid].to(value_cache.dtype)


def _kv_kept_in_full(layer) -> bool:
    """Whether vLLM must keep every KV page of this attention layer (asked of windowed layers):
    a DHP layer under a constant-time policy, whose kernels walk the whole bucket."""
    impl = getattr(layer, "impl", None)
    return isinstance(impl, DHPAttentionImpl) and impl.dhp_config.policy.is_constant_time


def _check_step(md: DHPMetadata, key_cache: torch.Tensor) -> None:
    """The setting check_values (a debugging aid that syncs every step). vLLM's dummy
    runs (memory profiling, kernel warm-up, CUDA-graph capture) hand in tables of
    nothing but block 0, its null block, which no request is ever given, and 0.24's
    worker warm-up runs made-up requests the scheduler never reserved for
    (`compat.in_worker_warmup`); only real steps are checked against the address rule."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    if compat.in_worker_warmup():
        return
    n = md.seq_lens.shape[0]
    if bool((md.block_table[:n] != 0).any()):
        check_values(md.query_start_loc, md.seq_lens, md.block_table, md.bucket, md.num_actual_tokens,
                     key_cache.shape[0], key_cache.shape[2])
