"""Partial rollouts (`rollout.partial`, with `rollout.staleness` >= 1): the slot engine without its within-step tail.

A step's batch is full when R rows have finished; the rows still decoding then (and the rows that finished beyond
the R, and the rows not yet started) are carried into the next step, at most S = the slots of them (`Carry`, held
in the train state). The next step's carried rows go first: each is RE-PREFILLED with the new params over its
prompt and its response so far into its slot's cache (the engine's layout: prompt at [0, P), response token t at
P + t) and continues from its next token, so every token is sampled by one parameter version's policy given its
prefix (no KV cache of old params is kept; the carry is small arrays). Each token is tagged with the version that
sampled it (`version_SxN`).

Bounds: a row that already holds tokens when carried in must finish in that step (the step runs on until it has;
its slots keep taking new rows meanwhile), so a row's tokens come from two consecutive versions at most. Row
counts: a step takes the carry (S rows) and its R new rows and hands R on, so the carry stays S rows; the first
step's carry is S priming rows the caller supplies (`priming_carry`), else no row would ever be carried and the
tail would stay.

Batch shards (`shards`, as the slot engine's): each shard runs its own queue, as if alone: its S/shards slots and
carried rows (the carry's rows h * S/shards .. are shard h's, split over the devices like the batch), its
R/shards new rows, its own "full" (R/shards of its rows finished, none carried in with tokens live: it then stops
while the others go on), and it hands on its first R/shards rows to finish (the output in shard order, so the
batch stays evenly split); no row and no KV cache crosses shards (tested against one-shard queues run apart).

A row's sample depends only on its prompt and its randomness (its own uniforms and noise key travel with it): with
one version throughout, its tokens equal the slot engine's and its log-probs agree to float precision (the
re-prefill computes its KV in one batched forward instead of one decode step per token; tested).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling import decode
from jopd.sampling.config import RowRandomness, SampleOutput, SamplingConfig, stop_and_pad_ids
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.slots import local_take

UNFINISHED = 2**30  # the sort key of a row that has not finished (after every finished one)


@flax.struct.dataclass
class Carry:
    """The S rows one step hands the next, in a fixed shape (an `Orbax`-checkpointable part of the train state)."""

    prompt_SxP: Int[Array, "S P"]
    prompt_mask_SxP: Bool[Array, "S P"]
    tokens_SxN: Int[Array, "S N"]  # the response so far (pad after `lengths_S`)
    logp_SxN: Float[Array, "S N"]
    ulogp_SxN: Float[Array, "S N"]
    lengths_S: Int[Array, "S"]  # tokens so far (0: not started)
    done_S: Bool[Array, "S"]  # ended with a stop token
    finished_S: Bool[Array, "S"]  # needs no more decoding (stop token, or max_new_tokens reached)
    uniforms_SxN: Float[Array, "S N"]  # the row's own randomness (`row_randomness`)
    keys_Sx2: Int[Array, "S 2"]
    row_id_S: Int[Array, "S"]  # the global row index its randomness was drawn for (< 0: a priming row)
    version_SxN: Int[Array, "S N"]  # the parameter step that sampled each token (-1: no token)
    full_SxNxV: Float[Array, "S N V"] | None = None  # with `sampling.return_full_logprobs`
    topk_SxNxK: Int[Array, "S N K"] | None = None  # with `sampling.return_topk`


class PartialOutput(NamedTuple):
    """One step of `sample_partial`: R finished rows (in finishing order) and what goes on to the next step."""

    sample: SampleOutput  # the R rows; `decode_iterations` the step's decode passes
    prompt_RxP: Int[Array, "R P"]  # each row's prompt (a carried row's is not in this step's batch)
    prompt_mask_RxP: Bool[Array, "R P"]
    version_RxN: Int[Array, "R N"]  # the parameter step that sampled each token (-1 after the row's end)
    row_id_R: Int[Array, "R"]
    carry: Carry
    sampled_tokens: Int[Array, ""]  # tokens sampled in this step (output rows and carried ones)
    reprefill_tokens: Int[Array, ""]  # real tokens (prompt + response so far) the carried rows' re-prefill ran


def empty_carry(slots: int, prompt_len: int, sampling: SamplingConfig, vocab: int) -> Carry:
    """A carry of `slots` rows, all finished and empty (the train state's before step 0, replaced by the priming)."""
    S, P, N = slots, prompt_len, sampling.max_new_tokens
    f = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    i = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    return Carry(prompt_SxP=i(S, P), prompt_mask_SxP=jnp.ones((S, P), bool), tokens_SxN=i(S, N), logp_SxN=f(S, N),
                 ulogp_SxN=f(S, N), lengths_S=i(S), done_S=jnp.zeros((S,), bool), finished_S=jnp.ones((S,), bool),
                 uniforms_SxN=f(S, N), keys_Sx2=jnp.zeros((S, 2), jnp.uint32), row_id_S=i(S),
                 version_SxN=jnp.full((S, N), -1, jnp.int32),
                 full_SxNxV=f(S, N, vocab) if sampling.return_full_logprobs else None,
                 topk_SxNxK=i(S, N, sampling.return_topk) if sampling.return_topk else None)


def carry_like(sampling: SamplingConfig, leaf) -> Carry:
    """A `Carry` of `leaf` in every field (None in those `sampling` does not fill): e.g. its shardings."""
    names = [f.name for f in dataclasses.fields(Carry)]
    off = {"full_SxNxV": not sampling.return_full_logprobs, "topk_SxNxK": not sampling.return_topk}
    return Carry(**{n: None if off.get(n) else leaf for n in names})


def priming_rows(slots: int, rows: int, shards: int = 1) -> np.ndarray:
    """The batch rows whose prompts the S priming rows take: per batch shard its first S/shards rows (so each
    shard's carry starts from its own prompts)."""
    j = np.arange(slots)
    return (j // (slots // shards)) * (rows // shards) + j % (slots // shards)


def priming_carry(prompt_SxP, prompt_mask_SxP, rand: RowRandomness, row_id_S, sampling: SamplingConfig,
                  vocab: int) -> Carry:
    """The first step's carry: S rows not started yet (their prompts and randomness), so that the step takes S
    rows more than it hands on and the carry holds S rows from then on."""
    S, P = prompt_SxP.shape
    carry = empty_carry(S, P, sampling, vocab)
    return carry.replace(prompt_SxP=jnp.asarray(prompt_SxP, jnp.int32), prompt_mask_SxP=jnp.asarray(prompt_mask_SxP, bool),
                         finished_S=jnp.zeros((S,), bool), uniforms_SxN=jnp.asarray(rand.uniforms_BxN),
                         keys_Sx2=jnp.asarray(rand.noise_key_data_Bx2), row_id_S=jnp.asarray(row_id_S, jnp.int32))


def reprefill_width(lengths_S, finished_S, max_new_tokens: int) -> int:
    """The response columns the re-prefill of a carry runs over (static, so few programs): the longest live carried
    response rounded up to a power of two, at least a quarter of max_new_tokens, at most all of it."""
    N = max_new_tokens
    live = np.asarray(lengths_S)[~np.asarray(finished_S, bool)]
    need = int(live.max()) if live.size else 0
    return min(N, max(-(-N // 4), 1 << max(need - 1, 0).bit_length()))


def reprefill(params, carry: Carry, cache, *, cfg, precision, sampling, P: int, N: int, width: int):
    """Each carried row's prompt + response so far (its first `width` columns hold every live row's) through the
    model into its slot's cache (one batched forward), and its next token picked at t = its length from the last
    real position's logits. (`jopd aot` costs it on its own: `sizing.cost`.)"""
    ell = carry.lengths_S
    kv_mask = jnp.concatenate([carry.prompt_mask_SxP.astype(bool), jnp.arange(N)[None, :] < ell[:, None]], axis=1)
    tokens = jnp.concatenate([carry.prompt_SxP, carry.tokens_SxN[:, :width]], axis=1)
    # a finished row's last position may lie beyond the width: its pick is discarded
    logits, cache = decode.prefill_at(params, tokens, kv_mask, jnp.minimum(P + ell - 1, P + width - 1), cache,
                                      cfg=cfg, precision=precision)
    t = jnp.minimum(ell, N - 1)  # a finished row's pick is discarded
    u = jnp.take_along_axis(carry.uniforms_SxN, t[:, None], axis=1)[:, 0]
    return decode.pick(logits, u, carry.keys_Sx2, t, precision=precision, sampling=sampling), cache


def sample_partial(
    params: transformer.Params,
    prompt_RxP: Int[Array, "R P"],
    prompt_mask_RxP: Bool[Array, "R P"],
    rand: RowRandomness,
    row_id_R: Int[Array, "R"],
    cache: transformer.KVCache,
    carry: Carry,
    version: Int[Array, ""],
    *,
    cfg: ModelConfig,
    precision: PrecisionConfig,
    sampling: SamplingConfig,
    reprefill_width: int | None = None,
    shards: int = 1,
) -> PartialOutput:
    """One step: the carry's S rows (in slots 0..S-1, re-prefilled) and then the R new rows in order on the cache's
    S slots, until R rows have finished and no row carried in with tokens is still decoding; `version` tags every
    token sampled. `shards`: each batch shard h runs its own queue (`slots.py`'s): its S/shards slots and carried
    rows, its R/shards new rows, its own "full" (R/shards of its rows finished; it then stops while others go on);
    it hands on its first R/shards to finish (the output in shard order) and carries the rest. `reprefill_width`:
    the response columns the re-prefill runs over (None: all N; the caller's `reprefill_width(carry)` is enough for
    every live carried row). Pure; jit it with the cache donated."""
    R, P = prompt_RxP.shape
    N = rand.uniforms_BxN.shape[1]
    S, _, L, _ = cache["k"][0].shape
    if (carry.lengths_S.shape[0] != S or carry.prompt_SxP.shape[1] != P or L != P + N or S > R or S % shards
            or R % shards):
        raise ValueError(f"partial rollouts: a carry of {carry.lengths_S.shape[0]} rows x prompt length "
                         f"{carry.prompt_SxP.shape[1]} for {S} slots of cache length {L} (P + N = {P + N}), "
                         f"at most {R} rows, both a multiple of the {shards} shards")
    if sampling.return_routing:
        raise ValueError("partial rollouts: no routing record (a mixture-of-experts student)")
    Sl, Rl = S // shards, R // shards
    Ml = Sl + Rl  # a shard's pool: its carried rows, then its new ones
    M = shards * Ml  # the pool, shard by shard (pool row h * Ml + j: shard h's j-th)
    V = cfg.vocab_size
    params = transformer.unstack_layers(params)
    choice = dict(precision=precision, sampling=sampling)
    stop_ids, pad_id = stop_and_pad_ids(cfg, sampling)
    version = jnp.asarray(version, jnp.int32)
    mask_RxP = prompt_mask_RxP.astype(bool)

    def cat(a_S, b_R):
        """Per shard its carried rows then its new ones: [S, ...] and [R, ...] -> [M, ...] (one shard: a concat)."""
        a = a_S.reshape(shards, Sl, *a_S.shape[1:])
        b = b_R.astype(a.dtype).reshape(shards, Rl, *b_R.shape[1:])
        return jnp.concatenate([a, b], axis=1).reshape(M, *a_S.shape[1:])

    shard_S = jnp.arange(S) // Sl  # each slot's (and carried row's) shard
    carry_pool_S = shard_S * Ml + jnp.arange(S) % Sl  # the pool row of carry row s (slot s starts with it)
    pool_mask = cat(carry.prompt_mask_SxP.astype(bool), mask_RxP)
    n_prompt_M = jnp.sum(pool_mask, axis=1, dtype=jnp.int32)
    uniforms = cat(carry.uniforms_SxN, rand.uniforms_BxN)
    keys = cat(carry.keys_Sx2, rand.noise_key_data_Bx2)
    start_len = cat(carry.lengths_S, jnp.zeros((R,), jnp.int32))
    carried_live = ~carry.finished_S
    # a row carried in with tokens of an older version finishes here (two versions per row at most)
    must_M = cat(carried_live & (carry.lengths_S > 0), jnp.zeros((R,), bool))

    carried_tokens = jnp.where(jnp.arange(N)[None, :] < carry.lengths_S[:, None], carry.tokens_SxN, pad_id)
    out = {"tokens": cat(carried_tokens, jnp.full((R, N), pad_id, jnp.int32)),
           "logp": cat(carry.logp_SxN, jnp.zeros((R, N))), "ulogp": cat(carry.ulogp_SxN, jnp.zeros((R, N))),
           "version": cat(carry.version_SxN, jnp.full((R, N), -1)), "lengths": start_len,
           "done": cat(carry.done_S, jnp.zeros((R,), bool)), "finished": cat(carry.finished_S, jnp.zeros((R,), bool)),
           "finish": cat(jnp.where(carry.finished_S, -1, UNFINISHED), jnp.full((R,), UNFINISHED))}
    if sampling.return_full_logprobs:
        out["full"] = cat(carry.full_SxNxV, jnp.zeros((R, N, V)))
    if sampling.return_topk:
        out["topk"] = cat(carry.topk_SxNxK, jnp.zeros((R, N, sampling.return_topk)))

    def record(o, at_row, t, c: decode.Choice, it):
        """Token t of the pool rows `at_row` (M: nowhere) chosen; a row ends on a stop token or at N tokens."""
        at = (at_row, t)
        o["tokens"] = o["tokens"].at[at].set(c.tok_B, mode="drop")
        o["logp"] = o["logp"].at[at].set(c.logp_B, mode="drop")
        o["ulogp"] = o["ulogp"].at[at].set(c.ulogp_B, mode="drop")
        o["version"] = o["version"].at[at].set(version, mode="drop")
        if sampling.return_full_logprobs:
            o["full"] = o["full"].at[at].set(c.full_BxV, mode="drop")
        if sampling.return_topk:
            o["topk"] = o["topk"].at[at].set(c.topk_BxK, mode="drop")
        stopped = jnp.isin(c.tok_B, stop_ids)
        ended = stopped | (t + 1 >= N)
        o["lengths"] = o["lengths"].at[at_row].set(t + 1, mode="drop")
        o["done"] = o["done"].at[at_row].set(stopped, mode="drop")
        o["finished"] = o["finished"].at[at_row].set(ended, mode="drop")
        o["finish"] = o["finish"].at[at_row].set(jnp.where(ended, it, UNFINISHED), mode="drop")
        return o, ended

    # 1. The new rows' prompts prefilled once (the slot engine's arithmetic), token 0 of each picked in one batch.
    pcache = jax.tree.map(lambda c: jnp.zeros((R,) + c.shape[1:], c.dtype), cache)
    logits_RxV, pcache = decode.prefill(params, prompt_RxP, mask_RxP, pcache, cfg=cfg, precision=precision,
                                        max_new_tokens=N)[:2]
    prompt_kv = jax.tree.map(lambda c: c[:, :, :P], pcache)
    first = decode.pick(logits_RxV, rand.uniforms_BxN[:, 0], rand.noise_key_data_Bx2, jnp.zeros((R,), jnp.int32),
                        **choice)

    # 2. The carried rows, slot s <- carry row s: re-prefilled with these params, their next token picked.
    width = N if reprefill_width is None else reprefill_width
    picked, cache = reprefill(params, carry, cache, cfg=cfg, precision=precision, sampling=sampling, P=P, N=N,
                               width=width)
    out, ended = record(out, jnp.where(carried_live, carry_pool_S, M), carry.lengths_S, picked, 0)
    state = {"cache": cache, "row": carry_pool_S, "t": carry.lengths_S + 1, "tok": picked.tok_B,
             "live": carried_live & ~ended, "next": jnp.zeros((shards,), jnp.int32), "out": out,
             "iterations": jnp.zeros((), jnp.int32)}

    def take_rows(state, take_SHxSl, local_SHxSl):
        """Slots in `take` start their shard's new row `local` (0..R/shards-1): its prompt KV copied in, token 0
        recorded."""
        take = take_SHxSl.reshape(S)
        new = (jnp.arange(shards)[:, None] * Rl + local_SHxSl).reshape(S)  # the global new row

        def copy(c_SxKxLxDh, p_RxKxPxDh):
            return c_SxKxLxDh.at[:, :, :P].set(jnp.where(take[:, None, None, None],
                                                         local_take(p_RxKxPxDh, local_SHxSl), c_SxKxLxDh[:, :, :P]))

        state["cache"] = jax.tree.map(copy, state["cache"], prompt_kv)
        rows = (jnp.arange(shards)[:, None] * Ml + Sl + local_SHxSl).reshape(S)  # their pool rows
        c = decode.Choice(*(None if x is None else x[new] for x in first))
        state["out"], ended = record(state["out"], jnp.where(take, rows, M), jnp.zeros((S,), jnp.int32), c,
                                     state["iterations"])
        state["row"] = jnp.where(take, rows, state["row"])
        state["t"] = jnp.where(take, 1, state["t"])
        state["tok"] = jnp.where(take, c.tok_B, state["tok"])
        state["live"] = jnp.where(take, ~ended, state["live"])
        return state

    def refill(state, active_SH):
        """Each active shard's free slots take its next new rows, in order (slot order)."""
        free = ~state["live"].reshape(shards, Sl) & active_SH[:, None]
        pending = Rl - state["next"]
        rank = jnp.cumsum(free, axis=1) - 1
        take = free & (rank < pending[:, None])
        local = jnp.minimum(state["next"][:, None] + rank, Rl - 1)
        state["next"] = state["next"] + jnp.minimum(jnp.sum(free, axis=1), pending).astype(jnp.int32)
        return jax.lax.cond(jnp.any(take), lambda s: take_rows(s, take, local), lambda s: s, state)

    state = refill(state, jnp.ones((shards,), bool))

    def active(state):
        """[shards]: the shards still sampling (rows to serve, and not full or a row carried in with tokens live)."""
        live = state["live"].reshape(shards, Sl)
        work = jnp.any(live, axis=1) | (state["next"] < Rl)
        full = jnp.sum(state["out"]["finished"].reshape(shards, Ml), axis=1) >= Rl
        must_live = jnp.any(live & must_M[state["row"]].reshape(shards, Sl), axis=1)
        return work & ~(full & ~must_live)

    def body(state):
        on_SH = active(state)  # a shard that is done stays as it is (its rows and slots), as if it had stopped
        row, t, on_S = state["row"], state["t"], on_SH[shard_S]
        live = state["live"] & on_S
        kv_mask = jnp.concatenate([pool_mask[row], jnp.arange(N)[None, :] < t[:, None]], axis=1)
        t_safe = jnp.minimum(t, N - 1)  # a finished slot's t may be N: its pick is discarded
        c, state["cache"] = decode.decode_step(
            params, state["tok"], state["cache"], P + t - 1, n_prompt_M[row] + t - 1, kv_mask,
            uniforms[row, t_safe], keys[row], t_safe, cfg=cfg, **choice)
        state["iterations"] = state["iterations"] + 1
        state["out"], ended = record(state["out"], jnp.where(live, row, M), t_safe, c, state["iterations"])
        state["live"] = state["live"] & ~(live & ended)
        state["t"], state["tok"] = jnp.where(live, t + 1, t), jnp.where(on_S, c.tok_B, state["tok"])
        return refill(state, on_SH)

    state = jax.lax.while_loop(lambda s: jnp.any(active(s)), body, state)
    o = state["out"]

    # 3. Per shard, its first R/shards rows to finish (finishing pass, then pool order) are its part of the batch;
    # its other S/shards are carried.
    j = jnp.arange(Ml)[None, :]
    fin, finish = o["finished"].reshape(shards, Ml), o["finish"].reshape(shards, Ml)
    order = jnp.argsort(jnp.where(fin, finish * Ml + j, UNFINISHED + j), axis=1, stable=True)
    out_rows, kept = order[:, :Rl], order[:, Rl:]
    pool = {"prompt": cat(carry.prompt_SxP, prompt_RxP), "mask": pool_mask, "uniforms": uniforms, "keys": keys,
            "row_id": cat(carry.row_id_S, row_id_R)}
    at = lambda name, rows: local_take((o | pool)[name], rows)  # noqa: E731
    sample = SampleOutput(tokens_BxN=at("tokens", out_rows), lengths_B=at("lengths", out_rows),
                          logprobs_BxN=at("logp", out_rows), unprocessed_logprobs_BxN=at("ulogp", out_rows),
                          done_B=at("done", out_rows), full_logprobs_BxNxV=at("full", out_rows) if "full" in o else None,
                          topk_ids_BxNxK=at("topk", out_rows) if "topk" in o else None, cache=state["cache"],
                          decode_iterations=state["iterations"])
    new_carry = Carry(prompt_SxP=at("prompt", kept), prompt_mask_SxP=at("mask", kept), tokens_SxN=at("tokens", kept),
                      logp_SxN=at("logp", kept), ulogp_SxN=at("ulogp", kept), lengths_S=at("lengths", kept),
                      done_S=at("done", kept), finished_S=at("finished", kept), uniforms_SxN=at("uniforms", kept),
                      keys_Sx2=at("keys", kept), row_id_S=at("row_id", kept), version_SxN=at("version", kept),
                      full_SxNxV=at("full", kept) if "full" in o else None,
                      topk_SxNxK=at("topk", kept) if "topk" in o else None)
    reprefilled = jnp.sum(jnp.where(carried_live, carry.prompt_mask_SxP.sum(axis=1, dtype=jnp.int32) + carry.lengths_S,
                                    0))
    return PartialOutput(sample, at("prompt", out_rows), at("mask", out_rows), at("version", out_rows),
                         at("row_id", out_rows), new_carry, jnp.sum(o["lengths"] - start_len), reprefilled)


class Schedule(NamedTuple):
    """`partial_schedule`'s answer: the step's decode passes, the pool rows it hands on (in order) and those it
    carries (in carry-slot order)."""

    passes: int
    out_rows: list[int]
    carried: list[int]


def partial_schedule(carry_lengths, carry_finished, total_lengths, slots: int, rows: int) -> Schedule:
    """The schedule `sample_partial` runs (host side, exact), given each pool row's final length (`total_lengths`:
    the carry's S rows, then the R new ones): the carried rows hold slots 0..S-1 (a live one takes its next token
    from its re-prefill), free slots take the new rows in order after each pass, and the step ends once R rows
    have finished and no row carried in with tokens is live. One batch shard (with several: this per shard)."""
    S, R = slots, rows
    total = [int(x) for x in total_lengths]
    length = [int(x) for x in carry_lengths] + [0] * R
    finished = [bool(x) for x in carry_finished] + [False] * R
    must = [not finished[s] and length[s] > 0 for s in range(S)] + [False] * R
    finish = [-1 if finished[s] else None for s in range(S)] + [None] * R
    slot_row: list[int | None] = [None] * S
    it, nxt = 0, 0

    def advance(j):  # row j takes its next token at pass `it`
        length[j] += 1
        if length[j] >= total[j]:
            finished[j], finish[j] = True, it
            return False
        return True

    live = [False] * S
    for s in range(S):
        if not finished[s]:
            slot_row[s], live[s] = s, advance(s)

    def refill():
        nonlocal nxt
        for s in range(S):
            if not live[s] and nxt < R:
                slot_row[s], nxt = S + nxt, nxt + 1
                live[s] = advance(slot_row[s])

    refill()
    while (any(live) or nxt < R) and not (sum(finished) >= R and not any(live[s] and must[slot_row[s]]
                                                                        for s in range(S))):
        it += 1
        for s in range(S):
            if live[s]:
                live[s] = advance(slot_row[s])
        refill()
    key = [(finish[j], j) if finished[j] else (UNFINISHED, j) for j in range(S + R)]
    order = [j for _, j in sorted(key)]
    return Schedule(it, order[:R], order[R:])


def priming_row_ids(slots: int) -> np.ndarray:
    """The priming rows' ids (< 0, apart from every step's rows; `priming_seed_indices` their randomness's)."""
    return -1 - np.arange(slots)


def priming_seed_indices(row_ids) -> np.ndarray:
    """The `row_randomness` indices of priming rows: a range no step's rows reach (2**62 + j)."""
    return (2**62 + (-1 - np.asarray(row_ids, np.int64))).astype(np.uint64)

