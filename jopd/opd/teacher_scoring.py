"""One teacher's scoring of the student's tokens: its forward on prompt + response, reduced to what the loss kind
reads (top-K ids and log-probs of its full softmax, computed chunk by chunk so no [B, N, V] tensor is kept; the
log-prob of every sampled token; the hidden states only for the full-vocabulary comparison losses); the same
reduction of a weighted mixture of teachers (`mixture_scores`), and the frozen reference's log-probs for the RL
kinds' KL term. Which teacher scores which rows, and the train step's input, are `opd.scoring`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jopd.losses import LossConfig
from jopd.losses.chunked import chunked_logits_map, chunked_map, head_params
from jopd.losses.kinds import OBJECTIVES
from jopd.losses.compute import compact_fields
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.losses.layout import compact_chunk, from_compact, to_compact
from jopd.opd.batch import SequenceLayout
from jopd.opd.packing import PackPlan, compact_hidden, pack_tokens, packed_hidden


def teacher_scores(
    teacher_hidden_BxTxD: Float[Array, "B T D"],
    teacher_params: Mapping[str, Any],
    *,
    k: int,
    chunk: int,
    targets_BxT: Int[Array, "B T"] | None = None,
    temperature: float = 1.0,
    dtype=jnp.float32,
    extra_ids_BxTxE: Int[Array, "B T E"] | None = None,
) -> dict[str, jax.Array]:
    """Teacher top-K of its FULL softmax (at `temperature`), computed chunk by chunk; no gradient.

    Returns `LossBatch` fields: teacher_topk_ids_BxTxK int32, teacher_topk_logprobs_BxTxK fp32 (log-probs under
    the full-vocabulary softmax, descending), and, when `targets_BxT` is given, teacher_target_logprobs_BxT
    (log pi_t of each target token, for sampled-token OPD). With `extra_ids_BxTxE` (e.g. the student's top-K
    ids, the sampled token) the support is the teacher's top-K followed by those ids, [B, T, K + E], scored at
    the same softmax, and `support_mask_BxTxK` marks each id's first occurrence (a repeated id counts once).
    """
    hidden = jax.lax.stop_gradient(teacher_hidden_BxTxD)
    params = jax.lax.stop_gradient(head_params(teacher_params))
    _check_k(k, params)

    def fn(logits_BxCxV, inp):
        # top-K of the logits, normalized afterwards: no [B, C, V] log-softmax is materialized
        z = logits_BxCxV / temperature
        return support_scores(z, jax.nn.logsumexp(z, axis=-1, keepdims=True), inp, k)

    return chunked_logits_map(fn, params, hidden, _score_inputs(targets_BxT, extra_ids_BxTxE), chunk, dtype=dtype,
                              remat=False)


def _check_k(k: int, head) -> None:
    V = head["lm_head"].shape[-1] if "lm_head" in head else head["embed"].shape[0]
    if not 1 <= k <= V:
        raise ValueError(f"teacher top-K: k={k} must be in [1, vocab={V}]")


def _score_inputs(targets_BxT, extra_ids_BxTxE) -> dict[str, jax.Array]:
    inputs = {} if targets_BxT is None else {"targets": targets_BxT}
    if extra_ids_BxTxE is not None:
        inputs["extra"] = extra_ids_BxTxE
    return inputs


def support_scores(s_BxCxV, lse_BxCx1, inp: Mapping[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """One chunk's `teacher_scores` fields from scores `s` whose log-probs are s - lse (a teacher's logits at the
    temperature and their logsumexp, or a mixture's log-probs and 0): the top-K, the extra ids and the targets."""
    values, ids = jax.lax.top_k(s_BxCxV, k)
    ids = ids.astype(jnp.int32)
    if "extra" in inp:
        extra = inp["extra"].astype(jnp.int32)
        ids = jnp.concatenate([ids, extra], axis=-1)
        values = jnp.concatenate([values, jnp.take_along_axis(s_BxCxV, extra, axis=-1)], axis=-1)
        K = ids.shape[-1]
        earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [i, j]: j comes before i
        repeated = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier, axis=-1)
    out = {"teacher_topk_ids_BxTxK": ids, "teacher_topk_logprobs_BxTxK": values - lse_BxCx1}
    if "extra" in inp:
        out["support_mask_BxTxK"] = ~repeated
    if "targets" in inp:
        t = inp["targets"].astype(jnp.int32)[..., None]
        out["teacher_target_logprobs_BxT"] = (jnp.take_along_axis(s_BxCxV, t, axis=-1) - lse_BxCx1)[..., 0]
    return out


def mixture_scores(
    hiddens: tuple[Float[Array, "B T D"], ...],
    teachers_params: tuple[Mapping[str, Any], ...],
    log_weights: tuple[float, ...],
    *,
    k: int,
    chunk: int,
    targets_BxT: Int[Array, "B T"] | None = None,
    temperature: float = 1.0,
    dtype=jnp.float32,
    extra_ids_BxTxE: Int[Array, "B T E"] | None = None,
) -> dict[str, jax.Array]:
    """`teacher_scores` of a weighted mixture of teachers: log p(v) = logsumexp_i(log w_i + log p_i(v)) (weights
    normalized), each p_i the full softmax of teacher i at `temperature`, computed chunk by chunk (one [B, C, V]
    per teacher at a time); its top-K, extra ids and targets as `teacher_scores` returns them."""
    heads = tuple(jax.lax.stop_gradient(head_params(p)) for p in teachers_params)
    _check_k(k, heads[0])
    inputs = _score_inputs(targets_BxT, extra_ids_BxTxE)
    inputs |= {f"_hidden{i}": jax.lax.stop_gradient(h) for i, h in enumerate(hiddens)}

    def fn(inp):
        inp = dict(inp)
        parts = []
        for i, (head, log_w) in enumerate(zip(heads, log_weights)):
            z = transformer.logits_from_hidden(head, inp.pop(f"_hidden{i}"), dtype=dtype,
                                               logits_dtype=jnp.float32) / temperature
            parts.append(jax.nn.log_softmax(z, axis=-1) + log_w)
        log_p = jax.nn.logsumexp(jnp.stack(parts), axis=0)
        return support_scores(log_p, jnp.zeros(log_p.shape[:-1] + (1,), log_p.dtype), inp, k)

    return chunked_map(fn, inputs, chunk)


