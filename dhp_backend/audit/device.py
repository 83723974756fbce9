"""G2 on the GPU machine: the gate on the exact binaries that machine's Triton compiled and ran.

CI judges binaries compiled by its own Triton for sm_90; the GPU machine may
run another Triton version that schedules differently. This launches every
variant of a list through the Triton path on the local GPU (both split modes,
so `merge_kernel` runs too), then audits what ``device_caches`` holds.
"""

from __future__ import annotations

import torch

from dhp_backend.audit import gate, variants

_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _heads(group: int, nh16: bool) -> tuple[int, int]:
    """(num_heads, num_kv_heads) with the given group, num_heads % 16 == 0 iff nh16 (never 1)."""
    if nh16:
        kv = max(1, 16 // group)
        return group * kv, kv
    kv = 3
    return group * kv, kv  # 3, 6, 12, 24: none divisible by 16


def launch(variant: variants.Variant, device: torch.device) -> None:
    """Run one small random step of ``variant`` in fold and in split mode."""
    from dhp_backend.ops.triton.launch import paged_attention_triton
    from dhp_backend.testing.pages import reserved_table

    dtype, bs, head = _DT[variant.dtype], variant.block_size or 16, variant.head
    H, Hkv = _heads(variant.group, variant.nh16)
    g = torch.Generator(device=device).manual_seed(0)
    lens = [(1, 100), (20, 200), (50, 50)]  # (query, total): decode, chunk on context, prompt
    width = -(-max(s for _, s in lens) // bs) + 1
    num_blocks = 1 + len(lens) * width + 4  # block 0: the null block
    kc = torch.randn(num_blocks, Hkv, bs, head, generator=g, device=device).to(dtype)
    vc = torch.randn(num_blocks, Hkv, bs, head, generator=g, device=device).to(dtype)
    # The address rule: every request owns distinct real pages up to the strict bucket (width * bs).
    table = reserved_table([width * bs] * len(lens), block_size=bs, num_blocks=num_blocks, width=width,
                           layout="random", seed=0, device=device)
    T = sum(q for q, _ in lens)
    q = torch.randn(T, H, head, generator=g, device=device).to(dtype)
    qsl = torch.tensor([0] + [sum(x for x, _ in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32,
                       device=device)
    sl = torch.tensor([s for _, s in lens], dtype=torch.int32, device=device)
    causal = True if variant.causal is None else variant.causal
    for mode in ("fold", "split"):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc, vc, table, qsl, sl, out, scale=head ** -0.5, causal=causal, num_tokens=T,
                               policy="strict", bucket=width * bs, _mode=mode)
        if not torch.isfinite(out.float()).all():
            raise RuntimeError(f"{variant.key} ({mode}): non-finite output; the audit needs working launches")
    torch.cuda.synchronize(device)


def audit_on_device(variant_list, progress=print) -> list[dict]:
    """Launch each attention variant, then gate every binary the kernels' caches hold."""
    device = torch.device("cuda", torch.cuda.current_device())
    attn = [v for v in variant_list if v.kernel == "attention_kernel"]
    for i, v in enumerate(attn, 1):
        launch(v, device)
        progress(f"[launch {i}/{len(attn)}] {v.key}")
    results = []
    for name, info, ck in variants.from_device_caches():
        r = gate.audit_compiled(ck, name, info)
        results.append(r)
        progress(f"[audit] {name} {info.get('specialization', '')[:80]}: {'pass' if r['passed'] else 'FAIL'}")
    return results
