"""The rollout engines behind one interface, and the one rule that picks an engine for a batch.

An `Engine` is a pure sample function (params, prompts, masks, randomness, cache -> `SampleOutput`) and how many
decode slots (rows of its KV cache) it runs for a batch. `choose_engine` is the only place that decides which
engine runs: the static one unless decode slots are asked for (`sampling.slots` > 0) or a prompt's samples share
its prefill (several samples per prompt). `Sampler` compiles `bind(choice.program, ...)` per choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jopd.models.config import ModelConfig
from jopd.registry import Registry
from jopd.sampling.config import SampleOutput, SamplingConfig
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.slots import sample_slots, slot_iterations
from jopd.sampling.static import sample_static


@dataclasses.dataclass(frozen=True)
class Engine:
    """`sample(params, prompt_UxP, prompt_mask_UxP, rand, cache, *, cfg, precision, sampling, group, shards)`: R =
    U x group rows (row r samples prompt r // group) on a cache of `slots(rows, sampling, shards)` rows.
    `decode_steps(lengths_R, slots, shards)`: the decode forward passes it runs for rows of these lengths (its
    `SampleOutput.decode_iterations`). `per_row`: its rows are at their own decode steps (`decode.decode_step` at
    one slot index per row) and its prompts are prefilled into buffers of their own (then copied into the slots);
    otherwise every row is at one step and the prompts are prefilled into the decode cache."""

    sample: Callable[..., SampleOutput]
    slots: Callable[[int, SamplingConfig, int], int]
    decode_steps: Callable[[np.ndarray, int, int], int]
    per_row: bool


def _static(params, prompt_UxP, prompt_mask_UxP, rand, cache, *, cfg, precision, sampling, group, shards):
    del shards  # every row has its own cache row: nothing crosses a batch shard
    if group != 1:
        raise ValueError(f"static engine: one sample per prompt, got group={group}")
    return sample_static(params, prompt_UxP, prompt_mask_UxP, rand, cache, cfg=cfg, precision=precision,
                         sampling=sampling)


def _slot_count(rows: int, sampling: SamplingConfig, shards: int) -> int:
    """`sampling.slots` (0: one per row), at most the rows, a multiple of the batch shards."""
    slots = rows if sampling.slots == 0 else min(sampling.slots, rows)
    return max(shards, slots - slots % shards)


ENGINES: Registry[Engine] = Registry("rollout engine")
ENGINES.add("static", Engine(sample=_static, slots=lambda rows, sampling, shards: rows,
                             decode_steps=lambda lengths, slots, shards: max(int(np.max(lengths)) - 1, 0),
                             per_row=False))
ENGINES.add("slots", Engine(sample=sample_slots, slots=_slot_count, decode_steps=slot_iterations, per_row=True))


class EngineChoice(NamedTuple):
    """The engine for a batch, as `Sampler.program_for` keys its programs: `program` 0 is the static engine, g > 0
    the slot engine with g samples per prompt; `slots` its decode slots (the KV cache's rows)."""

    program: int
    slots: int

    @property
    def engine(self) -> Engine:
        return engine_of(self.program)


def engine_of(program: int) -> Engine:
    """The engine of an `EngineChoice.program`."""
    return ENGINES["static" if program == 0 else "slots"]


def choose_engine(rows: int, group: int, sampling: SamplingConfig, shards: int = 1) -> EngineChoice:
    """The engine for `rows` rows of `group` samples per prompt over `shards` batch shards."""
    static = sampling.slots == 0 and group == 1
    name = "static" if static else "slots"
    return EngineChoice(0 if static else group, ENGINES[name].slots(rows, sampling, shards))


def bind(program: int, cfg: ModelConfig, precision: PrecisionConfig, sampling: SamplingConfig, shards: int = 1):
    """The pure sample function of `EngineChoice.program`, its static arguments bound:
    (params, prompt_UxP, prompt_mask_UxP, rand, cache) -> `SampleOutput`."""
    engine, group = engine_of(program), max(program, 1)

    def sample(params, prompt_UxP, prompt_mask_UxP, rand, cache):
        return engine.sample(params, prompt_UxP, prompt_mask_UxP, rand, cache, cfg=cfg, precision=precision,
                             sampling=sampling, group=group, shards=shards)
    return sample
