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

    from jopd.lab.runs import build_at_checkpoint, checkpoint_dir, run_config
    from jopd.models import io

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    cfg = run_config(args.run_dir)
    run_, state, step = build_at_checkpoint(cfg, checkpoint_dir(cfg), args.step,
                                            log=lambda m: print(m, file=sys.stderr))
    path = io.save_hf(jax.device_get(state.params), run_.step.student_cfg, out, tokenizer=run_.tokenizer)
    print(f"wrote the student of {args.run_dir} at step {step} to {path}")
    return 0
