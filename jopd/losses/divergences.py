"""Per-token divergences between the student's and the teacher's next-token distributions.

Pure functions over the last (vocabulary or top-K) axis; any leading axes (`*N`, e.g. B, T) broadcast. Every
divergence is a differentiable function of the student logits and returns nats per position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def token_logprobs(logits_NxV: Float[Array, "*N V"], targets_N: Int[Array, "*N"]) -> Float[Array, "*N"]:
    """log softmax(logits)[target] without materializing the full log-softmax."""
    picked = jnp.take_along_axis(logits_NxV, targets_N[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits_NxV, axis=-1)


def cross_entropy(logits_NxV: Float[Array, "*N V"], targets_N: Int[Array, "*N"]) -> Float[Array, "*N"]:
    return -token_logprobs(logits_NxV, targets_N)


def topk_reverse_kl(
    student_logits_NxV: Float[Array, "*N V"],
    teacher_ids_NxK: Int[Array, "*N K"],
    teacher_logprobs_NxK: Float[Array, "*N K"],
) -> tuple[Float[Array, "*N"], Float[Array, "*N"]]:
    """Truncated reverse KL on the teacher's top-K support S, both sides renormalized on S.

    loss = sum_{v in S} p^_s(v) (log p^_s(v) - log p^_t(v)), p^_s = softmax(student_logits[S]),
    p^_t = softmax(teacher_logprobs over S). Returns (loss, student top-K mass sum_{v in S} p_s(v) under the
    student's full softmax; the mass is a stop-gradient metric).
    """
    s_on_support = jnp.take_along_axis(student_logits_NxV, teacher_ids_NxK.astype(jnp.int32), axis=-1)
    return topk_reverse_kl_on_support(s_on_support, teacher_logprobs_NxK), topk_mass(student_logits_NxV,
                                                                                     teacher_ids_NxK)


def _masked(x_NxK: jax.Array, mask_NxK: jax.Array | None) -> jax.Array:
    """Entries outside the support mask (a repeated id of a union support) get -inf: zero mass."""
    return x_NxK if mask_NxK is None else jnp.where(mask_NxK, x_NxK, -jnp.inf)


def _support_kl(log_p_NxK: jax.Array, log_q_NxK: jax.Array, mask_NxK: jax.Array | None) -> jax.Array:
    """sum over the support of p (log p - log q); masked entries contribute exactly 0, and so do their gradients
    (their -inf log-probs are replaced before the product, so no 0 * inf enters the forward or the backward)."""
    if mask_NxK is not None:
        log_p_NxK, log_q_NxK = jnp.where(mask_NxK, log_p_NxK, 0.0), jnp.where(mask_NxK, log_q_NxK, 0.0)
    terms = jnp.exp(log_p_NxK) * (log_p_NxK - log_q_NxK)
    return jnp.sum(terms if mask_NxK is None else jnp.where(mask_NxK, terms, 0.0), axis=-1)


def topk_reverse_kl_on_support(
    student_logits_NxK: Float[Array, "*N K"],
    teacher_logprobs_NxK: Float[Array, "*N K"],
    mask_NxK: Bool[Array, "*N K"] | None = None,
) -> Float[Array, "*N"]:
    """`topk_reverse_kl`'s loss from the student's logits at the K support tokens alone: renormalizing on S
    cancels the student's full-vocabulary logsumexp, so nothing else is needed (nor differentiated). `mask`
    (optional) keeps each support id once: a union of two top-K sets repeats the ids they share."""
    log_ps_hat = jax.nn.log_softmax(_masked(student_logits_NxK, mask_NxK), axis=-1)
    log_pt_hat = jax.nn.log_softmax(_masked(teacher_logprobs_NxK.astype(log_ps_hat.dtype), mask_NxK), axis=-1)
    return _support_kl(log_ps_hat, log_pt_hat, mask_NxK)


def topk_mass(student_logits_NxV: Float[Array, "*N V"], ids_NxK: Int[Array, "*N K"],
              mask_NxK: Bool[Array, "*N K"] | None = None) -> Float[Array, "*N"]:
    """The student's full-softmax mass on the given tokens, each counted once (a stop-gradient metric)."""
    logits = jax.lax.stop_gradient(student_logits_NxV)
    s_on_support = _masked(jnp.take_along_axis(logits, ids_NxK.astype(jnp.int32), axis=-1), mask_NxK)
    return jnp.exp(jax.nn.logsumexp(s_on_support, axis=-1) - jax.nn.logsumexp(logits, axis=-1))


def _log1m_mass(log_mass: jax.Array) -> jax.Array:
    """log(1 - m) from log m, for the tail of a top-K support; m may round to >= 1, so it is kept just below."""
    log_mass = jnp.minimum(log_mass, -1e-7)
    return jnp.log(-jnp.expm1(log_mass))


def topk_tail_reverse_kl(
    student_logits_NxV: Float[Array, "*N V"],
    teacher_ids_NxK: Int[Array, "*N K"],
    teacher_logprobs_NxK: Float[Array, "*N K"],
    mask_NxK: Bool[Array, "*N K"] | None = None,
) -> tuple[Float[Array, "*N"], Float[Array, "*N"]]:
    """Reverse KL between the two distributions coarse-grained to K + 1 outcomes: each of the teacher's top-K
    tokens S (probabilities under the full softmaxes, not renormalized) and "any other token" (the tail).

    loss = sum_{v in S} p_s(v) (log p_s(v) - log p_t(v)) + p_s(tail) (log p_s(tail) - log p_t(tail)).
    Unlike `topk_reverse_kl`, mass the student moves off the teacher's top-K is penalized; it is a lower bound
    of the full reverse KL (coarse-graining never increases KL) and equals it when K = V. Needs the same batch
    (teacher top-K ids and full-softmax log-probs). `mask` keeps each id of a union support once. Returns
    (loss, student mass on the support, stop-gradient).
    """
    s_on_support = jnp.take_along_axis(student_logits_NxV, teacher_ids_NxK.astype(jnp.int32), axis=-1)
    log_ps = _masked(s_on_support - jax.nn.logsumexp(student_logits_NxV, axis=-1, keepdims=True), mask_NxK)
    log_pt = _masked(teacher_logprobs_NxK.astype(log_ps.dtype), mask_NxK)
    log_ps_tail = _log1m_mass(jax.nn.logsumexp(log_ps, axis=-1))
    log_pt_tail = _log1m_mass(jax.nn.logsumexp(log_pt, axis=-1))
    loss = _support_kl(log_ps, log_pt, mask_NxK) + jnp.exp(log_ps_tail) * (log_ps_tail - log_pt_tail)
    return loss, jax.lax.stop_gradient(jnp.exp(jax.nn.logsumexp(log_ps, axis=-1)))


def _kl_from_logprobs(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p||q) = sum p (log p - log q) over the last axis, from normalized log-probabilities."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def reverse_kl(student_logits_NxV: Float[Array, "*N V"], teacher_logits_NxV: Float[Array, "*N V"]
               ) -> Float[Array, "*N"]:
    """KL(p_s || p_t) over the full vocabulary (mode-seeking; what OPD minimizes)."""
    log_ps = jax.nn.log_softmax(student_logits_NxV, axis=-1)
    log_pt = jax.nn.log_softmax(teacher_logits_NxV.astype(log_ps.dtype), axis=-1)
    return _kl_from_logprobs(log_ps, log_pt)


