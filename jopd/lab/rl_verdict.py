"""The **broke** criterion for reward-trained runs (REINFORCE, GRPO) under a rollout setup, against the same
method's standard-engine run (BASE) at the same step.

A run BROKE iff either

1. **accuracy drop**: its held-out accuracy (`RUN_DIR/eval/NAME.csv`, column `correct`, the same problems and
   the same `train.eval_seed` draws as BASE) is below BASE's by at least `acc_margin` (absolute, default 0.05)
   **and** the paired 95% bootstrap interval of the mean per-problem difference (run − base, problems
   resampled) lies entirely below 0; or
2. **collapse**: over the last `tail` (20%) of its logged training steps (`RUN_DIR/metrics.jsonl`), any of
   - reward → 0: mean reward < `collapse_reward` (0.02) while BASE's mean reward over its own last 20% was higher;
   - entropy collapse: mean per-token entropy of the student on its rollouts < `collapse_entropy` (0.05 nats);
   - length pinned at the cap: on average >= `cap_fraction` (95%) of the rollouts end at `sampling.max_new_tokens`
     (the `response_at_cap` metric; runs logged without it fall back to mean length >= 95% of the cap);
   - NaN: a non-finite value in any training metric, at any step of the run.

Otherwise OK. The interval is over problems only (not training seeds), as in the quality rule.

Pure numpy (no jax): reads the files `jopd train` writes (`jopd.lab.runs`), so it runs anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from jopd.lab import quality as q
from jopd.lab.runs import config_field, read_eval, read_run_config, training_rows
from jopd.lab.stats import mean_difference_ci


@dataclasses.dataclass(frozen=True)
class Criterion:
    acc_margin: float = 0.05  # absolute accuracy drop (run below base) that can break a run
    collapse_reward: float = 0.02  # mean reward below this (with the base's higher) is a collapse
    collapse_entropy: float = 0.05  # nats per token
    cap_fraction: float = 0.95  # fraction of rollouts at max_new_tokens that counts as pinned
    tail: float = 0.2  # the last fraction of logged training steps the collapse signals look at
    resamples: int = 10_000
    seed: int = 0
    confidence: float = 0.95

    def __post_init__(self):
        for name in ("acc_margin", "collapse_reward", "collapse_entropy"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v}")
        for name in ("cap_fraction", "tail"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: must lie in (0, 1], got {getattr(self, name)}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: must lie in (0, 1), got {self.confidence}")
        if int(self.resamples) != self.resamples or self.resamples < 1:
            raise ValueError(f"resamples: must be a positive integer, got {self.resamples}")


@dataclasses.dataclass(frozen=True)
class AccuracyCheck:
    n: int
    run_accuracy: float
    base_accuracy: float
    diff_mean: float  # run - base
    ci_low: float
    ci_high: float
    margin: float
    broke: bool
    reason: str


def accuracy_check(run_N: np.ndarray, base_N: np.ndarray, c: Criterion) -> AccuracyCheck:
    """Broke iff base − run >= margin and the paired interval of (run − base) lies below 0."""
    if len(run_N) < 2 or len(run_N) != len(base_N):
        raise ValueError(f"need >= 2 paired problems, got {len(run_N)} run and {len(base_N)} base")
    diff = run_N - base_N
    lo, hi, _ = mean_difference_ci(run_N, base_N, resamples=c.resamples, seed=c.seed, confidence=c.confidence)
    d, margin = float(diff.mean()), c.acc_margin
    ci = f"{c.confidence:.0%} CI [{lo:+.3f}, {hi:+.3f}]"
    if -d >= margin and hi < 0:
        broke, reason = True, f"accuracy {-d:.3f} below the base (>= margin {margin:.3f}) and the {ci} excludes 0"
    elif -d < margin:
        broke, reason = False, f"accuracy difference {d:+.3f} is within the margin {margin:.3f}"
    else:
        broke, reason = False, f"accuracy {-d:.3f} below the base but the {ci} includes 0"
    return AccuracyCheck(n=len(diff), run_accuracy=float(run_N.mean()), base_accuracy=float(base_N.mean()),
                         diff_mean=d, ci_low=lo, ci_high=hi, margin=margin, broke=broke, reason=reason)


def tail_rows(rows: list[dict[str, Any]], fraction: float) -> list[dict[str, Any]]:
    return rows[len(rows) - max(1, math.ceil(fraction * len(rows))):]


def tail_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return float(np.mean(vals)) if vals else None


def _nonfinite(rows: list[dict[str, Any]]) -> tuple[int, str] | None:
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float) and not math.isfinite(v):
                return int(r["step"]), k
    return None


@dataclasses.dataclass(frozen=True)
class CollapseCheck:
    steps: tuple[int, int]  # first and last step of the run's tail
    reward: float | None
    base_reward: float | None
    entropy: float | None
    at_cap: float | None  # fraction of rollouts at max_new_tokens (or mean length / cap, see `at_cap_source`)
    at_cap_source: str
    nonfinite: str | None  # "step N: metric" of the first non-finite value
    signals: tuple[str, ...]  # the collapse signals that fired

    @property
    def broke(self) -> bool:
        return bool(self.signals)


def collapse_check(run_rows: list[dict[str, Any]], base_rows: list[dict[str, Any]] | None, max_new_tokens: int | None,
                   c: Criterion) -> CollapseCheck:
    tail = tail_rows(run_rows, c.tail)
    reward, entropy = tail_mean(tail, "reward"), tail_mean(tail, "entropy")
    base_reward = tail_mean(tail_rows(base_rows, c.tail), "reward") if base_rows else None
    at_cap, source = tail_mean(tail, "response_at_cap"), "response_at_cap"
    if at_cap is None and max_new_tokens:
        mean_len = tail_mean(tail, "response_len")
        at_cap, source = (None if mean_len is None else mean_len / max_new_tokens), "response_len / max_new_tokens"
    bad = _nonfinite(run_rows)
    signals = []
    if reward is not None and reward < c.collapse_reward and base_reward is not None and base_reward > reward:
        signals.append(f"reward {reward:.4f} < {c.collapse_reward} (base {base_reward:.4f})")
    if entropy is not None and entropy < c.collapse_entropy:
        signals.append(f"entropy {entropy:.4f} < {c.collapse_entropy} nats")
    if at_cap is not None and at_cap >= c.cap_fraction:
        signals.append(f"length pinned at the cap: {source} {at_cap:.3f} >= {c.cap_fraction}")
    if bad is not None:
        signals.append(f"non-finite {bad[1]} at step {bad[0]}")
    return CollapseCheck(steps=(int(tail[0]["step"]), int(tail[-1]["step"])), reward=reward, base_reward=base_reward,
                         entropy=entropy, at_cap=at_cap, at_cap_source=source,
                         nonfinite=None if bad is None else f"step {bad[0]}: {bad[1]}", signals=tuple(signals))


@dataclasses.dataclass(frozen=True)
class RLVerdict:
    accuracy: AccuracyCheck
    collapse: CollapseCheck
    base_collapse: CollapseCheck  # the same signals on the base (a broken base makes the comparison moot)
    criterion: Criterion
    verdict: str  # "BROKE" | "OK"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _max_new_tokens(run_dir: str | Path) -> int | None:
    v = config_field(read_run_config(run_dir), "sampling", "max_new_tokens")
    return int(v) if isinstance(v, int) else None


def check_same_method(run_dir: str | Path, base_dir: str | Path) -> None:
    """The base must be the same loss kind (its standard-engine run), when both configs say."""
    kinds = [config_field(read_run_config(d), "loss", "kind") for d in (run_dir, base_dir)]
    if None not in kinds and kinds[0] != kinds[1]:
        raise ValueError(f"{run_dir} trains loss.kind={kinds[0]} but {base_dir} trains {kinds[1]}: the broke "
                         f"criterion compares a method with its own standard-engine run")


def rl_verdict(run_dir: str | Path, base_dir: str | Path, eval_name: str = "after",
               criterion: Criterion = Criterion()) -> RLVerdict:
    """The broke criterion of RUN_DIR against BASE_DIR (see the module docstring)."""
    q.check_comparable([run_dir], [base_dir], eval_name)
    check_same_method(run_dir, base_dir)
    _, run_N, base_N = q.pair(read_eval(run_dir, eval_name, correctness=True),
                              read_eval(base_dir, eval_name, correctness=True), "correct")
    acc = accuracy_check(run_N, base_N, criterion)
    run_rows, base_rows = training_rows(run_dir), training_rows(base_dir)
    collapse = collapse_check(run_rows, base_rows, _max_new_tokens(run_dir), criterion)
    base_collapse = collapse_check(base_rows, None, _max_new_tokens(base_dir), criterion)
    verdict = "BROKE" if acc.broke or collapse.broke else "OK"
    return RLVerdict(accuracy=acc, collapse=collapse, base_collapse=base_collapse, criterion=criterion,
                     verdict=verdict)
