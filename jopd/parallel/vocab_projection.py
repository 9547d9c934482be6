"""A frozen LM head applied with its vocabulary split over the mesh, so no chip ever holds the whole head.

The full-vocabulary loss kinds project the teacher's hidden states with the teacher's head inside the loss's chunk
loop. Under the train rules the head [D, V] is split over fsdp on D while the rows are split over data x fsdp, so
GSPMD resolves the plain `einsum("btd,dv->btv")` by all-gathering the head on every chip (and, for a bf16 teacher
projected in fp32, upcasting the gathered copy): on the Qwen3-8B teacher that is 2.3 GiB per chip. Here the head
is laid out with V over every mesh axis instead (an all-to-all of 1/n of it per chip), each chip projects the
chunk's rows (gathered: B x C x D, small) onto its slice of V, and the logits go back to the rows' layout (an
all-to-all of one chunk). Without a mesh context, or when V does not split evenly, it is the plain projection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jopd.models.transformer import BATCH_MESH_AXES, logits_from_hidden, lm_head_DxV


def vocab_axes(vocab: int) -> tuple[str, ...]:
    """The mesh axes (of the current `jax.set_mesh` context) a vocabulary of this size is split over: every axis of
    size > 1, if their product divides `vocab`; else none (the caller falls back to the plain projection)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    # `tensor` first (the train rules already split V over it), `fsdp` last (moved from D to V by one all-to-all)
    order = sorted(mesh.axis_names, key=lambda a: (a != "tensor", a == "fsdp"))
    axes = tuple(a for a in order if mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and vocab % n == 0 else ()


def vocab_sharded_head(head: Mapping[str, jax.Array]) -> dict[str, Float[Array, "D V"]]:
    """`{"lm_head": [D, V]}` with V split over `vocab_axes(V)` (a tied `{"embed": [V, D]}` head transposed once);
    the head unchanged where there is nothing to split over."""
    head_DxV = lm_head_DxV(head)
    axes = vocab_axes(head_DxV.shape[1])
    if not axes:  # no split: the head as given (a tied one is not copied transposed)
        return dict(head)
    if "fsdp" in axes:  # the train rules' D over fsdp: V split over the other axes first (a slice, no traffic)
        head_DxV = jax.lax.with_sharding_constraint(head_DxV, P("fsdp", tuple(a for a in axes if a != "fsdp")))
    return {"lm_head": jax.lax.with_sharding_constraint(head_DxV, P(None, axes))}


def vocab_sharded_logits(head: Mapping[str, jax.Array], hidden_BxCxD: Float[Array, "B C D"], *, dtype=jnp.float32
                         ) -> Float[Array, "B C V"]:
    """fp32 logits of `hidden_BxCxD` under `head` (from `vocab_sharded_head`), computed on V-split slices and
    returned split over rows like the hidden states; equal to `logits_from_hidden(head, hidden)`."""
    V = lm_head_DxV(head).shape[1]
    axes = vocab_axes(V)
    if not axes:
        return logits_from_hidden(head, hidden_BxCxD, dtype=dtype)
    hidden = jax.lax.with_sharding_constraint(hidden_BxCxD, P())  # every chip projects every row of the chunk
    logits = jax.lax.with_sharding_constraint(logits_from_hidden(head, hidden, dtype=dtype), P(None, None, axes))
    row_axes = tuple(a for a in BATCH_MESH_AXES if a in axes) or None
    # back to the rows' layout, V still over `tensor` where the mesh has one (as the student's logits are)
    return jax.lax.with_sharding_constraint(logits, P(row_axes, None, "tensor" if "tensor" in axes else None))
