"""Measure a rollout engine's mismatch without training: sample a few batches with the candidate engine through
the OPD step's own rollout (`OPDStep.rollout`), and compare each visited position with the trainer.

Reported per response token, each with a 95% bootstrap CI over prompts (rows are resampled whole, so the
interval reflects prompt-to-prompt variation, and token-weighted means stay ratios of sums): the exact
full-vocabulary KL(sampler ‖ trainer), the sampled-token estimators k1 and k3, mean and max |Δprob| of the
sampled tokens, and the effective sample size of the IS weights. For a mixture-of-experts student also the
routing flips, each with its CI over prompts: the share of router decisions (token x sparse layer) and of tokens
(any sparse layer) whose expert set differs between the sampler and the trainer, over the tokens the sampler
routed (each prompt's and its response's but the last). With `train.routing_replay` the trainer's forward is the
replayed one (what the update differentiates), for the KL as for the flips.

Offline staleness (`measure(policy=...)`, `jopd mismatch --staleness K`): the rollouts are sampled with older
params (a checkpoint's step N-K) by the engine, and compared with the trainer at step N. The exact KL(q || p) is
then split per position as in the train step (`jopd.opd.staleness`, `is_correction.staleness_split_BxT`): q the
engine at theta_{N-K}, r the trainer's numerics at theta_{N-K}, p the trainer's at theta_N; engine = KL(q || r),
staleness = KL(r || p), cross = sum_v (q - r)(log r - log p). The three add up to the total per position up to
rounding (r and p come from the chunked trainer forward `staleness.lagged_logprobs`, the total from
`position_kl`'s, the same numerics by another code path) and the clamp at 0 of the two KLs.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int
from tqdm.auto import tqdm

from jopd.lab.position_kl import position_mismatch
from jopd.lab.stats import Estimate, estimate
from jopd.losses.is_correction import effective_sample_size, mismatch_terms_BxT, staleness_split_BxT
from jopd.opd.staleness import lagged_logprobs
from jopd.parallel.distributed import gather_to_host
from jopd.sampling.config import SampleOutput

# Per-row sums the statistics are ratios of (one row = one prompt's response).
_SUMS = ("n", "kl", "k1", "k3", "dprob", "r", "r2")
# ... and of the routing (a mixture-of-experts student): routed tokens, flipped decisions, flipped tokens
_ROUTE_SUMS = ("routed", "flipped_decisions", "flipped_tokens")
# ... and of the staleness split (`--staleness K`): tokens, and the engine / staleness / cross parts
_SPLIT_SUMS = ("n", "kl_engine", "kl_staleness", "kl_cross")


@dataclasses.dataclass
class StalenessSplit:
    """The exact KL(sampler || trainer) of a stale rollout split into its parts, nats per response token, each with
    its CI over prompts: q = the engine at `sampler_step`'s params, r = the trainer's numerics at them, p = the
    trainer at `trainer_step`'s. engine = KL(q || r), staleness = KL(r || p), cross = sum (q - r)(log r - log p);
    the three add up to the total up to rounding (the CIs do not add)."""

    staleness: int  # K = trainer_step - sampler_step
    sampler_step: int
    trainer_step: int
    engine_kl: Estimate
    staleness_kl: Estimate
    cross: Estimate


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
    # a mixture-of-experts student: the share of router decisions (token x sparse layer), and of tokens, whose
    # expert set differs between the sampler and the trainer; None for a dense one
    router_flip_frac: Estimate | None = None
    token_flip_frac: Estimate | None = None
    # `--staleness K`: the split of exact_kl into its engine / staleness / cross parts; None without it
    split: StalenessSplit | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        rows = [("exact KL(sampler || trainer)", self.exact_kl, "nats/token"), ("k1", self.k1, "nats/token"),
                ("k3", self.k3, "nats/token"), ("mean |dprob|", self.mean_abs_dprob, ""),
                ("max |dprob|", self.max_abs_dprob, ""), ("IS effective sample size", self.ess, "fraction")]
        if self.router_flip_frac is not None:
            rows += [("routing flips, decisions", self.router_flip_frac, "fraction"),
                     ("routing flips, tokens", self.token_flip_frac, "fraction")]
        lines = [f"{self.n_prompts} prompts, {self.n_tokens} response tokens, {len(self.batch_exact_kl)} batches, "
                 f"{self.wall_s:.1f} s", f"{'':30s} {'mean':>11s} {'95% CI over prompts':>25s}"]
        sp = self.split
        if sp is not None:
            rows += [("  engine KL(q || r)", sp.engine_kl, "nats/token"),
                     ("  staleness KL(r || p)", sp.staleness_kl, "nats/token"),
                     ("  cross sum (q-r)(log r-log p)", sp.cross, "nats/token")]
        for name, e, unit in rows:
            lines.append(f"{name:30s} {e.mean:11.4g} [{e.ci_low:11.4g}, {e.ci_high:11.4g}] {unit}")
        if sp is not None:
            lines.append(f"staleness {sp.staleness}: q = the engine at step {sp.sampler_step}, r = the trainer at step "
                         f"{sp.sampler_step}, p = the trainer at step {sp.trainer_step}; engine + staleness + cross "
                         f"= exact KL up to rounding")
        return "\n".join(lines)


def mismatch_row_sums(sampler_logprobs_BxN: Float[np.ndarray, "B N"], trainer_logprobs_BxN: Float[np.ndarray, "B N"],
                      mask_BxN: Bool[np.ndarray, "B N"], exact_kl_BxN: Float[np.ndarray, "B N"]
                      ) -> dict[str, np.ndarray]:
    """Per row, over its real response tokens, in float64: the token count, the sums of the exact KL and of the
    sampled-token terms (`jopd.losses.is_correction.mismatch_terms_BxT`, the step's own), and the max |Δprob|."""
    m = np.asarray(mask_BxN, bool)
    t = mismatch_terms_BxT(np.asarray(sampler_logprobs_BxN, np.float64), np.asarray(trainer_logprobs_BxN, np.float64),
                           m)
    return {"n": m.sum(1).astype(np.float64), "kl": np.where(m, np.asarray(exact_kl_BxN, np.float64), 0.0).sum(1),
            "k1": t["k1"].sum(1), "k3": t["k3"].sum(1), "dprob": t["abs_dprob"].sum(1), "r": t["r"].sum(1),
            "r2": t["r2"].sum(1), "max_dprob": t["abs_dprob"].max(1, initial=0.0)}


def routing_row_sums(router_flips_BxS: np.ndarray, routed_BxS: np.ndarray, sparse_layers: int) -> dict[str, np.ndarray]:
    """Per row, over the positions the sampler routed: their count, the router decisions that flipped (summed over
    the sparse layers) divided by `sparse_layers` (so that flipped_decisions / routed is the decision share), and
    the tokens with at least one flip (float64)."""
    flips = np.where(np.asarray(routed_BxS, bool), np.asarray(router_flips_BxS, np.float64), 0.0)
    return {"routed": np.asarray(routed_BxS, bool).sum(1).astype(np.float64),
            "flipped_decisions": flips.sum(1) / sparse_layers, "flipped_tokens": (flips > 0).sum(1).astype(np.float64)}


def _ratio(num: str):
    return lambda *cols, axis=-1: cols[_SUMS.index(num)].sum(axis) / cols[0].sum(axis)


def _ess(*cols, axis=-1):
    col = lambda name: cols[_SUMS.index(name)].sum(axis)  # noqa: E731
    return effective_sample_size(col("r"), col("r2"), col("n"))


def split_row_sums(split: dict[str, np.ndarray], mask_BxN: Bool[np.ndarray, "B N"]) -> dict[str, np.ndarray]:
    """Per row, over its real response tokens, the sums of the staleness split's parts (float64)."""
    m = np.asarray(mask_BxN, bool)
    return {f"kl_{k}": np.where(m, np.asarray(split[k], np.float64), 0.0).sum(1)
            for k in ("engine", "staleness", "cross")}


def no_lag_split(report: MismatchReport, step: int) -> StalenessSplit:
    """The split at K = 0 (r = p: the same params): all of the KL is the engine's, the staleness part and the cross
    term are 0 by definition (not measured), so the report is the K = 0 one bit for bit."""
    zero = Estimate(0.0, 0.0, 0.0)
    return StalenessSplit(0, step, step, engine_kl=report.exact_kl, staleness_kl=zero, cross=zero)


def summarize(rows: dict[str, np.ndarray], batch_kl: list[float], wall_s: float, *, resamples: int = 2000,
              seed: int = 0, steps: tuple[int, int] | None = None) -> MismatchReport:
    """Token-weighted means (ratios of per-row sums) with paired bootstrap CIs over rows. With the split's sums
    (`split_row_sums`), `steps` = (sampler step, trainer step) of the split."""
    n = rows["n"]
    if n.sum() == 0:
        raise ValueError("mismatch: the sampled responses hold no tokens (nothing to measure)")
    keep = n > 0
    est = functools.partial(estimate, tuple(rows[k][keep] for k in _SUMS), resamples=resamples, seed=seed)
    max_est = estimate((rows["max_dprob"][keep],), np.max, resamples=resamples, seed=seed)
    routing = {}
    if "routed" in rows:  # the same rows (prompts) resampled for the routing's ratios
        route = functools.partial(estimate, tuple(rows[k][keep] for k in _ROUTE_SUMS), resamples=resamples, seed=seed)
        share = lambda i: lambda *cols, axis=-1: cols[i].sum(axis) / cols[0].sum(axis)  # noqa: E731
        routing = dict(router_flip_frac=route(share(1)), token_flip_frac=route(share(2)))
    if "kl_engine" in rows:  # the same rows resampled for the split's ratios
        part = functools.partial(estimate, tuple(rows[k][keep] for k in _SPLIT_SUMS), resamples=resamples, seed=seed)
        ratio = lambda i: lambda *cols, axis=-1: cols[i].sum(axis) / cols[0].sum(axis)  # noqa: E731
        routing["split"] = StalenessSplit(steps[1] - steps[0], *steps, engine_kl=part(ratio(1)),
                                          staleness_kl=part(ratio(2)), cross=part(ratio(3)))
    return MismatchReport(n_prompts=int(keep.sum()), n_tokens=int(n.sum()), exact_kl=est(_ratio("kl")),
                          k1=est(_ratio("k1")), k3=est(_ratio("k3")), mean_abs_dprob=est(_ratio("dprob")),
                          max_abs_dprob=max_est, ess=est(_ess), batch_exact_kl=batch_kl, wall_s=wall_s, **routing)


def split_terms(params_p, params_r, prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"],
                sample: SampleOutput, *, model_cfg, temperature: float, chunk: int, dtype
                ) -> dict[str, Float[Array, "B N"]]:
    """Per response position, the staleness split of a rollout sampled with `params_r` (older) against the trainer
    at `params_p`: r and p both from the trainer's chunked forward (`staleness.lagged_logprobs`, the train step's
    r), the parts from `is_correction.staleness_split_BxT` (the train step's)."""
    lag = functools.partial(lagged_logprobs, prompt_BxP=prompt_BxP, prompt_mask_BxP=prompt_mask_BxP,
                            tokens_BxN=sample.tokens_BxN, lengths_B=sample.lengths_B, model_cfg=model_cfg,
                            temperature=temperature, chunk=chunk, dtype=dtype)
    # p is a log-softmax already (temperature applied): the split's own log_softmax leaves it as is, to rounding
    return staleness_split_BxT(sample.full_logprobs_BxNxV, lag(params_r), lag(params_p), 1.0)


def measure(run, state, batches: Iterable[dict[str, np.ndarray]], *, first_step: int = 0, resamples: int = 2000,
            seed: int = 0, progress: bool = True, policy=None, steps: tuple[int, int] | None = None
            ) -> MismatchReport:
    """Mismatch of `run`'s rollout engine (its `rollout_precision`, sampling and noise) against the trainer, on
    the given prompt batches, with the student at `state`. `run` is a `jopd.run.loop.OPDRun` whose sampler
    returns its full log-softmax (`train.mismatch: exact`).

    `policy`: older params to sample with (trainer layout; e.g. a checkpoint's step N-K), with the same row
    randomness and weight-noise keys as `state.params` would (batch i's); the report then carries the staleness
    split (`StalenessSplit`, `steps` = (sampler step, trainer step)). None: sample with `state.params`."""
    step = run.step
    if not step.sampler.sampling.return_full_logprobs:
        raise ValueError("mismatch: needs train.mismatch=exact (the sampler's full log-softmax)")
    if policy is not None and run.cfg.train.routing_replay:
        raise ValueError("--staleness: not with train.routing_replay=true (the split's r and p are plain forwards)")
    # the trainer side in the update's own compute dtype (`train.compute_dtype`): the mismatch the update sees
    fn = jax.jit(functools.partial(position_mismatch, model_cfg=step.student_cfg, dtype=step.compute_dtype,
                                   temperature=run.cfg.sampling.temperature, chunk=step.loss_cfg.chunk_size,
                                   routing_replay=run.cfg.train.routing_replay))
    split_fn = jax.jit(functools.partial(split_terms, model_cfg=step.student_cfg, dtype=step.compute_dtype,
                                         temperature=run.cfg.sampling.temperature, chunk=step.loss_cfg.chunk_size))
    t0 = time.perf_counter()
    sums: list[dict[str, np.ndarray]] = []
    batch_kl = []
    for i, batch in enumerate(tqdm(list(batches), desc="mismatch", disable=not progress, leave=False)):
        with jax.set_mesh(step.mesh):
            if policy is None:
                rollout = step.rollout(state, batch, first_step + i)
            else:  # the older params, with batch i's weight-noise key (as state.params would be synced)
                rollout = step.rollout(state, batch, first_step + i, policy, first_step + i)
            terms = fn(state.params, rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample)
            if policy is not None:
                split = split_fn(state.params, policy, rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample)
        sampler_lp = rollout.sample.unprocessed_logprobs_BxN
        rows = mismatch_row_sums(*gather_to_host((sampler_lp, terms["trainer_logprobs_BxN"], terms["response_mask_BxN"],
                                                  terms["exact_kl_BxN"])))  # all processes' rows, on every host
        if "routed_BxS" in terms:  # a mixture-of-experts student
            rows |= routing_row_sums(*gather_to_host((terms["router_flips_BxS"], terms["routed_BxS"])),
                                     len(step.student_cfg.sparse_layers))
        if policy is not None:
            rows |= split_row_sums(*gather_to_host((split, terms["response_mask_BxN"])))
        sums.append(rows)
        batch_kl.append(float(rows["kl"].sum() / max(rows["n"].sum(), 1.0)))
    wall = time.perf_counter() - t0
    merged = {k: np.concatenate([s[k] for s in sums]) for k in sums[0]}
    return summarize(merged, batch_kl, wall, resamples=resamples, seed=seed, steps=steps)


def measure_config(cfg, checkpoint: str | None = None, step: int | None = None, batches: int = 4,
                   resamples: int = 2000, log=print, staleness: int | None = None) -> tuple[MismatchReport, int]:
    """(report, student step) for a RunConfig: build its run, take the student from `checkpoint` (a checkpoint
    directory or RUN_DIR; None: the config's starting student, step 0), measure on its first `batches` training
    batches of prompts. `staleness` K (needs `checkpoint`): sample with the params of checkpoint step N - K (N:
    `step`, default the latest; both steps must be saved) and split the KL (`StalenessSplit`); K = 0 is the
    plain report with its split by definition (`no_lag_split`)."""
    from jopd.data.pipeline import train_iterator
    from jopd.lab.runs import build_at_checkpoint, resolve_checkpoint_dir, restore_state, saved_steps

    older = None
    if staleness is not None:  # the bad inputs first, before any model is built
        if staleness < 0:
            raise ValueError(f"--staleness {staleness}: must be >= 0 (the steps the sampler's params lag behind)")
        if checkpoint is None:
            raise ValueError(f"--staleness {staleness}: needs --checkpoint (both steps' params come from a run's "
                             f"checkpoints)")
        ckpt_dir = resolve_checkpoint_dir(checkpoint)
        saved = saved_steps(ckpt_dir)
        step = max(saved) if step is None else step
        if step in saved and step - staleness not in saved:
            raise ValueError(f"--staleness {staleness}: step {step} - {staleness} = {step - staleness} is not saved in "
                             f"{ckpt_dir} (saved steps: {saved}; both steps must be kept: checkpoint.every, "
                             f"checkpoint.keep)")
        older = step - staleness if staleness else None
    run, state, at = build_at_checkpoint(cfg, checkpoint, step, log=log)
    policy = None
    if older is not None:
        policy = restore_state(resolve_checkpoint_dir(checkpoint), run.step.abstract_state(), older)[0].params
    it = train_iterator(cfg.data, run.tokenizer, kind="prompt")
    report = measure(run, state, [next(it) for _ in range(batches)], resamples=resamples,
                     progress=sys.stderr.isatty(), policy=policy, steps=None if older is None else (older, at))
    if staleness == 0:
        report = dataclasses.replace(report, split=no_lag_split(report, at))
    return report, 0 if at is None else at
