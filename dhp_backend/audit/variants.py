"""Every kernel specialization the dispatcher can launch, and compiling one for sm_90 on a CPU.

A Triton kernel compiles to one binary per distinct (constexpr values, argument
specialization). For `attention_kernel` the constexprs come from
``config.kernel_config(head_size, group, dtype)`` plus the block size and
causal flag (launch.py); for `merge_kernel` from (group, head size) plus the
output dtype. Runtime ints marked ``do_not_specialize`` (everything that follows
the batch) create no variants. The ints that *are* specialised (strides, and
``num_heads``) get Triton's "divisible by 16" attribute when they are: strides
are multiples of 16 for every covered head size, but ``num_heads`` is a model
fact (32 -> divisible, 12 -> not), so it is an axis of its own (``nh16``). An
int argument equal to 1 would become a constexpr too; no stride or head count
of a covered shape is 1 except ``num_heads`` of a single-head model (not covered
by the enumeration; noted in the report).

GQA groups: 1, 2, 4, 8 by default; other groups (3, 5, 7, 16...) are other
binaries (``--groups``).
"""

from __future__ import annotations

import dataclasses
import os
import re

from dhp_backend.ops import tiles as kcfg

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
DEFAULT_GROUPS = (1, 2, 4, 8)
MERGE_UNROLL = 8  # launch.MERGE_UNROLL (launch imports torch; this module must not)
MERGE_WARPS = 4


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str
    head: int
    group: int
    block_size: int | None = None  # attention only
    causal: bool | None = None  # attention only
    nh16: bool = True  # num_heads % 16 == 0
    split: bool = False  # attention only: WRITE_PARTIALS (split mode) binary
    kind: str = "mixed"  # attention only: the step kind's tile config (config.STEP_KINDS)
    const_time: bool = True  # attention only: False = the policy-off binary (CONST_TIME constexpr)
    softcap: float = 0.0  # attention only: the SOFTCAP constexpr (a model's logits soft-cap; 0 = none)
    sinks: bool = False  # HAS_SINKS: the attention-sink binaries (attention fold mode, merge)
    window: int = 0  # attention only: the WINDOW constexpr (a model's sliding window; 0 = none)

    @property
    def key(self) -> str:
        k = f"{self.kernel}:{DTYPES[self.dtype]}:h{self.head}:g{self.group}"
        if self.kernel == "attention_kernel":
            k += (f":bs{self.block_size}:{'causal' if self.causal else 'noncausal'}"
                  f":{'split' if self.split else 'fold'}:{self.kind}{'' if self.const_time else ':off'}")
            k += f":cap{self.softcap:g}" if self.softcap else ""
            k += f":win{self.window}" if self.window else ""
        k += ":sinks" if self.sinks else ""
        return k + (":nh16" if self.nh16 else ":nh")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "key": self.key}


def enumerate_variants(groups=DEFAULT_GROUPS, dtypes=kcfg.SUPPORTED_DTYPES, heads=kcfg.SUPPORTED_HEAD_SIZES,
                       block_sizes=kcfg.SUPPORTED_BLOCK_SIZES) -> list[Variant]:
    """All distinct binaries over the given axes (deduplicated by what is compiled)."""
    out, seen = [], set()
    for dt in dtypes:
        for h in heads:
            for g in groups:
                for nh in (True, False):
                    for bs in block_sizes:
                        for c in (True, False):
                            for sp in (False, True):
                                for kind in kcfg.STEP_KINDS:
                                    for ct in (True, False):
                                        v = Variant("attention_kernel", dt, h, g, bs, c, nh, sp, kind, ct)
                                        sig = compile_inputs(v)[1:]
                                        if repr(sig) not in seen:
                                            seen.add(repr(sig))
                                            out.append(v)
                    v = Variant("merge_kernel", dt, h, g, nh16=nh)
                    sig = compile_inputs(v)[1:]
                    if repr(sig) not in seen:
                        seen.add(repr(sig))
                        out.append(v)
    return out


# The CI subset: the production shape (Llama-3-8B: bf16, head 128, G 4, block 16)
# in both num_heads specializations, and variants that together touch every
# dtype, head size, group, block size, causal flag, policy-off binary, warp count (8 warps at head
# 256 and fp32 head 256) and head padding (80, 96).
CI_SUBSET = (
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, True),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, True, "decode"),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, False, "prefill"),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, True, "decode", False),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, False, "prefill", False),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, False),
    Variant("attention_kernel", "float16", 64, 1, 32, False, True),
    Variant("attention_kernel", "bfloat16", 80, 2, 64, True, False),
    Variant("attention_kernel", "float16", 96, 8, 128, False, True, True),
    Variant("attention_kernel", "bfloat16", 256, 8, 16, True, True),
    Variant("attention_kernel", "float32", 64, 4, 16, True, True),
    Variant("merge_kernel", "bfloat16", 128, 4, nh16=True),
    Variant("merge_kernel", "float16", 80, 1, nh16=False),
    Variant("merge_kernel", "float32", 256, 8, nh16=True),
)

