"""Dense projection of the teacher's next-token distribution onto the student's support, at a common boundary.

At the start of an aligned span both tokenizations sit at a token boundary after the same text (and the same
conversation), so the teacher's next-token distribution p_t(. | context) there speaks about the same next text as
the student's p_s. For a student token s with bytes sigma(s) (`vocab.Vocab`; strings are bytes throughout, so a
byte-level token that is part of a UTF-8 character is handled like any other) define

    q(s)   = sum_{t : sigma(t) starts with sigma(s)} p_t(t)                          (prefix mass, `prefix_logprobs`)

the teacher's probability that the next text begins with sigma(s), as far as ONE teacher token determines it.
The student's EOS maps to the teacher's end-of-turn token: q(EOS) = p_t(end of turn) (which must be one token);
every other special student token gets q = 0, as does a text token that no teacher token extends.

For a support S (K student ids, e.g. the student's top-K), q need not be a distribution: when sigma(s) is a
proper prefix of sigma(s') for s, s' in S, q(s) counts q(s')'s tokens too. The **projection** used by the
truncated reverse KL with a tail therefore assigns each teacher token t to the support token whose string is the
LONGEST prefix of sigma(t) (`logprobs`):

    pi(s)    = sum_{t : the longest sigma(s'), s' in S, that prefixes sigma(t) is sigma(s)} p_t(t)
    pi(tail) = the teacher mass no support token prefixes (`tail_logprob`)  =  1 - sum_{s in S} pi(s)

a coarse-graining of p_t onto S + {tail}, so `losses.divergences.topk_tail_reverse_kl` applies to (student logits,
S, log pi). pi = q when the support's strings are prefix-free (no support string is a proper prefix of another;
always so for a character-level student). Teacher special tokens other than the end of turn are in the tail.

**Exactness.** Let Q(sigma) be the teacher's true probability that the next text begins with sigma: the
marginal over all token continuations (given the teacher's own tokenization of the text so far, as every
teacher probability in this package is), Q(sigma) = q(sigma) + sum_{t: sigma(t) a proper prefix of sigma} p_t(t) *
Q_{context + t}(rest of sigma). Hence

- pi(s) <= q(s) <= Q(sigma(s)) always: the projection is a lower bound of the teacher's next-text probability;
- q(s) = Q(sigma(s)) exactly iff every teacher token that is a proper prefix of sigma(s) either has p_t = 0 or
  cannot be continued into sigma(s) — in particular whenever no teacher token is a proper (non-empty) prefix of
  sigma(s), e.g. when sigma(s) is a single byte;
- a character-level student over single-byte characters (the toy tokenizer: printable ASCII and newline) at a
  teacher token boundary: pi(c) = q(c) = P_teacher(next character = c) = sum of p_t over the teacher tokens that
  start with c, and pi(EOS) = P_teacher(the turn ends now): the projection IS the teacher's next-character
  distribution (tail = every other next character or special token). For a multi-byte character c, teacher
  tokens holding only part of c make q(c) a lower bound.

The teacher's tokenization of the text so far is the one of the whole response, so where a boundary falls can
depend on what follows it (SmolLM2: `. ####` ends in ` ####`, `. 16` in ` `, `1`). After a boundary that a
continuation would have merged away, the teacher gives that continuation almost no mass, and the projection
inherits the bias: "exact" above holds at boundaries no continuation can move (docs/cross_tokenizer.md).

**Host precomputation** (`projection_table`, once per vocabulary pair): the teacher's text tokens sorted by their
byte strings, so that the tokens starting with sigma(s) are one contiguous interval [lo(s), hi(s)) of that order;
the table is the order and each student id's interval (two ints per student id). The intervals of a support
are laminar (nested or disjoint), so their endpoints cut the sorted teacher axis into at most 2K + 1 elementary
segments, each inside the same support intervals throughout; a segment's mass goes to the innermost support
interval that contains it, or to the tail.

**Device computation** (`project_teacher`): per position, every elementary segment's mass is summed directly
from the teacher's probabilities (blocks of `table.block` sorted ids: the whole blocks inside the segment from
block sums, the two edge blocks element by element): no differences of cumulative sums, so small masses keep
their relative precision. Cost per position O(V + (2K + 1) (V / block + 2 block)).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jopd.crosstok.vocab import Vocab


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProjectionTable:
    """What the projection needs from the two vocabularies (a pytree: pass it to jitted functions as is)."""

    teacher_order_V: Int[Array, "Vt"]  # teacher ids: text tokens by byte string, the end-of-turn token, the rest
    student_lo_V: Int[Array, "Vs"]  # student id s: its teacher tokens are order[lo(s):hi(s)]
    student_hi_V: Int[Array, "Vs"]
    block: int = dataclasses.field(metadata=dict(static=True))
    n_teacher_text: int = dataclasses.field(metadata=dict(static=True))


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with `prefix` (None: there is none)."""
    stripped = prefix.rstrip(b"\xff")
    return None if not stripped else stripped[:-1] + bytes([stripped[-1] + 1])


