"""`LossBatch`: everything a per-token loss reads, as one typed pytree (a jit argument of the train step).

Every [B, T, ...] field is aligned with the student's hidden positions: slot t describes the prediction of
`targets_BxT[:, t]`. Optional fields are None when the loss kind does not read them (the registry in
`losses.kinds` declares which kind needs which); None is an empty pytree node, so a missing field costs
nothing under jit and needs no sharding.

With `compact` set (packed sequences, `jopd.opd.packing`), the fields a kind reads per chunk (its
`Objective.chunk_fields` and `support_mask_BxTxK`) are in the compact layout [Q, Cq, ...] of the response
positions; every other field stays in the padded response layout [B, T, ...] (`targets_BxT` and
`sampler_full_logprobs_BxTxV` / `lagged_full_logprobs_BxTxV` are moved to the compact layout inside the loss).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
from jaxtyping import Array, Bool, Float, Int

from jopd.losses.layout import CompactLayout


@flax.struct.dataclass
class LossBatch:
    targets_BxT: Int[Array, "B T"]  # token predicted at each position
    response_mask_BxT: Bool[Array, "B T"]  # positions that may count (before special-token masking)
    teacher_topk_ids_BxTxK: Int[Array, "B T K"] | None = None  # teacher's top-K ids (topk kinds)
    teacher_topk_logprobs_BxTxK: Float[Array, "B T K"] | None = None  # their log-probs under the full softmax
    support_mask_BxTxK: Bool[Array, "B T K"] | None = None  # union supports: False on a repeated id
    teacher_target_logprobs_BxT: Float[Array, "B T"] | None = None  # log pi_t(target)
    # the teacher's final hidden states at the positions (rkl / fkl / jsd: projected by its head per chunk)
    teacher_hidden_BxTxD: Float[Array, "B T D"] | None = None
    sampler_logprobs_BxT: Float[Array, "B T"] | None = None  # log q(target) from the rollout engine
    sampler_full_logprobs_BxTxV: Float[Array, "B T V"] | None = None  # the sampler's log-softmax (exact mismatch)
    # the trainer's log-softmax with the rollout's own params (`rollout.staleness` > 0, exact mismatch): what
    # splits the mismatch into its staleness and engine parts (`is_correction.staleness_split_BxT`)
    lagged_full_logprobs_BxTxV: Float[Array, "B T V"] | None = None
    advantages_BxT: Float[Array, "B T"] | None = None  # per-token advantages (RL kinds)
    reference_logprobs_BxT: Float[Array, "B T"] | None = None  # log pi_ref(target), frozen reference (KL term)
    # A teacher with another tokenizer (`opd.cross_teacher`): aligned spans, K = T slots (a span holds >= 1
    # student token). span_id: each position's span (T: none); span_mask: span k exists; span_teacher_logprobs:
    # log p_teacher(span k); end_span: span k is the end span (student EOS <-> the teacher's end of turn);
    # dense_mask: the positions where a span starts (the dense projection's).
    span_id_BxT: Int[Array, "B T"] | None = None
    span_mask_BxT: Bool[Array, "B T"] | None = None
    end_span_BxT: Bool[Array, "B T"] | None = None
    span_teacher_logprobs_BxT: Float[Array, "B T"] | None = None
    dense_mask_BxT: Bool[Array, "B T"] | None = None
    task_BxT: Int[Array, "B T"] | None = None  # several tasks: each row's task id (`LossConfig.task_names`)
    token_normalizer: Float[Array, ""] | None = None  # replaces the count of loss tokens as the denominator
    compact: CompactLayout | None = None  # packed: where the chunk fields' compact positions come from

    def present(self) -> tuple[str, ...]:
        """Names of the per-position fields that are set."""
        return tuple(f.name for f in dataclasses.fields(self) if f.name != "compact" and getattr(self, f.name) is not None)

    def select(self, names) -> dict[str, jax.Array]:
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LossBatch) if f.name != "compact")
