"""A mixture-of-experts student's rollout records each token's experts: the static and the slot engine record the
same ids, and they are the trainer's own router choices (`transformer.forward(..., return_routing=True)`) on the
same tokens for the fp32 engine, at exactly the positions the trainer's predictions read (the real prompt tokens
and every response token but the last)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplingConfig, row_randomness
from jopd.sampling.sampler import Sampler
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8, norm_topk_prob=True, eos_token_id=None)
U, G, P, N = 3, 2, 5, 6


def test_both_engines_record_the_trainers_routing():
    params = numpy_params(CFG, seed=0, std=0.5)
    rng = np.random.default_rng(1)
    prompt = rng.integers(9, CFG.vocab_size, (U, P)).astype(np.int32)
    mask = np.ones((U, P), bool)
    mask[0, :2] = False  # left padding
    rand = row_randomness(0, np.arange(U * G), N)
    sampling = SamplingConfig(max_new_tokens=N, return_routing=True, stop_token_ids=tuple(range(3, 9)))
    static = Sampler(CFG, sampling).sample_padded(params, np.repeat(prompt, G, 0), np.repeat(mask, G, 0), rand)
    slots = Sampler(CFG, dataclasses.replace(sampling, slots=4)).sample_padded(params, prompt, mask, rand, group=G)
    np.testing.assert_array_equal(slots.tokens_BxN, static.tokens_BxN)
    lengths = np.asarray(static.lengths_B)
    assert lengths.min() < N - 1 and lengths.max() == N  # rows stop apart, some at the cap
    ids = np.asarray(static.expert_ids_BxSxLsxk)
    assert ids.shape == (U * G, P + N, 2, 2) and ids.dtype == np.int16
    np.testing.assert_array_equal(np.asarray(slots.expert_ids_BxSxLsxk), ids)

    # recorded: the real prompt tokens, and response token t iff it was fed back (t < length - 1)
    prompt_mask = np.repeat(mask, G, 0)
    fed = np.arange(N)[None, :] < lengths[:, None] - 1
    recorded = ids[:, :, 0, 0] >= 0
    np.testing.assert_array_equal(recorded, np.concatenate([prompt_mask, fed], 1))
    assert np.all((ids >= 0) == recorded[:, :, None, None])

    tokens = np.concatenate([np.repeat(prompt, G, 0), np.asarray(static.tokens_BxN)], 1)
    seq_mask = np.concatenate([prompt_mask, np.arange(N)[None, :] < lengths[:, None]], 1)
    _, _, own = jax.jit(lambda t, m: T.forward(params, t, cfg=CFG, attn_mask_BxT=m, return_routing=True))(
        jnp.asarray(tokens), jnp.asarray(seq_mask))
    own = np.moveaxis(np.asarray(own), 0, 2)  # [B, S, Ls, k]
    np.testing.assert_array_equal(ids[recorded], own[recorded])  # expert by expert, in the router's order
    assert len(np.unique(ids[recorded])) == CFG.num_experts  # every expert is used: the routing is not degenerate
