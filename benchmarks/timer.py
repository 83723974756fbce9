"""Timing one launch: CUDA events on a GPU (graph replay where it captures), host clocks on a CPU.

Each sample is one launch, rotating over the input sets (launch ``i`` reads set
``i mod n``). The statistics are the median and the 10/25/75/90th percentiles
of the samples.

On a GPU the host must not be what is measured: a Python launch of a small
kernel takes longer to enqueue than the kernel takes to run, and an event pair
around an eagerly launched kernel would then time the enqueue. So each chunk of
launches is queued behind a `torch.cuda._sleep` long enough for the host to get
ahead (the same device as the G4 timing gate), and the events measure the GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import time


@dataclasses.dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p25_ms: float
    p75_ms: float
    p90_ms: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        xs = sorted(samples_ms)

        def q(f: float) -> float:
            # linear interpolation between closest ranks
            pos = f * (len(xs) - 1)
            lo = int(pos)
            hi = min(lo + 1, len(xs) - 1)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

        return cls(median_ms=statistics.median(xs), p10_ms=q(0.10), p25_ms=q(0.25), p75_ms=q(0.75),
                   p90_ms=q(0.90), n=len(xs))


class HostTimer:
    """perf_counter around each call (CPU runs: the interpreter or the reference path)."""

    clock = "host perf_counter"

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps, self.warmup = max(1, reps), max(0, warmup)

    def sync(self) -> None:
        pass

    def measure(self, fns) -> Timing:
        for i in range(self.warmup):
            fns[i % len(fns)]()
        samples = []
        for i in range(self.reps):
            t = time.perf_counter()
            fns[i % len(fns)]()
            samples.append((time.perf_counter() - t) * 1e3)
        return Timing.of(samples)


class CudaTimer:
    """CUDA events around each launch, chunks queued behind a GPU spin (see the module docstring)."""

    clock = "CUDA events"
    CHUNK = 32
    PAD_MARGIN = 1.5
    MAX_PAD_MS = 200.0

    def __init__(self, reps: int, warmup: int, min_reps: int = 10, budget_s: float = 2.0) -> None:
        import torch

        self.torch = torch
        self.reps, self.warmup = max(1, reps), max(1, warmup)
        self.min_reps, self.budget_ms = min(min_reps, self.reps), budget_s * 1e3
        self.cycles_per_ms = self._calibrate_sleep()

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def _calibrate_sleep(self) -> float | None:
        from dhp_backend.audit.timing import gpu_sleep_cycles_per_ms

        return gpu_sleep_cycles_per_ms(self.torch, cycles=1_000_000)

    def _pad(self, ms: float) -> None:
        if self.cycles_per_ms and ms > 0:
            self.torch.cuda._sleep(int(min(ms, self.MAX_PAD_MS) * self.cycles_per_ms))

    def measure(self, fns) -> Timing:
        torch = self.torch
        n_sets = len(fns)
        for i in range(max(self.warmup, n_sets)):
            fns[i % n_sets]()
        torch.cuda.synchronize()
        # Host enqueue time of one launch (GPU held behind a spin), and a first GPU estimate.
        self._pad(self.MAX_PAD_MS)
        probe = min(8, self.CHUNK)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.CHUNK)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.CHUNK)]
        t = time.perf_counter()
        for j in range(probe):
            starts[j].record()
            fns[j % n_sets]()
            ends[j].record()
        host_ms = (time.perf_counter() - t) * 1e3 / probe
        torch.cuda.synchronize()
        est_ms = statistics.median(starts[j].elapsed_time(ends[j]) for j in range(probe))
        reps = max(self.min_reps, min(self.reps, int(self.budget_ms / max(est_ms, 1e-3))))
        samples: list[float] = []
        done = 0
        while done < reps:
            k = min(self.CHUNK, reps - done)
            torch.cuda.synchronize()
            self._pad(self.PAD_MARGIN * host_ms * k)
            for j in range(k):
                starts[j].record()
                fns[(done + j) % n_sets]()
                ends[j].record()
            ends[k - 1].synchronize()
            samples += [starts[j].elapsed_time(ends[j]) for j in range(k)]
            done += k
        return Timing.of(samples)


def capture_graphs(fns, warmup: int = 2):
    """One CUDA graph per callable (warmed up on a side stream first, PyTorch's recipe).

    Returns (replay callables, the tensors each capture returned): a replay
    rewrites the tensor its capture returned, which is how the caller checks
    that replaying gives the eager result. Raises whatever capture raises.
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            for _ in range(warmup):
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = [], []
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outs.append(f())
        graphs.append(g)
    torch.cuda.synchronize()
    return [g.replay for g in graphs], outs, graphs
