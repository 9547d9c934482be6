"""The registry of loss kinds and the one entry point the trainer calls: `token_loss`.

Alignment convention: every [B, T, ...] field of `LossBatch` describes hidden position t, i.e. the prediction of
`targets_BxT[:, t]` from the tokens up to and including input t (the trainer shifts tokens by one).

Normalization ("token-level", as in DAPO): loss = sum over unmasked (b, t) of w_bt * l_bt / N, where N is the
number of unmasked positions in the batch (response mask AND target not a special token), or the
`token_normalizer` field when given (e.g. the token count of the whole batch across gradient-accumulation
micro-batches), or, with `LossConfig.token_sum_norm` (Dr. GRPO), the constant B * T (rows x response slots; T =
the sampler's max_new_tokens): a micro-batch of B/n rows then divides by (B/n) * T, so the mean over the
micro-batches equals the whole batch's token sum / (B T). IS weights w are stop-gradient; IcePop-dropped tokens
get w = 0 but still count in N, so the per-token scale does not depend on how many were dropped.

RL kinds: reinforce is -A log pi_s(y) per token; grpo is PPO's clipped ratio against the sampler's log-probs
(`sampler_logprobs_BxT`, the behaviour policy): -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = pi_s / pi_b.
The ratio already weights every token by pi_s / pi_b, so for grpo `is_mode` does not multiply a second IS
weight in: it bounds the one in the ratio, with factor w(r) / r (none: 1; tis: min(1, cap / r), i.e. the
effective weight min(r, cap), a cap for the negative-advantage tokens that the clip leaves unbounded; icepop:
1 inside [icepop_low, icepop_high], else 0, the token dropped). Both kinds add `kl_coef` * k3(pi_s || pi_ref)
per token when a reference is given (`reference_logprobs_BxT`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jopd.losses import divergences as div
from jopd.losses.batch import LossBatch
from jopd.losses.chunked import chunked_logits_map
from jopd.losses.config import LossConfig
from jopd.losses.is_correction import (exact_kl_BxT, importance_ratio, importance_weights, is_metrics,
                                      mismatch_estimators)
from jopd.losses.masks import loss_mask, masked_mean, masked_sum
from jopd.losses.policy_gradient import (clipped_ratio_surrogate, opd_advantages, policy_gradient_surrogate,
                                         reference_kl_k3, softmax_entropy)
from jopd.models.config import ModelConfig

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Objective:
    """One loss kind, and everything the OPD step must provide for it (declared here only).

    `chunk_fields`: `LossBatch` fields read per logits chunk; `after_fields`: fields read after the chunked map;
    `per_position(cfg, logits, inputs)`: the kind's per-position terms from the (temperature-scaled) student
    logits of one chunk. `support_ids` names a [B, T, K] ids field when the gradient needs the student logits
    at those ids only: the full-vocabulary logits are then stop-gradient (metrics) and
    `inputs["support_logits"]` carries the differentiable ones (see `chunked_logits_map`). `grouped`: the
    rollouts come in groups of `rl.group_size` samples per prompt; `uses_rewards`: the step computes
    per-sequence rewards and hands advantages in `advantages_BxT`."""

    chunk_fields: tuple[str, ...]
    after_fields: tuple[str, ...]
    per_position: Callable[[LossConfig, jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]
    support_ids: str | None = None
    grouped: bool = False
    uses_rewards: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return ("targets_BxT", "response_mask_BxT") + self.chunk_fields + self.after_fields

    @property
    def needs_teacher_logits(self) -> bool:
        return "teacher_logits_BxTxV" in self.fields

    @property
    def needs_teacher_topk(self) -> bool:
        return "teacher_topk_ids_BxTxK" in self.fields


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
    """A full-vocabulary divergence against `teacher_logits_BxTxV` (scaled by the same temperature)."""
    def per_position(cfg, logits, inp):
        teacher = inp["teacher_logits_BxTxV"].astype(jnp.float32) / cfg.temperature
        return {"divergence": divergence(cfg, logits, teacher)}
    return per_position


def _none(cfg, logits, inp):
    return {}


_TOPK = ("teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK")
OBJECTIVES: dict[str, Objective] = {
    "topk_rkl": Objective(_TOPK, (), _topk_rkl, support_ids="teacher_topk_ids_BxTxK"),
    "topk_rkl_tail": Objective(_TOPK, (), _topk_rkl_tail),
    "sampled_opd": Objective((), ("teacher_target_logprobs_BxT",), _none),
    "rkl": Objective(("teacher_logits_BxTxV",), (), _full(lambda cfg, s, t: div.reverse_kl(s, t))),
    "fkl": Objective(("teacher_logits_BxTxV",), (), _full(lambda cfg, s, t: div.forward_kl(s, t))),
    "jsd": Objective(("teacher_logits_BxTxV",), (), _full(lambda cfg, s, t: div.generalized_jsd(s, t, cfg.jsd_beta))),
    "sft": Objective((), (), _none),
    # RL baselines: advantages from correctness rewards (computed on the host by `jopd.rl`), one per token;
    # grpo's clipped ratio reads the sampler's log-probs of the sampled tokens (the behaviour policy).
    "reinforce": Objective((), ("advantages_BxT",), _none, uses_rewards=True),
    "grpo": Objective((), ("advantages_BxT", "sampler_logprobs_BxT"), _none, grouped=True, uses_rewards=True),
}


def needs_reference(cfg: LossConfig) -> bool:
    """The loss reads `reference_logprobs_BxT` (the KL term of the RL kinds)."""
    return OBJECTIVES[cfg.kind].uses_rewards and cfg.kl_coef > 0


def _chunk_terms(cfg: LossConfig, logits_BxCxV: jax.Array, inp: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    logits = logits_BxCxV.astype(jnp.float32)
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    out = {"target_logprobs": div.token_logprobs(logits, inp["targets_BxT"])}
    out.update(OBJECTIVES[cfg.kind].per_position(cfg, logits, inp))
    if OBJECTIVES[cfg.kind].uses_rewards:  # the policy's entropy on its rollout: needs the full logits
        out["entropy"] = softmax_entropy(logits)
    if "sampler_full_logprobs_BxTxV" in inp:  # exact mismatch KL(sampler || trainer), full vocab, no gradient
        # the lab's formula (`jopd mismatch` computes the same outside the step); logits are already at temperature
        out["mismatch_kl"] = exact_kl_BxT(inp["sampler_full_logprobs_BxTxV"], jax.lax.stop_gradient(logits))
    return out


def _chunk_inputs(cfg: LossConfig, batch: LossBatch) -> dict[str, jax.Array]:
    """The fields the chunked map slices: the kind's own, and the sampler's full log-softmax when present."""
    names = ("targets_BxT",) + OBJECTIVES[cfg.kind].chunk_fields + ("sampler_full_logprobs_BxTxV",)
    if OBJECTIVES[cfg.kind].needs_teacher_topk:
        names += ("support_mask_BxTxK",)  # set when the support is a union (repeated ids masked)
    return batch.select(names)


def check_batch(cfg: LossConfig, batch: LossBatch, vocab: int | None = None) -> None:
    """Every field the kind needs is set, and every set field starts with (B, T) (trace time: shapes only)."""
    obj = OBJECTIVES[cfg.kind]
    needed = obj.fields + (("sampler_logprobs_BxT",) if cfg.is_mode != "none" else ())
    needed += ("reference_logprobs_BxT",) if needs_reference(cfg) else ()
    for name in needed:
        if getattr(batch, name) is None:
            why = (f"is_mode={cfg.is_mode!r}" if name == "sampler_logprobs_BxT" and cfg.kind != "grpo" else
                   f"kl_coef={cfg.kl_coef}" if name == "reference_logprobs_BxT" else f"kind={cfg.kind!r}")
            raise ValueError(f"LossBatch.{name}: missing (needed by LossConfig.{why})")
    B, T = batch.targets_BxT.shape
    for name in batch.present():
        x = getattr(batch, name)
        if name != "token_normalizer" and tuple(x.shape[:2]) != (B, T):
            raise ValueError(f"LossBatch.{name}: shape {tuple(x.shape)} does not start with (B, T)={(B, T)}")
    if obj.needs_teacher_topk:
        ids, lps = batch.teacher_topk_ids_BxTxK, batch.teacher_topk_logprobs_BxTxK
        K = cfg.support_size
        if ids.shape != (B, T, K) or lps.shape != ids.shape:
            raise ValueError(f"LossBatch: teacher_topk_ids_BxTxK {tuple(ids.shape)} and teacher_topk_logprobs_BxTxK "
                             f"{tuple(lps.shape)} must both be (B, T, LossConfig.support_size)={(B, T, K)}")
        if cfg.extra_support and batch.support_mask_BxTxK is None:
            raise ValueError(f"LossBatch.support_mask_BxTxK: missing (needed by LossConfig.support={cfg.support!r}, "
                             f"support_sampled={cfg.support_sampled})")
    if obj.needs_teacher_logits and vocab is not None and batch.teacher_logits_BxTxV.shape[-1] != vocab:
        raise ValueError(f"LossBatch.teacher_logits_BxTxV: vocab {batch.teacher_logits_BxTxV.shape[-1]} != "
                         f"student vocab {vocab}")


def _rl_terms(cfg: LossConfig, logp: jax.Array, terms: Mapping[str, jax.Array], batch: LossBatch, mask: jax.Array,
              weights: jax.Array) -> tuple[jax.Array, Metrics, jax.Array]:
    """reinforce / grpo: (per-position loss, metrics, per-position weights); see the module docstring."""
    logp_sg = jax.lax.stop_gradient(logp)
    adv = jax.lax.stop_gradient(batch.advantages_BxT.astype(jnp.float32))
    metrics: Metrics = {"advantage_mean": masked_mean(adv, mask),
                        "divergence": masked_mean(-logp_sg, mask),  # NLL of the sampled tokens (no teacher)
                        "entropy": masked_mean(terms["entropy"], mask)}
    if cfg.kind == "grpo":
        low, high = cfg.clip_range
        per_position, ratio, blocked = clipped_ratio_surrogate(logp, batch.sampler_logprobs_BxT.astype(jnp.float32),
                                                               adv, low, high)
        # the ratio is the IS weight already: is_mode bounds it instead of multiplying a second one in
        weights = weights / ratio if cfg.is_mode != "none" else jnp.ones_like(weights)
        metrics |= {"ratio_mean": masked_mean(ratio, mask),
                    "clip_frac": masked_mean(blocked.astype(jnp.float32), mask)}
    else:
        per_position = policy_gradient_surrogate(logp, adv)
    if needs_reference(cfg):
        kl = reference_kl_k3(logp, batch.reference_logprobs_BxT.astype(jnp.float32))
        per_position = per_position + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(jax.lax.stop_gradient(kl), mask)
    return per_position, metrics, weights


def _reduce(cfg: LossConfig, terms: Mapping[str, jax.Array], batch: LossBatch) -> tuple[jax.Array, Metrics]:
    """Per-position terms [B, T] -> (scalar loss, metrics); masks, IS weights and normalization live here."""
    mask = loss_mask(batch.response_mask_BxT, batch.targets_BxT, cfg.special_token_ids, cfg.template_token_ids)
    n_tokens = jnp.sum(mask).astype(jnp.float32)
    denom = batch.token_normalizer
    if denom is not None:
        denom = jnp.asarray(denom, jnp.float32)
    elif cfg.token_sum_norm:
        denom = jnp.asarray(float(mask.size), jnp.float32)  # rows x response slots: a constant of the shape
    else:
        denom = jnp.maximum(n_tokens, 1.0)
    logp = terms["target_logprobs"]
    logp_sg = jax.lax.stop_gradient(logp)
    metrics: Metrics = {"num_tokens": n_tokens, "target_logprob": masked_mean(logp_sg, mask)}

    weights = jnp.ones_like(logp)
    if batch.sampler_logprobs_BxT is not None:
        sampler = batch.sampler_logprobs_BxT.astype(jnp.float32)
        ratio = importance_ratio(logp_sg, sampler)
        kw = dict(cap=cfg.is_cap, low=cfg.icepop_low, high=cfg.icepop_high)
        weights = importance_weights(ratio, cfg.is_mode, **kw)
        metrics |= is_metrics(ratio, weights, mask, cfg.is_mode, **kw)
        metrics |= {f"mismatch_{k}": v for k, v in mismatch_estimators(sampler, logp_sg, mask).items()}

    teacher_lp = batch.teacher_target_logprobs_BxT
    if cfg.kind == "sampled_opd":
        teacher = teacher_lp.astype(jnp.float32)
        adv = opd_advantages(logp_sg, teacher, mask, cfg.gamma)
        per_position = policy_gradient_surrogate(logp, adv)
        metrics["divergence"] = masked_mean(logp_sg - teacher, mask)  # sampled reverse-KL estimate (k1)
        metrics["advantage_mean"] = masked_mean(adv, mask)
    elif OBJECTIVES[cfg.kind].uses_rewards:
        per_position, rl_metrics, weights = _rl_terms(cfg, logp, terms, batch, mask, weights)
        metrics |= rl_metrics
    else:
        per_position = -logp if cfg.kind == "sft" else terms["divergence"]
        metrics["divergence"] = masked_mean(jax.lax.stop_gradient(per_position), mask)
    if teacher_lp is not None:  # sampled estimate (k1) of KL(student || teacher) on the rollouts
        metrics["teacher_kl_k1"] = masked_mean(logp_sg - teacher_lp.astype(jnp.float32), mask)
    if "mismatch_kl" in terms:  # averaged over response tokens (special tokens included): docs/architecture.md
        metrics["mismatch_kl"] = masked_mean(terms["mismatch_kl"], batch.response_mask_BxT.astype(bool))
    if "topk_mass" in terms:  # mass on the support S (the teacher's top-K, or the union)
        metrics["topk_mass"] = masked_mean(terms["topk_mass"], mask)
        metrics["off_support_mass"] = 1.0 - metrics["topk_mass"]  # the student mass the truncated loss cannot see
        lp = batch.teacher_topk_logprobs_BxTxK.astype(jnp.float32)
        support = batch.support_mask_BxTxK
        if support is not None:
            lp = jnp.where(support, lp, -jnp.inf)
            unique = jnp.sum(support, axis=-1).astype(jnp.float32)
            metrics["support_size"] = masked_mean(unique, mask)
            if cfg.support == "union":  # shared ids of the two top-K sets, as a fraction of K
                metrics["topk_overlap"] = masked_mean((cfg.support_size - unique) / cfg.top_k, mask)
        metrics["teacher_topk_mass"] = masked_mean(jnp.exp(jax.nn.logsumexp(lp, axis=-1)), mask)

    loss = masked_sum(weights * per_position, mask) / denom
    metrics["loss"] = loss
    return loss, metrics


def token_loss(
    cfg: LossConfig,
    student_params: Mapping[str, Any],
    model_cfg: ModelConfig,
    hidden_BxTxD: Float[Array, "B T D"],
    batch: LossBatch,
    *,
    dtype=jnp.float32,
) -> tuple[Float[Array, ""], Metrics]:
    """Scalar loss and metrics from the student's final hidden states, projected to logits chunk by chunk.

    `hidden_BxTxD` is `transformer.forward(params, tokens, cfg=model_cfg, return_hidden=True)[0]`; the
    projection uses `transformer.logits_from_hidden` in `dtype` with fp32 logits, `cfg.chunk_size` positions
    at a time under `jax.checkpoint`, so neither forward nor backward keeps a full [B, T, V] tensor (peak
    O(B * chunk_size * V)). Differentiable in `student_params` and `hidden_BxTxD`; call it inside
    `jax.value_and_grad(..., has_aux=True)`. For topk_rkl the gradient goes through the student's logits at
    the teacher's top-K ids only (gathered head rows): the full-vocabulary logits feed stop-gradient metrics.

    `batch` fields (see `LossBatch`; each kind's needs are declared in `OBJECTIVES`): targets and response
    mask always; teacher top-K ids/log-probs (topk kinds, K = cfg.top_k, from `teacher_scores`); teacher
    target log-probs (sampled_opd, and the teacher_kl_k1 metric); full teacher logits (rkl / fkl / jsd);
    advantages (reinforce / grpo); reference log-probs (reinforce / grpo with kl_coef > 0); sampler log-probs
    of the targets (required by grpo and if is_mode != none, otherwise optional: mismatch and IS metrics); the
    sampler's full log-softmax (optional: the exact mismatch_kl);
    token_normalizer (optional denominator).

    Metrics: loss, num_tokens, divergence (mean unweighted per-token objective: truncated/full divergence,
    NLL for sft, sampled reverse-KL k1 for sampled_opd), target_logprob; topk_rkl adds topk_mass (student's
    full-softmax mass on the teacher's top-K) and teacher_topk_mass; sampled_opd adds advantage_mean; reinforce
    and grpo add advantage_mean, entropy (of the student's distribution at the temperature, mean per token) and,
    with kl_coef > 0, kl_ref (k3 of KL(student || reference)); grpo adds ratio_mean (pi_s / pi_sampler) and
    clip_frac (tokens whose gradient the clip blocks); with
    sampler_logprobs: is_ratio_mean, is_weight_mean, is_ess, is_frac_truncated, is_frac_dropped, mismatch_k1,
    mismatch_k3, mismatch_mean_abs_dprob, mismatch_max_abs_dprob, mismatch_ess.
    """
    B, T, D = hidden_BxTxD.shape
    if D != model_cfg.hidden_size:
        raise ValueError(f"token_loss: hidden size {D} != ModelConfig.hidden_size {model_cfg.hidden_size}")
    if tuple(batch.targets_BxT.shape) != (B, T):
        raise ValueError(f"token_loss: LossBatch.targets_BxT {tuple(batch.targets_BxT.shape)} != hidden (B, T)={(B, T)}")
    check_batch(cfg, batch, model_cfg.vocab_size)
    terms = chunked_logits_map(functools.partial(_chunk_terms, cfg), student_params, hidden_BxTxD,
                               _chunk_inputs(cfg, batch), cfg.chunk_size, dtype=dtype, remat=True,
                               support_ids_key=OBJECTIVES[cfg.kind].support_ids)
    return _reduce(cfg, terms, batch)


def token_loss_from_logits(cfg: LossConfig, logits_BxTxV: Float[Array, "B T V"], batch: LossBatch
                           ) -> tuple[Float[Array, ""], Metrics]:
    """Same loss from already materialized student logits (unchunked reference; tests, small vocab)."""
    check_batch(cfg, batch, logits_BxTxV.shape[-1])
    obj = OBJECTIVES[cfg.kind]
    inp = _chunk_inputs(cfg, batch)
    if obj.support_ids is not None:
        inp["support_logits"] = jnp.take_along_axis(logits_BxTxV, inp[obj.support_ids].astype(jnp.int32), axis=-1)
    return _reduce(cfg, _chunk_terms(cfg, logits_BxTxV, inp), batch)
