"""Sampler against the trainer's full forward: KV-cache decode, greedy, zero mismatch for identical engines,
stop tokens, seeds, noise switches, sharding, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jopd.config_dataclass import ConfigError, build
from jopd.losses.is_correction import exact_kl_BxT, mismatch_estimators
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplerShardings, SamplingConfig
from jopd.sampling.precision import PrecisionConfig, precision_from_name, prepare_sampler_params
from jopd.sampling.sampler import Sampler
from tests.helpers.attention_entries import CHUNKED_SMALL
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 11, 3, 2, 9, 10], [12]]  # unequal lengths: left padding is exercised
N = 8
# temperature 1, no truncation: the processed distribution is the plain softmax of the logits
PLAIN = SamplingConfig(max_new_tokens=N, return_full_logprobs=True)


@functools.lru_cache(maxsize=None)
def make_params():
    """Random weights scaled up so that next-token distributions are far from uniform and depend on context."""
    return numpy_params(CFG, 0, layer_scale=5.0, head_scale=20.0)


@jax.jit
def _forward(params, tokens, mask):
    return T.forward(params, tokens, cfg=CFG, attn_mask_BxT=mask)[0]


def trainer_logits(params, prompts, responses):
    """Full (no-cache) fp32 forward of prompt + response; per row the [len(response), V] logits that predict
    each response token."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        toks[i, :len(s)], mask[i, :len(s)] = s, True
    logits = np.asarray(_forward(params, toks, mask))
    return [logits[i, len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def responses(out):
    return [out.tokens_BxN[i, :out.lengths_B[i]].tolist() for i in range(len(out.lengths_B))]


def test_decode_matches_full_forward_and_identical_engines_have_zero_mismatch():
    params = make_params()
    out = Sampler(CFG, PLAIN).generate(params, PROMPTS, seed=0)
    assert out.lengths_B.tolist() == [N] * len(PROMPTS)  # no eos in CFG
    ref = trainer_logits(params, PROMPTS, responses(out))
    for i, logits in enumerate(ref):
        ref_logp = log_softmax(logits)
        # the KV-cache decode distribution at every step equals the full recompute
        np.testing.assert_allclose(out.full_logprobs_BxNxV[i], ref_logp, atol=1e-5, rtol=0)
        at_sampled = ref_logp[np.arange(N), out.tokens_BxN[i]]
        np.testing.assert_allclose(out.logprobs_BxN[i], at_sampled, atol=1e-5, rtol=0)
        np.testing.assert_allclose(out.unprocessed_logprobs_BxN[i], at_sampled, atol=1e-5, rtol=0)
    kl = exact_kl_BxT(out.full_logprobs_BxNxV, np.stack(ref), 1.0)
    assert float(jnp.max(jnp.abs(kl))) < 1e-6
    est = mismatch_estimators(out.unprocessed_logprobs_BxN,
                              np.stack([log_softmax(r)[np.arange(N), t] for r, t in zip(ref, out.tokens_BxN)]),
                              out.response_mask_BxN)
    assert abs(float(est["k1"])) < 1e-6 and abs(float(est["ess"]) - 1) < 1e-6


def test_greedy_is_stepwise_argmax_and_stops_per_sequence():
    params = make_params()
    greedy = SamplingConfig(max_new_tokens=N, greedy=True)
    out = Sampler(CFG, greedy).generate(params, PROMPTS, seed=0)
    for i, logits in enumerate(trainer_logits(params, PROMPTS, responses(out))):
        # teacher-forced on its own output, the full forward's argmax at every step is the greedy token
        np.testing.assert_array_equal(np.argmax(logits, -1), out.tokens_BxN[i])
    assert not out.done_B.any() and (out.logprobs_BxN == 0).all()

    row0 = out.tokens_BxN[0].tolist()  # stop on the first token row 0 emits at a later step (k >= 1) only
    k = next(k for k in range(1, N) if row0[k] not in row0[:k])
    stop = row0[k]
    stopped = Sampler(CFG, SamplingConfig(max_new_tokens=N, greedy=True, stop_token_ids=(stop,))).generate(
        params, PROMPTS, seed=0)
    for i, row in enumerate(out.tokens_BxN.tolist()):
        length = row.index(stop) + 1 if stop in row else N
        assert stopped.lengths_B[i] == length and stopped.done_B[i] == (stop in row)
        assert stopped.tokens_BxN[i, :length].tolist() == row[:length]
        assert (stopped.tokens_BxN[i, length:] == 0).all()  # pad id (CFG has none -> 0)
        assert (stopped.unprocessed_logprobs_BxN[i, length:] == 0).all()
    assert stopped.lengths_B[0] == k + 1 and stopped.done_B[0]


@pytest.mark.parametrize("attention", ["auto", "chunked"])
def test_seeds_and_batch_independence(attention):
    """With either attention (CFG's "auto", i.e. "xla" at these lengths, or "chunked" in blocks of 8: several cache
    tiles): seeds decide the samples and a row's sample does not depend on its batch-mates, bit for bit."""
    params = make_params()
    cfg = CFG if attention == "auto" else dataclasses.replace(CFG, attention=CHUNKED_SMALL)
    sampler = Sampler(cfg, PLAIN)
    a = sampler.generate(params, PROMPTS, seed=1)
    b = sampler.generate(params, PROMPTS, seed=1)
    c = sampler.generate(params, PROMPTS, seed=2)
    np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
    np.testing.assert_array_equal(a.logprobs_BxN, b.logprobs_BxN)
    assert (a.tokens_BxN != c.tokens_BxN).any()
    # a sequence's sample depends on (seed, its index), not on its batch-mates
    mates = sampler.generate(params, [[1, 2], PROMPTS[1], [3]], seed=1)
    np.testing.assert_array_equal(mates.tokens_BxN[1], a.tokens_BxN[1])
    np.testing.assert_array_equal(mates.logprobs_BxN[1], a.logprobs_BxN[1])
    assert (mates.tokens_BxN[0] != a.tokens_BxN[0]).any()
    if attention != "auto":
        # Across implementations only the last bits of the logits may differ (the softmax's sums in another order):
        # the same tokens here (no draw lands that close to a boundary), log-probs equal to float32 rounding.
        ref = Sampler(CFG, PLAIN).generate(params, PROMPTS, seed=1)
        np.testing.assert_array_equal(a.tokens_BxN, ref.tokens_BxN)
        np.testing.assert_allclose(a.logprobs_BxN, ref.logprobs_BxN, atol=1e-5, rtol=0)


def test_noise_switches():
    params = make_params()
    a = Sampler(CFG, PLAIN).generate(params, PROMPTS, seed=1)
    # noise sigma = 0 is bit-identical to no noise; sigma > 0 changes the logprobs
    zero = PrecisionConfig(logit_noise=0.0, weight_noise=0.0)
    p0 = prepare_sampler_params(params, zero, jax.random.key(5))
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), p0, params)))
    z = Sampler(CFG, PLAIN, zero).generate(p0, PROMPTS, seed=1)
    np.testing.assert_array_equal(z.full_logprobs_BxNxV, a.full_logprobs_BxNxV)
    noisy = Sampler(CFG, PLAIN, PrecisionConfig(logit_noise=0.5)).generate(params, PROMPTS, seed=1)
    assert not np.array_equal(noisy.full_logprobs_BxNxV, a.full_logprobs_BxNxV)


