"""Token choice, per decode step and pure: raw logits -> noisy, temperature-scaled logits (`step_logits`) -> one
token per row and its processed log-probability (`choose_tokens`: greedy, or top-k -> top-p -> inverse-CDF draw).

Tokens are drawn by inverse CDF from one uniform per step (two-level over the vocab: no full-vocab cumsum or
per-token random numbers), and the top-p cut is found by bisection on its threshold (`nucleus_threshold`): a sort
of a [64, 49152] block of rows is far slower on CPU than a few passes over it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PrecisionConfig


def _noise_BxV(noise_key_data_Bx2, t, shape_V):
    """Each row's logit noise at its step t (a scalar, or one step per row)."""
    keys = jax.random.wrap_key_data(noise_key_data_Bx2, impl="threefry2x32")
    if jnp.ndim(t) == 0:
        return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, t), shape_V, jnp.float32))(keys)
    return jax.vmap(lambda k, s: jax.random.normal(jax.random.fold_in(k, s), shape_V, jnp.float32))(keys, t)


def take(x_BxC, idx_B):
    """x[b, idx[b]] per row."""
    return jnp.take_along_axis(x_BxC, idx_B[:, None], axis=1)[:, 0]


def _inverse_cdf(probs_BxC, u_B):
    """Inverse-CDF draw: the first entry with positive mass whose cumulative mass reaches u * total (zero-mass
    entries are never returned, whatever the rounding of the cumsum). Also returns the position of u inside
    the chosen entry's interval, rescaled to [0, 1): uniform again, for a second-level draw."""
    cdf = jnp.cumsum(probs_BxC, axis=1)
    x = u_B * cdf[:, -1]
    positive = probs_BxC > 0
    hit = positive & (cdf >= x[:, None])
    last = probs_BxC.shape[1] - 1 - jnp.argmax(positive[:, ::-1], axis=1)
    idx = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), last)
    p = take(probs_BxC, idx)
    residual = (x - (take(cdf, idx) - p)) / jnp.maximum(p, jnp.finfo(jnp.float32).tiny)
    return idx, jnp.clip(residual, 0.0, 1.0 - jnp.finfo(jnp.float32).epsneg)


def sample_index(probs_BxC: Float[Array, "B C"], u_B: Float[Array, "B"], block: int = 256) -> Int[Array, "B"]:
    """Draw index i with probability probs[i] / sum(probs) from one uniform u per row (exact up to fp32
    rounding). Wide rows use two levels (a block by block mass, then an entry inside it), so no cumsum or
    per-entry random number spans the whole vocabulary."""
    B, C = probs_BxC.shape
    if C <= 2 * block:
        return _inverse_cdf(probs_BxC, u_B)[0]
    nb = -(-C // block)
    blocks = jnp.pad(probs_BxC, ((0, 0), (0, nb * block - C))).reshape(B, nb, block)
    j, u_in = _inverse_cdf(jnp.sum(blocks, axis=2), u_B)
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]
    return j * block + _inverse_cdf(inner, u_in)[0]


