"""The lab's intervals: one percentile bootstrap (`scipy.stats.bootstrap`, rows resampled whole, so arrays given
together stay paired row by row), the estimate it gives, and the paired interval of a difference of means that
the quality rule and the broke criterion both report.

numpy/scipy only (no jax), so the rules' summaries run anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats
from jaxtyping import Float

CI_METHOD = "percentile"
RESAMPLE_BATCH = 2000  # bootstrap resamples held in memory at once

# A Generator is used as is; an int seeds scipy's legacy RandomState (the draws behind `jopd mismatch`'s and
# the probe's reported intervals).
Seed = int | np.random.Generator
# statistic(*arrays, axis=-1): one value per resample along the rows axis (scipy's vectorized form)
Statistic = Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class Estimate:
    mean: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def bootstrap(data: Sequence[Float[np.ndarray, "N"]], statistic: Statistic, *, resamples: int, seed: Seed,
              confidence: float = 0.95) -> Any:
    """`scipy.stats.bootstrap` (its BootstrapResult) of `statistic` over the N rows of `data`, paired, percentile.
    Percentile rather than BCa: the statistics are means or ratios of sums over many rows (close to normal),
    and the percentile interval stays defined for degenerate data (every row alike -> [v, v])."""
    return scipy.stats.bootstrap(tuple(data), statistic, paired=True, vectorized=True, n_resamples=int(resamples),
                                 batch=RESAMPLE_BATCH, confidence_level=confidence, method=CI_METHOD, random_state=seed)


def estimate(data: Sequence[Float[np.ndarray, "N"]], statistic: Statistic, *, resamples: int, seed: Seed = 0,
             confidence: float = 0.95) -> Estimate:
    """statistic(*data) with its `bootstrap` interval. No rows: NaN; one row, or every row alike: [v, v]
    (nothing to resample)."""
    if len(data[0]) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"))
    value = float(statistic(*data, axis=-1))
    if len(data[0]) < 2 or np.ptp(statistic(*(d[:, None] for d in data), axis=-1)) == 0:
        return Estimate(value, value, value)
    ci = bootstrap(data, statistic, resamples=resamples, seed=seed, confidence=confidence).confidence_interval
    return Estimate(value, float(ci.low), float(ci.high))


def mean_estimate(x_N: Float[np.ndarray, "N"], resamples: int, seed: Seed = 0) -> Estimate:
    """Mean of x with a 95% bootstrap interval over its rows (`estimate`)."""
    return estimate((np.asarray(x_N, np.float64),), np.mean, resamples=resamples, seed=seed)


def _mean_difference(run_N, base_N, axis=-1):
    return run_N.mean(axis) - base_N.mean(axis)


def mean_difference_ci(run_N: Float[np.ndarray, "N"], base_N: Float[np.ndarray, "N"], *, resamples: int, seed: int,
                       confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, standard error) of mean(run) - mean(base) = the mean per-problem difference, problems
    resampled with replacement (the pairs kept), rng `np.random.default_rng(seed)`."""
    res = bootstrap((run_N, base_N), _mean_difference, resamples=resamples, seed=np.random.default_rng(seed),
                    confidence=confidence)
    return float(res.confidence_interval.low), float(res.confidence_interval.high), float(res.standard_error)
