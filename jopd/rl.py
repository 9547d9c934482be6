"""RL baselines on correctness rewards (for comparison with OPD), using the same sampler, loop and knobs.

reward = 1 if the response's final answer is right, else 0 (`data.answers.is_correct`). The sequence's advantage
is applied to each of its response tokens (`losses` kinds reinforce / grpo); the per-token objectives live in
`losses.objectives` / `losses.policy_gradient`, the host side (rewards, baselines, advantages) here.

- REINFORCE: advantage = reward − baseline, `rl.baseline`:
  batch_mean (the batch's mean reward), leave_one_out (the mean of the *other* rows of the batch, so a row's
  baseline does not depend on its own reward), running_mean (a bias-corrected EMA of previous batches' mean
  rewards, `rl.baseline_decay`; the first batch uses its own mean). The EMA is train state: the step keeps it
  in `opd.step.RLTrainState`, so it is checkpointed with the params and a resumed run repeats it bit for bit.
- GRPO: each prompt is sampled `group_size` times; advantage = (reward − group mean) / (group std + eps)
  (`normalize_std: false` drops the division, as Dr. GRPO does). The objective is PPO's clipped ratio against
  the sampler's log-probs (the behaviour policy), `inner_updates` optimizer updates per rollout batch, optional
  KL to the starting student (`kl_coef`) and Dr. GRPO's constant token-sum normalization (`token_sum_norm`).
  Dr. GRPO = `normalize_std: false` + `token_sum_norm: true`. The behaviour log-probs are the sampler's
  `train.is_logprobs`; keep the default, unprocessed (the same function of the logits as the trainer's
  log-prob, so the ratio is 1 for identical engines; processed ones are renormalized after top-p/top-k).
The batch baselines (batch_mean, leave_one_out, the GRPO groups) use this process's rows; the running mean
uses the global batch's mean reward (it is replicated state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pydantic
from jaxtyping import Float

from jopd.config_dataclass import config_dataclass
from jopd.data.answers import is_correct

Baseline = Literal["batch_mean", "leave_one_out", "running_mean"]


@config_dataclass
class RLConfig:
    group_size: int = pydantic.Field(4, ge=1)  # GRPO samples per prompt (the batch holds batch_size prompts)
    normalize_std: bool = True  # GRPO: divide by the group's reward std (Dr. GRPO sets this False)
    eps: float = pydantic.Field(1e-6, gt=0)
    baseline: Baseline = "batch_mean"  # REINFORCE's baseline (GRPO's is its group mean)
    baseline_decay: float = pydantic.Field(0.9, ge=0, lt=1)  # running_mean: EMA decay per rollout batch
    # Optimizer updates per rollout batch (GRPO only: its clipped ratio accounts for the policy's change).
    # optim.warmup_steps / decay_steps count optimizer updates, i.e. train.steps * inner_updates in all.
    inner_updates: int = pydantic.Field(1, ge=1)
    # GRPO: the ratio pi_theta / pi_sampler is clipped to [1 - clip_eps, 1 + clip_eps_high] (None: clip_eps;
    # DAPO's "clip higher" sets it above clip_eps).
    clip_eps: float = pydantic.Field(0.2, gt=0, lt=1)
    clip_eps_high: float | None = pydantic.Field(None, gt=0)
    # + kl_coef * k3(pi_theta || pi_ref) per token, pi_ref = the run's starting student (frozen)
    kl_coef: float = pydantic.Field(0.0, ge=0)
    # Divide the batch's token sum by the constant rows x sampling.max_new_tokens instead of the number of
    # loss tokens (Dr. GRPO: a sequence's weight no longer depends on its own or its batch-mates' lengths).
    token_sum_norm: bool = False


def correctness_rewards(responses: Sequence[str], answers: Sequence[str]) -> Float[np.ndarray, "B"]:
    return np.asarray([float(is_correct(r, str(a))) for r, a in zip(responses, answers)], np.float32)


def reinforce_advantages(rewards_B: Float[np.ndarray, "B"], baseline: Baseline = "batch_mean",
                         running_baseline: float | None = None) -> Float[np.ndarray, "B"]:
    """reward − baseline; `running_baseline` is the running_mean's value (None: no history yet, use the
    batch mean)."""
    if baseline == "batch_mean" or (baseline == "running_mean" and running_baseline is None):
        return (rewards_B - rewards_B.mean()).astype(np.float32)
    r = np.asarray(rewards_B, np.float64)
    if baseline == "leave_one_out":
        n = r.shape[0]
        if n < 2:
            raise ValueError(f"RLConfig.baseline=leave_one_out needs >= 2 rollouts per batch, got {n}")
        return (r - (r.sum() - r) / (n - 1)).astype(np.float32)
    return (r - running_baseline).astype(np.float32)


def running_baseline(ema: float, batches: int, decay: float) -> float | None:
    """Bias-corrected EMA of the previous `batches` batch means (Adam's correction for an EMA started at 0);
    None before the first batch."""
    return None if batches == 0 else float(ema) / (1.0 - decay ** batches)


def ema_update(ema: float, batch_mean: float, decay: float) -> np.float32:
    """The EMA after one more batch, rounded to the float32 the train state stores (so an uninterrupted run
    and a resumed one read the same value)."""
    return np.float32(decay * np.float64(ema) + (1.0 - decay) * np.float64(batch_mean))


def grpo_advantages(rewards_B: Float[np.ndarray, "B"], group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> Float[np.ndarray, "B"]:
    """Rows are grouped consecutively: rows [g*G, (g+1)*G) are the samples of prompt g."""
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"RLConfig.group_size={group_size} does not divide the rollout batch {rewards_B.shape[0]}")
    r = rewards_B.reshape(-1, group_size)
    adv = r - r.mean(axis=1, keepdims=True)
    if normalize_std:
        adv = adv / (r.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


def repeat_for_groups(batch: dict[str, np.ndarray], group_size: int) -> dict[str, np.ndarray]:
    """Each prompt row repeated `group_size` times, consecutively (the layout `grpo_advantages` expects)."""
    return {k: np.repeat(v, group_size, axis=0) for k, v in batch.items()}


def sequence_advantages(kind: str, rewards_B: Float[np.ndarray, "B"], cfg: RLConfig,
                        running_baseline: float | None = None) -> Float[np.ndarray, "B"]:
    if kind == "reinforce":
        return reinforce_advantages(rewards_B, cfg.baseline, running_baseline)
    if kind == "grpo":
        return grpo_advantages(rewards_B, cfg.group_size, cfg.normalize_std, cfg.eps)
    raise ValueError(f"LossConfig.kind={kind!r} is not an RL baseline (reinforce, grpo)")


def check_rl_config(kind: str, cfg: RLConfig) -> None:
    """Settings that only one kind can honour: one-line errors rather than silently ignored knobs."""
    if cfg.inner_updates > 1 and kind != "grpo":
        raise ValueError(f"RunConfig.rl.inner_updates={cfg.inner_updates}: only loss.kind=grpo reuses a rollout "
                         f"batch (its clipped ratio accounts for the policy's change); got loss.kind={kind}")
    if cfg.baseline != "batch_mean" and kind != "reinforce":
        raise ValueError(f"RunConfig.rl.baseline={cfg.baseline}: applies to loss.kind=reinforce only (GRPO's "
                         f"baseline is its group mean); got loss.kind={kind}")
