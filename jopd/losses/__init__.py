"""Distillation losses: pure functions of logits / log-probs, masks and weights.

Entry point: `token_loss(cfg, student_params, model_cfg, hidden_BxTxD, batch: LossBatch) -> (loss, metrics)`
(chunked over T). Each loss kind is one `OBJECTIVES` entry (`kinds.py`; built-ins in `builtin.py`, `cross_kinds.py`).
"""

from jopd.losses.batch import LossBatch
from jopd.losses.chunked import chunked_logits_map
from jopd.losses.config import LossConfig, RLConfig
from jopd.losses.divergences import (cross_entropy, forward_kl, generalized_jsd, reverse_kl, token_logprobs,
                                     topk_reverse_kl, topk_tail_reverse_kl)
from jopd.losses.is_correction import importance_ratio, importance_weights, is_metrics, mismatch_estimators
from jopd.losses.masks import loss_mask, masked_mean
from jopd.losses.compute import token_loss, token_loss_from_logits
from jopd.losses.kinds import OBJECTIVES
from jopd.losses.policy_gradient import (clipped_ratio_surrogate, discounted_future_sum, opd_advantages,
                                         policy_gradient_surrogate, reference_kl_k3, softmax_entropy)

__all__ = [
    "LossBatch", "LossConfig", "RLConfig", "OBJECTIVES", "token_loss", "token_loss_from_logits",
    "chunked_logits_map", "topk_reverse_kl", "topk_tail_reverse_kl", "reverse_kl", "forward_kl", "generalized_jsd", "cross_entropy",
    "token_logprobs", "importance_ratio", "importance_weights", "is_metrics", "mismatch_estimators",
    "loss_mask", "masked_mean", "discounted_future_sum", "opd_advantages", "policy_gradient_surrogate",
    "clipped_ratio_surrogate", "reference_kl_k3", "softmax_entropy",
]
