"""The registry of loss kinds and the one entry point the trainer calls: `token_loss`.

Alignment convention: every [B, T, ...] entry describes hidden position t, i.e. the prediction of
`targets[:, t]` from the tokens up to and including input t (the trainer shifts tokens by one).

Normalization ("token-level", as in DAPO): loss = sum over unmasked (b, t) of w_bt * l_bt / N, where N is the
number of unmasked positions in the batch (response mask AND target not a special token), or the
`token_normalizer` batch entry when given (e.g. the token count of the whole batch across gradient-accumulation
micro-batches). IS weights w are stop-gradient; IcePop-dropped tokens get w = 0 but still count in N, so the
per-token scale does not depend on how many were dropped.
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
from jopd.losses.chunked import chunked_logits_map
from jopd.losses.config import LossConfig
from jopd.losses.is_correction import importance_ratio, importance_weights, is_metrics, mismatch_estimators
from jopd.losses.masks import loss_mask, masked_mean, masked_sum
from jopd.losses.policy_gradient import opd_advantages, policy_gradient_surrogate
from jopd.models.config import ModelConfig

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Objective:
    """One loss kind: batch entries it reads per logits chunk, entries it reads after, and its per-position
    terms from the (temperature-scaled) student logits of one chunk. `support_ids` names a [B, T, K] ids entry
    when the loss's gradient needs the student logits at those ids only: the full-vocabulary logits are then
    stop-gradient (metrics) and `inp["support_logits"]` carries the differentiable ones (see
    `chunked_logits_map`)."""

    chunk_keys: tuple[str, ...]
    after_keys: tuple[str, ...]
    per_position: Callable[[LossConfig, jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]
    support_ids: str | None = None


def _topk_rkl(cfg, logits, inp):
    support = inp["support_logits"].astype(jnp.float32) / cfg.temperature
    return {"divergence": div.topk_reverse_kl_on_support(support, inp["teacher_topk_logprobs"]),
            "topk_mass": div.topk_mass(logits, inp["teacher_topk_ids"])}


def _topk_rkl_tail(cfg, logits, inp):
    loss, mass = div.topk_tail_reverse_kl(logits, inp["teacher_topk_ids"], inp["teacher_topk_logprobs"])
    return {"divergence": loss, "topk_mass": mass}


def _full(divergence):
    """A full-vocabulary divergence against `teacher_logits` (scaled by the same temperature)."""
    def per_position(cfg, logits, inp):
        teacher = inp["teacher_logits"].astype(jnp.float32) / cfg.temperature
        return {"divergence": divergence(cfg, logits, teacher)}
    return per_position


OBJECTIVES: dict[str, Objective] = {
    "topk_rkl": Objective(("teacher_topk_ids", "teacher_topk_logprobs"), (), _topk_rkl, "teacher_topk_ids"),
    "topk_rkl_tail": Objective(("teacher_topk_ids", "teacher_topk_logprobs"), (), _topk_rkl_tail),
    "sampled_opd": Objective((), ("teacher_target_logprobs",), lambda cfg, logits, inp: {}),
    "rkl": Objective(("teacher_logits",), (), _full(lambda cfg, s, t: div.reverse_kl(s, t))),
    "fkl": Objective(("teacher_logits",), (), _full(lambda cfg, s, t: div.forward_kl(s, t))),
    "jsd": Objective(("teacher_logits",), (), _full(lambda cfg, s, t: div.generalized_jsd(s, t, cfg.jsd_beta))),
    "sft": Objective((), (), lambda cfg, logits, inp: {}),
    # RL baselines: the advantages (from correctness rewards, computed on the host by `jopd.rl`) arrive per token.
    "reinforce": Objective((), ("advantages",), lambda cfg, logits, inp: {}),
    "grpo": Objective((), ("advantages",), lambda cfg, logits, inp: {}),
}
PG_KINDS = ("reinforce", "grpo")


def _chunk_terms(cfg: LossConfig, logits_BxCxV: jax.Array, inp: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    logits = logits_BxCxV.astype(jnp.float32)
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    out = {"target_logprobs": div.token_logprobs(logits, inp["targets"])}
    out.update(OBJECTIVES[cfg.kind].per_position(cfg, logits, inp))
    if "sampler_full_logprobs" in inp:  # exact mismatch KL(sampler || trainer), full vocab, no gradient
        out["mismatch_kl"] = div.reverse_kl(inp["sampler_full_logprobs"].astype(jnp.float32),
                                            jax.lax.stop_gradient(logits))
    return out


def _optional_chunk_keys(batch: Batch) -> tuple[str, ...]:
    return ("sampler_full_logprobs",) if "sampler_full_logprobs" in batch else ()


def _check_batch(cfg: LossConfig, batch: Batch, B: int, T: int, vocab: int | None) -> None:
    obj = OBJECTIVES[cfg.kind]
    needed = ("targets", "response_mask") + obj.chunk_keys + obj.after_keys
    if cfg.is_mode != "none":
        needed += ("sampler_logprobs",)
    for key in needed:
        if key not in batch:
            why = f"is_mode={cfg.is_mode!r}" if key == "sampler_logprobs" else f"kind={cfg.kind!r}"
            raise ValueError(f"loss batch: missing key {key!r} (needed by LossConfig.{why})")
    for key in set(needed) | ({"sampler_logprobs"} & set(batch)):  # other batch entries are not read
        if tuple(batch[key].shape[:2]) != (B, T):
            raise ValueError(f"loss batch[{key!r}]: shape {tuple(batch[key].shape)} does not start with "
                             f"(B, T)={(B, T)}")
    if cfg.kind in ("topk_rkl", "topk_rkl_tail"):
        ids, lps = batch["teacher_topk_ids"], batch["teacher_topk_logprobs"]
        if ids.shape != (B, T, cfg.top_k) or lps.shape != ids.shape:
            raise ValueError(f"loss batch: teacher_topk_ids {tuple(ids.shape)} and teacher_topk_logprobs "
                             f"{tuple(lps.shape)} must both be (B, T, LossConfig.top_k)={(B, T, cfg.top_k)}")
    if "teacher_logits" in obj.chunk_keys and vocab is not None and batch["teacher_logits"].shape[-1] != vocab:
        raise ValueError(f"loss batch['teacher_logits']: vocab {batch['teacher_logits'].shape[-1]} != student "
                         f"vocab {vocab}")


def _reduce(cfg: LossConfig, terms: Mapping[str, jax.Array], batch: Batch) -> tuple[jax.Array, Metrics]:
    """Per-position terms [B, T] -> (scalar loss, metrics); masks, IS weights and normalization live here."""
    mask = loss_mask(batch["response_mask"], batch["targets"], cfg.special_token_ids)
    n_tokens = jnp.sum(mask).astype(jnp.float32)
    denom = batch.get("token_normalizer")
    denom = jnp.maximum(n_tokens, 1.0) if denom is None else jnp.asarray(denom, jnp.float32)
    logp = terms["target_logprobs"]
    logp_sg = jax.lax.stop_gradient(logp)
    metrics: Metrics = {"num_tokens": n_tokens, "target_logprob": masked_mean(logp_sg, mask)}

    weights = jnp.ones_like(logp)
    if "sampler_logprobs" in batch:
        sampler = batch["sampler_logprobs"].astype(jnp.float32)
        ratio = importance_ratio(logp_sg, sampler)
        kw = dict(cap=cfg.is_cap, low=cfg.icepop_low, high=cfg.icepop_high)
        weights = importance_weights(ratio, cfg.is_mode, **kw)
        metrics |= is_metrics(ratio, weights, mask, cfg.is_mode, **kw)
        metrics |= mismatch_estimators(logp_sg, sampler, mask)

    if cfg.kind == "sampled_opd":
        teacher = batch["teacher_target_logprobs"].astype(jnp.float32)
        adv = opd_advantages(logp_sg, teacher, mask, cfg.gamma)
        per_position = policy_gradient_surrogate(logp, adv)
        metrics["divergence"] = masked_mean(logp_sg - teacher, mask)  # sampled reverse-KL estimate (k1)
        metrics["advantage_mean"] = masked_mean(adv, mask)
    elif cfg.kind in PG_KINDS:
        adv = jax.lax.stop_gradient(batch["advantages"].astype(jnp.float32))
        per_position = policy_gradient_surrogate(logp, adv)
        metrics["advantage_mean"] = masked_mean(adv, mask)
        metrics["divergence"] = masked_mean(-logp_sg, mask)  # NLL of the sampled tokens (no teacher involved)
    else:
        per_position = -logp if cfg.kind == "sft" else terms["divergence"]
        metrics["divergence"] = masked_mean(jax.lax.stop_gradient(per_position), mask)
    if "teacher_target_logprobs" in batch:  # sampled estimate (k1) of KL(student || teacher) on the rollouts
        metrics["teacher_kl_k1"] = masked_mean(logp_sg - batch["teacher_target_logprobs"].astype(jnp.float32), mask)
    if "mismatch_kl" in terms:  # averaged over response tokens (special tokens included), per DESIGN.md
        metrics["mismatch_kl"] = masked_mean(terms["mismatch_kl"], batch["response_mask"].astype(bool))
    if "topk_mass" in terms:
        metrics["topk_mass"] = masked_mean(terms["topk_mass"], mask)
        teacher_mass = jnp.exp(jax.nn.logsumexp(batch["teacher_topk_logprobs"].astype(jnp.float32), axis=-1))
        metrics["teacher_topk_mass"] = masked_mean(teacher_mass, mask)

    loss = masked_sum(weights * per_position, mask) / denom
    metrics["loss"] = loss
    return loss, metrics


def token_loss(
    cfg: LossConfig,
    student_params: Mapping[str, Any],
    model_cfg: ModelConfig,
    hidden_BxTxD: Float[Array, "B T D"],
    batch: Batch,
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

    Batch keys (all aligned with hidden positions, see module docstring):
      targets                 [B,T] int    token predicted at each position (always)
      response_mask           [B,T] bool   1 on response positions that count (always)
      teacher_topk_ids        [B,T,K] int32  kind=topk_rkl; K = cfg.top_k (from `teacher_scores`)
      teacher_topk_logprobs   [B,T,K] fp32   kind=topk_rkl; teacher log-probs under its full softmax
      teacher_target_logprobs [B,T] fp32   kind=sampled_opd; log pi_t(targets)
      teacher_logits          [B,T,V] fp32   kind=rkl|fkl|jsd (comparison runs / small vocab)
      advantages              [B,T] fp32   kind=reinforce|grpo: the sequence's advantage on each of its tokens
      sampler_logprobs        [B,T] fp32   log q(targets) from the sampler; required if is_mode != none,
                                            otherwise optional (adds mismatch / IS metrics)
      token_normalizer        []    fp32   optional denominator replacing the unmasked-token count
      sampler_full_logprobs   [B,T,V] fp32 optional: the sampler's full (unprocessed) log-softmax at the same
                                            temperature; adds metric mismatch_kl = exact KL(sampler || trainer)

    Metrics: loss, num_tokens, divergence (mean unweighted per-token objective: truncated/full divergence,
    NLL for sft, sampled reverse-KL k1 for sampled_opd), target_logprob; topk_rkl adds topk_mass (student's
    full-softmax mass on the teacher's top-K) and teacher_topk_mass; sampled_opd adds advantage_mean; with
    sampler_logprobs: is_ratio_mean, is_weight_mean, is_ess, is_frac_truncated, is_frac_dropped, mismatch_k1,
    mismatch_k3, mismatch_mean_abs_dprob, mismatch_max_abs_dprob.
    """
    B, T, D = hidden_BxTxD.shape
    if D != model_cfg.hidden_size:
        raise ValueError(f"token_loss: hidden size {D} != ModelConfig.hidden_size {model_cfg.hidden_size}")
    _check_batch(cfg, batch, B, T, model_cfg.vocab_size)
    obj = OBJECTIVES[cfg.kind]
    keys = ("targets",) + obj.chunk_keys + _optional_chunk_keys(batch)
    terms = chunked_logits_map(functools.partial(_chunk_terms, cfg), student_params, hidden_BxTxD,
                               {k: batch[k] for k in keys}, cfg.chunk_size, dtype=dtype, remat=True,
                               support_ids_key=obj.support_ids)
    return _reduce(cfg, terms, batch)


def token_loss_from_logits(cfg: LossConfig, logits_BxTxV: Float[Array, "B T V"], batch: Batch
                           ) -> tuple[Float[Array, ""], Metrics]:
    """Same loss from already materialized student logits (unchunked reference; tests, small vocab)."""
    B, T, V = logits_BxTxV.shape
    _check_batch(cfg, batch, B, T, V)
    obj = OBJECTIVES[cfg.kind]
    inp = {k: batch[k] for k in ("targets",) + obj.chunk_keys + _optional_chunk_keys(batch)}
    if obj.support_ids is not None:
        inp["support_logits"] = jnp.take_along_axis(logits_BxTxV, inp[obj.support_ids].astype(jnp.int32), axis=-1)
    return _reduce(cfg, _chunk_terms(cfg, logits_BxTxV, inp), batch)
