"""KV-cache rollout sampler: left-padded prompts, one prefill pass, then a `lax.while_loop` decode, all through
the shared `transformer.forward`. Temperature / top-k / top-p / greedy, per-sequence stop tokens, seeded.

The jitted core `sample_padded` takes the params as traced arguments, so one compiled program serves every
weight sync; it compiles once per (model cfg, precision, sampling cfg, shape bucket). `Sampler` buckets the
batch and prompt lengths (few distinct shapes), keeps a donated KV-cache buffer per bucket, and draws each
sequence's randomness from (seed, sequence index): a sequence's sample does not depend on its batch-mates.
Tokens are drawn by inverse CDF from one uniform per step (two-level over the vocab: no full-vocab cumsum or
per-token random numbers), and the top-p cut is found by bisection on its threshold (`nucleus_threshold`):
a sort of a [64, 49152] block of rows is far slower on CPU than a few passes over it.

Per generated token it returns the processed logprob (log-probability of the sampled token under the
distribution actually sampled from: after logit noise, temperature, top-k/top-p truncation and
renormalization; 0 for greedy) and the unprocessed logprob (after noise and temperature only); optionally
the full unprocessed log-softmax [B, N, V] fp32, for the exact mismatch KL (see `jopd.lab.position_kl`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Annotated, Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from jopd.config_dataclass import config_dataclass
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling.precision import PrecisionConfig


@config_dataclass
class SamplingConfig:
    """How the rollout engine picks tokens. `seed` only seeds the host-side randomness (`row_randomness`); it is
    not part of the compiled program."""

    temperature: Annotated[float, pydantic.Field(gt=0)] = 1.0
    top_k: Annotated[int, pydantic.Field(ge=0)] = 0  # 0: no top-k truncation
    top_p: Annotated[float, pydantic.Field(gt=0, le=1)] = 1.0  # 1: no nucleus truncation
    greedy: bool = False  # argmax of the (noisy) logits; processed logprob is 0 (a point mass)
    max_new_tokens: Annotated[int, pydantic.Field(gt=0)] = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # stop tokens in addition to the model config's eos ids
    return_full_logprobs: bool = False  # also return the unprocessed log-softmax per step, [B, N, V] fp32
    return_topk: Annotated[int, pydantic.Field(ge=0)] = 0  # also return each step's top-k token ids [B, N, k]
    # Decode slots of the slot engine (`jopd.sampling.slots`): a finished row's slot takes the next pending row
    # at once; 0: the static engine (every row of a batch decodes until the longest stops). Same samples.
    slots: Annotated[int, pydantic.Field(ge=0)] = 0
    # Rollouts per prompt for OPD (GRPO's are `rl.group_size`): a prompt is prefilled once and its samples
    # start from copies of its KV cache (the slot engine); `data.batch_size` counts prompts.
    samples_per_prompt: Annotated[int, pydantic.Field(ge=1)] = 1
    # Speed knob, same results: the top-p cut bisects until at most this many tokens sit at the boundary,
    # then ranks those exactly (no sort of the vocabulary; see `nucleus_threshold`).
    top_p_candidates: Annotated[int, pydantic.Field(gt=0)] = 128


class SampleOutput(NamedTuple):
    """Rollouts of one batch. Response slot t of row b is real iff t < lengths_B[b] (`response_mask`)."""

    tokens_BxN: Int[Array, "B N"]  # response token ids; pad id after the end
    lengths_B: Int[Array, "B"]  # number of response tokens, stop token included
    logprobs_BxN: Float[Array, "B N"]  # processed logprobs of the sampled tokens (0 after the end)
    unprocessed_logprobs_BxN: Float[Array, "B N"]  # temperature (and noise) only (0 after the end)
    done_B: Bool[Array, "B"]  # the row ended with a stop token (False: it hit max_new_tokens)
    full_logprobs_BxNxV: Float[Array, "B N V"] | None = None  # unprocessed log-softmax, if requested
    topk_ids_BxNxK: Int[Array, "B N K"] | None = None  # the (noisy) logits' top-k ids per step, if requested
    cache: Any = None  # the KV-cache buffer (donated in, handed back for reuse)
    # decode forward passes the engine ran (a replicated scalar): its slot-steps are rows + slots x this (every
    # row's first token comes from the prefill), so sum(lengths_B) / (rows + slots x decode_iterations) is the
    # fraction of them spent on real tokens (`rollout_useful_frac`)
    decode_iterations: Any = None

    @property
    def response_mask_BxN(self):
        n = self.tokens_BxN.shape[1]
        return np.arange(n)[None, :] < np.asarray(self.lengths_B)[:, None]


@dataclasses.dataclass(frozen=True)
class SamplerShardings:
    """Optional placement on a mesh: `params` a pytree of shardings matching the params (e.g. `jopd.parallel.rules`'
    param_shardings with the sample rules), `batch` one sharding for every array with a leading batch axis
    (its spec names the batch dim only), `cache` a sharding for every per-layer [B, K, S, Dh] cache buffer
    (`transformer.init_cache`) or a dict {"k": ..., "v": ...} of them."""

    params: Any
    batch: Any
    cache: Any

    @property
    def cache_dict(self) -> dict[str, Any]:
        return dict(self.cache) if isinstance(self.cache, dict) else {"k": self.cache, "v": self.cache}


# ---------------------------------------------------------------------------------------------
# token choice (pure, per step)


class RowRandomness(NamedTuple):
    """All randomness of one batch, one row per sequence (see `row_randomness`)."""

    uniforms_BxN: Float[Array, "B N"]  # U[0,1): drives the token choice of each step (inverse CDF)
    noise_key_data_Bx2: Int[Array, "B 2"]  # uint32 threefry key data of the logit noise (unused if sigma=0)


def row_randomness(seed: int, indices: Sequence[int] | np.ndarray, max_new_tokens: int) -> RowRandomness:
    """Per-sequence randomness on the host: numpy's counter-based Philox keyed by (seed, the sequence's global
    index). A sequence's draws do not depend on its batch-mates or on max_new_tokens (streams are read in
    order), and the compiled program holds no PRNG code unless logit noise is on (threefry is slow to
    compile on CPU)."""
    u = np.empty((len(indices), max_new_tokens), np.float32)
    k = np.empty((len(indices), 2), np.uint32)
    for r, i in enumerate(indices):
        rng = np.random.Generator(np.random.Philox(key=np.array([seed, i], np.uint64)))
        k[r] = rng.integers(0, 2**32, 2, dtype=np.uint32)
        u[r] = rng.random(max_new_tokens, dtype=np.float32)
    return RowRandomness(u, k)


def _noise_BxV(noise_key_data_Bx2, t, shape_V):
    """Each row's logit noise at its step t (a scalar, or one step per row)."""
    keys = jax.random.wrap_key_data(noise_key_data_Bx2, impl="threefry2x32")
    if jnp.ndim(t) == 0:
        return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, t), shape_V, jnp.float32))(keys)
    return jax.vmap(lambda k, s: jax.random.normal(jax.random.fold_in(k, s), shape_V, jnp.float32))(keys, t)


