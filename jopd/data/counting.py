"""Seeded synthetic letter-counting problems: the testbed's second task (beside arithmetic), for several teachers.

A problem names a letter and a short word over a small alphabet; the worked solution copies the word and writes
the running count after each occurrence of the letter, then the total:

    Q: How many a in bacada?
    A: ba1ca2da3 #### 3

Every step is local (copy the next character of the word; after the letter, the previous count plus one), which a
small character-level transformer can learn, and the answer is a number, so the shared numeric answer check
(`answers.is_correct`) grades it. As with arithmetic, problem `i` of a split is a pure function of (seed, split,
i): the train split is an index-addressable stream, the held-out split a fixed list, disjoint from train by
(letter, word).
"""

from __future__ import annotations

import functools
import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.data import seeded
from jopd.data.problem import Problem

_FROM_WORD = 0.85  # share of problems whose letter is drawn from the word itself


@config_dataclass
class CountingConfig:
    seed: int = 0  # problem-generation seed; the held-out split depends only on it and the fields below
    letters: str = pydantic.Field("abcdef", min_length=2)  # the words' alphabet (lowercase letters)
    min_length: int = pydantic.Field(4, ge=1)  # shortest word
    max_length: int = pydantic.Field(9, ge=1, le=20)  # longest word (the difficulty knob; responses ~2x longer)
    train_size: int = pydantic.Field(1_000_000, ge=1)  # virtual train stream length before an epoch wraps
    heldout_size: int = pydantic.Field(530, ge=1)  # size of the fixed held-out split

    def __post_init__(self):
        if self.min_length > self.max_length:
            raise ValueError(f"min_length={self.min_length} > max_length={self.max_length}")
        if not (self.letters.isalpha() and self.letters.islower()) or len(set(self.letters)) != len(self.letters):
            raise ValueError(f"letters={self.letters!r}: distinct lowercase letters only")


def worked_solution(letter: str, word: str) -> str:
    """The word copied with the running count after each `letter`, then ` #### total`."""
    out, count = [], 0
    for ch in word:
        out.append(ch)
        if ch == letter:
            count += 1
            out.append(str(count))
    return "".join(out) + f" #### {count}"


def _draw(cfg: CountingConfig, rng: np.random.Generator) -> tuple[str, str]:
    """One problem: (letter, word)."""
    n = int(rng.integers(cfg.min_length, cfg.max_length + 1))
    word = "".join(cfg.letters[i] for i in rng.integers(len(cfg.letters), size=n))
    # mostly a letter of the word: a count of 0 for most problems would make "0" a strong guess
    pool = word if rng.random() < _FROM_WORD else cfg.letters
    return pool[int(rng.integers(len(pool)))], word


def _problem(letter: str, word: str, where: str) -> Problem:
    solution = worked_solution(letter, word)
    return Problem(f"How many {letter} in {word}?", solution, str(word.count(letter)), where)


def _seeded_draw(cfg: CountingConfig, namespace: int, index: int, attempt: int) -> tuple[str, str]:
    return _draw(cfg, np.random.default_rng([cfg.seed, namespace, index, attempt]))


@functools.lru_cache(maxsize=8)
def _heldout_draws(cfg: CountingConfig) -> tuple[tuple[str, str], ...]:
    """The held-out (letter, word) pairs in order, first occurrence of each kept (cached: configs are frozen)."""
    return seeded.distinct_draws(functools.partial(_seeded_draw, cfg), lambda d: d, cfg.heldout_size,
                                 "CountingConfig: raise max_length or add letters")


def heldout_problems(cfg: CountingConfig) -> list[Problem]:
    """The fixed held-out split: `cfg.heldout_size` distinct problems, never in train."""
    return [_problem(letter, word, f"counting heldout #{i}") for i, (letter, word) in enumerate(_heldout_draws(cfg))]


class CountingTrain(seeded.SeededStream):
    """Index-addressable train stream: problem i is drawn from (seed, i), redrawn while it is a held-out one."""

    def __init__(self, cfg: CountingConfig):
        self.cfg = cfg
        super().__init__(cfg.train_size, functools.partial(_seeded_draw, cfg), lambda d: d,
                         frozenset(_heldout_draws(cfg)), lambda d, i: _problem(*d, f"counting train #{i}"),
                         "CountingConfig")
