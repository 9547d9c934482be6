"""The one table of dtype names used in configs and on the command line, the matmul precision of each, and the
one matmul of a compute dtype (`matmul`)."""

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


def matmul(spec: str, *operands: jax.Array, dtype, out_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, *operands)` in the compute dtype `dtype`, the result in `out_dtype` (default: `dtype`).

    fp32: fp32 operands at Precision.HIGHEST. A narrower dtype (bf16, fp16): its operands, accumulated in fp32
    (`preferred_element_type`: the MXU's native mode, and what makes the result independent of the backend's
    accumulation), then rounded once to `out_dtype`, so an fp32 `out_dtype` (the logits) is never rounded to the
    narrow dtype on the way."""
    dtype = jnp.dtype(dtype)
    ops = [x.astype(dtype) for x in operands]
    if dtype == jnp.float32:
        out = jnp.einsum(spec, *ops, precision=jax.lax.Precision.HIGHEST)
    else:
        out = jnp.einsum(spec, *ops, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
    return out.astype(dtype if out_dtype is None else out_dtype)
