"""RL baselines: advantages vs direct numpy formulas, and the policy-gradient loss vs its definition."""

import jax
import jax.numpy as jnp
import numpy as np

from jopd import rl
from jopd.losses import LossBatch, LossConfig, token_loss_from_logits


def test_grpo_advantages_are_group_normalized():
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1], np.float32)  # 3 prompts x 4 samples
    adv = rl.grpo_advantages(rewards, 4)
    g = rewards.reshape(3, 4)
    expected = (g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(adv, expected.reshape(-1), rtol=1e-6)
    assert np.all(adv[4:8] == 0)  # all-correct group: no signal
    np.testing.assert_allclose(rl.grpo_advantages(rewards, 4, normalize_std=False),
                               (g - g.mean(1, keepdims=True)).reshape(-1))


def test_reinforce_baseline_and_rewards():
    rewards = rl.correctness_rewards(["so #### 12", "#### 7", "no answer"], ["12", "8", "3"])
    np.testing.assert_array_equal(rewards, [1, 0, 0])
    np.testing.assert_allclose(rl.reinforce_advantages(rewards), rewards - 1 / 3, rtol=1e-6)


def test_repeat_for_groups_is_consecutive():
    out = rl.repeat_for_groups({"index": np.array([5, 9])}, 3)
    np.testing.assert_array_equal(out["index"], [5, 5, 5, 9, 9, 9])


def test_policy_gradient_loss_matches_its_definition():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 11, (2, 5)))
    mask = jnp.asarray(np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool))
    adv = jnp.asarray(np.repeat(np.array([[0.7], [-1.3]], np.float32), 5, axis=1))
    batch = LossBatch(targets_BxT=targets, response_mask_BxT=mask, advantages_BxT=adv)
    for kind in ("reinforce", "grpo"):
        def ours(lg):
            return token_loss_from_logits(LossConfig(kind=kind), lg, batch)[0]

        def direct(lg):
            logp = jnp.take_along_axis(jax.nn.log_softmax(lg), targets[..., None], -1)[..., 0]
            return -jnp.sum(jnp.where(mask, adv * logp, 0.0)) / jnp.sum(mask)

        np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(direct)(logits), atol=1e-6)
