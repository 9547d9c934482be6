"""Importance-sampling correction for rollout/trainer mismatch, the cheap mismatch estimators and the exact one.

The rollouts come from the sampler's distribution q (its own precision/engine); the loss is taken under the
trainer's p. Per sampled token, the ratio r = p(y)/q(y) = exp(log p - log q). Weights are stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jopd.losses.masks import masked_max, masked_mean, masked_sum

# Log-ratios are clipped before exp so a token the sampler gave ~0 probability cannot overflow the metrics;
# e^20 is far outside any truncation cap or IcePop band, so the weights themselves are unaffected.
_MAX_LOG_RATIO = 20.0


def importance_ratio(trainer_logprobs_BxT: Float[Array, "B T"], sampler_logprobs_BxT: Float[Array, "B T"]
                     ) -> Float[Array, "B T"]:
    log_r = jax.lax.stop_gradient(trainer_logprobs_BxT - sampler_logprobs_BxT)
    return jnp.exp(jnp.clip(log_r, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def importance_weights(ratio_BxT: Float[Array, "B T"], mode: str, *, cap: float = 2.0, low: float = 0.5,
                       high: float = 5.0) -> Float[Array, "B T"]:
    """none: 1; tis (token-level truncated IS): min(r, cap); icepop (masked IS): r if low <= r <= high else 0."""
    ratio_BxT = jax.lax.stop_gradient(ratio_BxT)
    if mode == "none":
        return jnp.ones_like(ratio_BxT)
    if mode == "tis":
        return jnp.minimum(ratio_BxT, cap)
    if mode == "icepop":
        return jnp.where((ratio_BxT >= low) & (ratio_BxT <= high), ratio_BxT, 0.0)
    raise ValueError(f"LossConfig.is_mode: unknown mode {mode!r} (expected none, tis or icepop)")


def is_metrics(ratio_BxT: Float[Array, "B T"], weights_BxT: Float[Array, "B T"], mask_BxT: Bool[Array, "B T"],
               mode: str, *, cap: float, low: float, high: float) -> dict[str, jax.Array]:
    """Fractions truncated / dropped and the normalized effective sample size of the raw ratios.

    ESS = (sum r)^2 / (n sum r^2) over the n unmasked tokens, in (0, 1]; 1 iff all ratios are equal.
    """
    n = jnp.maximum(jnp.sum(mask_BxT), 1).astype(ratio_BxT.dtype)
    s1, s2 = masked_sum(ratio_BxT, mask_BxT), masked_sum(ratio_BxT * ratio_BxT, mask_BxT)
    zero = jnp.zeros((), ratio_BxT.dtype)
    truncated = masked_mean((ratio_BxT > cap).astype(ratio_BxT.dtype), mask_BxT) if mode == "tis" else zero
    outside = (ratio_BxT < low) | (ratio_BxT > high)
    dropped = masked_mean(outside.astype(ratio_BxT.dtype), mask_BxT) if mode == "icepop" else zero
    return {
        "is_ratio_mean": s1 / n,
        "is_weight_mean": masked_mean(weights_BxT, mask_BxT),
        "is_ess": jnp.where(s2 > 0, s1 * s1 / (n * jnp.maximum(s2, 1e-30)), 1.0),
        "is_frac_truncated": truncated,
        "is_frac_dropped": dropped,
    }


def mismatch_estimators(sampler_logprobs_BxT: Float[Array, "B T"], trainer_logprobs_BxT: Float[Array, "B T"],
                        mask_BxT: Bool[Array, "B T"]) -> dict[str, jax.Array]:
    """Estimators of the mismatch KL(q || p) from the sampled tokens y ~ q alone (log q(y) from the sampler,
    log p(y) from the trainer, same temperature), over the masked tokens: k1 = mean(log q - log p) (unbiased,
    any sign per token); k3 = mean(r - 1 - log r), r = p/q (unbiased, >= 0 per token); mean / max |p(y) - q(y)|;
    ess = (sum r)^2 / (n sum r^2), the effective sample size fraction of the IS weights, in (0, 1]."""
    log_q = jax.lax.stop_gradient(sampler_logprobs_BxT).astype(jnp.float32)
    log_p = jax.lax.stop_gradient(trainer_logprobs_BxT).astype(jnp.float32)
    mask = mask_BxT.astype(bool)
    log_r = jnp.where(mask, jnp.clip(log_p - log_q, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    r = jnp.where(mask, jnp.exp(log_r), 0.0)
    dprob = jnp.abs(jnp.exp(log_p) - jnp.exp(log_q))
    s1, s2 = jnp.sum(r), jnp.sum(r * r)
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    return {
        "k1": masked_mean(-log_r, mask),
        "k3": masked_mean(jnp.expm1(log_r) - log_r, mask),
        "mean_abs_dprob": masked_mean(dprob, mask),
        "max_abs_dprob": masked_max(dprob, mask),
        "ess": jnp.where(s2 > 0, s1 * s1 / (n * jnp.maximum(s2, 1e-30)), 1.0),
    }


def exact_kl_BxT(sampler_logprobs_BxTxV: Float[Array, "B T V"], trainer_logits_BxTxV: Float[Array, "B T V"],
                 temperature: float = 1.0) -> Float[Array, "B T"]:
    """KL(q ‖ p) per position, q = the sampler's (unprocessed, temperature-scaled) log-softmax as returned
    with `SamplingConfig.return_full_logprobs`, p = softmax(trainer_logits / temperature). fp32, clamped at 0
    (rounding); 0 when the engines agree."""
    log_q = sampler_logprobs_BxTxV.astype(jnp.float32)
    log_p = jax.nn.log_softmax(trainer_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    q = jnp.exp(log_q)
    # q == 0 terms contribute 0 (and log_q may be -inf there); KL >= 0, but identical engines round to ±1e-10
    kl = jnp.sum(jnp.where(q > 0, q * (log_q - log_p), 0.0), axis=-1)
    return jnp.maximum(kl, 0.0)
