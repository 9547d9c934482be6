"""The scoring stage of the OPD step (`OPDStep.score_fn`): a rollout -> the train step's `TrainBatch`, every
teacher on the rows its `Routing` gives it (one teacher is a routing of one: the same code).

Each teacher scores by what it shares with the student: the student's tokenizer (`teacher_scoring.teacher_fields`,
top-K of its full softmax), another tokenizer (`cross_teacher.cross_teacher_fields`, on its own tokenization of
the rollout), or, in a cross-tokenizer run, the student's vocabulary (`cross_teacher.same_vocab_fields`, the
cross kinds' fields with every token its own span). Which rows a teacher scores is the routing's
(`opd.routing`): every row (`Routing.sole_scorer`), a static slice of every batch shard (task), or every row
for a mixture (`teacher_scoring.mixture_scores`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jopd.losses import LossBatch, LossConfig
from jopd.models.config import ModelConfig
from jopd.opd.batch import RolloutArrays, SequenceLayout, TrainBatch, sequence_layout
from jopd.opd.cross_teacher import cross_teacher_fields, same_vocab_fields
from jopd.opd.packing import PackPlan, pack_tokens
from jopd.opd.routing import Routing
from jopd.opd.teacher_scoring import (mixture_scores, reference_logprobs, scored_hidden, support_extra_ids,
                                      teacher_fields)


@dataclasses.dataclass(frozen=True)
class CrossRows:
    """What the teachers of a `loss.cross_tokenizer` run read besides the student's rows: the rollout's
    `CrossBatch` (the rows of the teachers with another tokenizer, aligned to each), each teacher's projection
    table (None: a teacher of the student's vocabulary, `same_vocab_fields`), and which rows ended their turn."""

    batch: Any  # `cross_teacher.CrossBatch` or None (no teacher with another tokenizer)
    tables: tuple[Any, ...]  # per teacher: its `crosstok.ProjectionTable`, or None
    done_B: jax.Array


def _shard_slice(x: jax.Array, shards: int, lo: int, hi: int) -> jax.Array:
    """Rows [lo, hi) of every shard's block of a [B, ...] array sharded over its rows -> [shards * (hi - lo), ...]
    (each shard keeps its own rows: a local slice)."""
    blocks = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
    return blocks[:, lo:hi].reshape(shards * (hi - lo), *x.shape[1:])


def _shard_concat(parts: Sequence[jax.Array], shards: int) -> jax.Array:
    """The inverse: per-teacher [shards * r_i, ...] arrays -> [B, ...], every shard's rows teacher by teacher."""
    blocks = [p.reshape(shards, p.shape[0] // shards, *p.shape[1:]) for p in parts]
    out = jnp.concatenate(blocks, axis=1)
    return out.reshape(out.shape[0] * out.shape[1], *out.shape[2:])


def routed_teacher_fields(teacher_params: tuple[Any, ...], layout: SequenceLayout, *,
                          teacher_cfgs: tuple[ModelConfig, ...], routing: Routing, loss_cfg: LossConfig,
                          student_topk_ids_BxNxK=None, plan: PackPlan | None = None, cross: CrossRows,
                          dtype=jnp.float32) -> dict[str, jax.Array]:
    """The teachers' `LossBatch` fields (no gradient), each teacher on the rows `routing` gives it (see the module
    docstring). `plan` (packed sequences) only when one teacher scores every row. `cross` (read only with
    `loss.cross_tokenizer`): each teacher writes the cross kinds' fields for its rows, by the cross path or,
    sharing the student's vocabulary, directly. `dtype`: the teachers' compute dtype (`train.compute_dtype`)."""
    def fields(i, layout, topk, rows):  # teacher i on `rows` (a function of each [B, ...] input: its slice)
        if loss_cfg.cross_tokenizer == "off":
            return teacher_fields(teacher_params[i], layout, teacher_cfg=teacher_cfgs[i], loss_cfg=loss_cfg,
                                  student_topk_ids_BxNxK=topk, plan=plan, dtype=dtype)
        if cross.tables[i] is None:
            return same_vocab_fields(teacher_params[i], layout, topk, rows(cross.done_B), teacher_cfg=teacher_cfgs[i],
                                     mode=loss_cfg.cross_tokenizer, temperature=loss_cfg.temperature,
                                     chunk=loss_cfg.chunk_size, dtype=dtype)
        return cross_teacher_fields(teacher_params[i], jax.tree.map(rows, cross.batch), topk,
                                    teacher_cfg=teacher_cfgs[i], table=cross.tables[i], mode=loss_cfg.cross_tokenizer,
                                    temperature=loss_cfg.temperature, chunk=loss_cfg.chunk_size, dtype=dtype)

    if routing.sole_scorer is not None:  # one teacher scores every row: exactly its computation
        return fields(routing.sole_scorer, layout, student_topk_ids_BxNxK, lambda x: x)
    if routing.mode == "mixture":
        return _mixture_fields(teacher_params, layout, teacher_cfgs=teacher_cfgs, log_weights=routing.log_weights,
                               loss_cfg=loss_cfg, student_topk_ids_BxNxK=student_topk_ids_BxNxK, dtype=dtype)
    S, outs, lo = routing.shards, [], 0
    for i, n in enumerate(routing.shard_rows):
        mine = lambda x, lo=lo, n=n: None if x is None else _shard_slice(x, S, lo, lo + n)  # noqa: E731
        outs.append(fields(i, SequenceLayout(*map(mine, layout)), mine(student_topk_ids_BxNxK), mine))
        lo += n
    return {k: _shard_concat([o[k] for o in outs], S) for k in outs[0]}


def _mixture_fields(teacher_params, layout: SequenceLayout, *, teacher_cfgs, log_weights, loss_cfg: LossConfig,
                    student_topk_ids_BxNxK=None, dtype=jnp.float32) -> dict[str, jax.Array]:
    hiddens = tuple(scored_hidden(p, c, layout, None, dtype=dtype) for p, c in zip(teacher_params, teacher_cfgs))
    return mixture_scores(hiddens, tuple(teacher_params), log_weights,
                          k=min(loss_cfg.top_k, teacher_cfgs[0].vocab_size), chunk=loss_cfg.chunk_size,
                          targets_BxT=layout.targets_BxN, temperature=loss_cfg.temperature,
                          extra_ids_BxTxE=support_extra_ids(layout, student_topk_ids_BxNxK, loss_cfg), dtype=dtype)


def score_rollout(teacher_params: tuple[Any, ...], rollout: RolloutArrays, reference_params=None, *,
                  teacher_cfgs: tuple[ModelConfig, ...], student_cfg: ModelConfig, loss_cfg: LossConfig,
                  is_logprobs: str, dtype, routing: Routing, cross_tables: tuple[Any, ...],
                  teacher_dtype=jnp.float32, routing_replay: bool = False) -> TrainBatch:
    """The scoring stage (`OPDStep.score_fn`): a rollout -> the train step's `TrainBatch` (the student's input and
    the response-aligned loss fields: the teachers', the sampler's log-probs, advantages, the reference's).
    `teacher_params`, `teacher_cfgs`, `cross_tables` (each teacher's projection table; None for a teacher of the
    student's vocabulary) hold one entry per teacher. With `rollout.plan` (`train.pack`), the sequences are
    packed: the student's input is the packed rows. `dtype`: the student's compute dtype (the reference's scoring),
    `teacher_dtype` the teachers' (`opd.resolve`). A mixture-of-experts student's rollout carries the sampler's
    routing to the update (`TrainBatch.sampler_experts_BxSxLsxk`), every row marked for replay with
    `routing_replay`."""
    sample, plan = rollout.sample, rollout.plan
    layout = sequence_layout(rollout.prompt_BxP, rollout.prompt_mask_BxP, sample.tokens_BxN, sample.lengths_B)
    teacher = routed_teacher_fields(teacher_params, layout, teacher_cfgs=teacher_cfgs, routing=routing,
                                    loss_cfg=loss_cfg, student_topk_ids_BxNxK=sample.topk_ids_BxNxK, plan=plan,
                                    cross=CrossRows(rollout.cross, cross_tables, sample.done_B), dtype=teacher_dtype)
    # `train.is_logprobs` picks the sampler's log-probs that IS weights and GRPO's ratio divide by; the default,
    # unprocessed (temperature and noise, before top-p/top-k renormalization), is the same function of the
    # logits as the trainer's log-prob, so the ratio measures the engines' mismatch only (1 when they agree)
    is_lp = sample.unprocessed_logprobs_BxN if is_logprobs == "unprocessed" else sample.logprobs_BxN
    advantages = None
    if rollout.advantages_B is not None:
        advantages = jnp.broadcast_to(rollout.advantages_B[:, None], layout.targets_BxN.shape).astype(jnp.float32)
    reference = None
    if reference_params is not None:
        reference = reference_logprobs(reference_params, layout, model_cfg=student_cfg, loss_cfg=loss_cfg, dtype=dtype,
                                       plan=plan)
    task = None if rollout.task_B is None else jnp.broadcast_to(rollout.task_B[:, None], layout.targets_BxN.shape)
    loss = LossBatch(targets_BxT=layout.targets_BxN, response_mask_BxT=layout.response_mask_BxN, task_BxT=task,
                     sampler_logprobs_BxT=is_lp, sampler_full_logprobs_BxTxV=sample.full_logprobs_BxNxV,
                     advantages_BxT=advantages, reference_logprobs_BxT=reference,
                     compact=None if plan is None else plan.compact, **teacher)
    # a MoE student's recorded routing (padded layout, packed in the update) and the rows that replay it
    experts = sample.expert_ids_BxSxLsxk
    recorded = dict(sampler_experts_BxSxLsxk=experts,
                    replay_B=None if experts is None else jnp.full(experts.shape[:1], routing_replay))
    if plan is None:
        return TrainBatch(tokens_BxS=layout.tokens_BxS, attn_mask_BxS=layout.attn_mask_BxS, loss=loss, **recorded)
    return TrainBatch(tokens_BxS=pack_tokens(layout.tokens_BxS, plan), attn_mask_BxS=plan.segment_BpxC > 0,
                      loss=loss, plan=plan, **recorded)
