"""The "cudnn" attention entry: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's flash attention
on a GPU (memory O(T), no [T, S] scores), behind the seam's causal call.

How the seam's inputs map onto what that call takes:
- Layout: q is already [B, T, H, Dh] (its BTNH); the head-major k/v [B, K, S, Dh] are transposed to [B, S, K, Dh].
  Grouped-query heads go as they are (it takes K kv heads dividing H). The scale is 1 / sqrt(Dh), as "xla"'s.
- Causal with padding: the call's padding is right padding only (`query_seq_lengths` / `key_value_seq_lengths`:
  real tokens first). A jopd row's real tokens are one contiguous run with padding on either side (left-padded
  prompt, right-padded response), so each row is rolled left by its first real position, attended with
  `is_causal` and its real length (cuDNN's padding-causal mask), and the output rolled back. q/k already carry
  RoPE, so rolling a row changes no score. **Rule**: `mask_BxT` must mark one contiguous run per row (what every
  jopd caller passes); a row with holes would be attended as if the holes were real.
- Packed rows (`segment_ids_BxT` given): the call has no segment ids, and a boolean `mask` would be a [B, 1, T, T]
  array per call (cuDNN takes it as a bias, with a bias gradient in the backward), what packing long rows must
  not build. So packed rows run the "chunked" call (segment ids, blockwise) on every platform. cuDNN's own packed
  layout (per-segment offsets, Hopper on) is not in `jax.nn.dot_product_attention`'s API.
- Dtypes: cuDNN's kernel takes bf16 / fp16 only; with fp32 compute the GPU branch runs "chunked" (exact,
  blockwise) instead. Head dims must be multiples of 8 (at most 128 before Hopper, 256 on it): jax raises
  otherwise.
- The platform is chosen at lowering (`lax.platform_dependent`): for cuda the cuDNN call; for every other
  platform the same call with `implementation="xla"` (dense, exact), which is how the mapping above is tested on
  CPU. On a host with no CUDA backend the cuda branch is never traced (jax's cuDNN call needs cuDNN to trace).
- The cached (decode) call is "chunked"'s: blocked over the cache slots, skipping the tiles past every row's
  write slot (cuDNN's causal mask is aligned at slot 0 and its padding is right padding, which a left-padded
  cache at per-row slots is not).

The seam's entries (`cudnn_causal`, `cudnn_cached`) are registered by `jopd.models.attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.attention_chunked import chunked_cached, chunked_causal

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


@functools.lru_cache(maxsize=1)
def cuda_backend() -> bool:
    """Whether this host has a CUDA backend (only then can a program be lowered for cuda)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _roll_rows(x_BxTx: jax.Array, shift_B: Int[Array, "B"]) -> jax.Array:
    """Row b of x moved left by shift_B[b] along axis 1, cyclically."""
    T = x_BxTx.shape[1]
    idx_BxT = (jnp.arange(T)[None, :] + shift_B[:, None]) % T
    return jnp.take_along_axis(x_BxTx, idx_BxT.reshape(idx_BxT.shape + (1,) * (x_BxTx.ndim - 2)), axis=1)


def _dot_product_attention(q_BxTxHxDh, k_BxKxTxDh, v_BxKxTxDh, *, mask_BxT, implementation: str):
    """The seam's causal call (no segments) as one `jax.nn.dot_product_attention` call: each row's real run rolled to
    the front, then causal with right padding only (the mapping of the module docstring)."""
    k, v = k_BxKxTxDh.transpose(0, 2, 1, 3), v_BxKxTxDh.transpose(0, 2, 1, 3)  # [B, T, K, Dh]
    first_B = jnp.argmax(mask_BxT, axis=1).astype(jnp.int32)  # 0 for a row with no real token
    lengths_B = mask_BxT.sum(axis=1, dtype=jnp.int32)
    q, k, v = (_roll_rows(x, first_B) for x in (q_BxTxHxDh, k, v))
    out = jax.nn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), is_causal=True,
                                       query_seq_lengths=lengths_B, key_value_seq_lengths=lengths_B,
                                       implementation=implementation)
    return _roll_rows(out, (-first_B) % out.shape[1])


def cudnn_causal(q_BxTxHxDh: Float[Array, "B T H Dh"], k_BxKxTxDh: Float[Array, "B K T Dh"],
                 v_BxKxTxDh: Float[Array, "B K T Dh"], *, mask_BxT: Bool[Array, "B T"],
                 segment_ids_BxT: Int[Array, "B T"] | None = None, dtype) -> Float[Array, "B T H Dh"]:
    """`Attention.causal` by `jax.nn.dot_product_attention` (see the module docstring for the mapping, its rule
    (one contiguous run of real tokens per row) and its fallbacks: packed rows, and fp32 on a GPU, run "chunked")."""
    mask_BxT = jnp.asarray(mask_BxT, bool)
    chunked = functools.partial(chunked_causal, mask_BxT=mask_BxT, segment_ids_BxT=segment_ids_BxT, dtype=dtype)
    if segment_ids_BxT is not None:
        return chunked(q_BxTxHxDh, k_BxKxTxDh, v_BxKxTxDh)
    default = functools.partial(_dot_product_attention, mask_BxT=mask_BxT, implementation="xla")
    if not cuda_backend():
        out = default(q_BxTxHxDh, k_BxKxTxDh, v_BxKxTxDh)
    else:
        on_gpu = (functools.partial(_dot_product_attention, mask_BxT=mask_BxT, implementation="cudnn")
                  if jnp.dtype(q_BxTxHxDh.dtype) in CUDNN_DTYPES else chunked)  # fp32: cuDNN's kernel refuses it
        out = jax.lax.platform_dependent(q_BxTxHxDh, k_BxKxTxDh, v_BxKxTxDh, cuda=on_gpu, default=default)
    return out.astype(dtype)


def cudnn_cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype):
    """`Attention.cached`: the "chunked" entry's blocked decode (see the module docstring)."""
    return chunked_cached(q, k_cache, v_cache, slot=slot, kv_mask_BxS=kv_mask_BxS, dtype=dtype)
