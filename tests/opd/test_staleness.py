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
from jopd.run.loop import build
from tests.helpers.tiny_testbed import tiny_cache, write_tiny
from tests.helpers.reference_kl import kl64, log_softmax64

REPO = Path(__file__).resolve().parents[2]
K = 2


def _trainer_logprobs(params, cfg, rollout):
    """The trainer's log-softmax at each response slot: one plain forward, full logits, float64 softmax."""
    a = rollout.arrays
    lay = sequence_layout(a.prompt_BxP, a.prompt_mask_BxP, a.sample.tokens_BxN, a.sample.lengths_B)
    logits, _ = transformer.forward(params, lay.tokens_BxS, cfg=cfg, attn_mask_BxT=lay.attn_mask_BxS)
    S, N = lay.tokens_BxS.shape[1], lay.targets_BxN.shape[1]
    return log_softmax64(np.asarray(logits)[:, S - N - 1:S - 1]), np.asarray(lay.response_mask_BxN)


def _config(tmp: Path, k: int, steps: int):
    path = write_tiny(tmp / "tiny.yaml", train={"steps": steps, "eval_problems": 8, "eval_max_new_tokens": 4},
                      optim={"learning_rate": 3e-2, "warmup_steps": 0},  # params that move: stale rollouts differ
                      rollout_precision={"logit_noise": 0.3},  # an engine part of its own
                      checkpoint={"every": 2, "keep": 3, "async_save": True})
    over = [f"train.cache_dir={tiny_cache()}", f"rollout.staleness={k}"]
    return path, over, load_config(str(path), [*over, f"train.out_dir={tmp / 'straight'}"])


def _steps(opd, state, teacher, data, start: int, stop: int):
    """Steps start..stop-1 as the loop runs them; each step's params before it (theta_t), batch, rollout, metrics."""
    params, batches, rollouts, metrics = [], [], [], []
    for t in range(start, stop):
        params.append(jax.device_get(state.params))  # before step t's update donates them
        batches.append(next(data))
        with jax.set_mesh(opd.mesh):
            state, m, rollout = opd(state, teacher, batches[-1], t)
        rollouts.append(rollout)
        metrics.append({key: float(v) for key, v in jax.device_get(m).items()})
    return state, params, batches, rollouts, metrics


def _sampled_by(opd, state, batch, t, params, v):
    """What `params` (saved, theta_v) sample with step t's row seeds and step v's weight sync."""
    with jax.set_mesh(opd.mesh):
        again = opd.rollout(state, batch, t, jax.device_put(params, opd.shardings.student), v)
    return np.asarray(again.sample.tokens_BxN)


def _bits(state):
    def raw(x):  # a typed PRNG key as its key data
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.tree.map(raw, jax.device_get(state)))]


def test_staleness_0_samples_step_t_with_the_params_of_step_t(tmp_path):
    _, _, cfg = _config(tmp_path, 0, 3)
    run, state = build(cfg, log=lambda *_: None)
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    assert not hasattr(state, "policies") and opd.copy_fn is None and opd.lagged_fn is None
    state, params, batches, rollouts, metrics = _steps(opd, state, run.teacher_params, data, 0, 3)
    for t in range(3):
        assert not any(key.startswith(("rollout_lag", "mismatch_kl_")) for key in metrics[t])
        tokens = np.asarray(rollouts[t].sample.tokens_BxN)
        np.testing.assert_array_equal(_sampled_by(opd, state, batches[t], t, params[t], t), tokens)