def _take(x_BxC, idx_B):
    return jnp.take_along_axis(x_BxC, idx_B[:, None], axis=1)[:, 0]


def _inverse_cdf(probs_BxC, u_B):
    """Inverse-CDF draw: the first entry with positive mass whose cumulative mass reaches u * total (zero-mass
    entries are never returned, whatever the rounding of the cumsum). Also returns the position of u inside
    the chosen entry's interval, rescaled to [0, 1): uniform again, for a second-level draw."""
    cdf = jnp.cumsum(probs_BxC, axis=1)
    x = u_B * cdf[:, -1]
    positive = probs_BxC > 0
    hit = positive & (cdf >= x[:, None])
    last = probs_BxC.shape[1] - 1 - jnp.argmax(positive[:, ::-1], axis=1)
    idx = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), last)
    p = _take(probs_BxC, idx)
    residual = (x - (_take(cdf, idx) - p)) / jnp.maximum(p, jnp.finfo(jnp.float32).tiny)
    return idx, jnp.clip(residual, 0.0, 1.0 - jnp.finfo(jnp.float32).epsneg)


def sample_index(probs_BxC: Float[Array, "B C"], u_B: Float[Array, "B"], block: int = 256) -> Int[Array, "B"]:
    """Draw index i with probability probs[i] / sum(probs) from one uniform u per row (exact up to fp32
    rounding). Wide rows use two levels (a block by block mass, then an entry inside it), so no cumsum or
    per-entry random number spans the whole vocabulary."""
    B, C = probs_BxC.shape
    if C <= 2 * block:
        return _inverse_cdf(probs_BxC, u_B)[0]
    nb = -(-C // block)
    blocks = jnp.pad(probs_BxC, ((0, 0), (0, nb * block - C))).reshape(B, nb, block)
    j, u_in = _inverse_cdf(jnp.sum(blocks, axis=2), u_B)
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]
    return j * block + _inverse_cdf(inner, u_in)[0]


