"""The production OPD step (`opd.step.build_step`) on a (data 2, fsdp 2, tensor 2) mesh equals the same step on
one device: teacher scoring, the update, and the layouts it promises (batch over data x fsdp, optimizer moments
in their parameter's layout)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jopd.losses import LossConfig
from jopd.models.config import ModelConfig
from jopd.run.config import load_config
from jopd.opd.batch import RolloutArrays
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from jopd.sampling.config import SampleOutput
from tests.helpers.tiny_params import numpy_params

STUDENT = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, tie_word_embeddings=False)
TEACHER = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=12)
LOSS = LossConfig(kind="topk_rkl", top_k=8, chunk_size=5, special_token_ids=(3,), is_mode="tis", support="teacher_topk")
B, P, N = 8, 6, 7


def _step(mesh_overrides, devices, loss=LOSS):
    cfg = load_config(None, [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
                             "train.mismatch=estimators", "optim.learning_rate=1e-2", "optim.warmup_steps=0",
                             *mesh_overrides])
    return build_step(dataclasses.replace(cfg, loss=loss), STUDENT, (TEACHER,), M.make_mesh(cfg.mesh, devices))


def _rollout():
    """A sampled batch as the sampler returns it: left-padded prompts, responses of varied length."""
    rng = np.random.RandomState(0)
    prompt = rng.randint(4, 64, (B, P)).astype(np.int32)
    pmask = np.arange(P)[None] >= rng.randint(0, 4, (B, 1))
    lengths = rng.randint(1, N + 1, B).astype(np.int32)
    tokens = np.where(np.arange(N)[None] < lengths[:, None], rng.randint(3, 64, (B, N)), 0).astype(np.int32)
    logp = np.where(np.arange(N)[None] < lengths[:, None], rng.normal(-2, 0.5, (B, N)), 0).astype(np.float32)
    # the student's top-K ids per step (what the sampler hands the union support): K distinct ids per position
    topk = np.argsort(rng.rand(B, N, 64), axis=-1)[..., :LOSS.top_k].astype(np.int32)
    sample = SampleOutput(tokens_BxN=tokens, lengths_B=lengths, logprobs_BxN=logp, unprocessed_logprobs_BxN=logp,
                          done_B=np.ones(B, bool), topk_ids_BxNxK=topk)
    return prompt, pmask, sample


def _rel(a, b):
    return float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)) / optax.tree.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("support", ["teacher_topk", "union"])
def test_sharded_step_equals_single_device(support):
    loss = dataclasses.replace(LOSS, support=support)
    student = jax.tree.map(lambda x: 3 * x, numpy_params(STUDENT, seed=0))
    teacher = jax.tree.map(lambda x: 3 * x, numpy_params(TEACHER, seed=7))
    prompt, pmask, sample = _rollout()
    results = {}
    for name, over, devices in (("one", ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"], jax.devices()[:1]),
                                ("eight", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], jax.devices())):
        step = _step(over, devices, loss)
        state = step.init_state(student, seed=1)
        with jax.set_mesh(step.mesh):
            rollout = RolloutArrays(prompt_BxP=prompt, prompt_mask_BxP=pmask, sample=sample)
            batch = step.score_fn(jax.device_put((teacher,), step.shardings.teacher), rollout)
            new_state, metrics = step.update(state, batch)
        results[name] = (step, batch, new_state, metrics, state)

    one, eight = results["one"], results["eight"]
    assert one[1].loss.teacher_topk_ids_BxTxK.shape[-1] == loss.support_size  # K, or 2K for the union
    np.testing.assert_array_equal(eight[1].loss.teacher_topk_ids_BxTxK, one[1].loss.teacher_topk_ids_BxTxK)
    if support == "union":
        np.testing.assert_array_equal(eight[1].loss.support_mask_BxTxK, one[1].loss.support_mask_BxTxK)
    np.testing.assert_allclose(eight[1].loss.teacher_topk_logprobs_BxTxK, one[1].loss.teacher_topk_logprobs_BxTxK,
                               rtol=1e-5, atol=1e-6)
    loss1, loss8 = float(one[3]["loss"]), float(eight[3]["loss"])
    assert loss1 > 0 and abs(loss8 - loss1) <= 1e-5 * loss1
    assert float(one[3]["num_tokens"]) == float(eight[3]["num_tokens"]) > 0
    assert _rel(jax.device_get(eight[2].params), jax.device_get(one[2].params)) <= 1e-4
    assert _rel(jax.device_get(one[2].params), student) > 1e-4  # the update moved the params
    assert int(eight[2].step) == 1

    # the layouts production promises, on the 8-device mesh
    step8, batch8, state8 = eight[0], eight[1], eight[2]
    assert batch8.tokens_BxS.sharding.spec == step8.shardings.batch.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    assert batch8.loss.teacher_topk_ids_BxTxK.sharding.is_equivalent_to(step8.shardings.batch, 3)
    p_sh = step8.shardings.student
    assert state8.params["layers"]["q"].sharding == p_sh["layers"]["q"]
    assert state8.opt_state[1][0].mu["embed"].sharding == p_sh["embed"]  # Adam moments follow their param
    assert eight[4].params["embed"].is_deleted()  # the old state was donated to the update
