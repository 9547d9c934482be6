"""Dense projection of the teacher's next-token distribution onto the student's support, at a common boundary.

At the start of an aligned span both tokenizations sit at a token boundary after the same text (and the same
conversation). For a student token s with bytes sigma(s) (`vocab.Vocab`; strings are bytes throughout, so a
byte-level token that is part of a UTF-8 character is handled like any other) and a teacher next-token
distribution p (`project_teacher`) define

    q(s)   = sum_{t : sigma(t) starts with sigma(s)} p(t)                            (prefix mass, `prefix_logprobs`)

the teacher's probability that the next text begins with sigma(s), as far as ONE teacher token determines it.
The student's EOS maps to the teacher's end-of-turn token: q(EOS) = p(end of turn) (which must be one token);
every other special student token gets q = 0, as does a text token that no teacher token extends.

For a support S (K student ids, e.g. the student's top-K), q need not be a distribution: when sigma(s) is a
proper prefix of sigma(s') for s, s' in S, q(s) counts q(s')'s tokens too. The **projection** used by the
truncated reverse KL with a tail therefore assigns each teacher token t to the support token whose string is the
LONGEST prefix of sigma(t) (`logprobs`):

    pi(s)    = sum_{t : the longest sigma(s'), s' in S, that prefixes sigma(t) is sigma(s)} p(t)
    pi(tail) = the teacher mass no support token prefixes (`tail_logprob`)  =  1 - sum_{s in S} pi(s)

a coarse-graining of p onto S + {tail}, so `losses.divergences.topk_tail_reverse_kl` applies to (student logits,
S, log pi). pi = q when the support's strings are prefix-free (no support string is a proper prefix of another;
always so for a character-level student). Teacher special tokens other than the end of turn are in the tail.

**Backing off to the start of the teacher's last token** (`project_extensions`, `back_off`). The teacher's
tokenization of the text so far is the one of the WHOLE response, and where its last boundary falls can depend on
what follows: SmolLM2 writes `. ####` as `.`, ` ####` but `. 16` as `.`, ` `, `1`. At the boundary after a lone
` ` the teacher's distribution is conditioned on "the token before was exactly ` `", which it (trained on its
canonical tokenizations) reads as "not `####` next": the projection above would say "a digit, not `#`". So the
span start's distribution is taken one teacher token earlier. Let z be the teacher's last response token before
the boundary, tau = sigma(z), p_j the teacher's distribution at the start of z (context c: the prompt and the
teacher tokens before z) and p_{j+1} the one at the boundary (context c, z). With the strict extensions of tau,
X = {t : sigma(t) = tau + r, r non-empty}:

    D      = p_j(z) + sum_{t in X} p_j(t)                               (the token at j covers tau: event E)
    e(s)   = sum_{t in X : the longest support string prefixing r is sigma(s)} p_j(t),   e(tail) = the rest of X
    e_q(s) = sum_{t : sigma(t) starts with tau + sigma(s)} p_j(t)
    pi(s)  = (e(s) + p_j(z) pi_{j+1}(s)) / D,         pi(tail) = (e(tail) + p_j(z) pi_{j+1}(tail)) / D
    q(s)   = (e_q(s) + p_j(z) q_{j+1}(s)) / D

with pi_{j+1}, q_{j+1} the projection above of p_{j+1}. It is again a coarse-graining (sums with its tail to 1).
The student's EOS gets e = 0: pi(EOS) = p_j(z) p_{j+1}(end of turn) / D. When no teacher token extends tau,
D = p_j(z), e = 0 and pi = pi_{j+1}: the back-off changes nothing. At the response's first span there is no
last response token (the teacher's prompt ends with its generation marker, and the response is appended to the
prompt's ids as the sampler appends them), and pi = pi_{j+1}.

**Exactness.** Let Q(x) be the teacher's true probability that the text from the start of z on begins with x,
given c and E (summing over all token continuations). Then

    D Q(tau + sigma) = e_q(sigma) + p_j(z) Q_{j+1}(sigma) + sum_{t : tau < sigma(t) < tau + sigma, proper} p_j(t) Q_t(rest)
    Q_{j+1}(sigma)   = q_{j+1}(sigma) + sum_{t : sigma(t) a proper prefix of sigma} p_{j+1}(t) Q_{j+1,t}(rest)

so, for every student token s:

- pi(s) <= q(s) <= Q(tau + sigma(s)): the projection is a lower bound of the teacher's next-text probability
  given (c, E);
- q(s) = Q(tau + sigma(s)) exactly iff no teacher token that is a proper prefix of sigma(s) at j + 1, nor one
  strictly between tau and tau + sigma(s) at j, can continue into it with nonzero probability: in particular
  whenever sigma(s) is a single byte, and for EOS (Q = the probability that the turn ends after tau);
- a character-level student over single-byte characters (the toy tokenizer: printable ASCII and newline):
  pi(ch) = q(ch) = P_teacher(next character = ch | c, E) and pi(EOS) = P_teacher(the turn ends now | c, E): the
  projection IS the teacher's next-character distribution given the text, up to what c and E still say about
  tokenization: c is the teacher's tokenization of the text before z (right whenever where z starts does not
  depend on the text after it, as at a pre-tokenizer word start; a deeper boundary move is not corrected), and E
  leaves out the paths that split tau over several teacher tokens (non-canonical, so of little mass for a
  teacher trained on its own tokenizations). For a multi-byte character, teacher tokens holding only part of it
  make q a lower bound. Without the back-off (`project_teacher` alone) the same holds only at boundaries that no
  continuation can move: that is the bias the back-off removes.

**Host precomputation** (`projection_table`, once per vocabulary pair): the teacher's text tokens sorted by their
byte strings, so that the tokens starting with any string x are one contiguous interval of that order; the table
is the order, each student id's interval [lo(s), hi(s)), each teacher id's strict-extension interval, and a
sparse table (CSR by teacher id z, student ids sorted in each row) of the intervals of tau(z) + sigma(s) for the
pairs (z, s) that some teacher token extends. The intervals of a support are laminar (nested or disjoint), so
their endpoints cut the sorted teacher axis into at most 2K + 1 elementary segments, each inside the same support
intervals throughout; a segment's mass goes to the innermost support interval that contains it, or to the tail.

**Device computation** (`project_teacher`, `project_extensions`): per position, every elementary segment's mass is
summed directly from the teacher's probabilities (blocks of `table.block` sorted ids: the whole blocks inside the
segment from block sums, the two edge blocks element by element): no differences of cumulative sums, so small
masses keep their relative precision. Cost per position O(V + (2K + 1) (V / block + 2 block)); the sparse
lookup is a binary search of `table.ext_steps` steps per support id. `back_off` combines the two in log space.
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
    # the back-off (module docstring): teacher id z's strict extensions are order[ext_lo(z):ext_hi(z)] ...
    ext_lo_V: Int[Array, "Vt"]
    ext_hi_V: Int[Array, "Vt"]
    # ... and those starting with tau(z) + sigma(s) are order[pair_lo[e]:pair_hi[e]] for the entry e of
    # pair_student[ext_row[z]:ext_row[z + 1]] (student ids, increasing) equal to s; no entry: none
    ext_row_V: Int[Array, "Vt1"]
    pair_student_E: Int[Array, "E"]  # E >= 1: a sentinel entry closes the array
    pair_lo_E: Int[Array, "E"]
    pair_hi_E: Int[Array, "E"]
    block: int = dataclasses.field(metadata=dict(static=True))
    n_teacher_text: int = dataclasses.field(metadata=dict(static=True))
    ext_steps: int = dataclasses.field(metadata=dict(static=True))  # binary-search steps over the longest row


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with `prefix` (None: there is none)."""
    stripped = prefix.rstrip(b"\xff")
    return None if not stripped else stripped[:-1] + bytes([stripped[-1] + 1])


