"""Train state and the pure update step `train_step(state, batch) -> (state, metrics)`.

The step is generic in the objective: `loss_fn(params, microbatch) -> (loss, metrics)`. Gradient accumulation
scans over micro-batches inside the step, so one jitted call = one optimizer update whatever the accumulation.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

Params = Any
Batch = Any  # a pytree of arrays (e.g. `opd.batch.TrainBatch`)
LossFn = Callable[[Params, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: steps taken (rollout batches; GRPO may apply several updates per step)
    params: Params
    opt_state: optax.OptState
    rng: jax.Array  # typed PRNG key; split per step for sampling / noise


def _replicated(params: Params) -> jax.sharding.NamedSharding | None:
    leaves = jax.tree.leaves(params)
    sh = getattr(leaves[0], "sharding", None) if leaves else None
    if not isinstance(sh, jax.sharding.NamedSharding):
        return None
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Params):
    """Shardings of the optimizer state: params-shaped leaves (Adam moments) take their param's sharding,
    the rest (counters) are replicated. None if the params are not on a mesh."""
    replicated = _replicated(params)
    if replicated is None:
        return None
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, sh: sh, abstract, param_sh,
                                 transform_non_params=lambda _: replicated)


def new_train_state(params: Params, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """The state before the first update (pure: jit it with the state's out_shardings to place it)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng)


def init_train_state(params: Params, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """`new_train_state` for already placed params: the moments take their param's sharding, scalars are
    replicated. Explicit out_shardings: zeros_like() does not depend on its input's values, so XLA would not
    propagate the params' layout to the moments on its own (they would land whole on one device)."""
    opt_state = jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params))(params)
    step = jnp.zeros((), jnp.int32)
    replicated = _replicated(params)
    if replicated is not None:  # scalars live on the same mesh, replicated, so one jit sees one device set
        step, rng = jax.device_put((step, rng), replicated)
    return TrainState(step=step, params=params, opt_state=opt_state, rng=rng)


def _split_microbatches(batch: Batch, n: int) -> Batch:
    def split(x):
        if x.shape[0] % n:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by grad_accum_steps={n}")
        return x.reshape((n, x.shape[0] // n) + x.shape[1:])
    return jax.tree.map(split, batch)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, grad_accum_steps: int = 1,
                    skip_nonfinite: bool = False) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """Builds the pure step `step(state, batch, *frozen)`: `frozen` are extra inputs of `loss_fn(params, batch,
    *frozen)` that are not trained (e.g. the teacher's head). Metrics are averaged over micro-batches;
    `grad_norm` is of the mean gradient.

    `skip_nonfinite`: when the loss or the gradient norm is NaN/Inf, the step keeps the params and optimizer
    state as they were (decided on the device, so a bad update never exists anywhere, not even in a state the
    host has not looked at yet) and reports `nonfinite` = 1; the step counter still advances."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: Batch, *frozen):
        if grad_accum_steps == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, *frozen)
        else:
            micro = _split_microbatches(batch, grad_accum_steps)

            def accumulate(acc, mb):
                (loss, metrics), grads = grad_fn(state.params, mb, *frozen)
                return jax.tree.map(jnp.add, acc, (loss, metrics, grads)), None

            first = jax.tree.map(lambda x: x[0], micro)
            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, state.params, first, *frozen))
            zeros = (zeros[0][0], zeros[0][1], zeros[1])
            (loss, metrics, grads), _ = jax.lax.scan(accumulate, zeros, micro)
            inv = 1.0 / grad_accum_steps
            loss, metrics, grads = jax.tree.map(lambda x: x * inv, (loss, metrics, grads))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_nonfinite:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params, opt_state = jax.tree.map(keep, (params, opt_state), (state.params, state.opt_state))
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, update_norm=optax.tree.norm(updates),
                       nonfinite=(~finite).astype(jnp.float32))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


# Metrics that describe the rollout against the trainer's params at the weight sync: with several inner
# updates they are taken from the first one (later ones see a policy the sampler never ran).
_ROLLOUT_METRICS = ("mismatch_", "is_", "entropy", "kl_ref", "target_logprob", "teacher_kl_k1")


def inner_update_metrics(history: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """One row of metrics for `len(history)` updates on one batch: the rollout's (`_ROLLOUT_METRICS`) from the
    first update, the mean over the updates for the rest (loss, grad_norm, ratio_mean, clip_frac, ...)."""
    if len(history) == 1:
        return history[0]
    return _mean_over_updates(history) | {k: v for k, v in history[0].items() if k.startswith(_ROLLOUT_METRICS)}


@jax.jit
def _mean_over_updates(history: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """One program for every metric's mean (eagerly, each metric's additions were programs of their own: ~80 ms of
    dispatch per step on CPU)."""
    return {k: sum(m[k] for m in history) / len(history) for k in history[0]}
