"""What the csrc kernels' benches (`benchmarks.cuda_decode`, `benchmarks.cuda_prefill`) share:
refusing a machine without an sm_90 GPU, the probe before any timing, how one
variant's row is checked and timed, and the FA3 ratio of a shape's rows."""

from __future__ import annotations

import time

import torch

from benchmarks.inputs import rel_err

TOLERANCE = 2e-2  # relative error against SDPA above which a row is "wrong result" and not timed


def probe_first(ap, probe, kernel: str, probe_only: bool) -> int | None:
    """Refuse without an sm_90 GPU (an argparse error), then run ``probe`` (which
    builds the kernel on first use). Returns the exit code when the bench ends
    here (the probe failed, or only the probe was asked for), else None."""
    from dhp_backend.ops.cuda_common import unavailable_reason

    reason = unavailable_reason() if torch.cuda.is_available() else "no CUDA device"
    if reason:
        ap.error(f"needs an sm_90 GPU ({reason})")
    t0 = time.time()
    ok = probe()
    print(f"probe done in {time.time() - t0:.0f}s (includes the nvcc build on first use)", flush=True)
    if not ok:
        print(f"the CUDA {kernel} kernel is wrong on the probe steps: nothing timed")
        return 1
    return 0 if probe_only else None


def check_and_time(row: dict, fns, ref: torch.Tensor, measure, *,
                   rows_checked: int | None = None) -> torch.Tensor | None:
    """Fill ``row`` (``rel_err``, ``us`` or ``error``) for one variant: run ``fns[0]``
    once, check it against ``ref`` (its first ``rows_checked`` rows), and time it with
    ``measure(fns)`` (median ms) only when right. Returns the checked
    output (for the bit comparisons), None otherwise. ``fns[0] is None``: the anchor
    is not available here."""
    if fns[0] is None:
        row["error"] = "not available"
        return None
    o = fns[0]()
    if o.is_cuda:
        torch.cuda.synchronize()
    if rows_checked is not None:
        o = o[:rows_checked]
    row["rel_err"] = rel_err(o, ref)
    if row["rel_err"] >= TOLERANCE:
        row["error"] = "wrong result"
        return None
    row["us"] = measure(fns) * 1e3
    return o.clone()


def fa3_ratios(rows: list[dict]) -> None:
    """``fa3_over`` of each row of one shape: FA3's median time over the row's (> 1: faster than FA3)."""
    fa = next((r["us"] for r in rows if r["variant"] == "fa3"), None)
    for r in rows:
        r["fa3_over"] = fa / r["us"] if fa and r["us"] else None


def print_progress(k: int, n: int, t0: float, shape: str, rows: list[dict], mark=lambda r: "") -> None:
    """One line per shape while the bench runs: each row's time, FA3 ratio, error and ``mark(row)``."""
    print(f"[{k + 1}/{n} {time.time() - t0:5.0f}s] {shape}: " + ", ".join(
        f"{r['variant']} {r['us'] and round(r['us'], 1)} us ({r['fa3_over'] and round(r['fa3_over'], 3)} x FA3)"
        + (f" [{r['error']}]" if r.get("error") else "") + mark(r) for r in rows), flush=True)
