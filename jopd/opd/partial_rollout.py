"""Partial rollouts in the OPD step (`rollout.partial`, `sampling.partial` the engine): step n's rollout with the
carry of step n - 1, what it hands the update, and its per-token version metrics.

Step n samples with theta_{n-k} (the window's entry -k) and tags its tokens n - k; a row carried into step n holds
tokens of step n - 1's version, n - k - 1 (clamped at 0), whose r (the staleness split's trainer log-softmax) is
the window's oldest entry: with partial rollouts the window holds k + 1 versions. The carry (`Carry`, S rows) is a
field of the train state (`staleness.PartialTrainState`), so a checkpoint holds it and a resumed run carries the
very rows the uninterrupted one did. Step 0's carry is S priming rows: each sampler batch shard's first S/shards
prompts of its batch again, with randomness of their own (`partial.priming_seed_indices`), so that from then on a
step takes S rows more than it hands on and the tail has rows to fill it.

Each batch shard of the sampler runs its own queue (`partial.sample_partial`'s `shards`): its S/shards carried
rows (the carry's rows are split like the sampler's batch, in the state and its checkpoints), its R/shards rows
handed on per step. One process, colocated (`validate`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int

from jopd.config_dataclass import ConfigError
from jopd.opd.batch import RolloutArrays
from jopd.opd.resolve import rollout_seed, weight_sync_key
from jopd.parallel.distributed import host_local_to_global
from jopd.sampling.config import RowRandomness, row_randomness
from jopd.sampling.partial import (Carry, empty_carry, priming_carry, priming_row_ids, priming_rows,
                                  priming_seed_indices, reprefill_width)

OPDStep = Any  # `jopd.opd.step.OPDStep` (which imports this module)


@dataclasses.dataclass(frozen=True)
class PartialInfo:
    """What a partial rollout adds to a `Rollout`: each token's version and the step's own sampling work."""

    version_BxN: Int[Array, "B N"]  # the parameter step that sampled each token (-1 after the row's end)
    sampled_tokens: Any  # tokens sampled in this step (its batch's and the carried rows')
    reprefill_tokens: Any  # real tokens the carried rows' re-prefill ran (prompt + response so far)
    picks: int  # tokens picked outside the decode passes: the R new rows' first, the S carried rows' next
    reprefill_positions: int = 0  # positions the re-prefill ran: S x (P + its response columns)


def check_step(opd: OPDStep) -> None:
    """What `rollout.partial` needs of the built step (beside the config's own checks, `validate`)."""
    if jax.process_count() > 1:
        raise ConfigError(f"RunConfig.rollout.partial: one jax process (this run has {jax.process_count()})")
    if opd.student_cfg.sparse_layers:
        raise ConfigError("RunConfig.rollout.partial: not with a mixture-of-experts student (its routing record)")


def slots(opd: OPDStep) -> int:
    """S: the slot engine's decode slots for the step's rows (the carry's rows)."""
    return opd.sampler.engine(opd.rollout_rows)[1]


def carry_template(opd_cfg, sampler, rows: int) -> Carry:
    """The train state's carry before step 0 (empty; step 0 primes it)."""
    S = sampler.engine(rows)[1]
    return empty_carry(S, opd_cfg.data.max_prompt_len, sampler.sampling, sampler.cfg.vocab_size)


def carry_shardings(carry: Carry, sampler_batch: NamedSharding) -> Carry:
    """The carry's rows split like the sampler's batch (each batch shard holds its own queue's carried rows)."""
    return jax.tree.map(lambda _: sampler_batch, carry)


def _priming(opd: OPDStep, batch: dict[str, np.ndarray], seed: int) -> Carry:
    S, N = slots(opd), opd.sampler.sampling.max_new_tokens
    ids = priming_row_ids(S)
    take = priming_rows(S, batch["prompt_tokens"].shape[0], opd.sampler.shards)
    rand = row_randomness(seed, priming_seed_indices(ids), N)
    carry = priming_carry(batch["prompt_tokens"][take], batch["prompt_mask"][take].astype(bool), rand, ids,
                          opd.sampler.sampling, opd.student_cfg.vocab_size)
    return jax.device_put(carry, opd.shardings.state.carry)


def rollout(opd: OPDStep, state, batch: dict[str, np.ndarray], step: int, policy, version: int):
    """Step `step`'s partial rollout with `policy` (theta of step `version`, synced with its key): -> (the
    `Rollout` fields of its R handed-on rows: arrays, host rows, decode passes, slots, `PartialInfo`; the carry
    for the next step)."""
    batch = opd.host_rows(batch)
    seed = rollout_seed(opd.cfg.train.seed)
    params = opd.sync_policy(policy, weight_sync_key(state.rng, version))
    R, P = batch["prompt_tokens"].shape
    N = opd.sampler.sampling.max_new_tokens
    ids = step * R + np.arange(R)
    rand = row_randomness(seed, ids, N)
    carry = _priming(opd, batch, seed) if step == 0 else state.carry
    arrays = (batch["prompt_tokens"], batch["prompt_mask"].astype(bool), *rand, ids.astype(np.int32))
    prompt, mask, u, k, ids_dev = host_local_to_global(arrays, opd.shardings.sampler_batch)
    S = slots(opd)
    cache = opd.sampler.take_cache(S, P + N)
    # the re-prefill over the longest carried response's power-of-two bucket (a read of S lengths: the previous
    # step's rollout is done, its rows were read to the host)
    width = reprefill_width(*jax.device_get((carry.lengths_S, carry.finished_S)), N)
    out = opd.sampler.partial_program(width)(params, prompt, mask, RowRandomness(u, k), ids_dev, cache, carry,
                                             np.int32(version))
    opd.sampler.return_cache(S, P + N, out.sample.cache)
    iterations = out.sample.decode_iterations
    sample = out.sample._replace(cache=None, decode_iterations=None)
    sample, prompt_b, mask_b, version_b = jax.device_put((sample, out.prompt_RxP, out.prompt_mask_RxP, out.version_RxN),
                                                         opd.shardings.batch)
    host_prompt, host_mask, row_ids = jax.device_get((out.prompt_RxP, out.prompt_mask_RxP, out.row_id_R))
    host = {"prompt_tokens": np.asarray(host_prompt), "prompt_mask": np.asarray(host_mask).astype(np.int32),
            "index": np.asarray(row_ids),  # the rows' global row ids (< 0: priming rows), not problem indices
            "question": np.asarray([_prompt_text(opd.tokenizer, t, m) for t, m in zip(host_prompt, host_mask)])}
    info = PartialInfo(version_b, out.sampled_tokens, out.reprefill_tokens, picks=R + S,
                       reprefill_positions=S * (P + width))
    arrays = RolloutArrays(prompt_BxP=prompt_b, prompt_mask_BxP=mask_b, sample=sample)
    carry_out = jax.device_put(out.carry, opd.shardings.state.carry)
    return (arrays, host, iterations, S, info), carry_out


def _prompt_text(tokenizer, tokens, mask) -> str:
    return "" if tokenizer is None else tokenizer.decode(np.asarray(tokens)[np.asarray(mask).astype(bool)])


@jax.jit
def _per_token_r(version_BxN, version, log_r_new, log_r_old):
    return jnp.where((version_BxN == version)[..., None], log_r_new, log_r_old)


def lagged_logprobs(opd: OPDStep, window: tuple, rollout, version: int, older: int):
    """r per token from its own version's params: the window's entry -k for this step's tokens, its oldest for a
    carried row's older ones."""
    a = rollout.arrays
    args = (a.prompt_BxP, a.prompt_mask_BxP, a.sample.tokens_BxN, a.sample.lengths_B)
    log_r = opd.lagged_fn(window[-opd.staleness], *args)
    if older == version:  # clamped at the initial params: one version
        return log_r
    return _per_token_r(rollout.partial.version_BxN, np.int32(version), log_r, opd.lagged_fn(window[0], *args))


@jax.jit
def _lag_metrics(version_BxN, lengths_B, step, version):
    real = jnp.arange(version_BxN.shape[1])[None, :] < lengths_B[:, None]
    n = jnp.maximum(jnp.sum(real), 1)
    lag = jnp.sum(jnp.where(real, step - version_BxN, 0)) / n
    old = jnp.sum(real & (version_BxN < version)) / n
    return {"rollout_lag": lag.astype(jnp.float32), "rollout_old_frac": old.astype(jnp.float32)}


def metrics(rollout, step: int, version: int) -> dict:
    """`rollout_lag`: the mean token's lag in steps (step - its version); `rollout_old_frac`: the share of tokens
    sampled by the older version (a carried row's); `rollout_reprefill_tokens`: the carried rows' re-prefill."""
    info = rollout.partial
    m = _lag_metrics(info.version_BxN, rollout.sample.lengths_B, np.int32(step), np.int32(version))
    return m | {"rollout_reprefill_tokens": info.reprefill_tokens}
