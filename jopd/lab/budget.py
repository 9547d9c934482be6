"""The **screening check**'s logic: calibrate a student's mismatch budget from full runs with quality-rule
verdicts, then admit / reject / leave undecided a candidate rollout setup from its measured mismatch alone.

Mismatch (nats/token, mean over training steps) spans orders of magnitude between setups (bf16 ~1e-5, logit
noise ~1), so it is compared on a log scale: the admission threshold is the geometric mean of the bracket's ends
and a candidate's distance to it is log10(mismatch / threshold) (+1: ten times over the budget).

The calibration assumes quality falls monotonically with mismatch; where full runs contradict that (a PASS at
or above the lowest FAIL) it is reported, not hidden. Pure python/numpy.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

VERDICTS = ("PASS", "FAIL")
DECISIONS = ("admit", "reject", "undecided")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The budget calibrated from full runs; see `calibrate` for the definitions."""

    threshold: float  # admission threshold (nats/token)
    bracket_low: float  # highest PASS mismatch below the lowest FAIL (or the highest PASS when no FAIL)
    bracket_high: float | None  # lowest FAIL mismatch; None when no run failed
    lower_bound_only: bool  # no FAIL: the budget is only known to be >= threshold
    non_monotone: list[dict[str, Any]]  # PASS runs at or above the lowest FAIL: {"label", "mismatch"}
    n_pass: int
    n_fail: int
    note: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _label(labels: Sequence[str] | None, i: int) -> str:
    return labels[i] if labels is not None else f"run {i}"


def calibrate(runs: Sequence[tuple[float, str]], labels: Sequence[str] | None = None) -> Calibration:
    """Budget from full runs given as (mean mismatch, "PASS" | "FAIL"), optionally named by `labels`.

    bracket = (the highest PASS mismatch strictly below the lowest FAIL mismatch, the lowest FAIL mismatch);
    threshold = sqrt(low * high), the midpoint on a log scale. PASS runs at or above the lowest FAIL make the
    calibration non-monotone: they are listed in `non_monotone` and the bracket is still defined as above.
    Without FAIL runs the budget is only a lower bound: threshold = the highest PASS, `lower_bound_only`.
    Errors: no runs, no PASS run, no PASS run below the lowest FAIL, a bracket starting at 0 (no log midpoint),
    a mismatch that is negative or not finite, a verdict other than PASS/FAIL.
    """
    if not runs:
        raise ValueError("calibrate: no calibration runs")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"calibrate: {len(labels)} labels for {len(runs)} runs")
    for i, (m, v) in enumerate(runs):
        if v not in VERDICTS:
            raise ValueError(f"{_label(labels, i)}: verdict must be PASS or FAIL, got {v!r}")
        if not (isinstance(m, numbers.Real) and math.isfinite(m) and m >= 0):
            raise ValueError(f"{_label(labels, i)}: mismatch must be a finite number >= 0, got {m!r}")
    passes = [(float(m), i) for i, (m, v) in enumerate(runs) if v == "PASS"]
    fails = [(float(m), i) for i, (m, v) in enumerate(runs) if v == "FAIL"]
    if not passes:
        raise ValueError(f"calibrate: no PASS run among {len(runs)}: nothing is known to be within the budget")
    if not fails:
        top = max(passes)[0]
        if top == 0:
            raise ValueError("calibrate: the only PASS runs have mismatch 0 and none failed: no budget to calibrate")
        return Calibration(threshold=top, bracket_low=top, bracket_high=None, lower_bound_only=True,
                           non_monotone=[], n_pass=len(passes), n_fail=0,
                           note=f"no FAIL run: the budget is only known to be >= {top:.3g} (the highest PASS)")
    lowest_fail = min(fails)[0]
    below = [m for m, _ in passes if m < lowest_fail]
    odd = [{"label": _label(labels, i), "mismatch": m} for m, i in sorted(passes) if m >= lowest_fail]
    if not below:
        raise ValueError(f"calibrate: no PASS run below the lowest FAIL mismatch {lowest_fail:.3g}: no bracket")
    low = max(below)
    if low == 0:
        raise ValueError(f"calibrate: the only PASS below the lowest FAIL ({lowest_fail:.3g}) has mismatch 0: "
                         f"no log-scale midpoint; add a passing run with mismatch > 0")
    threshold = math.sqrt(low * lowest_fail)
    note = f"bracket [{low:.3g}, {lowest_fail:.3g}), threshold {threshold:.3g} (geometric mean)"
    if odd:
        note += (f"; non-monotone: {len(odd)} PASS run(s) at or above the lowest FAIL ("
                 + ", ".join(f"{o['label']} at {o['mismatch']:.3g}" for o in odd) + ")")
    return Calibration(threshold=threshold, bracket_low=low, bracket_high=lowest_fail, lower_bound_only=False,
                       non_monotone=odd, n_pass=len(passes), n_fail=len(fails), note=note)


