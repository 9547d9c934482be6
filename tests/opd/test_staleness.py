"""`rollout.staleness: k` (`jopd.opd.staleness`): step t samples with the params of step t - k, reproducibly; the
exact mismatch split into its engine / staleness / cross parts against numpy; one-line config errors; and a run
SIGKILLed with k > 0 resumes bit-identically (the window is checkpointed with the state)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import train_iterator
from jopd.models import transformer
from jopd.opd.batch import sequence_layout
from jopd.run.checkpoint import CheckpointConfig, Checkpointer
from jopd.run.config import load_config
from jopd.run.loop import build, train
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

REPO = Path(__file__).resolve().parents[2]
K = 2


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl(log_a, log_b):
    return (np.exp(log_a) * (log_a - log_b)).sum(-1)


def _trainer_logprobs(params, cfg, rollout):
    """The trainer's log-softmax at each response slot: one plain forward, full logits, float64 softmax."""
    a = rollout.arrays
    lay = sequence_layout(a.prompt_BxP, a.prompt_mask_BxP, a.sample.tokens_BxN, a.sample.lengths_B)
    logits, _ = transformer.forward(params, lay.tokens_BxS, cfg=cfg, attn_mask_BxT=lay.attn_mask_BxS)
    S, N = lay.tokens_BxS.shape[1], lay.targets_BxN.shape[1]
    return _log_softmax(np.asarray(logits)[:, S - N - 1:S - 1]), np.asarray(lay.response_mask_BxN)


@pytest.mark.parametrize("k", [0, K])
def test_step_t_samples_with_the_params_of_step_t_minus_k_and_the_split_is_exact(tmp_path, k):
    steps = 4
    path = write_tiny(tmp_path / "tiny.yaml", train={"steps": steps, "eval_problems": 8},
                      optim={"learning_rate": 3e-2, "warmup_steps": 0},  # params that move: stale rollouts differ
                      rollout_precision={"logit_noise": 0.3})  # an engine part of its own
    cfg = load_config(str(path), [f"train.cache_dir={tiny_cache()}", f"train.out_dir={tmp_path / 'out'}",
                                  f"rollout.staleness={k}"])
    run, state = build(cfg, log=lambda *_: None)
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    assert hasattr(state, "policies") == (k > 0)
    params, batches, rollouts, metrics = [], [], [], []
    for t in range(steps):
        params.append(jax.device_get(state.params))  # theta_t, before step t's update donates it
        batches.append(next(data))
        state, m, rollout = opd(state, run.teacher_params, batches[-1], t)
        rollouts.append(rollout)
        metrics.append({key: float(v) for key, v in jax.device_get(m).items()})
    for t in range(steps):
        v = max(t - k, 0)
        tokens = np.asarray(rollouts[t].sample.tokens_BxN)
        # what the saved params of step v sample with step t's row seeds (and step v's weight sync)
        again = opd.rollout(state, batches[t], t, jax.device_put(params[v], opd.shardings.student), v)
        np.testing.assert_array_equal(np.asarray(again.sample.tokens_BxN), tokens)
        if k == 0:
            assert not any(key.startswith(("rollout_lag", "mismatch_kl_")) for key in metrics[t])
            continue
        if t >= k:  # the lag matters: step t's own params sample other tokens
            now = opd.rollout(state, batches[t], t, jax.device_put(params[t], opd.shardings.student), t)
            assert not np.array_equal(np.asarray(now.sample.tokens_BxN), tokens)
        m = metrics[t]
        assert m["rollout_lag"] == t - v
        # numpy's split: q the sampler's, r = the trainer at theta_v, p = the trainer at theta_t
        log_q = np.asarray(rollouts[t].sample.full_logprobs_BxNxV, np.float64)
        log_r, mask = _trainer_logprobs(params[v], opd.student_cfg, rollouts[t])
        log_p, _ = _trainer_logprobs(params[t], opd.student_cfg, rollouts[t])
        ref = {"mismatch_kl": _kl(log_q, log_p), "mismatch_kl_engine": _kl(log_q, log_r),
               "mismatch_kl_staleness": _kl(log_r, log_p)}
        for name, kl in ref.items():
            np.testing.assert_allclose(m[name], kl[mask].mean(), rtol=2e-3, atol=1e-6, err_msg=f"step {t} {name}")
        parts = m["mismatch_kl_engine"] + m["mismatch_kl_staleness"] + m["mismatch_kl_cross"]
        np.testing.assert_allclose(parts, m["mismatch_kl"], rtol=1e-4, atol=1e-7)
        if t == 0:
            assert m["mismatch_kl_staleness"] < 1e-6 and abs(m["mismatch_kl_cross"]) < 1e-6
        elif t >= k:
            assert m["mismatch_kl_staleness"] > 1e-3  # a real lag, measured as such


@pytest.mark.parametrize("value, message", [
    (-1, r"^RunConfig\.rollout\.staleness: Input should be greater than or equal to 0"),
    (3, r"^RunConfig\.rollout\.staleness=3: must be below train\.steps=3 "),
])
def test_bad_staleness_is_one_line_naming_the_field(tmp_path, value, message):
    path = write_tiny(tmp_path / "tiny.yaml")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(str(path), [f"rollout.staleness={value}"])
    assert "\n" not in str(err.value)


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


@pytest.mark.slow
def test_sigkill_then_resume_with_staleness_is_bit_identical(tmp_path):
    """One SIGKILL at a random instant after the first checkpoint (the reliability test's machinery, smaller):
    the resumed run's final state — params, optimizer, and the window of past params — equals a straight run's."""
    steps = 6
    path = write_tiny(tmp_path / "tiny.yaml", train={"steps": steps, "eval_problems": 8, "eval_max_new_tokens": 4},
                      optim={"learning_rate": 3e-2, "warmup_steps": 0},
                      checkpoint={"every": 2, "keep": 3, "async_save": True})
    common = [f"train.cache_dir={tiny_cache()}", f"rollout.staleness={K}"]
    straight = load_config(str(path), [*common, f"train.out_dir={tmp_path / 'straight'}"])
    train(straight, log=lambda *_: None)

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jopd.cli", "train", str(path), *common, f"train.out_dir={out}"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline and _lines(out / "metrics.jsonl") < 4:
        time.sleep(0.01)  # the eval line and steps 1-3 logged: step 2's checkpoint is on its way
    time.sleep(float(np.random.default_rng(0).uniform(0, 0.2)))
    assert proc.poll() is None, "finished before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = load_config(str(path), [*common, f"train.out_dir={out}"])
    logs = []
    train(resumed, log=logs.append)
    assert any(line.startswith("resumed from") for line in logs)

    finals = []
    for cfg in (straight, resumed):
        run, _ = build(cfg, log=lambda *_: None)
        with Checkpointer(CheckpointConfig(dir=str(Path(cfg.train.out_dir) / "checkpoints"))) as ckpt:
            finals.append(jax.device_get(ckpt.restore(steps, run.step.abstract_state()).state))
    a, b = (jax.tree.leaves(jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, f)) for f in finals)
    assert len(a) == len(b) and len(finals[0].policies) == K
    for x, y in zip(a, b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
