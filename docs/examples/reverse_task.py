"""A task of your own: reverse a random word. Its answers are words, not numbers, so it brings its own answer
check; its settings come from the run config's `data.options`, validated by its own options dataclass.

    plugins: [docs/examples/reverse_task.py]   # in the config's folder, else the working directory
    data: {task: reverse, options: {min_len: 3, max_len: 6}}

tests/data/test_task_plugin.py trains a tiny testbed run with exactly this file.
"""

import re
import string

import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.data.problem import Problem
from jopd.data.tasks import TASKS, Task, task_options


@config_dataclass
class ReverseOptions:
    min_len: int = pydantic.Field(3, ge=1)
    max_len: int = pydantic.Field(6, ge=1)
    seed: int = 0
    heldout_size: int = pydantic.Field(64, ge=1)


class Words:
    """Problem i of a split is a pure function of (seed, split, i): an index-addressable stream."""

    def __init__(self, options: ReverseOptions, split: int, size: int):
        self.options, self.split, self.size = options, split, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Problem:
        if not 0 <= i < self.size:
            raise IndexError(i)
        rng = np.random.default_rng([self.options.seed, self.split, i])
        n = int(rng.integers(self.options.min_len, self.options.max_len + 1))
        word = "".join(rng.choice(list(string.ascii_lowercase), n))
        return Problem(question=f"Reverse: {word}", solution=f"#### {word[::-1]}", answer=word[::-1],
                       where=f"reverse {'train' if self.split == 0 else 'heldout'} #{i}")


def problems(data_cfg, split):
    opts = task_options(data_cfg)
    # train and held-out words come from different seed namespaces (an overlap of short words is possible)
    return Words(opts, 0, 1_000_000) if split == "train" else Words(opts, 1, opts.heldout_size)


def is_correct(response: str, reference: str) -> bool:
    found = re.search(r"####\s*([a-z]+)", response)
    return found is not None and found.group(1) == reference


TASKS.add("reverse", Task(problems=problems, is_correct=is_correct, options=ReverseOptions, streams_train=True,
                          cache_key=lambda data_cfg: ["reverse", dict(data_cfg.options)]))
