"""The one entry point the trainer calls: `token_loss` (and its unchunked reference `token_loss_from_logits`).

What each loss kind computes and reads is its `OBJECTIVES` entry (`jopd.losses.kinds`; the built-ins in
`jopd.losses.builtin`); this module does what every kind shares: the chunked projection, the masks, the IS
weights, the normalization and the rollout metrics.

Alignment convention: every [B, T, ...] field of `LossBatch` describes hidden position t, i.e. the prediction of
`targets_BxT[:, t]` from the tokens up to and including input t (the trainer shifts tokens by one).

Normalization ("token-level", as in DAPO): loss = sum over unmasked (b, t) of w_bt * l_bt / N, where N is the
number of unmasked positions in the batch (response mask AND target not a special token), or the
`token_normalizer` field when given (e.g. the token count of the whole batch across gradient-accumulation
micro-batches), or, with `LossConfig.token_sum_norm` (Dr. GRPO), the constant B * T (rows x response slots; T =
the sampler's max_new_tokens): a micro-batch of B/n rows then divides by (B/n) * T, so the mean over the
micro-batches equals the whole batch's token sum / (B T). IS weights w are stop-gradient; IcePop-dropped tokens
get w = 0 but still count in N, so the per-token scale does not depend on how many were dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jopd.losses import builtin, cross_kinds  # noqa: F401  (register the built-in kinds)
from jopd.losses import divergences as div
from jopd.losses.batch import LossBatch
from jopd.losses.chunked import chunked_logits_map
from jopd.losses.config import LossConfig
from jopd.losses.is_correction import (exact_kl_BxT, importance_ratio, importance_weights, is_metrics,
                                      mismatch_estimators, staleness_split_BxT)
from jopd.losses.kinds import OBJECTIVES, Metrics
from jopd.losses.layout import compact_chunk, from_compact, to_compact
from jopd.losses.masks import loss_mask, masked_mean, masked_sum
from jopd.models.config import ModelConfig
from jopd.parallel.vocab_projection import vocab_sharded_head

__all__ = ["check_batch", "compact_fields", "loss_chunk", "needs_reference", "per_task_means",
           "token_loss", "token_loss_from_logits"]


def needs_reference(cfg: LossConfig) -> bool:
    """The loss reads `reference_logprobs_BxT` (the KL term of the RL kinds, `loss.kl_coef > 0`)."""
    return OBJECTIVES[cfg.kind].reads_reference and cfg.kl_coef > 0


def loss_chunk(cfg: LossConfig) -> int:
    """Positions per chunk of the loss: `loss.chunk_size`, halved for the kinds that also project the teacher's
    logits in each chunk (two [B, C, V] logits: half the positions keep the peak that chunk_size sets)."""
    return max(1, cfg.chunk_size // 2) if OBJECTIVES[cfg.kind].reads_teacher_head else cfg.chunk_size


def _chunk_terms(cfg: LossConfig, teacher_head, logits_BxCxV: jax.Array, inp: Mapping[str, jax.Array]
                 ) -> dict[str, jax.Array]:
    logits = logits_BxCxV.astype(jnp.float32)
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    out = {"target_logprobs": div.token_logprobs(logits, inp["targets_BxT"])}
    if teacher_head is not None:  # the same head in every chunk (not sliced)
        inp = dict(inp, teacher_head=teacher_head)
    out.update(OBJECTIVES[cfg.kind].per_position(cfg, logits, inp))
    if "sampler_full_logprobs_BxTxV" in inp:  # exact mismatch KL(sampler || trainer), full vocab, no gradient
        # the lab's formula (`jopd mismatch` computes the same outside the step); logits are already at temperature
        out["mismatch_kl"] = exact_kl_BxT(inp["sampler_full_logprobs_BxTxV"], jax.lax.stop_gradient(logits))
        if "lagged_full_logprobs_BxTxV" in inp:  # rollout.staleness > 0: its engine / staleness / cross parts
            split = staleness_split_BxT(inp["sampler_full_logprobs_BxTxV"], inp["lagged_full_logprobs_BxTxV"],
                                        jax.lax.stop_gradient(logits))
            out |= {f"mismatch_kl_{k}": v for k, v in split.items()}
    return out


def compact_fields(cfg: LossConfig) -> tuple[str, ...]:
    """The kind's fields read per chunk: what a packed batch holds in the compact layout."""
    names = OBJECTIVES[cfg.kind].chunk_fields
    if OBJECTIVES[cfg.kind].needs_teacher_topk:
        names += ("support_mask_BxTxK",)  # set when the support is a union (repeated ids masked)
    return names


