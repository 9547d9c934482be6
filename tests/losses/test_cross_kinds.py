"""The cross-tokenizer kinds normalize by the positions that carry their signal: a row that did not align (no
spans, no span starts) changes neither the loss nor its gradient, whatever its length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.losses.batch import LossBatch
from jopd.losses.config import LossConfig
from jopd.losses.compute import token_loss_from_logits

B, T, V, K = 2, 6, 11, 4


def _batch(rng):
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    span_id = np.array([[0, 0, 1, 2, 2, 3], [T] * T], np.int32)  # row 1: misaligned (no spans)
    span_mask = np.zeros((B, T), bool)
    span_mask[0, :4] = True
    starts = np.zeros((B, T), bool)
    starts[0, [0, 2, 3, 5]] = True
    end = np.zeros((B, T), bool)
    end[0, 3] = True  # row 0's last span (position 5): its EOS
    return LossBatch(
        targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((B, T), bool),
        span_id_BxT=jnp.asarray(span_id), span_mask_BxT=jnp.asarray(span_mask), end_span_BxT=jnp.asarray(end),
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
        batch = batch.replace(span_teacher_logprobs_BxT=None)
    cfg = LossConfig(kind=kind, top_k=K, support="teacher_topk")  # as `step.resolve_loss_config` sets it
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


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_the_end_span_is_logged_apart_from_the_text_spans():
    """`end_signal` (the EOS token's advantage is minus it), `text_signal`, `end_span_frac` of xtok_sampled and the
    dense divergence at the end span's start (`end_divergence`), against numpy on the same batch."""
    rng = np.random.default_rng(1)
    batch = _batch(rng)
    logits = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
    sampled = batch.replace(teacher_topk_ids_BxTxK=None, teacher_topk_logprobs_BxTxK=None, support_mask_BxTxK=None)
    _, m = token_loss_from_logits(LossConfig(kind="xtok_sampled", support="teacher_topk"), logits, sampled)
    lp = _log_softmax(logits)[0, np.arange(T), np.asarray(batch.targets_BxT[0])]
    span = np.asarray(batch.span_id_BxT[0])
    signal = np.array([lp[span == k].sum() for k in range(4)]) - np.asarray(batch.span_teacher_logprobs_BxT[0, :4])
    assert float(m["end_signal"]) == pytest.approx(signal[3], rel=1e-5)
    assert float(m["text_signal"]) == pytest.approx(signal[:3].mean(), rel=1e-5)
    assert float(m["end_span_frac"]) == 1.0  # the one aligned row ended its turn
    dense = batch.replace(span_teacher_logprobs_BxT=None)
    cfg = LossConfig(kind="xtok_dense", top_k=K, support="teacher_topk")
    _, m = token_loss_from_logits(cfg, logits, dense)
    ids, t_lp = np.asarray(batch.teacher_topk_ids_BxTxK[0, 5]), np.asarray(batch.teacher_topk_logprobs_BxTxK[0, 5])
    ps = np.exp(_log_softmax(logits)[0, 5, ids])
    ps_tail, pt_tail = 1 - ps.sum(), 1 - np.exp(t_lp).sum()  # topk_rkl_tail at the EOS position
    want = (ps * (np.log(ps) - t_lp)).sum() + ps_tail * (np.log(ps_tail) - np.log(pt_tail))
    assert float(m["end_divergence"]) == pytest.approx(want, rel=1e-4)
    assert float(m["end_divergence"]) != pytest.approx(float(m["divergence"]), rel=1e-3)
