"""Statistics of the G4 timing gate (design.md section 3): two-class leakage tests on timing streams.

Three tests, all on the same measurements of two secret classes A and B:

- **Welch t** (the dudect test, the gate's primary statistic), kept online:
  per class a Welford accumulator (n, mean, M2 = sum of squared deviations),
  merged batch-wise with Chan et al.'s parallel formula, so 10^5+ samples in
  float64 agree with a two-pass numpy computation to rounding::

      var_c = M2_c / (n_c - 1)
      t     = (mean_A - mean_B) / sqrt(var_A / n_A + var_B / n_B)

- **Cropped Welch t** (dudect's secondary statistic, reported, not gating):
  the same test restricted to samples below pooled percentiles of the first
  batch seen (thresholds at quantiles ``1 - 0.5 ** (10 * (i + 1) / K)``, as in
  dudect with K crops). Long right tails (interrupts, other tenants of the
  GPU) inflate the variance; cropping them makes mean shifts of the bulk
  easier to see. Thresholds come from the *pooled* sample so cropping cannot
  by itself create a difference between the classes.

- **Paired tests**: the harness launches one A and one B per round, in random
  order, so the two samples of a round share the GPU's state (clocks,
  temperature, neighbours) and are not independent. The per-round differences
  ``d_i = x_A,i - x_B,i`` are tested for a zero median; because the order
  inside a round is a fair coin, d_i is symmetric about zero when the classes
  do not differ, even if launch order itself matters (first vs second):

  * sign test: among the non-zero d_i (n of them, n_+ positive),
    ``z = (n_+ - n / 2) / sqrt(n / 4)``;
  * Wilcoxon signed-rank: zero differences dropped, ranks of |d_i| with ties
    given their average rank, ``W+`` = sum of ranks of the positive d_i,
    ``z = (W+ - n(n+1)/4) / sqrt(n(n+1)(2n+1)/24 - sum_g (t_g^3 - t_g)/48)``
    where t_g are the sizes of the tie groups (CUDA event times are quantised
    to about half a microsecond, so ties are the rule, not the exception).

**Pass rule** (`verdict`): a pair passes when it has at least 10^5 samples
per class, ``|t| < 4.5`` and the paired ``|z| < 4.5`` (both the sign test and
Wilcoxon). Fewer samples give "too few samples", which does not pass. The
threshold 4.5 is dudect's: under no leak a |t| above it has probability about
7e-6 per test.

numpy and math only (scipy is not a dependency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

THRESHOLD = 4.5
MIN_SAMPLES = 100_000


class Welford:
    """Running count, mean and M2 of one stream, merged batch-wise (Chan et al.)."""

    __slots__ = ("n", "mean", "m2")

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def update_batch(self, xs) -> None:
        xs = np.asarray(xs, dtype=np.float64).ravel()
        nb = xs.size
        if nb == 0:
            return
        mb = float(xs.mean())
        m2b = float(((xs - mb) ** 2).sum())  # two-pass inside the batch: no cancellation
        n = self.n + nb
        d = mb - self.mean
        self.mean += d * nb / n
        self.m2 += m2b + d * d * self.n * nb / n
        self.n = n

    @property
    def var(self) -> float:
        """Unbiased sample variance (nan below two samples)."""
        return self.m2 / (self.n - 1) if self.n > 1 else math.nan


class WelchT:
    """Online Welch t-test between classes 0 and 1."""

    def __init__(self) -> None:
        self.acc = (Welford(), Welford())

    def update(self, cls: int, x: float) -> None:
        self.acc[cls].update(float(x))

    def update_batch(self, cls: int, xs) -> None:
        self.acc[cls].update_batch(xs)

    @property
    def n(self) -> tuple[int, int]:
        return self.acc[0].n, self.acc[1].n

    @property
    def means(self) -> tuple[float, float]:
        return self.acc[0].mean, self.acc[1].mean

    @property
    def variances(self) -> tuple[float, float]:
        return self.acc[0].var, self.acc[1].var

    @property
    def t(self) -> float:
        (a, b) = self.acc
        if a.n < 2 or b.n < 2:
            return math.nan
        se2 = a.var / a.n + b.var / b.n
        if se2 == 0.0:
            # Identical constant streams: no difference. Different constants: infinite evidence.
            return 0.0 if a.mean == b.mean else math.copysign(math.inf, a.mean - b.mean)
        return (a.mean - b.mean) / math.sqrt(se2)

    @property
    def df(self) -> float:
        """Welch-Satterthwaite degrees of freedom (reported; at 10^5 samples t is normal)."""
        (a, b) = self.acc
        if a.n < 2 or b.n < 2:
            return math.nan
        va, vb = a.var / a.n, b.var / b.n
        den = va * va / (a.n - 1) + vb * vb / (b.n - 1)
        return (va + vb) ** 2 / den if den > 0 else math.inf


def welch_t(a, b) -> float:
    """Two-pass Welch t of two samples (the reference the online test must equal)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    se2 = a.var(ddof=1) / a.size + b.var(ddof=1) / b.size
    return float((a.mean() - b.mean()) / math.sqrt(se2))


