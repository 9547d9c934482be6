"""Evaluate a run's student at a saved step on the held-out problems (per-problem divergence and correctness).

    jopd eval RUN_DIR [--step N] [--problems N] [--name NAME]

Restores the checkpoint of step N (default: the latest) of a `jopd train` output directory and writes
RUN_DIR/eval/NAME.{csv,json} (default NAME: step_N), in the format `jopd train` writes for before/after: one
row per held-out problem with its teacher divergence (mean per-token KL(student || teacher) over the student's
response, nats/token) and correctness. The sampling seed is the run's train.eval_seed, so two runs evaluated
at the same step answer each problem with the same random draws (`jopd compare` pairs them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a `jopd train` output directory (holds config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--problems", type=int, default=None, help="held-out problems (default: the run's eval_problems)")
    p.add_argument("--name", default=None, help="output name under RUN_DIR/eval (default: step_N)")


def run(args: argparse.Namespace) -> int:
    from jopd.lab.runs import build_at_checkpoint, checkpoint_dir, run_config
    from jopd.run import loop

    if args.problems is not None and args.problems < 1:
        raise ValueError(f"--problems: must be >= 1, got {args.problems}")
    over = [f"train.eval_problems={args.problems}"] if args.problems else []
    cfg = run_config(args.run_dir, over)
    run_, state, step = build_at_checkpoint(cfg, checkpoint_dir(cfg), args.step,
                                            log=lambda m: print(m, file=sys.stderr))
    name = args.name or f"step_{step}"
    summary = loop.run_eval(run_, state.params, name, Path(args.run_dir))
    print(json.dumps({"step": step, **summary}, indent=2))
    print(f"wrote {Path(args.run_dir) / 'eval' / name}.csv", file=sys.stderr)
    return 0
