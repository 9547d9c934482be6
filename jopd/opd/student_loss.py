"""The student's side of the train step: `loss_fn(params, batch) -> (loss, metrics)` for `train_state`.

Both read the student's final hidden states from the one `transformer.forward` and hand them to
`losses.token_loss`, which projects to logits chunk by chunk (no full [B, T, V] kept).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from jopd.losses import LossBatch, LossConfig, token_loss
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import TrainBatch
from jopd.opd.packing import compact_hidden, packed_hidden


def rollout_loss_fn(model_cfg: ModelConfig, loss_cfg: LossConfig, dtype=jnp.float32, remat: bool = False):
    """OPD / RL objective on a `TrainBatch` (prompt + response, response-aligned loss fields). Only the
    positions that predict response tokens are projected to logits: the N slots of each padded row, or, for
    packed rows, the real response tokens alone. `remat`: recompute each layer in the backward pass (see
    `transformer.forward`). `teacher_head` (frozen): the teacher's LM head, for the kinds that project the
    teacher's hidden states chunk by chunk (`Objective.reads_teacher_head`)."""

    def loss_fn(params, batch: TrainBatch, teacher_head=None):
        if batch.plan is not None:  # packed rows: the hidden states that predict response tokens, compact
            hidden = packed_hidden(params, model_cfg, batch.tokens_BxS, batch.plan, dtype=dtype, remat=remat)
            return token_loss(loss_cfg, params, model_cfg, compact_hidden(hidden, batch.plan), batch.loss,
                              dtype=dtype, teacher_head=teacher_head)
        hidden, _ = transformer.forward(params, batch.tokens_BxS, cfg=model_cfg, attn_mask_BxT=batch.attn_mask_BxS,
                                        dtype=dtype, return_hidden=True, remat=remat)
        S, N = batch.tokens_BxS.shape[1], batch.n_response
        return token_loss(loss_cfg, params, model_cfg, hidden[:, S - N - 1:S - 1], batch.loss, dtype=dtype,
                          teacher_head=teacher_head)

    return loss_fn


def sft_loss_fn(model_cfg: ModelConfig, dtype=jnp.float32, remat: bool = False, response_from: int = 1):
    """Cross-entropy on the response of SFT batches (`tokens`, `attn_mask`, `loss_mask`, all [B, S], from
    `data.pipeline`'s sft kind). `response_from`: the first column a response token can occupy (the pipeline's
    `max_prompt_len`); only positions from there on are projected to logits — with a 49k vocabulary the head is
    a large share of the step."""
    loss_cfg = LossConfig(kind="sft")

    def loss_fn(params, batch: Mapping[str, jax.Array]):
        hidden, _ = transformer.forward(params, batch["tokens"], cfg=model_cfg, attn_mask_BxT=batch["attn_mask"],
                                        dtype=dtype, return_hidden=True, remat=remat)
        r = response_from
        lb = LossBatch(targets_BxT=batch["tokens"][:, r:], response_mask_BxT=batch["loss_mask"][:, r:].astype(bool))
        return token_loss(loss_cfg, params, model_cfg, hidden[:, r - 1:-1], lb, dtype=dtype)

    return loss_fn