def _interval(keys: list[bytes], prefix: bytes) -> tuple[int, int]:
    """[lo, hi): the sorted keys that start with `prefix`."""
    succ = _successor(prefix)
    return bisect.bisect_left(keys, prefix), len(keys) if succ is None else bisect.bisect_left(keys, succ)


def _extension_pairs(student: Vocab, teacher: Vocab) -> dict[bytes, list[tuple[bytes, int]]]:
    """For each teacher string tau: the student strings sigma (with their lowest id) such that some teacher token
    starts with tau + sigma, sorted by student id."""
    t_strings = {b for b in teacher.token_bytes if b is not None}
    s_first: dict[bytes, int] = {}
    for s, b in enumerate(student.token_bytes):
        if b is not None and s != student.eos_id:
            s_first.setdefault(b, s)
    longest = max(map(len, s_first), default=0)
    pairs: dict[bytes, dict[bytes, int]] = {}
    for t in t_strings:
        for i in range(1, len(t)):
            if t[:i] in t_strings:  # t = tau + r, r non-empty: every student string prefixing r
                row = pairs.setdefault(t[:i], {})
                for n in range(1, min(len(t) - i, longest) + 1):
                    s = s_first.get(t[i:i + n])
                    if s is not None:
                        row[t[i:i + n]] = s
    return {tau: sorted(row.items(), key=lambda kv: kv[1]) for tau, row in pairs.items()}


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
            lo[s], hi[s] = _interval(keys, sigma)
    # the back-off's tables: strict extensions of each teacher token, and of each (teacher, student) pair
    pairs = _extension_pairs(student, teacher)
    ext_lo, ext_hi = np.zeros(vt, np.int32), np.zeros(vt, np.int32)
    row_ptr, p_student, p_lo, p_hi = np.zeros(vt + 1, np.int32), [], [], []
    for z in range(vt):
        tau = teacher.token_bytes[z] if z < len(teacher) else None
        if tau is not None:
            ext_lo[z], ext_hi[z] = bisect.bisect_right(keys, tau), _interval(keys, tau)[1]
            for sigma, s in pairs.get(tau, ()):
                a, e = _interval(keys, tau + sigma)
                p_student.append(s), p_lo.append(a), p_hi.append(e)
        row_ptr[z + 1] = len(p_student)
    longest_row = int(np.max(np.diff(row_ptr), initial=0))
    as_array = lambda x: jnp.asarray(np.array(x + [-1], np.int32))  # noqa: E731 (the sentinel)
    order = np.array([*text, end, *rest], np.int32)
    return ProjectionTable(teacher_order_V=jnp.asarray(order), student_lo_V=jnp.asarray(lo),
                           student_hi_V=jnp.asarray(hi), ext_lo_V=jnp.asarray(ext_lo), ext_hi_V=jnp.asarray(ext_hi),
                           ext_row_V=jnp.asarray(row_ptr), pair_student_E=as_array(p_student),
                           pair_lo_E=as_array(p_lo), pair_hi_E=as_array(p_hi),
                           block=block or max(8, int(math.sqrt(vt / 2))), n_teacher_text=len(text),
                           ext_steps=int(longest_row).bit_length())


