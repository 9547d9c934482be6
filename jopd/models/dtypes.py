"""The one table of dtype names used in configs and on the command line, and the matmul precision of each."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

DTypeName = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, Any] = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def matmul_precision(dtype) -> jax.lax.Precision:
    """The matmul precision of a compute dtype: fp32 compute means fp32 matmuls also on TPU (whose default is bf16
    passes); lower dtypes use DEFAULT."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
