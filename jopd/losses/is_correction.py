"""Importance-sampling correction for rollout/trainer mismatch, the cheap mismatch estimators and the exact one.

The rollouts come from the sampler's distribution q (its own precision/engine); the loss is taken under the
trainer's p. Per sampled token, the ratio r = p(y)/q(y) = exp(log p - log q). Weights are stop-gradient.

`mismatch_terms_BxT` and `effective_sample_size` take numpy or JAX arrays alike: the step logs them in fp32
under jit, the lab (`jopd.lab.mismatch`) sums them per prompt in float64 for its bootstrap, from one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jopd.losses.masks import masked_max, masked_mean, masked_sum

# Log-ratios are clipped before exp so a token the sampler gave ~0 probability cannot overflow the metrics;
# e^20 is far outside any truncation cap or IcePop band, so the weights themselves are unaffected.
_MAX_LOG_RATIO = 20.0


def _array_module(*arrays):
    """jax.numpy when any input is a JAX array (or a tracer), else numpy (which keeps float64)."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def effective_sample_size(sum_r: Float[Array | np.ndarray, "*S"], sum_r2: Float[Array | np.ndarray, "*S"],
                          n: Float[Array | np.ndarray, "*S"]) -> Float[Array | np.ndarray, "*S"]:
    """ESS = (sum r)^2 / (n sum r^2) of n importance ratios from their sums: the effective sample size fraction
    of the IS weights, in (0, 1]; 1 iff all ratios are equal, and 1 when there are none (sum r^2 = 0)."""
    xp = _array_module(sum_r, sum_r2, n)
    return xp.where(sum_r2 > 0, sum_r * sum_r / (n * xp.maximum(sum_r2, 1e-30)), 1.0)


def mismatch_terms_BxT(sampler_logprobs_BxT: Float[Array | np.ndarray, "B T"],
                       trainer_logprobs_BxT: Float[Array | np.ndarray, "B T"],
                       mask_BxT: Bool[Array | np.ndarray, "B T"]) -> dict[str, Float[Array | np.ndarray, "B T"]]:
    """Per sampled token y ~ q, the terms the mismatch estimators average (0 at masked positions), computed in
    the inputs' dtype: k1 = log q(y) - log p(y), k3 = r - 1 - log r, abs_dprob = |p(y) - q(y)|, r = p(y)/q(y)
    and r2 = r^2, with log r clipped to +-20 (`importance_ratio`)."""
    xp = _array_module(sampler_logprobs_BxT, trainer_logprobs_BxT, mask_BxT)
    log_q, log_p, mask = sampler_logprobs_BxT, trainer_logprobs_BxT, mask_BxT.astype(bool)
    log_r = xp.where(mask, xp.clip(log_p - log_q, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    r = xp.where(mask, xp.exp(log_r), 0.0)
    return {"k1": -log_r, "k3": xp.expm1(log_r) - log_r,
            "abs_dprob": xp.where(mask, xp.abs(xp.exp(log_p) - xp.exp(log_q)), 0.0), "r": r, "r2": r * r}


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

    ESS: `effective_sample_size` over the n unmasked tokens.
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
        "is_ess": effective_sample_size(s1, s2, n),
        "is_frac_truncated": truncated,
        "is_frac_dropped": dropped,
    }


def mismatch_estimators(sampler_logprobs_BxT: Float[Array, "B T"], trainer_logprobs_BxT: Float[Array, "B T"],
                        mask_BxT: Bool[Array, "B T"]) -> dict[str, jax.Array]:
    """Estimators of the mismatch KL(q || p) from the sampled tokens y ~ q alone (log q(y) from the sampler,
    log p(y) from the trainer, same temperature), over the masked tokens (`mismatch_terms_BxT`, fp32):
    k1 = mean(log q - log p) (unbiased, any sign per token); k3 = mean(r - 1 - log r), r = p/q (unbiased, >= 0
    per token); mean / max |p(y) - q(y)|; ess = `effective_sample_size` of the IS weights, in (0, 1]."""
    log_q = jax.lax.stop_gradient(sampler_logprobs_BxT).astype(jnp.float32)
    log_p = jax.lax.stop_gradient(trainer_logprobs_BxT).astype(jnp.float32)
    mask = mask_BxT.astype(bool)
    t = mismatch_terms_BxT(log_q, log_p, mask)
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    return {
        "k1": masked_mean(t["k1"], mask),
        "k3": masked_mean(t["k3"], mask),
        "mean_abs_dprob": masked_mean(t["abs_dprob"], mask),
        "max_abs_dprob": masked_max(t["abs_dprob"], mask),
        "ess": effective_sample_size(jnp.sum(t["r"]), jnp.sum(t["r2"]), n),
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


def staleness_split_BxT(sampler_logprobs_BxTxV: Float[Array, "B T V"], lagged_logprobs_BxTxV: Float[Array, "B T V"],
                        trainer_logits_BxTxV: Float[Array, "B T V"], temperature: float = 1.0
                        ) -> dict[str, Float[Array, "B T"]]:
    """The exact mismatch KL(q || p) of `exact_kl_BxT` split per position, with r = the trainer's numerics at the
    sampler's (older) params: engine = KL(q || r) (the engine's numerics at the same params), staleness =
    KL(r || p) (the trainer's numerics at both: params n-k vs n), cross = sum_v (q - r)(log r - log p). The three
    add up to KL(q || p) exactly (to rounding and the clamp at 0 of the two KLs); cross is 0 when q = r or r = p.
    q: the sampler's log-softmax, r: a log-softmax, p = softmax(trainer_logits / temperature); fp32."""
    log_q = sampler_logprobs_BxTxV.astype(jnp.float32)
    log_r = lagged_logprobs_BxTxV.astype(jnp.float32)
    log_p = jax.nn.log_softmax(trainer_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    q, r = jnp.exp(log_q), jnp.exp(log_r)
    engine = jnp.sum(jnp.where(q > 0, q * (log_q - log_r), 0.0), axis=-1)
    staleness = jnp.sum(jnp.where(r > 0, r * (log_r - log_p), 0.0), axis=-1)
    cross = jnp.sum((q - r) * (log_r - log_p), axis=-1)
    return {"engine": jnp.maximum(engine, 0.0), "staleness": jnp.maximum(staleness, 0.0), "cross": cross}
