"""The "splash" attention entry's causal call: Pallas TPU splash attention (block-sparse flash attention, memory
O(T · block), never a [T, S] score matrix), with padding, packed segment ids and grouped-query heads.

- Grouped-query heads go to the kernel as they are: `make_splash_mha` takes k/v with K heads and reads kv head
  h // (H / K) for query head h (its index maps), and its backward sums dk/dv over each group, so k/v are never
  repeated H / K times.
- Splash has one static mask (causal here) and-ed with segment ids; it has no padding mask. Padded tokens (and
  the tokens added to round T up to a whole block) get a segment id no real token has, so no real query sees
  them, and each padded query still sees itself (no empty softmax row; its output is never read).
- Splash does not scale the scores: q is scaled by 1 / sqrt(Dh) first, as the "xla" entry does to the scores.
- The kernel (its numpy mask tables) is built per static shape and cached. Interpret mode or the compiled
  kernel is chosen at lowering by the platform lowered for (`_splash`), so a CPU host runs the interpreter
  and still compiles the real kernel ahead of time for a TPU topology.
- Under a mesh in context (`jax.set_mesh`: the train step, teacher scoring, `jopd aot`) the kernel runs in a
  `jax.shard_map` on each device's block (`attention_mesh.on_each_device`): the batch over the batch axes (data,
  fsdp) that divide it, the heads over `tensor` when it divides both head counts, the sequence whole (the SPMD
  partitioner refuses to split a Mosaic call). Without a mesh it is called as it is.

The entry's cached (decode) call is `attention_decode.decode_cached`, re-exported here as `splash_cached`.
The Pallas modules are imported when a kernel is first built, so importing jopd.models never needs libtpu.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.attention_decode import decode_cached
from jopd.models.attention_mesh import by_platform, on_each_device
from jopd.models.dtypes import matmul_precision

LANES = 128  # the kernel's blocks are whole multiples of the TPU lane width
BLOCKS = (512, 256, 128)  # the largest that divides the (rounded-up) length is used


def _block(T: int) -> int:
    return next(b for b in BLOCKS if T % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(T: int, H: int, interpret: bool):
    """The splash kernel for one [H, T, Dh] row (causal over T, segment ids given at call time)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b = _block(T)
    sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sa.MultiHeadMask([sa.CausalMask((T, T))] * H)
    # Its mask tables must be concrete arrays (the kernel is cached across traces), yet the kernel is first built
    # inside a trace, maybe under a mesh of devices that run nothing (a TPU topology compiled ahead of time): so it
    # is built in a thread of its own, where jax's trace and mesh contexts (both per thread) are empty.
    build = functools.partial(sa.make_splash_mha, mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(build).result()


def _splash(q_BxHxTxDh, k_BxKxTxDh, v_BxKxTxDh, seg_BxT, *, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    _, H, T, _ = q_BxHxTxDh.shape
    kernel = _kernel(T, H, interpret)
    attend = jax.vmap(lambda q, k, v, s: kernel(q, k, v, SegmentIds(q=s, kv=s)))
    # The kernel's dots take the default matmul precision, which should be the compute dtype's (fp32: HIGHEST),
    # not a global setting (HIGHEST on bf16 operands is a Mosaic compile error). The backward kernels are traced
    # when the gradient is, outside any `with` here: hence the vjp of our own that enters it on both passes.
    precision = matmul_precision(q_BxHxTxDh.dtype).name.lower()

    @jax.custom_vjp
    def run(q, k, v, seg):
        with jax.default_matmul_precision(precision):
            return attend(q, k, v, seg)

    def fwd(q, k, v, seg):
        with jax.default_matmul_precision(precision):
            return jax.vjp(lambda q_, k_, v_: attend(q_, k_, v_, seg), q, k, v)

    def bwd(pullback, dout):
        with jax.default_matmul_precision(precision):
            return (*pullback(dout), None)  # no gradient for the integer segment ids

    run.defvjp(fwd, bwd)
    return run(q_BxHxTxDh, k_BxKxTxDh, v_BxKxTxDh, seg_BxT)


def _specs(batch, head):
    P = jax.sharding.PartitionSpec
    heads = P(batch, head, None, None)  # [B, H or K, T, Dh]
    return (heads, heads, heads, P(batch, None)), heads


def splash_causal(q_BxTxHxDh: Float[Array, "B T H Dh"], k_BxKxTxDh: Float[Array, "B K T Dh"],
                  v_BxKxTxDh: Float[Array, "B K T Dh"], *, mask_BxT: Bool[Array, "B T"],
                  segment_ids_BxT: Int[Array, "B T"] | None = None, dtype) -> Float[Array, "B T H Dh"]:
    """`Attention.causal` by the splash kernel (see the module docstring); T is rounded up to a whole block."""
    B, T, _, Dh = q_BxTxHxDh.shape
    seg_BxT = (jnp.zeros((B, T), jnp.int32) if segment_ids_BxT is None
               else jnp.asarray(segment_ids_BxT, jnp.int32))
    pad_id = jnp.min(seg_BxT) - 1  # below every real id
    seg_BxT = jnp.where(jnp.asarray(mask_BxT, bool), seg_BxT, pad_id)
    Tp = -(-T // LANES) * LANES
    q = (q_BxTxHxDh * (1.0 / math.sqrt(Dh))).astype(q_BxTxHxDh.dtype).transpose(0, 2, 1, 3)  # [B, H, T, Dh]
    k, v = k_BxKxTxDh, v_BxKxTxDh
    if Tp != T:
        grow = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
        q, k, v = grow(q), grow(k), grow(v)
        seg_BxT = jnp.concatenate([seg_BxT, jnp.broadcast_to(pad_id, (B, Tp - T)).astype(jnp.int32)], axis=1)
    # The one place interpret vs compiled is chosen: by the platform being lowered for, not the host's backend.
    kernel = functools.partial(by_platform, tpu=functools.partial(_splash, interpret=False),
                               default=functools.partial(_splash, interpret=True))
    out = on_each_device(kernel, (q, k, v, seg_BxT), B=B, heads=(q.shape[1], k.shape[1]), specs=_specs)
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(dtype)


# The entry's cached call: the decode kernel (its own module, `jopd.models.attention_decode`).
splash_cached = decode_cached
