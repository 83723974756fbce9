"""Compile the attention kernel for sm_90 without a GPU and summarise its SASS.

    python -m benchmarks.offline_sass [--dtype bf16] [--head 128] [--group 4]
        [--block-size 16] [--non-causal] [--dump DIR]

Uses the ptxas bundled with Triton, so registers, spills, shared memory, the
matrix instructions (HGMMA = wgmma) and every branch can be read on a CPU-only
machine (for design.md's G2 review before a GPU run). The SASS comes from this
machine's Triton; the GPU machine's Triton may schedule differently, so the GPU
bench (quick_kernel_bench) repeats the summary on the binary that actually ran.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile

_DT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def compile_attention(dtype="bf16", head=128, group=4, block_size=16, causal=True, nh16=True, split=False):
    """The attention kernel for sm_90 as the dispatcher would launch it (`audit.variants` compiles it).

    ``nh16``: whether num_heads is a multiple of 16 (Triton specialises on it; Llama-3-8B's 32 is).
    ``split``: the split-mode binary (WRITE_PARTIALS) instead of the fold-mode one.
    """
    from dhp_backend.audit.variants import Variant, compile_variant

    return compile_variant(Variant("attention_kernel", _DT[dtype], head, group, block_size, causal, nh16, split))


def resource_usage(cubin: bytes) -> str:
    from dhp_backend.audit.sass import tool_path

    cuobjdump = tool_path("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", out)
    return m.group(0) if m else out.strip()


def summarize(ck) -> dict:
    sass, ptx = ck.asm["sass"], ck.asm["ptx"]
    lines = sass.splitlines()
    branches = [(i, ln.split("\t")[-1].strip()) for i, ln in enumerate(lines)
                if re.search(r"\b(BRA|EXIT|BRX|JMP)\b", ln)]
    return dict(
        resources=resource_usage(ck.asm["cubin"]), shared=ck.metadata.shared, num_warps=ck.metadata.num_warps,
        hgmma=len(re.findall(r"\bHGMMA\b", sass)), hmma=len(re.findall(r"\bHMMA\b", sass)),
        ldl_stl=len(re.findall(r"\b(LDL|STL)\b", sass)), mufu_ex2=sass.count("MUFU.EX2"),
        mufu_rcp=sass.count("MUFU.RCP"), ptx_div_rn=len(re.findall(r"div\.rn\.f32", ptx)),
        ptx_div_full=len(re.findall(r"div\.full\.f32", ptx)), branches=branches,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DT))
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--split", action="store_true", help="the split-mode (WRITE_PARTIALS) binary")
    ap.add_argument("--dump", help="write the .sass and .ptx here")
    a = ap.parse_args(argv)
    ck = compile_attention(a.dtype, a.head, a.group, a.block_size, not a.non_causal, split=a.split)
    s = summarize(ck)
    for k, v in s.items():
        if k != "branches":
            print(f"{k}: {v}")
    print("branches (SASS line, instruction):")
    for i, b in s["branches"]:
        print(f"  {i:5d}  {b}")
    if a.dump:
        import os

        os.makedirs(a.dump, exist_ok=True)
        stem = f"attention_{a.dtype}_h{a.head}_g{a.group}_bs{a.block_size}"
        with open(os.path.join(a.dump, stem + ".sass"), "w") as f:
            f.write(ck.asm["sass"])
        with open(os.path.join(a.dump, stem + ".ptx"), "w") as f:
            f.write(ck.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