def _chunk_inputs(cfg: LossConfig, batch: LossBatch) -> dict[str, jax.Array]:
    """The fields the chunked map slices: the targets, the kind's own, and the sampler's full log-softmax when
    present; a packed batch's in the compact layout (the targets and the sampler's moved there now)."""
    full = ("sampler_full_logprobs_BxTxV", "lagged_full_logprobs_BxTxV")
    inp = batch.select(("targets_BxT",) + compact_fields(cfg) + full)
    if batch.compact is not None:
        for name in ("targets_BxT",) + full:
            if name in inp:
                inp[name] = to_compact(inp[name], batch.compact)
    return inp


def _padded(cfg: LossConfig, batch: LossBatch, terms: Mapping[str, jax.Array]):
    """A packed batch's compact fields and the chunked terms, back in the padded response layout the reduction
    reads (under jit, what the reduction does not read is never moved)."""
    if batch.compact is None:
        return batch, terms
    layout = batch.compact
    back = {n: from_compact(getattr(batch, n), layout) for n in compact_fields(cfg) if getattr(batch, n) is not None}
    return (batch.replace(compact=None, **back), {k: from_compact(v, layout) for k, v in terms.items()})


def check_batch(cfg: LossConfig, batch: LossBatch, vocab: int | None = None, teacher_head=None) -> None:
    """Every field the kind needs is set, and every set field starts with (B, T) — a packed batch's chunk fields
    with the compact layout's (Q, Cq) — (trace time: shapes only)."""
    obj = OBJECTIVES[cfg.kind]
    needed = obj.fields + (("sampler_logprobs_BxT",) if cfg.is_mode != "none" else ())
    needed += ("reference_logprobs_BxT",) if needs_reference(cfg) else ()
    for name in needed:
        if getattr(batch, name) is None:
            why = (f"kind={cfg.kind!r}" if name in obj.fields else
                   f"kl_coef={cfg.kl_coef}" if name == "reference_logprobs_BxT" else f"is_mode={cfg.is_mode!r}")
            raise ValueError(f"LossBatch.{name}: missing (needed by LossConfig.{why})")
    padded = B, T = batch.targets_BxT.shape
    compact = set(compact_fields(cfg)) if batch.compact is not None else set()
    for name in batch.present():
        x = getattr(batch, name)
        want, what = (batch.compact.shape, "compact (Q, Cq)") if name in compact else (padded, "(B, T)")
        if name != "token_normalizer" and tuple(x.shape[:2]) != want:
            raise ValueError(f"LossBatch.{name}: shape {tuple(x.shape)} does not start with {what}={want}")
    if batch.compact is not None:
        B, T = batch.compact.shape  # the chunk fields' leading dims
    if obj.needs_teacher_topk:
        ids, lps = batch.teacher_topk_ids_BxTxK, batch.teacher_topk_logprobs_BxTxK
        K = cfg.support_size
        if ids.shape != (B, T, K) or lps.shape != ids.shape:
            raise ValueError(f"LossBatch: teacher_topk_ids_BxTxK {tuple(ids.shape)} and teacher_topk_logprobs_BxTxK "
                             f"{tuple(lps.shape)} must both be (B, T, LossConfig.support_size)={(B, T, K)}")
        if cfg.extra_support and batch.support_mask_BxTxK is None:
            raise ValueError(f"LossBatch.support_mask_BxTxK: missing (needed by LossConfig.support={cfg.support!r}, "
                             f"support_sampled={cfg.support_sampled})")
    if obj.reads_teacher_head:
        if teacher_head is None:
            raise ValueError(f"token_loss: teacher_head missing (LossConfig.kind={cfg.kind!r} projects the teacher's "
                             f"hidden states with it)")
        head_V = (teacher_head["lm_head"].shape[-1] if "lm_head" in teacher_head else teacher_head["embed"].shape[0])
        if vocab is not None and head_V != vocab:
            raise ValueError(f"token_loss: the teacher's head has vocab {head_V} != student vocab {vocab}")


def _reduce(cfg: LossConfig, terms: Mapping[str, jax.Array], batch: LossBatch) -> tuple[jax.Array, Metrics]:
    """Per-position terms [B, T] -> (scalar loss, metrics); masks, IS weights and normalization live here."""
    mask = loss_mask(batch.response_mask_BxT, batch.targets_BxT, cfg.special_token_ids, cfg.template_token_ids)
    objective = OBJECTIVES[cfg.kind]
    if objective.signal_mask is not None:
        mask = objective.signal_mask(batch, mask)
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

    per_position, weights, kind_metrics = objective.reduce(cfg, logp, terms, batch, mask, weights)
    metrics |= kind_metrics
    teacher_lp = batch.teacher_target_logprobs_BxT
    if teacher_lp is not None:  # sampled estimate (k1) of KL(student || teacher) on the rollouts
        metrics["teacher_kl_k1"] = masked_mean(logp_sg - teacher_lp.astype(jnp.float32), mask)
    for name in [k for k in terms if k.startswith("mismatch_kl")]:  # averaged over response tokens (special
        metrics[name] = masked_mean(terms[name], batch.response_mask_BxT.astype(bool))  # included): architecture.md

    loss = masked_sum(weights * per_position, mask) / denom
    metrics["loss"] = loss
    if cfg.task_names and batch.task_BxT is not None:
        metrics |= _task_sums(cfg.task_names, batch.task_BxT, mask, jax.lax.stop_gradient(weights * per_position),
                              None if teacher_lp is None else logp_sg - teacher_lp.astype(jnp.float32))
    return loss, metrics


