"""From a sampled batch to the trainer's loss batch: sequence layout, teacher scores, sampler log-probs.

Layout: the left-padded prompt [B, P] followed by the response [B, N] gives `tokens`/`attn_mask` [B, P+N];
every loss entry is response-aligned [B, N, ...] (slot t describes response token t, predicted from the
hidden state at sequence position P+t-1), which is what `objectives.rollout_loss_fn` expects.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.losses import LossConfig, teacher_scores
from jopd.models.config import ModelConfig
from jopd.objectives import response_hidden


def sequence_layout(prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"], tokens_BxN: Int[Array, "B N"],
                    lengths_B: Int[Array, "B"]) -> dict[str, jax.Array]:
    """tokens/attn_mask over prompt+response, and the response mask (slots before each row's length)."""
    N = tokens_BxN.shape[1]
    response_mask = jnp.arange(N)[None, :] < lengths_B[:, None]
    return {
        "tokens": jnp.concatenate([prompt_BxP, tokens_BxN], axis=1).astype(jnp.int32),
        "attn_mask": jnp.concatenate([prompt_mask_BxP.astype(bool), response_mask], axis=1),
        "targets": tokens_BxN.astype(jnp.int32),
        "response_mask": response_mask,
    }


@functools.partial(jax.jit, static_argnames=("teacher_cfg", "loss_cfg", "full_teacher_logits"))
def score_with_teacher(teacher_params, layout: dict[str, jax.Array], *, teacher_cfg: ModelConfig,
                       loss_cfg: LossConfig, full_teacher_logits: bool = False) -> dict[str, jax.Array]:
    """Teacher forward outside any gradient: top-K ids + log-probs (chunked, no [B,N,V] kept) and the
    teacher's log-prob of every sampled token. `full_teacher_logits` (rkl/fkl/jsd comparison losses) also
    returns the teacher's full logits [B, N, V]."""
    N = layout["targets"].shape[1]
    hidden = response_hidden(teacher_params, teacher_cfg, layout["tokens"], layout["attn_mask"], N)
    out = teacher_scores(hidden, teacher_params, k=min(loss_cfg.top_k, teacher_cfg.vocab_size),
                         chunk=loss_cfg.chunk_size, targets_BxT=layout["targets"],
                         temperature=loss_cfg.temperature)
    if full_teacher_logits:
        from jopd.models.transformer import logits_from_hidden
        out["teacher_logits"] = logits_from_hidden(teacher_params, hidden)
    return out


def loss_batch(layout: dict[str, jax.Array], teacher: dict[str, jax.Array], *,
               sampler_logprobs_BxN: Float[Array, "B N"] | None = None,
               sampler_full_logprobs_BxNxV: Float[Array, "B N V"] | None = None) -> dict[str, jax.Array]:
    """Everything `objectives.rollout_loss_fn` reads, in one dict (a jit argument of the train step)."""
    batch = dict(layout) | teacher
    if sampler_logprobs_BxN is not None:
        batch["sampler_logprobs"] = sampler_logprobs_BxN
    if sampler_full_logprobs_BxNxV is not None:
        batch["sampler_full_logprobs"] = sampler_full_logprobs_BxNxV
    return batch


IsLogprobs = Literal["unprocessed", "processed"]
