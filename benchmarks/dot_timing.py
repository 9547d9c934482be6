"""Matmuls timed alone at their own shapes (fp32, jopd's XLA:CPU flags): the floor a stage's matmuls cannot get
under on this machine, for the benchmarks' %-of-ceiling columns."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def best_call_s(f, *args, repeats: int = 5) -> float:
    """Best of `repeats` blocked calls of an already traced function (its first call compiles, not counted)."""
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def dot_seconds(lhs: tuple, rhs: tuple, spec: str, cache: dict) -> float:
    """Best-of-5 seconds of one einsum at these shapes less the cost of a jitted call that does nothing
    (dispatch), cached by shape."""
    if "dispatch" not in cache:
        cache["dispatch"] = best_call_s(jax.jit(lambda a: a + 1), jnp.ones((), jnp.float32), repeats=20)
    key = (lhs, rhs, spec)
    if key not in cache:
        a, b = jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32)
        cache[key] = max(best_call_s(jax.jit(lambda a, b: jnp.einsum(spec, a, b)), a, b) - cache["dispatch"], 0.0)
    return cache[key]
