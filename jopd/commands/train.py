"""Run on-policy distillation: `jopd train CONFIG.yaml [key=value ...]` (resumes from the latest checkpoint)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default="configs/testbed.yaml",
                   help="YAML run config (default: configs/testbed.yaml, the CPU testbed)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.steps=20 loss.top_k=16")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    from jopd.run.config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)  # validation errors surface before any compute
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from jopd.run import device_split

    # rollout.placement=process with rollout.sampler_devices: this process keeps the devices the sampler process
    # leaves, set before anything starts jax's backend (on GPU / TPU a later restriction is impossible)
    device_split.restrict_trainer(cfg)
    from jopd.lab.probe import training_probe
    from jopd.run.loop import train

    summary = train(cfg, probe_hook=training_probe)  # the loop schedules train.probe_every; the lab measures
    if "stopped" in summary:  # a guard stopped the run (non-finite update, degenerate rollouts): say so, fail
        print(f"jopd train: stopped: {summary['stopped']}", file=sys.stderr)
        return 3
    return 0 if "after" in summary or summary["steps"] < cfg.train.steps else 1
