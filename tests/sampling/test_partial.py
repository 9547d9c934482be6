"""Partial rollouts (`jopd.sampling.partial`): carrying a row into the next step must not change its sample (one
version: the slot engine's rows), each token is sampled by its tagged version's policy given its prefix (two
versions: an independent full forward), and the decode passes follow the host-side schedule exactly."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jopd.models import transformer as T
from jopd.sampling.config import SamplerShardings, SamplingConfig, row_randomness
from jopd.sampling.partial import (empty_carry, partial_schedule, priming_carry, priming_row_ids, priming_rows,
                                   priming_seed_indices, reprefill_width, sample_partial)
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.sampler import Sampler
from tests.helpers.reference_kl import log_softmax64
from tests.helpers.tiny_params import numpy_params
from tests.sampling.test_slots import CFG, N, STOP, assert_same_samples, params, prompts

R, S, P, SEED = 8, 3, 16, 7


def batch(step: int):
    """Step `step`'s R prompts, left-padded to P, and their row ids step * R + i."""
    toks, mask = np.zeros((R, P), np.int32), np.zeros((R, P), bool)
    for i, p in enumerate(prompts(R, seed=100 + step)):
        toks[i, P - len(p):], mask[i, P - len(p):] = p, True
    return toks, mask, step * R + np.arange(R)


def rand_of(row_ids):
    ids = np.asarray(row_ids, np.int64)
    seeds = np.where(ids < 0, priming_seed_indices(np.minimum(ids, -1)), ids.astype(np.uint64))
    return row_randomness(SEED, seeds, N)


@functools.lru_cache(maxsize=None)
def program(sampling: SamplingConfig, precision: PrecisionConfig, width: int, shards: int = 1):
    return jax.jit(functools.partial(sample_partial, cfg=CFG, precision=precision, sampling=sampling,
                                     reprefill_width=width, shards=shards), donate_argnums=(5,))


def run_from(carry, versions, batches, program_at, widths=None):
    """Partial rollouts from `carry` over len(versions) steps, step n sampling `batches[n]` with `versions[n]`
    (params) tagged n by `program_at(width)`, each re-prefill over `widths[n]` columns (None: its carry's
    `reprefill_width`, as the OPD step runs it). Returns per step (output, carry before it, that width)."""
    cache = T.init_cache(CFG, carry.lengths_S.shape[0], P + N)
    steps = []
    for n, p in enumerate(versions):
        toks, mask, ids = batches[n]
        width = reprefill_width(*jax.device_get((carry.lengths_S, carry.finished_S)), N) if widths is None \
            else widths[n]
        out = program_at(width)(p, toks, mask, rand_of(ids), ids, cache, carry, n)
        cache = out.sample.cache
        steps.append((jax.device_get(out._replace(sample=out.sample._replace(cache=None))), jax.device_get(carry),
                      width))
        carry = out.carry
    return steps


def priming(sampling, slots: int = S, shards: int = 1):
    """Step 0's carry: `slots` priming rows, each batch shard's from its own first prompts."""
    toks, mask, _ = batch(0)
    ids, take = priming_row_ids(slots), priming_rows(slots, R, shards)
    return priming_carry(toks[take], mask[take], rand_of(ids), ids, sampling, CFG.vocab_size)


def run_steps(sampling, precision, versions, slots: int = S, shards: int = 1, program_at=None):
    """Partial rollouts over len(versions) steps of `batch(n)`, step n sampling with `versions[n]` tagged n; the
    first step primed with `slots` rows of its own prompts; each re-prefill over its carry's `reprefill_width`
    columns, as the OPD step runs it. Returns per step (output, carry before it, that width)."""
    program_at = program_at or (lambda w: program(sampling, precision, w, shards))
    return run_from(priming(sampling, slots, shards), versions, [batch(n) for n in range(len(versions))],
                    program_at)