@pytest.mark.slow
def test_staleness_k_reproducible_split_exact_and_sigkill_resume_bit_identical(tmp_path):
    """k = 2, 6 steps: (1) step t's rollout is what the saved params of step t - k sample with step t's row seeds
    (and differ from step t's own once the lag is real); (2) the logged mismatch split equals numpy's from the
    sampler's log-softmax and two plain forwards, and its parts add up to mismatch_kl; (3) `jopd train` SIGKILLed
    after its step-2 checkpoint (the reliability test's machinery, one kill) resumes from that checkpoint — the
    window of past params restored with the state — to the straight run's final state, bit for bit."""
    steps = 6
    path, over, cfg = _config(tmp_path, K, steps)
    run, state = build(cfg, log=lambda *_: None)  # trains and caches the tiny models before the subprocess
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    assert len(state.policies) == K
    final, params, batches, rollouts, metrics = _steps(opd, state, run.teacher_params, data, 0, steps)
    for t in range(steps):
        v = max(t - K, 0)
        tokens = np.asarray(rollouts[t].sample.tokens_BxN)
        np.testing.assert_array_equal(_sampled_by(opd, final, batches[t], t, params[v], v), tokens)
        if t >= K:  # the lag matters: step t's own params sample other tokens
            assert not np.array_equal(_sampled_by(opd, final, batches[t], t, params[t], t), tokens)
        m = metrics[t]
        assert m["rollout_lag"] == t - v
        # numpy's split: q the sampler's, r = the trainer at theta_v, p = the trainer at theta_t
        log_q = np.asarray(rollouts[t].sample.full_logprobs_BxNxV, np.float64)
        log_r, mask = _trainer_logprobs(params[v], opd.student_cfg, rollouts[t])
        log_p, _ = _trainer_logprobs(params[t], opd.student_cfg, rollouts[t])
        ref = {"mismatch_kl": kl64(log_q, log_p), "mismatch_kl_engine": kl64(log_q, log_r),
               "mismatch_kl_staleness": kl64(log_r, log_p)}
        for name, kl in ref.items():
            np.testing.assert_allclose(m[name], kl[mask].mean(), rtol=2e-3, atol=1e-6, err_msg=f"step {t} {name}")
        parts = m["mismatch_kl_engine"] + m["mismatch_kl_staleness"] + m["mismatch_kl_cross"]
        np.testing.assert_allclose(parts, m["mismatch_kl"], rtol=1e-4, atol=1e-7)
        # the IS weights' ESS, staleness included: ratios p(y)/q(y) of the sampled tokens against the current params
        at = lambda lp: np.take_along_axis(lp, tokens[..., None].astype(np.int64), -1)[..., 0][mask]
        ratio = np.exp(at(log_p) - at(log_q))
        np.testing.assert_allclose(m["is_ess"], ratio.sum() ** 2 / (ratio.size * (ratio ** 2).sum()), rtol=1e-3)
        if t == 0:
            assert m["mismatch_kl_staleness"] < 1e-6 and abs(m["mismatch_kl_cross"]) < 1e-6
        elif t >= K:
            assert m["mismatch_kl_staleness"] > 1e-3  # a real lag, measured as such

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jopd.cli", "train", str(path), *over, f"train.out_dir={out}"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline and not (out / "checkpoints" / "2").is_dir():
        time.sleep(0.005)  # step 2's checkpoint committed: a kill now lands mid-run
    time.sleep(float(np.random.default_rng(0).uniform(0, 0.05)))
    assert proc.poll() is None, "finished before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # what the loop does on a restart (`restore_latest` of the state and the Grain iterator), then its steps
    with Checkpointer(CheckpointConfig(dir=str(out / "checkpoints"))) as ckpt:
        restored = ckpt.restore_latest(opd.abstract_state(), train_iterator(cfg.data, run.tokenizer, kind="prompt"))
    assert restored is not None and restored.step < steps
    resumed = _steps(opd, restored.state, run.teacher_params, restored.iterator, restored.step, steps)[0]
    assert _bits(resumed) == _bits(final)  # params, optimizer state, step, key and the window of past params


@pytest.mark.parametrize("value, message", [
    (-1, r"^RunConfig\.rollout\.staleness: Input should be greater than or equal to 0"),
    (3, r"^RunConfig\.rollout\.staleness=3: must be below train\.steps=3 "),
])
def test_bad_staleness_is_one_line_naming_the_field(tmp_path, value, message):
    path = write_tiny(tmp_path / "tiny.yaml")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(str(path), [f"rollout.staleness={value}"])
    assert "\n" not in str(err.value)


def test_split_parts_add_up_to_the_exact_kl_and_vanish_where_they_should():
    from jopd.losses.is_correction import exact_kl_BxT, staleness_split_BxT

    rng = np.random.default_rng(0)
    logits_q, logits_r, logits_p = (rng.normal(0, 2, (2, 3, 11)).astype(np.float32) for _ in range(3))
    log_q, log_r = log_softmax64(logits_q).astype(np.float32), log_softmax64(logits_r).astype(np.float32)
    split = {k: np.asarray(v, np.float64) for k, v in staleness_split_BxT(log_q, log_r, logits_p / 0.7, 1.0).items()}
    log_p = log_softmax64(logits_p / 0.7)
    np.testing.assert_allclose(split["engine"], kl64(log_q, log_r), rtol=1e-5)
    np.testing.assert_allclose(split["staleness"], kl64(log_r, log_p), rtol=1e-5)
    total = np.asarray(exact_kl_BxT(log_q, logits_p, 0.7), np.float64)
    np.testing.assert_allclose(split["engine"] + split["staleness"] + split["cross"], total, rtol=1e-5)
    same_engine = staleness_split_BxT(log_q, log_q, logits_p, 1.0)  # q = r: all of it is staleness
    assert float(np.abs(same_engine["engine"]).max()) < 1e-6 and float(np.abs(same_engine["cross"]).max()) < 1e-6
    no_lag = staleness_split_BxT(log_q, log_r, logits_r, 1.0)  # r = p: all of it is engine
    assert float(np.abs(no_lag["staleness"]).max()) < 1e-6 and float(np.abs(no_lag["cross"]).max()) < 1e-6
