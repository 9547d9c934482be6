"""The compact layout of response positions [Q, Cq] (`jopd.opd.packing`): the per-position work of a loss (LM
head, per-position terms) runs on real response tokens only, while its reduction stays in the padded response
layout [B, N]. `CompactLayout` says where each compact position comes from and where each padded slot went;
`to_compact` / `from_compact` move fields between the two, inside each batch shard (row indices are local to
their shard, the leading axis of every array split over the shards like the batch)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


@flax.struct.dataclass
class CompactLayout:
    resp_row_QxC: Int[Array, "Q Cq"]  # the padded response slot (row, t) each compact position holds
    resp_t_QxC: Int[Array, "Q Cq"]
    valid_QxC: Bool[Array, "Q Cq"]  # a real response token (the tail of the last compact rows is padding)
    compact_index_BxN: Int[Array, "B N"]  # each padded slot's flat compact index in its shard; Q*Cq: none
    shards: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.valid_QxC.shape)


def take_rows(x_RxA, rows_XxY, cols_XxY, shards: int):
    """x[row, col] inside each shard: x [shards * R, A, ...] at local (row, col) indices [shards * X, Y] ->
    [shards * X, Y, ...]."""
    R, X = x_RxA.shape[0] // shards, rows_XxY.shape[0] // shards
    xs = x_RxA.reshape(shards, R, *x_RxA.shape[1:])
    r, c = rows_XxY.reshape(shards, X, -1), cols_XxY.reshape(shards, X, -1)
    out = jax.vmap(lambda x, i, j: x[i, j])(xs, r, c)
    return out.reshape(shards * X, *out.shape[2:])


def to_compact(x_BxN, layout: CompactLayout):
    """A padded response-aligned field [B, N, ...] in the compact layout [Q, Cq, ...] (padding positions hold
    row 0's slot 0 of their shard: masked by `valid_QxC`)."""
    return take_rows(x_BxN, layout.resp_row_QxC, layout.resp_t_QxC, layout.shards)


def from_compact(y_QxC, layout: CompactLayout, fill=0):
    """A compact per-position field [Q, Cq, ...] back in the padded response layout [B, N, ...]; `fill` where a
    slot holds no response token."""
    Q, Cq, *rest = y_QxC.shape
    shards, B = layout.shards, layout.compact_index_BxN.shape[0]
    flat = y_QxC.reshape(shards, Q // shards * Cq, *rest)
    flat = jnp.concatenate([flat, jnp.full((shards, 1, *rest), fill, y_QxC.dtype)], axis=1)
    idx = layout.compact_index_BxN.reshape(shards, B // shards, -1)
    out = jax.vmap(lambda f, i: f[i])(flat, idx)
    return out.reshape(B, *out.shape[2:])


def compact_chunk(chunk_size: int, padded_rows: int, compact_rows: int, width: int) -> int:
    """Positions per chunk along a compact row so that a chunk holds no more positions than a padded chunk would
    (padded_rows x chunk_size): the loss's and the teacher's peak [rows, chunk, V] logits stay what they were."""
    return max(1, min(width, chunk_size * padded_rows // max(compact_rows, 1)))
