"""Which teacher scores which rows of a step (`Routing`, resolved once from the config; static, a jit partial
argument), and the host side of it. Every run has one: a run with one `teacher` is a routing of one (to it), so
the step, the scoring (`opd.scoring`) and the held-out eval run the same code for one teacher and for several.

`routing` (with `RunConfig.teachers`):
- **task**: a row is scored by the teacher that lists its task. The data stream holds a fixed number of rows per
  task in every batch (`data.mix`), so each teacher's rows per batch shard are a static count: the host orders
  each shard's rows teacher by teacher (`shard_order`), and on the device each teacher runs its forward and its
  top-K on a static slice of every shard's rows (`scoring.routed_teacher_fields`), with no data moved between
  devices and no teacher run on rows it does not own. It needs each teacher's rows per step to split evenly over
  the batch shards (an error says which at build time).
- **mixture**: every teacher scores every row and the loss reads their mixture p(v) = sum_i w_i p_i(v) /
  sum_i w_i on the support (`teacher_scoring.mixture_scores`): T teacher forwards per row, by definition.
- **one** (a teacher's name; the run's one `teacher`): that teacher scores every row; the others only serve the
  held-out eval.
A routing whose rows all go to one teacher (`Routing.sole_scorer`: to one, or a single teacher under task or
mixture) runs exactly that teacher's computation.

With `loss.cross_tokenizer` (task or one; a mixture is refused), each teacher writes the cross kinds' fields for
its own rows: a teacher with its own tokenizer by the cross path (`cross_teacher_fields`, on its rows of the
rollout's `CrossBatch`, aligned on the host to its pair by `cross_teacher.align_routed` with `row_teachers`), a
teacher of the student's vocabulary among several directly on the student's tokens, every token its own span
(`cross_teacher.same_vocab_fields`). So the loss reads one set of fields for every row.

The held-out eval measures each row's teacher divergence against its task's teacher (`Routing.eval_teacher`):
the teacher that lists the task, else what the run trains against (the mixture, or the one teacher), so runs with
different routings are compared on the same footing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from jopd.data.mixture import batch_rows, task_sources

if TYPE_CHECKING:  # the run's config is the layer above the step (jopd.run): annotations only
    from jopd.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Routing:
    """The resolved `routing` of a run (static: a jit partial argument); one teacher is a routing of one."""

    mode: str  # "task" | "mixture" | "one"
    names: tuple[str, ...]  # the teachers, in `teacher_sources` order
    tasks: tuple[str, ...]  # the run's tasks, in data order (a row's `task_id` indexes them)
    owner: tuple[int | None, ...]  # per task: the teacher that lists it (None: none does)
    log_weights: tuple[float, ...]  # mixture: log of each teacher's normalized weight
    scorer: int = 0  # one: the teacher that scores every row
    shard_rows: tuple[int, ...] = ()  # task: each teacher's rows in one batch shard (G samples included)
    shards: int = 1  # batch shards of the step (task: the slices are per shard)

    @property
    def sole_scorer(self) -> int | None:
        """The teacher that scores every row (routed to one, or the only teacher), else None."""
        if self.mode == "one":
            return self.scorer
        return 0 if len(self.names) == 1 else None

    @classmethod
    def one(cls, name: str, tasks: tuple[str, ...]) -> "Routing":
        """A routing of one teacher, `name`, that scores every row of `tasks` (e.g. a model measured alone)."""
        return cls(mode="one", names=(name,), tasks=tasks, owner=(None,) * len(tasks), log_weights=(0.0,))

    def eval_teacher(self, task_id: int) -> int | None:
        """The teacher a held-out row of task `task_id` is measured against (None: the mixture)."""
        owner = self.owner[task_id]
        if owner is not None:
            return owner
        return self.scorer if self.mode == "one" else None


def resolve_routing(cfg: RunConfig, rollouts_per_prompt: int, shards: int) -> Routing:
    """The run's routing (`RunConfig.scoring_routing`: the one `teacher` is routed to). Errors name the config
    fields."""
    sources = cfg.teacher_sources()
    names = tuple(t.name for t in sources)
    data = task_sources(cfg.data)
    tasks = tuple(s.name for s in data)
    owner = tuple(next((i for i, t in enumerate(sources) if task in t.tasks), None) for task in tasks)
    total = sum(t.weight for t in sources)
    log_w = tuple(math.log(t.weight / total) for t in sources)
    routing = cfg.scoring_routing
    mode = routing if routing in ("task", "mixture") else "one"
    scorer = names.index(routing) if mode == "one" else 0
    shard_rows: tuple[int, ...] = ()
    if mode == "task":
        rows = batch_rows(data, cfg.data.batch_size) if len(data) > 1 else (cfg.data.batch_size,)
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


def row_teachers(task_id_B: np.ndarray, routing: Routing) -> np.ndarray:
    """The teacher that scores each row (host): its task's under routing=task, the one that scores every row
    otherwise (`Routing.sole_scorer`)."""
    if routing.sole_scorer is not None:
        return np.full(len(task_id_B), routing.sole_scorer)
    return np.asarray([routing.owner[t] for t in task_id_B])
