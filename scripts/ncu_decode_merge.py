"""One decode step on the csrc kernel (split mode), launched a few times: a target for ncu
(`ncu --kernel-name regex:merge_kernel ...`). Usage: python scripts/ncu_decode_merge.py B16-32k"""
import sys

import torch

from dhp_backend.bench.cuda_decode import _shape, cuda_fn
from dhp_backend.bench.cuda_prefill import make_step

B, ctx, reqs = _shape(sys.argv[1] if len(sys.argv) > 1 else "B16-32k")
st = make_step(reqs, torch.Generator(device="cuda").manual_seed(0))
fn = cuda_fn(st, "m2x2_pv_ef", mode="split")
for _ in range(4):
    fn()
torch.cuda.synchronize()
print("ran", sys.argv[1:] or ["B16-32k"])
