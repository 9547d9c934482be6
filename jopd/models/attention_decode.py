"""The "splash" attention entry's cached call: a Pallas TPU decode kernel that reads each row's KV cache only up to
that row's own slot, on jopd's cache layout ([B, K, S, Dh] per layer) as it is, with its slot mask.

Why not JAX's own decode kernels (`jax.experimental.pallas.ops.tpu`): `paged_attention` would read this cache
without a copy (a free reshape to pages of [1, B·K·S/P, P, Dh], one virtual row per (b, kv head), page_indices an
arange, lengths slot + 1), but it masks only by length: a row's slots are [0, length), no mask, no start offset
(page_indices skip whole pages only), and it returns no logsumexp that would let a second pass correct for the
rest. jopd's prompts are left-padded (`sampling.decode.prefill`), so a row's padded slots [0, pad) sit inside
[0, length) and would be attended. `ragged_paged_attention` has the same mask (causal, a static sliding window)
and wants K and V interleaved in one [pages, P, 2K, Dh] array, a copy of both caches per step.

The kernel here: grid (row, slot block); one step holds a [K, block, Dh] tile of k and v and every kv head's query
group. The tiles' index map is clamped at the block holding the row's slot, so blocks past it are never fetched
(Pallas skips the copy when a block index repeats) and their step computes nothing: a row's cost follows its own
slot. Inside a tile, slot j counts iff j <= slot and `kv_mask_BxS[j]`; softmax online in fp32, as the "chunked"
entry does. Query head h reads kv head h // (H / K).

- One new token per row (T = 1, a decode step) at a scalar or per-row slot. T > 1 (prefill against the cache)
  takes the blocked path (`attention_chunked.chunked_cached`), as does a cache whose S no block divides.
- The platform lowered for picks the compiled kernel (TPU) or Pallas interpret mode (elsewhere: tests on CPU).
- Under a mesh in context the kernel runs per device in a `jax.shard_map` (`attention_mesh.on_each_device`: rows
  over the batch axes, kv heads over `tensor`); the slot axis stays whole.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.attention_chunked import chunked_cached
from jopd.models.attention_mesh import by_platform, on_each_device
from jopd.models.dtypes import matmul_precision

BLOCKS = (1024, 512, 256, 128)  # slot block: the largest that divides S (whole TPU lanes) and fits the budget
KV_VMEM_BUDGET = 8 << 20  # k and v tiles, double-buffered, within the 16 MiB default scoped VMEM (v5e)
LANES = 128
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: finite, so exp(NEG - m) is 0, never NaN


def _block(S: int, K: int, Dh: int, itemsize: int) -> int | None:
    """The slot block, or None when none divides S (the blocked path then)."""
    fits = [b for b in BLOCKS if S % b == 0 and 2 * 2 * K * b * Dh * itemsize <= KV_VMEM_BUDGET]
    return fits[0] if fits else next((b for b in reversed(BLOCKS) if S % b == 0), None)


def _kernel(last_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *, block: int, scale: float,
            precision):
    """One (row b, slot block i) step: fold the tile's allowed slots into each kv head's running softmax."""
    from jax.experimental import pallas as pl

    b, i = pl.program_id(0), pl.program_id(1)
    last = last_ref[b]
    K = q_ref.shape[0]

    @pl.when(i == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i * block <= last)  # a block past the row's slot: nothing to do (and nothing was fetched)
    def _():
        slot_1xN = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        allowed_1xN = (slot_1xN <= last) & (mask_ref[...] != 0)
        for h in range(K):  # static: one 2-D dot per kv head
            q_GxDh = q_ref[h]
            s_GxN = jax.lax.dot_general(q_GxDh, k_ref[h], (((1,), (1,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32) * scale
            s_GxN = jnp.where(allowed_1xN, s_GxN, NEG)
            m_prev = m_ref[h]  # [G, LANES], every lane the same
            m_new = jnp.maximum(m_prev, jnp.max(s_GxN, axis=1, keepdims=True))
            p_GxN = jnp.where(allowed_1xN, jnp.exp(s_GxN - m_new[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p_GxN, axis=1, keepdims=True)
            pv = jax.lax.dot_general(p_GxN.astype(v_ref.dtype), v_ref[h], (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv
            m_ref[h] = m_new

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        l = l_ref[...][:, :, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # nothing seen: 0


def _decode(last_B, q_BxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask_Bx1xS, *, interpret: bool):
    """The kernel over the (local) rows: out [B, K, G, Dh] in q's dtype."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    B, K, G, Dh = q_BxKxGxDh.shape
    S = k_BxKxSxDh.shape[2]
    block = _block(S, K, Dh, k_BxKxSxDh.dtype.itemsize)

    def kv_index(b, i, last_ref):  # clamped at the row's last block: no fetch past it
        return b, 0, jnp.minimum(i, jax.lax.div(last_ref[b], block)), 0

    def mask_index(b, i, last_ref):
        return b, 0, jnp.minimum(i, jax.lax.div(last_ref[b], block))

    kernel = functools.partial(_kernel, block=block, scale=1.0 / math.sqrt(Dh),
                               precision=matmul_precision(q_BxKxGxDh.dtype))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, S // block),
            in_specs=[pl.BlockSpec((None, K, G, Dh), lambda b, i, last_ref: (b, 0, 0, 0)),
                      pl.BlockSpec((None, K, block, Dh), kv_index),
                      pl.BlockSpec((None, K, block, Dh), kv_index),
                      pl.BlockSpec((None, 1, block), mask_index)],
            out_specs=pl.BlockSpec((None, K, G, Dh), lambda b, i, last_ref: (b, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((K, G, LANES), jnp.float32), pltpu.VMEM((K, G, LANES), jnp.float32),
                            pltpu.VMEM((K, G, Dh), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((B, K, G, Dh), q_BxKxGxDh.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        # No cost estimate: what it reads follows each row's slot, which no compile-time count knows; `jopd aot`'s
        # roofline adds the reads up to the filled length on paper (jopd.sizing.attention_cost).
        interpret=interpret,
    )(last_B, q_BxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask_Bx1xS)


def _specs(batch, head):
    P = jax.sharding.PartitionSpec
    heads = P(batch, head, None, None)  # [B, K, G or S, Dh]
    return (P(batch), heads, heads, heads, P(batch, None, None)), heads


def decode_cached(q_BxTxHxDh: Float[Array, "B T H Dh"], k_cache: Float[Array, "B K S Dh"],
                  v_cache: Float[Array, "B K S Dh"], *, slot: Int[Array, ""] | Int[Array, "B"] | int,
                  kv_mask_BxS: Bool[Array, "B S"] | None = None, dtype) -> Float[Array, "B T H Dh"]:
    """`Attention.cached` by the decode kernel (see the module docstring): T = 1 new token per row at `slot`."""
    B, T, H, Dh = q_BxTxHxDh.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    if T != 1 or _block(S, K, Dh, k_cache.dtype.itemsize) is None:
        return chunked_cached(q_BxTxHxDh, k_cache, v_cache, slot=slot, kv_mask_BxS=kv_mask_BxS, dtype=dtype)
    last_B = jnp.broadcast_to(jnp.asarray(slot, jnp.int32), (B,))
    mask = jnp.ones((B, S), jnp.int32) if kv_mask_BxS is None else jnp.asarray(kv_mask_BxS).astype(jnp.int32)
    q = q_BxTxHxDh.reshape(B, K, H // K, Dh).astype(k_cache.dtype)  # T = 1: query head h = (h // G, h % G)
    kernel = functools.partial(by_platform, tpu=functools.partial(_decode, interpret=False),
                               default=functools.partial(_decode, interpret=True))
    out = on_each_device(kernel, (last_B, q, k_cache, v_cache, mask[:, None, :]), B=B, heads=(K,), specs=_specs)
    return out.reshape(B, 1, H, Dh).astype(dtype)
