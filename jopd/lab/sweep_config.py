"""`SweepConfig`: a grid of rollout setups × training seeds, each a full `jopd train` run against one baseline,
then the quality rule per run and a seed-aware verdict per setup, and optionally the screening check.

    base: configs/testbed.yaml            # the run config every run starts from (path relative to the cwd)
    overrides: [train.steps=400]          # applied to every run
    out_dir: runs/sweeps/testbed_bracket  # RUN = OUT/<setup name>/seed<k>/ (a `jopd train` directory)
    baseline: {name: fp32, seeds: [0, 1, 2]}
    setups:
      - {name: noise_1.0, overrides: [rollout_precision.logit_noise=1.0], seeds: [0, 1]}
    quality: {eval: after, threshold: 0.2, resamples: 10000}
    screen: {calibration: [noise_1.0, ...], candidates: [bf16, ...], batches: 4, student: start}
    methods:                              # optional: a contrast of training methods on the same setups
      opd: {overrides: [loss.kind=topk_rkl]}
      grpo: {overrides: [loss.kind=grpo], rule: broke}
"""

from __future__ import annotations

import os
from typing import Literal

import pydantic

from jopd.config_dataclass import build, config_dataclass, read_yaml_mapping

_NAME = pydantic.Field(pattern=r"^[A-Za-z0-9_.+-]+$", min_length=1)


@config_dataclass
class SetupConfig:
    name: str = _NAME
    overrides: tuple[str, ...] = ()  # key=value overrides of this setup (e.g. rollout_precision.logit_noise=1.0)
    seeds: tuple[int, ...] = (0,)  # training seeds (train.seed); the baseline's seed k pairs with setup seed k
    # setups sharing a group (e.g. one IS correction across engines) get a bracket of their own; the ungrouped
    # setups give the sweep's main bracket. Every group is judged against the same baseline.
    group: str | None = pydantic.Field(None, pattern=r"^[A-Za-z0-9_.+-]+$")

    @pydantic.field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds):
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"must be a non-empty list of distinct seeds, got {list(seeds)}")
        return seeds


@config_dataclass
class MethodConfig:
    """One training method of a contrast sweep (e.g. OPD vs REINFORCE vs GRPO): its overrides, and the rule
    that judges its runs against its own standard-engine baseline."""

    overrides: tuple[str, ...] = ()
    rule: Literal["quality", "broke"] = "quality"  # quality: OPD's rule; broke: `jopd.lab.rl_verdict`


@config_dataclass
class QualityConfig:
    eval: str = "after"  # which RUN/eval/<name>.csv the rule compares (the same step for every run)
    threshold: float = pydantic.Field(0.2, gt=0)  # FAIL iff rise >= threshold and the paired CI excludes 0
    resamples: int = pydantic.Field(10_000, ge=100)
    seed: int = 0  # bootstrap seed


@config_dataclass
class ScreenConfig:
    calibration: tuple[str, ...] = ()  # setups whose full-run verdicts calibrate the budget
    candidates: tuple[str, ...] = ()  # setups screened offline, then checked against their full runs
    batches: pydantic.PositiveInt = 4  # prompt batches measured per setup
    # the student the offline measurement uses: "start" (the run's starting student, e.g. the warm start) or
    # "baseline" (the baseline's first seed at its last step)
    student: Literal["start", "baseline"] = "start"
    resamples: int = pydantic.Field(2000, ge=100)


@config_dataclass
class SweepConfig:
    base: str
    out_dir: str
    baseline: SetupConfig
    setups: tuple[SetupConfig, ...] = ()
    overrides: tuple[str, ...] = ()
    quality: QualityConfig = QualityConfig()
    screen: ScreenConfig | None = None
    # a contrast sweep: every method runs the baseline and every setup (RUN = OUT/<method>/<setup>/seed<k>)
    methods: dict[str, MethodConfig] | None = None

    def __post_init__(self):
        names = [self.baseline.name] + [s.name for s in self.setups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"setups: duplicate names {dup}")
        if self.methods is not None and self.screen is not None:
            raise ValueError("screen: not available in a sweep with methods (screen one method's sweep)")
        if self.methods is not None and not self.methods:
            raise ValueError("methods: empty (leave it out for a one-method sweep)")
        if self.screen is not None:
            for field in ("calibration", "candidates"):
                unknown = [n for n in getattr(self.screen, field) if n not in names]
                if unknown:
                    raise ValueError(f"screen.{field}: unknown setups {unknown}")

    def all_setups(self) -> tuple[SetupConfig, ...]:
        return (self.baseline,) + self.setups

    def setup(self, name: str) -> SetupConfig:
        return next(s for s in self.all_setups() if s.name == name)

    def method_names(self) -> tuple[str | None, ...]:
        """The methods in file order, or (None,) for a one-method sweep."""
        return tuple(self.methods) if self.methods else (None,)


def load_sweep(path: str) -> SweepConfig:
    cfg = build(SweepConfig, read_yaml_mapping(path), where="SweepConfig")
    if not os.path.isfile(cfg.base):
        raise FileNotFoundError(f"SweepConfig.base: {cfg.base} not found (paths are relative to the working directory)")
    return cfg
