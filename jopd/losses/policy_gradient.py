"""Policy-gradient surrogates: sampled-token OPD (the per-token reverse-KL estimate as an advantage), REINFORCE,
PPO's clipped ratio (GRPO), the k3 KL to a reference, and the policy's entropy (a metric)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def discounted_future_sum(rewards_BxT: Float[Array, "B T"], gamma: float) -> Float[Array, "B T"]:
    """A_t = sum_{k >= t} gamma^(k-t) r_k along T (reverse scan); gamma = 0 returns the rewards."""
    if gamma == 0.0:
        return rewards_BxT

    def step(next_sum_B, r_B):
        acc = r_B + gamma * next_sum_B
        return acc, acc

    _, sums_TxB = jax.lax.scan(step, jnp.zeros_like(rewards_BxT[:, 0]), rewards_BxT.T, reverse=True)
    return sums_TxB.T


def opd_advantages(student_logprobs_BxT: Float[Array, "B T"], teacher_logprobs_BxT: Float[Array, "B T"],
                   mask_BxT: Bool[Array, "B T"], gamma: float = 0.0) -> Float[Array, "B T"]:
    """Stop-gradient advantage: reward r_t = -(log pi_s(y_t) - log pi_t(y_t)) on unmasked tokens (0 elsewhere),
    optionally summed over future tokens with discount gamma."""
    rewards = jnp.where(mask_BxT, -(student_logprobs_BxT - teacher_logprobs_BxT), 0.0)
    return jax.lax.stop_gradient(discounted_future_sum(rewards, gamma))


def policy_gradient_surrogate(student_logprobs_BxT: Float[Array, "B T"], advantages_BxT: Float[Array, "B T"]
                              ) -> Float[Array, "B T"]:
    """-A_t log pi_s(y_t): its gradient is the REINFORCE estimate (its value is not a divergence)."""
    return -jax.lax.stop_gradient(advantages_BxT) * student_logprobs_BxT


# Log-ratios are clipped before exp (as in `is_correction`): a token the sampler gave ~0 probability must not
# overflow; outside +-20 the clip has long blocked the gradient anyway.
_MAX_LOG_RATIO = 20.0


def clipped_ratio_surrogate(student_logprobs_BxT: Float[Array, "B T"], behaviour_logprobs_BxT: Float[Array, "B T"],
                            advantages_BxT: Float[Array, "B T"], low: float, high: float
                            ) -> tuple[Float[Array, "B T"], Float[Array, "B T"], Bool[Array, "B T"]]:
    """PPO's clipped objective per token, as a loss: -min(r A, clip(r, low, high) A), r = pi_s(y) / pi_b(y).

    Returns (loss terms, r (stop-gradient), blocked). `blocked` marks the tokens where the clipped term is the
    smaller one, i.e. r > high with A > 0 or r < low with A < 0: there the loss is constant in the student's
    parameters (zero gradient), which keeps the update from moving r further out of the band. In the other
    direction (r > high with A < 0, r < low with A > 0) the unclipped term acts, gradient -A r grad log pi_s.
    Inside the band the gradient is -A r grad log pi_s (= the REINFORCE gradient when r = 1).
    """
    adv = jax.lax.stop_gradient(advantages_BxT)
    log_r = jnp.clip(student_logprobs_BxT - jax.lax.stop_gradient(behaviour_logprobs_BxT),
                     -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_r)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, low, high) * adv
    blocked = jax.lax.stop_gradient(clipped < unclipped)
    # `where`, not `minimum`: at ties (inside the band) minimum would split the gradient between two branches
    return -jnp.where(blocked, clipped, unclipped), jax.lax.stop_gradient(ratio), blocked


def reference_kl_k3(student_logprobs_BxT: Float[Array, "B T"], reference_logprobs_BxT: Float[Array, "B T"]
                    ) -> Float[Array, "B T"]:
    """Per-token k3 estimate of KL(pi_s || pi_ref) on tokens sampled from (about) pi_s: e^d - d - 1 with
    d = log pi_ref(y) - log pi_s(y); >= 0, unbiased, differentiable in the student (GRPO's KL penalty)."""
    d = jnp.clip(jax.lax.stop_gradient(reference_logprobs_BxT) - student_logprobs_BxT,
                 -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.expm1(d) - d


def softmax_entropy(logits_BxTxV: Float[Array, "B T V"]) -> Float[Array, "B T"]:
    """Entropy (nats) of softmax(logits) per position, stop-gradient: H = logsumexp(z) - sum softmax(z) z."""
    z = jax.lax.stop_gradient(logits_BxTxV).astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
