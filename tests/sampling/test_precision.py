"""Precision policy: fake quantization against numpy / ml_dtypes references, weight noise statistics, the
sigma = 0 switch, presets and errors; mismatch estimators against direct numpy formulas."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy import special

from jopd.config_dataclass import ConfigError, build
from jopd.losses.is_correction import exact_kl_BxT, mismatch_estimators
from jopd.models.config import ModelConfig
from jopd.sampling.precision import PRESETS, PrecisionConfig, fake_quant, precision_from_name, prepare_sampler_params
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, tie_word_embeddings=False)


def test_fake_quant_matches_numpy_reference():
    w = np.asarray(jax.random.normal(jax.random.key(0), (3, 16, 5)), np.float32) * np.float32(0.1)
    amax = np.abs(w).max(axis=1, keepdims=True)  # contraction axis 1: one scale per (layer, output)
    s8 = amax / 127
    np.testing.assert_allclose(fake_quant(jnp.asarray(w), (1,), "int8"), np.round(w / s8) * s8, rtol=1e-6,
                               atol=1e-8)
    s_fp8 = amax / 448
    ref = (w / s_fp8).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s_fp8
    np.testing.assert_allclose(fake_quant(jnp.asarray(w), (1,), "fp8"), ref, rtol=1e-6, atol=1e-8)
    # the abs-max of every channel is exactly representable in both formats
    for kind in ("int8", "fp8"):
        q = np.asarray(fake_quant(jnp.asarray(w), (1,), kind))
        np.testing.assert_allclose(np.abs(q).max(axis=1), amax[:, 0], rtol=1e-6)
    # error bounds: half a step (int8), 2^-4 relative (e4m3 has 3 mantissa bits) above the subnormal range
    assert np.all(np.abs(np.asarray(fake_quant(jnp.asarray(w), (1,), "int8")) - w) <= s8 / 2 * (1 + 1e-5))
    q8 = np.asarray(fake_quant(jnp.asarray(w), (1,), "fp8"))
    normal = np.abs(w / s_fp8) >= 2.0**-6
    assert np.all(np.abs(q8 - w)[normal] <= np.abs(w)[normal] * 2.0**-4 * (1 + 1e-5))


def test_prepare_sampler_params_quantizes_matrices_only_and_casts():
    params = numpy_params(CFG, 1)
    out = prepare_sampler_params(params, precision_from_name("int8"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
    # norms are kept (only cast); matrices take at most 255 distinct levels per output channel
    np.testing.assert_array_equal(out["layers"]["attn_norm"], params["layers"]["attn_norm"].astype(jnp.bfloat16))
    up = np.asarray(prepare_sampler_params(params, PrecisionConfig(weight_quant="int8"))["layers"]["up"])
    assert max(len(np.unique(up[0, :, j])) for j in range(up.shape[2])) <= 255
    same = prepare_sampler_params(params, PrecisionConfig())
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), same, params)))


def test_weight_noise_is_relative_seeded_and_off_at_zero():
    params = numpy_params(CFG, 2)
    sigma = 0.05
    a = prepare_sampler_params(params, PrecisionConfig(weight_noise=sigma), jax.random.key(7))
    b = prepare_sampler_params(params, PrecisionConfig(weight_noise=sigma), jax.random.key(7))
    c = prepare_sampler_params(params, PrecisionConfig(weight_noise=sigma), jax.random.key(8))
    w, wa = np.asarray(params["layers"]["gate"]), np.asarray(a["layers"]["gate"])
    np.testing.assert_array_equal(wa, b["layers"]["gate"])
    assert not np.array_equal(wa, c["layers"]["gate"])
    rel = (wa - w) / np.abs(w)
    assert abs(rel.mean()) < 4 * sigma / np.sqrt(rel.size) and abs(rel.std() / sigma - 1) < 0.05
    zero = prepare_sampler_params(params, PrecisionConfig(weight_noise=0.0), jax.random.key(7))
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), zero, params)))
    with pytest.raises(ValueError, match="weight_noise > 0 needs a PRNG key"):
        prepare_sampler_params(params, PrecisionConfig(weight_noise=sigma))


def test_presets_and_errors():
    assert set(PRESETS) == {"fp32", "fp16", "bf16", "fp8", "int8"}
    assert precision_from_name("fp32") == PrecisionConfig()
    p = precision_from_name("fp8", logit_noise=0.1)
    assert (p.compute_dtype, p.weight_quant, p.cache_dtype, p.logit_noise) == ("bf16", "fp8", jnp.bfloat16, 0.1)
    with pytest.raises(ValueError, match=r"^--precision: unknown precision 'fp64' \(choose one of fp32, fp16"):
        precision_from_name("fp64", field="--precision")
    with pytest.raises(ConfigError, match=r"^precision\.logit_noise: Input should be greater than or equal to 0"):
        build(PrecisionConfig, {"logit_noise": -0.1}, "precision")
    with pytest.raises(ConfigError, match=r"^precision\.weight_quant: "):
        build(PrecisionConfig, {"weight_quant": "int4"}, "precision")


def test_mismatch_functions_match_numpy():
    rng = np.random.default_rng(0)
    q_logits = rng.normal(size=(2, 3, 7)) * 2
    p_logits = q_logits + rng.normal(size=(2, 3, 7)) * 0.3
    temperature = 0.7
    log_q = special.log_softmax(q_logits / temperature, axis=-1)
    p = special.softmax(p_logits / temperature, axis=-1)
    ref = special.rel_entr(np.exp(log_q), p).sum(-1)
    np.testing.assert_allclose(exact_kl_BxT(log_q.astype(np.float32), p_logits.astype(np.float32), temperature),
                               ref, rtol=1e-4, atol=1e-7)

    lq = rng.normal(size=(2, 5)) - 2
    lp = lq + rng.normal(size=(2, 5)) * 0.2
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    got = mismatch_estimators(lq, lp, mask)
    r = np.exp(lp - lq)[mask]
    np.testing.assert_allclose(got["k1"], np.mean((lq - lp)[mask]), rtol=1e-5)
    np.testing.assert_allclose(got["k3"], np.mean(r - 1 - np.log(r)), rtol=1e-5)
    np.testing.assert_allclose(got["max_abs_dprob"], np.abs(np.exp(lp) - np.exp(lq))[mask].max(), rtol=1e-5)
    np.testing.assert_allclose(got["mean_abs_dprob"], np.abs(np.exp(lp) - np.exp(lq))[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(got["ess"], r.sum() ** 2 / (r.size * (r**2).sum()), rtol=1e-5)
