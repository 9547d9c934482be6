"""The **quality rule**: did a run's held-out teacher divergence rise against its baseline run at the same step?

Per problem, the held-out eval (`RUN_DIR/eval/NAME.csv`, written by `jopd train` / `jopd eval`, read by
`jopd.lab.runs.read_eval`) holds the student's mean per-token KL(student ‖ teacher) over its response. Two runs
evaluated on the same problems under the study's fixed eval seed are compared problem by problem:

- rise = mean(run) / mean(base) − 1;
- a paired bootstrap interval of the mean per-problem difference (run − base);
- FAIL iff rise ≥ threshold (default 0.2) **and** the interval excludes 0, else PASS.

That interval sees only problem-to-problem noise, not training-seed noise, so `seed_aware_rule` adds the
verdict for several training seeds of each side (a bootstrap over seeds and problems) and the rise measured
against the base seeds' own spread.

Pure numpy/scipy (no jax), so the lab's summaries run anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jopd.lab.runs import EvalData, config_field, read_run_config
from jopd.lab.stats import CI_METHOD, RESAMPLE_BATCH, mean_difference_ci


def _ids(ids: np.ndarray, k: int = 5) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:k])
    return shown + (", ..." if len(ids) > k else "")


def align(evals: Sequence[EvalData], column: str = "divergence") -> tuple[np.ndarray, list[np.ndarray]]:
    """(sorted problem ids, each eval's `column` (divergence, or correct) in that order). Every eval must hold
    exactly the problems of the first: otherwise a ValueError says how many are missing from each side (never a
    silent subset). For `divergence`, a problem left unscored (NaN) in any eval is left out of all of them, with a
    warning naming the files and the count: a comparison pairs only problems both sides scored."""
    if not evals:
        raise ValueError("align: no evals given")
    ref = evals[0]
    ids = np.sort(ref.index)
    out = []
    for e in evals:
        only_ref = np.setdiff1d(ref.index, e.index)
        only_e = np.setdiff1d(e.index, ref.index)
        if len(only_ref) or len(only_e):
            raise ValueError(
                f"problem sets differ: {len(only_ref)} of the {len(ref.index)} problems in {ref.path} are missing "
                f"from {e.path}" + (f" (ids {_ids(only_ref)})" if len(only_ref) else "")
                + f", and {len(only_e)} of the {len(e.index)} in {e.path} are missing from {ref.path}"
                + (f" (ids {_ids(only_e)})" if len(only_e) else "")
                + "; evaluate both runs on the same problems (same train.eval_problems)")
        out.append(getattr(e, column)[np.argsort(e.index)])
    if column == "divergence":
        scored = np.all([np.isfinite(a) for a in out], axis=0)
        if not scored.all():
            why = ", ".join(f"{e.unscored} in {e.path}" for e in evals if e.unscored)
            warnings.warn(f"{int((~scored).sum())} of {len(ids)} problems left out of the comparison: their "
                          f"divergence is NaN (unscored: {why})", stacklevel=2)
            ids, out = ids[scored], [a[scored] for a in out]
    return ids, out


def pair(run: EvalData, base: EvalData, column: str = "divergence") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(problem ids, run values, base values) of `column`, paired by problem id; see `align` for the errors."""
    ids, (b, r) = align([base, run], column)
    return ids, r, b


@dataclasses.dataclass(frozen=True)
class QualityVerdict:
    """The quality rule's result for one run against one baseline run."""

    n: int  # problems paired
    run_mean: float
    base_mean: float
    rise: float  # run_mean / base_mean - 1
    diff_mean: float  # mean over problems of (run - base)
    ci_low: float  # paired bootstrap interval of diff_mean
    ci_high: float
    se: float  # bootstrap standard error of diff_mean
    threshold: float
    confidence: float
    resamples: int
    verdict: str  # "PASS" | "FAIL"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ci_method": CI_METHOD}


def _check_arrays(named: dict[str, np.ndarray], n_min: int = 2) -> int:
    n, first = None, None
    for name, a in named.items():
        if a.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array of per-problem divergences, got shape {a.shape}")
        if n is not None and len(a) != n:
            raise ValueError(f"{first} has {n} problems but {name} has {len(a)} (pair them by index first)")
        n, first = len(a), first or name
        bad = np.flatnonzero(~np.isfinite(a))
        if len(bad):
            raise ValueError(f"{name}: {len(bad)} non-finite value(s) (first at position {bad[0]}: {a[bad[0]]})")
    if n is None or n < n_min:
        raise ValueError(f"need at least {n_min} paired problems, got {n or 0}")
    return n


def _check_params(threshold: float, resamples: int, confidence: float) -> None:
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold: must be a finite number >= 0, got {threshold}")
    if int(resamples) != resamples or resamples < 1:
        raise ValueError(f"resamples: must be a positive integer, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must lie in (0, 1), got {confidence}")


def _judge(rise: float, lo: float, hi: float, threshold: float, confidence: float) -> tuple[str, str]:
    excludes = lo > 0 or hi < 0
    ci = f"the {confidence:.0%} CI [{lo:+.4g}, {hi:+.4g}]"
    if rise >= threshold and excludes:
        return "FAIL", f"rise {rise:+.1%} >= {threshold:+.1%} and {ci} excludes 0"
    if rise < threshold:
        return "PASS", f"rise {rise:+.1%} < {threshold:+.1%}"
    return "PASS", f"rise {rise:+.1%} >= {threshold:+.1%} but {ci} includes 0"


def quality_rule(run_B: np.ndarray, base_B: np.ndarray, threshold: float = 0.2, resamples: int = 10000,
                 seed: int = 0, confidence: float = 0.95) -> QualityVerdict:
    """The per-run quality rule on per-problem divergences already paired (same order, same problems).

    CI: `jopd.lab.stats.mean_difference_ci` (scipy's paired percentile bootstrap) of mean(run) − mean(base) =
    the mean of the paired differences, `resamples` resamples, rng seeded by `seed`; all differences equal ->
    [d, d].
    FAIL iff rise >= threshold and the CI excludes 0 (ci_low > 0 or ci_high < 0).
    """
    run_B, base_B = np.asarray(run_B, np.float64), np.asarray(base_B, np.float64)
    n = _check_arrays({"run": run_B, "base": base_B})
    _check_params(threshold, resamples, confidence)
    run_mean, base_mean = float(run_B.mean()), float(base_B.mean())
    if base_mean <= 0:
        raise ValueError(f"base: mean teacher divergence is {base_mean:.6g}; the rise is undefined unless it is > 0")
    lo, hi, se = mean_difference_ci(run_B, base_B, resamples=resamples, seed=seed, confidence=confidence)
    rise = run_mean / base_mean - 1
    verdict, reason = _judge(rise, lo, hi, threshold, confidence)
    return QualityVerdict(n=n, run_mean=run_mean, base_mean=base_mean, rise=rise, diff_mean=run_mean - base_mean,
                          ci_low=lo, ci_high=hi, se=se, threshold=float(threshold),
                          confidence=float(confidence), resamples=int(resamples), verdict=verdict, reason=reason)


@dataclasses.dataclass(frozen=True)
class SeedAwareVerdict:
    """The quality rule over training seeds of both sides (see `seed_aware_rule` for the definitions)."""

    n: int  # problems (shared by every seed)
    run_seed_means: list[float]  # per run seed, mean over problems
    base_seed_means: list[float]
    run_mean: float  # mean of run_seed_means
    base_mean: float
    rise: float  # run_mean / base_mean - 1
    diff_mean: float  # run_mean - base_mean
    ci_low: float  # hierarchical bootstrap interval of diff_mean (the verdict's scale)
    ci_high: float
    se: float  # bootstrap standard deviation of diff_mean
    rise_ci_low: float  # the same replicates on the rise's scale
    rise_ci_high: float
    base_seed_rises: list[float]  # each base seed's mean / base_mean - 1: the base's own "rise" range
    base_rel_std: float | None  # std(base_seed_means, ddof=1) / base_mean; None with one base seed
    rise_over_base_std: float | None  # rise / base_rel_std
    threshold: float
    confidence: float
    resamples: int
    verdict: str
    reason: str
    pairs: list[dict[str, Any]]  # per-run rule for every (run seed i, base seed j): {"run": i, "base": j, ...}
    per_run_fails: int  # how many of the pairs FAIL under the per-run rule
    disagree: bool  # some pair's per-run verdict differs from this verdict

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ci_method": "hierarchical percentile bootstrap (seeds x problems)"}


def hierarchical_replicates(runs_SxN: np.ndarray, bases_SxN: np.ndarray, resamples: int,
                            seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap replicates of (run mean, base mean), each the mean over seeds of the mean over problems.

    Per replicate: draw the problems once with replacement (the same draw for every seed of both sides: the
    problems are crossed with the seeds and paired with the base, so resampling them separately per seed would
    throw the pairing away), and draw each side's seeds with replacement, independently. With S seeds on a side
    this spreads the seed means by sqrt((S-1)/S) of their standard error, i.e. a little too narrow for 2-3 seeds.
    """
    rng = np.random.default_rng(seed)
    n = runs_SxN.shape[1]
    out_r, out_b = [], []
    for start in range(0, resamples, RESAMPLE_BATCH):
        m = min(RESAMPLE_BATCH, resamples - start)
        w_prob = rng.multinomial(n, np.full(n, 1 / n), size=m) / n  # [m, n] problem weights
        w_run = rng.multinomial(len(runs_SxN), np.full(len(runs_SxN), 1 / len(runs_SxN)), size=m) / len(runs_SxN)
        w_base = rng.multinomial(len(bases_SxN), np.full(len(bases_SxN), 1 / len(bases_SxN)), size=m) / len(bases_SxN)
        out_r.append(((w_run @ runs_SxN) * w_prob).sum(1))
        out_b.append(((w_base @ bases_SxN) * w_prob).sum(1))
    return np.concatenate(out_r), np.concatenate(out_b)


def seed_aware_rule(runs: Sequence[np.ndarray], bases: Sequence[np.ndarray], threshold: float = 0.2,
                    resamples: int = 10000, seed: int = 0, confidence: float = 0.95) -> SeedAwareVerdict:
    """The quality rule when several training seeds of the run and of the base were evaluated.

    Inputs: per seed, the per-problem divergences, all on the same problems in the same order (`align`).
    - run_mean, base_mean: the mean over that side's seeds of each seed's mean over problems;
      rise = run_mean / base_mean − 1, diff_mean = run_mean − base_mean.
    - CI: percentile interval of diff_mean over `hierarchical_replicates` (seeds and problems resampled; the
      same replicates give the rise's interval). Verdict: FAIL iff rise >= threshold and the interval of the
      **difference** excludes 0. (Every replicate's base mean is > 0, so the rise's interval excludes 0
      exactly when the difference's does, up to quantile interpolation.)
    - The base seeds' own spread: each base seed's mean against base_mean (`base_seed_rises`), their relative
      standard deviation (ddof=1), and rise / that std: a rise of a few base standard deviations is a rise
      that the base's own reruns do not produce.
    - `pairs`: the per-run rule (problems only) for every run seed against every base seed, i.e. what the seed
      study's one-run-per-side comparison would have said for each choice of runs; `disagree` flags pairs
      whose verdict differs from the seed-aware one.
    """
    runs = [np.asarray(r, np.float64) for r in runs]
    bases = [np.asarray(b, np.float64) for b in bases]
    if not runs or not bases:
        raise ValueError(f"need at least one seed on each side, got {len(runs)} run and {len(bases)} base seed(s)")
    n = _check_arrays({**{f"run seed {i}": r for i, r in enumerate(runs)},
                       **{f"base seed {j}": b for j, b in enumerate(bases)}})
    _check_params(threshold, resamples, confidence)
    R, B = np.stack(runs), np.stack(bases)
    run_means, base_means = R.mean(1), B.mean(1)
    run_mean, base_mean = float(run_means.mean()), float(base_means.mean())
    if (base_means <= 0).any():
        j = int(np.flatnonzero(base_means <= 0)[0])
        raise ValueError(f"base seed {j}: mean teacher divergence is {base_means[j]:.6g}; the rise needs > 0")
    rep_r, rep_b = hierarchical_replicates(R, B, int(resamples), seed)
    alpha = (1 - confidence) / 2
    lo, hi = (float(v) for v in np.quantile(rep_r - rep_b, [alpha, 1 - alpha]))
    rlo, rhi = (float(v) for v in np.quantile(rep_r / rep_b - 1, [alpha, 1 - alpha]))
    rise = run_mean / base_mean - 1
    verdict, reason = _judge(rise, lo, hi, threshold, confidence)
    rel_std = float(base_means.std(ddof=1) / base_mean) if len(bases) > 1 else None
    pairs = []
    for i, r in enumerate(runs):
        for j, b in enumerate(bases):
            v = quality_rule(r, b, threshold, resamples, seed, confidence)
            pairs.append({"run": i, "base": j, "rise": v.rise, "ci_low": v.ci_low, "ci_high": v.ci_high,
                          "verdict": v.verdict})
    fails = sum(p["verdict"] == "FAIL" for p in pairs)
    return SeedAwareVerdict(
        n=n, run_seed_means=run_means.tolist(), base_seed_means=base_means.tolist(), run_mean=run_mean,
        base_mean=base_mean, rise=rise, diff_mean=run_mean - base_mean, ci_low=lo, ci_high=hi,
        se=float(np.std(rep_r - rep_b, ddof=1)), rise_ci_low=rlo, rise_ci_high=rhi,
        base_seed_rises=(base_means / base_mean - 1).tolist(), base_rel_std=rel_std,
        rise_over_base_std=(rise / rel_std if rel_std else None), threshold=float(threshold),
        confidence=float(confidence), resamples=int(resamples), verdict=verdict, reason=reason, pairs=pairs,
        per_run_fails=fails, disagree=any(p["verdict"] != verdict for p in pairs))


def check_comparable(run_dirs: Sequence[str | Path], base_dirs: Sequence[str | Path], eval_name: str) -> list[str]:
    """Checks, from the runs' config.yaml where present, that the comparison means what it says.

    Errors (ValueError): a directory given twice; `after` evals of runs with different `train.steps` (not the
    same step); two dirs on one side with the same `train.seed` (not two training seeds). Returns warnings:
    differing `train.eval_seed` (the per-problem pairing then pairs different sampling draws).
    """
    dirs = [Path(d) for d in [*run_dirs, *base_dirs]]
    seen: dict[Path, Path] = {}
    for d in dirs:
        key = d.resolve()
        if key in seen:
            raise ValueError(f"{d}: the same run directory is given twice (as {seen[key]} too)")
        seen[key] = d
    cfgs = {d: read_run_config(d) for d in dirs}
    train = lambda d, key: config_field(cfgs[d], "train", key)  # noqa: E731
    if eval_name == "after":
        steps = {d: train(d, "steps") for d in cfgs if train(d, "steps") is not None}
        if len(set(steps.values())) > 1:
            (d1, s1), (d2, s2) = next((a, b) for a in steps.items() for b in steps.items() if a[1] != b[1])
            raise ValueError(f"{d1}/config.yaml has train.steps={s1} but {d2}/config.yaml has {s2}: their 'after' "
                             f"evals are not at the same step (pass --eval step_N)")
    for side in (run_dirs, base_dirs):
        by_seed: dict[Any, Path] = {}
        for d in map(Path, side):
            s = train(d, "seed")
            if s is None:
                continue
            if s in by_seed:
                raise ValueError(f"{d}/config.yaml and {by_seed[s]}/config.yaml have the same train.seed={s}: "
                                 f"not two training seeds")
            by_seed[s] = d
    eval_seeds = {train(d, "eval_seed") for d in cfgs if train(d, "eval_seed") is not None}
    if len(eval_seeds) > 1:
        return [f"the runs' train.eval_seed differ ({', '.join(map(str, sorted(eval_seeds)))}): problems are "
                f"paired, but their sampling draws are not"]
    return []
