"""The implementations timed side by side: vLLM's attention backends' kernels, a dense ceiling, DHP.

Each anchor is an object with

- ``available()``: None, or why it cannot run at all in this process (import
  error, no GPU); asked once;
- ``prepare(case, sets)``: its native cache layout and any planning, outside the
  timed region; raises `NotAvailable` (or anything) for a shape it does not take;
- ``run(i)``: one launch on input set ``i``, returning its output;
  ``packed(i, result)`` turns that into ``[num_tokens, Hq, d]`` for the check;
- ``release()``: drops what ``prepare`` built (one anchor's copy of the cache at a time);
- ``features``: the model features (`cases.Case.features`) it passes to its
  kernel; a case with any other feature is refused in ``prepare`` with
  `NotAvailable` (``feature_gap`` says why), so no anchor ever times the plain
  computation in place of a featured step.

The signatures follow the sources of vLLM 0.24 (``vllm/vllm_flash_attn/
flash_attn_interface.py``, ``vllm/v1/attention/ops/triton_unified_attention.py``,
``vllm/v1/attention/backends/{flash_attn,triton_attn,flashinfer}.py``) and
FlashInfer 0.6.12 (``decode.py``, ``prefill.py``); each anchor is called as the
vLLM backend that uses it calls it.
"""

from __future__ import annotations

import importlib
import time

import torch

TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


class NotAvailable(Exception):
    """The anchor cannot run this case; the message says why (it becomes the row's status)."""


