"""Seeded synthetic counting problems: the testbed's second task (beside arithmetic), for several teachers.

A problem lists a few distinct things, animals and objects; the worked solution copies the animals one by one,
each with the running count, then gives the total:

    Q: How many animals: fig, cat, pen, dog?
    A: cat1 dog2 #### 2

Every step is local (the next animal of the list, whose name appears once in the question; the previous count
plus one) once the model knows which names are animals, which it learns from the data; the answer is a number,
so the shared numeric answer check (`answers.is_correct`) grades it. As with arithmetic, problem `i` of a split
is a pure function of (seed, split, i): the train split is an index-addressable stream, the held-out split a
fixed list, disjoint from train by the list of things.
"""

from __future__ import annotations

import functools
import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.data import seeded
from jopd.data.problem import Problem

ANIMALS = ("cat", "dog", "bee", "ant", "owl", "bat", "hen", "cow", "pig", "fox", "elk", "yak")
OBJECTS = ("pen", "cup", "egg", "fig", "hat", "key", "jar", "toy", "nut", "box", "map", "mug")
THINGS = ANIMALS + OBJECTS


@config_dataclass
class CountingConfig:
    seed: int = 0  # problem-generation seed; the held-out split depends only on it and the fields below
    min_items: int = pydantic.Field(2, ge=1)  # fewest things per problem
    max_items: int = pydantic.Field(5, ge=1, le=len(THINGS))  # most things (the difficulty knob; 5 chars per animal)
    train_size: int = pydantic.Field(1_000_000, ge=1)  # virtual train stream length before an epoch wraps
    heldout_size: int = pydantic.Field(530, ge=1)  # size of the fixed held-out split

    def __post_init__(self):
        if self.min_items > self.max_items:
            raise ValueError(f"min_items={self.min_items} > max_items={self.max_items}")


def worked_solution(things: tuple[str, ...]) -> str:
    """Each animal of `things` with the running count, then `#### total`."""
    animals = [t for t in things if t in ANIMALS]
    return " ".join([f"{t}{i}" for i, t in enumerate(animals, start=1)] + [f"#### {len(animals)}"])


def _draw(cfg: CountingConfig, rng: np.random.Generator) -> tuple[str, ...]:
    """One problem: its things, distinct, in order."""
    n = int(rng.integers(cfg.min_items, cfg.max_items + 1))
    return tuple(THINGS[i] for i in rng.choice(len(THINGS), size=n, replace=False))


def _problem(things: tuple[str, ...], where: str) -> Problem:
    solution = worked_solution(things)
    return Problem(f"How many animals: {', '.join(things)}?", solution, solution.rsplit(" ", 1)[1], where)


def _seeded_draw(cfg: CountingConfig, namespace: int, index: int, attempt: int) -> tuple[str, ...]:
    return _draw(cfg, np.random.default_rng([cfg.seed, namespace, index, attempt]))


@functools.lru_cache(maxsize=8)
def _heldout_draws(cfg: CountingConfig) -> tuple[tuple[str, ...], ...]:
    """The held-out lists in order, first occurrence of each kept (cached: configs are frozen)."""
    return seeded.distinct_draws(functools.partial(_seeded_draw, cfg), lambda d: d, cfg.heldout_size,
                                 "CountingConfig: raise max_items")


def heldout_problems(cfg: CountingConfig) -> list[Problem]:
    """The fixed held-out split: `cfg.heldout_size` distinct problems, never in train."""
    return [_problem(things, f"counting heldout #{i}") for i, things in enumerate(_heldout_draws(cfg))]


class CountingTrain(seeded.SeededStream):
    """Index-addressable train stream: problem i is drawn from (seed, i), redrawn while it is a held-out one."""

    def __init__(self, cfg: CountingConfig):
        self.cfg = cfg
        super().__init__(cfg.train_size, functools.partial(_seeded_draw, cfg), lambda d: d,
                         frozenset(_heldout_draws(cfg)), lambda d, i: _problem(d, f"counting train #{i}"),
                         "CountingConfig")
