"""The "chunked" attention implementation: blockwise online softmax in plain JAX (exact, any backend).

A block of queries at a time meets a block of keys at a time; a running max, sum and weighted-value accumulator
(all fp32) carry the softmax across key blocks, so no [B, H, T, S] score tensor exists: the live scores are one
[B, H, block_q, block_k] tile. Each query block's work is under `jax.checkpoint`, so the backward pass recomputes
its tiles instead of keeping every block's probabilities: memory O(T·block) in training too.

The mask is built per tile from structure: query i (at position qpos) sees key j (at position kpos) iff
kpos <= qpos, key j is real, and (packed rows) both share a segment. A key tile no query of the block can see is
skipped (`lax.cond`): the blocks above the causal diagonal, and the cache slots past every row's write slot.
T and S need not be multiples of the block: both are padded, the padding masked. A query that sees nothing
(a padded one) gets a zero output with finite gradients, not NaN.

The seam's entries (`chunked_causal`, `chunked_cached`) are registered by `jopd.models.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.dtypes import matmul_precision

BLOCK = 512  # default query and key block: one [B, H, 512, 512] fp32 tile is live at a time


def _pad_axis(x: jax.Array, axis: int, to: int, value) -> jax.Array:
    pad = to - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(n: int, block: int) -> tuple[int, int]:
    """(block actually used, number of blocks): a length shorter than the block is one block of its own size."""
    block = min(block, n)
    return block, -(-n // block)


def blockwise_attention(
    q_BxTxHxDh: Float[Array, "B T H Dh"],
    k_BxKxSxDh: Float[Array, "B K S Dh"],
    v_BxKxSxDh: Float[Array, "B K S Dh"],
    *,
    q_pos_BxT: Int[Array, "B T"],
    kv_valid_BxS: Bool[Array, "B S"],
    q_seg_BxT: Int[Array, "B T"] | None = None,
    kv_seg_BxS: Int[Array, "B S"] | None = None,
    dtype=jnp.float32,
    block_q: int = BLOCK,
    block_k: int = BLOCK,
    kv_in_place: bool = False,
) -> Float[Array, "B T H Dh"]:
    """softmax(q k^T / sqrt(Dh)) v over the keys j with j <= q_pos[i], kv_valid[j] and (if given) equal segments,
    computed a [block_q, block_k] tile at a time; grouped-query heads (query head h reads kv head h // (H / K)).
    `kv_in_place` (a decode against a cache whose length the key block divides): each computed tile is sliced from
    k and v where they lie, not from a blocked copy of them (which would copy the whole cache at every step)."""
    B, T, H, Dh = q_BxTxHxDh.shape
    K, S = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
    G = H // K
    bq, nq = _blocks(T, block_q)
    bk, nk = _blocks(S, block_k)
    prec = matmul_precision(dtype)
    scale = 1.0 / jnp.sqrt(jnp.float32(Dh))
    segmented = q_seg_BxT is not None

    # queries: [nq, B, K, G, bq, Dh]; a padded query has position -1 (sees nothing)
    q = q_BxTxHxDh.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4)
    q = _pad_axis(q, 3, nq * bq, 0).reshape(B, K, G, nq, bq, Dh).transpose(3, 0, 1, 2, 4, 5)
    q_pos = _pad_axis(q_pos_BxT.astype(jnp.int32), 1, nq * bq, -1).reshape(B, nq, bq).transpose(1, 0, 2)
    # keys: [nk, B, K, bk, Dh]; a padded key is invalid
    in_place = kv_in_place and nk * bk == S
    if in_place:  # the scan carries block indices; `kv_tile` slices the tile it computes
        kv_xs = jnp.arange(nk, dtype=jnp.int32)
    else:
        kv_xs = tuple(_pad_axis(x, 2, nk * bk, 0).reshape(B, K, nk, bk, Dh).transpose(2, 0, 1, 3, 4)
                      for x in (k_BxKxSxDh, v_BxKxSxDh))

    def kv_tile(kv_x):
        if in_place:
            return tuple(jax.lax.dynamic_slice_in_dim(x, kv_x * bk, bk, axis=2) for x in (k_BxKxSxDh, v_BxKxSxDh))
        return kv_x
    kv_pos = jnp.broadcast_to(jnp.arange(nk * bk, dtype=jnp.int32).reshape(nk, 1, bk), (nk, B, bk))
    kv_valid = _pad_axis(kv_valid_BxS.astype(bool), 1, nk * bk, False).reshape(B, nk, bk).transpose(1, 0, 2)
    if segmented:
        q_seg = _pad_axis(q_seg_BxT, 1, nq * bq, -1).reshape(B, nq, bq).transpose(1, 0, 2)
        kv_seg = _pad_axis(kv_seg_BxS, 1, nk * bk, -2).reshape(B, nk, bk).transpose(1, 0, 2)
    else:  # one segment everywhere; the comparison folds away
        q_seg = jnp.zeros((nq, B, bq), jnp.int32)
        kv_seg = jnp.zeros((nk, B, bk), jnp.int32)

    def tile(carry, key_block, q_blk, q_pos_blk, q_seg_blk):
        """Fold one key tile into the running (max, sum, accumulator) of one query block."""
        m_BxKxGxQ, l_BxKxGxQ, acc_BxKxGxQxDh = carry
        kv_x, kv_pos_blk, kv_valid_blk, kv_seg_blk = key_block
        allowed_BxQxS = ((kv_pos_blk[:, None, :] <= q_pos_blk[:, :, None]) & kv_valid_blk[:, None, :]
                         & (kv_seg_blk[:, None, :] == q_seg_blk[:, :, None]))

        def fold(_):
            k_blk, v_blk = kv_tile(kv_x)
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, precision=prec,
                           preferred_element_type=jnp.float32) * scale
            allowed = allowed_BxQxS[:, None, None]
            s = jnp.where(allowed, s, jnp.finfo(jnp.float32).min)
            m_new = jnp.maximum(m_BxKxGxQ, s.max(-1))
            # masked entries are zeroed explicitly: for a row that has seen nothing yet, s - m_new is 0 there
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m_BxKxGxQ - m_new)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v_blk.dtype), v_blk, precision=prec,
                            preferred_element_type=jnp.float32)
            return m_new, alpha * l_BxKxGxQ + p.sum(-1), alpha[..., None] * acc_BxKxGxQxDh + pv

        # a tile no query of the block may see (above the causal diagonal, past every row's slot) is skipped
        return jax.lax.cond(allowed_BxQxS.any(), fold, lambda _: carry, None), None

    @jax.checkpoint  # the backward pass recomputes this query block's tiles instead of storing them
    def query_block(q_blk, q_pos_blk, q_seg_blk, kv_xs, kv_pos, kv_valid, kv_seg):
        init = (jnp.full((B, K, G, bq), jnp.finfo(jnp.float32).min, jnp.float32),
                jnp.zeros((B, K, G, bq), jnp.float32), jnp.zeros((B, K, G, bq, Dh), jnp.float32))
        step = functools.partial(tile, q_blk=q_blk, q_pos_blk=q_pos_blk, q_seg_blk=q_seg_blk)
        (_, l, acc), _ = jax.lax.scan(step, init, (kv_xs, kv_pos, kv_valid, kv_seg))
        # a query that saw nothing has l = 0 and acc = 0: output 0, and the division's gradient stays finite
        return (acc / jnp.where(l == 0.0, 1.0, l)[..., None]).astype(dtype)

    def per_query_block(_, xs):
        q_blk, q_pos_blk, q_seg_blk = xs
        return None, query_block(q_blk, q_pos_blk, q_seg_blk, kv_xs, kv_pos, kv_valid, kv_seg)

    _, out = jax.lax.scan(per_query_block, None, (q, q_pos, q_seg))  # [nq, B, K, G, bq, Dh]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * bq, H, Dh)
    return out[:, :T]


def chunked_causal(q, k, v, *, mask_BxT, segment_ids_BxT=None, dtype, block_q: int = BLOCK,
                   block_k: int = BLOCK):
    """The seam's causal call, blockwise: token i sees the real tokens j <= i of its own segment."""
    B, T = mask_BxT.shape
    pos_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return blockwise_attention(q, k, v, q_pos_BxT=pos_BxT, kv_valid_BxS=mask_BxT, q_seg_BxT=segment_ids_BxT,
                               kv_seg_BxS=segment_ids_BxT, dtype=dtype, block_q=block_q, block_k=block_k)


def chunked_cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype, block_q: int = BLOCK,
                   block_k: int = BLOCK):
    """The seam's cached call, blocked over the cache slots: new token i (at slot `slot` + i, `slot` a scalar or
    one per row) sees the real slots at or before its own; slot tiles past every row's last new token are skipped."""
    B, T = q.shape[0], q.shape[1]
    S = k_cache.shape[2]
    if kv_mask_BxS is None:
        kv_mask_BxS = jnp.ones((B, S), bool)
    slot_B = jnp.broadcast_to(jnp.asarray(slot, jnp.int32), (B,))
    q_pos_BxT = slot_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    # a key block that divides the cache lets each tile be read where it lies (no blocked copy of the cache)
    block_k = next((b for b in (block_k, block_k // 2, block_k // 4) if b and S % b == 0), block_k)
    return blockwise_attention(q, k_cache, v_cache, q_pos_BxT=q_pos_BxT, kv_valid_BxS=kv_mask_BxS, dtype=dtype,
                               block_q=block_q, block_k=block_k, kv_in_place=True)
