"""The student's side of the train step: `loss_fn(params, batch) -> (loss, metrics)` for `train_state`.

Both read the student's final hidden states from the one `transformer.forward` and hand them to
`losses.token_loss`, which projects to logits chunk by chunk (no full [B, T, V] kept).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jopd.losses import LossBatch, LossConfig, token_loss
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import TrainBatch
from jopd.models.moe import expert_set_flips
from jopd.opd.packing import compact_hidden, pack_positions, packed_hidden


def rollout_loss_fn(model_cfg: ModelConfig, loss_cfg: LossConfig, dtype=jnp.float32, remat: bool = False):
    """OPD / RL objective on a `TrainBatch` (prompt + response, response-aligned loss fields). Only the
    positions that predict response tokens are projected to logits: the N slots of each padded row, or, for
    packed rows, the real response tokens alone. `remat`: recompute each layer in the backward pass (see
    `transformer.forward`). `teacher_head` (frozen): the teacher's LM head, for the kinds that project the
    teacher's hidden states chunk by chunk (`Objective.reads_teacher_head`).

    A batch with the sampler's routing (`TrainBatch.sampler_experts_BxSxLsxk`, a mixture-of-experts student) adds
    the routing-flip metrics (`routing_flip_metrics`), and its rows marked `replay_B` run the sampler's experts
    (`transformer.forward`'s `replay_experts_LsxBxTxk`; the others -1, their routers' own choice), so their loss,
    its gradient and `mismatch_kl` are the replayed forward's.

    `loss_cfg.router_aux_coef` > 0 (a mixture-of-experts student): + coef * `router_aux_loss`, the routers'
    load-balancing loss averaged over the sparse layers, over the tokens whose hidden states predict the loss's
    response tokens (`response_mask_BxT`)."""
    aux_coef = loss_cfg.router_aux_coef if model_cfg.sparse_layers else 0.0

    def loss_fn(params, batch: TrainBatch, teacher_head=None):
        recorded = batch.sampler_experts_BxSxLsxk  # [B, S, Ls, k] or None (a dense student)
        replay = None
        if recorded is not None:
            replay = jnp.where(batch.replay_B[:, None, None, None], recorded, jnp.asarray(-1, recorded.dtype))
            if batch.plan is not None:  # in the packed rows' layout
                recorded, replay = (pack_positions(x, batch.plan, -1) for x in (recorded, replay))
            recorded, replay = (jnp.moveaxis(x, 2, 0) for x in (recorded, replay))  # [Ls, B, S, k]: the forward's
        routed = recorded is not None
        if batch.plan is not None:  # packed rows: the hidden states that predict response tokens, compact
            if aux_coef:  # refused by `validate.check_run` (the mask would need the compact layout's positions)
                raise ValueError("loss.router_aux_coef: not with train.pack")
            out = packed_hidden(params, model_cfg, batch.tokens_BxS, batch.plan, dtype=dtype, remat=remat,
                                return_routing=routed, replay_experts_LsxBpxCxk=replay)
            hidden, *extra = out if routed else (out,)
            loss, metrics = token_loss(loss_cfg, params, model_cfg, compact_hidden(hidden, batch.plan), batch.loss,
                                       dtype=dtype, teacher_head=teacher_head)
        else:
            aux_mask = aux_mask_BxS(batch) if aux_coef else None
            hidden, _, *extra = transformer.forward(params, batch.tokens_BxS, cfg=model_cfg,
                                                    attn_mask_BxT=batch.attn_mask_BxS, dtype=dtype,
                                                    return_hidden=True, remat=remat, return_routing=routed,
                                                    replay_experts_LsxBxTxk=replay, router_aux_mask_BxT=aux_mask)
            S, N = batch.tokens_BxS.shape[1], batch.n_response
            loss, metrics = token_loss(loss_cfg, params, model_cfg, hidden[:, S - N - 1:S - 1], batch.loss,
                                       dtype=dtype, teacher_head=teacher_head)
        if routed:
            metrics = metrics | routing_flip_metrics(extra[0], recorded)
        if aux_coef:
            aux = jnp.mean(extra[-1])
            loss = loss + aux_coef * aux
            metrics = metrics | {"router_aux_loss": aux}
        return loss, metrics

    return loss_fn


def aux_mask_BxS(batch: TrainBatch) -> jax.Array:
    """[B, S]: the positions whose hidden states predict the response tokens the loss counts (`response_mask_BxT`
    shifted by one: position S - N - 1 + t predicts response token t)."""
    B, S = batch.tokens_BxS.shape
    N = batch.n_response
    resp = jnp.asarray(batch.loss.response_mask_BxT, bool)
    return jnp.concatenate([jnp.zeros((B, S - N - 1), bool), resp, jnp.zeros((B, 1), bool)], axis=1)


def routing_flip_metrics(own_LsxBxTxk: Int[Array, "Ls B T k"], recorded_LsxBxTxk: Int[Array, "Ls B T k"]
                         ) -> dict[str, jax.Array]:
    """The sampler's routing against the trainer's own router choices on the same tokens (`moe.expert_set_flips`),
    over the tokens the sampler recorded: `mismatch_router_flip_frac`, the share of router decisions (token x
    sparse layer) whose expert set differs, and `mismatch_token_flip_frac`, the share of tokens with such a
    difference in at least one sparse layer. With routing replay the trainer's own choice is its router's top-k on
    the replayed forward's hidden states."""
    flips_BxT, recorded_BxT = expert_set_flips(own_LsxBxTxk, recorded_LsxBxTxk)
    n = jnp.maximum(jnp.sum(recorded_BxT), 1).astype(jnp.float32)
    return {"mismatch_router_flip_frac": jnp.sum(flips_BxT) / (n * own_LsxBxTxk.shape[0]),
            "mismatch_token_flip_frac": jnp.sum(flips_BxT > 0) / n}


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
