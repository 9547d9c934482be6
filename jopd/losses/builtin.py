"""The built-in loss kinds, each one `OBJECTIVES` entry (see `jopd.losses.kinds` for what an entry holds).

RL kinds: reinforce is -A log pi_s(y) per token; grpo is PPO's clipped ratio against the sampler's log-probs
(`sampler_logprobs_BxT`, the behaviour policy): -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = pi_s / pi_b.
The ratio already weights every token by pi_s / pi_b, so for grpo `is_mode` does not multiply a second IS
weight in: it bounds the one in the ratio, with factor w(r) / r (none: 1; tis: min(1, cap / r), i.e. the
effective weight min(r, cap), a cap for the negative-advantage tokens that the clip leaves unbounded; icepop:
1 inside [icepop_low, icepop_high], else 0, the token dropped). Both kinds add `kl_coef` * k3(pi_s || pi_ref)
per token when a reference is given (`reference_logprobs_BxT`).

Kinds with settings of their own declare them as `options` (`loss.options`): jsd `JSDOptions`, sampled_opd
`SampledOPDOptions`, grpo `GRPOOptions`.
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.losses import advantages
from jopd.losses import divergences as div
from jopd.losses.kinds import OBJECTIVES, Objective, divergence_reduce
from jopd.losses.masks import masked_mean
from jopd.losses.policy_gradient import (clipped_ratio_surrogate, opd_advantages, policy_gradient_surrogate,
                                         reference_kl_k3, softmax_entropy)
from jopd.parallel.vocab_projection import vocab_sharded_logits

_TOPK = ("teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK")


# -- the kinds' own settings (`loss.options`) --------------------------------------------------------------------

@config_dataclass
class JSDOptions:
    # GKD convention: JSD_b = b KL(p_t||m) + (1-b) KL(p_s||m), m = b p_t + (1-b) p_s, with the limits of
    # JSD_b/b and JSD_b/(1-b) at the ends: b=0 -> forward KL(p_t||p_s), b=1 -> reverse KL(p_s||p_t).
    beta: Annotated[float, pydantic.Field(ge=0.0, le=1.0)] = 0.5


@config_dataclass
class SampledOPDOptions:
    # advantage_t = sum_{k>=t} gamma^(k-t) r_k over unmasked k (0 = per-token advantage).
    gamma: Annotated[float, pydantic.Field(ge=0.0, le=1.0)] = 0.0


@config_dataclass
class GRPOOptions:
    # PPO's clipped ratio r = pi_theta(y) / pi_sampler(y), clipped to [1 - clip_eps, 1 + clip_eps_high] (None:
    # clip_eps; DAPO's "clip higher" sets it above clip_eps).
    clip_eps: Annotated[float, pydantic.Field(gt=0.0, lt=1.0)] = 0.2
    clip_eps_high: Annotated[float, pydantic.Field(gt=0.0)] | None = None

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high) bounds of the ratio."""
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return 1.0 - self.clip_eps, 1.0 + high


# -- per-position terms (one chunk of student logits, already at the loss temperature) ----------------------

def _topk_rkl(cfg, logits, inp):
    support = inp["support_logits"].astype(jnp.float32) / cfg.temperature
    mask = inp.get("support_mask_BxTxK")
    return {"divergence": div.topk_reverse_kl_on_support(support, inp["teacher_topk_logprobs_BxTxK"], mask),
            "topk_mass": div.topk_mass(logits, inp["teacher_topk_ids_BxTxK"], mask)}


def _topk_rkl_tail(cfg, logits, inp):
    loss, mass = div.topk_tail_reverse_kl(logits, inp["teacher_topk_ids_BxTxK"], inp["teacher_topk_logprobs_BxTxK"],
                                          inp.get("support_mask_BxTxK"))
    return {"divergence": loss, "topk_mass": mass}


def _full(divergence):
    """A full-vocabulary divergence against the teacher's logits, projected from its hidden states by its head
    in this chunk only (scaled by the same temperature)."""
    def per_position(cfg, logits, inp):
        head, hidden = jax.lax.stop_gradient(inp["teacher_head"]), inp["teacher_hidden_BxTxD"]
        # in the dtype the scoring computed the hidden states in (`train.compute_dtype`; fp32 logits either way); on a
        # mesh, each chip projects onto its slice of V (no chip holds the whole head)
        teacher = vocab_sharded_logits(head, hidden, dtype=hidden.dtype) / cfg.temperature
        return {"divergence": divergence(cfg, logits, teacher)}
    return per_position


def _none(cfg, logits, inp):
    return {}


def _entropy(cfg, logits, inp):
    """The policy's entropy on its rollout (a metric of the RL kinds): needs the full logits."""
    return {"entropy": softmax_entropy(logits)}


# -- reductions -----------------------------------------------------------------------------------------------

def _support_reduce(cfg, logp, terms, batch, mask, weights):
    """The truncated kinds: the divergence, and how much mass the support S holds (the teacher's top-K or the
    union): the student's (`topk_mass`, `off_support_mass`: what the truncated loss cannot see) and the
    teacher's (`teacher_topk_mass`), with the union's size and overlap."""
    per_position, weights, metrics = divergence_reduce(cfg, logp, terms, batch, mask, weights)
    metrics["topk_mass"] = masked_mean(terms["topk_mass"], mask)
    metrics["off_support_mass"] = 1.0 - metrics["topk_mass"]
    lp = batch.teacher_topk_logprobs_BxTxK.astype(jnp.float32)
    support = batch.support_mask_BxTxK
    if support is not None:
        lp = jnp.where(support, lp, -jnp.inf)
        unique = jnp.sum(support, axis=-1).astype(jnp.float32)
        metrics["support_size"] = masked_mean(unique, mask)
        if cfg.support == "union":  # shared ids of the two top-K sets, as a fraction of K
            metrics["topk_overlap"] = masked_mean((cfg.support_size - unique) / cfg.top_k, mask)
    metrics["teacher_topk_mass"] = masked_mean(jnp.exp(jax.nn.logsumexp(lp, axis=-1)), mask)
    return per_position, weights, metrics


