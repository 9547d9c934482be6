"""The registry of tasks: one `Task` entry per `data.task` — its problems, how a problem becomes the user's turn,
how an answer is checked (and rewarded, for the RL kinds), and optionally a step checker for the
teacher-reliability probe. `DataConfig.task` validates against it, so a task registered from a user's module
(`plugins:`, see docs/extending.md) is trained, evaluated and probed like a built-in one.

Built-ins: `arithmetic` (the testbed's seeded word problems, checkable step by step), `counting` (letters in a
word, with running counts; checkable step by step) and `jsonl` (GSM8K-style files, `data.train_path` /
`data.heldout_path`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from jopd.data import answers
from jopd.data.problem import Problem
from jopd.registry import Registry

if TYPE_CHECKING:
    from jopd.data.pipeline import DataConfig

Split = Literal["train", "heldout"]


class StepChecker(Protocol):
    """What the probe's first-error cut needs of a task whose worked solutions are checkable step by step."""

    def check_response(self, response: str, solution: str) -> Any: ...  # a `arithmetic_steps.StepCheck`
    def local_violations(self, response: str, solution: str) -> int | None: ...
    def num_steps(self, solution: str) -> int: ...


@dataclasses.dataclass(frozen=True)
class Task:
    """One task. `problems(data_cfg, split)`: the split's problems (a `Sequence`; the train split may be a lazy
    stream — set `streams_train`, and the pipeline then checks only its first problems up front).
    `is_correct(response, reference)`: the answer check (eval accuracy, the probe); `reward(response,
    reference)`: the RL kinds' reward (default 1.0 if correct else 0.0). `user_turn(problem)`: the text of the
    user's message (default: the question). `cache_key(data_cfg)`: what identifies the task's data in the
    cache key of SFT-made models. `options`: a config dataclass validating `data.options` (None: no options)."""

    problems: Callable[["DataConfig", Split], Sequence[Problem]]
    cache_key: Callable[["DataConfig"], Any]
    is_correct: Callable[[str, str], bool] = answers.is_correct
    reward: Callable[[str, str], float] | None = None
    user_turn: Callable[[Problem], str] = lambda problem: problem.question
    step_checker: StepChecker | None = None
    streams_train: bool = False
    options: type | None = None

    def reward_of(self, response: str, reference: str) -> float:
        if self.reward is not None:
            return float(self.reward(response, reference))
        return float(self.is_correct(response, reference))


TASKS: Registry[Task] = Registry("task")


def task_options(cfg: "DataConfig"):
    """`data.options` validated by the task's own options dataclass (its defaults when none are given)."""
    from jopd.config_dataclass import ConfigError, build

    options = TASKS[cfg.task].options
    if options is None:
        if cfg.options:
            raise ConfigError(f"options: task {cfg.task!r} takes no options, got {sorted(cfg.options)}")
        return None
    return build(options, dict(cfg.options), where="options")


# -- the built-ins ------------------------------------------------------------------------------------------


class _ArithmeticSteps:
    """The arithmetic task's worked solutions, checked step by step (`jopd.data.arithmetic_steps`)."""

    def check_response(self, response: str, solution: str):
        from jopd.data.arithmetic_steps import check_response
        return check_response(response, solution)

    def local_violations(self, response: str, solution: str) -> int | None:
        from jopd.data.arithmetic_steps import local_violations
        return local_violations(response, solution)

    def num_steps(self, solution: str) -> int:
        from jopd.data.arithmetic_steps import parse_reference
        return len(parse_reference(solution).steps)


def _arithmetic_problems(cfg: "DataConfig", split: Split) -> Sequence[Problem]:
    from jopd.data.arithmetic import ArithmeticTrain, heldout_problems
    return ArithmeticTrain(cfg.arithmetic) if split == "train" else heldout_problems(cfg.arithmetic)


def _counting_problems(cfg: "DataConfig", split: Split) -> Sequence[Problem]:
    from jopd.data.counting import CountingTrain, heldout_problems
    return CountingTrain(cfg.counting) if split == "train" else heldout_problems(cfg.counting)


def _jsonl_problems(cfg: "DataConfig", split: Split) -> Sequence[Problem]:
    from jopd.data.math_jsonl import load_math_jsonl
    path = cfg.train_path if split == "train" else cfg.heldout_path
    if not path:
        raise ValueError(f"DataConfig.{split}_path: not set (task=jsonl has no {split} split without it)")
    return load_math_jsonl(path)


TASKS.add("arithmetic", Task(_arithmetic_problems, cache_key=lambda cfg: dataclasses.asdict(cfg.arithmetic),
                             step_checker=_ArithmeticSteps(), streams_train=True))
TASKS.add("counting", Task(_counting_problems, cache_key=lambda cfg: dataclasses.asdict(cfg.counting),
                           step_checker=importlib.import_module("jopd.data.counting_steps"), streams_train=True))
TASKS.add("jsonl", Task(_jsonl_problems, cache_key=lambda cfg: [cfg.train_path]))
