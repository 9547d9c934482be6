"""The loss kinds of a teacher with another tokenizer (`loss.kind: xtok_sampled | xtok_dense`; their entries'
`cross_tokenizer` says what `opd.cross_teacher` writes for them): the student's response and the teacher's
tokenization of the same text, cut into aligned spans.

- `xtok_sampled` (exact): the cross-tokenizer form of `sampled_opd`. Per aligned span k, the signal
  s_k = log p_student(span k) - log p_teacher(span k) (each the sum of its side's token log-probs in the span, by
  the chain rule); every student token of span k gets the advantage -s_k, and the loss is the policy gradient
  -A log pi_s(y) per token. Its `divergence` metric is the sampled reverse KL of the text per student token,
  sum_k s_k / tokens: tokenizer-free.
- `xtok_dense`: the truncated reverse KL with a tail (`topk_rkl_tail`) at the positions where a span starts,
  against the teacher's next-token distribution projected onto the student's top-K support there (the support
  ids and the projected log-probs come in the truncated kinds' fields). Backed off to the start of the teacher's
  last token, the projection is the teacher's next-character distribution for a character-level student, and a
  lower bound of its next-text probability elsewhere (`crosstok.project`); positions inside a teacher token carry
  no dense signal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jopd.crosstok.spans import at_tokens, span_sums
from jopd.losses import divergences as div
from jopd.losses.kinds import OBJECTIVES, Objective
from jopd.losses.masks import masked_mean
from jopd.losses.policy_gradient import policy_gradient_surrogate

_SPANS = ("span_id_BxT", "span_mask_BxT", "end_span_BxT")


def _none(cfg, logits, inp):
    return {}


def _in_span(batch, mask):
    return mask & (batch.span_id_BxT < batch.span_mask_BxT.shape[1])


def _at_span_start(batch, mask):
    return mask & batch.dense_mask_BxT


def _response_frac(mask, batch):
    return jnp.sum(mask) / jnp.maximum(jnp.sum(batch.response_mask_BxT), 1)


def _sampled_reduce(cfg, logp, terms, batch, mask, weights):
    """Span-level policy gradient: each student token of span k has the advantage -(s_k), s_k the span signal.
    `mask` holds the aligned positions only (`_in_span`)."""
    logp_sg = jax.lax.stop_gradient(logp)
    K = batch.span_mask_BxT.shape[1]
    in_span = mask
    span_BxT = jnp.where(in_span, batch.span_id_BxT, K)
    student = span_sums(jnp.where(in_span, logp_sg, 0.0), span_BxT, K)
    signal = jnp.where(batch.span_mask_BxT, student - batch.span_teacher_logprobs_BxT.astype(jnp.float32), 0.0)
    adv = -at_tokens(signal, span_BxT)
    tokens = jnp.maximum(jnp.sum(in_span), 1).astype(jnp.float32)
    # num_tokens (the shared reduction's) counts the aligned tokens: the degenerate-run guard stops a run whose
    # rollouts never align
    # the end span's signal (its EOS token's advantage is minus it) apart from the text spans': a student that
    # stops ending its turn shows here first
    end = batch.span_mask_BxT & batch.end_span_BxT
    metrics = {"divergence": jnp.sum(signal) / tokens, "advantage_mean": masked_mean(adv, in_span),
               "aligned_token_frac": _response_frac(in_span, batch), "end_signal": masked_mean(signal, end),
               "text_signal": masked_mean(signal, batch.span_mask_BxT & ~batch.end_span_BxT),
               "end_span_frac": jnp.sum(end) / jnp.maximum(jnp.sum(jnp.any(batch.span_mask_BxT, axis=1)), 1)}
    return policy_gradient_surrogate(logp, jnp.where(in_span, adv, 0.0)), weights, metrics


def _dense_terms(cfg, logits, inp):
    loss, mass = div.topk_tail_reverse_kl(logits, inp["teacher_topk_ids_BxTxK"], inp["teacher_topk_logprobs_BxTxK"],
                                          inp["support_mask_BxTxK"])
    return {"divergence": loss, "topk_mass": mass}


def _dense_reduce(cfg, logp, terms, batch, mask, weights):
    """The truncated reverse KL with a tail, at the span starts only (`mask` holds them: `_at_span_start`)."""
    at_start = mask
    per_position = jnp.where(at_start, terms["divergence"], 0.0)
    K = batch.span_mask_BxT.shape[1]
    at_end = at_start & (at_tokens(batch.end_span_BxT.astype(jnp.float32), jnp.where(at_start, batch.span_id_BxT, K))
                         > 0)  # the end span's start: the student's EOS position
    divergence = jax.lax.stop_gradient(terms["divergence"])
    metrics = {"divergence": masked_mean(divergence, at_start), "topk_mass": masked_mean(terms["topk_mass"], at_start),
               "dense_position_frac": _response_frac(at_start, batch),
               "end_divergence": masked_mean(divergence, at_end)}
    return per_position, weights, metrics


OBJECTIVES.add("xtok_sampled", Objective((), _SPANS + ("span_teacher_logprobs_BxT",), _none, _sampled_reduce,
                                         signal_mask=_in_span, cross_tokenizer="sampled"))
OBJECTIVES.add("xtok_dense", Objective(("teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK", "support_mask_BxTxK"),
                                       ("dense_mask_BxT",) + _SPANS, _dense_terms, _dense_reduce, student_support=True,
                                       signal_mask=_at_span_start, cross_tokenizer="dense"))
