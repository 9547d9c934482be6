"""The rollout sampler's host facade: `Sampler` buckets the batch and prompt lengths (few distinct shapes), keeps a
donated KV-cache buffer per bucket, draws each sequence's randomness from (seed, sequence index) (a sequence's
sample does not depend on its batch-mates), and runs the engine `engines.choose_engine` picks.

The engines' programs take the params as traced arguments, so one compiled program serves every weight sync; it
compiles once per (model cfg, precision, sampling cfg, engine, shape bucket). The pieces, one job per module:
`config` (settings, output, randomness, placement), `token_choice` (temperature / top-k / top-p / greedy),
`decode` (prefill, pick, one decode step), `static` and `slots` (the two engines), `engines` (their interface
and the choice).

Per generated token the output holds the processed logprob (log-probability of the sampled token under the
distribution actually sampled from: after logit noise, temperature, top-k/top-p truncation and renormalization; 0
for greedy) and the unprocessed logprob (after noise and temperature only); optionally the full unprocessed
log-softmax [B, N, V] fp32, for the exact mismatch KL (see `jopd.lab.position_kl`), and for a mixture-of-experts
model each token's expert ids per sparse layer (`return_routing`: what routing replay and the flip rate read).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling.config import RowRandomness, SampleOutput, SamplerShardings, SamplingConfig, row_randomness
from jopd.sampling.engines import EngineChoice, bind, choose_engine
from jopd.sampling.partial import PartialOutput, carry_like, sample_partial
from jopd.sampling.precision import PrecisionConfig


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
    # the seed only enters through `row_randomness`; the slot count only through the cache shape; the mesh only
    # through the shardings
    return dataclasses.replace(sampling, seed=0, slots=0, samples_per_prompt=1, mesh=None)


@functools.lru_cache(maxsize=64)
def _compiled(cfg: ModelConfig, precision: PrecisionConfig, sampling: SamplingConfig, program: int = 0):
    """One jitted program per static setup, shared by all `Sampler`s (jit then caches per shape bucket)."""
    return jax.jit(bind(program, cfg, precision, sampling), donate_argnums=(4,))


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
        self._programs: dict[int | str, Any] = {}
        self.shards = 1  # batch shards: the slot engine refills a slot from its own shard's rows
        if shardings is not None:
            spec = shardings.batch.spec
            axes = spec[0] if len(spec) else None
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            self.shards = math.prod(shardings.batch.mesh.shape[a] for a in axes)

    def program_for(self, program: int = 0):
        """The jitted program of `EngineChoice.program` (0: the static engine; g > 0: the slot engine, g samples
        per prompt), with this sampler's shardings and the cache donated; e.g. `.lower(params, prompt, mask, rand,
        cache)` (`jopd.sizing.aot`)."""
        if program not in self._programs:
            precision, sampling = _program_precision(self.precision), _program_sampling(self.sampling)
            if self.shardings is None:
                self._programs[program] = _compiled(self.cfg, precision, sampling, program)
            else:
                b, c = self.shardings.batch, self.shardings.cache_dict
                out = SampleOutput(b, b, b, b, b, b if self.sampling.return_full_logprobs else None,
                                   b if self.sampling.return_topk else None,
                                   b if self.sampling.return_routing else None, c,
                                   NamedSharding(b.mesh, PartitionSpec()))
                self._programs[program] = jax.jit(
                    bind(program, self.cfg, precision, sampling, self.shards), donate_argnums=(4,),
                    in_shardings=(self.shardings.params, b, b, b, c), out_shardings=out)
        return self._programs[program]

    @property
    def program(self):
        """The static engine's program (`program_for(0)`)."""
        return self.program_for(0)

    def engine(self, rows: int, group: int = 1) -> EngineChoice:
        """(program, decode slots) for `rows` rows of `group` samples per prompt (`engines.choose_engine`): the
        static engine (0, rows), or the slot engine (group, `sampling.slots` at most the rows, a multiple of the
        shards)."""
        return choose_engine(rows, group, self.sampling, self.shards)

    def partial_program(self, reprefill_width: int | None = None):
        """The jitted partial-rollouts step (`partial.sample_partial`, one queue per batch shard, the cache donated)
        whose re-prefill runs over `reprefill_width` response columns: (params, prompt_RxP, mask_RxP, rand,
        row_id_R, cache, carry, version) -> `PartialOutput`; with shardings, the carry's rows split like the
        batch's."""
        key = f"partial_{reprefill_width}"
        if key not in self._programs:
            fn = functools.partial(sample_partial, cfg=self.cfg, precision=_program_precision(self.precision),
                                   sampling=_program_sampling(self.sampling), reprefill_width=reprefill_width,
                                   shards=self.shards)
            if self.shardings is None:
                self._programs[key] = jax.jit(fn, donate_argnums=(5,))
            else:
                b, c = self.shardings.batch, self.shardings.cache_dict
                one = NamedSharding(b.mesh, PartitionSpec())
                carry = carry_like(self.sampling, b)
                sample = SampleOutput(b, b, b, b, b, carry.full_SxNxV, carry.topk_SxNxK, None, c, one)
                self._programs[key] = jax.jit(
                    fn, donate_argnums=(5,), in_shardings=(self.shardings.params, b, b, b, b, c, carry, one),
                    out_shardings=PartialOutput(sample, b, b, b, b, carry, one, one))
        return self._programs[key]

    def take_cache(self, slots: int, length: int) -> transformer.KVCache:
        """The kept KV-cache buffer of `slots` rows x `length` (a new one if none is kept); hand it back with
        `return_cache` after a program that donated it."""
        cache = self._caches.pop((slots, length), None)
        return self.new_cache(slots, length) if cache is None else cache

    def return_cache(self, slots: int, length: int, cache: transformer.KVCache) -> None:
        if self.keep_cache:
            self._caches[(slots, length)] = cache

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
