"""What the rollout engines share: the sampling settings, the output, each row's randomness and the placement.

Every other sampling module imports these; this one imports none of them (no circle between the engines and the
facade).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from jaxtyping import Array, Bool, Float, Int

from jopd.config_dataclass import config_dataclass
from jopd.models.config import ModelConfig
from jopd.parallel.mesh import MeshConfig


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
    # also return each token's expert ids in every sparse layer (`SampleOutput.expert_ids_BxSxLsxk`; a
    # mixture-of-experts model: the OPD step sets it for such a student)
    return_routing: bool = False
    # Decode slots of the slot engine (`jopd.sampling.slots`): a finished row's slot takes the next pending row
    # at once; 0: the static engine (every row of a batch decodes until the longest stops). Same samples.
    slots: Annotated[int, pydantic.Field(ge=0)] = 0
    # Rollouts per prompt for OPD (GRPO's are `rl.group_size`): a prompt is prefilled once and its samples
    # start from copies of its KV cache (the slot engine); `data.batch_size` counts prompts.
    samples_per_prompt: Annotated[int, pydantic.Field(ge=1)] = 1
    # Speed knob, same results: the top-p cut bisects until at most this many tokens sit at the boundary,
    # then ranks those exactly (no sort of the vocabulary; see `nucleus_threshold`).
    top_p_candidates: Annotated[int, pydantic.Field(gt=0)] = 128
    # The OPD step's sampler layout: a mesh over the trainer's devices (e.g. {data: -1, tensor: 4}), the rollout
    # weights split over its `tensor` axis and the rows over data x fsdp (`opd.shardings.sampler_mesh`); None: the
    # trainer's mesh (`mesh:`). Not part of the compiled program (its shardings are).
    mesh: MeshConfig | None = None


class SampleOutput(NamedTuple):
    """Rollouts of one batch. Response slot t of row b is real iff t < lengths_B[b] (`response_mask`)."""

    tokens_BxN: Int[Array, "B N"]  # response token ids; pad id after the end
    lengths_B: Int[Array, "B"]  # number of response tokens, stop token included
    logprobs_BxN: Float[Array, "B N"]  # processed logprobs of the sampled tokens (0 after the end)
    unprocessed_logprobs_BxN: Float[Array, "B N"]  # temperature (and noise) only (0 after the end)
    done_B: Bool[Array, "B"]  # the row ended with a stop token (False: it hit max_new_tokens)
    full_logprobs_BxNxV: Float[Array, "B N V"] | None = None  # unprocessed log-softmax, if requested
    topk_ids_BxNxK: Int[Array, "B N K"] | None = None  # the (noisy) logits' top-k ids per step, if requested
    # with `return_routing`: the expert ids each token was routed to in every sparse layer (Ls of them, k each, in
    # the router's order), in the scored sequence layout S = P + N (prompt slot j, then response token t at P + t);
    # -1 where the engine routed nothing the trainer reads: prompt padding, and a row's last response token and
    # after (never fed back). `routing_dtype` of the model.
    expert_ids_BxSxLsxk: Int[Array, "B S Ls k"] | None = None
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


def routing_dtype(cfg: ModelConfig):
    """The dtype `SampleOutput.expert_ids_BxSxLsxk` is kept in: int16 (half of int32's bytes) while the expert ids
    and the -1 fit."""
    return jnp.int16 if cfg.num_experts < 2**15 else jnp.int32


def routing_buffer(cfg: ModelConfig, rows: int, length: int) -> jax.Array:
    """An empty recording of `rows` rows of `length` positions: -1 everywhere ([rows, length, Ls, k])."""
    shape = (rows, length, len(cfg.sparse_layers), cfg.num_experts_per_tok)
    if not cfg.sparse_layers:
        raise ValueError("sampling.return_routing: the model has no sparse (mixture-of-experts) layer to record")
    return jnp.full(shape, -1, routing_dtype(cfg))


def stop_and_pad_ids(cfg: ModelConfig, sampling: SamplingConfig) -> tuple[jax.Array, int]:
    """The ids that end a row (the model's EOS ids and `stop_token_ids`) and the id written after its end."""
    stop_ids = jnp.asarray(sorted(set(cfg.eos_ids) | set(sampling.stop_token_ids)) or [-1], jnp.int32)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_ids or (0,))[0]
    return stop_ids, pad_id
