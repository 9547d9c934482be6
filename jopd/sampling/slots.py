"""The slot engine: continuous batching within one rollout step, and prompts shared by their samples.

A fixed number of decode slots S serves the step's R rows (R = U prompts x G samples each). The U prompts are
prefilled once, in one batched pass; a slot takes a row by copying its prompt's KV cache into its own and
starting from the token the prompt's last position chose for that row. When a row stops, its slot takes the
next pending row at once, so no decode step is spent on a finished row while rows are pending (the static
engine, `static.sample_static`, runs every row until the longest stops). Rows are served in order, per batch
shard (`shards`: a slot takes only rows of its own shard, so no KV cache crosses devices).

A row's sample depends only on its prompt and its randomness (`row_randomness`: one uniform per step, the
logit-noise key): its slot, its batch-mates and when it started do not enter. Each slot's cache has the static
engine's layout (prompt in [0, P), response token t at P + t) and each decode step attends over it with the same
mask, so a row's tokens equal the static engine's and its log-probs agree to float precision (tested).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling import decode
from jopd.sampling.config import RowRandomness, SampleOutput, SamplingConfig, routing_buffer, stop_and_pad_ids
from jopd.sampling.precision import PrecisionConfig


def local_take(x_SHxAx, idx_SHxB):
    """x [shards * A, ...] gathered at shard-local indices [shards, B] -> [shards * B, ...] (no cross-shard
    gather: the leading axis stays split over the batch shards)."""
    shards, b = idx_SHxB.shape
    x = x_SHxAx.reshape(shards, -1, *x_SHxAx.shape[1:])
    idx = idx_SHxB.reshape(shards, b, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, idx, axis=1).reshape(shards * b, *x.shape[2:])


def sample_slots(
    params: transformer.Params,
    prompt_UxP: Int[Array, "U P"],
    prompt_mask_UxP: Bool[Array, "U P"],
    rand: RowRandomness,
    cache: transformer.KVCache,
    *,
    cfg: ModelConfig,
    precision: PrecisionConfig,
    sampling: SamplingConfig,
    group: int = 1,
    shards: int = 1,
) -> SampleOutput:
    """Sample G = `group` responses per left-padded prompt on the cache's S slots; R = U * G rows in prompt
    order (row r samples prompt r // G with `rand`'s row r). Returns the static engine's `SampleOutput` for the
    R rows (the slots' cache handed back). Pure; `Sampler` jits it with the cache donated."""
    U, P = prompt_UxP.shape
    R, N = rand.uniforms_BxN.shape
    S, _, L, _ = cache["k"][0].shape
    if R != U * group or L != P + N or S % shards or R % shards or S > R:
        raise ValueError(f"slot engine: {U} prompts x group {group} != {R} rows, or cache length {L} != P + N = "
                         f"{P + N}, or {S} slots not a divisor-compatible count <= {R} rows over {shards} shards")
    Sl, Rl = S // shards, R // shards
    V = cfg.vocab_size
    params = transformer.unstack_layers(params)
    choice = dict(precision=precision, sampling=sampling)
    stop_ids, pad_id = stop_and_pad_ids(cfg, sampling)
    mask_UxP = prompt_mask_UxP.astype(bool)
    n_prompt_U = jnp.sum(mask_UxP, axis=1, dtype=jnp.int32)

    # 1. Prefill every prompt once, into buffers of the slots' length (the static engine's prefill arithmetic).
    routing = sampling.return_routing  # record each fed token's experts (`SampleOutput.expert_ids_BxSxLsxk`)
    pcache = jax.tree.map(lambda c: jnp.zeros((U,) + c.shape[1:], c.dtype), cache)
    logits_UxV, pcache, *prompt_ids = decode.prefill(params, prompt_UxP, mask_UxP, pcache, cfg=cfg,
                                                     precision=precision, max_new_tokens=N, return_routing=routing)
    prompt_kv = jax.tree.map(lambda c: c[:, :, :P], pcache)  # [U, K, P, Dh] per layer

    row_prompt_R = jnp.arange(R) // group  # global prompt of each row (in its row's shard)

    # 2. Token 0 of every row, from its prompt's last position (one batched head + pick, not one per refill).
    zero_R = jnp.zeros((R,), jnp.int32)
    tok0, logp0, ulogp0, full0, topk0 = decode.pick(logits_UxV[row_prompt_R], rand.uniforms_BxN[:, 0],
                                                    rand.noise_key_data_Bx2, zero_R, **choice)
    stop0 = jnp.isin(tok0, stop_ids)

    out = {"tokens": jnp.full((R, N), pad_id, jnp.int32).at[:, 0].set(tok0),
           "logp": jnp.zeros((R, N), jnp.float32).at[:, 0].set(logp0),
           "ulogp": jnp.zeros((R, N), jnp.float32).at[:, 0].set(ulogp0),
           "lengths": jnp.ones((R,), jnp.int32), "done": stop0}
    if sampling.return_full_logprobs:
        out["full"] = jnp.zeros((R, N, V), jnp.float32).at[:, 0].set(full0)
    if sampling.return_topk:
        out["topk"] = jnp.zeros((R, N, sampling.return_topk), jnp.int32).at[:, 0].set(topk0)
    if routing:  # each row its prompt's real tokens (one prefill per prompt); response tokens as they are fed back
        buf = routing_buffer(cfg, R, P + N)
        ids_UxPxLsxk = jnp.where(mask_UxP[:, :, None, None], prompt_ids[0].transpose(1, 2, 0, 3).astype(buf.dtype), -1)
        out["experts"] = buf.at[:, :P].set(ids_UxPxLsxk[row_prompt_R])

    def global_rows(local_SHxSl):
        return (jnp.arange(shards)[:, None] * Rl + local_SHxSl).reshape(S)

    def take_rows(state, take_SHxSl, local_SHxSl):
        """Slots in `take` start their new (shard-local) rows: prompt KV copied in, token 0 already chosen."""
        rows = global_rows(local_SHxSl)
        prompts_local = (local_SHxSl // group)
        take = take_SHxSl.reshape(S)

        def copy(c_SxKxLxDh, p_UxKxPxDh):
            new = local_take(p_UxKxPxDh, prompts_local)
            return c_SxKxLxDh.at[:, :, :P].set(jnp.where(take[:, None, None, None], new, c_SxKxLxDh[:, :, :P]))

        state["cache"] = jax.tree.map(copy, state["cache"], prompt_kv)
        state["row"] = jnp.where(take, rows, state["row"])
        state["t"] = jnp.where(take, 1, state["t"])
        state["tok"] = jnp.where(take, tok0[rows], state["tok"])
        state["live"] = jnp.where(take, ~stop0[rows] & (N > 1), state["live"])
        return state

    state = {"cache": cache, "row": jnp.zeros((S,), jnp.int32), "t": jnp.zeros((S,), jnp.int32),
             "tok": jnp.zeros((S,), jnp.int32), "live": jnp.zeros((S,), bool),
             "next": jnp.full((shards,), Sl, jnp.int32), "out": out, "iterations": jnp.zeros((), jnp.int32)}
    state = take_rows(state, jnp.ones((shards, Sl), bool), jnp.broadcast_to(jnp.arange(Sl), (shards, Sl)))

    def cond(state):
        return jnp.any(state["live"]) | jnp.any(state["next"] < Rl)

    def body(state):
        row, t, live = state["row"], state["t"], state["live"]
        prompt = row_prompt_R[row]
        kv_mask = jnp.concatenate([mask_UxP[prompt], jnp.arange(N)[None, :] < t[:, None]], axis=1)
        t_safe = jnp.minimum(t, N - 1)  # a finished slot's t may be N: its pick is discarded
        (tok, logp, ulogp, full, topk), state["cache"], *ids = decode.decode_step(
            params, state["tok"], state["cache"], P + t - 1, n_prompt_U[prompt] + t - 1, kv_mask,
            rand.uniforms_BxN[row, t_safe], rand.noise_key_data_Bx2[row], t_safe, cfg=cfg, return_routing=routing,
            **choice)
        o = state["out"]
        at = (jnp.where(live, row, R), t_safe)  # finished slots write nowhere
        if routing:  # a live slot fed its row's token t-1 (at P + t - 1), and the row goes on
            fed = ids[0].transpose(1, 0, 2).astype(o["experts"].dtype)
            o["experts"] = o["experts"].at[at[0], P + t - 1].set(fed, mode="drop")
        o["tokens"] = o["tokens"].at[at].set(tok, mode="drop")
        o["logp"] = o["logp"].at[at].set(logp, mode="drop")
        o["ulogp"] = o["ulogp"].at[at].set(ulogp, mode="drop")
        if sampling.return_full_logprobs:
            o["full"] = o["full"].at[at].set(full, mode="drop")
        if sampling.return_topk:
            o["topk"] = o["topk"].at[at].set(topk, mode="drop")
        stopped = jnp.isin(tok, stop_ids)
        o["lengths"] = o["lengths"].at[at[0]].set(t + 1, mode="drop")
        o["done"] = o["done"].at[at[0]].set(stopped, mode="drop")
        state["out"] = o
        state["live"] = live & ~stopped & (t + 1 < N)
        state["t"], state["tok"] = jnp.where(live, t + 1, t), tok  # a finished slot's t stays <= N
        state["iterations"] = state["iterations"] + 1

        # refill: each shard's free slots take its next pending rows, in order
        free = ~state["live"].reshape(shards, Sl)
        pending = Rl - state["next"]
        rank = jnp.cumsum(free, axis=1) - 1
        take = free & (rank < pending[:, None])
        state["next"] = state["next"] + jnp.minimum(jnp.sum(free, axis=1), pending).astype(jnp.int32)
        local = jnp.minimum(state["next"][:, None] - jnp.sum(take, axis=1, keepdims=True) + rank, Rl - 1)
        return jax.lax.cond(jnp.any(take), lambda s: take_rows(s, take, local), lambda s: s, state)

    state = jax.lax.while_loop(cond, body, state)
    o = state["out"]
    return SampleOutput(tokens_BxN=o["tokens"], lengths_B=o["lengths"], logprobs_BxN=o["logp"],
                        unprocessed_logprobs_BxN=o["ulogp"], done_B=o["done"], full_logprobs_BxNxV=o.get("full"),
                        topk_ids_BxNxK=o.get("topk"), expert_ids_BxSxLsxk=o.get("experts"), cache=state["cache"],
                        decode_iterations=state["iterations"])


def slot_iterations(lengths_R, slots: int, shards: int = 1) -> int:
    """The decode forward passes `sample_slots` runs for rows of these lengths (host side, exact): per shard, its
    slots take its rows in order; a row of length L >= 2 holds its slot for L - 1 passes (its first token comes
    from the prefill); a row of length 1 needs none, but its slot takes the next row only after one pass."""
    import heapq

    import numpy as np

    lengths = np.asarray(lengths_R).reshape(shards, -1)
    per = slots // shards
    end = 0
    for rows in lengths:
        free = [(0, s) for s in range(per)]  # (pass after which the slot can take a row, slot index)
        for n in rows:
            at, s = heapq.heappop(free)
            end = max(end, at + max(int(n) - 1, 0))
            heapq.heappush(free, (at + max(int(n) - 1, 1), s))
    return end
