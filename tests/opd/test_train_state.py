"""Generic update step: matches a hand-written Optax update; accumulation equals one big batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jopd.opd.optim import OptimConfig, make_optimizer, learning_rate_schedule
from jopd.opd.train_state import init_train_state, make_train_step


def _loss(params, batch):
    pred = batch["x"] @ params["w"]
    per_example = jnp.mean((pred - batch["y"]) ** 2, axis=-1)
    return per_example.mean(), {"pred_mean": pred.mean()}


def _setup():
    params = {"w": jax.random.normal(jax.random.key(0), (5, 3))}
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 5)), "y": jax.random.normal(jax.random.key(2), (8, 3))}
    return params, batch


def test_step_equals_manual_optax_update():
    params, batch = _setup()
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), total_steps=10)
    grads = jax.grad(lambda p: _loss(p, batch)[0])(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    expected = optax.apply_updates(params, updates)
    state = init_train_state(params, opt, jax.random.key(3))
    step = jax.jit(make_train_step(_loss, opt), donate_argnums=0)
    new_state, metrics = step(state, batch)  # donates (deletes) the old state's buffers
    assert state.params["w"].is_deleted()
    np.testing.assert_allclose(new_state.params["w"], expected["w"], rtol=1e-6, atol=1e-7)
    assert int(new_state.step) == 1
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-6)


def test_grad_accumulation_equals_full_batch():
    params, batch = _setup()
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), total_steps=10)
    full = jax.jit(make_train_step(_loss, opt, 1))(init_train_state(params, opt, jax.random.key(0)), batch)
    acc = jax.jit(make_train_step(_loss, opt, 4))(init_train_state(params, opt, jax.random.key(0)), batch)
    np.testing.assert_allclose(acc[0].params["w"], full[0].params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc[1]["loss"], full[1]["loss"], rtol=1e-6)


def test_schedule_warmup_then_cosine_to_end_fraction():
    sched = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=4, end_lr_fraction=0.1), 20)
    assert float(sched(0)) == 0.0 and abs(float(sched(4)) - 1.0) < 1e-6
    assert abs(float(sched(20)) - 0.1) < 1e-6 and float(sched(12)) < 1.0


def test_nonfinite_update_is_skipped_on_device():
    params, batch = _setup()
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), total_steps=10)
    bad = dict(batch, x=batch["x"].at[0, 0].set(jnp.nan))
    for skip in (True, False):
        state = init_train_state(params, opt, jax.random.key(3))
        step = jax.jit(make_train_step(_loss, opt, skip_nonfinite=skip))
        state, m_good = step(state, batch)
        after_good = jax.tree.map(np.asarray, (state.params, state.opt_state))
        state, m_bad = step(state, bad)
        assert float(m_good["nonfinite"]) == 0.0 and float(m_bad["nonfinite"]) == 1.0
        assert int(state.step) == 2
        kept = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), (state.params, state.opt_state), after_good)
        assert all(jax.tree.leaves(kept)) == skip  # skipped: bit-identical to before; applied: NaN got in
        assert np.isfinite(np.asarray(state.params["w"])).all() == skip
