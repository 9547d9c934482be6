"""Sampled-token OPD: the per-token reverse-KL estimate as an advantage, with a policy-gradient surrogate."""

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
