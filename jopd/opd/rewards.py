"""The RL kinds' host side of a step: correctness rewards from the task's answer check, the running-mean
baseline kept as train state, and the grouping of rollouts per prompt. (The per-sequence advantages are each
kind's registry entry, `jopd.losses.advantages`; the per-token objectives are `jopd.losses.builtin`'s.)

GRPO's behaviour log-probs are the sampler's `train.is_logprobs`; keep the default, unprocessed (the same
function of the logits as the trainer's log-prob, so the ratio is 1 for identical engines; processed ones are
renormalized after top-p/top-k). The running mean uses the global batch's mean reward (it is replicated state).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np
from jaxtyping import Float

from jopd.data.tasks import Task
from jopd.losses.config import RLConfig
from jopd.losses.kinds import Objective
from jopd.opd.train_state import TrainState


@flax.struct.dataclass
class RLTrainState(TrainState):
    """The train state of an RL kind with `rl.baseline: running_mean`: the baseline's EMA is state of the run
    (checkpointed and restored with the params, so a resumed run reads the very float32 the uninterrupted run
    read). Every other kind keeps the plain `TrainState` pytree."""

    reward_ema: jax.Array  # float32 scalar: EMA (from 0) of the batch-mean rewards of the steps so far


def correctness_rewards(task: Task | Sequence[Task], responses: Sequence[str], answers: Sequence[str]
                        ) -> Float[np.ndarray, "B"]:
    """The task's reward of each response (default: 1 if its final answer is right, else 0); `task` may give
    each row's own task (a mix of tasks)."""
    tasks = [task] * len(responses) if isinstance(task, Task) else task
    return np.asarray([t.reward_of(r, str(a)) for t, r, a in zip(tasks, responses, answers)], np.float32)


def uses_running_baseline(objective: Objective, cfg: RLConfig) -> bool:
    return objective.uses_rewards and cfg.baseline == "running_mean"


def running_baseline(ema: float, batches: int, decay: float) -> float | None:
    """Bias-corrected EMA of the previous `batches` batch means (Adam's correction for an EMA started at 0);
    None before the first batch."""
    return None if batches == 0 else float(ema) / (1.0 - decay ** batches)


def ema_update(ema: float, batch_mean: float, decay: float) -> np.float32:
    """The EMA after one more batch, rounded to the float32 the train state stores (so an uninterrupted run
    and a resumed one read the same value)."""
    return np.float32(decay * np.float64(ema) + (1.0 - decay) * np.float64(batch_mean))


def repeat_for_groups(batch: dict[str, np.ndarray], group_size: int) -> dict[str, np.ndarray]:
    """Each prompt row repeated `group_size` times, consecutively (the layout `grpo_advantages` expects)."""
    return {k: np.repeat(v, group_size, axis=0) for k, v in batch.items()}

