"""The attention seam (`jopd.models.attention`): its "xla" entry against a plain numpy attention (causal with padding,
packed segments, grouped-query heads, cached decode at a scalar or per-row slots), and the forward's use of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import transformer as T
from jopd.models.attention import ATTENTION, Attention, attention_impl
from jopd.models.config import ModelConfig

B, H, K, Dh = 3, 4, 2, 8  # two query heads per kv head


def reference(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, allowed_BxTxS):
    """softmax(q k^T / sqrt(Dh)) v per query head, over the allowed keys only, kv head h // (H / K)."""
    b_, t_, h_, d_ = q_BxTxHxDh.shape
    group = h_ // k_BxKxSxDh.shape[1]
    out = np.zeros((b_, t_, h_, d_), np.float64)
    for b in range(b_):
        for t in range(t_):
            keys = np.flatnonzero(allowed_BxTxS[b, t])
            if keys.size == 0:  # a padded query that sees nothing: its output is never read
                continue
            for h in range(h_):
                kv = h // group
                s = k_BxKxSxDh[b, kv, keys].astype(np.float64) @ q_BxTxHxDh[b, t, h] / np.sqrt(d_)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v_BxKxSxDh[b, kv, keys]
    return out


def qkv(T_, S, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, T_, H, Dh)).astype(np.float32), rng.normal(size=(B, K, S, Dh)).astype(np.float32),
            rng.normal(size=(B, K, S, Dh)).astype(np.float32))


def test_causal_with_padding_on_either_side():
    T_ = 7
    q, k, v = qkv(T_, T_)
    mask = np.ones((B, T_), bool)
    mask[0, :3] = False  # left padding
    mask[1, 5:] = False  # right padding
    out = np.asarray(ATTENTION["xla"].causal(q, k, v, mask_BxT=mask, dtype=jnp.float32))
    allowed = np.tril(np.ones((T_, T_), bool))[None] & mask[:, None, :]
    ref = reference(q, k, v, allowed)
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)  # a padded query's output is unused


def test_packed_segments_do_not_see_each_other():
    T_ = 8
    q, k, v = qkv(T_, T_, seed=1)
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    mask = np.ones((B, T_), bool)
    mask[0, 7] = False
    out = np.asarray(ATTENTION["xla"].causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32))
    allowed = np.tril(np.ones((T_, T_), bool))[None] & mask[:, None, :] & (seg[:, :, None] == seg[:, None, :])
    ref = reference(q, k, v, allowed)
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)
    # a segment's output does not depend on another segment's keys
    k2 = k.copy()
    k2[0, :, 3:5] += 10.0
    again = np.asarray(ATTENTION["xla"].causal(q, k2, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32))
    np.testing.assert_array_equal(again[0, :3], out[0, :3])


@pytest.mark.parametrize("per_row", [False, True])
def test_cached_decode_at_slots(per_row):
    S, T_ = 12, 2
    q, k, v = qkv(T_, S, seed=2)
    kv_mask = np.ones((B, S), bool)
    kv_mask[0, :2] = False  # a left-padded prompt
    kv_mask[2, 4] = False
    slot = np.array([3, 7, 10]) if per_row else np.int32(5)
    out = np.asarray(ATTENTION["xla"].cached(q, k, v, slot=jnp.asarray(slot), kv_mask_BxS=kv_mask,
                                             dtype=jnp.float32))
    first = np.broadcast_to(slot, (B,))
    q_slot_BxT = first[:, None] + np.arange(T_)[None, :]
    allowed = (np.arange(S)[None, None, :] <= q_slot_BxT[:, :, None]) & kv_mask[:, None, :]
    np.testing.assert_allclose(out, reference(q, k, v, allowed), rtol=1e-5, atol=1e-5)
    # no kv mask: every slot up to the token's own is real
    full = np.asarray(ATTENTION["xla"].cached(q, k, v, slot=jnp.asarray(slot), dtype=jnp.float32))
    allowed = np.arange(S)[None, None, :] <= q_slot_BxT[:, :, None]
    np.testing.assert_allclose(full, reference(q, k, v, allowed), rtol=1e-5, atol=1e-5)


CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=H, num_kv_heads=K,
                  head_dim=Dh, max_position_embeddings=64)


def test_forward_calls_the_named_implementation():
    """An entry registered under a new name is what `forward(attention=name)` runs, for both calls."""
    calls = []
    xla = ATTENTION["xla"]
    ATTENTION.add("test_counting", Attention(
        causal=lambda *a, **kw: calls.append("causal") or xla.causal(*a, **kw),
        cached=lambda *a, **kw: calls.append("cached") or xla.cached(*a, **kw)))
    try:
        params = T.init_params(CFG, jax.random.key(0))
        toks = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 6)))
        ref, _ = T.forward(params, toks, cfg=CFG)
        out, _ = T.forward(params, toks, cfg=CFG, attention="test_counting")
        np.testing.assert_array_equal(out, ref)
        assert calls == ["causal"]  # traced once: the layers run as a scan
        cache = T.init_cache(CFG, 2, 8)
        _, cache = T.forward(params, toks[:, :5], cfg=CFG, cache=cache, cache_index=0, attention="test_counting")
        assert calls == ["causal"] + ["cached"] * CFG.num_layers
    finally:
        ATTENTION.remove("test_counting")


def test_unknown_implementation_is_one_line():
    with pytest.raises(ValueError) as e:
        attention_impl("nope")
    assert "\n" not in str(e.value) and "unknown attention implementation 'nope'" in str(e.value)
    assert "xla" in str(e.value)
    params = T.init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        T.forward(params, jnp.zeros((1, 3), jnp.int32), cfg=CFG, attention="flash")
