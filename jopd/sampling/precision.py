"""Rollout precision policy: the numerics of the sampler, deliberately configurable to create a controlled
rollout/trainer mismatch (compute dtype, simulated weight quantization, KV-cache and logits dtypes) plus
seeded noise injection on weights (here, once per weight sync) and on logits (in the sampler, per step).

The trainer keeps its own precision (fp32 by default); `prepare_sampler_params` turns the trainer's params
into the rollout engine's params once per weight sync.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass

from jopd.models.dtypes import DTYPES, DTypeName

# Contraction (input) axes of every matrix in the params layout of `jopd.models.transformer`: the scale of a
# per-output-channel quantizer is the abs-max over these axes. Counted from the end, so that a stacked leaf ([L, ...])
# and a per-layer one (a mixed dense/sparse MoE schedule's) get the same scales. Norm weights and biases are never
# quantized, nor is a MoE router (inference engines keep it in the model dtype: it only picks experts).
_INPUT_AXES: dict[str, tuple[int, ...]] = {
    "embed": (-1,),  # V x D: one scale per vocab row (it is also the tied lm_head's output channel)
    "lm_head": (-2,),  # D x V
    "q": (-3,), "k": (-3,), "v": (-3,),  # [L x] D x N x Dh
    "o": (-3, -2),  # [L x] H x Dh x D
    "gate": (-2,), "up": (-2,),  # [L x] D x F
    "down": (-2,),  # [L x] F x D
    "expert_gate": (-2,), "expert_up": (-2,),  # [L x] E x D x I: one scale per expert and output channel
    "expert_down": (-2,),  # [L x] E x I x D
}
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0


@config_dataclass
class PrecisionConfig:
    """Numerics of the rollout engine. The defaults are the trainer's fp32 numerics (zero mismatch)."""

    compute_dtype: DTypeName = "fp32"  # matmuls / activations inside `forward`
    weight_quant: Literal["none", "fp8", "int8"] = "none"  # simulated per-output-channel weight quantization
    kv_cache_dtype: DTypeName | None = None  # None: same as compute_dtype
    logits_dtype: DTypeName = "fp32"  # logits are rounded to this; the sampling math itself runs in fp32
    logit_noise: Annotated[float, pydantic.Field(ge=0)] = 0.0  # sigma (nats) of Gaussian noise on logits
    weight_noise: Annotated[float, pydantic.Field(ge=0)] = 0.0  # relative sigma: w += sigma*|w|*N(0,1)

    @property
    def dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def cache_dtype(self):
        return DTYPES[self.kv_cache_dtype or self.compute_dtype]

    @property
    def logits_jnp_dtype(self):
        return DTYPES[self.logits_dtype]


# Named policies for the CLI and configs. fp8/int8 follow common inference engines: quantized weights with
# bf16 activations, KV cache and logits.
PRESETS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp16": {"compute_dtype": "fp16", "logits_dtype": "fp16"},
    "bf16": {"compute_dtype": "bf16", "logits_dtype": "bf16"},
    "fp8": {"compute_dtype": "bf16", "logits_dtype": "bf16", "weight_quant": "fp8"},
    "int8": {"compute_dtype": "bf16", "logits_dtype": "bf16", "weight_quant": "int8"},
}


def precision_from_name(name: str, *, logit_noise: float = 0.0, weight_noise: float = 0.0,
                        field: str = "precision") -> PrecisionConfig:
    """Preset by name (fp32 | fp16 | bf16 | fp8 | int8) with optional noise; unknown name -> ValueError."""
    if name not in PRESETS:
        raise ValueError(f"{field}: unknown precision {name!r} (choose one of {', '.join(PRESETS)})")
    return PrecisionConfig(**PRESETS[name], logit_noise=logit_noise, weight_noise=weight_noise)


def fake_quant(w: jax.Array, input_axes: tuple[int, ...], kind: str) -> jax.Array:
    """Quantize-dequantize `w` (fp32 result) with a symmetric per-output-channel scale.

    fp8: float8_e4m3fn with scale = amax / 448; int8: round-to-nearest with scale = amax / 127.
    """
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=input_axes, keepdims=True)
    qmax = FP8_MAX if kind == "fp8" else INT8_MAX
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    if kind == "fp8":
        q = (w32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    elif kind == "int8":
        q = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX)
    else:
        raise ValueError(f"PrecisionConfig.weight_quant: unknown kind {kind!r}")
    return q * scale


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def prepare_sampler_params(params: Any, precision: PrecisionConfig, key: jax.Array | None = None) -> Any:
    """Trainer params -> rollout params: relative weight noise (seeded by `key`), then simulated weight
    quantization, then a cast to the compute dtype. Call once per weight sync (jitted; compiles once per
    params structure and precision). With weight_noise == 0 and weight_quant == "none" it is only the cast.
    """
    if precision.weight_noise > 0 and key is None:
        raise ValueError("prepare_sampler_params: PrecisionConfig.weight_noise > 0 needs a PRNG key")
    return _prepare(params, key if precision.weight_noise > 0 else None, precision)


@functools.partial(jax.jit, static_argnums=(2,))
def _prepare(params: Any, key: jax.Array | None, precision: PrecisionConfig) -> Any:
    flat, treedef = jax.tree.flatten_with_path(params)
    if precision.weight_noise > 0:
        # one draw for all leaves (a single PRNG op: threefry is slow to compile on CPU), then split
        sizes = [w.size for _, w in flat]
        eps = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    out = []
    for i, (path, w) in enumerate(flat):
        w32 = w.astype(jnp.float32)
        if precision.weight_noise > 0:  # static skip: sigma == 0 leaves the weights bit-identical
            w32 = w32 + precision.weight_noise * jnp.abs(w32) * eps[i].reshape(w.shape)
        name = _leaf_name(path)
        if precision.weight_quant != "none" and name in _INPUT_AXES:
            w32 = fake_quant(w32, _INPUT_AXES[name], precision.weight_quant)
        out.append(w32.astype(precision.dtype))
    return jax.tree.unflatten(treedef, out)