def placeholder_table(student_vocab_size: int, teacher_vocab_size: int, pairs_per_teacher_id: float = 4.0,
                      ext_steps: int = 16) -> ProjectionTable:
    """A table of the right shapes for vocabularies of these sizes, all zeros (no text, empty intervals), for
    lowering and sizing a step without the tokenizers (`jopd aot` on config-only model directories). The sparse
    entries are estimated as `pairs_per_teacher_id` per teacher id: SmolLM2's 49152-token BPE has 3.7 against
    itself and 0.8 against a character-level student. Its values are meaningless: never project with it."""
    vs, vt = int(student_vocab_size), int(teacher_vocab_size)
    e = max(1, int(pairs_per_teacher_id * vt))
    zeros = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    return ProjectionTable(teacher_order_V=zeros(vt), student_lo_V=zeros(vs), student_hi_V=zeros(vs),
                           ext_lo_V=zeros(vt), ext_hi_V=zeros(vt), ext_row_V=zeros(vt + 1), pair_student_E=zeros(e),
                           pair_lo_E=zeros(e), pair_hi_E=zeros(e), block=max(8, int(math.sqrt(vt / 2))),
                           n_teacher_text=0, ext_steps=ext_steps)


class Projected(NamedTuple):
    """log-probabilities on the support (-inf: zero mass, or a masked slot) and of the tail."""

    logprobs_PxK: Float[Array, "*P K"]  # log pi(s): the coarse-graining (sums with the tail to 1)
    prefix_logprobs_PxK: Float[Array, "*P K"]  # log q(s): the teacher's mass of tokens starting with sigma(s)
    tail_logprob_P: Float[Array, "*P"]  # log pi(tail)


