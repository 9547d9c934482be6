"""A `jopd train` output directory read back: its config, its checkpoints (and the run built at one), whether it
finished, its held-out evals (`eval/NAME.{csv,json}`) and its per-step metrics (`metrics.jsonl`). Every lab
module and command reads run directories through here.

The file readers are numpy only (no jax: the RunConfig and checkpoint readers import it when called), so the
rules' summaries run anywhere; every error names the file.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

if TYPE_CHECKING:
    from jopd.run.loop import OPDRun
    from jopd.run.config import RunConfig
    from jopd.opd.train_state import TrainState

# ---------------------------------------------------------------------------------------------
# config


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """RUN_DIR/config.yaml (what `jopd train` saved), with `train.out_dir` pointing at RUN_DIR."""
    from jopd.run.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a `jopd train` output directory?)")
    return load_config(str(path), [f"train.out_dir={Path(run_dir)}", *overrides])


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """`RUN_DIR/config.yaml` as saved, a mapping of config sections (not validated: a hand-made run dir may hold
    a partial one), or None when absent."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping of config sections")
    return cfg


def config_field(cfg: dict[str, Any] | None, section: str, key: str) -> Any:
    """cfg[section][key] of a `read_run_config` mapping; None where the config, the section or the key is absent."""
    part = (cfg or {}).get(section)
    return part.get(key) if isinstance(part, dict) else None


# ---------------------------------------------------------------------------------------------
# checkpoints


def checkpoint_dir(cfg: RunConfig) -> str:
    return cfg.checkpoint.dir or str(Path(cfg.train.out_dir) / "checkpoints")


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory given as itself or as the RUN_DIR holding it (RUN_DIR/checkpoints)."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def saved_steps(ckpt_dir: str | Path) -> list[int]:
    """The steps saved in an Orbax checkpoint directory of `jopd train`, sorted (an error if none)."""
    from jopd.run.checkpoint import Checkpointer
    from jopd.run.config import RunConfig

    if not Path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint directory")
    ckpt = Checkpointer(dataclasses.replace(RunConfig().checkpoint, dir=str(ckpt_dir), async_save=False))
    try:
        steps = sorted(int(s) for s in ckpt.all_steps())
    finally:
        ckpt.close()
    if not steps:
        raise FileNotFoundError(f"{ckpt_dir}: holds no checkpoint")
    return steps


def restore_state(ckpt_dir: str | Path, abstract_state: Any, step: int | None = None) -> tuple[Any, int]:
    """(train state, its step) from an Orbax checkpoint directory of `jopd train` (default: the latest step)."""
    from jopd.run.checkpoint import Checkpointer
    from jopd.run.config import RunConfig

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


def build_at_checkpoint(cfg: RunConfig, checkpoint: str | Path | None, step: int | None = None,
                        log=print) -> tuple[OPDRun, TrainState, int | None]:
    """(run, train state, its step): `cfg`'s run (`jopd.run.loop.build`) with the student restored from
    `checkpoint` (a checkpoint directory or the RUN_DIR holding one) at `step` (default: the latest); with no
    checkpoint, the config's starting student and step None."""
    from jopd.run import loop

    run, state = loop.build(cfg, log=log)
    if checkpoint is None:
        return run, state, None
    state, at = restore_state(resolve_checkpoint_dir(checkpoint), run.step.abstract_state(), step)
    return run, state, at


def is_finished(run_dir: str | Path) -> bool:
    """The run reached its last step and wrote its final evaluation (`summary.json` with "after")."""
    path = Path(run_dir) / "summary.json"
    try:
        return "after" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# held-out evals


@dataclasses.dataclass(frozen=True)
class EvalData:
    """One run's held-out eval: problem ids and per-problem teacher divergence (nats/token), file order; the
    per-problem correctness (0/1) when read with `correctness=True`. A divergence is NaN where the eval could not
    score the response (a cross-tokenizer response the pair cannot align, e.g. a special token mid-text; the
    eval's summary counts them as `misaligned`): `quality.align` leaves such problems out of every comparison,
    saying how many."""

    path: Path
    index: np.ndarray  # [n] int problem ids, unique
    divergence: np.ndarray  # [n] float64
    correct: np.ndarray | None = None  # [n] float64 in {0, 1}
    task: np.ndarray | None = None  # [n] str: each problem's task, when the run mixes several (a `task` column)

    @property
    def unscored(self) -> int:
        """Problems whose divergence is NaN (not scored)."""
        return int(np.isnan(self.divergence).sum())


def eval_path(run_dir: str | Path, name: str, suffix: str = ".csv") -> Path:
    return Path(run_dir) / "eval" / f"{name}{suffix}"


def _bool(raw: str, path: Path, line: int) -> float:
    v = raw.strip().lower()
    if v in ("true", "1", "1.0"):
        return 1.0
    if v in ("false", "0", "0.0"):
        return 0.0
    raise ValueError(f"{path}:{line}: correct {raw!r} is not a boolean")


