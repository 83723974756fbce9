"""Decision run (b) of issue 30's arithmetic contract (docs/kernels.md section 7): the csrc decode
kernel's consumer on the next contract, checked bit for bit against the prefill that chose it.

    python -m benchmarks.decode_v2 --probe      # right, and a decode row == the v2 prefill's row
    python -m benchmarks.cuda_decode --variants fa3,cuda_auto,exp_v2,exp_p2x2_pv_ef ...   # timing

An EXPERIMENT, outside the package: ``benchmarks/csrc/decode_v2_sm90.cu`` includes
``csrc/decode_sm90.cu`` unchanged and adds the v2 consumer; it is built into a library of its own
(`benchmarks.experiment_lib`). The launches go through the product's launcher
(`dhp_backend.ops.cuda_decode.decode_sm90`: its planning, split/fold choice, workspace and
longest-first schedule) with the experiment library's entry in place of the engine's, so the
rows differ in the kernel only. ``exp_<variant>`` of a product variant is the product's binary
built by the same nvcc in the experiment library (a like-for-like baseline).

The probe (exit 1 when wrong):
  - every row against SDPA, both split modes, splits dealt one and three per CTA;
  - **the contract's invariance**: a decode row equals, bit for bit, the last row of the v2 prefill
    (``benchmarks.contract_v2`` variant ``v2fma_fold512``) of the same request on the same cache:
    prefill = decode for the same position;
  - the experiment library's product binaries give the engine's bits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import sys
from pathlib import Path

import torch

from benchmarks import cuda_runs, experiment_lib
from benchmarks.inputs import rel_err

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_v2_sm90.cu"
# The v2 consumer's code (decode_v2_sm90.cu: 4 + 8 * (kPipe | kV2)) and its residency (two CTAs per SM).
_PIPE = 1 | 8 | 16 | 64  # the product's kPipe: kPairedV | kEvictFirst | kMmaSync | kMmaPipe
V2_CODE = 4 + 8 * (_PIPE | 512)
V2 = "v2"


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    lib = experiment_lib.load(SOURCE, "dhp_decode_v2")
    # The product entry's signature (dhp_backend.ops.cuda_decode._entry).
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.dhp_decode_v2_sm90.argtypes = [p, i64, i64, p, p, i64, i64, i64, i32, p, i64, i64, p, i64, p, p, i32, i32,
                                       i32, i32, i32, i32, ctypes.c_float, i32, i32, i32, p, p, p, i32, i32, p,
                                       i32, p, i32, p]
    lib.dhp_decode_v2_sm90.restype = i32
    return lib


@contextlib.contextmanager
def experiment_entry():
    """The product launcher with the experiment library's entry, and variant ``v2`` known to it."""
    from dhp_backend.ops import cuda_decode as cd

    saved_entry, saved_variants = cd._entry, dict(cd.VARIANTS)
    cd._entry = lambda: library().dhp_decode_v2_sm90
    cd.VARIANTS[V2] = (V2_CODE, 2)
    try:
        yield cd
    finally:
        cd._entry = saved_entry
        cd.VARIANTS.clear()
        cd.VARIANTS.update(saved_variants)


def exp_fn(st, variant: str = V2, mode=None, spp=None):
    """A closure launching ``variant`` (``v2`` or a product variant) of the experiment library on
    decode step ``st`` (benchmarks.cuda_prefill.make_step) into its own output; policy off."""
    from benchmarks.cuda_prefill import SCALE

    out = torch.full_like(st["q"], float("nan"))
    args = (st["q"], st["kc"], st["vc"], st["table"], st["qsl"], st["sl"], out)
    kw = dict(scale=SCALE, causal=True, variant=variant, mode=mode, spp=spp)
    with experiment_entry() as cd:
        cd.decode_sm90(*args, **kw)  # the metadata checked once

    def run():
        with experiment_entry() as cd:
            return cd.decode_sm90(*args, **kw, check=False)
    return run


def decode_of_prefill(st):
    """The decode step of each request's last query row on the same cache and table."""
    last = (st["qsl"][1:] - 1).long()
    B = last.shape[0]
    return dict(st, q=st["q"][last].contiguous(), qsl=torch.arange(B + 1, dtype=torch.int32, device=st["q"].device),
                reqs=[(1, s) for _, s in st["reqs"]], max_q=1), last


def probe() -> bool:
    from benchmarks import contract_v2
    from benchmarks import cuda_prefill as cp
    from benchmarks.cuda_decode import cuda_fn

    gen = torch.Generator(device="cuda").manual_seed(1)
    errs, same_prefill, same_product = {}, {}, {}
    for heads in ("32,8", "28,4"):
        cp.H, cp.HKV = (int(x) for x in heads.split(","))
        # lengths: inside one step, a stage past the end, a split's edge, several splits, a page tail
        for lens in ((1, 64, 65), (127, 128, 129, 200), (511, 512, 513), (1000, 2100, 77), (5000, 4099)):
            pre = cp.make_step([(s, s) for s in lens], gen)
            v2_prefill = contract_v2.v2_fn(pre, True, "v2fma_fold512")()
            st, last = decode_of_prefill(pre)
            ref = cp.sdpa_ref(st, True)
            want = v2_prefill[last]
            runs = [(V2, mode, spp) for mode, spp in (("split", None), ("fold", None), ("split", 1), ("split", 3))]
            for variant, mode, spp in runs:
                o = exp_fn(st, variant, mode, spp)()
                torch.cuda.synchronize()
                key = f"{heads} {lens} {variant}/{mode}{f'/spp{spp}' if spp else ''}"
                errs[key] = rel_err(o, ref)
                same_prefill[key] = bool(torch.equal(o.view(torch.int16), want.view(torch.int16)))
            for mode in ("split", "fold"):  # the experiment library's product binary == the engine's
                mine = exp_fn(st, "p2x2_pv_ef", mode)()
                theirs = cuda_fn(st, "p2x2_pv_ef", mode)()
                torch.cuda.synchronize()
                same_product[f"{heads} {lens} {mode}"] = bool(torch.equal(mine.view(torch.int16),
                                                                          theirs.view(torch.int16)))
    cp.H, cp.HKV = 32, 8
    ok = all(e < 2e-2 for e in errs.values()) and all(same_prefill.values()) and all(same_product.values())
    print(f"probe: {'OK' if ok else 'WRONG'} errs " + json.dumps({k: round(v, 5) for k, v in errs.items()}) +
          " bits==v2 prefill " + json.dumps(same_prefill) + " product bits " + json.dumps(same_product), flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", action="store_true", help="check the v2 decode (exit 1 if wrong); the default")
    ap.parse_args(argv)
    return cuda_runs.probe_first(ap, probe, "decode (contract v2)", True)


if __name__ == "__main__":
    sys.exit(main())
