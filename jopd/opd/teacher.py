"""Teacher scoring: the frozen teacher's forward on prompt + response, reduced to what the loss kind reads
(top-K ids and log-probs, computed chunk by chunk so no [B, N, V] tensor is kept; the log-prob of every
sampled token; the full logits only for the full-vocabulary comparison losses)."""

from __future__ import annotations

from typing import Any

import jax

from jopd.losses import LossConfig, teacher_scores
from jopd.losses.objectives import OBJECTIVES
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import SequenceLayout


def teacher_fields(teacher_params: Any, layout: SequenceLayout, *, teacher_cfg: ModelConfig,
                   loss_cfg: LossConfig) -> dict[str, jax.Array]:
    """`LossBatch` fields from the teacher (no gradient): teacher_topk_ids_BxTxK / _logprobs_BxTxK and
    teacher_target_logprobs_BxT always, teacher_logits_BxTxV when the loss kind needs them."""
    N = layout.targets_BxN.shape[1]
    hidden = transformer.response_hidden(teacher_params, teacher_cfg, layout.tokens_BxS, layout.attn_mask_BxS, N)
    out = teacher_scores(hidden, teacher_params, k=min(loss_cfg.top_k, teacher_cfg.vocab_size),
                         chunk=loss_cfg.chunk_size, targets_BxT=layout.targets_BxN, temperature=loss_cfg.temperature)
    if OBJECTIVES[loss_cfg.kind].needs_teacher_logits:
        out["teacher_logits_BxTxV"] = transformer.logits_from_hidden(teacher_params, hidden)
    return out