def _order_key(z: jax.Array) -> jax.Array:
    """int32 key with the order of the float32 values (sign-magnitude -> two's complement)."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def nucleus_threshold(z_BxC: Float[Array, "B C"], lse_B: Float[Array, "B"], top_p: float, bracket: int,
                      blind_steps: int = 6, p_BxC: Float[Array, "B C"] | None = None):
    """Top-p cut without sorting: the smallest kept logit z* per row, where token v is kept iff the probability
    mass of the tokens strictly more probable than v, under p = exp(z - lse), is below top_p (the sorted-prefix
    rule, with tied tokens kept or dropped together).

    Bisection on the order key of the threshold narrows a bracket (lo, hi] with mass(z > hi) < top_p <=
    mass(z > lo) until it holds at most `bracket` tokens (or a single value); those few are then ranked
    exactly with a top-k. Each step is one pass over the row: the first `blind_steps` update only the masses
    (a sort of the vocabulary is far slower on CPU); later steps also count the bracket, to know when to stop.
    """
    B, C = z_BxC.shape
    c = min(bracket, C)
    p = jnp.exp(z_BxC - lse_B[:, None]) if p_BxC is None else p_BxC
    keys = _order_key(z_BxC)
    hi = jnp.max(keys, axis=1)  # mass strictly above the max is 0 < top_p
    # Tokens with z <= lse + log((1 - top_p) / C) - 1 hold at most (1 - top_p) / e of the mass, so the mass
    # above that value is >= top_p + 0.63 (1 - top_p): a valid lower end, far from rounding trouble.
    lo = _order_key(lse_B + math.log((1.0 - top_p) / C) - 1.0)

    def wide(lo, hi):  # more than one representable value left in (lo, hi]
        return jax.lax.bitcast_convert_type(hi - lo, jnp.uint32) > 1  # hi >= lo; the difference may wrap

    def bisect(lo, hi, m_hi, go):
        mid = lo + jax.lax.shift_right_logical(hi - lo, 1)  # exact midpoint, even when hi - lo wraps
        above = keys > mid[:, None]
        m_mid = jnp.sum(jnp.where(above, p, 0.0), axis=1)
        down = go & (m_mid < top_p)  # the threshold is <= mid
        up = go & ~(m_mid < top_p)
        return jnp.where(up, mid, lo), jnp.where(down, mid, hi), jnp.where(down, m_mid, m_hi)

    def blind(_, s):
        lo, hi, m_hi = s
        return bisect(lo, hi, m_hi, wide(lo, hi))

    lo, hi, m_hi = jax.lax.fori_loop(0, blind_steps, blind, (lo, hi, jnp.zeros((B,), jnp.float32)))

    def count(lo, hi):
        return jnp.sum((keys > lo[:, None]) & (keys <= hi[:, None]), axis=1, dtype=jnp.int32)

    def counted(s):
        lo, hi, m_hi, n = s
        lo, hi, m_hi = bisect(lo, hi, m_hi, (n > c) & wide(lo, hi))
        return lo, hi, m_hi, count(lo, hi)

    lo, hi, m_hi, _ = jax.lax.while_loop(lambda s: jnp.any((s[3] > c) & wide(s[0], s[1])), counted,
                                         (lo, hi, m_hi, count(lo, hi)))
    in_bracket = (keys > lo[:, None]) & (keys <= hi[:, None])
    vals, _ = jax.lax.top_k(jnp.where(in_bracket, z_BxC, -jnp.inf), c)
    pv = jnp.exp(vals - lse_B[:, None])
    strictly_above = m_hi[:, None] + jnp.sum(jnp.where(vals[:, None, :] > vals[:, :, None], pv[:, None, :], 0.0),
                                             axis=2)
    keep = (vals > -jnp.inf) & (strictly_above < top_p)
    return jnp.min(jnp.where(keep, vals, jnp.inf), axis=1)


def _sample_above(u_B, z_BxC, lse_B, p_BxC, z_star_B):
    """Sample among entries with z >= z* (renormalized). Returns (index, processed logprob)."""
    kept_p = jnp.where(z_BxC >= z_star_B[:, None], p_BxC, 0.0)
    idx = sample_index(kept_p, u_B)
    return idx, take(z_BxC, idx) - lse_B - jnp.log(jnp.sum(kept_p, axis=1))


def choose_tokens(scaled_BxV: Float[Array, "B V"], u_B: Float[Array, "B"], sampling: SamplingConfig,
                  lse_B: Float[Array, "B"] | None = None):
    """Pick one token per row from temperature-scaled logits, driven by one uniform u per row: argmax (greedy),
    or temperature -> top-k -> top-p on the renormalized top-k -> renormalize -> inverse-CDF draw.
    `lse_B` (the logsumexp of the row) may be passed when already known. Returns (tokens_B, processed
    logprobs_B)."""
    B, V = scaled_BxV.shape
    if sampling.greedy:
        return jnp.argmax(scaled_BxV, axis=1).astype(jnp.int32), jnp.zeros((B,), jnp.float32)
    if 0 < sampling.top_k < V:
        z, ids = jax.lax.top_k(scaled_BxV, sampling.top_k)
        lse = jax.nn.logsumexp(z, axis=1)
    else:
        z, ids = scaled_BxV, None
        lse = jax.nn.logsumexp(z, axis=1) if lse_B is None else lse_B
    p = jnp.exp(z - lse[:, None])
    if sampling.top_p < 1.0:
        z_star = nucleus_threshold(z, lse, sampling.top_p, sampling.top_p_candidates, p_BxC=p)
        idx, logp = _sample_above(u_B, z, lse, p, z_star)
    else:
        idx = sample_index(p, u_B)
        logp = take(z, idx) - lse
    tok = idx if ids is None else take(ids, idx)
    return tok.astype(jnp.int32), logp


def step_logits(logits_BxV, noise_key_data_Bx2, t, precision: PrecisionConfig, temperature: float):
    """Raw logits (already rounded to the logits dtype) -> noisy, temperature-scaled fp32 logits (each row's
    noise at its step t: a scalar, or [B])."""
    z = logits_BxV.astype(jnp.float32)
    if precision.logit_noise > 0:  # static skip: sigma == 0 is bit-identical to no noise
        z = z + precision.logit_noise * _noise_BxV(noise_key_data_Bx2, t, z.shape[1:])
    return z / temperature
