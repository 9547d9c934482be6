"""Loss formulas and properties on explicit logits (tiny vocab), against numpy/scipy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.special import log_softmax as np_log_softmax
from scipy.special import rel_entr

from jopd.config_dataclass import ConfigError, build
from jopd.losses import (LossBatch, LossConfig, discounted_future_sum, forward_kl, generalized_jsd, importance_ratio,
                         importance_weights, is_metrics, loss_mask, mismatch_estimators, reverse_kl,
                         token_logprobs, token_loss_from_logits, topk_reverse_kl, topk_tail_reverse_kl)
from jopd.losses.kinds import OBJECTIVES

B, T, V, K = 2, 6, 11, 4
SPECIAL = (9, 10)


def _rand(seed, shape, scale=2.0):
    return np.random.default_rng(seed).normal(size=shape) * scale


def _np_topk_rkl(s_logits, ids, t_logprobs):
    ls = np_log_softmax(np.take_along_axis(s_logits, ids, -1), axis=-1)
    lt = np_log_softmax(t_logprobs, axis=-1)
    return np.sum(np.exp(ls) * (ls - lt), -1)


def _teacher_topk(t_logits, k):
    lp = jax.nn.log_softmax(jnp.asarray(t_logits, jnp.float32), -1)
    vals, ids = jax.lax.top_k(lp, k)
    return ids, vals


def _batch(kind, s_logits, t_logits, k=K, seed=0, **extra):
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, min(SPECIAL), (B, T))
    targets[0, 3], targets[1, 2] = SPECIAL  # special-token targets inside the response
    response = np.ones((B, T), bool)
    response[0, :2] = False  # prompt
    response[1, -1] = False  # padding
    batch = {"targets_BxT": jnp.asarray(targets, jnp.int32), "response_mask_BxT": jnp.asarray(response)}
    if kind in ("topk_rkl", "topk_rkl_tail"):
        batch["teacher_topk_ids_BxTxK"], batch["teacher_topk_logprobs_BxTxK"] = _teacher_topk(t_logits, k)
    elif kind == "sampled_opd":
        batch["teacher_target_logprobs_BxT"] = token_logprobs(jnp.asarray(t_logits, jnp.float32),
                                                              batch["targets_BxT"])
    elif kind in ("rkl", "fkl", "jsd"):  # the teacher's "hidden states" are its logits, its head the identity
        batch["teacher_hidden_BxTxD"] = jnp.asarray(t_logits, jnp.float32)
    return LossBatch(**batch, **extra)


def identity_head(v):
    """A teacher head that maps hidden states to themselves: `teacher_hidden_BxTxD` then holds the logits."""
    return {"lm_head": jnp.eye(v, dtype=jnp.float32)}


def _head(cfg, v):
    return identity_head(v) if OBJECTIVES[cfg.kind].reads_teacher_head else None


def _cfg(kind, **kw):
    kw.setdefault("support", "teacher_topk")  # these batches carry the teacher's top-K only (test_support: union)
    return LossConfig(kind=kind, top_k=kw.pop("top_k", K), special_token_ids=SPECIAL, **kw)


def _loss_and_grad(cfg, logits, batch):
    head = _head(cfg, np.shape(logits)[-1])
    return jax.value_and_grad(lambda x: token_loss_from_logits(cfg, x, batch, head)[0])(jnp.asarray(logits,
                                                                                                 jnp.float32))


# ------------------------------------------------------------------------------------------- truncated RKL

def test_topk_rkl_matches_numpy_formula_and_token_mean():
    s, t = _rand(0, (B, T, V)), _rand(1, (B, T, V))
    batch = _batch("topk_rkl", s, t)
    ids, lps = np.asarray(batch.teacher_topk_ids_BxTxK), np.asarray(batch.teacher_topk_logprobs_BxTxK)
    loss, mass = topk_reverse_kl(jnp.asarray(s, jnp.float32), batch.teacher_topk_ids_BxTxK, batch.teacher_topk_logprobs_BxTxK)
    ref = _np_topk_rkl(s, ids, lps)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)
    p_s = np.exp(np_log_softmax(s, -1))
    np.testing.assert_allclose(mass, np.take_along_axis(p_s, ids, -1).sum(-1), rtol=1e-5)

    total, metrics = token_loss_from_logits(_cfg("topk_rkl"), jnp.asarray(s, jnp.float32), batch)
    mask = np.asarray(batch.response_mask_BxT) & ~np.isin(np.asarray(batch.targets_BxT), SPECIAL)
    assert metrics["num_tokens"] == mask.sum() == B * T - 3 - 2
    np.testing.assert_allclose(total, ref[mask].sum() / mask.sum(), rtol=1e-5)
    # an explicit normalizer (e.g. the token count of all gradient-accumulation micro-batches) replaces N
    total2, _ = token_loss_from_logits(_cfg("topk_rkl"), jnp.asarray(s, jnp.float32),
                                       batch.replace(token_normalizer=jnp.float32(40.0)))
    np.testing.assert_allclose(total2, ref[mask].sum() / 40.0, rtol=1e-5)
    np.testing.assert_allclose(metrics["topk_mass"], np.take_along_axis(p_s, ids, -1).sum(-1)[mask].mean(),
                               rtol=1e-5)


def _gradient_vs_central_differences(jax_loss, np_loss, seed):
    """float64 (scoped) so central differences are exact to ~1e-10: truncation eps^2 * (third derivative) ~ 1e-12, roundoff
    1e-16 / eps ~ 1e-10; the numpy formula being differenced is an independent implementation.
    Returns (gradient, finite differences, off-support mask)."""
    s, t = _rand(seed, (3, V)), _rand(seed + 1, (3, V))
    coef = np.array([0.7, -1.3, 2.1])
    with jax.enable_x64(True):
        vals, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(t), -1), K)
        ids_np, vals_np = np.asarray(ids), np.asarray(vals)
        grad = jax.grad(lambda x: jnp.sum(coef * jax_loss(x, ids, vals)[0]))(jnp.asarray(s))
        assert grad.dtype == jnp.float64
    eps = 1e-6
    fd = np.zeros_like(s)
    for idx in np.ndindex(*s.shape):
        plus, minus = s.copy(), s.copy()
        plus[idx] += eps
        minus[idx] -= eps
        fd[idx] = (coef @ np_loss(plus, ids_np, vals_np) - coef @ np_loss(minus, ids_np, vals_np)) / (2 * eps)
    off_support = np.ones_like(s, bool)
    np.put_along_axis(off_support, ids_np, False, -1)
    return np.asarray(grad), fd, off_support


def test_topk_rkl_gradient_matches_finite_differences():
    grad, fd, off_support = _gradient_vs_central_differences(topk_reverse_kl, _np_topk_rkl, seed=2)
    np.testing.assert_allclose(grad, fd, atol=1e-8)
    assert np.all(grad[off_support] == 0.0)  # the loss only sees logits on the support


@pytest.mark.parametrize("kind,atol", [("topk_rkl", 1e-7), ("topk_rkl_tail", 1e-6)])
def test_topk_losses_with_k_equal_vocab_are_full_reverse_kl(kind, atol):
    s, t = _rand(4, (B, T, V)), _rand(5, (B, T, V))
    l_topk, g_topk = _loss_and_grad(_cfg(kind, top_k=V), s, _batch(kind, s, t, k=V))
    l_full, g_full = _loss_and_grad(_cfg("rkl"), s, _batch("rkl", s, t))
    np.testing.assert_allclose(l_topk, l_full, rtol=1e-5)
    np.testing.assert_allclose(g_topk, g_full, rtol=1e-4, atol=atol)
    _, metrics = token_loss_from_logits(_cfg(kind, top_k=V), jnp.asarray(s, jnp.float32), _batch(kind, s, t, k=V))
    np.testing.assert_allclose(metrics["topk_mass"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["teacher_topk_mass"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("kind", ["topk_rkl", "topk_rkl_tail", "rkl", "fkl", "jsd"])
def test_zero_loss_and_gradient_when_student_equals_teacher(kind):
    t = _rand(6, (B, T, V))
    s = t + 3.0  # a constant shift leaves the distribution unchanged
    loss, grad = _loss_and_grad(_cfg(kind), s, _batch(kind, s, t))
    assert abs(float(loss)) < 1e-6
    assert float(jnp.max(jnp.abs(grad))) < 1e-6


# ------------------------------------------------------------------------------------------- top-K + tail RKL

def _np_topk_tail_rkl(s_logits, ids, t_logprobs):
    """KL between the (K + 1)-outcome coarse-grainings, from probabilities (an independent formula)."""
    p_s = np.take_along_axis(np.exp(np_log_softmax(s_logits, -1)), ids, -1)
    p_t = np.exp(t_logprobs)
    tail_s, tail_t = 1 - p_s.sum(-1), 1 - p_t.sum(-1)
    return rel_entr(p_s, p_t).sum(-1) + rel_entr(tail_s, tail_t)


def test_topk_tail_rkl_matches_formula_bounds_full_rkl_and_sees_off_support_mass():
    s, t = _rand(11, (B, T, V)), _rand(12, (B, T, V))
    batch = _batch("topk_rkl_tail", s, t)
    ids, lps = np.asarray(batch.teacher_topk_ids_BxTxK), np.asarray(batch.teacher_topk_logprobs_BxTxK)
    loss, mass = topk_tail_reverse_kl(jnp.asarray(s, jnp.float32), batch.teacher_topk_ids_BxTxK,
                                      batch.teacher_topk_logprobs_BxTxK)
    np.testing.assert_allclose(loss, _np_topk_tail_rkl(s, ids, lps), rtol=1e-5, atol=1e-6)
    full = np.asarray(reverse_kl(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32)))
    assert np.all(np.asarray(loss) <= full + 1e-6)  # coarse-graining never increases KL
    # Moving student mass off the support, with the shape on the support unchanged: the renormalized loss
    # cannot see it, the tail loss grows.
    off = np.ones_like(s, bool)
    np.put_along_axis(off, ids, False, -1)
    s_off = np.where(off, s + 3.0, s)
    renorm = [topk_reverse_kl(jnp.asarray(x, jnp.float32), batch.teacher_topk_ids_BxTxK,
                              batch.teacher_topk_logprobs_BxTxK)[0] for x in (s, s_off)]
    np.testing.assert_allclose(renorm[0], renorm[1], rtol=1e-5)
    tail_off = topk_tail_reverse_kl(jnp.asarray(s_off, jnp.float32), batch.teacher_topk_ids_BxTxK,
                                    batch.teacher_topk_logprobs_BxTxK)[0]
    assert np.all(np.asarray(tail_off) > np.asarray(loss))


def test_topk_tail_rkl_gradient_matches_finite_differences():
    grad, fd, off_support = _gradient_vs_central_differences(topk_tail_reverse_kl, _np_topk_tail_rkl, seed=13)
    np.testing.assert_allclose(grad, fd, atol=1e-8)
    assert np.all(np.abs(grad[off_support]) > 0)  # unlike the renormalized loss, off-support logits get a gradient


# ------------------------------------------------------------------------------------------- masks

def test_loss_mask_drops_prompt_padding_and_special_targets():
    targets = jnp.array([[1, 9, 2, 10, 3]])
    response = jnp.array([[0, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(loss_mask(response, targets, SPECIAL), [[0, 0, 1, 0, 1]])
    np.testing.assert_array_equal(loss_mask(response, targets, ()), response)


@pytest.mark.parametrize("kind,extra", [("topk_rkl", {}), ("topk_rkl_tail", {}), ("rkl", {}), ("fkl", {}), ("jsd", {"options": {"beta": 0.3}}),
                                        ("sft", {}), ("sampled_opd", {"options": {"gamma": 0.9}}),
                                        ("topk_rkl", {"is_mode": "tis"}), ("sampled_opd", {"is_mode": "icepop"})])
def test_masked_positions_contribute_nothing(kind, extra):
    s, t = _rand(7, (B, T, V)), _rand(8, (B, T, V))
    sampler = {"sampler_logprobs_BxT": jnp.asarray(_rand(9, (B, T), 0.3) - 2.0, jnp.float32)}
    batch = _batch(kind, s, t, **sampler)
    cfg = _cfg(kind, **extra)
    mask = np.asarray(loss_mask(batch.response_mask_BxT, batch.targets_BxT, SPECIAL))
    assert (~mask).sum() == 5
    loss, grad = _loss_and_grad(cfg, s, batch)
    s2 = np.where(mask[..., None], s, _rand(10, (B, T, V), 10.0))  # change only the masked positions
    loss2, grad2 = _loss_and_grad(cfg, s2, batch)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    np.testing.assert_allclose(grad2, grad, rtol=1e-6, atol=1e-9)
    assert np.all(np.asarray(grad)[~mask] == 0.0)
    assert float(jnp.abs(grad).max()) > 0


# ------------------------------------------------------------------------------------------- full-vocab divergences

def test_forward_kl_and_jsd_match_scipy():
    s, t = _rand(11, (5, V)), _rand(12, (5, V))
    ps, pt = np.exp(np_log_softmax(s, -1)), np.exp(np_log_softmax(t, -1))
    sj, tj = jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32)
    np.testing.assert_allclose(forward_kl(sj, tj), rel_entr(pt, ps).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(reverse_kl(sj, tj), rel_entr(ps, pt).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(generalized_jsd(sj, tj, 0.5), jensenshannon(ps, pt, axis=-1) ** 2, rtol=1e-5)
    for beta in (0.1, 0.7):
        m = beta * pt + (1 - beta) * ps
        ref = beta * rel_entr(pt, m).sum(-1) + (1 - beta) * rel_entr(ps, m).sum(-1)
        np.testing.assert_allclose(generalized_jsd(sj, tj, beta), ref, rtol=1e-5)


def test_jsd_limits_are_forward_and_reverse_kl():
    s, t = _rand(13, (5, V)), _rand(14, (5, V))
    with jax.enable_x64(True):
        sj, tj = jnp.asarray(s), jnp.asarray(t)
        fkl, rkl = forward_kl(sj, tj), reverse_kl(sj, tj)
        np.testing.assert_array_equal(generalized_jsd(sj, tj, 0.0), fkl)
        np.testing.assert_array_equal(generalized_jsd(sj, tj, 1.0), rkl)
        b = 1e-8  # JSD_b = b * FKL + O(b^2) (the O(b^2) constant grows with how far apart p_s, p_t are)
        np.testing.assert_allclose(generalized_jsd(sj, tj, b) / b, fkl, rtol=1e-4)
        np.testing.assert_allclose(generalized_jsd(sj, tj, 1 - b) / b, rkl, rtol=1e-4)


def test_sft_is_token_mean_cross_entropy():
    s = _rand(15, (B, T, V))
    batch = _batch("sft", s, None)
    loss, metrics = token_loss_from_logits(_cfg("sft"), jnp.asarray(s, jnp.float32), batch)
    nll = -np.take_along_axis(np_log_softmax(s, -1), np.asarray(batch.targets_BxT)[..., None], -1)[..., 0]
    mask = np.asarray(loss_mask(batch.response_mask_BxT, batch.targets_BxT, SPECIAL))
    np.testing.assert_allclose(loss, nll[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["divergence"], nll[mask].mean(), rtol=1e-5)


# ------------------------------------------------------------------------------------------- sampled-token OPD

@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_sampled_opd_expected_gradient_matches_full_reverse_kl(gamma):
    # Positions are independent here (logits do not depend on earlier tokens), so E[grad of -A log pi(y)] over
    # y ~ pi_s equals grad KL(pi_s || pi_t) exactly, for any gamma (future rewards are independent of y_t and
    # E[grad log pi] = 0). With N = 20000 samples the Monte-Carlo relative error of the mean gradient is
    # ~0.015 (gamma=0) to ~0.03 (gamma=0.9) (measured over seeds 0-2), so cosine > 0.99 and relative error < 0.1
    # leave >3x margin, while a sign, stop-gradient or normalization bug breaks both by far.
    n, t_len, v = 20000, 4, 6
    s, t = jnp.asarray(_rand(16, (t_len, v), 1.0), jnp.float32), jnp.asarray(_rand(17, (t_len, v), 1.0), jnp.float32)
    y = jax.random.categorical(jax.random.key(0), s, shape=(n, t_len))
    batch = LossBatch(targets_BxT=y, response_mask_BxT=jnp.ones((n, t_len), bool),
                      teacher_target_logprobs_BxT=token_logprobs(jnp.broadcast_to(t, (n, t_len, v)), y))
    cfg = LossConfig(kind="sampled_opd", options={"gamma": gamma})
    g_pg = jax.jit(jax.grad(lambda x: token_loss_from_logits(cfg, jnp.broadcast_to(x, (n, t_len, v)), batch)[0]))(s)
    full = LossBatch(targets_BxT=jnp.zeros((1, t_len), jnp.int32), response_mask_BxT=jnp.ones((1, t_len), bool),
                     teacher_hidden_BxTxD=t[None])
    g_rkl = jax.grad(lambda x: token_loss_from_logits(LossConfig(kind="rkl"), x[None], full, identity_head(v))[0])(s)
    cos = float(jnp.vdot(g_pg, g_rkl) / (jnp.linalg.norm(g_pg) * jnp.linalg.norm(g_rkl)))
    rel_err = float(jnp.linalg.norm(g_pg - g_rkl) / jnp.linalg.norm(g_rkl))
    assert cos > 0.99 and rel_err < 0.1, (cos, rel_err)


def test_discounted_future_sum_and_masked_rewards():
    r = _rand(18, (3, 7))
    gamma = 0.8
    ref = np.zeros_like(r)
    for b in range(3):
        acc = 0.0
        for t in reversed(range(7)):
            acc = r[b, t] + gamma * acc
            ref[b, t] = acc
    np.testing.assert_allclose(discounted_future_sum(jnp.asarray(r, jnp.float32), gamma), ref, rtol=1e-5)
    np.testing.assert_array_equal(discounted_future_sum(jnp.asarray(r, jnp.float32), 0.0), r.astype(np.float32))


# ------------------------------------------------------------------------------------------- IS correction

@pytest.mark.parametrize("mode", ["none", "tis", "icepop"])
def test_is_weights_are_one_when_sampler_equals_trainer(mode):
    lp = jnp.asarray(_rand(19, (B, T), 1.0) - 3.0, jnp.float32)
    ratio = importance_ratio(lp, lp)
    w = importance_weights(ratio, mode)
    np.testing.assert_array_equal(w, 1.0)
    m = is_metrics(ratio, w, jnp.ones((B, T), bool), mode, cap=2.0, low=0.5, high=5.0)
    assert float(m["is_ess"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["is_frac_truncated"]) == 0.0 and float(m["is_frac_dropped"]) == 0.0
    mm = mismatch_estimators(lp, lp, jnp.ones((B, T), bool))
    assert float(mm.pop("ess")) == 1.0  # all IS weights equal
    assert all(float(v) == 0.0 for v in mm.values())


def test_tis_truncates_at_cap_and_icepop_drops_outside_band():
    ratio = jnp.array([[0.1, 0.5, 1.0, 2.0, 3.0, 5.0, 7.0]])
    log_r = jnp.log(ratio)
    r = importance_ratio(log_r - 1.0, jnp.full_like(log_r, -1.0))
    np.testing.assert_allclose(r, ratio, rtol=1e-6)
    np.testing.assert_allclose(importance_weights(ratio, "tis", cap=2.0), [[0.1, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_allclose(importance_weights(ratio, "icepop", low=0.5, high=5.0),
                               [[0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 0.0]])  # the band is inclusive
    mask = jnp.array([[1, 1, 1, 1, 1, 1, 0]], bool)  # the last token is masked out of the metrics
    m_tis = is_metrics(ratio, importance_weights(ratio, "tis", cap=2.0), mask, "tis", cap=2.0, low=0.5, high=5.0)
    assert float(m_tis["is_frac_truncated"]) == pytest.approx(2 / 6)
    m_ice = is_metrics(ratio, importance_weights(ratio, "icepop"), mask, "icepop", cap=2.0, low=0.5, high=5.0)
    assert float(m_ice["is_frac_dropped"]) == pytest.approx(1 / 6)
    rr = np.array([0.1, 0.5, 1.0, 2.0, 3.0, 5.0])
    assert float(m_ice["is_ess"]) == pytest.approx(rr.sum() ** 2 / (6 * (rr ** 2).sum()), rel=1e-6)
    grad = jax.grad(lambda lp: jnp.sum(importance_weights(importance_ratio(lp, jnp.zeros_like(lp)), "tis")))(log_r)
    assert np.all(np.asarray(grad) == 0.0)  # weights are stop-gradient


def test_is_weights_scale_per_token_losses_in_token_loss():
    s, t = _rand(20, (B, T, V)), _rand(21, (B, T, V))
    base = _batch("topk_rkl", s, t)
    trainer_lp = token_logprobs(jnp.asarray(s, jnp.float32), base.targets_BxT)
    log_r = jnp.asarray(_rand(22, (B, T), 1.0), jnp.float32)
    batch = base.replace(sampler_logprobs_BxT=trainer_lp - log_r)
    per_token = _np_topk_rkl(s, np.asarray(base.teacher_topk_ids_BxTxK), np.asarray(base.teacher_topk_logprobs_BxTxK))
    mask = np.asarray(loss_mask(base.response_mask_BxT, base.targets_BxT, SPECIAL))
    r = np.exp(np.asarray(log_r, np.float64))
    for mode, w in [("none", np.ones_like(r)), ("tis", np.minimum(r, 1.5)),
                    ("icepop", np.where((r >= 0.6) & (r <= 1.8), r, 0.0))]:
        cfg = _cfg("topk_rkl", is_mode=mode, is_cap=1.5, icepop_low=0.6, icepop_high=1.8)
        loss, metrics = token_loss_from_logits(cfg, jnp.asarray(s, jnp.float32), batch)
        np.testing.assert_allclose(loss, (w * per_token)[mask].sum() / mask.sum(), rtol=1e-4)
        np.testing.assert_allclose(metrics["mismatch_k1"], -np.asarray(log_r)[mask].mean(), rtol=1e-4, atol=1e-6)
        lr = np.asarray(log_r, np.float64)[mask]
        np.testing.assert_allclose(metrics["mismatch_k3"], (np.expm1(lr) - lr).mean(), rtol=1e-4)
    # sampler == trainer: TIS/IcePop leave the loss unchanged
    same = base.replace(sampler_logprobs_BxT=trainer_lp)
    l_none = token_loss_from_logits(_cfg("topk_rkl"), jnp.asarray(s, jnp.float32), same)[0]
    for mode in ("tis", "icepop"):
        l_is, m = token_loss_from_logits(_cfg("topk_rkl", is_mode=mode), jnp.asarray(s, jnp.float32), same)
        np.testing.assert_allclose(l_is, l_none, rtol=1e-6)
        np.testing.assert_allclose(m["is_weight_mean"], 1.0, rtol=1e-6)


# ------------------------------------------------------------------------------------------- config and inputs

def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"^loss\.kind: "):
        build(LossConfig, {"kind": "kl"}, "loss")
    with pytest.raises(ConfigError, match=r"^loss\.topk: unknown key"):
        build(LossConfig, {"topk": 8}, "loss")
    with pytest.raises(ConfigError, match=r"^loss\.icepop_high: .*icepop_low"):
        build(LossConfig, {"icepop_low": 2.0, "icepop_high": 1.0}, "loss")
    with pytest.raises(ConfigError, match=r"^loss\.special_token_ids\.1: "):
        build(LossConfig, {"special_token_ids": [3, -1]}, "loss")
    assert build(LossConfig, {"special_token_ids": [3, 4]}).special_token_ids == (3, 4)


def test_missing_or_misshaped_batch_entries_raise_one_clear_error():
    s = jnp.zeros((B, T, V))
    batch = _batch("sft", np.zeros((B, T, V)), None)
    with pytest.raises(ValueError, match=r"LossBatch.teacher_topk_ids_BxTxK: missing \(needed by LossConfig.kind='topk_rkl'\)"):
        token_loss_from_logits(_cfg("topk_rkl"), s, batch)
    with pytest.raises(ValueError, match="LossBatch.sampler_logprobs_BxT: missing.*is_mode='tis'"):
        token_loss_from_logits(_cfg("sft", is_mode="tis"), s, batch)
    t = _rand(23, (B, T, V))
    with pytest.raises(ValueError, match=r"LossConfig.support_size\)=\(2, 6, 3\)"):
        token_loss_from_logits(_cfg("topk_rkl", top_k=3), s, _batch("topk_rkl", t, t, k=4))
    with pytest.raises(ValueError, match=r"LossBatch.sampler_logprobs_BxT: shape \(2, 5\)"):
        token_loss_from_logits(_cfg("sft"), s, batch.replace(sampler_logprobs_BxT=jnp.zeros((B, T - 1))))
    token_loss_from_logits(_cfg("sft"), s, batch.replace(advantages_BxT=jnp.zeros((B, T))))  # fields it does not read


# -- RL kinds: GRPO's clipped ratio, the KL to a reference, token-sum normalization, entropy ---------------------


def _own_logprobs(logits, targets):
    return np.take_along_axis(np_log_softmax(np.asarray(logits, np.float64), -1), targets[..., None], -1)[..., 0]


def test_clipped_ratio_gradient_vanishes_only_in_the_direction_the_clip_blocks():
    """One row, one position per case: r = pi_s / pi_b set by the behaviour log-prob. The gradient at a
    position is zero iff (r > 1 + eps, A > 0) or (r < 1 - eps, A < 0)."""
    cases = [(1.5, 1.0, True), (1.5, -1.0, False), (0.5, -1.0, True), (0.5, 1.0, False), (1.0, 1.0, False),
             (1.1, 1.0, False), (0.9, -1.0, False), (1.3, 1.0, True)]  # (ratio, advantage, blocked)
    n = len(cases)
    logits = jnp.asarray(_rand(31, (1, n, V)), jnp.float32)
    targets = np.random.default_rng(32).integers(0, V, (1, n))
    own = _own_logprobs(logits, targets)
    ratio = np.array([[c[0] for c in cases]])
    batch = LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((1, n), bool),
                      advantages_BxT=jnp.asarray([[c[1] for c in cases]], jnp.float32),
                      sampler_logprobs_BxT=jnp.asarray(own - np.log(ratio), jnp.float32))
    cfg = LossConfig(kind="grpo", options={"clip_eps": 0.2})
    grad = jax.grad(lambda lg: token_loss_from_logits(cfg, lg, batch)[0])(logits)
    per_position = np.abs(np.asarray(grad)).sum(-1)[0]
    for (r, a, blocked), g in zip(cases, per_position):
        assert (g == 0.0) == blocked, (r, a, g)
    # unblocked: the gradient is r times the REINFORCE gradient of that token (-A r d log pi / n)
    reinforce = jax.grad(lambda lg: token_loss_from_logits(LossConfig(kind="reinforce"), lg, batch)[0])(logits)
    for t, (r, a, blocked) in enumerate(cases):
        if not blocked:
            np.testing.assert_allclose(grad[0, t], r * reinforce[0, t], rtol=1e-4, atol=1e-7)
    _, m = token_loss_from_logits(cfg, logits, batch)
    assert float(m["clip_frac"]) == pytest.approx(3 / n)
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio.mean(), rtol=1e-5)


def test_clip_eps_high_widens_only_the_upper_side():
    logits = jnp.asarray(_rand(33, (1, 2, V)), jnp.float32)
    targets = np.zeros((1, 2), np.int64)
    own = _own_logprobs(logits, targets)
    batch = LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((1, 2), bool),
                      advantages_BxT=jnp.asarray([[1.0, -1.0]], jnp.float32),
                      sampler_logprobs_BxT=jnp.asarray(own - np.log([[1.25, 0.75]]), jnp.float32))
    def frac(**kw):
        return float(token_loss_from_logits(LossConfig(kind="grpo", options=kw), logits, batch)[1]["clip_frac"])

    assert frac(clip_eps=0.2) == 1.0  # both clipped
    assert frac(clip_eps=0.2, clip_eps_high=0.28) == 0.5  # 1.25 now inside [0.8, 1.28]; 0.75 still below 0.8


def test_grpo_is_mode_bounds_the_ratio_instead_of_doubling_it():
    """tis: the effective per-token weight is min(r, cap) (here r = 3 on a negative-advantage token, which
    the clip leaves unbounded); icepop: tokens outside the band are dropped."""
    logits = jnp.asarray(_rand(34, (1, 1, V)), jnp.float32)
    targets = np.zeros((1, 1), np.int64)
    own = _own_logprobs(logits, targets)
    batch = LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((1, 1), bool),
                      advantages_BxT=jnp.asarray([[-1.0]], jnp.float32),
                      sampler_logprobs_BxT=jnp.asarray(own - np.log(3.0), jnp.float32))
    def g(**kw):
        return jax.grad(lambda lg: token_loss_from_logits(LossConfig(kind="grpo", **kw), lg, batch)[0])(logits)

    plain = jax.grad(lambda lg: token_loss_from_logits(LossConfig(kind="reinforce"), lg, batch)[0])(logits)
    np.testing.assert_allclose(g(), 3.0 * plain, rtol=1e-4)
    np.testing.assert_allclose(g(is_mode="tis", is_cap=2.0), 2.0 * plain, rtol=1e-4)
    assert float(jnp.abs(g(is_mode="icepop", icepop_low=0.5, icepop_high=2.5)).sum()) == 0.0
    np.testing.assert_allclose(g(is_mode="icepop", icepop_low=0.5, icepop_high=5.0), 3.0 * plain, rtol=1e-4)


def test_reference_kl_is_k3_and_pulls_towards_the_reference():
    logits = jnp.asarray(_rand(35, (B, T, V)), jnp.float32)
    targets = np.random.default_rng(36).integers(0, V, (B, T))
    own = _own_logprobs(logits, targets)
    ref = own + np.random.default_rng(37).normal(0, 0.5, (B, T))
    base = dict(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((B, T), bool),
                advantages_BxT=jnp.zeros((B, T), jnp.float32))
    cfg = LossConfig(kind="reinforce", kl_coef=0.5)
    with pytest.raises(ValueError, match=r"reference_logprobs_BxT: missing \(needed by LossConfig.kl_coef=0.5\)"):
        token_loss_from_logits(cfg, logits, LossBatch(**base))
    batch = LossBatch(**base, reference_logprobs_BxT=jnp.asarray(ref, jnp.float32))
    loss, m = token_loss_from_logits(cfg, logits, batch)
    d = ref - own
    k3 = np.exp(d) - d - 1
    np.testing.assert_allclose(float(m["kl_ref"]), k3.mean(), rtol=1e-4)
    np.testing.assert_allclose(float(loss), 0.5 * k3.mean(), rtol=1e-4)  # advantages 0: the KL term alone
    same = batch.replace(reference_logprobs_BxT=jnp.asarray(own, jnp.float32))
    assert abs(float(token_loss_from_logits(cfg, logits, same)[1]["kl_ref"])) < 1e-6
    # a small step against the gradient lowers the KL
    grad = jax.grad(lambda lg: token_loss_from_logits(cfg, lg, batch)[0])(logits)
    assert float(token_loss_from_logits(cfg, logits - 0.1 * grad, batch)[1]["kl_ref"]) < float(m["kl_ref"])


def test_token_sum_norm_divides_by_rows_times_slots():
    logits = jnp.asarray(_rand(38, (B, T, V)), jnp.float32)
    targets = np.random.default_rng(39).integers(0, V, (B, T))
    mask = np.arange(T)[None] < np.array([[4], [2]])
    adv = np.repeat(np.array([[0.7], [-1.3]], np.float32), T, 1)
    batch = LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.asarray(mask),
                      advantages_BxT=jnp.asarray(adv))
    own = _own_logprobs(logits, targets)
    for kind in ("reinforce", "grpo"):
        b = batch.replace(sampler_logprobs_BxT=jnp.asarray(own, jnp.float32)) if kind == "grpo" else batch
        # per token: -A log pi (reinforce); -A r with r = 1 (grpo, sampler = trainer)
        total = -np.sum(np.where(mask, adv * (own if kind == "reinforce" else 1.0), 0.0))
        by_count = float(token_loss_from_logits(LossConfig(kind=kind), logits, b)[0])
        by_slots = float(token_loss_from_logits(LossConfig(kind=kind, token_sum_norm=True), logits, b)[0])
        np.testing.assert_allclose(by_count, total / mask.sum(), rtol=1e-5)
        np.testing.assert_allclose(by_slots, total / (B * T), rtol=1e-5)
        # per row halves (gradient-accumulation micro-batches) averaged = the whole batch: the constant scales
        halves = [float(token_loss_from_logits(LossConfig(kind=kind, token_sum_norm=True), logits[i:i + 1],
                                               jax.tree.map(lambda x: x[i:i + 1], b))[0]) for i in range(B)]
        np.testing.assert_allclose(np.mean(halves), by_slots, rtol=1e-5)


def test_rl_entropy_metric_is_the_students_softmax_entropy():
    logits = jnp.asarray(_rand(40, (B, T, V)), jnp.float32)
    targets = np.random.default_rng(41).integers(0, V, (B, T))
    batch = LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((B, T), bool),
                      advantages_BxT=jnp.zeros((B, T), jnp.float32))
    lp = np_log_softmax(np.asarray(logits, np.float64) / 2.0, -1)
    _, m = token_loss_from_logits(LossConfig(kind="reinforce", temperature=2.0), logits, batch)
    np.testing.assert_allclose(float(m["entropy"]), -(np.exp(lp) * lp).sum(-1).mean(), rtol=1e-5)
    assert "entropy" not in token_loss_from_logits(LossConfig(kind="sft"), logits, batch)[1]  # RL kinds only