class Extensions(NamedTuple):
    """The teacher's distribution at the start of its last token z, restricted to z's strict extensions
    (module docstring: log e, log e_q, log e(tail)), with log p_j(z) and log D."""

    logmass_PxK: Float[Array, "*P K"]  # log e(s)
    prefix_logmass_PxK: Float[Array, "*P K"]  # log e_q(s)
    tail_logmass_P: Float[Array, "*P"]  # log e(tail)
    last_logprob_P: Float[Array, "*P"]  # log p_j(z)
    log_norm_P: Float[Array, "*P"]  # log D


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


def _sorted_blocks(lp_PxV: jax.Array, table: ProjectionTable) -> jax.Array:
    """The probabilities in the table's teacher order, in blocks [P, V / block, block] (zero-padded)."""
    P, V = lp_PxV.shape
    b = table.block
    nb = -(-V // b)
    p = jnp.exp(lp_PxV)[:, table.teacher_order_V]
    return jnp.pad(p, ((0, 0), (0, nb * b - V))).reshape(P, nb, b)


def _partition(pb_PxBxb: jax.Array, lo_PxK: jax.Array, hi_PxK: jax.Array, valid_PxK: jax.Array, V: int, b: int
               ) -> tuple[jax.Array, jax.Array]:
    """(pi-style partition [P, K + 1]: each elementary segment's mass to its innermost interval, else slot K;
    prefix masses [P, K]: each interval's whole mass) of laminar intervals [lo, hi) (invalid ones: empty)."""
    P, K = lo_PxK.shape
    lo, hi = jnp.where(valid_PxK, lo_PxK, 0), jnp.where(valid_PxK, hi_PxK, 0)
    pts = jnp.sort(jnp.concatenate([lo, hi], axis=-1), axis=-1)
    a = jnp.concatenate([jnp.zeros((P, 1), pts.dtype), pts], axis=-1)  # J = 2K + 1 elementary segments [a, e)
    e = jnp.concatenate([pts, jnp.full((P, 1), V, pts.dtype)], axis=-1)
    m = _segment_masses(pb_PxBxb, a, e, b)  # [P, J]
    contains = valid_PxK[:, None, :] & (lo[:, None, :] <= a[..., None]) & (a[..., None] < hi[:, None, :])
    inner = jnp.argmin(jnp.where(contains, (hi - lo)[:, None, :], V + 1), axis=-1)  # innermost
    assigned = jnp.where(contains.any(-1), inner, K)
    part = jnp.zeros((P, K + 1), m.dtype).at[jnp.arange(P)[:, None], assigned].add(m)
    prefix = jnp.sum(jnp.where(contains, m[..., None], 0.0), axis=1)
    return part, prefix


def _flat(teacher_logprobs_PxV, support_ids_PxK, support_mask_PxK, table: ProjectionTable):
    V = teacher_logprobs_PxV.shape[-1]
    if V != table.teacher_order_V.shape[0]:
        raise ValueError(f"projection: teacher log-probs have {V} ids, the table {table.teacher_order_V.shape[0]}")
    K = support_ids_PxK.shape[-1]
    return (teacher_logprobs_PxV.reshape(-1, V).astype(jnp.float32), support_ids_PxK.reshape(-1, K),
            support_mask_PxK.reshape(-1, K))


def project_teacher(
    teacher_logprobs_PxV: Float[Array, "*P Vt"],
    support_ids_PxK: Int[Array, "*P K"],
    support_mask_PxK: Bool[Array, "*P K"],
    table: ProjectionTable,
) -> Projected:
    """The teacher's next-token log-probs (any leading axes, full vocabulary of the teacher model) projected onto
    each position's student support (module docstring). Mask repeated support ids (a repeat of a kept id would
    get pi = 0 but the full q)."""
    lead, K = support_ids_PxK.shape[:-1], support_ids_PxK.shape[-1]
    lp, ids, mask = _flat(teacher_logprobs_PxV, support_ids_PxK, support_mask_PxK, table)
    lo = jnp.take(table.student_lo_V, ids, mode="fill", fill_value=0)
    hi = jnp.take(table.student_hi_V, ids, mode="fill", fill_value=0)
    part, prefix = _partition(_sorted_blocks(lp, table), lo, hi, mask & (lo < hi), lp.shape[1], table.block)
    logs = lambda x: jnp.where(mask, jnp.log(x), -jnp.inf).reshape(*lead, K)  # noqa: E731
    return Projected(logprobs_PxK=logs(part[:, :K]), prefix_logprobs_PxK=logs(prefix),
                     tail_logprob_P=jnp.log(part[:, K]).reshape(lead))


def _pair_intervals(table: ProjectionTable, last_P: jax.Array, ids_PxK: jax.Array):
    """(lo, hi, found) of the teacher tokens starting with tau(last) + sigma(id): a binary search of the student
    id in the last token's row of the sparse table (`table.ext_steps` halvings of the longest row)."""
    z = jnp.clip(last_P, 0, table.ext_row_V.shape[0] - 2)[:, None]
    start, stop = table.ext_row_V[z], table.ext_row_V[z + 1]  # [P, 1]
    a, e = jnp.broadcast_to(start, ids_PxK.shape), jnp.broadcast_to(stop, ids_PxK.shape)
    for _ in range(table.ext_steps):  # lower bound of the id in [a, e)
        mid = (a + e) // 2
        right = (a < e) & (table.pair_student_E[mid] < ids_PxK)
        a, e = jnp.where(right, mid + 1, a), jnp.where((a < e) & ~right, mid, e)
    found = (a < stop) & (table.pair_student_E[a] == ids_PxK)
    return table.pair_lo_E[a], table.pair_hi_E[a], found


def project_extensions(
    teacher_logprobs_PxV: Float[Array, "*P Vt"],
    last_ids_P: Int[Array, "*P"],
    support_ids_PxK: Int[Array, "*P K"],
    support_mask_PxK: Bool[Array, "*P K"],
    table: ProjectionTable,
) -> Extensions:
    """The back-off's masses (module docstring) from the teacher's log-probs at the start of its last token
    z = `last_ids` (any leading axes). Mask repeated support ids as for `project_teacher`."""
    lead, K = support_ids_PxK.shape[:-1], support_ids_PxK.shape[-1]
    lp, ids, mask = _flat(teacher_logprobs_PxV, support_ids_PxK, support_mask_PxK, table)
    last = last_ids_P.reshape(-1).astype(jnp.int32)
    V, b = lp.shape[1], table.block
    pb = _sorted_blocks(lp, table)
    lo, hi, found = _pair_intervals(table, last, ids)
    part, prefix = _partition(pb, lo, hi, mask & found & (lo < hi), V, b)
    x_lo = jnp.take(table.ext_lo_V, last, mode="fill", fill_value=0)[:, None]
    x_hi = jnp.take(table.ext_hi_V, last, mode="fill", fill_value=0)[:, None]
    extended = _segment_masses(pb, x_lo, jnp.maximum(x_hi, x_lo), b)[:, 0]  # the mass of X
    last_lp = jnp.take_along_axis(lp, jnp.clip(last, 0, V - 1)[:, None], axis=1)[:, 0]
    # X minus the support's shares, clamped: the rounding of two sums must not make it negative
    tail = jnp.maximum(extended - jnp.sum(part[:, :K], axis=-1), 0.0)
    logs = lambda x: jnp.where(mask, jnp.log(x), -jnp.inf).reshape(*lead, K)  # noqa: E731
    return Extensions(logmass_PxK=logs(part[:, :K]), prefix_logmass_PxK=logs(prefix),
                      tail_logmass_P=jnp.log(tail).reshape(lead), last_logprob_P=last_lp.reshape(lead),
                      log_norm_P=jnp.logaddexp(last_lp, jnp.log(extended)).reshape(lead))


def back_off(now: Projected, ext: Extensions, use_P: Bool[Array, "*P"]) -> Projected:
    """The projection at a span start marginalized over the extensions of the teacher's last token (module
    docstring): pi = (e + p_j(z) pi_{j+1}) / D, likewise q and the tail; `now` unchanged where `use` is False
    (the response's first span)."""
    w_P = jnp.where(use_P, ext.last_logprob_P - ext.log_norm_P, 0.0)  # log (p_j(z) / D); 0: pi = pi_{j+1}

    def mix(e, n):
        slot = (...,) + (None,) * (n.ndim - use_P.ndim)  # per support slot, or per position (the tail)
        return jnp.logaddexp(jnp.where(use_P[slot], e - ext.log_norm_P[slot], -jnp.inf), w_P[slot] + n)

    return Projected(logprobs_PxK=mix(ext.logmass_PxK, now.logprobs_PxK),
                     prefix_logprobs_PxK=mix(ext.prefix_logmass_PxK, now.prefix_logprobs_PxK),
                     tail_logprob_P=mix(ext.tail_logmass_P, now.tail_logprob_P))
