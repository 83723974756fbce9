"""Where an end-to-end generation spends GPU time: kernels summed by name and by kind.

``e2e_throughput --profile-kernels`` runs one extra ``llm.generate`` (fresh prompts of
the same length distribution, after the timed one, so the timed number carries no
profiler overhead) under ``torch.profiler`` with CUDA activity only, in the engine's
own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the profiler sees only kernels
launched by its process). Kernels replayed from CUDA graphs are reported by CUPTI one
by one, like eager ones.

Two configurations profiled on the same workload tell where a throughput gap lives:
attention kernels, the KV-cache scatter, GEMMs, or nowhere on the GPU (host time:
``gpu_busy_s`` well under ``wall_s``).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

# Kinds, tested in this order on the kernel's (demangled) name; the first match wins.
KINDS = (
    ("kv_cache_update", re.compile(r"reshape_and_cache|cache_kernel|concat_and_cache", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|decode_sm90|prefill_sm90|dhp|merge_kernel"
                             r"|BatchPrefill|BatchDecode|PersistentVariableLength", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|matmul|sm90_|splitK|cublas|_mm_", re.I)),
    ("norm_act_rope", re.compile(r"norm|silu|act_and_mul|rotary|rope|fused_add", re.I)),
    ("sampling_other", re.compile(r".")),
)
TOP_KERNELS = 25


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "sampling_other"


def summarize(events, wall_s: float, top: int = TOP_KERNELS) -> dict:
    """events: iterable of (kernel name, device seconds). Sums by name and by kind."""
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, seconds in events:
        entry = by_name[name]
        entry[0] += 1
        entry[1] += float(seconds)
    busy = sum(t for _, t in by_name.values())
    by_kind: dict[str, dict] = {}
    for name, (calls, seconds) in by_name.items():
        k = by_kind.setdefault(kind_of(name), {"calls": 0, "seconds": 0.0})
        k["calls"] += calls
        k["seconds"] += seconds
    kinds = {k: {"calls": v["calls"], "seconds": round(v["seconds"], 6),
                 "share_of_busy": round(v["seconds"] / busy, 4) if busy else None}
             for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"])}
    kernels = [{"name": name[:200], "kind": kind_of(name), "calls": calls, "seconds": round(seconds, 6)}
               for name, (calls, seconds) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"wall_s": round(wall_s, 4), "gpu_busy_s": round(busy, 4),
            "busy_share_of_wall": round(busy / wall_s, 4) if wall_s else None,
            "kinds": kinds, "top_kernels": kernels}


def profile_generate(run) -> dict:
    """Call ``run()`` (one generation) under torch.profiler; return ``summarize`` of its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False, with_stack=False) as prof:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            us = getattr(ev, "device_time", None)
            if us is None:
                us = ev.cuda_time
            events.append((ev.name, us * 1e-6))
    if not events:
        raise RuntimeError("torch.profiler recorded no CUDA kernels (is the engine in this process? "
                           "--profile-kernels sets VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return summarize(events, wall)


def markdown(config: str, prof: dict, top: int = 12) -> list[str]:
    """A few lines per configuration for the report."""
    lines = [f"### {config}: GPU time by kind (profiled run: wall {prof['wall_s']:.2f} s, kernels "
             f"{prof['gpu_busy_s']:.2f} s = {100 * (prof['busy_share_of_wall'] or 0):.0f} % of wall)", "",
             "| kind | calls | seconds | share of kernel time |", "|---|---:|---:|---:|"]
    for kind, v in prof["kinds"].items():
        lines.append(f"| {kind} | {v['calls']:,} | {v['seconds']:.3f} | {100 * (v['share_of_busy'] or 0):.1f} % |")
    lines += ["", "| kernel | kind | calls | seconds |", "|---|---|---:|---:|"]
    for k in prof["top_kernels"][:top]:
        name = k["name"].replace("|", "\\|")[:110]
        lines.append(f"| `{name}` | {k['kind']} | {k['calls']:,} | {k['seconds']:.3f} |")
    return lines + [""]
