"""The exact mismatch metric computed inside the chunked loss: KL(sampler || trainer) on response tokens."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import log_softmax, rel_entr, softmax

from jopd.losses import LossBatch, LossConfig, token_loss
from jopd.models import transformer as T
from jopd.models.config import ModelConfig

CFG = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8)


def _setup():
    params = T.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, 37)
    hidden, _ = T.forward(params, toks, cfg=CFG, return_hidden=True)
    logits = np.asarray(T.logits_from_hidden(params, hidden), np.float64)
    mask = np.ones((2, 9), bool)
    mask[1, 6:] = False
    return params, hidden, toks, logits, mask


def test_mismatch_kl_zero_for_identical_engine_and_matches_scipy_for_perturbed_one():
    params, hidden, toks, logits, mask = _setup()
    lc = LossConfig(kind="sft", chunk_size=4, temperature=0.7)
    base = LossBatch(targets_BxT=toks, response_mask_BxT=jnp.asarray(mask))
    same = log_softmax(logits / 0.7, axis=-1)
    _, m = token_loss(lc, params, CFG, hidden, base.replace(sampler_full_logprobs_BxTxV=jnp.asarray(same, jnp.float32)))
    assert abs(float(m["mismatch_kl"])) < 1e-6
    noisy = log_softmax(logits / 0.7 + np.random.RandomState(0).normal(0, 0.3, logits.shape), axis=-1)
    _, m = token_loss(lc, params, CFG, hidden, base.replace(sampler_full_logprobs_BxTxV=jnp.asarray(noisy, jnp.float32)))
    kl = rel_entr(np.exp(noisy), softmax(logits / 0.7, axis=-1)).sum(-1)
    expected = kl[mask].mean()
    assert expected > 1e-3
    np.testing.assert_allclose(float(m["mismatch_kl"]), expected, rtol=1e-4)
