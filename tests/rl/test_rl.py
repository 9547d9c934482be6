"""RL baselines: advantages vs direct numpy formulas, and the policy-gradient loss vs its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.data.tasks import TASKS
from jopd.losses import LossBatch, LossConfig, RLConfig, token_loss_from_logits
from jopd.losses import advantages as adv_lib
from jopd.losses.kinds import OBJECTIVES
from jopd.opd import rewards as rl
from jopd.opd import validate


def test_grpo_advantages_are_group_normalized():
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1], np.float32)  # 3 prompts x 4 samples
    adv = adv_lib.grpo_advantages(rewards, 4)
    g = rewards.reshape(3, 4)
    expected = (g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(adv, expected.reshape(-1), rtol=1e-6)
    assert np.all(adv[4:8] == 0)  # all-correct group: no signal
    np.testing.assert_allclose(adv_lib.grpo_advantages(rewards, 4, normalize_std=False),
                               (g - g.mean(1, keepdims=True)).reshape(-1))


def test_reinforce_baseline_and_rewards():
    rewards = rl.correctness_rewards(TASKS['arithmetic'], ["so #### 12", "#### 7", "no answer"], ["12", "8", "3"])
    np.testing.assert_array_equal(rewards, [1, 0, 0])
    np.testing.assert_allclose(adv_lib.reinforce_advantages(rewards), rewards - 1 / 3, rtol=1e-6)


def test_repeat_for_groups_is_consecutive():
    out = rl.repeat_for_groups({"index": np.array([5, 9])}, 3)
    np.testing.assert_array_equal(out["index"], [5, 5, 5, 9, 9, 9])


def test_policy_gradient_loss_matches_its_definition():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 11, (2, 5)))
    mask = jnp.asarray(np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool))
    adv = jnp.asarray(np.repeat(np.array([[0.7], [-1.3]], np.float32), 5, axis=1))
    # the sampler's log-probs = the trainer's: grpo's ratio is 1, so its gradient is the plain policy gradient
    own = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    batch = LossBatch(targets_BxT=targets, response_mask_BxT=mask, advantages_BxT=adv, sampler_logprobs_BxT=own)
    for kind in ("reinforce", "grpo"):
        def ours(lg):
            return token_loss_from_logits(LossConfig(kind=kind), lg, batch)[0]

        def direct(lg):
            logp = jnp.take_along_axis(jax.nn.log_softmax(lg), targets[..., None], -1)[..., 0]
            return -jnp.sum(jnp.where(mask, adv * logp, 0.0)) / jnp.sum(mask)

        np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(direct)(logits), atol=1e-6)


def test_grpo_advantages_zero_mean_unit_scale_and_all_equal_groups():
    rewards = np.random.default_rng(0).integers(0, 2, 64).astype(np.float32)
    rewards[:8] = 1.0  # two all-correct groups
    rewards[8:12] = 0.0  # one all-wrong group
    for normalize in (True, False):
        g = adv_lib.grpo_advantages(rewards, 4, normalize_std=normalize).reshape(16, 4)
        np.testing.assert_allclose(g.mean(1), 0.0, atol=1e-6)
        assert np.all(g[:3] == 0.0)  # all-equal groups: no signal, exactly
    g = adv_lib.grpo_advantages(rewards, 4).reshape(16, 4)
    mixed = rewards.reshape(16, 4).std(1) > 0
    np.testing.assert_allclose(g[mixed].std(1), 1.0, rtol=1e-4)  # unit scale (population std, as normalized)
    with pytest.raises(ValueError, match="group_size=3 does not divide the rollout batch 64"):
        adv_lib.grpo_advantages(rewards, 3)


def test_leave_one_out_baseline_matches_the_formula():
    rewards = np.random.default_rng(1).integers(0, 2, 9).astype(np.float32)
    adv = adv_lib.reinforce_advantages(rewards, "leave_one_out")
    expected = [rewards[i] - np.mean(np.delete(rewards, i)) for i in range(len(rewards))]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)
    # = n / (n - 1) x the batch-mean advantage
    np.testing.assert_allclose(adv, 9 / 8 * adv_lib.reinforce_advantages(rewards), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="leave_one_out needs >= 2 rollouts"):
        adv_lib.reinforce_advantages(rewards[:1], "leave_one_out")


def test_running_baseline_is_the_bias_corrected_ema_of_previous_batch_means():
    means, decay = [0.1, 0.5, 0.3, 0.9], 0.8
    ema = np.float32(0.0)
    assert rl.running_baseline(ema, 0, decay) is None  # no history: the batch mean is used
    np.testing.assert_allclose(adv_lib.reinforce_advantages(np.array([1, 0], np.float32), "running_mean", None), [0.5, -0.5])
    for n, m in enumerate(means, start=1):
        ema = rl.ema_update(ema, m, decay)
        assert isinstance(ema, np.float32)
        w = decay ** np.arange(n - 1, -1, -1)  # weights of batches 1..n
        np.testing.assert_allclose(rl.running_baseline(ema, n, decay), np.sum(w * means[:n]) / w.sum(), rtol=1e-6)
    np.testing.assert_allclose(adv_lib.reinforce_advantages(np.array([1, 0], np.float32), "running_mean", 0.25),
                               [0.75, -0.25])


def test_rl_settings_a_kind_cannot_honour_are_one_line_errors():
    from jopd.config_dataclass import ConfigError, build

    with pytest.raises(ValueError, match=r"rl.inner_updates=2: loss.kind=reinforce does not reuse a rollout batch"):
        validate.check_rl("reinforce", OBJECTIVES["reinforce"], RLConfig(inner_updates=2))
    with pytest.raises(ValueError, match=r"rl.baseline=leave_one_out: loss.kind=grpo does not use it"):
        validate.check_rl("grpo", OBJECTIVES["grpo"], RLConfig(baseline="leave_one_out"))
    validate.check_rl("grpo", OBJECTIVES["grpo"], RLConfig(inner_updates=4))
    validate.check_rl("reinforce", OBJECTIVES["reinforce"], RLConfig(baseline="leave_one_out"))
    for field, value in (("inner_updates", 0), ("baseline_decay", 1.0)):
        with pytest.raises(ConfigError, match=rf"^rl\.{field}: "):
            build(RLConfig, {field: value}, "rl")
    for field, value in (("options.clip_eps", 0.0), ("kl_coef", -1)):  # the per-token settings are the loss's
        key, _, option = field.partition(".")
        data = {"kind": "grpo", "options": {option: value}} if option else {field: value}
        with pytest.raises(ConfigError, match=rf"^loss\.{field}: "):
            build(LossConfig, data, "loss")
    with pytest.raises(ConfigError, match=r"^rl\.baseline: "):
        build(RLConfig, {"baseline": "median"}, "rl")


@pytest.mark.parametrize("baseline", ["batch_mean", "leave_one_out", "running_mean"])
def test_reinforce_on_a_two_armed_bandit_raises_the_expected_reward(baseline):
    """One-token episodes over a 2-token vocabulary: arm 1 pays 1 with probability 0.8, arm 0 with 0.2. The
    optimum is pi(arm 1) = 1. Plain SGD on `token_loss_from_logits` (kind reinforce) from the uniform policy."""
    pay = np.array([0.2, 0.8])
    rng = np.random.default_rng(0)
    theta = jnp.zeros(2)
    cfg = LossConfig(kind="reinforce")
    grad_fn = jax.jit(jax.grad(lambda th, b: token_loss_from_logits(cfg, jnp.broadcast_to(th, (32, 1, 2)), b)[0]))
    expected = lambda th: float(jax.nn.softmax(th) @ pay)  # noqa: E731
    start, ema = expected(theta), np.float32(0.0)
    for step in range(60):
        arms = rng.random(32) < float(jax.nn.softmax(theta)[1])
        rewards = (rng.random(32) < pay[arms.astype(int)]).astype(np.float32)
        running = rl.running_baseline(ema, step, 0.9)
        adv = OBJECTIVES["reinforce"].advantages(rewards, RLConfig(baseline=baseline), running)
        ema = rl.ema_update(ema, rewards.mean(), 0.9)
        batch = LossBatch(targets_BxT=jnp.asarray(arms[:, None].astype(np.int32)),
                          response_mask_BxT=jnp.ones((32, 1), bool), advantages_BxT=jnp.asarray(adv[:, None]))
        theta = theta - 1.0 * grad_fn(theta, batch)
    assert start == pytest.approx(0.5)
    assert expected(theta) > 0.7, (baseline, expected(theta))  # most of the way to the optimum 0.8
    assert float(jax.nn.softmax(theta)[1]) > 0.8


def test_rl_per_token_settings_from_older_configs_land_in_the_loss_config(tmp_path):
    """`rl.kl_coef` / `token_sum_norm` are `loss.*` now, `rl.clip_eps` / `clip_eps_high` grpo's `loss.options.*`; a
    run's saved config from before (both copies, the loss one at its default) and a command-line `rl.*` override
    still load."""
    import yaml

    from jopd.config_dataclass import ConfigError
    from jopd.run.config import load_config

    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"rl": {"group_size": 2, "kl_coef": 0.05, "clip_eps": 0.3, "token_sum_norm": True},
                                     "loss": {"kind": "grpo", "kl_coef": 0.0, "clip_eps": 0.2}}))
    cfg = load_config(str(saved))
    assert (cfg.loss.kl_coef, cfg.loss.options.clip_eps, cfg.loss.token_sum_norm, cfg.rl.group_size) == (0.05, 0.3, True, 2)
    assert load_config(None, ["rl.kl_coef=0.1"]).loss.kl_coef == 0.1
    assert load_config(str(saved), ["loss.kl_coef=0.2", "rl.kl_coef=0.0"]).loss.kl_coef == 0.2
    with pytest.raises(ConfigError, match=r"^RunConfig.rl.kl_coef=0.1 and loss.kl_coef=0.2: set loss.kl_coef only"):
        load_config(None, ["rl.kl_coef=0.1", "loss.kl_coef=0.2"])
