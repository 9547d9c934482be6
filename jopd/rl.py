"""RL baselines on correctness rewards (for comparison with OPD), using the same sampler, loop and knobs.

reward = 1 if the response's final answer is right, else 0 (`data.answers.is_correct`).
- REINFORCE: advantage = reward − mean reward of the batch (a variance-reducing baseline).
- GRPO: each prompt is sampled `group_size` times; advantage = (reward − group mean) / (group std + eps).
  One optimizer update per batch of fresh rollouts, so the PPO ratio is 1 and clipping is inactive: the
  update is the plain group-normalized policy gradient (IS correction for sampler/trainer mismatch still
  applies via `loss.is_mode`).
The sequence's advantage is applied to each of its response tokens (`losses` kind reinforce / grpo).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.data.answers import is_correct


@config_dataclass
class RLConfig:
    group_size: int = pydantic.Field(4, ge=1)  # GRPO samples per prompt (the batch holds batch_size prompts)
    normalize_std: bool = True  # GRPO: divide by the group's reward std (Dr. GRPO sets this False)
    eps: float = pydantic.Field(1e-6, gt=0)


def correctness_rewards(responses: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    return np.asarray([float(is_correct(r, str(a))) for r, a in zip(responses, answers)], np.float32)


def reinforce_advantages(rewards_B: np.ndarray) -> np.ndarray:
    return (rewards_B - rewards_B.mean()).astype(np.float32)


def grpo_advantages(rewards_B: np.ndarray, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> np.ndarray:
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


def sequence_advantages(kind: str, rewards_B: np.ndarray, cfg: RLConfig) -> np.ndarray:
    if kind == "reinforce":
        return reinforce_advantages(rewards_B)
    if kind == "grpo":
        return grpo_advantages(rewards_B, cfg.group_size, cfg.normalize_std, cfg.eps)
    raise ValueError(f"LossConfig.kind={kind!r} is not an RL baseline (reinforce, grpo)")
