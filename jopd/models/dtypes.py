"""The one table of dtype names used in configs and on the command line."""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp

DTypeName = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, Any] = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