def forward_kl(student_logits_NxV: Float[Array, "*N V"], teacher_logits_NxV: Float[Array, "*N V"]
               ) -> Float[Array, "*N"]:
    """KL(p_t || p_s) over the full vocabulary (mass-covering; the classic distillation loss)."""
    log_ps = jax.nn.log_softmax(student_logits_NxV, axis=-1)
    log_pt = jax.nn.log_softmax(teacher_logits_NxV.astype(log_ps.dtype), axis=-1)
    return _kl_from_logprobs(log_pt, log_ps)


def generalized_jsd(student_logits_NxV: Float[Array, "*N V"], teacher_logits_NxV: Float[Array, "*N V"],
                    beta: float) -> Float[Array, "*N"]:
    """Generalized Jensen-Shannon divergence, GKD convention (Agarwal et al. 2024; TRL's GKD trainer).

    JSD_b = b KL(p_t || m) + (1-b) KL(p_s || m), m = b p_t + (1-b) p_s, for 0 < b < 1. `beta` is a static
    Python float; the ends are defined as the limits of JSD_b/b (b -> 0) and JSD_b/(1-b) (b -> 1):
    b = 0 gives forward KL(p_t || p_s), b = 1 gives reverse KL(p_s || p_t). b = 0.5 is the usual JSD.
    """
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits_NxV, teacher_logits_NxV)
    if beta == 1.0:
        return reverse_kl(student_logits_NxV, teacher_logits_NxV)
    log_ps = jax.nn.log_softmax(student_logits_NxV, axis=-1)
    log_pt = jax.nn.log_softmax(teacher_logits_NxV.astype(log_ps.dtype), axis=-1)
    log_m = jnp.logaddexp(log_pt + jnp.log(beta), log_ps + jnp.log1p(-beta))
    return beta * _kl_from_logprobs(log_pt, log_m) + (1.0 - beta) * _kl_from_logprobs(log_ps, log_m)
