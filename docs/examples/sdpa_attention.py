"""An attention implementation of your own: `jax.nn.dot_product_attention` (JAX's fused-attention API, its XLA
path) behind jopd's attention seam, under the name "sdpa".

The seam hands an implementation structure, never a [B, T, S] mask; this one builds the boolean mask from it, as
the built-in "xla" entry does. A forward then names it:

    transformer.forward(params, tokens_BxT, cfg=cfg, attention="sdpa")

tests/models/test_attention_plugin.py checks exactly this file against the built-in "xla" entry (prefill with
padding, packed segments and GQA; decoding at per-row cache slots) and through a whole forward.
"""

import jax
import jax.numpy as jnp

from jopd.models.attention import ATTENTION, Attention, cache_mask, causal_mask


def _sdpa(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS, dtype):
    # jax.nn.dot_product_attention takes sequence-major K/V ([B, S, K, Dh]) and groups query heads over K itself
    k = k_BxKxSxDh.transpose(0, 2, 1, 3).astype(dtype)
    v = v_BxKxSxDh.transpose(0, 2, 1, 3).astype(dtype)
    out = jax.nn.dot_product_attention(q_BxTxHxDh.astype(dtype), k, v, mask=mask_BxTxS[:, None], implementation="xla")
    return out.astype(dtype)


def causal(q, k, v, *, mask_BxT, segment_ids_BxT=None, dtype):
    return _sdpa(q, k, v, causal_mask(mask_BxT, segment_ids_BxT), dtype)


def cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype):
    if kv_mask_BxS is None:
        kv_mask_BxS = jnp.ones((k_cache.shape[0], k_cache.shape[2]), bool)
    return _sdpa(q, k_cache, v_cache, cache_mask(slot, q.shape[1], kv_mask_BxS), dtype)


ATTENTION.add("sdpa", Attention(causal=causal, cached=cached))