# The model-feature binaries (issue 31): soft-cap (Gemma-2's 50) and sinks on the
# production shape, in fold mode (the sink folded by the attention kernel), split mode
# (by the merge kernel) and the decode tile; and the merge kernel with sinks. Sliding
# windows: constant-time fold (Mistral's 4096) and split decode (gpt-oss: head 64,
# window 128, sinks), and the policy-off binaries whose walk starts at the window
# (fold prefill, Gemma-3's head 256 and window 1024; split decode).
FEATURE_SUBSET = (
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, softcap=50.0, sinks=True),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, True, "decode", softcap=50.0),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, False, "prefill", False, softcap=30.0,
            sinks=True),
    Variant("merge_kernel", "bfloat16", 128, 4, nh16=True, sinks=True),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, window=4096),
    Variant("attention_kernel", "bfloat16", 64, 8, 16, True, True, True, "decode", sinks=True, window=128),
    Variant("attention_kernel", "bfloat16", 256, 2, 16, True, True, False, "prefill", False, softcap=50.0,
            window=1024),
    Variant("attention_kernel", "bfloat16", 128, 4, 16, True, True, True, "decode", False, window=4096),
)


def compile_inputs(v: Variant):
    """(jit function, signature, constexprs, attrs, options) for `triton.compile`."""
    from dhp_backend.ops import workspace as wsp
    from dhp_backend.ops.triton import kernels

    cfg = kcfg.kernel_config(v.head, v.group, v.dtype, kind=v.kind if v.kernel == "attention_kernel" else "mixed",
                             const_time=bool(v.const_time) if v.kernel == "attention_kernel" else True)
    dt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[v.dtype]
    if v.kernel == "attention_kernel":
        fn = kernels.attention_kernel
        elem = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "out_ptr": dt, "sink_out_ptr": dt, "bt_ptr": "i32",
                "qsl_ptr": "i32", "seq_ptr": "i32", "bucket_ptr": "i32", "ws_acc_ptr": "fp32", "zero_ptr": dt,
                "ws_m_ptr": "fp32", "ws_l_ptr": "fp32", "sink_ptr": "fp32"}
        const = dict(GROUP=v.group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
                     TILES_PER_SPLIT=cfg.tiles_per_split, BLOCK_SIZE=v.block_size, HEAD=v.head,
                     HEAD_PAD=cfg.head_pad, CAUSAL=bool(v.causal), FP32=cfg.fp32, UPCAST_DOT=False,
                     SEARCH_BLOCK=kcfg.SEARCH_BLOCK, SINK_SLOTS=wsp.SINK_SLOTS, SINK_ROWS=wsp.SINK_ROWS,
                     SINK_WIDTH=wsp.SINK_WIDTH, PREFETCH=cfg.prefetch, WRITE_PARTIALS=bool(v.split),
                     CONST_TIME=bool(v.const_time), SOFTCAP=float(v.softcap), HAS_SINKS=bool(v.sinks),
                     WINDOW=int(v.window), INTERPRET=False)
        if v.sinks:
            elem["attn_sinks_ptr"] = "fp32"
        else:
            const["attn_sinks_ptr"] = None  # the plain binaries: a None constexpr, no parameter (launch.launch)
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        floats = {"qk_scale"}
    else:
        fn = kernels.merge_kernel
        elem = {"ws_acc_ptr": "fp32", "ws_m_ptr": "fp32", "ws_l_ptr": "fp32", "out_ptr": dt}
        const = dict(GROUP=v.group, GROUP_PAD=kcfg.next_pow2(v.group), HEAD=v.head, HEAD_PAD=cfg.head_pad,
                     UNROLL=MERGE_UNROLL, HAS_SINKS=bool(v.sinks))
        if v.sinks:
            elem["sinks_ptr"] = "fp32"
        else:
            const["sinks_ptr"] = None
        opts = dict(num_warps=MERGE_WARPS)
        floats = set()
    if not hasattr(fn, "do_not_specialize"):  # an InterpretedFunction: nothing to compile
        raise RuntimeError(
            "the SASS gate compiles the Triton kernels, but they were imported under TRITON_INTERPRET=1 in this "
            f"process ({type(fn).__name__}); run the gate in a process without TRITON_INTERPRET")
    dns = set(fn.do_not_specialize) if all(isinstance(x, str) for x in fn.do_not_specialize) else {
        fn.arg_names[i] for i in fn.do_not_specialize}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in const:
            sig[n] = "constexpr"
        elif n in elem:
            sig[n] = "*" + elem[n]
            attrs[(i,)] = [["tt.divisibility", 16]]  # the launcher's tensors and workspace slices are 16-byte aligned
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            # Specialised ints: strides are multiples of 16 for every covered
            # head size (head_size % 16 == 0); num_heads is the nh16 axis.
            if n not in dns and (re.fullmatch(r"s[qkvo]_[a-z]", n) or (n == "num_heads" and v.nh16)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return fn, sig, const, attrs, opts


def compile_variant(v: Variant):
    """Compile for sm_90 (Hopper) with Triton's bundled ptxas; no GPU needed."""
    os.environ.pop("TRITON_DISABLE_LINE_INFO", None)  # the gate needs line info in the cubin
    # Triton 3.9 warns unless this is set; 1 is its default and what Triton 3.6 on the GPU machine does.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, const, attrs, opts = compile_inputs(v)
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def from_device_caches(fns=None):
    """(kernel name, variant description, CompiledKernel) of every binary a process has launched.

    For the GPU machine: after a run (tests, bench, vLLM), these are the exact
    artefacts that executed there, compiled by that machine's Triton; pass each
    to `gate.audit_compiled`.
    """
    if fns is None:
        from dhp_backend.ops.triton import kernels

        fns = (kernels.attention_kernel, kernels.merge_kernel)
    out = []
    for fn in fns:
        for dev, cache in getattr(fn, "device_caches", {}).items():
            kernel_cache = cache[0] if isinstance(cache, (tuple, list)) else cache
            for spec_key, ck in kernel_cache.items():
                out.append((fn.__name__, {"device": str(dev), "specialization": str(spec_key)[:300]}, ck))
    return out
