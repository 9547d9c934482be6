"""Model properties that need no reference implementation (parity tests live in test_parity_hf.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jopd.models.config import ModelConfig
from jopd.models import transformer as T

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_left_and_right_padding_give_same_logits_on_real_tokens():
    params = T.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (1, 7), 0, 61)
    right = jnp.concatenate([toks, jnp.zeros((1, 3), jnp.int32)], 1)
    left = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), toks], 1)
    m_r = jnp.arange(10)[None] < 7
    m_l = jnp.arange(10)[None] >= 3
    lr, _ = T.forward(params, right, cfg=CFG, attn_mask_BxT=m_r)
    ll, _ = T.forward(params, left, cfg=CFG, attn_mask_BxT=m_l)
    np.testing.assert_allclose(lr[:, :7], ll[:, 3:], atol=1e-5)


def test_kv_cache_decode_matches_full_forward():
    params = T.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(2), (2, 9), 0, 61)
    full, _ = T.forward(params, toks, cfg=CFG)
    cache = T.init_cache(CFG, 2, 9)
    out, cache = T.forward(params, toks[:, :5], cfg=CFG, cache=cache, cache_index=0)
    steps = [out]
    for t in range(5, 9):
        o, cache = T.forward(params, toks[:, t:t + 1], cfg=CFG, cache=cache, cache_index=t,
                             positions_BxT=jnp.full((2, 1), t))
        steps.append(o)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)


def test_nnx_wrapper_uses_the_same_forward():
    model = T.Transformer(CFG, rngs=nnx.Rngs(3))
    toks = jnp.arange(6)[None] % 61
    via_module, _ = model(toks)
    graphdef, state = nnx.split(model)
    via_merge, _ = nnx.merge(graphdef, state)(toks)
    via_pure, _ = T.forward(T.params_of(model), toks, cfg=CFG)
    np.testing.assert_array_equal(via_module, via_pure)
    np.testing.assert_array_equal(via_merge, via_pure)
    assert jax.tree.structure(T.params_of(model)) == jax.tree.structure(T.abstract_params(CFG))


def test_unstacked_layers_run_the_same_forward():
    params = T.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(2), (2, 7), 0, 61)
    unstacked = T.unstack_layers(params)
    assert isinstance(unstacked["layers"], tuple) and len(unstacked["layers"]) == CFG.num_layers
    np.testing.assert_allclose(T.forward(unstacked, toks, cfg=CFG)[0], T.forward(params, toks, cfg=CFG)[0],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_at_ids_equal_the_full_projection_gathered(tied):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    params = T.init_params(cfg, jax.random.key(4))
    hidden = jax.random.normal(jax.random.key(5), (2, 3, cfg.hidden_size))
    ids = jax.random.randint(jax.random.key(6), (2, 3, 5), 0, cfg.vocab_size)
    full = T.logits_from_hidden(params, hidden)
    np.testing.assert_allclose(T.logits_at_ids(params, hidden, ids), jnp.take_along_axis(full, ids, axis=-1),
                               atol=1e-5, rtol=1e-5)
