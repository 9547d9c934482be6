"""Sharded abstract arrays: `ShapeDtypeStruct`s carrying shardings (AOT lowering, checkpoint restore targets), and
the per-device memory a layout implies, from shapes only."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def sharded_abstract(shapes_tree, shardings_tree, dtype=None):
    """ShapeDtypeStructs carrying shardings, for AOT `jit(f).lower(...)` (no device memory touched)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh),
                        shapes_tree, shardings_tree)


def sharded_bytes_per_device(abstract_tree, shardings_tree) -> int:
    """Max bytes per device of a pytree under shardings, from shapes only (no arrays needed)."""
    total = 0
    for s, sh in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings_tree)):
        total += math.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
    return total
