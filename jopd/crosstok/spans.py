"""The exact sampled-path signal of cross-tokenizer OPD: per aligned span, log p_student(span) - log p_teacher(span).

A span (`align.Alignment`) is a run of student tokens and a run of teacher tokens that spell the same bytes (or,
for the end span, both sides' end-of-turn tokens), both starting at a common boundary. By the chain rule,
log p(span | everything before it) on each side is the sum of that side's per-token log-probs (teacher-forced, of
the tokens actually in the sequence) over the span's tokens; the signal is

    signal_k = sum_{i in student tokens of span k} log p_s(y_i | y_<i)
             - sum_{j in teacher tokens of span k} log p_t(z_j | z_<j).

Both sums are of the two models' own tokenizations of the same text, so the signal is exact for the sampled path
(the teacher's tokenization being its canonical one, not a marginal over all its tokenizations).

Layout: row b's student response tokens are positions 0..Ns-1 of `logp_student_BxNs` (the response layout of the
rest of jopd), its teacher response tokens (`Alignment.teacher_ids_Nt`) positions 0..Nt-1 of `logp_teacher_BxNt`.
`span_index` turns alignments into padded arrays (host, numpy); `span_logprobs` is the device computation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jopd.crosstok.align import Alignment, Misaligned


@dataclasses.dataclass(frozen=True, eq=False)
class SpanIndex:
    """Padded span arrays of a batch (numpy). A token in no span (padding, a failed row) has span id K; a masked
    span has start 0. `reasons[b]` is None for an aligned row, else why it has no spans (never dropped silently)."""

    student_span_BxNs: Int[np.ndarray, "B Ns"]  # span id of each student response token
    teacher_span_BxNt: Int[np.ndarray, "B Nt"]  # span id of each teacher response token
    span_mask_BxK: Bool[np.ndarray, "B K"]
    # the response position of the span's first token: the next-token distribution that predicts it (row b's
    # logits for response token i) is where `project.project_teacher` compares the two sides
    student_start_BxK: Int[np.ndarray, "B K"]
    teacher_start_BxK: Int[np.ndarray, "B K"]
    end_span_BxK: Bool[np.ndarray, "B K"]  # the end-of-turn span
    teacher_ids_BxNt: Int[np.ndarray, "B Nt"]  # the teacher's response ids, right-padded with pad_id
    teacher_mask_BxNt: Bool[np.ndarray, "B Nt"]
    reasons: tuple[str | None, ...]


def span_index(rows: Sequence[Alignment | Misaligned], n_student: int, n_teacher: int, max_spans: int,
               pad_id: int = 0) -> SpanIndex:
    """Pack a batch's alignments into [B, Ns] / [B, Nt] / [B, K] arrays. A row whose student or teacher response
    or span count exceeds n_student / n_teacher / max_spans gets no spans and a reason, like a `Misaligned` row."""
    B, K = len(rows), max_spans
    s_span = np.full((B, n_student), K, np.int32)
    t_span = np.full((B, n_teacher), K, np.int32)
    mask, end = np.zeros((B, K), bool), np.zeros((B, K), bool)
    s_start, t_start = np.zeros((B, K), np.int32), np.zeros((B, K), np.int32)
    t_ids, t_mask = np.full((B, n_teacher), pad_id, np.int32), np.zeros((B, n_teacher), bool)
    reasons: list[str | None] = []
    for b, row in enumerate(rows):
        if isinstance(row, Misaligned):
            reasons.append(row.reason)
            continue
        ns, nt, k = len(row.student_ids_Ns), len(row.teacher_ids_Nt), row.n_spans
        if ns > n_student or nt > n_teacher or k > K:
            reasons.append(f"alignment does not fit: {ns} student tokens (max {n_student}), {nt} teacher tokens "
                           f"(max {n_teacher}), {k} spans (max {K})")
            continue
        reasons.append(None)
        for j, ((s0, s1), (t0, t1)) in enumerate(zip(row.spans_student_Kx2, row.spans_teacher_Kx2)):
            s_span[b, s0:s1], t_span[b, t0:t1] = j, j
            s_start[b, j], t_start[b, j] = s0, t0
        mask[b, :k] = True
        end[b, k - 1] = row.ends_turn
        t_ids[b, :nt], t_mask[b, :nt] = row.teacher_ids_Nt, True
    return SpanIndex(s_span, t_span, mask, s_start, t_start, end, t_ids, t_mask, tuple(reasons))


class SpanLogProbs(NamedTuple):
    """Per-span sums, 0 on masked spans."""

    student_BxK: Float[Array, "B K"]  # log p_student(span | before)
    teacher_BxK: Float[Array, "B K"]  # log p_teacher(span | before)
    signal_BxK: Float[Array, "B K"]  # student - teacher


def span_sums(logp_BxN: jax.Array, span_BxN: jax.Array, K: int) -> jax.Array:
    """sum of logp over the positions of each span id 0..K-1 (id K collects the rest and is dropped)."""
    rows = jnp.arange(logp_BxN.shape[0])[:, None]
    out = jnp.zeros((logp_BxN.shape[0], K + 1), logp_BxN.dtype).at[rows, span_BxN].add(logp_BxN)
    return out[:, :K]


def span_logprobs(
    logp_student_BxNs: Float[Array, "B Ns"],
    logp_teacher_BxNt: Float[Array, "B Nt"],
    student_span_BxNs: Int[Array, "B Ns"],
    teacher_span_BxNt: Int[Array, "B Nt"],
    span_mask_BxK: Bool[Array, "B K"],
) -> SpanLogProbs:
    """The per-span log-prob sums of both sides and the signal (module docstring). Span ids outside [0, K) (the
    padding id K) contribute nowhere; differentiable in both log-prob inputs."""
    K = span_mask_BxK.shape[1]
    s = jnp.where(span_mask_BxK, span_sums(logp_student_BxNs, student_span_BxNs, K), 0.0)
    t = jnp.where(span_mask_BxK, span_sums(logp_teacher_BxNt, teacher_span_BxNt, K), 0.0)
    return SpanLogProbs(student_BxK=s, teacher_BxK=t, signal_BxK=s - t)


def at_tokens(values_BxK: Float[Array, "B K"], span_BxN: Int[Array, "B N"]) -> Float[Array, "B N"]:
    """Each token's span value (e.g. the signal broadcast to the student tokens of its span); 0 for id K."""
    padded = jnp.concatenate([values_BxK, jnp.zeros_like(values_BxK[:, :1])], axis=1)
    return jnp.take_along_axis(padded, span_BxN, axis=1)
