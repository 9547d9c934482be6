"""Measure a rollout engine's mismatch without training: sample a few batches with the candidate engine through
the OPD step's own rollout (`OPDStep.rollout`), and compare each visited position with the trainer.

Reported per response token, each with a 95% bootstrap CI over prompts (rows are resampled whole, so the
interval reflects prompt-to-prompt variation, and token-weighted means stay ratios of sums): the exact
full-vocabulary KL(sampler ‖ trainer), the sampled-token estimators k1 and k3, mean and max |Δprob| of the
sampled tokens, and the effective sample size of the IS weights.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from scipy import stats
from tqdm.auto import tqdm

from jopd.lab.mismatch import position_mismatch
from jopd.parallel.distributed import gather_to_host

# Per-row sums the statistics are ratios of (one row = one prompt's response).
_SUMS = ("n", "kl", "k1", "k3", "dprob", "r", "r2")


@dataclasses.dataclass(frozen=True)
class Estimate:
    mean: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class MismatchReport:
    n_prompts: int
    n_tokens: int
    exact_kl: Estimate  # nats per response token
    k1: Estimate
    k3: Estimate
    mean_abs_dprob: Estimate
    max_abs_dprob: Estimate
    ess: Estimate
    batch_exact_kl: list[float]  # per sampled batch
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d

    def table(self) -> str:
        rows = [("exact KL(sampler || trainer)", self.exact_kl, "nats/token"), ("k1", self.k1, "nats/token"),
                ("k3", self.k3, "nats/token"), ("mean |dprob|", self.mean_abs_dprob, ""),
                ("max |dprob|", self.max_abs_dprob, ""), ("IS effective sample size", self.ess, "fraction")]
        lines = [f"{self.n_prompts} prompts, {self.n_tokens} response tokens, {len(self.batch_exact_kl)} batches, "
                 f"{self.wall_s:.1f} s", f"{'':30s} {'mean':>11s} {'95% CI over prompts':>25s}"]
        for name, e, unit in rows:
            lines.append(f"{name:30s} {e.mean:11.4g} [{e.ci_low:11.4g}, {e.ci_high:11.4g}] {unit}")
        return "\n".join(lines)


def row_sums(exact_kl_BxN, trainer_logprobs_BxN, sampler_logprobs_BxN, mask_BxN) -> dict[str, np.ndarray]:
    """Per-row sums over the real response tokens, in float64, and the per-row max |Δprob|."""
    m = np.asarray(mask_BxN, bool)
    log_p = np.asarray(trainer_logprobs_BxN, np.float64)
    log_q = np.asarray(sampler_logprobs_BxN, np.float64)
    log_r = np.where(m, np.clip(log_p - log_q, -20.0, 20.0), 0.0)
    r = np.where(m, np.exp(log_r), 0.0)
    dprob = np.where(m, np.abs(np.exp(log_p) - np.exp(log_q)), 0.0)
    return {"n": m.sum(1).astype(np.float64), "kl": np.where(m, np.asarray(exact_kl_BxN, np.float64), 0.0).sum(1),
            "k1": (-log_r).sum(1), "k3": np.where(m, np.expm1(log_r) - log_r, 0.0).sum(1), "dprob": dprob.sum(1),
            "r": r.sum(1), "r2": (r * r).sum(1), "max_dprob": dprob.max(1, initial=0.0)}


def _ratio(num: str):
    return lambda *cols, axis=-1: cols[_SUMS.index(num)].sum(axis) / cols[0].sum(axis)


def _ess(*cols, axis=-1):
    r, r2, n = cols[_SUMS.index("r")].sum(axis), cols[_SUMS.index("r2")].sum(axis), cols[0].sum(axis)
    return r * r / (n * r2)


def _estimate(data: tuple[np.ndarray, ...], statistic, resamples: int, seed: int) -> Estimate:
    value = float(statistic(*data))
    if len(data[0]) < 2 or np.ptp(statistic(*(d[:, None] for d in data), axis=-1)) == 0:
        return Estimate(value, value, value)  # one row, or every row alike: nothing to resample
    res = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=resamples,
                          method="percentile", random_state=seed)
    return Estimate(value, float(res.confidence_interval.low), float(res.confidence_interval.high))


def summarize(rows: dict[str, np.ndarray], batch_kl: list[float], wall_s: float, *, resamples: int = 2000,
              seed: int = 0) -> MismatchReport:
    """Token-weighted means (ratios of per-row sums) with paired bootstrap CIs over rows."""
    n = rows["n"]
    if n.sum() == 0:
        raise ValueError("mismatch: the sampled responses hold no tokens (nothing to measure)")
    keep = n > 0
    data = tuple(rows[k][keep] for k in _SUMS)
    est = functools.partial(_estimate, data, resamples=resamples, seed=seed)
    max_rows = rows["max_dprob"][keep]
    max_ci = stats.bootstrap((max_rows,), np.max, n_resamples=resamples, method="percentile",
                             random_state=seed).confidence_interval if len(max_rows) > 1 and np.ptp(max_rows) else None
    max_est = Estimate(float(max_rows.max()), *(map(float, max_ci) if max_ci else (max_rows.max(),) * 2))
    return MismatchReport(n_prompts=int(keep.sum()), n_tokens=int(n.sum()), exact_kl=est(_ratio("kl")),
                          k1=est(_ratio("k1")), k3=est(_ratio("k3")), mean_abs_dprob=est(_ratio("dprob")),
                          max_abs_dprob=max_est, ess=est(_ess), batch_exact_kl=batch_kl, wall_s=wall_s)


def measure(run, state, batches: Iterable[dict[str, np.ndarray]], *, first_step: int = 0, resamples: int = 2000,
            seed: int = 0, progress: bool = True) -> MismatchReport:
    """Mismatch of `run`'s rollout engine (its `rollout_precision`, sampling and noise) against the trainer, on
    the given prompt batches, with the student at `state`. `run` is a `jopd.opd.loop.OPDRun` whose sampler
    returns its full log-softmax (`train.mismatch: exact`)."""
    step = run.step
    if not step.sampler.sampling.return_full_logprobs:
        raise ValueError("mismatch: needs train.mismatch=exact (the sampler's full log-softmax)")
    fn = jax.jit(functools.partial(position_mismatch, model_cfg=step.student_cfg,
                                   temperature=run.cfg.sampling.temperature, chunk=step.loss_cfg.chunk_size))
    t0 = time.perf_counter()
    sums: list[dict[str, np.ndarray]] = []
    batch_kl = []
    for i, batch in enumerate(tqdm(list(batches), desc="mismatch", disable=not progress, leave=False)):
        with jax.set_mesh(step.mesh):
            rollout = step.rollout(state, batch, first_step + i)
            terms = fn(state.params, rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample)
        sampler_lp = rollout.sample.unprocessed_logprobs_BxN
        rows = row_sums(*gather_to_host((terms["exact_kl_BxN"], terms["trainer_logprobs_BxN"], sampler_lp,
                                         terms["response_mask_BxN"])))  # all processes' rows, on every host
        sums.append(rows)
        batch_kl.append(float(rows["kl"].sum() / max(rows["n"].sum(), 1.0)))
    wall = time.perf_counter() - t0
    merged = {k: np.concatenate([s[k] for s in sums]) for k in sums[0]}
    return summarize(merged, batch_kl, wall, resamples=resamples, seed=seed)
