"""What the device can do at all, measured in the same run as the anchors.

- copy bandwidth: one large device-to-device copy; bytes read + written over its
  time. Decode attention reads K/V once, so its useful GB/s is read against this.
- matmul: a large bf16 GEMM (2*M*N*K FLOPs over its time), what prefill
  attention's TFLOP/s is read against.

On a CPU the same two, small, with host clocks: the run's plumbing, not numbers
to quote.
"""

from __future__ import annotations

import functools


def measure(device, timer, *, quick: bool = False) -> dict:
    import torch

    gpu = device.type == "cuda"
    copy_bytes = (1 << 30 if not quick else 256 << 20) if gpu else 64 << 20
    n = 8192 if gpu else 256
    out = {}
    try:
        a = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
        b = torch.empty_like(a)
        t = timer.measure([functools.partial(b.copy_, a)])
        out["copy"] = {"bytes_per_copy": 2 * copy_bytes, "time_ms": t.median_ms, "n": t.n,
                       "GBps": 2 * copy_bytes / (t.median_ms * 1e-3) / 1e9,
                       "what": f"{copy_bytes >> 20} MiB device-to-device copy, read + written bytes / median time"}
        del a, b
    except Exception as exc:  # noqa: BLE001 - a ceiling that cannot be measured is reported, not fatal
        out["copy"] = {"status": f"not available: {type(exc).__name__}: {exc}"}
    try:
        x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        y = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        t = timer.measure([functools.partial(torch.mm, x, y)])
        out["matmul"] = {"shape": [n, n, n], "dtype": "bfloat16", "time_ms": t.median_ms, "n": t.n,
                         "TFLOPs": 2 * n**3 / (t.median_ms * 1e-3) / 1e12,
                         "what": f"{n}x{n}x{n} bf16 GEMM (torch.mm), 2*n^3 / median time"}
        del x, y
    except Exception as exc:  # noqa: BLE001
        out["matmul"] = {"status": f"not available: {type(exc).__name__}: {exc}"}
    if gpu:
        torch.cuda.empty_cache()
    return out