def projection_table(student: Vocab, teacher: Vocab, teacher_end_ids: Sequence[int], *,
                     student_vocab_size: int | None = None, teacher_vocab_size: int | None = None,
                     block: int | None = None) -> ProjectionTable:
    """The host table (module docstring). `*_vocab_size`: the models' vocabulary sizes when they pad their
    tokenizer's (extra ids: no text; a student one gets q = 0, a teacher one is in the tail). Two student ids
    with the same string: the lower id gets the interval, the other q = 0."""
    if len(teacher_end_ids) != 1 or teacher.is_text(teacher_end_ids[0]):
        raise ValueError(f"projection: the teacher's end of turn must be one special token, got ids "
                         f"{list(teacher_end_ids)}")
    vs, vt = student_vocab_size or len(student), teacher_vocab_size or len(teacher)
    if vs < len(student) or vt < len(teacher):
        raise ValueError(f"projection: vocabulary sizes {vs}/{vt} are smaller than the tokenizers' "
                         f"{len(student)}/{len(teacher)}")
    end = int(teacher_end_ids[0])
    text = sorted((i for i in range(len(teacher)) if teacher.is_text(i)), key=lambda i: teacher.token_bytes[i])
    keys = [teacher.token_bytes[i] for i in text]
    rest = [i for i in range(vt) if i != end and not teacher.is_text(i)]
    lo, hi = np.zeros(vs, np.int32), np.zeros(vs, np.int32)
    seen: set[bytes] = set()
    for s in range(len(student)):
        sigma = student.token_bytes[s]
        if s == student.eos_id:
            lo[s], hi[s] = len(text), len(text) + 1
        elif sigma is not None and sigma not in seen:
            seen.add(sigma)
            succ = _successor(sigma)
            lo[s] = bisect.bisect_left(keys, sigma)
            hi[s] = len(keys) if succ is None else bisect.bisect_left(keys, succ)
    order = np.array([*text, end, *rest], np.int32)
    return ProjectionTable(teacher_order_V=jnp.asarray(order), student_lo_V=jnp.asarray(lo),
                           student_hi_V=jnp.asarray(hi), block=block or max(8, int(math.sqrt(vt / 2))),
                           n_teacher_text=len(text))


class Projected(NamedTuple):
    """log-probabilities on the support (-inf: zero mass, or a masked slot) and of the tail."""

    logprobs_PxK: Float[Array, "*P K"]  # log pi(s): the coarse-graining (sums with the tail to 1)
    prefix_logprobs_PxK: Float[Array, "*P K"]  # log q(s): the teacher's mass of tokens starting with sigma(s)
    tail_logprob_P: Float[Array, "*P"]  # log pi(tail)


