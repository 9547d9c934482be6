"""Per-sequence advantages of the RL kinds from correctness rewards (host side, numpy): REINFORCE's baselines and
GRPO's group normalization. Each is referenced by its kind's registry entry (`Objective.advantages`).

- REINFORCE: advantage = reward − baseline, `rl.baseline`: batch_mean (the batch's mean reward), leave_one_out
  (the mean of the *other* rows, so a row's baseline does not depend on its own reward), running_mean (a
  bias-corrected EMA of previous batches' mean rewards, `rl.baseline_decay`; the first batch uses its own
  mean — the EMA is train state, kept by the step in `opd.rewards.RLTrainState`).
- GRPO: each prompt is sampled `group_size` times; advantage = (reward − group mean) / (group std + eps)
  (`normalize_std: false` drops the division, as Dr. GRPO does).
The batch baselines (batch_mean, leave_one_out, the GRPO groups) use this process's rows.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

from jopd.losses.config import Baseline, RLConfig


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


def reinforce(rewards_B, cfg: RLConfig, running_baseline: float | None = None):
    """`Objective.advantages` of reinforce."""
    return reinforce_advantages(rewards_B, cfg.baseline, running_baseline)


def grpo(rewards_B, cfg: RLConfig, running_baseline: float | None = None):
    """`Objective.advantages` of grpo (its baseline is the group mean)."""
    return grpo_advantages(rewards_B, cfg.group_size, cfg.normalize_std, cfg.eps)
