"""The quality rule (jopd.lab.quality) on constructed per-problem data, against independent references."""

from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from jopd.lab import quality as q
from jopd.lab.runs import EvalData

N = 530


def problems(seed=0):
    """Per-problem difficulty shared by every run: the reason the paired interval is narrow."""
    return np.random.default_rng(seed).gamma(2.0, 0.3, N)


def scaled(base, factor, rel_noise, seed):
    """A run whose every problem is `factor` x the base's, times small independent noise; mean rescaled so
    that the rise is exactly factor - 1."""
    r = base * factor * (1 + rel_noise * np.random.default_rng(seed).standard_normal(N))
    return r * (factor * base.mean() / r.mean())


def test_rise_of_25pct_with_small_spread_fails():
    base = problems()
    run = scaled(base, 1.25, 0.05, 1)
    v = q.quality_rule(run, base)
    assert v.rise == pytest.approx(0.25, abs=1e-12) and v.n == N
    assert v.diff_mean == pytest.approx(run.mean() - base.mean())
    assert 0 < v.ci_low < v.diff_mean < v.ci_high
    assert v.verdict == "FAIL"
    # ">= threshold": a rise exactly at the threshold fails too
    assert q.quality_rule(run, base, threshold=v.rise).verdict == "FAIL"
    assert q.quality_rule(run, base, threshold=v.rise + 1e-9).verdict == "PASS"


def test_rise_of_25pct_with_a_huge_paired_spread_passes():
    base = problems()
    # most problems get ~0, 5% get 20x: the same +25% on average, but the difference is dominated by few problems
    k = np.where(np.random.default_rng(2).random(N) < 0.05, 20.0, 0.0)
    k[:3] = 20.0  # never all zero
    run = base * 1.25 * k * (base.sum() / (base * k).sum())
    v = q.quality_rule(run, base)
    assert v.rise == pytest.approx(0.25, abs=1e-12)
    assert v.ci_low < 0 < v.ci_high
    assert v.verdict == "PASS" and "includes 0" in v.reason


def test_rise_of_10pct_passes_even_though_significant():
    base = problems()
    v = q.quality_rule(scaled(base, 1.10, 0.05, 3), base)
    assert v.rise == pytest.approx(0.10, abs=1e-12) and v.ci_low > 0
    assert v.verdict == "PASS"


def test_a_fall_passes():
    base = problems()
    v = q.quality_rule(scaled(base, 0.7, 0.05, 4), base)
    assert v.rise == pytest.approx(-0.3, abs=1e-12) and v.ci_high < 0
    assert v.verdict == "PASS"


def test_ci_matches_scipy_paired_bootstrap_within_monte_carlo_error():
    base = problems()
    run = scaled(base, 1.15, 0.3, 5)
    d = run - base
    v = q.quality_rule(run, base, resamples=10000, seed=0)
    ref = scipy.stats.bootstrap((run, base), lambda x, y, axis: np.mean(x, axis) - np.mean(y, axis), paired=True,
                                vectorized=True, n_resamples=10000, method="percentile", rng=12345)
    se = d.std(ddof=1) / np.sqrt(N)
    # an endpoint's Monte-Carlo s.d. with 10^4 resamples is ~0.03 se; the two estimates differ by ~0.04 se
    assert v.ci_low == pytest.approx(ref.confidence_interval.low, abs=0.2 * se)
    assert v.ci_high == pytest.approx(ref.confidence_interval.high, abs=0.2 * se)
    assert v.se == pytest.approx(d.std(ddof=0) / np.sqrt(N), rel=0.05)
    # an independent reference: a numpy paired bootstrap of the mean difference
    rng = np.random.default_rng(7)
    means = np.array([d[rng.integers(0, N, N)].mean() for _ in range(4000)])
    lo, hi = np.quantile(means, [0.025, 0.975])
    assert v.ci_low == pytest.approx(lo, abs=0.25 * se) and v.ci_high == pytest.approx(hi, abs=0.25 * se)
    # and the pairing matters: ignoring it (independent resampling of the two runs) gives a far wider interval
    unpaired = scipy.stats.bootstrap((run, base), lambda x, y, axis: np.mean(x, axis) - np.mean(y, axis),
                                     paired=False, vectorized=True, n_resamples=2000, method="percentile", rng=1)
    width = unpaired.confidence_interval.high - unpaired.confidence_interval.low
    assert width > 2 * (v.ci_high - v.ci_low)


