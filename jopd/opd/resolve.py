"""What the step takes from the run's config beyond its fields: the loss config resolved against the run (masks
from the tokenizer, the sampler's temperature, the run's tasks), the rollouts per prompt, and the seeds of the
sampler's per-row draws and of the weight noise (pure functions of (seed, step): what makes a resumed run
bit-identical), and the compute dtypes of the update and the scoring (`train.compute_dtype`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from jopd.data.mixture import task_sources
from jopd.losses import LossConfig
from jopd.losses.kinds import OBJECTIVES
from jopd.models.dtypes import DTYPES
from jopd.opd import validate

if TYPE_CHECKING:  # the run's config is the layer above the step (jopd.run): annotations only
    from jopd.run.config import RunConfig


def rollout_seed(train_seed: int) -> int:
    """Seed of the sampler's per-row draws (`row_randomness`): a function of `train.seed` only, kept apart
    from every other stream that seed feeds (model init, weight noise)."""
    return train_seed * 1_000_003 + 7


def weight_sync_key(rng: jax.Array, step: int | jax.Array) -> jax.Array:
    """Key of step n's weight noise (`rollout_precision.weight_noise`, drawn once per weight sync)."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), 1)


def rollouts_per_prompt(cfg: RunConfig) -> int:
    """G, the rollouts of each prompt per step: GRPO's `rl.group_size`, else `sampling.samples_per_prompt` (the two
    agree: `validate.check_run`)."""
    if OBJECTIVES[cfg.loss.kind].grouped:
        return cfg.rl.group_size
    return cfg.sampling.samples_per_prompt


def student_compute_dtype(cfg: RunConfig):
    """The dtype of the student's matmuls in the update, and so of the exact mismatch, measured on the update's own
    logits, and of the frozen reference's scoring: `train.compute_dtype`, or bf16 for a bf16 student
    (`student.dtype: bf16`: its params, and so its matmuls, are bf16 whatever `train.compute_dtype` says)."""
    return DTYPES["bf16" if "bf16" in (cfg.student.dtype, cfg.train.compute_dtype) else "fp32"]


def teacher_compute_dtype(cfg: RunConfig):
    """The dtype of every teacher's scoring matmuls: `train.compute_dtype`, whatever a teacher is stored in (a
    bf16-stored teacher under fp32 compute is upcast layer by layer, an fp32 one under bf16 cast down)."""
    return DTYPES[cfg.train.compute_dtype]


def resolve_loss_config(cfg: RunConfig, tokenizer) -> LossConfig:
    """Fill run-dependent loss fields: the masked target tokens (`train.mask`, from the tokenizer; EOS is always
    trained, so the student keeps learning when to stop), the sampler's temperature (the loss compares
    distributions at it), and the run's tasks when it mixes several (per-task metrics). A cross-tokenizer kind's
    support is the projected one (the student's top-K ids, K of them): `loss.support` does not apply to it."""
    from jopd.data.toy_tokenizer import special_token_ids

    validate.check_tokenizer(cfg, tokenizer)
    special, template = cfg.loss.special_token_ids, cfg.loss.template_token_ids
    if tokenizer is not None and not special and cfg.train.mask == "all_special":
        special = tuple(sorted(set(special_token_ids(tokenizer)) - {tokenizer.eos_token_id}))
    if tokenizer is not None and not template and cfg.train.mask == "template_first" and cfg.train.template_tokens:
        vocab = tokenizer.get_vocab()
        template = tuple(sorted({vocab[t] for t in cfg.train.template_tokens} - {tokenizer.eos_token_id}))
    tasks = tuple(s.name for s in task_sources(cfg.data))
    loss = dataclasses.replace(cfg.loss, special_token_ids=special, template_token_ids=template,
                               temperature=cfg.sampling.temperature, task_names=tasks if len(tasks) > 1 else ())
    if loss.cross_tokenizer != "off":
        loss = dataclasses.replace(loss, support="teacher_topk", support_sampled=False)
    return loss
