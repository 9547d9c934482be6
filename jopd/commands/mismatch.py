"""Measure a rollout engine's mismatch with the trainer, without training: exact KL per response token, with CIs.

    jopd mismatch CONFIG [key=value ...] [--checkpoint DIR] [--step N] [--staleness K] [--batches 4] [--json OUT]

(overrides follow the config directly, before the options; e.g. rollout_precision.logit_noise=0.5)

Samples --batches training batches of prompts with the config's rollout engine (`rollout_precision`,
`sampling`) through the OPD step's own rollout, with the student at a checkpoint (default: the config's
starting student, e.g. the testbed's warm start), and compares every visited position with the trainer's
fp32 forward: exact full-vocabulary KL(sampler || trainer), k1, k3, mean/max |dprob| and the IS effective
sample size, each with a 95% bootstrap CI over prompts, and the wall time; for a mixture-of-experts student also
the routing flips (the share of router decisions and of tokens whose experts differ between the sampler and the
trainer), with `train.routing_replay=true` against the trainer's replayed forward. The prompts and the sampler's
random draws depend only on data.seed and train.seed, so two engines measured alike see the same prompts.

--staleness K (with --checkpoint): the offline measure of bounded staleness (`rollout.staleness`). The rollouts
are sampled by the engine with the student of checkpoint step N - K and compared with the trainer at step N (N:
--step, default the latest); both steps must be saved (`checkpoint.every`, `checkpoint.keep`). The exact KL is
reported as before and split per token as the train step logs it: engine = KL(q || r), staleness = KL(r || p),
cross = sum (q - r)(log r - log p), with q the engine at N - K, r the trainer's numerics at N - K, p the trainer at
N; the parts add up to the total up to rounding. K = 0 is the plain report (bit for bit), its staleness part 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (the candidate rollout engine is its rollout_precision)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout_precision.compute_dtype=bf16")
    p.add_argument("--checkpoint", default=None,
                   help="a `jopd train` checkpoint directory (RUN_DIR/checkpoints) or RUN_DIR to take the student from")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--staleness", type=int, default=None, metavar="K",
                   help="sample with the student of checkpoint step N-K (N: --step), compare with the trainer at "
                        "step N, and split the KL into its engine and staleness parts; needs --checkpoint, and both "
                        "steps kept (checkpoint.every, checkpoint.keep)")
    p.add_argument("--batches", type=int, default=4, help="batches of data.batch_size prompts to sample")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples for the CIs")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


def run(args: argparse.Namespace) -> int:
    from jopd.lab.mismatch import measure_config
    from jopd.run.config import load_config

    if args.batches < 1:
        raise ValueError(f"--batches: must be >= 1, got {args.batches}")
    cfg = load_config(args.config, [*args.overrides, "train.mismatch=exact"])
    report, at = measure_config(cfg, args.checkpoint, args.step, args.batches, args.resamples,
                                log=lambda m: print(m, file=sys.stderr), staleness=args.staleness)
    where = f"{args.checkpoint} step {at}" if args.checkpoint else "the config's starting student"
    if report.split is not None:
        where += f", rollouts sampled at step {report.split.sampler_step} (staleness {report.split.staleness})"
    replay = ", routing replay" if cfg.train.routing_replay else ""
    print(f"rollout engine {cfg.rollout_precision} vs trainer ({cfg.student.dtype}{replay}); student: {where}")
    print(report.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_dict() | {
            "rollout_precision": dataclasses.asdict(cfg.rollout_precision), "student_step": at}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