def test_sharded_sampler_equals_unsharded():
    params = make_params()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))  # PROMPTS pad to a batch of 4
    repl = NamedSharding(mesh, P())
    shardings = SamplerShardings(params=jax.tree.map(lambda _: repl, params), batch=NamedSharding(mesh, P("data")),
                                 cache=NamedSharding(mesh, P("data")))
    sharded = Sampler(CFG, PLAIN, shardings=shardings).generate(jax.device_put(params, repl), PROMPTS, seed=3)
    plain = Sampler(CFG, PLAIN).generate(params, PROMPTS, seed=3)
    np.testing.assert_array_equal(sharded.tokens_BxN, plain.tokens_BxN)
    np.testing.assert_allclose(sharded.logprobs_BxN, plain.logprobs_BxN, atol=1e-5, rtol=0)


def test_bad_input_names_the_field():
    sampler = Sampler(CFG, PLAIN)
    with pytest.raises(ValueError, match=r"prompts: no prompts"):
        sampler.generate(make_params(), [])
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        sampler.generate(make_params(), [[1], []])
    with pytest.raises(ValueError, match=r"prompts\[0\]: 60 tokens \+ max_new_tokens=8 exceed .* 64"):
        sampler.generate(make_params(), [[1] * 60])
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match=r"^sampling\.top_p: "):
            build(SamplingConfig, {"top_p": bad}, "sampling")
    with pytest.raises(ValueError, match=r"precision: unknown precision 'fp4'"):
        precision_from_name("fp4")
    with pytest.raises(ConfigError, match=r"^precision\.compute_dtype: "):
        build(PrecisionConfig, {"compute_dtype": "fp64"}, "precision")
