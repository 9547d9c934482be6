"""The slot engine (continuous batching within a step, prompts shared by their samples) against the static engine:
a row's sample must not depend on its slot, its batch-mates or its prompt being shared."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jopd.models.config import ModelConfig
from jopd.models import transformer as T
from jopd.sampling.config import SamplerShardings, SamplingConfig, row_randomness
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.sampler import Sampler
from jopd.sampling.slots import slot_iterations
from tests.helpers.attention_entries import CHUNKED_SMALL
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=96, tie_word_embeddings=False, eos_token_id=3)
N = 24
STOP = (4, 5, 6, 7, 8)  # with the EOS id 3: rows stop at scattered steps


@functools.lru_cache(maxsize=None)
def params():
    return numpy_params(CFG, 1, layer_scale=5.0, head_scale=6.0)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, CFG.vocab_size, rng.integers(1, 11)).tolist() for _ in range(n)]


def assert_same_samples(out, ref, atol=2e-5):
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    np.testing.assert_array_equal(out.lengths_B, ref.lengths_B)
    np.testing.assert_array_equal(out.done_B, ref.done_B)
    np.testing.assert_allclose(out.logprobs_BxN, ref.logprobs_BxN, atol=atol)
    np.testing.assert_allclose(out.unprocessed_logprobs_BxN, ref.unprocessed_logprobs_BxN, atol=atol)
    for name in ("full_logprobs_BxNxV", "topk_ids_BxNxK"):
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        valid = out.response_mask_BxN[..., None]
        if name == "topk_ids_BxNxK":
            np.testing.assert_array_equal(np.where(valid, a, 0), np.where(valid, b, 0))
        else:
            np.testing.assert_allclose(np.where(valid, a, 0), np.where(valid, b, 0), atol=atol)


# each setting at two slot counts (a compile each): together 1, 3, 5 and as many slots as rows
SETTINGS = {
    "top_p": (SamplingConfig(max_new_tokens=N, top_p=0.9, stop_token_ids=STOP), PrecisionConfig(), (1, 5)),
    "top_k_noise": (SamplingConfig(max_new_tokens=N, top_k=7, temperature=0.8, return_full_logprobs=True,
                                   return_topk=4, stop_token_ids=STOP), PrecisionConfig(logit_noise=0.7), (3, 16)),
    "greedy_noise": (SamplingConfig(max_new_tokens=N, greedy=True, stop_token_ids=STOP),
                     PrecisionConfig(logit_noise=2.0), (5, 16)),
}


def with_attention(attention: str) -> ModelConfig:
    """CFG ("auto": "xla" at these lengths), or CFG with "chunked" in blocks of 8 (the caches span several tiles,
    and rows at different slots skip different ones)."""
    return CFG if attention == "auto" else dataclasses.replace(CFG, attention=CHUNKED_SMALL)


@pytest.mark.parametrize("setting,attention", [(s, "auto") for s in sorted(SETTINGS)] + [("top_p", "chunked")])
def test_each_row_samples_as_in_the_static_engine_whatever_the_slot_count(setting, attention):
    sampling, precision, slot_counts = SETTINGS[setting]
    rows = prompts(13)
    cfg = with_attention(attention)
    ref = Sampler(cfg, sampling, precision).generate(params(), rows, seed=5)
    lengths = ref.lengths_B
    assert len(set(lengths.tolist())) > 3  # rows end at scattered steps: slots are refilled mid-run
    for slots in slot_counts if attention == "auto" else slot_counts[-1:]:  # "chunked": one count (a compile each)
        out = Sampler(cfg, dataclasses.replace(sampling, slots=slots), precision).generate(params(), rows, seed=5)
        assert_same_samples(out, ref)


def test_a_prompts_samples_share_its_prefill_and_equal_separate_prefills():
    U, G = 4, 3
    sampling = SamplingConfig(max_new_tokens=N, top_p=0.95, return_full_logprobs=True, stop_token_ids=STOP)
    unique = prompts(U, seed=2)
    engine = Sampler(CFG, sampling)
    prompt_UxP, mask_UxP = engine.pad(unique)
    rand = row_randomness(9, np.arange(U * G), N)
    shared = jax.device_get(engine.sample_padded(params(), prompt_UxP, mask_UxP, rand, group=G))
    # G separate prefills: every row its own copy of its prompt, the static engine
    repeated = np.repeat(prompt_UxP, G, axis=0), np.repeat(mask_UxP, G, axis=0)
    separate = jax.device_get(Sampler(CFG, sampling).sample_padded(params(), *repeated, rand))
    assert_same_samples(shared, separate)
    assert len({tuple(t) for t in shared.tokens_BxN[:G].tolist()}) > 1  # the samples of a prompt differ
    for slots in (5,):  # shared prompts with refill
        out = Sampler(CFG, dataclasses.replace(sampling, slots=slots)).sample_padded(params(), prompt_UxP, mask_UxP,
                                                                                  rand, group=G)
        assert_same_samples(jax.device_get(out), separate)


@pytest.mark.parametrize("attention", ["auto", "chunked"])
def test_a_rows_sample_does_not_depend_on_its_batch_mates(attention):
    sampling = SamplingConfig(max_new_tokens=N, top_p=0.9, slots=3, stop_token_ids=STOP)
    rows = prompts(10, seed=4)
    cfg = with_attention(attention)
    together = Sampler(cfg, sampling).generate(params(), rows, seed=1, first_index=100)
    alone = Sampler(cfg, sampling).generate(params(), rows[6:7], seed=1, first_index=106)
    np.testing.assert_array_equal(alone.tokens_BxN[0], together.tokens_BxN[6])


def test_slots_over_a_batch_sharded_mesh_equal_one_device():
    """8 devices, the batch over data x fsdp: each shard's slots serve its own rows, same samples."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    batch = NamedSharding(mesh, P("data"))
    shardings = SamplerShardings(params=jax.tree.map(lambda _: NamedSharding(mesh, P()), params()), batch=batch,
                                 cache=NamedSharding(mesh, P("data", "tensor")))
    sampling = SamplingConfig(max_new_tokens=N, top_p=0.9, slots=8, stop_token_ids=STOP)
    rows = prompts(16, seed=6)
    ref = Sampler(CFG, dataclasses.replace(sampling, slots=0)).generate(params(), rows, seed=2)
    sampler = Sampler(CFG, sampling, shardings=shardings)
    assert sampler.shards == 4 and sampler.engine(16) == (1, 8)
    out = sampler.generate(params(), rows, seed=2)
    assert_same_samples(out, ref)