def _imported(module: str, *names: str):
    """(the module's attributes ``names``, or the module; None), or (None, why it is absent here).

    Any failure counts as "absent" (a missing package, a CUDA build mismatch, a
    renamed function): the anchor's row says why instead of the run crashing."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        return None, f"{module} does not import: {type(exc).__name__}: {exc}"
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        return None, f"{module} has no {', '.join(missing)} (another version?)"
    return (tuple(getattr(mod, n) for n in names) if names else mod), None


def _cuda_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA GPU (this run is on {device.type})"
    return None


def nhd_cache(kv: torch.Tensor, head_size: int) -> torch.Tensor:
    """DHP's ``[blocks, Hkv, block, 2d]`` as vLLM's FLASH_ATTN/TRITON_ATTN cache
    ``[blocks, 2, block, Hkv, d]`` (K = ``[:, 0]``, V = ``[:, 1]``), a copy."""
    nb, hkv, bs, _ = kv.shape
    return kv.view(nb, hkv, bs, 2, head_size).permute(0, 3, 2, 1, 4).contiguous()


def hnd_cache(kv: torch.Tensor, head_size: int) -> torch.Tensor:
    """DHP's cache as vLLM's FLASHINFER cache in HND order ``[blocks, 2, Hkv, block, d]``, a copy."""
    nb, hkv, bs, _ = kv.shape
    return kv.view(nb, hkv, bs, 2, head_size).permute(0, 3, 1, 2, 4).contiguous()


ALL_FEATURES = frozenset({"sliding_window", "logits_soft_cap", "sinks"})


class Anchor:
    name = ""
    label = ""
    graphable = True  # may be captured in a CUDA graph for decode shapes
    features: frozenset = frozenset()  # the model features `run` applies (see the module docstring)
    feature_gap = "this anchor passes no model features to its kernel"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.case = None
        self.sets = None
        self.outs = None
        self.notes: list[str] = []

    def available(self) -> str | None:
        return _cuda_reason(self.device)

    def prepare(self, case, sets) -> None:
        self.notes = []  # first: a refused case's row must not carry the previous case's notes
        missing = [f for f in case.features if f not in self.features]
        if missing:
            raise NotAvailable(f"{' and '.join(missing)}: {self.feature_gap}")
        self.case, self.sets = case, sets
        self.outs = [torch.empty_like(s.query) for s in sets]

    def run(self, i: int):
        raise NotImplementedError

    def packed(self, i: int, result) -> torch.Tensor:
        return result

    def info(self) -> dict:
        """Extra fields for the row (path, bucket...)."""
        return {}

    def release(self) -> None:
        self.case = self.sets = self.outs = None

    @property
    def scale(self) -> float:
        return self.case.head_size ** -0.5


def window_size(case) -> tuple[int, int]:
    """FlashAttention's (left, right) for the case, as vLLM's FLASH_ATTN and TRITON_ATTN
    backends set it for a decoder layer: ``(W - 1, 0)`` (row i sees keys i - W < k <= i)."""
    return (-1, -1) if case.sliding_window is None else (case.sliding_window - 1, 0)


class FlashAttention3(Anchor):
    """FA3 with every feature, as vLLM 0.24's FLASH_ATTN backend passes them: ``window_size``,
    ``softcap`` (0 = none) and the sinks as ``s_aux`` (FA3 takes them in bf16 only, as
    gpt-oss's parameter is; `inputs.build_set` draws bf16-exact values)."""

    name = "fa3"
    label = "FlashAttention-3 (vllm.vllm_flash_attn, fa_version=3)"
    features = ALL_FEATURES

    def available(self) -> str | None:
        why = _cuda_reason(self.device)
        if why:
            return why
        fns, why = _imported("vllm.vllm_flash_attn", "flash_attn_varlen_func")
        unsupported, why2 = _imported("vllm.vllm_flash_attn.flash_attn_interface", "fa_version_unsupported_reason")
        if why or why2:
            return why or why2
        # The default version is FA2, which this vLLM build may lack; ask for FA3 explicitly.
        why = unsupported[0](3)
        if why:
            return why
        self.fn = fns[0]
        return None

    def prepare(self, case, sets) -> None:
        super().prepare(case, sets)
        self.caches = [nhd_cache(s.kv, case.head_size) for s in sets]
        # Only the features the case has: a plain case makes the very call it always made.
        self.feature_args = []
        for s in sets:
            kw = {}
            if case.sliding_window is not None:
                kw["window_size"] = list(window_size(case))
            if case.logits_soft_cap:
                kw["softcap"] = case.logits_soft_cap
            if s.sinks is not None:
                kw["s_aux"] = s.sinks.to(torch.bfloat16)
            self.feature_args.append(kw)

    def run(self, i: int):
        s, kv, c = self.sets[i], self.caches[i], self.case
        # As vllm/v1/attention/backends/flash_attn.py calls it (kv_cache.unbind(1)).
        return self.fn(q=s.query, k=kv[:, 0], v=kv[:, 1], out=self.outs[i], cu_seqlens_q=s.query_start_loc,
                       max_seqlen_q=c.max_q_len, seqused_k=s.seq_lens, max_seqlen_k=c.max_seq_len,
                       softmax_scale=self.scale, causal=c.causal, block_table=s.block_table, fa_version=3,
                       **self.feature_args[i])

    def release(self) -> None:
        super().release()
        self.caches = self.feature_args = None


class FlashInfer(Anchor):
    """Paged decode wrapper (tensor cores, as vLLM) for decode steps, paged prefill wrapper otherwise."""

    name = "flashinfer"
    label = "FlashInfer (BatchDecode/BatchPrefillWithPagedKVCacheWrapper, HND)"
    feature_gap = ("not wired in this harness: FlashInfer JIT-compiles a kernel per window/soft-cap variant "
                   "(minutes each on a fresh machine), and vLLM 0.24's FLASHINFER backend takes sinks only "
                   "through TRT-LLM on SM100; FA3 is the features family's anchor")
    WORKSPACE_BYTES = 394 * 2**20  # vLLM 0.24's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE default

    def __init__(self, device) -> None:
        super().__init__(device)
        self.workspace = None
        self.planned: set = set()

    def available(self) -> str | None:
        why = _cuda_reason(self.device)
        if why:
            return why
        self.fi, why = _imported("flashinfer")
        if why:
            return why
        self.version = getattr(self.fi, "__version__", None)
        return None

    @staticmethod
    def pages(case, s):
        """(indptr on the host, page indices on the device, last-page lengths on the host)."""
        bs = case.block_size
        n = [-(-x // bs) for x in case.seq_lens]
        indptr = torch.tensor([0] + n, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        need = torch.tensor(n, device=s.block_table.device).unsqueeze(1)
        cols = torch.arange(s.block_table.shape[1], device=s.block_table.device).unsqueeze(0)
        indices = s.block_table[cols < need].contiguous()  # row-major: request 0's pages, then 1's...
        last = torch.tensor([(x - 1) % bs + 1 for x in case.seq_lens], dtype=torch.int32)
        return indptr, indices, last

    def prepare(self, case, sets) -> None:
        super().prepare(case, sets)
        c, fi = case, self.fi
        dt = sets[0].query.dtype
        if self.workspace is None:
            self.workspace = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        decode = c.kind == "decode"
        key = (decode, str(dt), c.head_size, c.num_heads // c.num_kv_heads, c.causal)
        if key not in self.planned:
            print(f"    flashinfer: first {'decode' if decode else 'prefill'} plan for {dt} head {c.head_size}: "
                  "FlashInfer JIT-compiles its kernels on first use (cached on disk afterwards); "
                  "this can take minutes ...", flush=True)
        t = time.time()
        self.caches = [hnd_cache(s.kv, c.head_size) for s in sets]
        self.wrappers = []
        common = {"num_qo_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "page_size": c.block_size,
                  "q_data_type": dt, "kv_data_type": dt, "o_data_type": dt, "sm_scale": self.scale}
        for s in sets:
            indptr, indices, last = self.pages(c, s)
            if decode:
                w = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="HND", use_tensor_cores=True)
                w.plan(indptr=indptr, indices=indices, last_page_len=last, head_dim=c.head_size, **common)
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="HND")
                w.plan(qo_indptr=s.query_start_loc.cpu(), paged_kv_indptr=indptr, paged_kv_indices=indices,
                       paged_kv_last_page_len=last, head_dim_qk=c.head_size, causal=c.causal, **common)
            self.wrappers.append(w)
        if key not in self.planned:
            self.planned.add(key)
            print(f"    flashinfer: planned in {time.time() - t:.1f} s", flush=True)
        self.notes.append("decode wrapper, use_tensor_cores=True" if decode else
                          f"prefill wrapper, backend {getattr(self.wrappers[0], '_backend', '?')}")

    def run(self, i: int):
        kv = self.caches[i]
        return self.wrappers[i].run(self.sets[i].query, (kv[:, 0], kv[:, 1]), out=self.outs[i])

    def release(self) -> None:
        super().release()
        self.caches = self.wrappers = None


class TritonUnified(Anchor):
    """vLLM's TRITON_ATTN kernel, with the 3D (split) path for small decode batches as the backend sets it up."""

    name = "triton_unified"
    label = "vLLM Triton unified_attention"
    features = ALL_FEATURES

    def available(self) -> str | None:
        why = _cuda_reason(self.device)
        if why:
            return why
        fns, why = _imported("vllm.v1.attention.ops.triton_unified_attention", "unified_attention")
        if why:
            return why
        self.fn = fns[0]
        try:
            from vllm.v1.attention.backends.triton_attn import (
                MIN_LAUNCH_GRID_SIZE_2D,
                NUM_PAR_SOFTMAX_SEGMENTS,
            )
        except Exception:  # noqa: BLE001 - the values of vLLM 0.24
            MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS = 128, 16
        self.min_grid, self.segments = MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS
        return None

    def prepare(self, case, sets) -> None:
        super().prepare(case, sets)
        c = case
        self.caches = [nhd_cache(s.kv, c.head_size) for s in sets]
        # As TritonAttentionMetadataBuilder (eager: no capture sizes to snap to).
        self.threshold = self.min_grid // c.num_kv_heads
        hp = 1 << (c.head_size - 1).bit_length()
        f32 = {"dtype": torch.float32, "device": self.device}
        self.segm_out = torch.empty(self.threshold, c.num_heads, self.segments, hp, **f32)
        self.segm_max = torch.empty(self.threshold, c.num_heads, self.segments, **f32)
        self.segm_expsum = torch.empty(self.threshold, c.num_heads, self.segments, **f32)
        # k/v descale as the backend passes them (layer._k_scale expanded); read only for fp8 caches.
        self.descale = torch.ones(1, **f32).expand(c.num_reqs, c.num_kv_heads)
        use_3d = c.kind == "decode" and c.num_reqs <= self.threshold
        self.notes.append(f"{'3D (split softmax)' if use_3d else '2D'} kernel; seq_threshold_3D {self.threshold}")

    def run(self, i: int):
        s, kv, c = self.sets[i], self.caches[i], self.case
        self.fn(q=s.query, k=kv[:, 0], v=kv[:, 1], out=self.outs[i], cu_seqlens_q=s.query_start_loc,
                max_seqlen_q=c.max_q_len, seqused_k=s.seq_lens, max_seqlen_k=c.max_seq_len,
                softmax_scale=self.scale, causal=c.causal, window_size=window_size(c), block_table=s.block_table,
                softcap=c.logits_soft_cap or 0, q_descale=None, k_descale=self.descale, v_descale=self.descale,
                seq_threshold_3D=self.threshold, num_par_softmax_segments=self.segments,
                softmax_segm_output=self.segm_out, softmax_segm_max=self.segm_max,
                softmax_segm_expsum=self.segm_expsum, sinks=s.sinks)
        return self.outs[i]

    def release(self) -> None:
        super().release()
        self.caches = self.segm_out = self.segm_max = self.segm_expsum = self.descale = None


class SdpaCudnn(Anchor):
    """torch SDPA, cuDNN backend, on dense K/V gathered outside the timed region: a ceiling, not a paged kernel.

    Requests with the same (query length, total length) form one dense batch.
    Decode groups run as non-causal attention of the G query heads of each KV
    head (no K/V expansion, exact for one query token); prefill groups use
    ``enable_gqa`` where cuDNN takes it, else K/V with repeated heads; a chunk
    with cached context gets an explicit bottom-right causal mask.
    """

    name = "sdpa_cudnn"
    label = "torch SDPA, cuDNN backend, dense K/V"
    feature_gap = ("torch's scaled_dot_product_attention has no soft-cap or sinks argument, and this dense "
                   "ceiling builds no window masks")

    def available(self) -> str | None:
        why = _cuda_reason(self.device)
        if why:
            return why
        fns, why = _imported("torch.nn.attention", "SDPBackend", "sdpa_kernel")
        if why:
            return why
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available to torch"
        self.backend, self.sdpa_kernel = fns[0].CUDNN_ATTENTION, fns[1]
        return None

    @staticmethod
    def groups(case) -> list[tuple[int, int, int, int]]:
        """(first request, count, q_len, seq_len) for runs of equal shapes."""
        out: list[list[int]] = []
        for r, (q, s) in enumerate(zip(case.q_lens, case.seq_lens)):
            if out and out[-1][2:] == [q, s]:
                out[-1][1] += 1
            else:
                out.append([r, 1, q, s])
        return [tuple(g) for g in out]

    def _dense(self, c, s, group, expand: bool):
        from dhp_backend.ops.reference import gather_request_kv

        r0, n, q_len, seq_len = group
        G = c.num_heads // c.num_kv_heads
        # Filled request by request: a stack of gathered copies would hold the dense K/V twice.
        k = s.query.new_empty(n, c.num_kv_heads, seq_len, c.head_size)
        v = torch.empty_like(k)
        for j, r in enumerate(range(r0, r0 + n)):
            k[j] = gather_request_kv(s.key_cache, s.block_table[r], seq_len)
            v[j] = gather_request_kv(s.value_cache, s.block_table[r], seq_len)
        t0 = int(s.query_start_loc[r0])
        q = s.query[t0:t0 + n * q_len].view(n, q_len, c.num_heads, c.head_size)
        kw: dict = {}
        if q_len == 1:
            q = q.view(n, c.num_kv_heads, G, c.head_size).contiguous()
        else:
            q = q.transpose(1, 2).contiguous()  # [n, Hq, q_len, d]
            if G > 1 and expand:
                k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
            elif G > 1:
                kw["enable_gqa"] = True
            if c.causal and q_len == seq_len:
                kw["is_causal"] = True
            elif c.causal:
                i = torch.arange(q_len, device=q.device).unsqueeze(1)
                p = torch.arange(seq_len, device=q.device).unsqueeze(0)
                kw["attn_mask"] = p <= (seq_len - q_len) + i
        return q, k, v, kw

    def prepare(self, case, sets) -> None:
        super().prepare(case, sets)
        self.outs = None
        self.group_shapes = self.groups(case)
        self.inputs = [[self._dense(case, s, g, False) for g in self.group_shapes] for s in sets]
        gqa_prefill = case.num_heads != case.num_kv_heads and any(g[2] > 1 for g in self.group_shapes)
        try:
            self.run(0)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except RuntimeError as exc:
            if not gqa_prefill:
                raise
            # cuDNN may refuse enable_gqa: repeat the K/V heads instead (more bytes read: noted).
            self.inputs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.inputs = [[self._dense(case, s, g, True) for g in self.group_shapes] for s in sets]
            self.notes.append(f"K/V heads repeated (enable_gqa refused: {str(exc).splitlines()[0][:120]})")
        else:
            if gqa_prefill:
                self.notes.append("enable_gqa")

    def run(self, i: int):
        F = torch.nn.functional
        with self.sdpa_kernel(self.backend):
            return [F.scaled_dot_product_attention(q, k, v, scale=self.scale, **kw) for q, k, v, kw in self.inputs[i]]

    def packed(self, i: int, result) -> torch.Tensor:
        c = self.case
        parts = []
        for (_, n, q_len, _), o in zip(self.group_shapes, result):
            if q_len == 1:  # [n, Hkv, G, d]: query head h = kv_head * G + g
                parts.append(o.reshape(n, c.num_heads, c.head_size))
            else:  # [n, Hq, q_len, d]
                parts.append(o.transpose(1, 2).reshape(n * q_len, c.num_heads, c.head_size))
        return torch.cat(parts)

    def release(self) -> None:
        super().release()
        self.inputs = None


class DHP(Anchor):
    """DHP through `ops.paged_attention` under one policy (the Triton path; the reference path on a CPU
    without the interpreter)."""

    features = ALL_FEATURES

    def __init__(self, device, policy: str) -> None:
        super().__init__(device)
        self.policy = policy
        self.name = f"dhp_{policy}"
        self.label = f"DHP, policy {policy}"
        self.graphable = True

    def available(self) -> str | None:
        return _imported("dhp_backend.ops", "paged_attention")[1]

    def prepare(self, case, sets) -> None:
        from dhp_backend.ops import ProblemSpec, bucket_for_step
        from dhp_backend.ops import triton as triton_pkg

        super().prepare(case, sets)
        c = case
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        spec = ProblemSpec(device_type=self.device.type, dtype=c.dtype, head_size=c.head_size,
                           num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, block_size=c.block_size,
                           causal=c.causal, device_capability=cap, logits_soft_cap=c.logits_soft_cap,
                           sinks=c.sinks, sliding_window=c.sliding_window)
        ok, why = triton_pkg.supports(spec)
        if ok:
            # path auto = what vLLM runs: the Triton kernels, and for policy-off
            # prefill steps the csrc kernel's Triton-bit-compatible binary.
            from dhp_backend.ops.plan import step_kernel

            self.path = "auto"
            self.kernel = step_kernel(spec, self.policy, c.num_tokens, len(sets[0].seq_lens))
        elif self.device.type == "cpu":
            # The Triton path runs on a CPU only under the interpreter (TRITON_INTERPRET=1
            # set before triton is imported); the reference path keeps the pipeline honest.
            self.path = "reference"
            self.notes.append(f"reference path (not constant-time, host loop): {why}")
        else:
            raise NotAvailable(f"the Triton path does not cover this shape: {why}")
        self.buckets = [bucket_for_step(self.policy, max_model_len=c.max_model_len, seq_lens=s.seq_lens)
                        for s in sets]
        self.check_values = True  # the first launch (the correctness check) validates the values too

    def run(self, i: int):
        from dhp_backend.ops import paged_attention

        s, c = self.sets[i], self.case
        check, self.check_values = self.check_values, False
        return paged_attention(s.query, s.key_cache, s.value_cache, s.block_table, s.query_start_loc, s.seq_lens,
                               self.outs[i], scale=self.scale, causal=c.causal, policy=self.policy,
                               bucket=self.buckets[i], max_model_len=c.max_model_len, num_tokens=c.num_tokens,
                               path=self.path, allow_fallback=self.path == "reference", check_values=check,
                               logits_soft_cap=c.logits_soft_cap, sinks=s.sinks, sliding_window=c.sliding_window)

    def info(self) -> dict:
        b = self.buckets[0] if self.buckets else None
        if isinstance(b, torch.Tensor):
            vals = sorted(set(b.tolist()))
            b = vals[0] if len(vals) == 1 else vals
        return {"path": self.path, "kernel": getattr(self, "kernel", self.path), "policy": self.policy, "bucket": b}

    def release(self) -> None:
        super().release()
        self.buckets = None


POLICIES = ("off", "strict", "request")
ANCHOR_NAMES = ("fa3", "flashinfer", "triton_unified", "sdpa_cudnn") + tuple(f"dhp_{p}" for p in POLICIES)


def make_anchors(device: torch.device, names=None) -> list[Anchor]:
    """The anchors by name, in the table's order (default: all)."""
    names = list(names or ANCHOR_NAMES)
    unknown = [n for n in names if n not in ANCHOR_NAMES]
    if unknown:
        raise ValueError(f"unknown anchor(s) {unknown}; accepted: {', '.join(ANCHOR_NAMES)}")
    ctor = {"fa3": FlashAttention3, "flashinfer": FlashInfer, "triton_unified": TritonUnified,
            "sdpa_cudnn": SdpaCudnn}
    out = []
    for n in ANCHOR_NAMES:
        if n in names:
            out.append(DHP(device, n[4:]) if n.startswith("dhp_") else ctor[n](device))
    return out
