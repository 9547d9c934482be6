"""The OPD step's batches: a rollout's device arrays (`RolloutArrays`, what the scoring stage takes whole), the
sequence layout of a sampled batch, and the train step's input `TrainBatch`.

Layout: the left-padded prompt [B, P] followed by the response [B, N] gives the student's input
`tokens_BxS` / `attn_mask_BxS`, S = P + N. Every loss field is response-aligned [B, N, ...]: slot t describes
response token t, predicted from the hidden state at sequence position P + t - 1 (`transformer.response_hidden`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jopd.losses import LossBatch
from jopd.sampling.config import SampleOutput


@flax.struct.dataclass
class RolloutArrays:
    """One step's sampled batch as global device arrays (a pytree: the scoring stage's input)."""

    prompt_BxP: Int[Array, "B P"]  # left-padded prompts
    prompt_mask_BxP: Bool[Array, "B P"]
    sample: SampleOutput  # tokens, lengths, sampler log-probs (and full log-softmax with train.mismatch=exact)
    advantages_B: Array | None = None  # RL kinds: the per-sequence advantage from the rewards
    rewards_B: Array | None = None  # RL kinds: each response's reward (logged; scoring does not read it)
    plan: Any = None  # `opd.packing.PackPlan` (train.pack): score and update the packed sequences
    cross: Any = None  # `opd.cross_teacher.CrossBatch`: the teacher's own sequences and the aligned spans
    task_B: Array | None = None  # several tasks (`data.mix`): each row's task id, for the per-task metrics


class SequenceLayout(NamedTuple):
    tokens_BxS: Int[Array, "B S"]  # prompt then response
    attn_mask_BxS: Bool[Array, "B S"]  # real prompt tokens and response tokens before each row's end
    targets_BxN: Int[Array, "B N"]  # the response tokens (what the N response slots predict)
    response_mask_BxN: Bool[Array, "B N"]  # slots before each row's length


def sequence_layout(prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"], tokens_BxN: Int[Array, "B N"],
                    lengths_B: Int[Array, "B"]) -> SequenceLayout:
    N = tokens_BxN.shape[1]
    response_mask = jnp.arange(N)[None, :] < lengths_B[:, None]
    return SequenceLayout(
        tokens_BxS=jnp.concatenate([prompt_BxP, tokens_BxN], axis=1).astype(jnp.int32),
        attn_mask_BxS=jnp.concatenate([prompt_mask_BxP.astype(bool), response_mask], axis=1),
        targets_BxN=tokens_BxN.astype(jnp.int32),
        response_mask_BxN=response_mask,
    )


@flax.struct.dataclass
class TrainBatch:
    """The train step's input: the student's forward input and the response-aligned loss fields. Packed
    (`plan` set): the tokens are the packed rows [Bp, C] and the loss's chunk fields compact (`opd.packing`)."""

    tokens_BxS: Int[Array, "B S"]
    attn_mask_BxS: Bool[Array, "B S"]
    loss: LossBatch  # [B, N, ...] fields, N = the response slots
    plan: Any = None  # `opd.packing.PackPlan` when packed
    # a mixture-of-experts student: the sampler's expert ids per token and sparse layer in the padded sequence
    # layout [B, S, Ls, k] (`SampleOutput.expert_ids_BxSxLsxk`; -1 where it routed nothing the loss reads), what
    # the routing-flip metrics compare with and routing replay runs
    sampler_experts_BxSxLsxk: Int[Array, "B S Ls k"] | None = None
    # with it, the rows whose forward replays them (`train.routing_replay`: all, else none). Data, not a static
    # switch: the update is one program either way, so replaying the trainer's own choice changes no bit
    replay_B: Bool[Array, "B"] | None = None

    @property
    def n_response(self) -> int:
        return self.loss.targets_BxT.shape[1]


def scoring_input(rollout: RolloutArrays) -> RolloutArrays:
    """What the scoring program takes: the rollout without the sampler's full log-softmax [B, N, V]
    (`train.mismatch=exact`). Scoring would only pass it through, and a jitted pass-through writes a copy into a
    new output buffer (3.9 GiB per chip on the Llama-3.2-1B v5e config); `with_sampler_full_logprobs` hands the
    sampler's own buffer to the train step instead."""
    return rollout.replace(sample=rollout.sample._replace(full_logprobs_BxNxV=None))


def with_sampler_full_logprobs(batch: TrainBatch, rollout: RolloutArrays) -> TrainBatch:
    """The scored `batch` with the rollout's full log-softmax (if the sampler returned one) as a loss field."""
    full = rollout.sample.full_logprobs_BxNxV
    return batch if full is None else batch.replace(loss=batch.loss.replace(sampler_full_logprobs_BxTxV=full))


def abstract(tree):
    """ShapeDtypeStructs (with shardings where the leaves have them) of a pytree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
