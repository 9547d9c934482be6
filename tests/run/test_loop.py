"""The OPD loop end to end on a tiny testbed (12 steps; 6 + restart + 6 for the resume check): it lowers held-out teacher divergence, resumes bit-identically,
and turns SIGTERM into a checkpoint + exit 0 that a restart continues from."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jopd.run.config import load_config
from jopd.run.loop import train

TINY = {
    "teacher": {"arch": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                         "num_kv_heads": 1, "head_dim": 16},
                "warm_start": {"steps": 60, "batch_size": 32, "learning_rate": 1e-2}},
    "student": {"arch": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2,
                         "num_kv_heads": 1, "head_dim": 8},
                "warm_start": {"steps": 20, "batch_size": 32, "learning_rate": 1e-2}},
    "data": {"batch_size": 8, "eval_batch_size": 16, "arithmetic": {"max_steps": 2, "max_number": 9, "heldout_size": 64}},
    "sampling": {"max_new_tokens": 12},
    "loss": {"top_k": 32},
    "optim": {"learning_rate": 1e-2, "warmup_steps": 0, "decay_steps": 12},
    "train": {"steps": 12, "eval_problems": 32, "eval_max_new_tokens": 12, "log_rollouts": 1},
    "checkpoint": {"every": 1000, "async_save": False},
}


def _cfg(tmp: Path, out: str, **train):
    over = [f"train.out_dir={tmp / out}", f"train.cache_dir={tmp / 'cache'}"]
    over += [f"train.{k}={v}" for k, v in train.items()]
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return load_config(str(path), over)


def _indices(out: Path):
    return [json.loads(line)["index"] for line in (out / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opd")
    return tmp, train(_cfg(tmp, "straight"), log=lambda *_: None)


@pytest.mark.slow
def test_opd_lowers_heldout_teacher_divergence(straight):
    _, summary = straight
    before, after = summary["before"]["teacher_divergence"], summary["after"]["teacher_divergence"]
    assert after < 0.9 * before, (before, after)


def test_resume_is_bit_identical(straight):
    tmp, full = straight
    first = train(_cfg(tmp, "resumed", steps=6), log=lambda *_: None)
    assert first["steps"] == 6
    logs = []
    second = train(_cfg(tmp, "resumed"), log=logs.append)
    assert any("resumed from" in str(x) and "step 6" in str(x) for x in logs)
    assert _indices(tmp / "resumed") == _indices(tmp / "straight")  # same data order across the restart
    for a, b in zip(jax.tree.leaves(second["state"].params), jax.tree.leaves(full["state"].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_saves_and_restart_continues(straight):
    tmp, _ = straight
    out = tmp / "preempted"
    cfg_path = tmp / "long.yaml"
    cfg_path.write_text(yaml.safe_dump(TINY | {"train": TINY["train"] | {"steps": 400}}))
    cmd = [sys.executable, "-m", "jopd.cli", "train", str(cfg_path), f"train.out_dir={out}",
           f"train.cache_dir={tmp / 'cache'}"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum(1 for _ in metrics.open()) >= 3:  # eval/before + 2 steps logged
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and 2 <= saved[-1] < 400, output
    logs = []
    cfg = _cfg(tmp, "preempted", steps=saved[-1] + 1)
    resumed = train(cfg, log=logs.append)
    assert any(f"at step {saved[-1]}" in str(x) for x in logs), logs
    assert resumed["steps"] == saved[-1] + 1
