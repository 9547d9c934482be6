"""The OPD train step on a (data 2, fsdp 2, tensor 2) mesh equals the single-device step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jopd import mesh as M
from jopd.losses import LossConfig
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.objectives import rollout_loss_fn
from jopd.optim import OptimConfig, make_optimizer
from jopd.rollout import loss_batch, score_with_teacher, sequence_layout
from jopd.train_step import init_train_state, make_train_step

STUDENT = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, tie_word_embeddings=False)
TEACHER = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=12)
LOSS = LossConfig(kind="topk_rkl", top_k=8, chunk_size=5, special_token_ids=(3,))
B, P, N = 8, 6, 7


def _batch():
    """A rollout-shaped batch: left-padded prompts, responses of varied length, teacher top-K scores."""
    rng = np.random.RandomState(0)
    prompt = rng.randint(4, 64, (B, P))
    pmask = np.arange(P)[None] >= rng.randint(0, 4, (B, 1))
    resp = rng.randint(3, 64, (B, N))
    lengths = rng.randint(1, N + 1, B)
    layout = sequence_layout(jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(resp), jnp.asarray(lengths))
    teacher_params = jax.tree.map(lambda x: 3 * x, T.init_params(TEACHER, jax.random.key(7)))
    scores = score_with_teacher(teacher_params, layout, teacher_cfg=TEACHER, loss_cfg=LOSS)
    sampler_lp = jnp.asarray(rng.normal(-2, 0.5, (B, N)), jnp.float32)
    return loss_batch(layout, scores, sampler_logprobs_BxN=sampler_lp)


def _rel(a, b):
    return float(optax.global_norm(jax.tree.map(jnp.subtract, a, b)) / optax.global_norm(b))


def test_sharded_train_step_equals_single_device():
    params = jax.tree.map(lambda x: 3 * x, T.init_params(STUDENT, jax.random.key(0)))
    batch = _batch()
    loss_fn = rollout_loss_fn(STUDENT, LOSS)
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), 10)

    (loss1, _), grads1 = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    state1, m1 = jax.jit(make_train_step(loss_fn, opt))(init_train_state(params, opt, jax.random.key(1)), batch)

    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    p_sh = M.param_shardings(STUDENT, mesh, M.rules_for("train"))
    b_sh = M.batch_shardings(batch, mesh, M.rules_for("train"))
    sp, sb = jax.device_put(params, p_sh), jax.device_put(batch, b_sh)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), in_shardings=(p_sh, b_sh),
                      out_shardings=((None, None), p_sh))
    (loss8, _), grads8 = grad_fn(sp, sb)
    assert abs(float(loss8) - float(loss1)) <= 1e-5 * abs(float(loss1))
    assert _rel(jax.device_get(grads8), grads1) <= 1e-4
    assert grads8["layers"]["q"].sharding == p_sh["layers"]["q"]  # gradients stay in the params' layout

    state8 = init_train_state(sp, opt, jax.random.key(1))
    st_sh = M.shardings_of(state8)
    assert st_sh.opt_state[1][0].mu["embed"] == p_sh["embed"]  # Adam moments inherit the params' layout
    step8 = jax.jit(make_train_step(loss_fn, opt), in_shardings=(st_sh, b_sh), out_shardings=(st_sh, None),
                    donate_argnums=0)
    state8, m8 = step8(state8, sb)
    assert abs(float(m8["loss"]) - float(m1["loss"])) <= 1e-5 * abs(float(m1["loss"]))
    assert _rel(jax.device_get(state8.params), state1.params) <= 1e-4
    assert int(state8.step) == 1
