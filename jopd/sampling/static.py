"""The static engine: one prefill of the batch's left-padded prompts, then a `lax.while_loop` decode in which every
row takes one step per iteration until the longest stops (a finished row keeps decoding, its tokens discarded).
The slot engine (`jopd.sampling.slots`) gives the same samples without the finished rows' steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling import decode
from jopd.sampling.config import RowRandomness, SampleOutput, SamplingConfig, routing_buffer, stop_and_pad_ids
from jopd.sampling.precision import PrecisionConfig


def sample_static(
    params: transformer.Params,
    prompt_BxP: Int[Array, "B P"],
    prompt_mask_BxP: Bool[Array, "B P"],
    rand: RowRandomness,
    cache: transformer.KVCache,
    *,
    cfg: ModelConfig,
    precision: PrecisionConfig,
    sampling: SamplingConfig,
) -> SampleOutput:
    """Prefill left-padded prompts (every row ends with a real token) and decode up to max_new_tokens.

    `cache` has S = P + max_new_tokens slots (`decode`'s layout). `rand` holds each row's randomness
    (`row_randomness`). Pure; `Sampler` jits it with the cache donated.
    """
    B, P = prompt_BxP.shape
    N = sampling.max_new_tokens
    V = cfg.vocab_size
    params = transformer.unstack_layers(params)  # outside the decode loop; a no-op for `stages.sync` output
    stop_ids, pad_id = stop_and_pad_ids(cfg, sampling)
    mask = prompt_mask_BxP.astype(bool)
    kv_mask_BxS = jnp.concatenate([mask, jnp.ones((B, N), bool)], axis=1)
    n_prompt_B = jnp.sum(mask, axis=1, dtype=jnp.int32)
    choice = dict(precision=precision, sampling=sampling)

    routing = sampling.return_routing  # record each fed token's experts (`SampleOutput.expert_ids_BxSxLsxk`)
    logits_BxV, cache, *prompt_ids = decode.prefill(params, prompt_BxP, mask, cache, cfg=cfg, precision=precision,
                                                    max_new_tokens=N, return_routing=routing)

    def u_at(t):
        return jax.lax.dynamic_index_in_dim(rand.uniforms_BxN, t, axis=1, keepdims=False)

    def record(state, t, c: decode.Choice):
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), t, 1)  # noqa: E731
        done = state["done"]  # a finished row's step is discarded: pad token, zero log-probs
        tok = jnp.where(done, pad_id, c.tok_B)
        state["tokens"] = put(state["tokens"], tok)
        state["logp"] = put(state["logp"], jnp.where(done, 0.0, c.logp_B))
        state["ulogp"] = put(state["ulogp"], jnp.where(done, 0.0, c.ulogp_B))
        if sampling.return_full_logprobs:
            state["full"] = put(state["full"], c.full_BxV)
        if sampling.return_topk:
            state["topk"] = put(state["topk"], c.topk_BxK)
        state["lengths"] = state["lengths"] + (~done).astype(jnp.int32)
        state["done"] = done | jnp.isin(tok, stop_ids)
        state["tok"] = tok
        return state

    state = {
        "tokens": jnp.full((B, N), pad_id, jnp.int32),
        "logp": jnp.zeros((B, N), jnp.float32),
        "ulogp": jnp.zeros((B, N), jnp.float32),
        "lengths": jnp.zeros((B,), jnp.int32),
        "done": jnp.zeros((B,), bool),
        "tok": jnp.zeros((B,), jnp.int32),
        "cache": cache,
        "t": jnp.int32(1),
    }
    if sampling.return_full_logprobs:
        state["full"] = jnp.zeros((B, N, V), jnp.float32)
    if sampling.return_topk:
        state["topk"] = jnp.zeros((B, N, sampling.return_topk), jnp.int32)
    if routing:  # the prompt's real tokens from the prefill; response tokens as they are fed back
        buf = routing_buffer(cfg, B, P + N)
        ids = jnp.where(mask[:, :, None, None], prompt_ids[0].transpose(1, 2, 0, 3).astype(buf.dtype), -1)
        state["experts"] = buf.at[:, :P].set(ids)
    t0 = jnp.int32(0)
    state = record(state, 0, decode.pick(logits_BxV, u_at(t0), rand.noise_key_data_Bx2, t0, **choice))

    def cond(state):
        return (state["t"] < N) & ~jnp.all(state["done"])

    def body(state):
        t = state["t"]  # feed token t-1 (slot P+t-1), then choose token t
        c, state["cache"], *ids = decode.decode_step(
            params, state["tok"], state["cache"], P + t - 1, n_prompt_B + t - 1, kv_mask_BxS, u_at(t),
            rand.noise_key_data_Bx2, t, cfg=cfg, return_routing=routing, **choice)
        if routing:  # token t-1 is fed for the trainer iff its row goes on (a finished row feeds padding)
            fed = jnp.where(state["done"][:, None, None], -1, ids[0].transpose(1, 0, 2))
            state["experts"] = jax.lax.dynamic_update_index_in_dim(state["experts"], fed.astype(state["experts"].dtype),
                                                                   P + t - 1, 1)
        state = record(state, t, c)
        state["t"] = t + 1
        return state

    state = jax.lax.while_loop(cond, body, state)
    return SampleOutput(tokens_BxN=state["tokens"], lengths_B=state["lengths"], logprobs_BxN=state["logp"],
                        unprocessed_logprobs_BxN=state["ulogp"], done_B=state["done"],
                        full_logprobs_BxNxV=state.get("full"), topk_ids_BxNxK=state.get("topk"),
                        expert_ids_BxSxLsxk=state.get("experts"), cache=state["cache"],
                        decode_iterations=state["t"] - 1)
