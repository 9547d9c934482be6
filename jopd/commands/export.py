"""Export a run's distilled student as a Hugging Face model directory (transformers and vLLM load it).

    jopd export RUN_DIR [--step N] --out DIR

Restores the student's parameters at step N (default: the latest checkpoint) of a `jopd train` output
directory and writes DIR/config.json, DIR/model.safetensors and the run's tokenizer (with its chat template).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a `jopd train` output directory (holds config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory (created; existing model files are replaced)")


def run(args: argparse.Namespace) -> int:
    import jax

    from jopd.lab.runs import checkpoint_dir, restore_state, run_config
    from jopd.models import io
    from jopd.opd import loop

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    cfg = run_config(args.run_dir)
    run_, _ = loop.build(cfg, log=lambda m: print(m, file=sys.stderr))
    state, step = restore_state(checkpoint_dir(cfg), run_.step.abstract_state(), args.step)
    path = io.save_hf(jax.device_get(state.params), run_.step.student_cfg, out, tokenizer=run_.tokenizer)
    print(f"wrote the student of {args.run_dir} at step {step} to {path}")
    return 0
