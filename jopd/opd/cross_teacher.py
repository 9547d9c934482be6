"""A teacher with another tokenizer (`loss.cross_tokenizer`): its scoring of the student's rollouts.

On the host, each rollout's response text is re-tokenized by the teacher inside its own chat template and the two
tokenizations are cut into aligned spans (`jopd.crosstok`); on the device, the teacher runs on its own token
sequence and its scores are brought to the student's response layout:

- **sampled** (exact): per aligned span, the teacher's log-prob of the span (the sum of its tokens' log-probs by
  the chain rule) beside the student's span ids, for the span-level policy gradient of `xtok_sampled`;
- **dense**: at the start of each aligned span (where both sides sit at a token boundary after the same text),
  the teacher's next-token distribution projected onto the student's top-K support (`crosstok.project`), for the
  truncated reverse KL with a tail of `xtok_dense` at those positions, marginalized over the teacher tokens that
  extend its last token's text (its boundary there can depend on what follows). For a character-level student it
  is the teacher's next-character distribution given the text; a lower bound of the teacher's next-text
  probability elsewhere (`crosstok.project`, docs/cross_tokenizer.md "When it is exact").

Among several teachers (`opd.routing`), each teacher with another tokenizer aligns and scores only its own rows
(`align_routed`), and a teacher of the student's vocabulary writes the same fields with every token its own span
(`same_vocab_fields`).

A rollout the pair cannot align (a special token mid-response, a character the teacher cannot encode, more tokens
than the layout holds) gets no spans: it adds nothing to the loss, and it is counted (`xtok_misaligned_frac`,
with the reasons logged), never dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jopd import crosstok
from jopd.crosstok.spans import span_sums
from jopd.losses.chunked import chunked_logits_map, head_params
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import SequenceLayout


# teacher response slots beyond the student's max_new_tokens: its end-of-turn ids, and room for a response the
# teacher writes in a few more tokens than the student (longer ones are misaligned, never truncated)
TEACHER_SLACK = 4


@flax.struct.dataclass
class CrossBatch:
    """A batch's teacher-side sequences and span arrays (device pytree, rows like the rollout's)."""

    prompt_BxPt: Int[Array, "B Pt"]  # the teacher's rendered prompt, left-padded
    prompt_mask_BxPt: Bool[Array, "B Pt"]
    tokens_BxNt: Int[Array, "B Nt"]  # the teacher's response ids (text, then end of turn), right-padded
    mask_BxNt: Bool[Array, "B Nt"]
    student_span_BxN: Int[Array, "B N"]  # span id of each student response token (N: none)
    teacher_span_BxNt: Int[Array, "B Nt"]  # span id of each teacher response token (N: none)
    span_mask_BxN: Bool[Array, "B N"]  # span k of the row exists (K = N slots: a span holds >= 1 student token)
    end_span_BxN: Bool[Array, "B N"]  # span k is the end span (the student's EOS <-> the teacher's end of turn)
    student_start_BxN: Int[Array, "B N"]  # the student position of span k's first token
    teacher_start_BxN: Int[Array, "B N"]  # the teacher position of span k's first token
    aligned_B: Bool[Array, "B"]


def cross_batch_shapes(B: int, prompt_width: int, N: int) -> CrossBatch:
    """The shapes and dtypes of the `CrossBatch` that `CrossTeacher.align` fills for B rows of N response tokens
    (teacher rows N + TEACHER_SLACK wide), as ShapeDtypeStructs: what `jopd aot` lowers the scoring from."""
    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
    b8 = lambda *shape: sds(shape, jnp.bool_)  # noqa: E731
    Nt = N + TEACHER_SLACK
    return CrossBatch(prompt_BxPt=i32(B, prompt_width), prompt_mask_BxPt=b8(B, prompt_width), tokens_BxNt=i32(B, Nt),
                      mask_BxNt=b8(B, Nt), student_span_BxN=i32(B, N), teacher_span_BxNt=i32(B, Nt),
                      span_mask_BxN=b8(B, N), end_span_BxN=b8(B, N), student_start_BxN=i32(B, N), teacher_start_BxN=i32(B, N),
                      aligned_B=b8(B))


@dataclasses.dataclass(frozen=True, eq=False)
class CrossTeacher:
    """The checked tokenizer pair and what the projection needs (made once per run). `jopd aot` may hold a
    stand-in without a pair (no tokenizers: it sizes the step, it cannot align)."""

    pair: crosstok.Pair | None
    table: crosstok.ProjectionTable
    system_prompt: str | None
    teacher_pad_id: int

    @classmethod
    def make(cls, student_tok, teacher_tok, student_cfg: ModelConfig, teacher_cfg: ModelConfig,
             system_prompt: str | None = None) -> "CrossTeacher":
        """Check the pair before any compute (`crosstok.check_pair`: one line naming the problem)."""
        pair = crosstok.check_pair(student_tok, teacher_tok)
        table = crosstok.projection_table(pair.student, pair.teacher, pair.teacher_end_ids,
                                          student_vocab_size=student_cfg.vocab_size,
                                          teacher_vocab_size=teacher_cfg.vocab_size)
        pad = teacher_tok.pad_token_id if teacher_tok.pad_token_id is not None else teacher_tok.eos_token_id
        return cls(pair, table, system_prompt, int(pad))

    def messages(self, user_turn: str) -> list[dict[str, str]]:
        """The conversation before the assistant's turn, as the student's prompt has it (`data.system_prompt`, the
        task's `user_turn(problem)`), for the teacher's own chat template."""
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": user_turn}]

    def align(self, user_turns, tokens_BxN: np.ndarray, lengths_B: np.ndarray, prompt_width: int,
              teacher_width: int, own_B: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], list[str | None]]:
        """This process's rows aligned (host, numpy): the `CrossBatch` arrays and each row's failure reason.
        `user_turns`: each row's user message (the batch's `user_turn`). `own_B` (several teachers): only those
        rows are aligned; the others are left empty (no spans) with no reason, as another teacher scores them."""
        B, N = tokens_BxN.shape
        own = np.ones(B, bool) if own_B is None else np.asarray(own_B, bool)
        rows = [crosstok.align_response(self.pair, self.messages(str(q)), tokens_BxN[b, :lengths_B[b]].tolist())
                if own[b] else crosstok.Misaligned("") for b, q in enumerate(user_turns)]
        rows = [r if isinstance(r, crosstok.Misaligned) or len(r.teacher_prompt_ids_Pt) <= prompt_width
                else crosstok.Misaligned(f"teacher prompt of {len(r.teacher_prompt_ids_Pt)} tokens > {prompt_width}")
                for r in rows]
        idx = crosstok.span_index(rows, N, teacher_width, N, pad_id=self.teacher_pad_id)
        prompt = np.full((B, prompt_width), self.teacher_pad_id, np.int32)
        pmask = np.zeros((B, prompt_width), bool)
        pmask[:, -1] = True  # a failed row still has one (pad) prompt token: no empty attention rows
        for b, r in enumerate(rows):
            if idx.reasons[b] is None:
                p = r.teacher_prompt_ids_Pt
                prompt[b, prompt_width - len(p):], pmask[b] = p, np.arange(prompt_width) >= prompt_width - len(p)
        arrays = {"prompt_BxPt": prompt, "prompt_mask_BxPt": pmask, "tokens_BxNt": idx.teacher_ids_BxNt,
                  "mask_BxNt": idx.teacher_mask_BxNt, "student_span_BxN": idx.student_span_BxNs,
                  "teacher_span_BxNt": idx.teacher_span_BxNt, "span_mask_BxN": idx.span_mask_BxK,
                  "end_span_BxN": idx.end_span_BxK,
                  "student_start_BxN": idx.student_start_BxK, "teacher_start_BxN": idx.teacher_start_BxK,
                  "aligned_B": np.asarray([r is None for r in idx.reasons])}
        return arrays, [r if o else None for r, o in zip(idx.reasons, own)]


def align_routed(crosses, teacher_B: np.ndarray, user_turns, tokens_BxN: np.ndarray, lengths_B: np.ndarray,
                 prompt_width: int, teacher_width: int) -> tuple[dict[str, np.ndarray], list[str | None]]:
    """`CrossTeacher.align` for rows of several teachers: each teacher with another tokenizer (`crosses[i]`) aligns
    its own rows (`teacher_B == i`) with its own pair; the rows of a teacher of the student's vocabulary (None) stay
    empty (it scores the student's tokens: `same_vocab_fields`) and never fail. One teacher's rows of the arrays
    are only read by that teacher (`scoring.routed_teacher_fields` slices them)."""
    arrays, reasons = None, [None] * len(teacher_B)
    for i, cross in enumerate(crosses):
        own = np.asarray(teacher_B) == i
        if cross is None or not (own.any() or arrays is None):
            continue
        mine, why = cross.align(user_turns, tokens_BxN, lengths_B, prompt_width, teacher_width, own)
        arrays = mine if arrays is None else {k: np.where(own.reshape((-1,) + (1,) * (v.ndim - 1)), mine[k], v)
                                              for k, v in arrays.items()}
        reasons = [w if o else r for w, r, o in zip(why, reasons, own)]
    return arrays, reasons


def misaligned_summary(reasons: list[str | None]) -> str:
    """The most common failure reasons of a batch, for the log."""
    counts = Counter(r.split(" at ")[0] for r in reasons if r is not None)
    return "; ".join(f"{n} x {r}" for r, n in counts.most_common(3))


def _teacher_hidden(teacher_params, teacher_cfg: ModelConfig, cross: CrossBatch, dtype) -> jax.Array:
    """The teacher's final hidden states at every position of its prompt + response rows [B, Pt + Nt, D]."""
    tokens = jnp.concatenate([cross.prompt_BxPt, cross.tokens_BxNt], axis=1)
    mask = jnp.concatenate([cross.prompt_mask_BxPt, cross.mask_BxNt], axis=1)
    hidden, _ = transformer.forward(teacher_params, tokens, cfg=teacher_cfg, attn_mask_BxT=mask, return_hidden=True,
                                    dtype=dtype)
    return jax.lax.stop_gradient(hidden)


def _ids_logprobs(temperature: float):
    """A chunk function: the log-probs at `temperature` of the ids `inp["ids"]` [B, C, J] (log-softmax at them)."""
    def fn(logits, inp):
        z = logits / temperature
        return {"lp": jnp.take_along_axis(z, inp["ids"], axis=-1) - jax.nn.logsumexp(z, axis=-1, keepdims=True)}
    return fn


def _first_occurrence(ids_BxNxK: jax.Array) -> jax.Array:
    """True at each id's first occurrence in its [K] row (a repeated id counts once on the support)."""
    K = ids_BxNxK.shape[-1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)
    return ~jnp.any((ids_BxNxK[..., :, None] == ids_BxNxK[..., None, :]) & earlier, axis=-1)


def same_vocab_fields(
    teacher_params,
    layout: SequenceLayout,
    student_topk_BxNxK: Int[Array, "B N K"] | None,
    done_B: Bool[Array, "B"],
    *,
    teacher_cfg: ModelConfig,
    mode: str,
    temperature: float,
    chunk: int,
    dtype=jnp.float32,
) -> dict[str, jax.Array]:
    """`cross_teacher_fields`' fields from a teacher of the student's own vocabulary, one of several teachers of a
    cross-tokenizer run (`opd.routing`): it scores the student's tokens as sampled, so every response token is its
    own aligned span (both sides sit at a token boundary after each token) and its distribution needs no
    projection. sampled: span k is token k, with the teacher's log p_t(y_k) (so `xtok_sampled` is `sampled_opd`
    with gamma = 0 on these rows); dense: every position is a span start, with the student's top-K ids and the
    teacher's exact log-probs of them (`xtok_dense` is `topk_rkl_tail` on the student's top-K support). `dtype`:
    the teacher's compute dtype."""
    N = layout.targets_BxN.shape[1]
    hidden = transformer.response_hidden(teacher_params, teacher_cfg, layout.tokens_BxS, layout.attn_mask_BxS, N,
                                         dtype=dtype)
    head = jax.lax.stop_gradient(head_params(teacher_params))
    valid_BxN, pos_1xN = layout.response_mask_BxN, jnp.arange(N)[None]
    last_B1 = jnp.sum(valid_BxN, axis=1, keepdims=True) - 1
    out = {"span_id_BxT": jnp.where(valid_BxN, pos_1xN, N).astype(jnp.int32), "span_mask_BxT": valid_BxN,
           # the end span: the student's EOS, which is the teacher's too (one vocabulary)
           "end_span_BxT": valid_BxN & (pos_1xN == last_B1) & done_B[:, None]}
    if mode == "sampled":
        lp = chunked_logits_map(_ids_logprobs(temperature), head, hidden, {"ids": layout.targets_BxN[..., None]},
                                chunk, remat=False, dtype=dtype)["lp"][..., 0]
        out["span_teacher_logprobs_BxT"] = jnp.where(valid_BxN, lp, 0.0)
        return out
    support = student_topk_BxNxK.astype(jnp.int32)
    lp = chunked_logits_map(_ids_logprobs(temperature), head, hidden, {"ids": support}, chunk, remat=False,
                            dtype=dtype)["lp"]
    keep = _first_occurrence(support) & valid_BxN[..., None]
    out["teacher_topk_ids_BxTxK"] = jnp.where(valid_BxN[..., None], support, 0)
    out["teacher_topk_logprobs_BxTxK"] = jnp.where(keep, lp, 0.0)
    out["support_mask_BxTxK"] = keep
    out["dense_mask_BxT"] = valid_BxN
    return out


def cross_teacher_fields(teacher_params, cross: CrossBatch, student_topk_BxNxK, *, teacher_cfg: ModelConfig,
                         table: crosstok.ProjectionTable, mode: str, temperature: float, chunk: int,
                         dtype=jnp.float32) -> dict[str, jax.Array]:
    """`LossBatch` fields in the student's response layout [B, N]: the span arrays and the teacher's per-span
    log-probs (sampled), or the projected teacher log-probs at the span starts (dense). `dtype`: the teacher's
    compute dtype (fp32 logits and log-softmax either way)."""
    Pt = cross.prompt_BxPt.shape[1]
    hidden = _teacher_hidden(teacher_params, teacher_cfg, cross, dtype)
    head = jax.lax.stop_gradient(head_params(teacher_params))
    out = {"span_id_BxT": cross.student_span_BxN, "span_mask_BxT": cross.span_mask_BxN,
           "end_span_BxT": cross.end_span_BxN}
    if mode == "sampled":
        # teacher position Pt + j - 1 predicts its response token j
        h_BxNtxD = hidden[:, Pt - 1:Pt - 1 + cross.tokens_BxNt.shape[1]]
        lp = chunked_logits_map(_ids_logprobs(temperature), head, h_BxNtxD, {"ids": cross.tokens_BxNt[..., None]},
                                chunk, remat=False, dtype=dtype)["lp"][..., 0]
        lp = jnp.where(cross.mask_BxNt, lp, 0.0)
        sums = span_sums(lp, cross.teacher_span_BxNt, cross.span_mask_BxN.shape[1])
        out["span_teacher_logprobs_BxT"] = jnp.where(cross.span_mask_BxN, sums, 0.0)
        return out
    # dense: the teacher's distribution at each span start, projected onto the student's top-K there and backed
    # off to the start of the teacher's last token before it (`crosstok.project`: where the teacher's boundary
    # falls can depend on the text after it)
    rows = jnp.arange(hidden.shape[0])[:, None]
    start = cross.teacher_start_BxN
    back = cross.span_mask_BxN & (start > 0)  # the first span follows the prompt: nothing to back off to
    last = jnp.take_along_axis(cross.tokens_BxNt, jnp.maximum(start - 1, 0), axis=1)
    support = jnp.take_along_axis(student_topk_BxNxK, cross.student_start_BxN[..., None], axis=1).astype(jnp.int32)
    first = _first_occurrence(support)
    inputs = {"ids": support, "first": first, "last": last}

    def projected(logits, inp):
        lp = jax.nn.log_softmax(logits / temperature, axis=-1)
        return crosstok.project_teacher(lp, inp["ids"], inp["first"], table)._asdict()

    def extensions(logits, inp):
        lp = jax.nn.log_softmax(logits / temperature, axis=-1)
        return crosstok.project_extensions(lp, inp["last"], inp["ids"], inp["first"], table)._asdict()

    # two passes over the span starts, one [chunk, V_teacher] block of logits at a time each
    now = chunked_logits_map(projected, head, hidden[rows, Pt - 1 + start], inputs, chunk, remat=False, dtype=dtype)
    before = hidden[rows, jnp.maximum(Pt - 2 + start, 0)]  # predicts the last token (used where `back`)
    ext = chunked_logits_map(extensions, head, before, inputs, chunk, remat=False, dtype=dtype)
    pi = crosstok.back_off(crosstok.Projected(**now), crosstok.Extensions(**ext), back).logprobs_PxK
    keep = first & jnp.isfinite(pi) & cross.span_mask_BxN[..., None]  # an id the teacher cannot express: tail
    # at the student position of each span start (scatter [B, K] -> [B, N]; K = N slots)
    starts = jnp.where(cross.span_mask_BxN, cross.student_start_BxN, support.shape[1])
    N = student_topk_BxNxK.shape[1]
    put = lambda x, fill: jnp.full((x.shape[0], N + 1, *x.shape[2:]), fill, x.dtype).at[rows, starts].set(x)[:, :N]  # noqa: E731
    out["teacher_topk_ids_BxTxK"] = put(support, 0)
    out["teacher_topk_logprobs_BxTxK"] = put(jnp.where(keep, pi, 0.0), 0.0)
    out["support_mask_BxTxK"] = put(keep, False)
    out["dense_mask_BxT"] = put(cross.span_mask_BxN, False)
    return out
