"""Several teachers (`RunConfig.teachers`): which teacher scores which rows of a step, and how.

`routing` (resolved once into a static `Routing`):
- **task**: a row is scored by the teacher that lists its task. The data stream holds a fixed number of rows per
  task in every batch (`data.mix`), so each teacher's rows per batch shard are a static count: the host orders
  each shard's rows teacher by teacher (`shard_order`), and on the device each teacher runs its forward and its
  top-K on a static slice of every shard's rows (`routed_teacher_fields`), with no data moved between devices and
  no teacher run on rows it does not own. It needs each teacher's rows per step to split evenly over the batch
  shards (an error says which at build time).
- **mixture**: every teacher scores every row and the loss reads their mixture p(v) = sum_i w_i p_i(v) /
  sum_i w_i on the support (`teacher.mixture_scores`): T teacher forwards per row, by definition. One teacher
  with weight w gives back the teacher itself: the step then runs exactly the one-teacher computation.
- **one** (a teacher's name): that teacher scores every row; the others only serve the held-out eval.

With `loss.cross_tokenizer` (task or one; a mixture is refused), each teacher writes the cross kinds' fields for
its own rows (`routed_teacher_fields`' `cross`): a teacher with its own tokenizer by the cross path
(`cross_teacher_fields`, on its rows of the rollout's `CrossBatch`, aligned on the host to its pair by
`cross_teacher.align_routed`), a teacher of the student's vocabulary directly on the student's tokens, every token
its own span (`cross_teacher.same_vocab_fields`). So the loss reads one set of fields for every row.

The held-out eval measures each row's teacher divergence against its task's teacher (`Routing.eval_teacher`):
the teacher that lists the task, else what the run trains against (the mixture, or the one teacher), so runs with
different routings are compared on the same footing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jopd.data.mixture import batch_rows, task_sources
from jopd.losses import LossConfig
from jopd.models.config import ModelConfig
from jopd.opd.batch import SequenceLayout
from jopd.opd.cross_teacher import cross_teacher_fields, same_vocab_fields
from jopd.opd.run_config import RunConfig
from jopd.opd.teacher import mixture_scores, scored_hidden, teacher_fields


@dataclasses.dataclass(frozen=True)
class Routing:
    """The resolved `routing` of a run with several teachers (static: a jit partial argument)."""

    mode: str  # "task" | "mixture" | "one"
    names: tuple[str, ...]  # the teachers, in `teachers` order
    tasks: tuple[str, ...]  # the run's tasks, in data order (a row's `task_id` indexes them)
    owner: tuple[int | None, ...]  # per task: the teacher that lists it (None: none does)
    log_weights: tuple[float, ...]  # mixture: log of each teacher's normalized weight
    scorer: int = 0  # one: the teacher that scores every row
    shard_rows: tuple[int, ...] = ()  # task: each teacher's rows in one batch shard (G samples included)
    shards: int = 1  # batch shards of the step (task: the slices are per shard)

    def eval_teacher(self, task_id: int) -> int | None:
        """The teacher a held-out row of task `task_id` is measured against (None: the mixture)."""
        owner = self.owner[task_id]
        if owner is not None:
            return owner
        return self.scorer if self.mode == "one" else None


def resolve_routing(cfg: RunConfig, rollouts_per_prompt: int, shards: int) -> Routing | None:
    """The run's routing (None: one teacher, today's step). Errors name the config fields."""
    if not cfg.teachers:
        return None
    names = tuple(t.name for t in cfg.teachers)
    sources = task_sources(cfg.data)
    tasks = tuple(s.name for s in sources)
    owner = tuple(next((i for i, t in enumerate(cfg.teachers) if task in t.tasks), None) for task in tasks)
    total = sum(t.weight for t in cfg.teachers)
    log_w = tuple(math.log(t.weight / total) for t in cfg.teachers)
    mode = cfg.routing if cfg.routing in ("task", "mixture") else "one"
    scorer = names.index(cfg.routing) if mode == "one" else 0
    shard_rows: tuple[int, ...] = ()
    if mode == "task":
        rows = batch_rows(sources, cfg.data.batch_size) if len(sources) > 1 else (cfg.data.batch_size,)
        per_teacher = [sum(r for r, o in zip(rows, owner) if o == i) * rollouts_per_prompt for i in range(len(names))]
        for name, n in zip(names, per_teacher):
            if n % shards:
                raise ValueError(f"RunConfig.routing=task: teacher {name!r} scores {n} rows per step, which do not "
                                 f"split over the {shards} batch shards (data.batch_size, data.mix): each shard "
                                 f"runs every teacher on an equal share of its rows")
        shard_rows = tuple(n // shards for n in per_teacher)
    return Routing(mode=mode, names=names, tasks=tasks, owner=owner, log_weights=log_w, scorer=scorer,
                   shard_rows=shard_rows, shards=shards)


def shard_order(task_id_U: np.ndarray, routing: Routing, shards: int) -> np.ndarray:
    """A permutation of one process's prompt rows (routing=task) such that each of its `shards` equal blocks of
    consecutive rows holds teacher 0's share, then teacher 1's, ...: a teacher's rows are then the same static
    slice of every shard (`routed_teacher_fields`). Within a teacher the rows keep their order."""
    teacher_U = np.asarray([routing.owner[t] for t in task_id_U])
    per_teacher = [np.flatnonzero(teacher_U == i) for i in range(len(routing.names))]
    for name, rows in zip(routing.names, per_teacher):
        if len(rows) % shards:
            raise ValueError(f"routing=task: teacher {name!r} has {len(rows)} rows in this batch, which do not split "
                             f"over its {shards} shards")
    return np.concatenate([rows.reshape(shards, -1)[s] for s in range(shards) for rows in per_teacher])


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


@dataclasses.dataclass(frozen=True)
class CrossRows:
    """What the teachers of a `loss.cross_tokenizer` run read besides the student's rows: the rollout's
    `CrossBatch` (the rows of the teachers with another tokenizer, aligned to each), each teacher's projection
    table (None: a teacher of the student's vocabulary, `same_vocab_fields`), and which rows ended their turn."""

    batch: Any  # `cross_teacher.CrossBatch` or None (no teacher with another tokenizer)
    tables: tuple[Any, ...]  # per teacher: its `crosstok.ProjectionTable`, or None
    done_B: jax.Array


def row_teachers(task_id_B: np.ndarray, routing: Routing) -> np.ndarray:
    """The teacher that scores each row (host): its task's under routing=task, the named one under one."""
    if routing.mode == "one":
        return np.full(len(task_id_B), routing.scorer)
    return np.asarray([routing.owner[t] for t in task_id_B])


def routed_teacher_fields(teacher_params: tuple[Any, ...], layout: SequenceLayout, *,
                          teacher_cfgs: tuple[ModelConfig, ...], routing: Routing, loss_cfg: LossConfig,
                          student_topk_ids_BxNxK=None, plan=None, cross: CrossRows | None = None
                          ) -> dict[str, jax.Array]:
    """`teacher.teacher_fields` of a step with several teachers (see the module docstring). `plan` (packed
    sequences) only with routing to one teacher. `cross` (`loss.cross_tokenizer`): each teacher writes the cross
    kinds' fields for its rows, by the cross path or, sharing the student's vocabulary, directly."""
    def fields(i, layout, topk, rows):  # teacher i on `rows` (a function of each [B, ...] input: its slice)
        if cross is None:
            return teacher_fields(teacher_params[i], layout, teacher_cfg=teacher_cfgs[i], loss_cfg=loss_cfg,
                                  student_topk_ids_BxNxK=topk, plan=plan)
        if cross.tables[i] is None:
            return same_vocab_fields(teacher_params[i], layout, topk, rows(cross.done_B), teacher_cfg=teacher_cfgs[i],
                                     mode=loss_cfg.cross_tokenizer, temperature=loss_cfg.temperature,
                                     chunk=loss_cfg.chunk_size)
        return cross_teacher_fields(teacher_params[i], jax.tree.map(rows, cross.batch), topk,
                                    teacher_cfg=teacher_cfgs[i], table=cross.tables[i], mode=loss_cfg.cross_tokenizer,
                                    temperature=loss_cfg.temperature, chunk=loss_cfg.chunk_size)

    if routing.mode == "one" or len(teacher_params) == 1:  # one teacher scores every row: the one-teacher step
        i = routing.scorer if routing.mode == "one" else 0
        return fields(i, layout, student_topk_ids_BxNxK, lambda x: x)
    if routing.mode == "mixture":
        return _mixture_fields(teacher_params, layout, teacher_cfgs=teacher_cfgs, log_weights=routing.log_weights,
                               loss_cfg=loss_cfg, student_topk_ids_BxNxK=student_topk_ids_BxNxK)
    S, outs, lo = routing.shards, [], 0
    for i, n in enumerate(routing.shard_rows):
        mine = lambda x, lo=lo, n=n: None if x is None else _shard_slice(x, S, lo, lo + n)  # noqa: E731
        outs.append(fields(i, SequenceLayout(*map(mine, layout)), mine(student_topk_ids_BxNxK), mine))
        lo += n
    return {k: _shard_concat([o[k] for o in outs], S) for k in outs[0]}


def _mixture_fields(teacher_params, layout: SequenceLayout, *, teacher_cfgs, log_weights, loss_cfg: LossConfig,
                    student_topk_ids_BxNxK=None) -> dict[str, jax.Array]:
    from jopd.opd.teacher import support_extra_ids

    hiddens = tuple(scored_hidden(p, c, layout, None) for p, c in zip(teacher_params, teacher_cfgs))
    return mixture_scores(hiddens, tuple(teacher_params), log_weights,
                          k=min(loss_cfg.top_k, teacher_cfgs[0].vocab_size), chunk=loss_cfg.chunk_size,
                          targets_BxT=layout.targets_BxN, temperature=loss_cfg.temperature,
                          extra_ids_BxTxE=support_extra_ids(layout, student_topk_ids_BxNxK, loss_cfg))
