"""A `jopd train` output directory read back: its resolved config, its checkpoints, whether it finished.
(Its per-problem evaluations and logged mismatch: `jopd.lab.quality`.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jopd.opd.run_config import RunConfig, load_config


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """RUN_DIR/config.yaml (what `jopd train` saved), with `train.out_dir` pointing at RUN_DIR."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a `jopd train` output directory?)")
    return load_config(str(path), [f"train.out_dir={Path(run_dir)}", *overrides])


def checkpoint_dir(cfg: RunConfig) -> str:
    return cfg.checkpoint.dir or str(Path(cfg.train.out_dir) / "checkpoints")


def restore_state(ckpt_dir: str | Path, abstract_state: Any, step: int | None = None) -> tuple[Any, int]:
    """(train state, its step) from an Orbax checkpoint directory of `jopd train` (default: the latest step)."""
    from jopd.opd.checkpoint import Checkpointer

    if not Path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint directory")
    ckpt = Checkpointer(dataclasses.replace(RunConfig().checkpoint, dir=str(ckpt_dir), async_save=False))
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"{ckpt_dir}: holds no checkpoint")
        if step is None:
            step = max(steps)
        if step not in steps:
            raise ValueError(f"--step {step}: not saved in {ckpt_dir} (saved steps: {sorted(steps)})")
        return ckpt.restore(step, abstract_state).state, int(step)
    finally:
        ckpt.close()


def is_finished(run_dir: str | Path) -> bool:
    """The run reached its last step and wrote its final evaluation (`summary.json` with "after")."""
    path = Path(run_dir) / "summary.json"
    try:
        return "after" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False