def _sft_reduce(cfg, logp, terms, batch, mask, weights):
    per_position = -logp
    return per_position, weights, {"divergence": masked_mean(jax.lax.stop_gradient(per_position), mask)}


def _sampled_opd_reduce(cfg, logp, terms, batch, mask, weights):
    """Policy gradient with the per-token advantage -(log pi_s(y) - log pi_t(y)) (`options.gamma`: discounted sum)."""
    logp_sg = jax.lax.stop_gradient(logp)
    teacher = batch.teacher_target_logprobs_BxT.astype(jnp.float32)
    adv = opd_advantages(logp_sg, teacher, mask, cfg.options.gamma)
    metrics = {"divergence": masked_mean(logp_sg - teacher, mask),  # sampled reverse-KL estimate (k1)
               "advantage_mean": masked_mean(adv, mask)}
    return policy_gradient_surrogate(logp, adv), weights, metrics


def _rl_metrics(logp, terms, batch, mask):
    logp_sg = jax.lax.stop_gradient(logp)
    adv = jax.lax.stop_gradient(batch.advantages_BxT.astype(jnp.float32))
    metrics = {"advantage_mean": masked_mean(adv, mask),
               "divergence": masked_mean(-logp_sg, mask),  # NLL of the sampled tokens (no teacher)
               "entropy": masked_mean(terms["entropy"], mask)}
    return adv, metrics


def _with_reference_kl(cfg, per_position, logp, batch, mask, metrics):
    if cfg.kl_coef > 0:  # `check_batch` saw to the reference's log-probs
        kl = reference_kl_k3(logp, batch.reference_logprobs_BxT.astype(jnp.float32))
        per_position = per_position + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(jax.lax.stop_gradient(kl), mask)
    return per_position


def _reinforce_reduce(cfg, logp, terms, batch, mask, weights):
    adv, metrics = _rl_metrics(logp, terms, batch, mask)
    per_position = _with_reference_kl(cfg, policy_gradient_surrogate(logp, adv), logp, batch, mask, metrics)
    return per_position, weights, metrics


def _grpo_reduce(cfg, logp, terms, batch, mask, weights):
    adv, metrics = _rl_metrics(logp, terms, batch, mask)
    low, high = cfg.options.clip_range
    per_position, ratio, blocked = clipped_ratio_surrogate(logp, batch.sampler_logprobs_BxT.astype(jnp.float32),
                                                           adv, low, high)
    # the ratio is the IS weight already: is_mode bounds it instead of multiplying a second one in
    weights = weights / ratio if cfg.is_mode != "none" else jnp.ones_like(weights)
    metrics |= {"ratio_mean": masked_mean(ratio, mask), "clip_frac": masked_mean(blocked.astype(jnp.float32), mask)}
    per_position = _with_reference_kl(cfg, per_position, logp, batch, mask, metrics)
    return per_position, weights, metrics


# -- the entries ----------------------------------------------------------------------------------------------

OBJECTIVES.add("topk_rkl", Objective(_TOPK, (), _topk_rkl, _support_reduce, support_ids="teacher_topk_ids_BxTxK"))
OBJECTIVES.add("topk_rkl_tail", Objective(_TOPK, (), _topk_rkl_tail, _support_reduce))
OBJECTIVES.add("sampled_opd", Objective((), ("teacher_target_logprobs_BxT",), _none, _sampled_opd_reduce,
                                        options=SampledOPDOptions))
_FULL = dict(chunk_fields=("teacher_hidden_BxTxD",), after_fields=(), reads_teacher_head=True)
OBJECTIVES.add("rkl", Objective(per_position=_full(lambda cfg, s, t: div.reverse_kl(s, t)), **_FULL))
OBJECTIVES.add("fkl", Objective(per_position=_full(lambda cfg, s, t: div.forward_kl(s, t)), **_FULL))
OBJECTIVES.add("jsd", Objective(per_position=_full(lambda cfg, s, t: div.generalized_jsd(s, t, cfg.options.beta)),
                                options=JSDOptions, **_FULL))
OBJECTIVES.add("sft", Objective((), (), _none, _sft_reduce))
# RL baselines: advantages from correctness rewards (computed on the host), one per token; grpo's clipped ratio
# reads the sampler's log-probs of the sampled tokens (the behaviour policy).
OBJECTIVES.add("reinforce", Objective((), ("advantages_BxT",), _entropy, _reinforce_reduce,
                                      advantages=advantages.reinforce, reads_reference=True,
                                      baselines=("batch_mean", "leave_one_out", "running_mean")))
OBJECTIVES.add("grpo", Objective((), ("advantages_BxT", "sampler_logprobs_BxT"), _entropy, _grpo_reduce,
                                 advantages=advantages.grpo, grouped=True, reuses_rollouts=True,
                                 reads_reference=True, options=GRPOOptions))
