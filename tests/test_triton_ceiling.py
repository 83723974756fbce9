"""benchmarks/triton_ceiling.py's experimental kernels compute attention (CPU interpreter).

They are timed on the GPU machine only; here each variant (dense, one page per
step, two pages joined) must match SDPA on a small causal and full prefill,
through an identity and a shuffled block table. A fresh process, because the
interpreter must be chosen before triton is first imported.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CODE = """
import json
from benchmarks import triton_ceiling as tc
errs = tc.check_interpreted()
print(json.dumps([[list(k), v] for k, v in errs.items()]))
"""


def test_ceiling_variants_match_sdpa_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", CODE], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = json.loads(r.stdout.strip().splitlines()[-1])
    from benchmarks.triton_ceiling import VARIANTS

    paged = [n for n, v in VARIANTS.items() if v["PAGED"]]
    # every variant on the identity table, the paged ones also on a shuffled table, causal and full
    assert len(errs) == 2 * len(VARIANTS) + 2 * len(paged)
    for (name, table, causal), err in errs:
        assert err < 2e-3, f"{name} table={table} causal={causal}: relative error {err}"
