"""The cross-tokenizer kinds normalize by the positions that carry their signal: a row that did not align (no
spans, no span starts) changes neither the loss nor its gradient, whatever its length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.losses.batch import LossBatch
from jopd.losses.config import LossConfig
from jopd.losses.objectives import token_loss_from_logits

B, T, V, K = 2, 6, 11, 4


def _batch(rng):
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    span_id = np.array([[0, 0, 1, 2, 2, 3], [T] * T], np.int32)  # row 1: misaligned (no spans)
    span_mask = np.zeros((B, T), bool)
    span_mask[0, :4] = True
    starts = np.zeros((B, T), bool)
    starts[0, [0, 2, 3, 5]] = True
    return LossBatch(
        targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((B, T), bool),
        span_id_BxT=jnp.asarray(span_id), span_mask_BxT=jnp.asarray(span_mask),
        span_teacher_logprobs_BxT=jnp.asarray(np.where(span_mask, rng.normal(-3, 1, (B, T)), 0), jnp.float32),
        dense_mask_BxT=jnp.asarray(starts),
        teacher_topk_ids_BxTxK=jnp.asarray(rng.integers(0, V, (B, T, K)), jnp.int32),
        teacher_topk_logprobs_BxTxK=jnp.asarray(np.log(rng.dirichlet(np.ones(K), (B, T)) * 0.8), jnp.float32),
        support_mask_BxTxK=jnp.ones((B, T, K), bool))


@pytest.mark.parametrize("kind", ["xtok_sampled", "xtok_dense"])
def test_a_misaligned_row_neither_adds_to_nor_dilutes_the_loss(kind):
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    if kind == "xtok_sampled":
        batch = batch.replace(teacher_topk_ids_BxTxK=None, teacher_topk_logprobs_BxTxK=None, support_mask_BxTxK=None)
    else:
        batch = batch.replace(span_id_BxT=None, span_mask_BxT=None, span_teacher_logprobs_BxT=None)
    cfg = LossConfig(kind=kind, top_k=K, support="teacher_topk")  # as `step.cross_tokenizer_loss` sets it
    logits = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)

    def loss(logits, batch):
        return token_loss_from_logits(cfg, logits, batch)

    (both, metrics), g_both = jax.value_and_grad(loss, has_aux=True)(logits, batch)
    alone = jax.tree.map(lambda x: x[:1], batch)
    (one, _), g_one = jax.value_and_grad(loss, has_aux=True)(logits[:1], alone)
    assert abs(float(one)) > 1e-4 and float(both) == pytest.approx(float(one), rel=1e-6)
    np.testing.assert_allclose(np.asarray(g_both[:1]), np.asarray(g_one), rtol=1e-5, atol=1e-7)
    assert not np.asarray(g_both[1]).any()  # the misaligned row gets no gradient
    expected = 6 if kind == "xtok_sampled" else 4  # row 0's aligned tokens / span starts
    assert float(metrics["num_tokens"]) == expected
