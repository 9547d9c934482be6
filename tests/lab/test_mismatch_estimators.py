"""The mismatch estimators written once (`jopd.losses.is_correction`): the lab's float64 per-prompt sums
(`jopd.lab.mismatch.mismatch_row_sums`) add up to the train step's fp32 estimators on the same random tokens,
and the effective sample size is one formula on numpy and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.lab import mismatch as measure
from jopd.losses.is_correction import effective_sample_size, is_metrics, mismatch_estimators, mismatch_terms_BxT


def _tokens(seed=0, B=6, N=20):
    rng = np.random.default_rng(seed)
    log_q = np.log(rng.uniform(0.01, 1.0, (B, N)))
    log_p = log_q + rng.normal(0, 0.3, (B, N))
    log_p[0, 3] = log_q[0, 3] + 30.0  # beyond the +-20 clip of log r
    mask = rng.random((B, N)) < 0.8
    mask[2] = False  # a row without tokens
    return log_q.astype(np.float32), log_p.astype(np.float32), mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_sums_match_the_steps_estimators(seed):
    log_q, log_p, mask = _tokens(seed)
    kl = np.abs(np.random.default_rng(seed).normal(0, 0.1, log_q.shape))
    rows = measure.mismatch_row_sums(log_q, log_p, mask, kl)  # sampler first, trainer second, as the step
    est = jax.jit(mismatch_estimators)(log_q, log_p, mask)
    n = rows["n"].sum()
    assert rows["n"].tolist() == mask.sum(1).tolist() and rows["n"][2] == 0 == rows["k1"][2]
    for key, col in (("k1", "k1"), ("k3", "k3"), ("mean_abs_dprob", "dprob")):
        assert rows[col].sum() / n == pytest.approx(float(est[key]), rel=1e-5, abs=1e-7), key
    assert rows["max_dprob"].max() == pytest.approx(float(est["max_abs_dprob"]), rel=1e-6)
    ess = effective_sample_size(rows["r"].sum(), rows["r2"].sum(), n)
    assert isinstance(ess, np.ndarray) and ess == pytest.approx(float(est["ess"]), rel=1e-5)
    assert rows["kl"].sum() == pytest.approx(kl[mask].sum())
    # by hand, in float64: the definitions of docs/architecture.md
    lq, lp = log_q.astype(np.float64)[mask], log_p.astype(np.float64)[mask]
    log_r = np.clip(lp - lq, -20, 20)
    assert rows["k1"].sum() / n == pytest.approx(np.mean(-log_r), rel=1e-12)  # k1 of the clipped log r
    assert rows["k3"].sum() / n == pytest.approx(np.mean(np.exp(log_r) - 1 - log_r), rel=1e-10)
    r = np.exp(log_r)
    assert float(ess) == pytest.approx(r.sum() ** 2 / (len(r) * (r ** 2).sum()), rel=1e-12)


def test_terms_keep_the_inputs_precision_and_mask():
    log_q, log_p, mask = _tokens(3)
    t64 = mismatch_terms_BxT(log_q.astype(np.float64), log_p.astype(np.float64), mask)
    t32 = jax.jit(mismatch_terms_BxT)(jnp.asarray(log_q), jnp.asarray(log_p), jnp.asarray(mask))
    for k in ("k1", "k3", "abs_dprob", "r", "r2"):
        assert t64[k].dtype == np.float64 and t32[k].dtype == jnp.float32
        assert (t64[k][~mask] == 0).all()
        np.testing.assert_allclose(np.asarray(t32[k]), t64[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_ess_is_one_formula_for_is_metrics_and_the_lab():
    r = jnp.asarray([[0.5, 1.0, 2.0, 4.0]])
    mask = jnp.asarray([[True, True, True, False]])
    m = is_metrics(r, r, mask, "none", cap=2.0, low=0.5, high=5.0)
    assert float(m["is_ess"]) == pytest.approx(3.5 ** 2 / (3 * 5.25), rel=1e-6)
    assert float(effective_sample_size(np.float64(3.5), np.float64(5.25), np.float64(3))) == pytest.approx(
        float(m["is_ess"]), rel=1e-6)
    assert float(is_metrics(r, r, ~jnp.ones_like(mask), "none", cap=2.0, low=0.5, high=5.0)["is_ess"]) == 1.0
    assert float(effective_sample_size(np.zeros(()), np.zeros(()), np.ones(()))) == 1.0  # no tokens
