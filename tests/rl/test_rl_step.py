"""GRPO / REINFORCE through the production step (`opd.step.build_step`, the loop's `build` and `train`): the
clipped ratio is 1 at the first inner update when sampler == trainer (and not under rollout noise), inner
updates count as one step, a tiny GRPO run raises the training reward, and the running-mean baseline survives
checkpoint/resume bit for bit."""

import json

import jax
import numpy as np
import optax
import pytest
import yaml

from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.run.loop import train
from jopd.run import model_sources
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from tests.helpers.tiny_params import numpy_params
from tests.helpers.xla_test_flags import compiled_for_speed

_ARCH = ["hidden_size=16", "intermediate_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim=8"]
RANDOM = ([f"{role}.arch.{a}" for role in ("student", "teacher") for a in _ARCH]
          + ["loss.kind=grpo", "data.batch_size=4", "rl.group_size=4", "data.max_prompt_len=64",
             "sampling.max_new_tokens=8", "sampling.top_p=0.9", "data.arithmetic.max_steps=1",
             "train.mismatch=estimators", "optim.learning_rate=0.05", "optim.warmup_steps=0", "mesh.data=1"])


def _random_step(*overrides):
    """The production step on random tiny models (no SFT): the toy tokenizer decodes rewards."""
    tok = build_toy_tokenizer()
    cfg = load_config(None, RANDOM + list(overrides))
    s_cfg, t_cfg = (model_sources.testbed_model_config(src, tok) for src in (cfg.student, cfg.teacher))
    mesh = M.make_mesh(cfg.mesh, jax.devices()[:1])
    step = build_step(cfg, s_cfg, (t_cfg,), mesh, tok)
    student = numpy_params(s_cfg, 0, layer_scale=5.0, head_scale=20.0)  # peaked, context-dependent
    teacher = jax.device_put((numpy_params(t_cfg, 1),), step.shardings.teacher)
    batch = next(train_iterator(cfg.data, tok, kind="prompt"))
    return step, student, teacher, batch


def _adam_count(state) -> int:
    (_, count), *_ = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
    return int(count)


def test_ratio_is_one_at_the_first_inner_update_when_sampler_equals_trainer():
    step, student, teacher, batch = _random_step("rl.inner_updates=3", "loss.kl_coef=0.1")
    state = step.init_state(student)
    reference = step.place_reference(student)
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(state, batch, 0)
        scored = step.score(teacher, rollout, reference)
        first_state, first = step.update(state, scored)
    assert rollout.rewards_B.shape == (16,) and float(first["num_tokens"]) > 0
    # unprocessed sampler log-probs (before top-p renormalization) = the trainer's: r = 1 to float precision
    assert abs(float(first["ratio_mean"]) - 1.0) < 1e-6 and float(first["mismatch_max_abs_dprob"]) < 1e-6
    assert float(first["clip_frac"]) == 0.0
    assert abs(float(first["kl_ref"])) < 1e-6  # the reference is the starting student
    # the processed log-probs (top-p renormalized) are not the trainer's: a ratio against them would not be 1
    sample = jax.device_get(rollout.sample)
    valid = np.arange(8)[None] < sample.lengths_B[:, None]
    assert np.max(np.where(valid, sample.logprobs_BxN - sample.unprocessed_logprobs_BxN, 0.0)) > 1e-3
    with pytest.raises(ValueError, match=r"loss.kl_coef=0.1: OPDStep.score needs the reference params"):
        step.score(teacher, rollout)

    # the step: 3 optimizer updates on one scored batch, one step on the counter the loop and resume use. A
    # reference away from the student makes every inner update move (the tiny random student's rewards may all tie)
    away = step.place_reference(jax.tree.map(lambda x: x * 1.05, student))
    with jax.set_mesh(step.mesh):
        _, first = step.update(step.init_state(student), step.score(teacher, rollout, away))
        state, metrics, _ = step(step.init_state(student), teacher, batch, 0, away)
    assert int(state.step) == 1 and _adam_count(state) == 3
    assert metrics["mismatch_k3"] == first["mismatch_k3"]  # rollout metrics: from the first inner update
    assert float(first["update_norm"]) > 0
    assert float(metrics["update_norm"]) != float(first["update_norm"])  # the rest: averaged over the three


def test_rollout_mismatch_moves_the_ratio_at_the_first_inner_update():
    """Logit noise in the rollout engine (sampler != trainer): the ratio differs from 1 before any update,
    which is the mismatch the clip and `loss.is_mode` then act on."""
    step, student, teacher, batch = _random_step("rollout_precision.logit_noise=1.0")
    state = step.init_state(student)
    with jax.set_mesh(step.mesh):
        _, m = step.update(state, step.score(teacher, step.rollout(state, batch, 0)))
    assert abs(float(m["ratio_mean"]) - 1.0) > 1e-3 and float(m["mismatch_k3"]) > 1e-3


