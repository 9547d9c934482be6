"""Teacher scoring: the frozen teacher's forward on prompt + response, reduced to what the loss kind reads
(top-K ids and log-probs, computed chunk by chunk so no [B, N, V] tensor is kept; the log-prob of every
sampled token; the full logits only for the full-vocabulary comparison losses)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jopd.losses import LossConfig, teacher_scores
from jopd.losses.objectives import OBJECTIVES
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import SequenceLayout


def support_extra_ids(layout: SequenceLayout, student_topk_ids_BxNxK, loss_cfg: LossConfig):
    """The ids `loss.support` adds to the teacher's top-K: the student's top-K (union) and the sampled token."""
    parts = []
    if loss_cfg.support == "union":
        if student_topk_ids_BxNxK is None:
            raise ValueError("loss.support=union: the rollout carries no student top-K ids (SamplingConfig.return_topk)")
        parts.append(student_topk_ids_BxNxK.astype(jnp.int32))
    if loss_cfg.support_sampled:
        parts.append(layout.targets_BxN[..., None])
    return jnp.concatenate(parts, axis=-1) if parts else None


def teacher_fields(teacher_params: Any, layout: SequenceLayout, *, teacher_cfg: ModelConfig,
                   loss_cfg: LossConfig, student_topk_ids_BxNxK=None) -> dict[str, jax.Array]:
    """`LossBatch` fields from the teacher (no gradient): teacher_topk_ids_BxTxK / _logprobs_BxTxK (the support:
    the teacher's top-K, plus the ids `loss.support` adds, with `support_mask_BxTxK`) and
    teacher_target_logprobs_BxT always, teacher_logits_BxTxV when the loss kind needs them."""
    N = layout.targets_BxN.shape[1]
    hidden = transformer.response_hidden(teacher_params, teacher_cfg, layout.tokens_BxS, layout.attn_mask_BxS, N)
    out = teacher_scores(hidden, teacher_params, k=min(loss_cfg.top_k, teacher_cfg.vocab_size),
                         chunk=loss_cfg.chunk_size, targets_BxT=layout.targets_BxN, temperature=loss_cfg.temperature,
                         extra_ids_BxTxE=support_extra_ids(layout, student_topk_ids_BxNxK, loss_cfg))
    if OBJECTIVES[loss_cfg.kind].needs_teacher_logits:
        out["teacher_logits_BxTxV"] = transformer.logits_from_hidden(teacher_params, hidden)
    return out
