"""Run a `SweepConfig`: every (setup, seed) as a full `jopd train` run, resumable (finished runs are skipped, an
interrupted one resumes from its checkpoint), then the analysis (`sweep_report`).

Runs of a sweep that share the starting student, the teacher and the held-out evaluation settings (seed
`train.eval_seed`, problems, lengths) have the same evaluation before training: it is computed once, by the
first of them, and copied into the others (`_before_eval_key`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from jopd.lab.runs import WALL_FILE, eval_path, is_finished
from jopd.lab.sweep_config import SetupConfig, SweepConfig
from jopd.run.config import RunConfig, load_config


def run_dir(sweep: SweepConfig, setup: str, seed: int, method: str | None = None) -> Path:
    root = Path(sweep.out_dir) if method is None else Path(sweep.out_dir) / method
    return root / setup / f"seed{seed}"


def run_config(sweep: SweepConfig, setup: SetupConfig, seed: int, method: str | None = None) -> RunConfig:
    """The run config of one (method, setup, seed): base, sweep overrides, the method's, the setup's, then the
    seed and directory. Mismatch is always measured exactly (the x axis of the study)."""
    method_over = sweep.methods[method].overrides if method is not None else ()
    return load_config(sweep.base, [*sweep.overrides, *method_over, *setup.overrides, f"train.seed={seed}",
                                    f"train.out_dir={run_dir(sweep, setup.name, seed, method)}",
                                    "train.mismatch=exact"])


def planned_runs(sweep: SweepConfig) -> list[tuple[str | None, SetupConfig, int]]:
    """Per method: the baseline seeds first (every rule compares against them), then the setups in file order."""
    return [(m, s, seed) for m in sweep.method_names() for s in sweep.all_setups() for seed in s.seeds]


def check_configs(sweep: SweepConfig) -> None:
    """Every run's config is valid before the first one starts (a typo in the last setup fails now, not in an hour)."""
    for method, setup, seed in planned_runs(sweep):
        try:
            run_config(sweep, setup, seed, method)
        except ValueError as e:
            where = setup.name if method is None else f"{method}/{setup.name}"
            raise ValueError(f"sweep setup {where!r}: {e}") from None


def _before_eval_key(cfg) -> tuple:
    """What the eval before training depends on: runs that agree on it share that eval."""
    t = cfg.train
    return (cfg.student, cfg.teacher, cfg.teachers, cfg.routing, cfg.data, cfg.sampling, cfg.loss.cross_tokenizer,
            t.eval_problems, t.eval_max_new_tokens, t.eval_seed)


def _share_before_eval(sweep: SweepConfig, target: Path, cfg) -> None:
    """The starting student's eval is the same for every run of a sweep that starts from the same student and is
    judged by the same teacher (a setup that changes either computes its own)."""
    key = _before_eval_key(cfg)
    for method, setup, seed in planned_runs(sweep):
        src = run_dir(sweep, setup.name, seed, method)
        if src == target or _before_eval_key(run_config(sweep, setup, seed, method)) != key:
            continue
        files = [(eval_path(src, "before", x), eval_path(target, "before", x)) for x in (".json", ".csv")]
        if all(a.is_file() for a, _ in files):
            (target / "eval").mkdir(parents=True, exist_ok=True)
            for a, b in files:
                if not b.exists():
                    shutil.copy(a, b)
            return


@contextlib.contextmanager
def locked_out_dir(sweep: SweepConfig) -> Iterator[Path]:
    """Hold an exclusive lock on the sweep's out_dir while it trains: a second `jopd sweep` on the same directory
    would train the same runs beside it and mix their checkpoints. The OS drops the lock when the process dies
    (even on SIGKILL), so there is no stale lock to clean up. One lock per host and process id, so the processes
    of one multi-host job sharing a file system do not block each other."""
    out = Path(sweep.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f".sweep.{socket.gethostname()}.p{os.environ.get('JAX_PROCESS_ID', '0')}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise BlockingIOError(errno.EAGAIN, f"sweep out_dir {out}: another jopd sweep (pid {holder}) is "
                                  "training into it; stop it or wait for it to finish") from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield out
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def only_setups(sweep: SweepConfig, names: list[str]) -> set[str]:
    """The setups `names` picks (setup or group names; the baseline always), or ValueError naming an unknown one."""
    known = {s.name for s in sweep.setups} | {s.group for s in sweep.setups if s.group}
    unknown = [n for n in names if n not in known and n != sweep.baseline.name]
    if unknown:
        raise ValueError(f"--only: unknown setup or group {unknown} (setups: {', '.join(s.name for s in sweep.setups)})")
    return {sweep.baseline.name} | {s.name for s in sweep.setups if s.name in names or s.group in names}


def run_sweep(sweep: SweepConfig, log=print, only: set[str] | None = None) -> list[dict]:
    """Train every planned run that is not finished yet (of the setups in `only`, when given: e.g. one study of a
    larger sweep first). Returns one record per run: setup, seed, dir, status ("done" = finished before,
    "trained" = finished now, "interrupted" = preempted, resumable) and the wall seconds spent now. Refuses
    (BlockingIOError, one line from the CLI) while another sweep trains into the same out_dir."""
    check_configs(sweep)
    with locked_out_dir(sweep):
        return _train_planned(sweep, log, only)


def _train_planned(sweep: SweepConfig, log, only: set[str] | None = None) -> list[dict]:
    from jopd.lab.probe import training_probe
    from jopd.run.loop import train

    records = []
    runs = [r for r in planned_runs(sweep) if only is None or r[1].name in only]
    for i, (method, setup, seed) in enumerate(tqdm(runs, desc="sweep", dynamic_ncols=True)):
        out = run_dir(sweep, setup.name, seed, method)
        rec = {"method": method, "setup": setup.name, "seed": seed, "dir": str(out)}
        if is_finished(out):
            records.append(rec | {"status": "done", "wall_s": 0.0})
            continue
        log(f"[{i + 1}/{len(runs)}] {setup.name} seed {seed} -> {out}")
        cfg = run_config(sweep, setup, seed, method)
        _share_before_eval(sweep, out, cfg)
        t0 = time.perf_counter()
        summary = train(cfg, log=log, probe_hook=training_probe)
        status = "trained" if "after" in summary else "interrupted"
        wall = time.perf_counter() - t0
        records.append(rec | {"status": status, "wall_s": wall})
        out.mkdir(parents=True, exist_ok=True)
        with open(out / WALL_FILE, "a") as f:  # one line per (re)start of this run: resumes add up
            f.write(json.dumps({"status": status, "wall_s": round(wall, 2), "steps": summary.get("steps"),
                                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        if status == "interrupted":  # preempted (SIGTERM/SIGINT): the run saved its state; a rerun resumes it
            log(f"{out}: stopped at step {summary['steps']}; rerun the sweep to resume")
            break
    return records