def crop_quantiles(k: int = 20) -> np.ndarray:
    """dudect's crop quantiles, ``1 - 0.5 ** (10 * (i + 1) / k)`` for i < k (0.29 ... 0.999 at k=20)."""
    return 1.0 - 0.5 ** (10.0 * (np.arange(k) + 1) / k)


class CroppedWelch:
    """Welch t on samples below each of K pooled-percentile thresholds (dudect's cropping).

    The thresholds are the pooled quantiles of the first ``calibration`` samples
    (both classes together); samples are buffered until then, and the buffer is
    counted like every later batch once the thresholds are fixed.
    """

    def __init__(self, k: int = 20, calibration: int = 2000) -> None:
        self.quantiles = crop_quantiles(k)
        self.calibration = calibration
        self.thresholds: np.ndarray | None = None
        self.tests = [WelchT() for _ in range(k)]
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []

    def set_thresholds(self, pooled) -> None:
        self.thresholds = np.quantile(np.asarray(pooled, np.float64), self.quantiles)

    def update_batch(self, xs_a, xs_b) -> None:
        xs_a, xs_b = np.asarray(xs_a, np.float64).ravel(), np.asarray(xs_b, np.float64).ravel()
        if self.thresholds is None:
            self._pending.append((xs_a, xs_b))
            if sum(a.size + b.size for a, b in self._pending) < self.calibration:
                return
            xs_a = np.concatenate([a for a, _ in self._pending])
            xs_b = np.concatenate([b for _, b in self._pending])
            self._pending = []
            self.set_thresholds(np.concatenate([xs_a, xs_b]))
        for thr, test in zip(self.thresholds, self.tests):
            test.update_batch(0, xs_a[xs_a < thr])
            test.update_batch(1, xs_b[xs_b < thr])

    def flush(self) -> None:
        """Fix the thresholds from whatever was buffered (short streams)."""
        if self.thresholds is None and self._pending:
            xs_a = np.concatenate([a for a, _ in self._pending])
            xs_b = np.concatenate([b for _, b in self._pending])
            self._pending, self.calibration = [], 0
            self.update_batch(xs_a, xs_b)

    def t_values(self) -> list[float]:
        return [w.t for w in self.tests]

    def max_abs_t(self) -> tuple[float, float | None]:
        """(largest finite |t| over the crops, its quantile); (nan, None) before any data."""
        best, q = math.nan, None
        for quant, t in zip(self.quantiles, self.t_values()):
            if math.isfinite(t) and not (abs(t) <= best):
                best, q = abs(t), float(quant)
        return best, q


def sign_test(d) -> dict:
    """Sign test of paired differences: zeros dropped, normal approximation."""
    d = np.asarray(d, np.float64)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    z = (pos - n / 2.0) / math.sqrt(n / 4.0) if n else 0.0
    return {"n": n, "positive": pos, "negative": neg, "zeros": int(d.size - n), "z": z}


def average_ranks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranks 1..n of ``x`` with ties averaged, and the sizes of the tie groups."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    sizes = np.diff(np.r_[starts, xs.size])
    avg = starts + (sizes + 1) / 2.0  # average of ranks start+1 .. start+size
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat(avg, sizes)
    return ranks, sizes


def wilcoxon_signed_rank(d) -> dict:
    """Wilcoxon signed-rank test of paired differences (zeros dropped, tie-corrected normal z)."""
    d = np.asarray(d, np.float64)
    nz = d[d != 0]
    n = nz.size
    if n == 0:
        return {"n": 0, "zeros": int(d.size), "w_plus": 0.0, "z": 0.0}
    ranks, sizes = average_ranks(np.abs(nz))
    w_plus = float(ranks[nz > 0].sum())
    mean = n * (n + 1) / 4.0
    var = n * (n + 1) * (2 * n + 1) / 24.0 - float(((sizes.astype(np.float64) ** 3) - sizes).sum()) / 48.0
    z = (w_plus - mean) / math.sqrt(var) if var > 0 else 0.0
    return {"n": int(n), "zeros": int(d.size - n), "w_plus": w_plus, "z": z}


def paired(d) -> dict:
    """Both paired tests, and the larger |z| (what the pass rule uses)."""
    s, w = sign_test(d), wilcoxon_signed_rank(d)
    return {"sign": s, "wilcoxon": w, "z_max": max(abs(s["z"]), abs(w["z"])),
            "median_diff": float(np.median(d)) if len(d) else math.nan}


def verdict(n: Sequence[int], t: float, z_paired: float, *, threshold: float = THRESHOLD,
            min_samples: int = MIN_SAMPLES) -> str:
    """'pass', 'FAIL' (a test reached the threshold) or 'too few samples' (does not pass either)."""
    if not (abs(t) < threshold and abs(z_paired) < threshold):
        return "FAIL"  # includes nan: a test that could not be computed is not a pass
    if min(n) < min_samples:
        return "too few samples"
    return "pass"


def leak_detected(t: float, threshold: float = THRESHOLD) -> bool:
    """The control's criterion: the harness saw the leak it was shown (|t| above the threshold)."""
    return abs(t) > threshold