def teacher_topk(
    teacher_hidden_BxTxD: Float[Array, "B T D"],
    teacher_params: Mapping[str, Any],
    k: int,
    chunk: int,
    *,
    temperature: float = 1.0,
    dtype=jnp.float32,
) -> tuple[Int[Array, "B T K"], Float[Array, "B T K"]]:
    """(ids_BxTxK int32, logprobs_BxTxK fp32): the teacher's top-K tokens and their full-softmax log-probs."""
    out = teacher_scores(teacher_hidden_BxTxD, teacher_params, k=k, chunk=chunk, temperature=temperature,
                         dtype=dtype)
    return out["teacher_topk_ids_BxTxK"], out["teacher_topk_logprobs_BxTxK"]


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


def scored_hidden(params, cfg: ModelConfig, layout: SequenceLayout, plan: PackPlan | None, *, dtype=jnp.float32):
    """A frozen model's final hidden states that predict the response tokens: [B, N, D] in the padded response
    layout, or [Q, Cq, D] in the compact one when the sequences are packed (`plan`). Stop-gradient."""
    N = layout.targets_BxN.shape[1]
    if plan is None:
        return transformer.response_hidden(params, cfg, layout.tokens_BxS, layout.attn_mask_BxS, N, dtype=dtype)
    hidden = packed_hidden(params, cfg, pack_tokens(layout.tokens_BxS, plan), plan, dtype=dtype)
    return jax.lax.stop_gradient(compact_hidden(hidden, plan))


def _chunk(loss_cfg: LossConfig, layout: SequenceLayout, hidden, plan: PackPlan | None) -> int:
    """The scoring's positions per chunk: `loss.chunk_size`; on compact rows, as many positions per chunk as a
    padded chunk holds."""
    if plan is None:
        return loss_cfg.chunk_size
    return compact_chunk(loss_cfg.chunk_size, layout.targets_BxN.shape[0], *hidden.shape[:2])


def teacher_fields(teacher_params: Any, layout: SequenceLayout, *, teacher_cfg: ModelConfig,
                   loss_cfg: LossConfig, student_topk_ids_BxNxK=None, plan: PackPlan | None = None,
                   dtype=jnp.float32) -> dict[str, jax.Array]:
    """`LossBatch` fields from the teacher (no gradient): teacher_topk_ids_BxTxK / _logprobs_BxTxK (the support:
    the teacher's top-K, plus the ids `loss.support` adds, with `support_mask_BxTxK`) and
    teacher_target_logprobs_BxT always, teacher_hidden_BxTxD when the loss kind needs them. Packed (`plan`):
    the teacher runs on the packed rows and the per-chunk fields come in the compact layout (the target
    log-probs, read after the chunks, in the padded one). `dtype`: the compute dtype of its forward and head (fp32
    log-softmax either way)."""
    hidden = scored_hidden(teacher_params, teacher_cfg, layout, plan, dtype=dtype)
    targets, extra = layout.targets_BxN, support_extra_ids(layout, student_topk_ids_BxNxK, loss_cfg)
    if plan is not None:
        targets = to_compact(targets, plan.compact)
        extra = None if extra is None else to_compact(extra, plan.compact)
    out = teacher_scores(hidden, teacher_params, k=min(loss_cfg.top_k, teacher_cfg.vocab_size),
                         chunk=_chunk(loss_cfg, layout, hidden, plan), targets_BxT=targets,
                         temperature=loss_cfg.temperature, extra_ids_BxTxE=extra, dtype=dtype)
    if OBJECTIVES[loss_cfg.kind].needs_teacher_hidden:  # the loss projects them with the head, chunk by chunk
        out["teacher_hidden_BxTxD"] = hidden
    if plan is not None:  # what the kind does not read per chunk goes back to the padded layout
        chunked = compact_fields(loss_cfg)
        out = {k: v if k in chunked else from_compact(v, plan.compact) for k, v in out.items()}
    return out


def reference_logprobs(reference_params, layout: SequenceLayout, *, model_cfg: ModelConfig, loss_cfg: LossConfig,
                       dtype, plan: PackPlan | None = None) -> jax.Array:
    """log pi_ref(target) [B, N] of the frozen reference at the loss temperature, chunked like the teacher's
    scores and in the trainer's dtype (so the k3 KL to the starting student is 0 before the first update)."""
    hidden = scored_hidden(reference_params, model_cfg, layout, plan, dtype=dtype)
    targets = layout.targets_BxN if plan is None else to_compact(layout.targets_BxN, plan.compact)
    out = teacher_scores(hidden, reference_params, k=1, chunk=_chunk(loss_cfg, layout, hidden, plan),
                         targets_BxT=targets, temperature=loss_cfg.temperature, dtype=dtype)
    lp = out["teacher_target_logprobs_BxT"]
    return lp if plan is None else from_compact(lp, plan.compact)
