"""Random tiny-model params drawn with numpy (eager `init_params` compiles one PRNG program per leaf shape,
which dominates small tests on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jopd.models import transformer as T


def numpy_params(cfg, seed: int = 0, *, std: float = 0.02, layer_scale: float = 1.0, head_scale: float = 1.0):
    """N(0, std) matrices (layer matrices x layer_scale, lm_head x head_scale), unit norms, zero biases."""
    rng = np.random.default_rng(seed)

    def leaf(path, spec):
        shape, name = spec[0], str(path[-1].key)
        if name.endswith("norm"):
            return jnp.ones(shape, jnp.float32)
        if name.endswith("bias"):
            return jnp.zeros(shape, jnp.float32)
        scale = layer_scale if len(shape) > 2 else head_scale if name == "lm_head" else 1.0
        return jnp.asarray(rng.normal(0.0, std * scale, shape), jnp.float32)

    is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)  # noqa: E731
    return jax.tree_util.tree_map_with_path(leaf, T.param_shapes(cfg), is_leaf=is_spec)