def _task_sums(names, task_BxT, mask, loss_BxT, k1_BxT) -> Metrics:
    """Per task: its loss tokens and the sums of its per-token loss and teacher k1 (`task/<name>/..._sum`); the
    loop divides them (`per_task_means`). Sums, not means, so micro-batch averages still divide exactly."""
    out = {}
    for t, name in enumerate(names):
        m = mask & (task_BxT == t)
        out[f"task/{name}/num_tokens"] = jnp.sum(m).astype(jnp.float32)
        out[f"task/{name}/loss_sum"] = masked_sum(loss_BxT, m)
        if k1_BxT is not None:
            out[f"task/{name}/teacher_kl_k1_sum"] = masked_sum(k1_BxT, m)
    return out


def per_task_means(metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` with each task's `..._sum` turned into a per-token mean (`task/<name>/loss`, NaN without
    tokens); every other metric as it is."""
    out = {k: v for k, v in metrics.items() if not (k.startswith("task/") and k.endswith("_sum"))}
    for k, v in metrics.items():
        if k.startswith("task/") and k.endswith("_sum"):
            n = metrics[k.rsplit("/", 1)[0] + "/num_tokens"]
            out[k[:-len("_sum")]] = v / n if n > 0 else float("nan")
    return out


def token_loss(
    cfg: LossConfig,
    student_params: Mapping[str, Any],
    model_cfg: ModelConfig,
    hidden_BxTxD: Float[Array, "B T D"],
    batch: LossBatch,
    *,
    dtype=jnp.float32,
    teacher_head: Mapping[str, jax.Array] | None = None,
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
    target log-probs (sampled_opd, and the teacher_kl_k1 metric); the teacher's hidden states (rkl / fkl / jsd,
    with `teacher_head`: its `{"lm_head"}` or `{"embed"}` leaf, which projects them chunk by chunk);
    advantages (reinforce / grpo); reference log-probs (reinforce / grpo with kl_coef > 0); sampler log-probs
    of the targets (required by grpo and if is_mode != none, otherwise optional: mismatch and IS metrics); the
    sampler's full log-softmax (optional: the exact mismatch_kl); the trainer's log-softmax with the rollout's
    own (older) params (optional, with the sampler's: mismatch_kl_engine / _staleness / _cross, which add up to
    mismatch_kl: `is_correction.staleness_split_BxT`); token_normalizer (optional denominator).

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
    rows = batch.compact.shape if batch.compact is not None else tuple(batch.targets_BxT.shape)
    if rows != (B, T):
        raise ValueError(f"token_loss: the batch's positions {rows} != hidden (B, T)={(B, T)}")
    check_batch(cfg, batch, model_cfg.vocab_size, teacher_head)
    if teacher_head is not None:  # laid out once, outside the chunk loop: V split over the mesh
        teacher_head = vocab_sharded_head(teacher_head)
    chunk = loss_chunk(cfg)
    if batch.compact is not None:
        chunk = compact_chunk(chunk, batch.targets_BxT.shape[0], B, T)
    terms = chunked_logits_map(functools.partial(_chunk_terms, cfg, teacher_head), student_params, hidden_BxTxD,
                               _chunk_inputs(cfg, batch), chunk, dtype=dtype, remat=True,
                               support_ids_key=OBJECTIVES[cfg.kind].support_ids,
                               vocab_split=True)  # on a mesh, no chip gathers the student's whole head
    batch, terms = _padded(cfg, batch, terms)
    return _reduce(cfg, terms, batch)


def token_loss_from_logits(cfg: LossConfig, logits_BxTxV: Float[Array, "B T V"], batch: LossBatch,
                           teacher_head: Mapping[str, jax.Array] | None = None) -> tuple[Float[Array, ""], Metrics]:
    """Same loss from already materialized student logits (unchunked reference; tests, small vocab)."""
    check_batch(cfg, batch, logits_BxTxV.shape[-1], teacher_head)
    obj = OBJECTIVES[cfg.kind]
    inp = _chunk_inputs(cfg, batch)
    if obj.support_ids is not None:
        inp["support_logits"] = jnp.take_along_axis(logits_BxTxV, inp[obj.support_ids].astype(jnp.int32), axis=-1)
    batch, terms = _padded(cfg, batch, _chunk_terms(cfg, teacher_head, logits_BxTxV, inp))
    return _reduce(cfg, terms, batch)