def test_the_engine_choice():
    s = Sampler(CFG, SamplingConfig(max_new_tokens=4))
    assert s.engine(32) == (0, 32)  # static: one row per slot
    assert s.engine(32, group=4) == (4, 32)  # shared prompts, every row its slot
    s = Sampler(CFG, SamplingConfig(max_new_tokens=4, slots=8))
    assert s.engine(32) == (1, 8) and s.engine(5) == (1, 5)  # never more slots than rows
    with pytest.raises(ValueError, match=r"sample_padded: 7 rows of randomness for 2 prompts x 3 samples each"):
        s.sample_padded(params(), np.ones((2, 4), np.int32), np.ones((2, 4), bool), row_randomness(0, range(7), 4),
                        group=3)


@functools.partial(jax.jit, static_argnames="prefill")
def _cached_forward(p, tokens, cache, index, positions, kv_mask, prefill=False):
    return T.forward(p, tokens, cfg=CFG, cache=cache, cache_index=index, kv_mask_BxS=kv_mask,
                     positions_BxT=None if prefill else positions)


def test_kv_cache_rows_at_different_steps_match_the_full_forward():
    """The per-row cache write (`cache_index` [B]) against a full forward: two rows decoding at different slots."""
    p = params()
    tokens = np.array([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], np.int32)
    full = np.asarray(jax.jit(lambda p, t: T.forward(p, t, cfg=CFG)[0])(p, tokens))
    cache = T.init_cache(CFG, 2, 8)
    _, cache = _cached_forward(p, tokens[:, :3], cache, 0, None, np.arange(8)[None] < np.array([[3], [4]]),
                               prefill=True)
    # both rows feed token 3 at slot 3; then each row its own slot: [4, 4], then [4, 3] (row 1 one step behind)
    _, cache = _cached_forward(p, tokens[:, 3:4], cache, 3, np.array([[3], [3]]), np.ones((2, 8), bool))
    logits, _ = _cached_forward(p, tokens[:, 4:5], cache, np.array([4, 4]), np.array([[4], [4]]),
                                np.ones((2, 8), bool))
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, 4], atol=2e-5)
    logits, _ = _cached_forward(p, np.array([[9], [13]]), cache, np.array([4, 3]), np.array([[4], [3]]),
                                np.arange(8)[None] < np.array([[5], [4]]))
    np.testing.assert_allclose(np.asarray(logits[0, 0]), full[0, 4], atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits[1, 0]), full[1, 3], atol=2e-5)


def test_the_host_schedule_counts_the_engines_decode_passes():
    """`slot_iterations` (what the loop's rollout_useful_frac and the step-waste benchmark count) equals the
    passes the device loop ran, rows of length 1 included."""
    sampling = SamplingConfig(max_new_tokens=N, top_p=0.9, stop_token_ids=STOP)
    rows = prompts(16, seed=8)
    ref = Sampler(CFG, sampling).generate(params(), rows, seed=4)
    assert (ref.lengths_B == 1).any() and ref.decode_iterations == ref.lengths_B.max() - 1
    for slots in (3, 8):
        out = Sampler(CFG, dataclasses.replace(sampling, slots=slots)).generate(params(), rows, seed=4)
        assert out.decode_iterations == slot_iterations(out.lengths_B, slots)
    assert slot_iterations([5, 1, 1, 3], 2) == 4 and slot_iterations([5, 1, 1, 3], 2, shards=2) == 4
    assert slot_iterations([1, 1], 1) == 1 and slot_iterations([4, 4, 4, 4], 4) == 3