def _segment_masses(pb_PxBxb: jax.Array, a_PxJ: jax.Array, e_PxJ: jax.Array, b: int) -> jax.Array:
    """sum of the sorted probabilities over each [a, e) (exact sums, no cumulative differences)."""
    nb = pb_PxBxb.shape[1]
    blk = jnp.arange(nb)
    full = (blk * b >= a_PxJ[..., None]) & ((blk + 1) * b <= e_PxJ[..., None])  # [P, J, nb]
    mass = jnp.sum(jnp.where(full, pb_PxBxb.sum(-1)[:, None, :], 0.0), axis=-1)

    def edge(ib_PxJ, keep_PxJ):
        vals = jnp.take_along_axis(pb_PxBxb, ib_PxJ[..., None], axis=1)  # [P, J, b]
        r = ib_PxJ[..., None] * b + jnp.arange(b)
        blk_full = (ib_PxJ * b >= a_PxJ) & ((ib_PxJ + 1) * b <= e_PxJ)
        inc = (r >= a_PxJ[..., None]) & (r < e_PxJ[..., None]) & (keep_PxJ & ~blk_full)[..., None]
        return jnp.sum(jnp.where(inc, vals, 0.0), axis=-1)

    ia = jnp.minimum(a_PxJ // b, nb - 1)
    ie = jnp.minimum(jnp.maximum(e_PxJ - 1, a_PxJ) // b, nb - 1)
    return mass + edge(ia, jnp.ones_like(ia, bool)) + edge(ie, ie != ia)


def project_teacher(
    teacher_logprobs_PxV: Float[Array, "*P Vt"],
    support_ids_PxK: Int[Array, "*P K"],
    support_mask_PxK: Bool[Array, "*P K"],
    table: ProjectionTable,
) -> Projected:
    """The teacher's next-token log-probs (any leading axes, full vocabulary of the teacher model) projected onto
    each position's student support (module docstring). Mask repeated support ids (a repeat of a kept id would
    get pi = 0 but the full q)."""
    lead, V = teacher_logprobs_PxV.shape[:-1], teacher_logprobs_PxV.shape[-1]
    if V != table.teacher_order_V.shape[0]:
        raise ValueError(f"project_teacher: teacher log-probs have {V} ids, the table {table.teacher_order_V.shape[0]}")
    K = support_ids_PxK.shape[-1]
    lp = teacher_logprobs_PxV.reshape(-1, V).astype(jnp.float32)
    ids, mask = support_ids_PxK.reshape(-1, K), support_mask_PxK.reshape(-1, K)
    P, b = lp.shape[0], table.block
    nb = -(-V // b)
    p = jnp.exp(lp)[:, table.teacher_order_V]
    pb = jnp.pad(p, ((0, 0), (0, nb * b - V))).reshape(P, nb, b)
    lo = jnp.take(table.student_lo_V, ids, mode="fill", fill_value=0)
    hi = jnp.take(table.student_hi_V, ids, mode="fill", fill_value=0)
    valid = mask & (lo < hi)
    lo, hi = jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)
    pts = jnp.sort(jnp.concatenate([lo, hi], axis=-1), axis=-1)
    a = jnp.concatenate([jnp.zeros((P, 1), pts.dtype), pts], axis=-1)  # J = 2K + 1 elementary segments [a, e)
    e = jnp.concatenate([pts, jnp.full((P, 1), V, pts.dtype)], axis=-1)
    m = _segment_masses(pb, a, e, b)  # [P, J]
    contains = valid[:, None, :] & (lo[:, None, :] <= a[..., None]) & (a[..., None] < hi[:, None, :])  # [P, J, K]
    inner = jnp.argmin(jnp.where(contains, (hi - lo)[:, None, :], V + 1), axis=-1)  # innermost
    assigned = jnp.where(contains.any(-1), inner, K)
    part = jnp.zeros((P, K + 1), m.dtype).at[jnp.arange(P)[:, None], assigned].add(m)
    prefix = jnp.sum(jnp.where(contains, m[..., None], 0.0), axis=1)
    logs = lambda x: jnp.where(mask, jnp.log(x), -jnp.inf).reshape(*lead, K)  # noqa: E731
    return Projected(logprobs_PxK=logs(part[:, :K]), prefix_logprobs_PxK=logs(prefix),
                     tail_logprob_P=jnp.log(part[:, K]).reshape(lead))
