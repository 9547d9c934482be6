"""Loss functions `loss_fn(params, batch) -> (loss, metrics)` for the generic train step.

Both read the student's hidden states from the one `transformer.forward` and hand them to
`losses.token_loss`, which projects to logits chunk by chunk (no full [B,T,V] kept).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jopd.losses import LossConfig, token_loss
from jopd.models import transformer
from jopd.models.config import ModelConfig


def sft_loss_fn(model_cfg: ModelConfig, loss_cfg: LossConfig, dtype=jnp.float32, remat: bool = False):
    """Cross-entropy on the response of SFT batches (`tokens`, `attn_mask`, `loss_mask`, all [B, T]).
    `remat`: recompute each layer in the backward pass (see `transformer.forward`)."""

    def loss_fn(params, batch):
        hidden, _ = transformer.forward(params, batch["tokens"], cfg=model_cfg, attn_mask_BxT=batch["attn_mask"],
                                        dtype=dtype, return_hidden=True, remat=remat)
        lb = {"targets": batch["tokens"][:, 1:], "response_mask": batch["loss_mask"][:, 1:].astype(bool)}
        return token_loss(loss_cfg, params, model_cfg, hidden[:, :-1], lb, dtype=dtype)

    return loss_fn


def rollout_loss_fn(model_cfg: ModelConfig, loss_cfg: LossConfig, dtype=jnp.float32, remat: bool = False):
    """OPD/RL objective on rollout batches: `tokens`/`attn_mask` [B, P+N] (prompt then response) and the
    response-aligned loss entries [B, N, ...] (`targets`, `response_mask`, teacher scores, sampler logprobs).
    Only the N positions that predict response tokens are projected to logits. `remat`: recompute each layer
    in the backward pass (see `transformer.forward`)."""

    def loss_fn(params, batch):
        hidden, _ = transformer.forward(params, batch["tokens"], cfg=model_cfg, attn_mask_BxT=batch["attn_mask"],
                                        dtype=dtype, return_hidden=True, remat=remat)
        T, N = batch["tokens"].shape[1], batch["targets"].shape[1]
        lb = {k: v for k, v in batch.items() if k not in ("tokens", "attn_mask")}
        return token_loss(loss_cfg, params, model_cfg, hidden[:, T - N - 1:T - 1], lb, dtype=dtype)

    return loss_fn


def response_hidden(params, model_cfg: ModelConfig, tokens_BxT, attn_mask_BxT, n_response: int, dtype=jnp.float32):
    """Final hidden states at the N positions that predict the response tokens (no gradient use)."""
    hidden, _ = transformer.forward(params, tokens_BxT, cfg=model_cfg, attn_mask_BxT=attn_mask_BxT, dtype=dtype,
                                    return_hidden=True)
    T = tokens_BxT.shape[1]
    return jax.lax.stop_gradient(hidden[:, T - n_response - 1:T - 1])