def reference(sampling, precision, p, row_ids, slots: int = S, shards: int = 1, sampler=None):
    """The slot engine's sample of each row (its prompt, its randomness), by row id."""
    sampler = sampler or Sampler(CFG, dataclasses.replace(sampling, slots=slots), precision)
    rows = {}
    for step in sorted({int(i) // R for i in row_ids if i >= 0}):
        toks, mask, ids = batch(step)
        rows |= dict(zip(ids.tolist(), _split(jax.device_get(sampler.sample_padded(p, toks, mask, rand_of(ids))))))
    toks, mask, _ = batch(0)
    ids, take = priming_row_ids(slots), priming_rows(slots, R, shards)
    # padded to R rows with step 0's first ones (a row's sample does not depend on its batch-mates): one program
    take, ids = np.concatenate([take, np.arange(R - slots)]), np.concatenate([ids, np.arange(R - slots)])
    out = jax.device_get(sampler.sample_padded(p, toks[take], mask[take], rand_of(ids)))
    return rows | dict(zip(ids[:slots].tolist(), _split(out)))


def _split(out):
    fields = out._replace(cache=None, decode_iterations=None)
    return [type(out)(*(None if x is None else x[i:i + 1] for x in fields)) for i in range(out.tokens_BxN.shape[0])]


def _stack(rows):
    return type(rows[0])(*(None if rows[0][k] is None else np.concatenate([r[k] for r in rows]) for k in range(7)))


SAMPLING = SamplingConfig(max_new_tokens=N, top_k=7, temperature=0.8, return_full_logprobs=True, return_topk=4,
                          stop_token_ids=STOP)
NOISE = PrecisionConfig(logit_noise=0.7)


@functools.lru_cache(maxsize=None)
def one_version():
    """4 steps with the same params, and the slot engine's rows (shared by two tests: one compile)."""
    steps = run_steps(SAMPLING, NOISE, [params()] * 4)
    return steps, reference(SAMPLING, NOISE, params(), np.concatenate([o.row_id_R for o, _, _ in steps]))


def test_carried_rows_sample_as_in_the_slot_engine_with_one_version():
    """Same params every step: each handed-on row equals the slot engine's row of its prompt and randomness
    (tokens bit for bit; log-probs to 2e-5: the re-prefill computes a carried row's KV in one batched forward, not
    token by token, so only float rounding differs); rows were carried with tokens, and the carry holds S rows."""
    steps, ref = one_version()
    seen = []
    assert len({w for _, _, w in steps}) > 1  # the re-prefill ran over several widths, the samples alike
    for n, (out, carry_in, _) in enumerate(steps):
        expect = _stack([ref[int(i)] for i in out.row_id_R])
        assert_same_samples(out.sample._replace(cache=None, decode_iterations=None), expect)
        valid = out.sample.response_mask_BxN
        assert (out.version_RxN[valid] == np.maximum(0, out.version_RxN[valid])).all()
        assert (out.version_RxN[~valid] == -1).all()
        seen += out.row_id_R.tolist()
        assert out.carry.lengths_S.shape == (S,)
    assert len(seen) == len(set(seen))  # no row handed on twice
    carried = [n for n, (out, c, _) in enumerate(steps) if n and ((c.lengths_S > 0) & ~c.finished_S).any()]
    assert carried, "no row was carried with tokens: the test does not exercise the re-prefill"
    # every new row is handed on within two steps of its own (carried at most once after it started)
    for n, (out, _, _) in enumerate(steps):
        assert all(i < 0 or n - i // R <= 1 for i in out.row_id_R.tolist())


def _tagged_logprobs(p, out):
    """log-softmax at the sampling temperature of the full (uncached) forward of each row's prompt + response."""
    toks = np.concatenate([out.prompt_RxP, out.sample.tokens_BxN], 1)
    m = np.concatenate([out.prompt_mask_RxP, out.sample.response_mask_BxN], 1)
    logits = np.asarray(jax.jit(lambda p, t, m: T.forward(p, t, cfg=CFG, attn_mask_BxT=m)[0])(p, toks, m))
    lp = log_softmax64(logits[:, P - 1:P + N - 1] / SAMPLING.temperature)
    return np.take_along_axis(lp, out.sample.tokens_BxN[..., None].astype(np.int64), -1)[..., 0]


def test_each_token_is_sampled_by_its_tagged_versions_policy():
    """Two versions (steps 0, 1 with different params): in step 1's batch a carried row holds tokens of both; each
    token's unprocessed log-prob (no logit noise: temperature only) is its tagged version's given its prefix, from
    an independent full forward, and not the other version's."""
    versions = [params(), numpy_params(CFG, 2, layer_scale=5.0, head_scale=6.0)]
    steps = run_steps(SAMPLING, PrecisionConfig(), versions)
    out = steps[1][0]
    valid = out.sample.response_mask_BxN
    tags = out.version_RxN
    mixed = [(tags[b][valid[b]] == 0).any() and (tags[b][valid[b]] == 1).any() for b in range(R)]
    assert any(mixed), "no row of step 1 holds tokens of both versions"
    lp = [_tagged_logprobs(p, out) for p in versions]
    ulogp = out.sample.unprocessed_logprobs_BxN
    for v in (0, 1):
        at = valid & (tags == v)
        assert at.sum() > 3
        np.testing.assert_allclose(ulogp[at], lp[v][at], atol=5e-5)
        assert np.abs(ulogp[at] - lp[1 - v][at]).max() > 1e-2  # the other version's policy gives other values
    assert ((tags[valid] == 0) | (tags[valid] == 1)).all()


def test_decode_passes_follow_the_host_schedule():
    """Each step's decode passes and the rows it hands on (in order) are `partial_schedule`'s, from the rows' final
    lengths (the slot engine's) and the carry it started from."""
    steps, ref = one_version()
    for n, (out, carry, _) in enumerate(steps):
        pool = carry.row_id_S.tolist() + batch(n)[2].tolist()
        total = [int(ref[i].lengths_B[0]) for i in pool]
        sched = partial_schedule(carry.lengths_S, carry.finished_S, total, S, R)
        assert int(out.sample.decode_iterations) == sched.passes, f"step {n}"
        assert out.row_id_R.tolist() == [pool[j] for j in sched.out_rows]
        assert out.carry.row_id_S.tolist() == [pool[j] for j in sched.carried]
        np.testing.assert_array_equal(out.carry.lengths_S < np.array([total[j] for j in sched.carried]),
                                      ~out.carry.finished_S)


S2 = 4  # slots over two batch shards: 2 each, beside 4 of the R rows each


def _two_shard_sampler(sampling, precision):
    """The sampler over 2 devices, the batch (and the carry) split over them: 2 batch shards."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    one = NamedSharding(mesh, PartitionSpec())
    shardings = SamplerShardings(params=jax.tree.map(lambda _: one, params()),
                                 batch=NamedSharding(mesh, PartitionSpec("data")),
                                 cache=NamedSharding(mesh, PartitionSpec("data")))
    return Sampler(CFG, dataclasses.replace(sampling, slots=S2), precision, shardings=shardings)


def _shard_of(row_ids, rows_per_shard: int, slots_per_shard: int):
    """The batch shard a row id belongs to: a new row's by its place in its step's batch, a priming row's by its
    carry slot."""
    ids = np.asarray(row_ids)
    return np.where(ids >= 0, (ids % R) // rows_per_shard, (-1 - ids) // slots_per_shard)


def test_two_shards_sample_as_the_slot_engine_and_keep_each_shards_rows():
    """Two batch shards, the same params every step: each handed-on row equals the slot engine's row of its prompt
    and randomness (the slot engine on two devices, two batch shards); each shard hands on R/2 rows and carries
    S/2, all of its own (no row crosses shards); rows were carried with tokens. The re-prefill over all N columns
    (one program, shared with the next test; its widths are the one-shard test's); the sharded program itself runs
    in the OPD run (tests/opd/test_partial_rollouts.py)."""
    sampler = _two_shard_sampler(SAMPLING, NOISE)
    assert sampler.shards == 2
    steps = run_steps(SAMPLING, NOISE, [params()] * 3, slots=S2, shards=2,
                      program_at=lambda _: program(SAMPLING, NOISE, None, 2))
    ref = reference(SAMPLING, NOISE, params(), np.concatenate([o.row_id_R for o, _, _ in steps]), slots=S2,
                    shards=2, sampler=sampler)
    for out, carry_in, _ in steps:
        expect = _stack([ref[int(i)] for i in out.row_id_R])
        assert_same_samples(out.sample._replace(cache=None, decode_iterations=None), expect)
        np.testing.assert_array_equal(_shard_of(out.row_id_R, R // 2, S2 // 2), np.arange(R) // (R // 2))
        np.testing.assert_array_equal(_shard_of(out.carry.row_id_S, R // 2, S2 // 2), np.arange(S2) // (S2 // 2))
    carried = [n for n, (_, c, _) in enumerate(steps) if n and ((c.lengths_S > 0) & ~c.finished_S).any()]
    assert carried, "no row was carried with tokens: the test does not exercise the re-prefill"


def test_two_shards_are_two_one_shard_queues():
    """The 2-shard engine over R rows and S carried ones is two 1-shard engines, each on its shard's rows (their
    row ids and randomness) and carry, over 2 steps with 2 versions: tokens, log-probs, versions, the handed-on
    rows and the carry's integer fields bit for bit, its log-probs to float rounding (5e-6: the prefill's batch is
    R, not R/2 rows); its decode passes the longer queue's (a shard that is done stays as it is). The re-prefill
    over all N columns (one program per engine)."""
    versions = [params(), numpy_params(CFG, 2, layer_scale=5.0, head_scale=6.0)]
    precision = NOISE  # the rows' noise keys travel with them
    two = run_steps(SAMPLING, precision, versions, slots=S2, shards=2,
                    program_at=lambda _: program(SAMPLING, precision, None, 2))
    carry0, Rl, Sl = priming(SAMPLING, S2, shards=2), R // 2, S2 // 2
    halves = [run_from(jax.tree.map(lambda x: x[h * Sl:(h + 1) * Sl], carry0), versions,
                       [tuple(x[h * Rl:(h + 1) * Rl] for x in batch(n)) for n in range(len(versions))],
                       lambda _: program(SAMPLING, precision, None)) for h in range(2)]
    passes = []
    for n, (out, _, _) in enumerate(two):
        parts = [h[n][0] for h in halves]
        whole = jax.tree.map(lambda *xs: np.concatenate(xs), *[p._replace(sample=p.sample._replace(
            decode_iterations=None), sampled_tokens=None, reprefill_tokens=None) for p in parts])
        mine = out._replace(sample=out.sample._replace(decode_iterations=None), sampled_tokens=None,
                            reprefill_tokens=None)
        assert jax.tree.structure(whole) == jax.tree.structure(mine)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(whole)):
            if np.issubdtype(a.dtype, np.floating):
                np.testing.assert_allclose(a, b, rtol=0, atol=5e-6, err_msg=f"step {n}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"step {n}")
        passes.append([int(p.sample.decode_iterations) for p in parts])
        assert int(out.sample.decode_iterations) == max(passes[-1])
        assert int(out.sampled_tokens) == sum(int(p.sampled_tokens) for p in parts)
        assert int(out.reprefill_tokens) == sum(int(p.reprefill_tokens) for p in parts)
    assert any(a != b for a, b in passes), "the shards stopped together: the test does not exercise a shard's stop"
    out = two[1][0]
    valid = out.sample.response_mask_BxN
    assert any((out.version_RxN[b][valid[b]] == 0).any() and (out.version_RxN[b][valid[b]] == 1).any()
               for b in range(R)), "no row of step 1 holds tokens of both versions"


def test_priming_rows_are_each_shards_first_prompts():
    np.testing.assert_array_equal(priming_rows(3, 8), [0, 1, 2])
    np.testing.assert_array_equal(priming_rows(4, 8, shards=2), [0, 1, 4, 5])
    np.testing.assert_array_equal(priming_rows(8, 16, shards=4), [0, 1, 4, 5, 8, 9, 12, 13])


def test_bad_carry_shape_is_refused():
    sampling = dataclasses.replace(SAMPLING, return_full_logprobs=False, return_topk=0)
    toks, mask, ids = batch(0)
    with pytest.raises(ValueError, match="partial rollouts: a carry of 2 rows"):
        sample_partial(params(), toks, mask, rand_of(ids), ids, T.init_cache(CFG, S, P + N),
                       empty_carry(2, P, sampling, CFG.vocab_size), 0, cfg=CFG, precision=NOISE, sampling=sampling)


def test_reprefill_width_covers_every_live_carried_row_in_few_shapes():
    assert reprefill_width([0, 0, 0], [False] * 3, 256) == 64  # priming rows: the smallest bucket, N / 4
    assert reprefill_width([65, 200, 3], [False, True, False], 256) == 128  # a finished row needs no columns
    assert reprefill_width([129, 1, 1], [False] * 3, 256) == 256 and reprefill_width([7], [False], 24) == 8
    widths = {reprefill_width([n], [False], 256) for n in range(256)}
    assert widths == {64, 128, 256}
