"""Several tasks in one stream (`data.mix`): which task sources a run draws from, and each one's share of a batch.

A source is a registered task (`jopd.data.tasks`), or a label of the JSONL files' optional `task` field (the
problems of `data.train_path` / `data.heldout_path` whose `task` is that label, graded like task=jsonl). Every
batch holds a fixed number of each source's prompts, batch_size * weight / sum(weights) (it must be whole), so a
step always has the same rows per task: several teachers can then each score their own rows with static shapes
(`opd.routing`). Without `data.mix` the run has one source, `data.task`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jopd.data.problem import Problem
from jopd.data.tasks import TASKS, Split, Task

if TYPE_CHECKING:
    from jopd.data.pipeline import DataConfig


@dataclasses.dataclass(frozen=True)
class TaskSource:
    name: str  # the rows' task label: a registered task's name, or a JSONL `task` label
    task: Task  # its entry: prompts, answer check, reward, step checker (the jsonl entry for a JSONL label)
    weight: float = 1.0
    label: str | None = None  # a JSONL label: only the files' problems with this `task` value

    def problems(self, cfg: "DataConfig", split: Split) -> Sequence[Problem]:
        problems = self.task.problems(cfg, split)
        if self.label is None:
            return problems
        mine = [p for p in problems if p.task == self.label]
        if not mine:
            path = cfg.train_path if split == "train" else cfg.heldout_path
            raise ValueError(f"DataConfig.mix: {self.label!r} is neither a registered task ({', '.join(TASKS.names())})"
                             f" nor a `task` label of {path}")
        return mine


def task_sources(cfg: "DataConfig") -> tuple[TaskSource, ...]:
    """The run's task sources, in `data.mix`'s order (or `data.task` alone)."""
    if not cfg.mix:
        return (TaskSource(cfg.task, TASKS[cfg.task]),)
    out = []
    for name, weight in cfg.mix.items():
        if name in TASKS.names():
            out.append(TaskSource(name, TASKS[name], float(weight)))
        else:  # a label of the JSONL files' problems
            out.append(TaskSource(name, TASKS["jsonl"], float(weight), label=name))
    return tuple(out)


def batch_rows(sources: Sequence[TaskSource], batch_size: int, field: str = "batch_size") -> tuple[int, ...]:
    """Each source's rows in a batch of `batch_size`: its weight's share, which must be a whole number."""
    total = sum(s.weight for s in sources)
    rows = []
    for s in sources:
        exact = batch_size * s.weight / total
        if abs(exact - round(exact)) > 1e-9 or round(exact) < 1:
            shares = ", ".join(f"{t.name}: {batch_size * t.weight / total:g}" for t in sources)
            raise ValueError(f"mix: {field}={batch_size} does not split into whole rows per task "
                             f"({shares}); choose weights and {field} so each share is a whole number >= 1")
        rows.append(int(round(exact)))
    return tuple(rows)


def source_index(sources: Sequence[TaskSource]) -> dict[str, int]:
    """Task label -> its position in the run's sources (a row's `task_id`)."""
    return {s.name: i for i, s in enumerate(sources)}


def cache_key(cfg: "DataConfig"):
    """What identifies the stream's data in the cache key of SFT-made models (a single task: its own key)."""
    if not cfg.mix:
        return TASKS[cfg.task].cache_key(cfg)
    return [[s.name, s.weight, s.label, s.task.cache_key(cfg)] for s in task_sources(cfg)]
