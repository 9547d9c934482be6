"""A loss kind of your own: Amari's alpha-divergence between student and teacher on the truncated support.

On the support S (the teacher's top-K, or its union with the student's: `loss.support`) plus one tail outcome
for the rest of the vocabulary, with p the student's and q the teacher's probabilities:

    D_alpha(p || q) = (sum_{v in S + tail} p(v)^alpha q(v)^(1 - alpha) - 1) / (alpha (alpha - 1))

alpha -> 1 gives the truncated reverse KL with a tail (`topk_rkl_tail`), alpha -> 0 the forward one. A run
config imports this file and then names the kind like a built-in one, its alpha set in the kind's own options
(`AlphaOptions`, validated when the config is loaded), or one of the two fixed ones:

    plugins: [docs/examples/alpha_divergence.py]   # in the config's folder, else the working directory
    loss: {kind: alpha, options: {alpha: 0.7}}     # or {kind: alpha_0.5}

tests/losses/test_loss_plugin.py checks it against numpy and trains a tiny testbed run with exactly this file.
"""

import jax
import jax.numpy as jnp
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.losses import OBJECTIVES
from jopd.losses.kinds import Objective

SUPPORT = ("teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK")  # read per chunk: the teacher's support


def alpha_divergence(alpha: float):
    """The per-position terms of one alpha (a chunk of student logits, already at the loss temperature)."""

    def per_position(cfg, logits_BxCxV, inputs):
        ids, log_q = inputs["teacher_topk_ids_BxTxK"], inputs["teacher_topk_logprobs_BxTxK"]
        on_support = inputs.get("support_mask_BxTxK", jnp.ones(ids.shape, bool))  # a repeated id counts once
        log_p = jnp.take_along_axis(jax.nn.log_softmax(logits_BxCxV, axis=-1), ids, axis=-1)
        p = jnp.where(on_support, jnp.exp(log_p), 0.0)
        q = jnp.where(on_support, jnp.exp(log_q), 0.0)
        p_tail = jnp.clip(1.0 - p.sum(-1), 1e-12, 1.0)
        q_tail = jnp.clip(1.0 - q.sum(-1), 1e-12, 1.0)
        mixed = jnp.where(on_support, jnp.exp(alpha * log_p + (1 - alpha) * log_q), 0.0).sum(-1)
        mixed += p_tail ** alpha * q_tail ** (1 - alpha)
        return {"divergence": (mixed - 1.0) / (alpha * (alpha - 1.0))}

    return per_position


@config_dataclass
class AlphaOptions:
    """`loss.options` of kind `alpha` (`cfg.options` in its functions): one-line errors name the field."""

    alpha: float = pydantic.Field(0.5, gt=0.0, lt=1.0)


# the default reduction minimizes `divergence`
OBJECTIVES.add("alpha", Objective(chunk_fields=SUPPORT, after_fields=(), options=AlphaOptions,
                                  per_position=lambda cfg, logits, inputs:
                                  alpha_divergence(cfg.options.alpha)(cfg, logits, inputs)))
for a in (0.5, 0.9):
    OBJECTIVES.add(f"alpha_{a}", Objective(chunk_fields=SUPPORT, after_fields=(), per_position=alpha_divergence(a)))