def test_same_seed_same_interval():
    base = problems()
    run = scaled(base, 1.2, 0.2, 6)
    a, b = q.quality_rule(run, base, seed=3), q.quality_rule(run, base, seed=3)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)


def test_bad_values_are_errors_not_results():
    base = problems()
    with pytest.raises(ValueError, match="base: mean teacher divergence is 0"):
        q.quality_rule(base, np.zeros(N))
    bad = base.copy()
    bad[7] = np.nan
    with pytest.raises(ValueError, match="run: 1 non-finite value.*position 7"):
        q.quality_rule(bad, base)
    with pytest.raises(ValueError, match="run has 529 problems but base has 530"):
        q.quality_rule(base[:-1], base)
    with pytest.raises(ValueError, match="threshold"):
        q.quality_rule(base, base, threshold=float("nan"))


def ev(index, values, path="x.csv"):
    return EvalData(Path(path), np.asarray(index), np.asarray(values, float))


def test_pairing_leaves_out_problems_either_side_did_not_score():
    base, run = problems(), problems() * 2
    base[[3, 7]], run[[7, 11]] = np.nan, np.nan
    with pytest.warns(UserWarning, match=r"3 of 530 problems left out.*2 in base.csv, 2 in run.csv"):
        ids, r, b = q.pair(ev(np.arange(N), run, "run.csv"), ev(np.arange(N), base, "base.csv"))
    np.testing.assert_array_equal(ids, np.setdiff1d(np.arange(N), [3, 7, 11]))
    assert np.isfinite(r).all() and np.isfinite(b).all() and len(r) == len(b) == N - 3
    ones = np.ones(N)
    _, c_r, _ = q.pair(EvalData(Path("r"), np.arange(N), run, ones), EvalData(Path("b"), np.arange(N), base, ones),
                       "correct")
    assert len(c_r) == N  # correctness is kept for every problem


def test_pairing_by_index_and_differing_problem_sets():
    base = problems()
    perm = np.random.default_rng(0).permutation(N)
    ids, r, b = q.pair(ev(perm, base[perm] * 2, "run.csv"), ev(np.arange(N), base, "base.csv"))
    np.testing.assert_array_equal(ids, np.arange(N))
    np.testing.assert_allclose(r, 2 * base)  # re-ordered by problem id, not by file order
    np.testing.assert_allclose(b, base)

    run_ids = np.r_[np.arange(3, N), [600, 601]]  # lacks 0, 1, 2; has two the base lacks
    with pytest.raises(ValueError) as e:
        q.pair(ev(run_ids, np.ones(len(run_ids)), "run.csv"), ev(np.arange(N), base, "base.csv"))
    msg = str(e.value)
    assert "3 of the 530 problems in base.csv are missing from run.csv (ids 0, 1, 2)" in msg
    assert "2 of the 529 in run.csv are missing from base.csv (ids 600, 601)" in msg
    assert "\n" not in msg


# --- seed-aware rule ---------------------------------------------------------------------------------------

def seeds(base, factors, rel_noise, seed):
    return [scaled(base, f, rel_noise, seed + i) for i, f in enumerate(factors)]


def test_seed_aware_passes_where_the_base_seeds_spread_as_much_as_the_rise():
    p = problems()
    bases = seeds(p, [0.5 / 0.6, 1.0, 0.7 / 0.6], 0.02, 10)  # base seed means spread +-17%
    runs = seeds(p, [0.95, 1.25, 1.55], 0.02, 20)
    s = q.seed_aware_rule(runs, bases, resamples=4000)
    assert s.rise == pytest.approx(0.25, abs=1e-9) and s.rise >= s.threshold
    assert s.ci_low < 0 < s.ci_high and s.verdict == "PASS"
    assert s.rise_ci_low < 0 < s.rise_ci_high  # the same replicates on the rise's scale agree
    # the per-run rule (problems only) fails most seed pairs: it cannot see the seeds' spread
    assert s.per_run_fails >= 5 and s.disagree
    assert {(p["run"], p["base"]) for p in s.pairs} == {(i, j) for i in range(3) for j in range(3)}
    one = q.quality_rule(runs[2], bases[0])
    pair = next(p for p in s.pairs if (p["run"], p["base"]) == (2, 0))
    assert pair["verdict"] == one.verdict == "FAIL" and pair["rise"] == pytest.approx(one.rise)
    # the base's own spread
    m = np.array([b.mean() for b in bases])
    np.testing.assert_allclose(s.base_seed_rises, m / m.mean() - 1)
    assert s.base_rel_std == pytest.approx(m.std(ddof=1) / m.mean())
    assert s.rise_over_base_std == pytest.approx(0.25 / s.base_rel_std)