def _order_key(z: jax.Array) -> jax.Array:
    """int32 key with the order of the float32 values (sign-magnitude -> two's complement)."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def nucleus_threshold(z_BxC: Float[Array, "B C"], lse_B: Float[Array, "B"], top_p: float, bracket: int,
                      blind_steps: int = 6, p_BxC: Float[Array, "B C"] | None = None):
    """Top-p cut without sorting: the smallest kept logit z* per row, where token v is kept iff the probability
    mass of the tokens strictly more probable than v, under p = exp(z - lse), is below top_p (the sorted-prefix
    rule, with tied tokens kept or dropped together).

    Bisection on the order key of the threshold narrows a bracket (lo, hi] with mass(z > hi) < top_p <=
    mass(z > lo) until it holds at most `bracket` tokens (or a single value); those few are then ranked
    exactly with a top-k. Each step is one pass over the row: the first `blind_steps` update only the masses
    (a sort of the vocabulary is far slower on CPU); later steps also count the bracket, to know when to stop.
    """
    B, C = z_BxC.shape
    c = min(bracket, C)
    p = jnp.exp(z_BxC - lse_B[:, None]) if p_BxC is None else p_BxC
    keys = _order_key(z_BxC)
    hi = jnp.max(keys, axis=1)  # mass strictly above the max is 0 < top_p
    # Tokens with z <= lse + log((1 - top_p) / C) - 1 hold at most (1 - top_p) / e of the mass, so the mass
    # above that value is >= top_p + 0.63 (1 - top_p): a valid lower end, far from rounding trouble.
    lo = _order_key(lse_B + math.log((1.0 - top_p) / C) - 1.0)

    def wide(lo, hi):  # more than one representable value left in (lo, hi]
        return jax.lax.bitcast_convert_type(hi - lo, jnp.uint32) > 1  # hi >= lo; the difference may wrap

    def bisect(lo, hi, m_hi, go):
        mid = lo + jax.lax.shift_right_logical(hi - lo, 1)  # exact midpoint, even when hi - lo wraps
        above = keys > mid[:, None]
        m_mid = jnp.sum(jnp.where(above, p, 0.0), axis=1)
        down = go & (m_mid < top_p)  # the threshold is <= mid
        up = go & ~(m_mid < top_p)
        return jnp.where(up, mid, lo), jnp.where(down, mid, hi), jnp.where(down, m_mid, m_hi)

    def blind(_, s):
        lo, hi, m_hi = s
        return bisect(lo, hi, m_hi, wide(lo, hi))

    lo, hi, m_hi = jax.lax.fori_loop(0, blind_steps, blind, (lo, hi, jnp.zeros((B,), jnp.float32)))

    def count(lo, hi):
        return jnp.sum((keys > lo[:, None]) & (keys <= hi[:, None]), axis=1, dtype=jnp.int32)

    def counted(s):
        lo, hi, m_hi, n = s
        lo, hi, m_hi = bisect(lo, hi, m_hi, (n > c) & wide(lo, hi))
        return lo, hi, m_hi, count(lo, hi)

    lo, hi, m_hi, _ = jax.lax.while_loop(lambda s: jnp.any((s[3] > c) & wide(s[0], s[1])), counted,
                                         (lo, hi, m_hi, count(lo, hi)))
    in_bracket = (keys > lo[:, None]) & (keys <= hi[:, None])
    vals, _ = jax.lax.top_k(jnp.where(in_bracket, z_BxC, -jnp.inf), c)
    pv = jnp.exp(vals - lse_B[:, None])
    strictly_above = m_hi[:, None] + jnp.sum(jnp.where(vals[:, None, :] > vals[:, :, None], pv[:, None, :], 0.0),
                                             axis=2)
    keep = (vals > -jnp.inf) & (strictly_above < top_p)
    return jnp.min(jnp.where(keep, vals, jnp.inf), axis=1)


def _sample_above(u_B, z_BxC, lse_B, p_BxC, z_star_B):
    """Sample among entries with z >= z* (renormalized). Returns (index, processed logprob)."""
    kept_p = jnp.where(z_BxC >= z_star_B[:, None], p_BxC, 0.0)
    idx = sample_index(kept_p, u_B)
    return idx, _take(z_BxC, idx) - lse_B - jnp.log(jnp.sum(kept_p, axis=1))


def choose_tokens(scaled_BxV: Float[Array, "B V"], u_B: Float[Array, "B"], sampling: SamplingConfig,
                  lse_B: Float[Array, "B"] | None = None):
    """Pick one token per row from temperature-scaled logits, driven by one uniform u per row: argmax (greedy),
    or temperature -> top-k -> top-p on the renormalized top-k -> renormalize -> inverse-CDF draw.
    `lse_B` (the logsumexp of the row) may be passed when already known. Returns (tokens_B, processed
    logprobs_B)."""
    B, V = scaled_BxV.shape
    if sampling.greedy:
        return jnp.argmax(scaled_BxV, axis=1).astype(jnp.int32), jnp.zeros((B,), jnp.float32)
    if 0 < sampling.top_k < V:
        z, ids = jax.lax.top_k(scaled_BxV, sampling.top_k)
        lse = jax.nn.logsumexp(z, axis=1)
    else:
        z, ids = scaled_BxV, None
        lse = jax.nn.logsumexp(z, axis=1) if lse_B is None else lse_B
    p = jnp.exp(z - lse[:, None])
    if sampling.top_p < 1.0:
        z_star = nucleus_threshold(z, lse, sampling.top_p, sampling.top_p_candidates, p_BxC=p)
        idx, logp = _sample_above(u_B, z, lse, p, z_star)
    else:
        idx = sample_index(p, u_B)
        logp = _take(z, idx) - lse
    tok = idx if ids is None else _take(ids, idx)
    return tok.astype(jnp.int32), logp


def step_logits(logits_BxV, noise_key_data_Bx2, t, precision: PrecisionConfig, temperature: float):
    """Raw logits (already rounded to the logits dtype) -> noisy, temperature-scaled fp32 logits (each row's
    noise at its step t: a scalar, or [B])."""
    z = logits_BxV.astype(jnp.float32)
    if precision.logit_noise > 0:  # static skip: sigma == 0 is bit-identical to no noise
        z = z + precision.logit_noise * _noise_BxV(noise_key_data_Bx2, t, z.shape[1:])
    return z / temperature


# ---------------------------------------------------------------------------------------------
# the compiled program


def stop_and_pad_ids(cfg: ModelConfig, sampling: SamplingConfig) -> tuple[jax.Array, int]:
    """The ids that end a row (the model's EOS ids and `stop_token_ids`) and the id written after its end."""
    stop_ids = jnp.asarray(sorted(set(cfg.eos_ids) | set(sampling.stop_token_ids)) or [-1], jnp.int32)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_ids or (0,))[0]
    return stop_ids, pad_id


