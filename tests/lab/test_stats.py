"""`jopd.lab.stats`: the one bootstrap behind the lab's intervals, against the normal approximation, a direct
resampling by hand and scipy called directly; and its degenerate cases."""

import numpy as np
import pytest
import scipy.stats

from jopd.lab import stats


def test_paired_interval_matches_the_normal_approximation():
    diff = np.random.default_rng(3).choice([-1.0, 0.0, 0.0, 1.0], 2000)
    lo, hi, se = stats.mean_difference_ci(diff, np.zeros_like(diff), resamples=4000, seed=0, confidence=0.95)
    sem = diff.std() / np.sqrt(len(diff))
    assert lo == pytest.approx(diff.mean() - 1.96 * sem, abs=0.2 * sem)
    assert hi == pytest.approx(diff.mean() + 1.96 * sem, abs=0.2 * sem)
    assert se == pytest.approx(sem, rel=0.1)


@pytest.mark.parametrize("resamples", [500, 4500])
def test_paired_interval_draws_problem_indices_from_default_rng(resamples):
    """The same interval as resampling the problems by hand (rng.integers, 2000 resamples at a time): what the
    broke criterion computed before it used the shared bootstrap."""
    rng = np.random.default_rng(1)
    run, base = (rng.random(300) < 0.5).astype(float), (rng.random(300) < 0.6).astype(float)
    draw = np.random.default_rng(7)
    means = np.concatenate([(run - base)[draw.integers(0, 300, (min(2000, resamples - k), 300))].mean(1)
                            for k in range(0, resamples, 2000)])
    lo, hi, _ = stats.mean_difference_ci(run, base, resamples=resamples, seed=7, confidence=0.9)
    np.testing.assert_allclose([lo, hi], np.quantile(means, [0.05, 0.95]), rtol=0, atol=1e-12)


def test_estimate_is_scipys_bootstrap_and_degenerate_data_has_no_width():
    x = np.random.default_rng(2).gamma(2.0, 1.0, 80)
    ref = scipy.stats.bootstrap((x,), np.mean, n_resamples=1000, method="percentile", random_state=4)
    e = stats.mean_estimate(x, 1000, seed=4)
    assert e.mean == pytest.approx(x.mean())
    assert (e.ci_low, e.ci_high) == (ref.confidence_interval.low, ref.confidence_interval.high)
    n = np.arange(1.0, 81.0)
    ratio = lambda a, b, axis=-1: b.sum(axis) / a.sum(axis)  # noqa: E731
    r = stats.estimate((n, n * x), ratio, resamples=1000, seed=4)
    ref = scipy.stats.bootstrap((n, n * x), ratio, paired=True, vectorized=True, n_resamples=1000,
                                method="percentile", random_state=4)
    assert r.mean == pytest.approx((n * x).sum() / n.sum())
    assert (r.ci_low, r.ci_high) == (ref.confidence_interval.low, ref.confidence_interval.high)
    assert stats.mean_estimate(np.full(5, 0.3), 100) == stats.Estimate(0.3, 0.3, 0.3)
    assert stats.mean_estimate(np.array([2.0]), 100) == stats.Estimate(2.0, 2.0, 2.0)
    assert all(np.isnan(v) for v in stats.mean_estimate(np.zeros(0), 100).to_dict().values())
