"""Rollout/trainer **mismatch** (DESIGN.md "Definitions"): the exact full-vocabulary
KL(sampler's next-token distribution q ‖ trainer's p) at the same temperature on the positions the sampler
visited, plus the cheap estimators computed from the sampled tokens only.

Pure functions over arrays (jit-able); the caller supplies the masks of real response tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


def exact_kl_BxT(sampler_logprobs_BxTxV: Float[Array, "B T V"], trainer_logits_BxTxV: Float[Array, "B T V"],
                 temperature: float = 1.0) -> Float[Array, "B T"]:
    """KL(q ‖ p) per position, q = the sampler's (unprocessed, temperature-scaled) log-softmax as returned
    with `SamplingConfig.return_full_logprobs`, p = softmax(trainer_logits / temperature). fp32, >= 0 up to
    rounding; 0 when the engines agree."""
    log_q = sampler_logprobs_BxTxV.astype(jnp.float32)
    log_p = jax.nn.log_softmax(trainer_logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    q = jnp.exp(log_q)
    # q == 0 terms contribute 0 (and log_q may be -inf there).
    return jnp.sum(jnp.where(q > 0, q * (log_q - log_p), 0.0), axis=-1)


def trainer_response_logits(logits_fn: Callable[[np.ndarray, np.ndarray], jax.Array],
                            prompts: Sequence[Sequence[int]], tokens_BxN: Int[Array, "B N"]) -> Float[Array, "B N V"]:
    """The trainer's logits for each response position of the sampler's output: prompt + response (right-padded,
    all N response slots kept) through `logits_fn(tokens_BxT, mask_BxT) -> logits_BxTxV`; row b's response slot t
    is predicted at position len(prompt_b) - 1 + t."""
    tokens_BxN = np.asarray(tokens_BxN)
    n = tokens_BxN.shape[1]
    width = max(map(len, prompts)) + n
    toks = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        toks[i, :len(p) + n], mask[i, :len(p) + n] = list(p) + tokens_BxN[i].tolist(), True
    logits = logits_fn(toks, mask)
    return jnp.stack([logits[i, len(p) - 1:len(p) - 1 + n] for i, p in enumerate(prompts)])


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    m = mask_BxT.astype(jnp.float32)
    return jnp.sum(x_BxT * m) / jnp.maximum(jnp.sum(m), 1.0)


def mismatch_estimators(sampler_logprobs_BxT: Float[Array, "B T"], trainer_logprobs_BxT: Float[Array, "B T"],
                        mask_BxT: Bool[Array, "B T"]) -> dict[str, jax.Array]:
    """Cheap estimators of KL(q ‖ p) from the sampled tokens y ~ q only (log q(y), log p(y) at the same
    temperature; unprocessed sampler logprobs), averaged over real response tokens:

    k1 = mean(log q − log p); k3 = mean(r − 1 − log r) with r = p/q (unbiased, >= 0 per token);
    max/mean |Δprob| = |p(y) − q(y)|; ess = (Σ r)² / (n Σ r²), the effective sample size fraction of the
    importance weights r in (0, 1] (1 when the engines agree).
    """
    m = mask_BxT.astype(bool)
    log_r = trainer_logprobs_BxT.astype(jnp.float32) - sampler_logprobs_BxT.astype(jnp.float32)
    log_r = jnp.where(m, log_r, 0.0)
    r = jnp.exp(log_r)
    dprob = jnp.abs(jnp.exp(trainer_logprobs_BxT.astype(jnp.float32)) -
                    jnp.exp(sampler_logprobs_BxT.astype(jnp.float32)))
    dprob = jnp.where(m, dprob, 0.0)
    n = jnp.maximum(jnp.sum(m), 1)
    rm = jnp.where(m, r, 0.0)
    return {
        "k1": masked_mean(-log_r, m),
        "k3": masked_mean(r - 1.0 - log_r, m),
        "max_abs_dprob": jnp.max(dprob),
        "mean_abs_dprob": masked_mean(dprob, m),
        "ess": jnp.sum(rm) ** 2 / (n * jnp.maximum(jnp.sum(rm * rm), jnp.finfo(jnp.float32).tiny)),
    }