def sample_padded(
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

    `cache` has S = P + max_new_tokens slots; prompt token j sits in slot j, response token t in slot P + t.
    `rand` holds each row's randomness (`row_randomness`). Pure; `Sampler` jits it with the cache donated.
    """
    B, P = prompt_BxP.shape
    N = sampling.max_new_tokens
    V = cfg.vocab_size
    params = transformer.unstack_layers(params)  # outside the decode loop; a no-op for `stages.sync` output
    fwd = dict(cfg=cfg, dtype=precision.dtype, logits_dtype=precision.logits_jnp_dtype)
    stop_ids, pad_id = stop_and_pad_ids(cfg, sampling)
    mask = prompt_mask_BxP.astype(bool)
    kv_mask_BxS = jnp.concatenate([mask, jnp.ones((B, N), bool)], axis=1)
    n_prompt_B = jnp.sum(mask, axis=1, dtype=jnp.int32)

    hidden, cache = transformer.forward(params, prompt_BxP, attn_mask_BxT=mask, cache=cache, cache_index=0,
                                        positions_BxT=transformer.positions_from_mask(mask),
                                        kv_mask_BxS=kv_mask_BxS, return_hidden=True, **fwd)
    logits_BxV = transformer.logits_from_hidden(params, hidden[:, -1:], dtype=precision.dtype,
                                                logits_dtype=precision.logits_jnp_dtype)[:, 0]

    def pick(logits_BxV, t, done_B):
        scaled = step_logits(logits_BxV, rand.noise_key_data_Bx2, t, precision, sampling.temperature)
        u_B = jax.lax.dynamic_index_in_dim(rand.uniforms_BxN, t, axis=1, keepdims=False)
        lse = jax.nn.logsumexp(scaled, axis=1)
        tok, logp = choose_tokens(scaled, u_B, sampling, lse)
        full = scaled - lse[:, None]  # log-softmax; materialized only when returned
        ulogp = _take(scaled, tok) - lse
        tok = jnp.where(done_B, pad_id, tok)
        logp = jnp.where(done_B, 0.0, logp)
        ulogp = jnp.where(done_B, 0.0, ulogp)
        topk = jax.lax.top_k(scaled, sampling.return_topk)[1] if sampling.return_topk else None
        return tok, logp, ulogp, full, topk

    def record(state, t, tok, logp, ulogp, full, topk):
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), t, 1)  # noqa: E731
        state["tokens"] = put(state["tokens"], tok)
        state["logp"] = put(state["logp"], logp)
        state["ulogp"] = put(state["ulogp"], ulogp)
        if sampling.return_full_logprobs:
            state["full"] = put(state["full"], full)
        if sampling.return_topk:
            state["topk"] = put(state["topk"], topk)
        state["lengths"] = state["lengths"] + (~state["done"]).astype(jnp.int32)
        state["done"] = state["done"] | jnp.isin(tok, stop_ids)
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
    state = record(state, 0, *pick(logits_BxV, jnp.int32(0), state["done"]))

    def cond(state):
        return (state["t"] < N) & ~jnp.all(state["done"])

    def body(state):
        t = state["t"]  # feed token t-1 (slot P+t-1), then choose token t
        logits, state["cache"] = transformer.forward(
            params, state["tok"][:, None], cache=state["cache"], cache_index=P + t - 1,
            positions_BxT=(n_prompt_B + t - 1)[:, None], kv_mask_BxS=kv_mask_BxS, **fwd)
        state = record(state, t, *pick(logits[:, 0], t, state["done"]))
        state["t"] = t + 1
        return state

    state = jax.lax.while_loop(cond, body, state)
    return SampleOutput(tokens_BxN=state["tokens"], lengths_B=state["lengths"], logprobs_BxN=state["logp"],
                        unprocessed_logprobs_BxN=state["ulogp"], done_B=state["done"],
                        full_logprobs_BxNxV=state.get("full"), topk_ids_BxNxK=state.get("topk"),
                        cache=state["cache"], decode_iterations=state["t"] - 1)


# ---------------------------------------------------------------------------------------------
# host-side driver: buckets, padding, randomness, cache reuse


def bucket_size(n: int, *, minimum: int, pow2_up_to: int) -> int:
    """Powers of two up to `pow2_up_to`, then multiples of it (few shapes, <= 2x padding)."""
    n = max(n, minimum)
    if n <= pow2_up_to:
        return 1 << (n - 1).bit_length()
    return math.ceil(n / pow2_up_to) * pow2_up_to


def check_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_new_tokens: int) -> None:
    if len(prompts) == 0:
        raise ValueError("prompts: no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}]: empty prompt")
        cfg.check_context(len(p) + max_new_tokens, f"prompts[{i}]: {len(p)} tokens + max_new_tokens={max_new_tokens}")


def _program_precision(precision: PrecisionConfig) -> PrecisionConfig:
    # Weight quantization / noise act on the params (prepare_sampler_params), not on the program.
    return dataclasses.replace(precision, weight_quant="none", weight_noise=0.0)


def _program_sampling(sampling: SamplingConfig) -> SamplingConfig:
    # the seed only enters through `row_randomness`; the slot count only through the cache shape
    return dataclasses.replace(sampling, seed=0, slots=0, samples_per_prompt=1)


def _bind(cfg, precision, sampling, group: int = 0, shards: int = 1):
    """The static engine (group 0), or the slot engine for `group` samples per prompt (`jopd.sampling.slots`)."""
    from jopd.sampling.slots import sample_slots

    def fn(params, prompt_BxP, prompt_mask_BxP, rand, cache):
        if group == 0:
            return sample_padded(params, prompt_BxP, prompt_mask_BxP, rand, cache, cfg=cfg, precision=precision,
                                 sampling=sampling)
        return sample_slots(params, prompt_BxP, prompt_mask_BxP, rand, cache, cfg=cfg, precision=precision,
                            sampling=sampling, group=group, shards=shards)
    return fn


@functools.lru_cache(maxsize=64)
def _compiled(cfg: ModelConfig, precision: PrecisionConfig, sampling: SamplingConfig, group: int = 0):
    """One jitted program per static setup, shared by all `Sampler`s (jit then caches per shape bucket)."""
    return jax.jit(_bind(cfg, precision, sampling, group), donate_argnums=(4,))


class Sampler:
    """Rollout engine for one (model cfg, precision, sampling cfg); params are passed per call.

        sampler = Sampler(cfg, SamplingConfig(top_p=0.9, max_new_tokens=64), precision)
        rollout_params = prepare_sampler_params(params, precision, key)   # once per weight sync
        out = sampler.generate(rollout_params, [[1, 2, 3], [4, 5]], seed=0)  # numpy SampleOutput, B = 2

    Two engines, the same samples (`jopd.sampling.slots`): the static one runs every row of a batch until the
    longest stops; with `sampling.slots` > 0 (or several samples per prompt), the slot engine decodes on that
    many slots, refilling a finished row's slot with the next pending row, and prefills a shared prompt once.
    """

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, precision: PrecisionConfig | None = None, *,
                 shardings: SamplerShardings | None = None, keep_cache: bool = True,
                 min_prompt_bucket: int = 8, batch_pow2_up_to: int = 64, prompt_pow2_up_to: int = 256):
        self.cfg = cfg
        self.sampling = sampling
        self.precision = precision or PrecisionConfig()
        self.shardings = shardings
        self.keep_cache = keep_cache
        self._buckets = (min_prompt_bucket, batch_pow2_up_to, prompt_pow2_up_to)
        self._caches: dict[tuple[int, int], transformer.KVCache] = {}
        self._programs: dict[int, Any] = {}
        self.shards = 1  # batch shards: the slot engine refills a slot from its own shard's rows
        if shardings is not None:
            spec = shardings.batch.spec
            axes = spec[0] if len(spec) else None
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            self.shards = math.prod(shardings.batch.mesh.shape[a] for a in axes)

    def program_for(self, group: int = 0):
        """The jitted program for `group` samples per prompt (0: the static engine), with this sampler's
        shardings and the cache donated; e.g. `.lower(params, prompt, mask, rand, cache)` (`jopd.opd.aot`)."""
        if group not in self._programs:
            precision, sampling = _program_precision(self.precision), _program_sampling(self.sampling)
            if self.shardings is None:
                self._programs[group] = _compiled(self.cfg, precision, sampling, group)
            else:
                b, c = self.shardings.batch, self.shardings.cache_dict
                out = SampleOutput(b, b, b, b, b, b if self.sampling.return_full_logprobs else None,
                                   b if self.sampling.return_topk else None, c, NamedSharding(b.mesh, PartitionSpec()))
                self._programs[group] = jax.jit(
                    _bind(self.cfg, precision, sampling, group, self.shards), donate_argnums=(4,),
                    in_shardings=(self.shardings.params, b, b, b, c), out_shardings=out)
        return self._programs[group]

    @property
    def program(self):
        """The static engine's program (`program_for(0)`)."""
        return self.program_for(0)

    def engine(self, rows: int, group: int = 1) -> tuple[int, int]:
        """(program group, decode slots) for `rows` rows of `group` samples per prompt: the static engine (0,
        rows), or the slot engine with `sampling.slots` slots (at most the rows; a multiple of the shards)."""
        slots = self.sampling.slots
        if slots == 0 and group == 1:
            return 0, rows
        slots = rows if slots == 0 else min(slots, rows)
        slots = max(self.shards, slots - slots % self.shards)
        return group, slots

    def new_cache(self, batch: int, slots: int) -> transformer.KVCache:
        cache = transformer.init_cache(self.cfg, batch, slots, self.precision.cache_dtype)
        if self.shardings is not None:
            sh = self.shardings.cache_dict
            cache = jax.device_put(cache, {name: tuple(sh[name] for _ in bufs) for name, bufs in cache.items()})
        return cache

    def sample_padded(self, params, prompt_UxP, prompt_mask_UxP, rand: RowRandomness, group: int = 1
                      ) -> SampleOutput:
        """Run the compiled program on an already padded batch of U prompts, `group` samples each (rand: R = U x
        group rows, row r samples prompt r // group); device arrays out, the cache reused."""
        U, P = prompt_UxP.shape
        rows = rand.uniforms_BxN.shape[0]
        if rows != U * group:
            raise ValueError(f"sample_padded: {rows} rows of randomness for {U} prompts x {group} samples each")
        program, slots = self.engine(rows, group)
        length = P + self.sampling.max_new_tokens
        cache = self._caches.pop((slots, length), None)
        if cache is None:
            cache = self.new_cache(slots, length)
        out = self.program_for(program)(params, prompt_UxP, prompt_mask_UxP, rand, cache)
        if self.keep_cache:
            self._caches[(slots, length)] = out.cache
        return out._replace(cache=None)

    def pad(self, prompts: Sequence[Sequence[int]], min_batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad to the (batch, prompt length) bucket; filler rows get a single token so none is empty."""
        min_p, b_pow2, p_pow2 = self._buckets
        B = bucket_size(max(len(prompts), min_batch), minimum=1, pow2_up_to=b_pow2)
        P = bucket_size(max(len(p) for p in prompts), minimum=min_p, pow2_up_to=p_pow2)
        toks = np.zeros((B, P), np.int32)
        mask = np.zeros((B, P), bool)
        mask[len(prompts):, -1] = True
        for i, p in enumerate(prompts):
            toks[i, P - len(p):] = p
            mask[i, P - len(p):] = True
        return toks, mask

    def generate(self, params, prompts: Sequence[Sequence[int]], *, seed: int | None = None,
                 first_index: int = 0, min_batch: int = 1, row_ids: Sequence[int] | None = None) -> SampleOutput:
        """Sample completions of token-id prompts; sequence i is seeded by (seed, first_index + i), or by (seed,
        row_ids[i]) when given. `min_batch` pads small batches up to a bucket already compiled. Returns a numpy
        `SampleOutput` with exactly len(prompts) rows."""
        check_prompts(prompts, self.cfg, self.sampling.max_new_tokens)
        toks, mask = self.pad(prompts, min_batch)
        seed = self.sampling.seed if seed is None else seed
        ids = first_index + np.arange(toks.shape[0])
        if row_ids is not None:
            ids[:len(row_ids)] = row_ids
        rand = row_randomness(seed, ids, self.sampling.max_new_tokens)
        if self.shardings is not None:
            toks, mask, rand = jax.device_put((toks, mask, rand), self.shardings.batch)
        out = self.sample_padded(params, toks, mask, rand)
        n = len(prompts)
        rows = (None if x is None else np.asarray(x)[:n] for x in out[:-2])
        return SampleOutput(*rows, cache=None, decode_iterations=int(out.decode_iterations))
