"""One decode step launched a few times: a target for ncu. Usage:
    python scripts/ncu_decode.py B16-32k [TARGET [MODE]]
TARGET: a csrc decode variant (default v2; see ops.cuda_decode.VARIANTS), a row of
benchmarks.cuda_decode (``cuda_<variant>[:fixed|:deal<N>|...]``, e.g. cuda_auto:fixed against
cuda_auto:deal264: the plan's dealing and the dealt schedule, perf-notes lever 69) or ``fa3``;
MODE: split (default) or fold, for a bare csrc variant. NCU_HEADS="H,HKV[,D]" (environment) sets the
heads as `benchmarks.cuda_decode --heads` does, e.g. 16,8,256 for Gemma-2 9B (default Llama-3-8B's).
Profile the decode kernel with ``ncu --kernel-name regex:decode_v2_kernel``, its merge with
``regex:merge_kernel``, FA3's main kernel with ``--kernel-name-base demangled --kernel-name
regex:FlashAttnFwd``."""
import argparse
import os
import sys

import torch

from benchmarks import cuda_prefill as cp
from benchmarks.cuda_decode import _cuda_variant, _shape, cuda_fn
from benchmarks.cuda_prefill import fa3_fn, make_step

if os.environ.get("NCU_HEADS"):
    cp.set_heads(argparse.ArgumentParser(prog="NCU_HEADS"), os.environ["NCU_HEADS"])

shape = sys.argv[1] if len(sys.argv) > 1 else "B16-32k"
target = sys.argv[2] if len(sys.argv) > 2 else "v2"
mode = sys.argv[3] if len(sys.argv) > 3 else "split"
B, ctx, reqs = _shape(shape)
st = make_step(reqs, torch.Generator(device="cuda").manual_seed(0))
if target == "fa3":
    fn = fa3_fn(st, True)
elif target.startswith("cuda_"):
    row = _cuda_variant(target)
    if row is None:
        sys.exit(f"{target}: not a row of benchmarks.cuda_decode")
    fn = cuda_fn(st, row[0], **row[1])
else:
    fn = cuda_fn(st, target, mode=mode)
if fn is None:
    sys.exit(f"{target}: not available here")
for _ in range(4):
    fn()
torch.cuda.synchronize()
print("ran", shape, f"heads {cp.H}x{cp.HKV}x{cp.D}", target, mode)