def read_eval(run_dir: str | Path, name: str = "after", *, correctness: bool = False) -> EvalData:
    """Reads `RUN_DIR/eval/NAME.csv` (header `index,teacher_divergence,correct,...`, as `EvalResult.save`
    writes it); `correctness`: also its `correct` column (then required)."""
    path = eval_path(run_dir, name)
    if not path.is_file():
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"{run_dir}: no such run directory")
        have = sorted(p.stem for p in (Path(run_dir) / "eval").glob("*.csv"))
        hint = f" (this run has: {', '.join(have)})" if have else " (this run has no eval/*.csv)"
        raise FileNotFoundError(f"{path}: no such eval file{hint}")
    index: list[int] = []
    div: list[float] = []
    correct: list[float] = []
    task: list[str] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames
        except csv.Error as e:
            raise ValueError(f"{path}: malformed CSV ({e})") from None
        if not header:
            raise ValueError(f"{path}: empty file (expected a header with index,teacher_divergence)")
        missing = [c for c in ("index", "teacher_divergence") if c not in header]
        if missing:
            raise ValueError(f"{path}: header lacks column(s) {', '.join(missing)} (got {','.join(header)})")
        if correctness and "correct" not in header:
            raise ValueError(f"{path}: header lacks column correct (got {','.join(header)})")
        try:
            for row in reader:
                line = reader.line_num
                raw_i, raw_d = row.get("index"), row.get("teacher_divergence")
                if raw_i is None or raw_d is None:
                    raise ValueError(f"{path}:{line}: too few fields")
                try:
                    i = int(raw_i)
                except ValueError:
                    raise ValueError(f"{path}:{line}: index {raw_i!r} is not an integer") from None
                try:
                    d = float(raw_d)
                except ValueError:
                    raise ValueError(f"{path}:{line}: teacher_divergence {raw_d!r} is not a number") from None
                if math.isinf(d):  # NaN is allowed: a response the eval could not score (see EvalData)
                    raise ValueError(f"{path}:{line}: teacher_divergence is {raw_d} for problem {i}")
                index.append(i)
                div.append(d)
                if correctness:
                    correct.append(_bool(row["correct"] or "", path, line))
                if "task" in header:
                    task.append(row["task"] or "")
        except csv.Error as e:
            raise ValueError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    if not index:
        raise ValueError(f"{path}: no problems (header only)")
    idx = np.asarray(index, np.int64)
    uniq, counts = np.unique(idx, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{path}: problem index {int(uniq[counts > 1][0])} appears {int(counts.max())} times")
    return EvalData(path, idx, np.asarray(div, np.float64), np.asarray(correct, np.float64) if correctness else None,
                    np.asarray(task) if "task" in header else None)


def read_eval_summary(run_dir: str | Path, name: str = "after") -> dict[str, Any]:
    """`RUN_DIR/eval/NAME.json`: the eval's means (teacher divergence, accuracy, ...)."""
    path = eval_path(run_dir, name, ".json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such eval summary")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None


# ---------------------------------------------------------------------------------------------
# per-step metrics


def step_rows(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The training rows of `RUN_DIR/metrics.jsonl` by step (eval rows, whose keys are all `eval/...`, left out);
    the last line of a step wins, so a resumed run's repeated steps count once. Missing file: {}."""
    rows: dict[int, dict[str, Any]] = {}
    for row in _metric_lines(run_dir):
        if isinstance(row, dict) and "step" in row and any(k != "step" and not k.startswith("eval/") for k in row):
            rows[int(row["step"])] = row
    return rows


def _metric_lines(run_dir: str | Path):
    """The parsed lines of `RUN_DIR/metrics.jsonl` (none if it is missing; a bad line is a ValueError naming it)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def prefixed_rows(run_dir: str | Path, prefix: str) -> dict[int, dict[str, float]]:
    """The rows of `RUN_DIR/metrics.jsonl` holding `prefix`ed keys (e.g. "probe/" from `train.probe_every`,
    "eval/" from the held-out evals), by step, with the prefix stripped; a step logged twice (a resume) keeps
    its last row. Missing file: {}."""
    out: dict[int, dict[str, float]] = {}
    for row in _metric_lines(run_dir):
        mine = {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)} if isinstance(row, dict) else {}
        if mine and "step" in row:
            out[int(row["step"])] = mine
    return out


def training_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The training rows of `RUN_DIR/metrics.jsonl` (`step_rows`), sorted by step; a missing file or one without
    training rows is an error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file (a `jopd train` out_dir has one)")
    rows = step_rows(run_dir)
    if not rows:
        raise ValueError(f"{path}: no training rows")
    return [rows[s] for s in sorted(rows)]


def mean_metric(run_dir: str | Path, key: str, last_frac: float = 1.0) -> float | None:
    """Mean of metric `key` over the training steps logged in `RUN_DIR/metrics.jsonl` (`step_rows`), over the
    last `last_frac` of those steps (1: all); None when absent or never logged (non-finite values skipped)."""
    rows = step_rows(run_dir)
    steps = sorted(rows)[-max(1, math.ceil(len(rows) * last_frac)):] if rows else []
    vals = [float(rows[s][key]) for s in steps
            if isinstance(rows[s].get(key), (int, float)) and math.isfinite(rows[s][key])]
    return float(np.mean(vals)) if vals else None


def mean_mismatch(run_dir: str | Path) -> float | None:
    """Mean of `mismatch_kl` over the training steps logged in `RUN_DIR/metrics.jsonl` (`step_rows`); None when
    absent or never logged."""
    return mean_metric(run_dir, "mismatch_kl")


WALL_FILE = "sweep_wall.jsonl"  # RUN/sweep_wall.jsonl: one line per time `jopd sweep` trained the run


def wall_seconds(run_dir: str | Path) -> float | None:
    """Wall seconds `jopd sweep` spent training RUN_DIR (the sum over its resumes, `WALL_FILE`; a run killed
    mid-way loses that stretch); None when the run has no such file (trained outside a sweep, or before it
    was recorded)."""
    path = Path(run_dir) / WALL_FILE
    if not path.is_file():
        return None
    total = 0.0
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                total += float(json.loads(line)["wall_s"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with wall_s") from None
    return total
