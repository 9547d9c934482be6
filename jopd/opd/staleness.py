"""Bounded staleness (`rollout.staleness: k`): step n's rollouts are sampled with the student's parameters of
step n - k (the first k steps with the initial ones), as an asynchronous trainer whose sampler runs k policy
versions behind would sample them; k = 0 is the synchronous step.

The window: the trainer's params of steps n-k .. n-1 (clamped at 0), in the trainer's layout and dtype, held
in the train state (`LaggedTrainState`), so a checkpoint holds them and a resumed run samples with the very
parameters the uninterrupted one did. They are the trainer's copies, not the sampler's: the staleness part of
the mismatch is measured in the trainer's numerics at step n - k, and the sampler copy is rebuilt from them by
the step's own weight sync with step v = n - k's key, `sync(theta_v, weight_sync_key(rng, v))` — the copy step
v's synchronous weight sync made, so step n's rollout is what theta_v samples with step n's row seeds.

Measurement (train.mismatch=exact): q = the rollout's distribution (the engine's numerics at theta_{n-k}),
r = the trainer's numerics at theta_{n-k} (`lagged_logprobs`), p = the trainer's at theta_n (the update's).
`mismatch_kl` = KL(q || p) = KL(q || r) [engine] + KL(r || p) [staleness] + sum_v (q - r)(log r - log p)
[cross], an identity per position (`losses.is_correction.staleness_split_BxT`); the cross term is 0 when either
part is (an exact engine, or no lag).
"""

from __future__ import annotations

from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import pydantic
from jaxtyping import Array, Bool, Float, Int

from jopd.config_dataclass import config_dataclass
from jopd.losses.chunked import chunked_logits_map
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import TrainBatch, sequence_layout
from jopd.opd.rewards import RLTrainState
from jopd.opd.train_state import TrainState


@config_dataclass
class RolloutConfig:
    """How the rollouts relate to the trainer's parameters."""

    # Step n samples with the params of step n - k (the first k steps with the initial ones); 0: synchronous.
    # Costs k copies of the student's params in the train state (and its checkpoints).
    staleness: int = pydantic.Field(0, ge=0)
    # colocated: the sampler on the trainer's devices, one stage after the other. disaggregated: the sampler on
    # devices of its own (`opd.placement`), the first `sampler_devices` of the process's devices; with k >= 1 its
    # rollout of step n+1 runs beside the update of step n (the window's params are not the update's outputs).
    # process: the sampler in a worker process of its own (`jopd.run.sampler_process`), the params and rollouts
    # exchanged as TensorStore arrays in `exchange_dir`; a worker that dies is restarted.
    placement: Literal["colocated", "disaggregated", "process"] = "colocated"
    # disaggregated / process: how many devices the sampler gets (process: a worker on the host's first N devices,
    # the trainer on the rest: `run.device_split`; 0: the worker sees the trainer's devices)
    sampler_devices: int = pydantic.Field(0, ge=0)
    # process: a local directory or gs://bucket/path both sides reach (default <train.out_dir>/exchange)
    exchange_dir: str | None = None
    # process: how many steps' requests the sampler process holds, this step's and the next queue - 1 (their params
    # are the window's), so it samples ahead while the trainer trains; 1 <= queue <= staleness. 1: one at a time
    queue: int = pydantic.Field(1, ge=1)
    # Partial rollouts (`sampling.partial`, k >= 1, the slot engine): a row still decoding when the step's batch is
    # full carries into the next step, its tokens tagged with the version that sampled each; a row's tokens come
    # from two consecutive versions at most, and the window holds k + 1 versions (the older one's r).
    partial: bool = False


@flax.struct.dataclass
class LaggedTrainState(TrainState):
    """A `TrainState` with the window of past params (`rollout.staleness` > 0)."""

    # the trainer's params of steps n-k .. n-1 (clamped at 0) before step n; policies[0] samples step n
    policies: tuple


@flax.struct.dataclass
class LaggedRLTrainState(RLTrainState):
    """An `RLTrainState` (running-mean baseline) with the window of past params."""

    policies: tuple


@flax.struct.dataclass
class PartialTrainState(LaggedTrainState):
    """A `LaggedTrainState` (k + 1 versions) with the rows carried into the next step (`rollout.partial`)."""

    carry: Any  # `sampling.partial.Carry`: S rows of prompts, responses so far, randomness and version tags


def window_size(rollout: RolloutConfig) -> int:
    """Versions the window holds: k, and one more with partial rollouts (a carried row's older tokens' r)."""
    return rollout.staleness + int(rollout.partial)


def with_policies(state: TrainState, policies: tuple, carry=None) -> TrainState:
    """`state` with the window `policies` (a plain or RL train state), and the partial rollouts' `carry`."""
    if carry is not None:
        return PartialTrainState(**vars(state), policies=tuple(policies), carry=carry)
    cls = LaggedRLTrainState if isinstance(state, RLTrainState) else LaggedTrainState
    return cls(**vars(state), policies=tuple(policies))


def split_window(state: TrainState) -> tuple[TrainState, tuple]:
    """(the state without its window — and without the partial rollouts' carry, `carry_of` —, the window): what
    the update takes, so these buffers are never an update's outputs and a rollout that reads them need not wait
    for it."""
    fields = {k: v for k, v in vars(state).items() if k not in ("policies", "carry")}
    cls = RLTrainState if isinstance(state, LaggedRLTrainState) else TrainState
    return cls(**fields), state.policies


def carry_of(state: TrainState):
    """The partial rollouts' carry of `state` (None without `rollout.partial`)."""
    return getattr(state, "carry", None)


def policy_step(step: int, staleness: int) -> int:
    """The step whose parameters sample step `step`: step - staleness, the initial ones (0) before that."""
    return max(int(step) - staleness, 0)


def advance(state: TrainState, params) -> TrainState:
    """The window one step on: the oldest version out, `params` (a copy of this step's, before its update) in."""
    return state.replace(policies=state.policies[1:] + (params,))


def lagged_logprobs(params, prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"],
                    tokens_BxN: Int[Array, "B N"], lengths_B: Int[Array, "B"], *, model_cfg: ModelConfig,
                    temperature: float, chunk: int, dtype=jnp.float32) -> Float[Array, "B N V"]:
    """The trainer's log-softmax at the sampling temperature at each response slot of a rollout, with `params`
    (the rollout's own, theta_{n-k}): r, what the staleness part compares with the update's p. The trainer's
    numerics (its forward in `dtype`, fp32 logits), projected chunk by chunk."""
    layout = sequence_layout(prompt_BxP, prompt_mask_BxP, tokens_BxN, lengths_B)
    hidden = transformer.response_hidden(params, model_cfg, layout.tokens_BxS, layout.attn_mask_BxS,
                                         tokens_BxN.shape[1], dtype=dtype)

    def per_chunk(logits_BxCxV, _):
        return {"log_r": jax.nn.log_softmax(logits_BxCxV.astype(jnp.float32) / temperature, axis=-1)}

    return chunked_logits_map(per_chunk, params, hidden, {}, chunk, dtype=dtype, remat=False,
                              vocab_split=True)["log_r"]


def with_lagged_logprobs(batch: TrainBatch, log_r_BxNxV: Float[Array, "B N V"]) -> TrainBatch:
    """The scored `batch` with r as the loss field the staleness split reads."""
    return batch.replace(loss=batch.loss.replace(lagged_full_logprobs_BxTxV=log_r_BxNxV))
