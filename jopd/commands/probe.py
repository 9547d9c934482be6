"""Probe the teacher on the student's own wrong prefixes: does it recover, or carry the error to the wrong answer?

    jopd probe CONFIG [key=value ...] [--checkpoint DIR] [--step N] [--problems N] [--samples K] [--json OUT]

(overrides follow the config directly, before the options)

The student (the config's starting student, or a checkpoint's) answers the first N held-out problems with the
run's sampling under train.eval_seed (the draws `jopd train`'s held-out eval makes; --greedy-student: argmax).
Each wrong response is cut right after its first erroneous token (the arithmetic task: the first wrong
character of the first wrong step; JSONL math: at --fractions of its tokens), and the teacher continues that
prefix greedily and with K seeded samples. Reported, each with a 95% bootstrap CI over prefixes: recovery (the
continuation ends on the correct answer), agreement (on the student's wrong answer), other, and on the
arithmetic task follows_error (it carries the error consistently to a wrong answer); recognition (the
teacher's probability of the erroneous token vs its own top choice, the token's rank); and the same from the
reference solution and from the teacher's own response cut at the same place. Writes JSON, CSV (one row per
prefix) and a PNG (recovery / agreement vs where the prefix is cut); warns when the teacher mostly agrees.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or not all(0 < f <= 1 for f in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1]: {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (its teacher, student, data, sampling and train.eval_seed)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. sampling.temperature=0.7")
    p.add_argument("--checkpoint", default=None,
                   help="a `jopd train` checkpoint directory (RUN_DIR/checkpoints) or RUN_DIR to take the student from")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--problems", type=int, default=None,
                   help="first N held-out problems (default: the config's train.eval_problems)")
    p.add_argument("--samples", type=int, default=4, help="K seeded teacher continuations per prefix (0: greedy only)")
    p.add_argument("--greedy-student", action="store_true", help="the student answers greedily")
    p.add_argument("--cut", choices=("auto", "first_error", "fractions"), default="auto",
                   help="where wrong responses are cut (auto: first_error on the arithmetic task, else fractions)")
    p.add_argument("--fractions", type=_fractions, default=(0.25, 0.5, 0.75),
                   help="cut points of the fractions fallback, e.g. 0.25,0.5,0.75")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples for the CIs")
    p.add_argument("--json", default=None,
                   help="report path (the CSV and PNG go beside it; default: TRAIN_OUT_DIR/probe/probe_<student>.json)")


def run(args: argparse.Namespace) -> int:
    from jopd.lab import probe as probelib
    from jopd.lab.runs import build_at_checkpoint
    from jopd.run.config import load_config

    if args.problems is not None and args.problems < 1:
        raise ValueError(f"--problems: must be >= 1, got {args.problems}")
    if args.samples < 0:
        raise ValueError(f"--samples: must be >= 0, got {args.samples}")
    if args.step is not None and args.checkpoint is None:
        raise ValueError("--step: needs --checkpoint")
    cfg = load_config(args.config, args.overrides)
    run_, state, at = build_at_checkpoint(cfg, args.checkpoint, args.step, log=lambda m: print(m, file=sys.stderr))
    student = "start" if at is None else f"step_{at}"
    options = probelib.ProbeOptions(samples=args.samples, student_greedy=args.greedy_student, cut=args.cut,
                                    fractions=args.fractions, resamples=args.resamples, progress=sys.stderr.isatty())
    where = f"{args.checkpoint} step {at}" if args.checkpoint else "the config's starting student"
    out = Path(args.json) if args.json else Path(cfg.train.out_dir) / "probe" / f"probe_{student}.json"
    # one probe per (teacher, task) it teaches: several teachers are each probed on their own tasks' prefixes
    for label, teacher, source in probelib.probe_pairs(run_):
        problems = list(source.problems(cfg.data, "heldout"))[: args.problems or cfg.train.eval_problems]
        report = probelib.probe(run_, state.params, problems, options=options, teacher=teacher, source=source)
        print(f"teacher-reliability probe{f' [{label}]' if label else ''}; student: {where}")
        print(report.table())
        report.settings["student"] = where
        path = out if not label else out.with_name(f"{out.stem}_{label.replace('/', '_')}{out.suffix}")
        paths = report.save(path, title=f"teacher reliability{f' [{label}]' if label else ''} — student: {where}")
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0
