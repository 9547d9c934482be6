"""Seeded synthetic arithmetic word problems: the CPU testbed's task.

Each problem is a short chain of add / subtract / multiply steps applied left to right, with a worked solution
that shows every intermediate result and ends with `#### answer`:

    Q: Bo has 3 bags of 4 figs, gets 5, loses 6. How many?
    A: 3*4=12. 12+5=17. 17-6=11. #### 11

Problem `i` of a split is a pure function of (seed, split, i), so the train split is an index-addressable
stream of any length (grain shuffles and shards it lazily) and the held-out split is a fixed list. The two are
disjoint by their arithmetic (the expression, whatever the wording), not only by their text.
"""

from __future__ import annotations

import functools

import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.data import seeded
from jopd.data.problem import Problem

_NAMES = ("Al", "Bo", "Cy", "Di", "Ed", "Jo", "Max", "Sam", "Ann", "Zoe", "Kim", "Lu")
_THINGS = ("pens", "cups", "eggs", "figs", "hats", "keys", "jars", "toys", "nuts", "bees")
_ADD = ("gets {n}", "buys {n}", "finds {n}")
_SUB = ("loses {n}", "sells {n}", "uses {n}")
_MUL = {2: "doubles them", 3: "triples them"}


@config_dataclass
class ArithmeticConfig:
    seed: int = 0  # problem-generation seed; the held-out split depends only on it and the difficulty fields
    min_steps: int = pydantic.Field(1, ge=1)  # fewest operations per problem
    max_steps: int = pydantic.Field(3, ge=1, le=16)  # most operations per problem (the difficulty knob)
    max_number: int = pydantic.Field(20, ge=2)  # added/subtracted amounts and starting counts lie in [1, max_number]
    max_factor: int = pydantic.Field(3, ge=2, le=9)  # "N bags of": N in [2, max_factor]; doubles/triples if <= it
    train_size: int = pydantic.Field(1_000_000, ge=1)  # virtual train stream length before an epoch wraps
    heldout_size: int = pydantic.Field(530, ge=1)  # size of the fixed held-out split

    def __post_init__(self):
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps={self.min_steps} > max_steps={self.max_steps}")


def _draw(cfg: ArithmeticConfig, rng: np.random.Generator) -> tuple[str, str, str, str]:
    """One problem: (question, solution, answer, canonical expression used for dedup)."""
    num_ops = int(rng.integers(cfg.min_steps, cfg.max_steps + 1))
    name, thing = _NAMES[rng.integers(len(_NAMES))], _THINGS[rng.integers(len(_THINGS))]
    steps: list[str] = []
    if rng.random() < 0.3:  # open with a product: "3 bags of 4 figs"
        bags, each = int(rng.integers(2, cfg.max_factor + 1)), int(rng.integers(1, cfg.max_number + 1))
        value = bags * each
        opening, expr = f"{name} has {bags} bags of {each} {thing}", f"{bags}*{each}"
        steps.append(f"{bags}*{each}={value}.")
        num_ops -= 1
    else:
        value = int(rng.integers(1, cfg.max_number + 1))
        opening, expr = f"{name} has {value} {thing}", f"{value}"
    phrases = []
    for _ in range(num_ops):
        ops = ["+", "*"] + (["-"] if value >= 1 else [])
        op = ops[rng.integers(len(ops))]
        if op == "*":
            n = int(rng.integers(2, min(cfg.max_factor, 3) + 1))
            phrase, new = _MUL[n], value * n
        elif op == "+":
            n = int(rng.integers(1, cfg.max_number + 1))
            phrase, new = _ADD[rng.integers(len(_ADD))].format(n=n), value + n
        else:
            n = int(rng.integers(1, min(value, cfg.max_number) + 1))
            phrase, new = _SUB[rng.integers(len(_SUB))].format(n=n), value - n
        phrases.append(phrase)
        steps.append(f"{value}{op}{n}={new}.")
        expr += f"{op}{n}"
        value = new
    question = ", ".join([opening, *phrases]) + ". How many?"
    solution = " ".join(steps) + f" #### {value}"
    return question, solution, str(value), expr


@functools.lru_cache(maxsize=8)
def _heldout_draws(cfg: ArithmeticConfig) -> tuple[tuple[str, str, str, str], ...]:
    """The held-out draws in order, first occurrence of each expression kept (cached: configs are frozen)."""
    return seeded.distinct_draws(functools.partial(_seeded_draw, cfg), _expression, cfg.heldout_size,
                                 "ArithmeticConfig: raise max_number or max_steps")


def _seeded_draw(cfg: ArithmeticConfig, namespace: int, index: int, attempt: int) -> tuple[str, str, str, str]:
    return _draw(cfg, np.random.default_rng([cfg.seed, namespace, index, attempt]))


def _expression(draw: tuple[str, str, str, str]) -> str:
    return draw[3]


def heldout_problems(cfg: ArithmeticConfig) -> list[Problem]:
    """The fixed held-out split: `cfg.heldout_size` problems with distinct expressions, never in train."""
    return [Problem(q, s, a, f"arithmetic heldout #{i}") for i, (q, s, a, _) in enumerate(_heldout_draws(cfg))]


class ArithmeticTrain(seeded.SeededStream):
    """Index-addressable train stream: problem i is drawn from (seed, i), redrawn while it is a held-out one."""

    def __init__(self, cfg: ArithmeticConfig):
        self.cfg = cfg
        super().__init__(cfg.train_size, functools.partial(_seeded_draw, cfg), _expression,
                         frozenset(_expression(d) for d in _heldout_draws(cfg)),
                         lambda d, i: Problem(d[0], d[1], d[2], f"arithmetic train #{i}"), "ArithmeticConfig")
