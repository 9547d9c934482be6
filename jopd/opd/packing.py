"""Packed sequences for the scoring and the update: the forward passes and the loss touch real tokens only.

A step's rollouts (prompt + response, `opd.batch.sequence_layout`'s padded rows [B, P + N]) are packed several
to a row of C = P + N columns, each sequence's attention confined to itself by segment ids and its positions
restarting at 0 (`transformer.forward`'s `segment_ids_BxT`): the packed layout [Bp, C]. The hidden states
that predict response tokens are then gathered into a dense *compact* layout [Q, Cq] (response tokens only,
in row order), where the LM head, the teacher's top-K and the loss's per-position terms run. Everything the
loss reduces (masks, IS weights, advantages, normalization) stays in the padded response layout [B, N]: the
per-position terms are scattered back there (`from_compact`), so every loss kind reduces exactly as unpacked.

Plans are made on the host from the real lengths, per batch shard (a shard's rows are packed among themselves:
no gather crosses devices); row counts are rounded up to `granularity` rows so few shapes compile.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jopd.losses.layout import CompactLayout, take_rows


@flax.struct.dataclass
class PackPlan:
    """Where every packed position comes from, and the compact layout of the response positions. Row indices are
    local to their batch shard (the leading axis of every array is split over the shards like the batch)."""

    src_row_BpxC: Int[Array, "Bp C"]  # padded row of each packed position (0 on padding)
    src_col_BpxC: Int[Array, "Bp C"]  # its column in the padded prompt + response row
    segment_BpxC: Int[Array, "Bp C"]  # 1, 2, ... per sequence of a packed row; 0 on padding
    position_BpxC: Int[Array, "Bp C"]  # RoPE position inside its sequence
    hid_row_QxC: Int[Array, "Q Cq"]  # packed (row, column) of the hidden state that predicts each compact
    hid_col_QxC: Int[Array, "Q Cq"]  # position
    compact: CompactLayout

    @property
    def shards(self) -> int:
        return self.compact.shards


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def plan_packing(prompt_lens_B: np.ndarray, response_lens_B: np.ndarray, prompt_width: int, n_response: int, *,
                 shards: int = 1, granularity: int | None = None, compact_width: int | None = None,
                 width: int | None = None) -> PackPlan:
    """First-fit decreasing of each shard's sequences (prompt + response) into rows of `width` columns (default and
    minimum P + N: any sequence fits; wider rows hold more short sequences, at a quadratic attention cost), and the
    compact layout of their response tokens (rows of `compact_width`, default min(N, 32): little rounding waste;
    the loss sizes its chunks to the compact rows, `compact_chunk`). `granularity`: the packed row count per
    shard is a multiple of it (default: an eighth of the shard's rows), the compact one of a sixteenth of its
    most (all rows at N tokens): few shapes compile."""
    P, N = prompt_width, n_response
    C, Cq = width or P + N, compact_width or min(N, 32)
    if C < P + N:
        raise ValueError(f"packing: rows of {C} columns cannot hold a prompt + response of up to {P + N}")
    p_all, l_all = np.asarray(prompt_lens_B, np.int64), np.asarray(response_lens_B, np.int64)
    B = len(p_all)
    if B % shards:
        raise ValueError(f"packing: {B} rows do not split over {shards} batch shards")
    rows = B // shards
    g = granularity or max(1, rows // 8)
    if np.any(p_all < 1) or np.any(p_all > P) or np.any(l_all < 0) or np.any(l_all > N):
        raise ValueError(f"packing: prompt lengths must lie in [1, {P}] and response lengths in [0, {N}]")

    per_shard = []
    for s in range(shards):
        p, l = p_all[s * rows:(s + 1) * rows], l_all[s * rows:(s + 1) * rows]
        n = p + l
        bins: list[int] = []  # used columns per packed row
        where = np.zeros((rows, 2), np.int64)  # (packed row, offset) of each sequence
        for i in np.argsort(-n, kind="stable"):
            b = next((k for k, used in enumerate(bins) if used + n[i] <= C), len(bins))
            if b == len(bins):
                bins.append(0)
            where[i] = (b, bins[b])
            bins[b] += n[i]
        per_shard.append((p, l, where, len(bins), int(l.sum())))
    Bp = min(_round_up(max(x[3] for x in per_shard), g), rows)  # never more rows than the padded batch
    most = -(-rows * N // Cq)
    Q = min(_round_up(max(1, -(-max(x[4] for x in per_shard) // Cq)), granularity or max(1, most // 16)), most)

    out = {k: [] for k in ("src_row", "src_col", "segment", "position", "hid_row", "hid_col", "resp_row", "resp_t",
                           "valid", "compact")}
    for p, l, where, _, _ in per_shard:
        src_row, src_col = np.zeros((Bp, C), np.int32), np.zeros((Bp, C), np.int32)
        segment, position = np.zeros((Bp, C), np.int32), np.zeros((Bp, C), np.int32)
        seg_count = np.zeros(Bp, np.int32)
        flat = {k: np.zeros(Q * Cq, np.int32) for k in ("hid_row", "hid_col", "resp_row", "resp_t")}
        valid = np.zeros(Q * Cq, bool)
        compact = np.full((rows, N), Q * Cq, np.int32)
        q = 0
        for i in range(rows):
            b, off = where[i]
            n = p[i] + l[i]
            seg_count[b] += 1
            cols = slice(off, off + n)
            src_row[b, cols], src_col[b, cols] = i, np.arange(P - p[i], P + l[i])
            segment[b, cols], position[b, cols] = seg_count[b], np.arange(n)
            t = np.arange(l[i])
            at = slice(q, q + l[i])
            flat["hid_row"][at], flat["hid_col"][at] = b, off + p[i] - 1 + t  # position p - 1 + t predicts token t
            flat["resp_row"][at], flat["resp_t"][at] = i, t
            valid[at] = True
            compact[i, :l[i]] = np.arange(q, q + l[i])
            q += l[i]
        for k, v in (("src_row", src_row), ("src_col", src_col), ("segment", segment), ("position", position),
                     ("compact", compact)):
            out[k].append(v)
        for k, v in flat.items():
            out[k].append(v.reshape(Q, Cq))
        out["valid"].append(valid.reshape(Q, Cq))
    cat = {k: np.concatenate(v) for k, v in out.items()}
    compact = CompactLayout(resp_row_QxC=cat["resp_row"], resp_t_QxC=cat["resp_t"], valid_QxC=cat["valid"],
                            compact_index_BxN=cat["compact"], shards=shards)
    return PackPlan(src_row_BpxC=cat["src_row"], src_col_BpxC=cat["src_col"], segment_BpxC=cat["segment"],
                    position_BpxC=cat["position"], hid_row_QxC=cat["hid_row"], hid_col_QxC=cat["hid_col"],
                    compact=compact)


# -- device side: gathers inside each shard -------------------------------------------------------------------


def pack_tokens(tokens_BxS, plan: PackPlan):
    """The packed token rows [Bp, C] (0 on padding)."""
    packed = take_rows(tokens_BxS, plan.src_row_BpxC, plan.src_col_BpxC, plan.shards)
    return jnp.where(plan.segment_BpxC > 0, packed, 0)


def compact_hidden(hidden_BpxCxD, plan: PackPlan):
    """The packed forward's hidden states that predict the response tokens, in the compact layout [Q, Cq, D]."""
    return take_rows(hidden_BpxCxD, plan.hid_row_QxC, plan.hid_col_QxC, plan.shards)


def pack_positions(x_BxSx, plan: PackPlan, fill):
    """A per-position field of the padded rows [B, S, ...] in the packed layout [Bp, C, ...] (`fill` on padding)."""
    packed = take_rows(x_BxSx, plan.src_row_BpxC, plan.src_col_BpxC, plan.shards)
    real = (plan.segment_BpxC > 0).reshape(plan.segment_BpxC.shape + (1,) * (packed.ndim - 2))
    return jnp.where(real, packed, jnp.asarray(fill, packed.dtype))


def packed_hidden(params, cfg, tokens_BpxC, plan: PackPlan, *, dtype=jnp.float32, remat: bool = False,
                  return_routing: bool = False, replay_experts_LsxBpxCxk=None):
    """The model's final hidden states over packed rows [Bp, C, D] (each sequence attends to itself only); with
    `return_routing` also its routing [Ls, Bp, C, k] (`transformer.forward`'s, as is `replay_experts_LsxBpxCxk`)."""
    from jopd.models import transformer

    hidden, _, *routing = transformer.forward(params, tokens_BpxC, cfg=cfg, attn_mask_BxT=plan.segment_BpxC > 0,
                                              positions_BxT=plan.position_BpxC, segment_ids_BxT=plan.segment_BpxC,
                                              dtype=dtype, return_hidden=True, remat=remat,
                                              return_routing=return_routing,
                                              replay_experts_LsxBxTxk=replay_experts_LsxBpxCxk)
    return (hidden, *routing) if return_routing else hidden

