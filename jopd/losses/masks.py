"""Which positions count in the loss, and the token-level mean over them."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def loss_mask(response_mask_BxT: Bool[Array, "B T"], targets_BxT: Int[Array, "B T"],
              special_token_ids: Sequence[int] = (), template_token_ids: Sequence[int] = ()) -> Bool[Array, "B T"]:
    """Response positions that count: not a `special_token_ids` target anywhere, not the first occurrence in
    its row of a `template_token_ids` target (later occurrences are trained against, like any emitted token)."""
    mask = response_mask_BxT.astype(bool)
    if len(special_token_ids):
        mask = mask & ~jnp.isin(targets_BxT, jnp.asarray(tuple(special_token_ids), dtype=targets_BxT.dtype))
    for tid in template_token_ids:
        hit = (targets_BxT == tid) & response_mask_BxT.astype(bool)
        mask = mask & ~(hit & (jnp.cumsum(hit, axis=1) == 1))
    return mask


def masked_sum(x_BxT: Float[Array, "B T"], mask_BxT: Bool[Array, "B T"]) -> Float[Array, ""]:
    # `where`, not a product: a masked position contributes 0 to the value and its cotangent is exactly 0.
    return jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0))


def masked_mean(x_BxT: Float[Array, "B T"], mask_BxT: Bool[Array, "B T"]) -> Float[Array, ""]:
    """Token-level mean over the unmasked positions of the whole batch (0 when none)."""
    return masked_sum(x_BxT, mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1).astype(x_BxT.dtype)


def masked_max(x_BxT: Float[Array, "B T"], mask_BxT: Bool[Array, "B T"]) -> Float[Array, ""]:
    return jnp.max(jnp.where(mask_BxT, x_BxT, -jnp.inf), initial=0.0)

