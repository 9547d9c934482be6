"""Statistical checks of the sampler: top-p / top-k frequencies (chi-square), the exact-KL order of precision
policies, and the second-order law of logit noise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jopd.lab.position_kl import trainer_response_logits
from jopd.losses.is_correction import exact_kl_BxT
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PrecisionConfig, precision_from_name, prepare_sampler_params
from jopd.sampling.sampler import Sampler
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
PREFIX = [3, 1, 4, 1, 5]
DRAWS = 20_000


@functools.lru_cache(maxsize=None)
def make_params():
    """Random weights scaled up so that next-token distributions are far from uniform and depend on context."""
    return numpy_params(CFG, 0, layer_scale=5.0, head_scale=20.0)


@functools.lru_cache(maxsize=None)
def prefix_logits():
    """fp32 trainer logits after PREFIX (float64 for the reference math)."""
    logits, _ = T.forward(make_params(), jnp.asarray([PREFIX]), cfg=CFG)
    return np.asarray(logits[0, -1], np.float64)


def truncated_reference(temperature, top_k, top_p):
    """Renormalized distribution after temperature, top-k, then top-p on the renormalized top-k (numpy)."""
    z = prefix_logits() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[:top_k or len(p)]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    sorted_q = q[order]
    mass_before = np.cumsum(sorted_q) - sorted_q
    # the nucleus must not sit on a float boundary, or fp32 vs fp64 could disagree on it
    assert np.min(np.abs(mass_before[keep[order]] - top_p)) > 1e-4
    nucleus = np.zeros_like(keep)
    nucleus[order[(mass_before < top_p) & keep[order]]] = True
    r = np.where(nucleus, q, 0.0)
    return r / r.sum(), nucleus


@pytest.mark.parametrize("temperature,top_k,top_p,bracket", [
    (1.0, 0, 0.8, 128),  # the whole row fits the bracket: ranked directly, no bisection
    (3.0, 0, 0.8, 2),  # flatter, wide nucleus and a 2-token bracket: many bisection steps
    (1.5, 6, 0.9, 128),  # top-k, then top-p on the renormalized top-k
])
def test_truncated_sampling_frequencies(temperature, top_k, top_p, bracket):
    ref, nucleus = truncated_reference(temperature, top_k, top_p)
    size = int(nucleus.sum())
    assert 3 <= size < CFG.vocab_size - 20
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1,
                              top_p_candidates=bracket)
    out = Sampler(CFG, sampling).generate(make_params(), [PREFIX] * DRAWS, seed=7)
    tokens = out.tokens_BxN[:, 0]
    assert nucleus[tokens].all(), "a token outside the nucleus was sampled"
    counts = np.bincount(tokens, minlength=CFG.vocab_size)[nucleus]
    assert stats.chisquare(counts, ref[nucleus] * DRAWS).pvalue > 1e-3
    np.testing.assert_allclose(out.logprobs_BxN[:, 0], np.log(ref[tokens]), atol=1e-5, rtol=0)


def test_exact_kl_orders_precision_policies():
    """Mean exact KL(sampler ‖ fp32 trainer) over sampled responses: fp32 = 0 < fp16 < bf16 < fp8."""
    params = make_params()
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 11, 3, 2], [12], [30, 31]]
    n = 8
    sampling = SamplingConfig(max_new_tokens=n, return_full_logprobs=True)
    forward = jax.jit(lambda p, t, m: T.forward(p, t, cfg=CFG, attn_mask_BxT=m)[0])
    kl = {}
    for name in ("fp32", "fp16", "bf16", "fp8", "int8"):
        precision = precision_from_name(name)
        out = Sampler(CFG, sampling, precision).generate(prepare_sampler_params(params, precision), prompts, seed=0)
        trainer = trainer_response_logits(lambda t, m: forward(params, t, m), prompts, out.tokens_BxN)
        kl[name] = float(jnp.mean(exact_kl_BxT(out.full_logprobs_BxNxV, trainer, 1.0)))
    print("mean exact KL to the fp32 trainer (nats/token):", {k: f"{v:.3g}" for k, v in kl.items()})
    assert abs(kl["fp32"]) < 1e-6
    assert kl["fp32"] < kl["fp16"] < kl["bf16"] < kl["fp8"]
    assert kl["bf16"] < kl["int8"]


def test_logit_noise_kl_follows_second_order_law():
    """Logits z + eps, eps ~ N(0, s^2 I). With q = softmax(z + eps), p = softmax(z):
    KL(q ‖ p) = 1/2 Var_p(eps) + O(|eps|^3) = 1/2 (sum_v p_v eps_v^2 - (sum_v p_v eps_v)^2) + ...
    (the log-partition's Hessian is Cov_p), and E[.] = (s^2/2)(1 - sum_v p_v^2). The odd-order term has zero
    mean, so the bias is O(s^4): at s = 0.05 it is far below the Monte-Carlo error allowed below."""
    sigma, n = 0.05, 4096
    sampling = SamplingConfig(max_new_tokens=1, return_full_logprobs=True)
    out = Sampler(CFG, sampling, PrecisionConfig(logit_noise=sigma)).generate(make_params(), [PREFIX] * n, seed=3)
    trainer = np.broadcast_to(prefix_logits().astype(np.float32), (n, 1, CFG.vocab_size))
    kl = np.asarray(exact_kl_BxT(out.full_logprobs_BxNxV, trainer, 1.0), np.float64)[:, 0]
    p = np.exp(prefix_logits() - prefix_logits().max())
    p /= p.sum()
    predicted = sigma ** 2 / 2 * (1 - np.sum(p ** 2))
    stderr = kl.std(ddof=1) / np.sqrt(n)
    print(f"E KL measured {kl.mean():.4e} +- {stderr:.1e}, predicted {predicted:.4e}")
    assert abs(kl.mean() - predicted) < 4 * stderr
    assert stderr < 0.05 * predicted  # the check is sharp: 4 standard errors are < 20% of the value