def test_seed_aware_fails_a_rise_far_beyond_the_base_seeds_spread():
    p = problems()
    s = q.seed_aware_rule(seeds(p, [1.28, 1.30, 1.32], 0.02, 30), seeds(p, [0.99, 1.0, 1.01], 0.02, 40),
                          resamples=4000)
    assert s.rise == pytest.approx(0.30, abs=1e-9) and s.ci_low > 0 and s.verdict == "FAIL"
    assert s.per_run_fails == 9 and not s.disagree
    assert s.rise_over_base_std > 10


def test_hierarchical_bootstrap_spread_matches_its_analytic_variance():
    # no problem noise: only the seed draw varies; the mean of S draws with replacement has variance var0 / S
    run_means, base_means = np.array([0.6, 0.75, 0.9]), np.array([0.5, 0.6, 0.7, 0.65])
    runs = [np.full(N, m) for m in run_means]
    bases = [np.full(N, m) for m in base_means]
    s = q.seed_aware_rule(runs, bases, resamples=8000, seed=1)
    expected = np.sqrt(run_means.var() / 3 + base_means.var() / 4)
    assert s.se == pytest.approx(expected, rel=0.05)
    # one seed a side: it is the per-run rule's paired problem bootstrap
    p = problems()
    run, base = scaled(p, 1.15, 0.3, 5), p
    s1, v = q.seed_aware_rule([run], [base], resamples=10000), q.quality_rule(run, base)
    d = run - base
    assert s1.se == pytest.approx(d.std() / np.sqrt(N), rel=0.05)
    assert s1.ci_low == pytest.approx(v.ci_low, abs=0.2 * v.se)
    assert s1.ci_high == pytest.approx(v.ci_high, abs=0.2 * v.se)
    assert s1.base_rel_std is None and s1.rise_over_base_std is None


def test_seed_aware_errors():
    p = problems()
    with pytest.raises(ValueError, match="at least one seed"):
        q.seed_aware_rule([p], [])
    with pytest.raises(ValueError, match="run seed 0 has 530 problems but base seed 1 has 529"):
        q.seed_aware_rule([p], [p, p[:-1]])
    with pytest.raises(ValueError, match="base seed 0: mean teacher divergence is 0"):
        q.seed_aware_rule([p], [np.zeros(N), p])


def test_check_comparable(tmp_path):
    def run_dir(name, **train):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text("loss: {kind: topk_rkl}\ntrain: {" + ", ".join(f"{k}: {v}" for k, v in
                                                                                  train.items()) + "}\n")
        return d

    a, b = run_dir("a", steps=400, seed=0, eval_seed=5), run_dir("b", steps=400, seed=1, eval_seed=5)
    c = run_dir("c", steps=200, seed=2, eval_seed=5)
    d = run_dir("d", steps=400, seed=0, eval_seed=6)
    assert q.check_comparable([a], [b], "after") == []
    with pytest.raises(ValueError, match="train.steps=400 .* has 200"):
        q.check_comparable([a], [c], "after")
    assert q.check_comparable([a], [c], "step_200") == []
    with pytest.raises(ValueError, match="same train.seed=0"):
        q.check_comparable([a, d], [b], "after")
    assert "eval_seed differ (5, 6)" in q.check_comparable([a], [d], "after")[0]
    with pytest.raises(ValueError, match="given twice"):
        q.check_comparable([a], [tmp_path / "x" / ".." / "a"], "after")