@dataclasses.dataclass(frozen=True)
class Decision:
    decision: str  # "admit" | "reject" | "undecided"
    mismatch: float
    ci_low: float
    ci_high: float
    threshold: float
    log10_ratio: float  # log10(mismatch / threshold); -inf for mismatch 0
    reason: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["log10_ratio"] = self.log10_ratio if math.isfinite(self.log10_ratio) else None
        return d


def decide(candidate_mismatch_mean: float, ci_low: float, ci_high: float, calibration: Calibration) -> Decision:
    """admit iff the candidate's mismatch interval lies below the threshold, reject iff above, undecided iff it
    straddles the threshold (ci_low <= threshold <= ci_high). With a lower-bound-only calibration (no FAIL run),
    a candidate above the threshold is undecided, not rejected: nothing there is known to fail."""
    m, lo, hi = candidate_mismatch_mean, ci_low, ci_high
    for name, v in (("candidate mismatch", m), ("ci_low", lo), ("ci_high", hi)):
        if not (isinstance(v, numbers.Real) and math.isfinite(v)):
            raise ValueError(f"{name}: must be a finite number, got {v!r}")
    if m < 0:
        raise ValueError(f"candidate mismatch: must be >= 0, got {m}")
    if not lo <= m <= hi:
        raise ValueError(f"candidate interval [{lo}, {hi}] does not contain its mean {m}")
    t = calibration.threshold
    ratio = math.log10(m / t) if m > 0 else -math.inf
    if lo <= t <= hi:
        decision, reason = "undecided", f"interval [{lo:.3g}, {hi:.3g}] straddles the threshold {t:.3g}"
    elif hi < t:
        decision, reason = "admit", f"interval [{lo:.3g}, {hi:.3g}] lies below the threshold {t:.3g}"
    elif calibration.lower_bound_only:
        decision, reason = "undecided", (f"above the highest PASS {t:.3g}, and no calibration run failed: "
                                         f"the budget there is unknown")
    else:
        decision, reason = "reject", f"interval [{lo:.3g}, {hi:.3g}] lies above the threshold {t:.3g}"
    return Decision(decision=decision, mismatch=float(m), ci_low=float(lo), ci_high=float(hi), threshold=t,
                    log10_ratio=ratio, reason=reason)


@dataclasses.dataclass(frozen=True)
class MatchCount:
    """Screening decisions against the full runs' verdicts: admit matches PASS, reject matches FAIL."""

    total: int
    decided: int  # admit or reject
    matched: int
    mismatched: int
    undecided: int
    mismatched_at: list[int]  # positions of the wrong decisions

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def count_matches(decisions: Sequence[str], verdicts: Sequence[str]) -> MatchCount:
    """Compares each screening decision with the full run's verdict; undecided ones are counted apart."""
    if len(decisions) != len(verdicts):
        raise ValueError(f"count_matches: {len(decisions)} decisions but {len(verdicts)} verdicts")
    wrong, undecided = [], 0
    for i, (d, v) in enumerate(zip(decisions, verdicts)):
        if d not in DECISIONS:
            raise ValueError(f"decision {i}: must be one of {', '.join(DECISIONS)}, got {d!r}")
        if v not in VERDICTS:
            raise ValueError(f"verdict {i}: must be PASS or FAIL, got {v!r}")
        if d == "undecided":
            undecided += 1
        elif (d == "admit") != (v == "PASS"):
            wrong.append(i)
    decided = len(decisions) - undecided
    return MatchCount(total=len(decisions), decided=decided, matched=decided - len(wrong), mismatched=len(wrong),
                      undecided=undecided, mismatched_at=wrong)