# -- tiny runs with an SFT-trained student (cached per module) -----------------------------------------------------

_SFT_ARCH = ["hidden_size=32", "intermediate_size=64", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim=16"]
LEARNER = ([f"student.arch.{a}" for a in _SFT_ARCH] + [f"teacher.arch.{a}" for a in _ARCH]
           + ["student.warm_start.steps=150", "student.warm_start.learning_rate=1e-2", "teacher.warm_start.steps=0",
              "data.arithmetic.max_steps=1", "data.arithmetic.max_number=5", "data.arithmetic.heldout_size=16",
              "data.max_prompt_len=48", "data.max_response_len=24", "sampling.max_new_tokens=16",
              "data.eval_batch_size=16", "train.mismatch=estimators", "optim.warmup_steps=0"])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("rl_cache")


@pytest.mark.slow
def test_tiny_grpo_run_raises_the_training_reward(cache):
    """16 prompts x 8 samples, 2 inner updates per batch, 100 steps: the mean training reward of the second half
    beats the first 10 steps' by a margin well above the step-to-step noise (the student starts near 15%). The
    comparison uses the whole second half, not the last few steps: the reward wanders by a few points between
    windows."""
    cfg = load_config(None, LEARNER + ["loss.kind=grpo", "data.batch_size=16", "rl.group_size=8",
                                       "rl.inner_updates=2", "optim.learning_rate=3e-3", "train.steps=100",
                                       f"train.cache_dir={cache}"])
    tok = model_sources.run_tokenizer(cfg)
    (s_cfg, student, _), (t_cfg, teacher, _) = (model_sources.get_model(r, getattr(cfg, r), cfg, tok)
                                                for r in ("student", "teacher"))
    # one device (the loop would take all 8 simulated ones: the same step, several times slower on 2 cores)
    step = build_step(cfg, s_cfg, (t_cfg,), M.make_mesh(cfg.mesh, jax.devices()[:1]), tok)
    state, teacher = step.init_state(student), jax.device_put((teacher,), step.shardings.teacher)
    it = train_iterator(cfg.data, tok, kind="prompt")
    rewards = []
    for n in range(cfg.train.steps):
        with jax.set_mesh(step.mesh), compiled_for_speed():
            state, metrics, rollout = step(state, teacher, next(it), n)
        rewards.append(float(np.mean(jax.device_get(rollout.rewards_B))))
    first, last = np.mean(rewards[:10]), np.mean(rewards[50:])
    assert 0.02 < first < 0.5, first  # the task is learnable from here: rewards > 0, not saturated
    assert last > first + 0.05, (first, last)
    assert np.isfinite(float(metrics["entropy"])) and 0 <= float(metrics["clip_frac"]) < 1


def _reinforce_cfg(cache, out, steps):
    over = LEARNER + ["loss.kind=reinforce", "rl.baseline=running_mean", "rl.baseline_decay=0.5", "data.batch_size=8",
                      "optim.learning_rate=3e-3", "optim.decay_steps=4", f"train.steps={steps}",
                      f"train.out_dir={out}", f"train.cache_dir={cache}", "train.eval_problems=16",
                      "train.eval_max_new_tokens=16", "train.log_rollouts=0", "checkpoint.async_save=false"]
    return load_config(None, over)


def _training_rows(run_dir):
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.mark.slow
def test_running_mean_baseline_resumes_bit_identically(cache, tmp_path):
    straight = train(_reinforce_cfg(cache, tmp_path / "straight", 4), log=lambda *_: None)
    train(_reinforce_cfg(cache, tmp_path / "resumed", 2), log=lambda *_: None)
    logs = []
    resumed = train(_reinforce_cfg(cache, tmp_path / "resumed", 4), log=logs.append)
    assert any("resumed from" in str(x) and "step 2" in str(x) for x in logs)
    a, b = straight["state"], resumed["state"]
    assert float(a.reward_ema) > 0 and np.asarray(a.reward_ema) == np.asarray(b.reward_ema)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ra, rb = (_training_rows(tmp_path / d) for d in ("straight", "resumed"))
    assert [ra[s]["reward"] for s in (3, 4)] == [rb[s]["reward"] for s in (3, 4)]
    assert {"reward", "reward_std", "entropy", "response_at_cap"} <= set(ra[4])
    assert yaml.safe_load((tmp_path / "straight" / "config.yaml").read_text())["rl"]["baseline"] == "running_mean"
