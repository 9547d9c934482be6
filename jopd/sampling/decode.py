"""The decode primitive every rollout engine and the cost programs (`jopd.sizing.cost`) are made of: `prefill`
(prompts into a KV cache, the logits of each prompt's last position; `prefill_at` for rows with a
response already), `pick` (one step's token choice from raw
logits) and `decode_step` (one token per row through the model against the cache, then `pick`). No other module
runs the cached forward or spells the choice out again.

A cache of S = P + max_new_tokens slots holds prompt token j at slot j and response token t at slot P + t; a row's
response token t - 1 is fed at slot P + t - 1 to choose token t. Each row's randomness at its step t: uniform
`u_B`, logit-noise key `noise_key_data_Bx2` (`config.row_randomness`); `t` is a scalar (every row at one step,
the static engine) or one step per row (the slot engine).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.token_choice import choose_tokens, step_logits, take


class Choice(NamedTuple):
    """One decode step's pick per row."""

    tok_B: Int[Array, "B"]  # the chosen token
    logp_B: Float[Array, "B"]  # its processed log-probability (after truncation; 0 for greedy)
    ulogp_B: Float[Array, "B"]  # its unprocessed log-probability (noise and temperature only)
    full_BxV: Float[Array, "B V"]  # the unprocessed log-softmax (materialized only where it is kept)
    topk_BxK: Int[Array, "B K"] | None  # the (noisy) logits' top-k ids, if `sampling.return_topk`


def _forward_kwargs(cfg: ModelConfig, precision: PrecisionConfig) -> dict:
    return dict(cfg=cfg, dtype=precision.dtype, logits_dtype=precision.logits_jnp_dtype)


def pick(logits_BxV: Float[Array, "B V"], u_B: Float[Array, "B"], noise_key_data_Bx2: Int[Array, "B 2"],
         t: Int[Array, ""] | Int[Array, "B"], *, precision: PrecisionConfig, sampling: SamplingConfig) -> Choice:
    """Raw logits (already in the logits dtype) -> each row's token at step t, its log-probs, the full log-softmax
    and the top-k ids."""
    scaled = step_logits(logits_BxV, noise_key_data_Bx2, t, precision, sampling.temperature)
    lse = jax.nn.logsumexp(scaled, axis=1)
    tok, logp = choose_tokens(scaled, u_B, sampling, lse)
    full = scaled - lse[:, None]  # log-softmax; materialized only when returned
    ulogp = take(scaled, tok) - lse
    topk = jax.lax.top_k(scaled, sampling.return_topk)[1] if sampling.return_topk else None
    return Choice(tok, logp, ulogp, full, topk)


def prefill(params: transformer.Params, prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"],
            cache: transformer.KVCache, *, cfg: ModelConfig, precision: PrecisionConfig, max_new_tokens: int,
            return_routing: bool = False):
    """Left-padded prompts (every row ends with a real token) into cache slots [0, P), attending over the cache's
    full length as the decode steps do; returns the logits at each prompt's last position and the cache (and with
    `return_routing` every prompt token's expert ids per sparse layer [Ls, B, P, k], `transformer.forward`'s)."""
    B = prompt_BxP.shape[0]
    mask = prompt_mask_BxP.astype(bool)
    kv_mask_BxS = jnp.concatenate([mask, jnp.ones((B, max_new_tokens), bool)], axis=1)
    hidden, cache, *routing = transformer.forward(params, prompt_BxP, attn_mask_BxT=mask, cache=cache, cache_index=0,
                                                  positions_BxT=transformer.positions_from_mask(mask),
                                                  kv_mask_BxS=kv_mask_BxS, return_hidden=True,
                                                  return_routing=return_routing, **_forward_kwargs(cfg, precision))
    logits_BxV = transformer.logits_from_hidden(params, hidden[:, -1:], dtype=precision.dtype,
                                                logits_dtype=precision.logits_jnp_dtype)[:, 0]
    return (logits_BxV, cache, *routing)


def prefill_at(params: transformer.Params, tokens_BxT: Int[Array, "B T"], kv_mask_BxS: Bool[Array, "B S"],
               at_B: Int[Array, "B"], cache: transformer.KVCache, *, cfg: ModelConfig, precision: PrecisionConfig):
    """Rows laid out as the cache holds them (prompt in [0, P), response so far from P on; `kv_mask_BxS` marks the
    real slots, its first T columns the fed tokens') into cache slots [0, T) in one forward; returns the logits at
    each row's position `at_B` (its last real token) and the cache. The partial-rollout engine's re-prefill of a
    carried row (`sampling.partial`)."""
    T = tokens_BxT.shape[1]
    hidden, cache = transformer.forward(params, tokens_BxT, attn_mask_BxT=kv_mask_BxS[:, :T], cache=cache,
                                        cache_index=0, kv_mask_BxS=kv_mask_BxS, return_hidden=True,
                                        **_forward_kwargs(cfg, precision))[:2]
    last = jnp.take_along_axis(hidden, at_B[:, None, None], axis=1)  # [B, 1, D]
    logits_BxV = transformer.logits_from_hidden(params, last, dtype=precision.dtype,
                                                logits_dtype=precision.logits_jnp_dtype)[:, 0]
    return logits_BxV, cache


def decode_step(params: transformer.Params, tok_B: Int[Array, "B"], cache: transformer.KVCache,
                slot: Int[Array, ""] | Int[Array, "B"], positions_B: Int[Array, "B"],
                kv_mask_BxS: Bool[Array, "B S"], u_B: Float[Array, "B"], noise_key_data_Bx2: Int[Array, "B 2"],
                t: Int[Array, ""] | Int[Array, "B"], *, cfg: ModelConfig, precision: PrecisionConfig,
                sampling: SamplingConfig, return_routing: bool = False):
    """Each row's last token (RoPE position `positions_B`) into the cache at `slot` (a scalar, or one per row),
    attending to the slots up to its own that `kv_mask_BxS` marks real; then the next token chosen (`pick` at t).
    Returns (the choice, the cache), and with `return_routing` the fed token's expert ids per sparse layer
    [Ls, B, k]."""
    logits, cache, *routing = transformer.forward(params, tok_B[:, None], cache=cache, cache_index=slot,
                                                  positions_BxT=positions_B[:, None], kv_mask_BxS=kv_mask_BxS,
                                                  return_routing=return_routing, **_forward_kwargs(cfg, precision))
    choice = pick(logits[:, 0], u_B, noise_key_data_Bx2, t, precision=precision, sampling=sampling)
    return (choice, cache, routing[0][:, :, 0]) if return_routing else (choice, cache)
