"""Reliability of `jopd train` under abuse: SIGKILL at random moments (one of them in the middle of an async
checkpoint write) and restarts end with params bit-identical to an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jopd.run.checkpoint import CheckpointConfig, Checkpointer
from jopd.run.loop import build, train
from jopd.run.config import load_config
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

REPO = Path(__file__).resolve().parents[2]
STEPS = 16
KILLS = 3  # each kill costs a process start (jax import, compile): three, one of them mid-write, cover the cases


def _cfg_file(tmp: Path) -> Path:
    return write_tiny(tmp / "tiny.yaml", train={"steps": STEPS, "eval_problems": 16, "eval_max_new_tokens": 8},
                      checkpoint={"every": 2, "keep": 3, "async_save": True})


def _final_params(abstract_state, out_dir: str):
    with Checkpointer(CheckpointConfig(dir=str(Path(out_dir) / "checkpoints"))) as ckpt:
        restored = ckpt.restore(STEPS, abstract_state)
    return jax.device_get(restored.state.params)


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def _writing(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any("tmp" in p.name for p in ckpt_dir.iterdir())


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
    cfg_path = _cfg_file(tmp_path)
    common = [f"train.cache_dir={tiny_cache()}"]
    straight = load_config(str(cfg_path), [*common, f"train.out_dir={tmp_path / 'straight'}"])
    train(straight, log=lambda *_: None)  # also trains and caches the tiny testbed models

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jopd.cli", "train", str(cfg_path), *common, f"train.out_dir={out}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = np.random.default_rng(0)
    metrics, ckpt_dir = out / "metrics.jsonl", out / "checkpoints"
    kills, caught_write = 0, False
    while kills < KILLS:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = _lines(metrics) + int(rng.integers(1, 5))  # a few more steps logged, then a random instant
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline and _lines(metrics) < target:
            time.sleep(0.01)
        if kills == 1:  # this kill lands inside an async checkpoint write (orbax's tmp directory exists)
            while proc.poll() is None and time.time() < deadline and not _writing(ckpt_dir):
                time.sleep(0.001)
        else:
            time.sleep(float(rng.uniform(0, 0.3)))
        if proc.poll() is not None:
            break  # finished before the kill: nothing left to interrupt
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        caught_write |= kills == 1 and _writing(ckpt_dir)
        kills += 1
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert kills == KILLS and caught_write  # every kill landed, one of them mid-write: that step was never restored
    abstract = build(straight, log=lambda *_: None)[0].step.abstract_state()  # the same config but its out_dir
    a, b = _final_params(abstract, straight.train.out_dir), _final_params(abstract, str(out))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


TIMING = ("step_time_s", "tokens_per_s")


@pytest.mark.slow
def test_same_config_and_seed_give_identical_metrics(tmp_path):
    import json

    cfg_path = write_tiny(tmp_path / "tiny.yaml", train={"steps": 4, "eval_problems": 8},
                          rollout_precision={"logit_noise": 0.5, "weight_noise": 0.01})  # every random stream on
    logs = []
    for name in ("a", "b"):
        cfg = load_config(str(cfg_path), [f"train.cache_dir={tiny_cache()}", f"train.out_dir={tmp_path / name}"])
        train(cfg, log=lambda *_: None)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logs.append([{k: v for k, v in r.items() if k not in TIMING} for r in rows])
    assert len(logs[0]) >= 5 and logs[0] == logs[1]
