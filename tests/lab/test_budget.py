"""Screening logic (jopd.lab.budget) on synthetic calibration runs."""

import math

import pytest

from jopd.lab import budget as sc

# mean mismatch (nats/token) and full-run verdicts shaped like the seed study: everything up to 0.184 passed,
# runs near 0.39 failed
STUDY = [(0.0, "PASS"), (4e-5, "PASS"), (8.4e-4, "PASS"), (0.011, "PASS"), (0.184, "PASS"), (0.39, "FAIL"),
         (0.395, "FAIL"), (3.4, "FAIL")]


def test_threshold_lies_inside_the_bracket_at_its_log_midpoint():
    c = sc.calibrate(STUDY)
    assert (c.bracket_low, c.bracket_high) == (0.184, 0.39)
    assert c.bracket_low < c.threshold < c.bracket_high
    assert math.log(c.threshold) == pytest.approx((math.log(0.184) + math.log(0.39)) / 2)
    assert not c.lower_bound_only and c.non_monotone == [] and (c.n_pass, c.n_fail) == (5, 3)
    # the input order does not matter
    assert sc.calibrate(STUDY[::-1]).threshold == c.threshold


def test_decisions_admit_reject_undecided():
    c = sc.calibrate(STUDY)
    t = c.threshold
    near = sc.decide(t * 1.05, t * 0.8, t * 1.3, c)  # interval straddles the threshold
    assert near.decision == "undecided" and near.log10_ratio == pytest.approx(math.log10(1.05))
    low = sc.decide(0.01, 0.008, 0.012, c)
    assert low.decision == "admit" and low.log10_ratio == pytest.approx(math.log10(0.01 / t)) and low.log10_ratio < -1
    high = sc.decide(1.0, 0.9, 1.1, c)
    assert high.decision == "reject" and high.log10_ratio == pytest.approx(math.log10(1.0 / t)) and high.log10_ratio > 0
    # an interval that only touches the threshold is undecided (the candidate may be exactly at the budget)
    assert sc.decide(t * 0.9, t * 0.8, t, c).decision == "undecided"
    # a point estimate (zero-width interval) just below the threshold is admitted
    assert sc.decide(t * 0.99, t * 0.99, t * 0.99, c).decision == "admit"
    zero = sc.decide(0.0, 0.0, 0.0, c)
    assert zero.decision == "admit" and zero.log10_ratio == -math.inf and zero.to_dict()["log10_ratio"] is None


def test_non_monotone_calibration_is_reported_and_the_bracket_kept():
    runs = STUDY + [(1.0, "PASS"), (0.39, "PASS")]  # passes at and above the lowest FAIL
    c = sc.calibrate(runs, labels=[f"r{i}" for i in range(len(runs))])
    assert [(o["label"], o["mismatch"]) for o in c.non_monotone] == [("r9", 0.39), ("r8", 1.0)]
    assert (c.bracket_low, c.bracket_high) == (0.184, 0.39)
    assert c.threshold == sc.calibrate(STUDY).threshold
    assert "non-monotone: 2 PASS run(s)" in c.note


def test_without_fail_runs_the_budget_is_a_lower_bound():
    c = sc.calibrate([(0.0, "PASS"), (0.01, "PASS"), (0.2, "PASS")])
    assert c.lower_bound_only and c.threshold == 0.2 and c.bracket_high is None
    assert "only known to be >= 0.2" in c.note
    assert sc.decide(0.05, 0.04, 0.06, c).decision == "admit"
    above = sc.decide(1.0, 0.9, 1.1, c)
    assert above.decision == "undecided" and "no calibration run failed" in above.reason


@pytest.mark.parametrize("runs, message", [
    ([], "no calibration runs"),
    ([(0.5, "FAIL"), (1.0, "FAIL")], "no PASS run"),
    ([(0.1, "FAIL"), (0.5, "PASS")], "no PASS run below the lowest FAIL"),
    ([(0.0, "PASS"), (0.5, "FAIL")], "has mismatch 0"),
    ([(0.1, "pass")], "verdict must be PASS or FAIL"),
    ([(float("nan"), "PASS")], "run 0: mismatch must be a finite number >= 0"),
    ([(-1e-3, "PASS")], "mismatch must be a finite number >= 0"),
])
def test_calibration_errors(runs, message):
    with pytest.raises(ValueError, match=message):
        sc.calibrate(runs)


def test_decide_rejects_an_interval_that_does_not_hold_its_mean():
    with pytest.raises(ValueError, match="does not contain its mean"):
        sc.decide(0.5, 0.6, 0.7, sc.calibrate(STUDY))


def test_match_counter():
    m = sc.count_matches(["admit", "reject", "undecided", "admit", "reject", "admit"],
                         ["PASS", "FAIL", "FAIL", "FAIL", "PASS", "PASS"])
    assert (m.total, m.decided, m.matched, m.mismatched, m.undecided) == (6, 5, 3, 2, 1)
    assert m.mismatched_at == [3, 4]
    with pytest.raises(ValueError, match="2 decisions but 1 verdicts"):
        sc.count_matches(["admit", "reject"], ["PASS"])
    with pytest.raises(ValueError, match="decision 0: must be one of"):
        sc.count_matches(["yes"], ["PASS"])
