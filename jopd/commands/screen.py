"""Screen candidate rollout setups offline against a mismatch budget calibrated from full runs' verdicts.

    jopd screen SCREEN.yaml

SCREEN.yaml:
    baseline: [runs/b/seed0, runs/b/seed1]       # baseline runs (`jopd train` dirs), one per training seed
    calibration: [runs/x/seed0, runs/y/seed0]    # full runs judged by the quality rule against the baseline
                                                 # run of the same train.seed (else the first baseline run)
    candidates:                                  # rollout setups to screen without training
      - {name: bf16, config: configs/testbed.yaml, overrides: [rollout_precision.compute_dtype=bf16]}
    student: null      # checkpoint dir or run dir of the student to measure with; null: the config's start
    batches: 4         # prompt batches per measurement
    scale: offline     # offline: calibration runs are re-measured like the candidates; in_run: their logged mean
    quality: {eval: after, threshold: 0.2, resamples: 10000}

Prints the bracket, the admission threshold, and per candidate admit / reject / undecided (its interval
straddles the threshold), the distance to the threshold and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

import pydantic

from jopd.config_dataclass import build, config_dataclass, read_yaml_mapping
from jopd.lab.sweep_config import QualityConfig


@config_dataclass
class Candidate:
    name: str
    config: str
    overrides: tuple[str, ...] = ()


@config_dataclass
class ScreenFile:
    baseline: tuple[str, ...]
    calibration: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    student: str | None = None
    batches: pydantic.PositiveInt = 4
    scale: Literal["offline", "in_run"] = "offline"
    resamples: int = pydantic.Field(2000, ge=100)
    quality: QualityConfig = QualityConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("screen", help="screen YAML (format above)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


def run(args: argparse.Namespace) -> int:
    from jopd.lab.screen import calibration_from_runs, screen
    from jopd.run.config import load_config

    spec = build(ScreenFile, read_yaml_mapping(args.screen), where=Path(args.screen).name)
    cal, configs, in_run = calibration_from_runs(spec.baseline, spec.calibration, spec.quality)
    if spec.scale == "in_run":
        missing = [d for d in spec.calibration if d not in in_run]
        if missing:
            raise ValueError(f"scale: in_run needs mismatch_kl in metrics.jsonl; missing in {missing}")
    cands = [(c.name, load_config(c.config, list(c.overrides)), []) for c in spec.candidates]
    report = screen(cal, cands, student=spec.student, batches=spec.batches, resamples=spec.resamples,
                    scale=spec.scale, setup_configs=configs, in_run=in_run,
                    log=lambda m: print(m, file=sys.stderr))
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    return 0
