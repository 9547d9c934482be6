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
  `jax.shard_map` on each device's block: the batch over the batch axes (data, fsdp) that divide it, the heads
  over `tensor` when it divides both head counts, the sequence whole (a Mosaic call is opaque to the SPMD
  partitioner, which would otherwise refuse it). Without a mesh it is called as it is.

Not here: the cached (decode) call, `jopd.models.attention_paged`.
The Pallas modules are imported when a kernel is first built, so importing jopd.models never needs libtpu.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.dtypes import matmul_precision

# The mesh axes that split the batch (`transformer.BATCH_MESH_AXES`, which this module cannot import: transformer
# imports the seam) and the one that splits heads (`jopd.parallel.mesh.MESH_AXES`; models sit below parallel).
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"
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


def per_device_specs(B: int, heads: tuple[int, ...]):
    """(mesh axes for shard_map, batch axes, head axis) for a kernel call on [B, heads, ...] arrays under the
    context mesh (`jax.set_mesh`), or None without one. The batch goes over the batch axes that divide it (in
    order), the heads over `tensor` when it divides every head count; every other free axis replicates."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)  # already manual: an outer shard_map
    if not free:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    batch, n = [], 1
    for a in BATCH_AXES:
        if a in free and B % (n * sizes[a]) == 0:
            batch.append(a)
            n *= sizes[a]
    head = HEAD_AXIS if HEAD_AXIS in free and all(h % sizes[HEAD_AXIS] == 0 for h in heads) else None
    return frozenset(free), (tuple(batch) or None), head


def _on_each_device(fn, q_BxHxTxDh, k_BxKxTxDh, v_BxKxTxDh, seg_BxT):
    """`fn` on each device's [B/b, H/h, T, Dh] block under a mesh (a Mosaic call is opaque to the SPMD
    partitioner: without this it would be run on whole gathered arrays); `fn` itself without a mesh."""
    B, H = q_BxHxTxDh.shape[:2]
    specs = per_device_specs(B, (H, k_BxKxTxDh.shape[1]))
    if specs is None:
        return fn(q_BxHxTxDh, k_BxKxTxDh, v_BxKxTxDh, seg_BxT)
    axes, batch, head = specs
    P = jax.sharding.PartitionSpec
    spec = P(batch, head, None, None)
    # check_vma off: the Pallas call carries no varying-axes annotation for shard_map's checker
    return jax.shard_map(fn, in_specs=(spec, spec, spec, P(batch, None)), out_specs=spec, axis_names=axes,
                         check_vma=False)(q_BxHxTxDh, k_BxKxTxDh, v_BxKxTxDh, seg_BxT)


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
    kernel = functools.partial(jax.lax.platform_dependent, tpu=functools.partial(_splash, interpret=False),
                               default=functools.partial(_splash, interpret=True))
    out = _on_each_device(kernel, q, k, v, seg_BxT)
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(dtype)


def splash_cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype):
    raise NotImplementedError("attention 'splash': the cached (decode) call is future work (a ragged/paged "
                              "Pallas decode kernel); decode with attention 'xla'")
