"""The projection against brute force: per-teacher-token loops over the vocabularies, and the teacher's true
next-text probabilities by enumerating its token sequences (a tiny teacher vocabulary, a random bigram model),
with and without the back-off to the start of the teacher's last token."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.crosstok import (Vocab, align_response, back_off, check_pair, project_extensions, project_teacher,
                           projection_table, vocab_of)
from jopd.data.chat import encode_text
from jopd.data.toy_tokenizer import CHARACTERS
from jopd.losses.divergences import topk_tail_reverse_kl
from tests.crosstok.made_up import bpe

TOL = dict(rtol=2e-5, atol=1e-7)


def _brute_partition(student: Vocab, teacher: Vocab, end_id, p_V, support, mask):
    """pi(s) and q(s) by looping over teacher tokens (module docstring of project.py), and the tail."""
    strings = [student.token_bytes[s] if m and s < len(student) else None for s, m in zip(support, mask)]
    eos_slot = next((k for k, (s, m) in enumerate(zip(support, mask)) if m and s == student.eos_id), None)
    part, prefix, tail = np.zeros(len(support)), np.zeros(len(support)), 0.0
    for t in range(len(p_V)):
        tb = teacher.token_bytes[t] if t < len(teacher) else None
        if tb is None:
            if t == end_id and eos_slot is not None:
                part[eos_slot] += p_V[t]
                prefix[eos_slot] += p_V[t]
            else:
                tail += p_V[t]
            continue
        hits = [k for k, sb in enumerate(strings) if sb is not None and tb.startswith(sb)]
        for k in hits:
            prefix[k] += p_V[t]
        if hits:
            part[max(hits, key=lambda k: len(strings[k]))] += p_V[t]
        else:
            tail += p_V[t]
    return part, prefix, tail


def _project(table, logp_PxV, support_PxK, mask_PxK):
    out = jax.jit(project_teacher)(jnp.asarray(logp_PxV), jnp.asarray(support_PxK), jnp.asarray(mask_PxK), table)
    return [np.exp(np.asarray(x, np.float64)) for x in out]


def _random_logp(rng, P, V, scale=4.0):
    x = rng.normal(0, scale, (P, V))
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


@pytest.fixture(scope="module")
def toy_smollm2(toy, smollm2):
    pair = check_pair(toy, smollm2)
    return pair, projection_table(pair.student, pair.teacher, pair.teacher_end_ids)


def test_character_student_gets_the_teachers_next_character_distribution(toy, smollm2, toy_smollm2):
    """Toy (one printable ASCII character per token) against SmolLM2: pi(c) = sum of p_t over the teacher tokens
    whose decoded text starts with c (brute force from `decode`), pi(EOS) = p_t(<|im_end|>)."""
    pair, table = toy_smollm2
    rng = np.random.default_rng(0)
    logp = _random_logp(rng, 2, len(smollm2))
    support = np.arange(len(toy))[None].repeat(2, 0)
    part, prefix, tail = _project(table, logp, support, np.ones_like(support, bool))
    decoded = smollm2.backend_tokenizer.decode_batch([[i] for i in range(len(smollm2))])
    p = np.exp(logp.astype(np.float64))
    for s in range(len(toy)):
        c = toy.convert_ids_to_tokens(s)
        if s == toy.eos_token_id:
            want = p[:, smollm2.eos_token_id]
        elif s in toy.all_special_ids:
            want = np.zeros(2)
        else:
            starts = [i for i, d in enumerate(decoded) if d.startswith(c) and i not in smollm2.all_special_ids]
            want = p[:, starts].sum(-1)
        np.testing.assert_allclose(part[:, s], want, **TOL)
        np.testing.assert_allclose(prefix[:, s], want, **TOL)  # single characters: prefix-free
    np.testing.assert_allclose(part.sum(-1) + tail, 1.0, rtol=1e-5)
    assert (tail > 0).all()  # non-ASCII starts, other special tokens


def test_random_supports_with_masked_repeats(toy, toy_smollm2):
    pair, table = toy_smollm2
    rng = np.random.default_rng(1)
    P, K = 4, 12
    logp = _random_logp(rng, P, table.teacher_order_V.shape[0])
    support = rng.integers(0, len(toy), (P, K))
    support[:, 1] = support[:, 0]
    support[0, 2] = toy.eos_token_id
    mask = np.ones((P, K), bool)
    mask[:, 1] = False  # the repeat
    part, prefix, tail = _project(table, logp, support, mask)
    for i in range(P):
        bp, bq, bt = _brute_partition(pair.student, pair.teacher, pair.teacher_end_ids[0],
                                      np.exp(logp[i].astype(np.float64)), support[i], mask[i])
        np.testing.assert_allclose(part[i], bp, **TOL)
        np.testing.assert_allclose(prefix[i], bq, **TOL)
        np.testing.assert_allclose(tail[i], bt, rtol=1e-5)
    assert (part[:, 1] == 0).all()


def test_nested_support_strings_smollm2_both_sides(smollm2):
    """Support strings that prefix one another (" ", " t", " the", "t", "th", "the"), a partial UTF-8 piece
    (the first byte of "é") and random ids: pi assigns each teacher token to its longest support prefix."""
    v = vocab_of(smollm2)
    table = projection_table(v, v, (smollm2.eos_token_id,))
    pieces = ["Ġ", "Ġt", "Ġthe", "t", "th", "the", "Ã", "Ã©", "<|im_end|>", "<|im_start|>"]
    rng = np.random.default_rng(2)
    P = 3
    fixed = smollm2.convert_tokens_to_ids(pieces)
    support = np.stack([np.array(fixed + list(rng.integers(0, len(v), 6))) for _ in range(P)])
    mask = np.ones_like(support, bool)
    logp = _random_logp(rng, P, len(v), scale=3.0)
    part, prefix, tail = _project(table, logp, support, mask)
    for i in range(P):
        bp, bq, bt = _brute_partition(v, v, smollm2.eos_token_id, np.exp(logp[i].astype(np.float64)), support[i],
                                      mask[i])
        np.testing.assert_allclose(part[i], bp, **TOL)
        np.testing.assert_allclose(prefix[i], bq, **TOL)
        np.testing.assert_allclose(tail[i], bt, rtol=1e-5)
    assert (prefix[:, 0] > part[:, 0]).all() and part[0, 9] == 0  # nesting; a special other than EOS gets 0
    np.testing.assert_allclose(part.sum(-1) + tail, 1.0, rtol=1e-5)


def _vocab(strings, eos=0) -> Vocab:
    return Vocab("made-up", tuple(None if s is None else s.encode() for s in strings), eos, None, False)


@pytest.mark.parametrize("block", [1, 3, 8])
def test_small_blocks_against_brute_force(block):
    """Random made-up vocabularies over {a, b, c}: every block edge case of the segment sums; a duplicated
    student string (only the lower id gets it); support ids past the student's vocabulary (q = 0)."""
    rng = np.random.default_rng(block)
    words = ["".join(w) for n in (1, 2, 3) for w in itertools.product("abc", repeat=n) if w != ("b",)]
    t_strings = [None, "b", *rng.choice(words, 24, replace=False), None]  # 0: end of turn, 26: another special
    s_strings = [None, "b", *rng.choice(words, 11, replace=False), "b"]
    dup = len(s_strings) - 1
    student, teacher = _vocab(s_strings), _vocab(t_strings)
    table = projection_table(student, teacher, (0,), teacher_vocab_size=30, block=block)
    P, K = 6, 6
    logp = _random_logp(rng, P, 30, scale=2.0)
    support = np.stack([rng.choice(len(s_strings) + 2, K, replace=False) for _ in range(P)])
    support[:2, :2] = [1, dup]  # the duplicate next to its original
    mask = rng.random((P, K)) < 0.85
    part, prefix, tail = _project(table, logp, support, mask)
    for i in range(P):
        bp, bq, bt = _brute_partition(student, teacher, 0, np.exp(logp[i].astype(np.float64)), support[i],
                                      mask[i] & (support[i] != dup))
        np.testing.assert_allclose(part[i], bp, **TOL)
        np.testing.assert_allclose(prefix[i], bq, **TOL)
        np.testing.assert_allclose(tail[i], bt, rtol=1e-5, atol=1e-7)
    assert (part[support == dup] == 0).all() and (prefix[support == dup] == 0).all()


# ---- the teacher's true next-text probabilities, by enumeration ----

T_STRINGS = [None, "a", "b", "ab", "ba", "abb", "bb", "bab"]  # id 0: end of turn


def _bigram(seed=3):
    W = np.random.default_rng(seed).normal(0, 1.5, (len(T_STRINGS) + 1, len(T_STRINGS)))
    return np.exp(W) / np.exp(W).sum(-1, keepdims=True)  # row = previous token (last row: start)


def _true_prefix_prob(P, prev: int, sigma: str, strings=T_STRINGS) -> float:
    """P_teacher(the next text begins with sigma | previous token), summing over every token continuation."""
    total = 0.0
    for t, ts in enumerate(strings):
        if ts is None:
            continue
        if ts.startswith(sigma):
            total += P[prev, t]
        elif sigma.startswith(ts):
            total += P[prev, t] * _true_prefix_prob(P, t, sigma[len(ts):], strings)
    return total


def _true_given_covers(P, prev: int, tau: str, sigma: str | None, strings=T_STRINGS) -> float:
    """P_teacher(the text begins with tau + sigma | previous token, the next token's text starts with tau), by
    enumerating token paths; sigma None: the turn ends right after tau (the end-of-turn token is id 0)."""
    num = den = 0.0
    for t, ts in enumerate(strings):
        if ts is None or not ts.startswith(tau):
            continue
        den += P[prev, t]
        rest = ts[len(tau):]
        if sigma is None:
            num += P[prev, t] * P[t, 0] if not rest else 0.0
        elif rest.startswith(sigma):
            num += P[prev, t]
        elif sigma.startswith(rest):
            num += P[prev, t] * _true_prefix_prob(P, t, sigma[len(rest):], strings)
    return num / den


def test_projection_against_enumerated_next_text_probabilities():
    """q(s) <= Q(sigma(s)) always; equal for single characters (the character-level student: pi is the exact
    next-character distribution, EOS included) and for strings no teacher token properly prefixes."""
    P = _bigram()
    teacher = _vocab(T_STRINGS)
    start = len(T_STRINGS)
    logp = np.log(P[start])[None].astype(np.float32)
    chars = _vocab([None, "a", "b"])
    part, prefix, tail = _project(projection_table(chars, teacher, (0,)), logp, np.array([[0, 1, 2]]),
                                  np.ones((1, 3), bool))
    np.testing.assert_allclose(part[0], [P[start, 0], _true_prefix_prob(P, start, "a"),
                                         _true_prefix_prob(P, start, "b")], rtol=1e-5)
    np.testing.assert_allclose(tail, 0.0, atol=1e-6)  # every next character is a or b, or the turn ends

    multi = [None, "a", "ab", "abb", "b", "ba", "bab", "bb"]
    s_vocab = _vocab(multi)
    ids = np.arange(1, len(multi))[None]
    _, prefix, _ = _project(projection_table(s_vocab, teacher, (0,)), logp, ids, np.ones_like(ids, bool))
    for k, sigma in enumerate(multi[1:]):
        true = _true_prefix_prob(P, start, sigma)
        properly_prefixed = any(ts and sigma.startswith(ts) and ts != sigma for ts in T_STRINGS)
        assert prefix[0, k] <= true + 1e-7
        if properly_prefixed:
            assert prefix[0, k] < true - 1e-4  # strictly below: the teacher can reach sigma through a shorter token
        else:
            np.testing.assert_allclose(prefix[0, k], true, rtol=1e-5)


def test_projection_feeds_the_truncated_reverse_kl_with_tail(toy_smollm2):
    """log pi on the support is what `topk_tail_reverse_kl` takes as the teacher's log-probs; its tail is then
    ours: the loss equals the KL of the two (K + 1)-outcome distributions computed here."""
    pair, table = toy_smollm2
    rng = np.random.default_rng(4)
    P, K = 3, 8
    logp_t = _random_logp(rng, P, table.teacher_order_V.shape[0])
    text_or_eos = [i for i in range(len(pair.student)) if pair.student.is_text(i) or i == pair.student.eos_id]
    support = np.stack([rng.choice(text_or_eos, K, replace=False) for _ in range(P)])
    mask = np.ones((P, K), bool)
    s_logits = jnp.asarray(rng.normal(0, 2, (P, 103)), jnp.float32)

    @jax.jit
    def both(logp_t, support, mask, s_logits):
        proj = project_teacher(logp_t, support, mask, table)
        return proj, topk_tail_reverse_kl(s_logits, support, proj.logprobs_PxK, mask)[0]

    proj, loss = both(jnp.asarray(logp_t), jnp.asarray(support), jnp.asarray(mask), s_logits)
    ps = np.asarray(jax.nn.softmax(s_logits), np.float64)[np.arange(P)[:, None], support]
    ps = np.concatenate([ps, 1 - ps.sum(-1, keepdims=True)], -1)
    pt = np.exp(np.concatenate([np.asarray(proj.logprobs_PxK), np.asarray(proj.tail_logprob_P)[:, None]], -1))
    np.testing.assert_allclose(loss, (ps * (np.log(ps) - np.log(pt))).sum(-1), rtol=1e-4)


# ---- backing off to the start of the teacher's last token ----


def _backed_off(table, logp_before_PxV, logp_now_PxV, last_P, support_PxK, mask_PxK, use_P):
    @jax.jit
    def run(before, now, last, support, mask, use):
        return back_off(project_teacher(now, support, mask, table),
                        project_extensions(before, last, support, mask, table), use)

    out = run(*(jnp.asarray(x) for x in (logp_before_PxV, logp_now_PxV, last_P, support_PxK, mask_PxK, use_P)))
    return [np.exp(np.asarray(x, np.float64)) for x in out]


def _brute_backoff(student: Vocab, teacher: Vocab, end_id, p_before, p_now, last, support, mask):
    """pi, q and the tail with the back-off, by looping over teacher tokens (project.py's docstring formulas)."""
    now_part, now_prefix, now_tail = _brute_partition(student, teacher, end_id, p_now, support, mask)
    strings = [student.token_bytes[s] if m and s < len(student) else None for s, m in zip(support, mask)]
    tau = teacher.token_bytes[last]
    e, e_q, e_tail, D = np.zeros(len(support)), np.zeros(len(support)), 0.0, p_before[last]
    for t in range(len(p_before)):
        tb = teacher.token_bytes[t] if t < len(teacher) else None
        if tb is None or len(tb) <= len(tau) or not tb.startswith(tau):
            continue
        D += p_before[t]
        rest = tb[len(tau):]
        hits = [k for k, sb in enumerate(strings) if sb is not None and rest.startswith(sb)]
        for k in hits:
            e_q[k] += p_before[t]
        if hits:
            e[max(hits, key=lambda k: len(strings[k]))] += p_before[t]
        else:
            e_tail += p_before[t]
    w = p_before[last]
    return (e + w * now_part) / D, (e_q + w * now_prefix) / D, (e_tail + w * now_tail) / D


def test_back_off_against_brute_force_on_random_vocabularies():
    """Made-up vocabularies over {a, b, c} (strings of 1 to 3 letters: many extensions, nested support strings),
    random teacher distributions at both positions, random last tokens and supports (EOS, a special id, ids past
    the vocabulary, masked slots); a row that does not back off is the plain projection."""
    rng = np.random.default_rng(7)
    words = ["".join(w) for n in (1, 2, 3) for w in itertools.product("abc", repeat=n)]
    t_strings = [None, *rng.choice(words, 30, replace=False), None]  # 0: end of turn, 31: another special
    s_strings = [None, *rng.choice(words, 14, replace=False)]
    student, teacher = _vocab(s_strings), _vocab(t_strings)
    table = projection_table(student, teacher, (0,), teacher_vocab_size=34, block=3)
    P, K = 8, 7
    before, now = _random_logp(rng, P, 34, scale=2.0), _random_logp(rng, P, 34, scale=2.0)
    last = rng.integers(1, 31, P)
    support = np.stack([rng.choice(len(s_strings) + 2, K, replace=False) for _ in range(P)])
    mask = rng.random((P, K)) < 0.9
    use = np.arange(P) != 0
    part, prefix, tail = _backed_off(table, before, now, last, support, mask, use)
    plain = _project(table, now[:1], support[:1], mask[:1])
    for got, want in zip((part, prefix, tail), plain):
        np.testing.assert_allclose(got[0], want[0], **TOL)
    for i in range(1, P):
        bp, bq, bt = _brute_backoff(student, teacher, 0, *(np.exp(x[i].astype(np.float64)) for x in (before, now)),
                                    last[i], support[i], mask[i])
        np.testing.assert_allclose(part[i], bp, **TOL)
        np.testing.assert_allclose(prefix[i], bq, **TOL)
        np.testing.assert_allclose(tail[i], bt, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(part.sum(-1) + tail, 1.0, rtol=1e-5)
    assert table.ext_steps >= 2 and (part[1:] > 0).sum() > 20  # several rows searched, real masses checked


def test_back_off_against_enumerated_next_text_probabilities():
    """The bigram teacher, backed off to the start of each last token tau: for single characters and EOS the
    projection is P(next text | previous token, the token covers tau) by enumeration; for longer strings a lower
    bound, strictly below exactly where a path goes through a teacher token inside tau + sigma."""
    P = _bigram()
    teacher = _vocab(T_STRINGS)
    cases = [(prev, tau_id) for prev in range(len(T_STRINGS) + 1)  # the last row: the start of the response
             for tau_id in range(1, len(T_STRINGS))]
    before = np.log(P[[prev for prev, _ in cases]]).astype(np.float32)
    now = np.log(P[[tau_id for _, tau_id in cases]]).astype(np.float32)
    last, use, n = np.array([tau_id for _, tau_id in cases]), np.ones(len(cases), bool), len(cases)
    part, _, tail = _backed_off(projection_table(_vocab([None, "a", "b"]), teacher, (0,)), before, now, last,
                                np.tile([0, 1, 2], (n, 1)), np.ones((n, 3), bool), use)
    multi = [None, "a", "ab", "abb", "b", "ba", "bab", "bb"]
    ids = np.tile(np.arange(1, len(multi)), (n, 1))
    _, prefix, _ = _backed_off(projection_table(_vocab(multi), teacher, (0,)), before, now, last, ids,
                               np.ones_like(ids, bool), use)
    np.testing.assert_allclose(tail, 0.0, atol=1e-6)  # every next character is a or b, or the turn ends
    strict = 0
    for i, (prev, tau_id) in enumerate(cases):
        tau = T_STRINGS[tau_id]
        want = [_true_given_covers(P, prev, tau, c) for c in (None, "a", "b")]
        np.testing.assert_allclose(part[i], want, rtol=2e-5)
        for k, sigma in enumerate(multi[1:]):
            true = _true_given_covers(P, prev, tau, sigma)
            inside = any(ts and (tau + sigma).startswith(ts) and len(tau) < len(ts) < len(tau + sigma)
                         for ts in T_STRINGS) or any(ts and sigma.startswith(ts) and ts != sigma for ts in T_STRINGS)
            assert prefix[i, k] <= true * (1 + 1e-5)
            if inside:
                assert prefix[i, k] < true * (1 - 1e-4)
                strict += 1
            else:
                np.testing.assert_allclose(prefix[i, k], true, rtol=2e-5)
    assert strict > 100  # both branches exercised


def test_lone_space_then_hashes_made_up_bpe():
    """A BPE that merges " ####" across the space (SmolLM2's case): "17. 16" is written ".", " ", "1", "6",
    "17. ####" ends in " ####". A bigram teacher trained on such tokenizations: after "." it writes " ####", after
    a lone " " almost never "#". At the span start after the lone space, the plain projection says "not #"; the
    back-off gives the teacher's next-character distribution given the text (by enumeration), where "#" leads."""
    merges = [("#", "#"), ("##", "##"), (" ", "####")]
    tok = bpe(CHARACTERS, merges)
    assert tok.convert_ids_to_tokens(encode_text(tok, "17. ####"))[-1] == " ####"
    from jopd.data.toy_tokenizer import build_toy_tokenizer

    toy = build_toy_tokenizer()
    pair = check_pair(toy, tok)
    a = align_response(pair, [{"role": "user", "content": "x"}], encode_text(toy, "17. 16") + [toy.eos_token_id])
    teacher = pair.teacher
    assert [teacher.token_bytes[i] for i in a.teacher_ids_Nt[:a.n_teacher_text]] == [b"1", b"7", b".", b" ", b"1",
                                                                                      b"6"]
    V = len(teacher)
    strings = [None if b is None else b.decode() for b in teacher.token_bytes]
    strings[pair.teacher_end_ids[0]] = None
    order = [pair.teacher_end_ids[0]] + [i for i in range(V) if i != pair.teacher_end_ids[0]]
    rng = np.random.default_rng(5)
    W = rng.normal(0, 1.0, (V + 1, V))
    W[:, [i for i in range(V) if strings[i] is None and i != pair.teacher_end_ids[0]]] = -30.0  # no specials
    ids = {s: i for i, s in enumerate(strings) if s is not None}
    W[ids["."], ids[" ####"]], W[ids["."], ids[" "]] = 8.0, 6.5  # after ".": " ####", sometimes " " + a number
    W[ids[" "], [ids["#"], ids["##"], ids["####"], ids[" ####"]]] = -12.0  # a lone " " is never followed by "#"
    W[ids[" "], [ids[d] for d in "0123456789"]] = 6.0
    P = np.exp(W) / np.exp(W).sum(-1, keepdims=True)
    # the end-of-turn id first, so that the enumeration's id 0 is the end of turn
    P_e, strings_e = P[:, order][order + [V]], [strings[i] for i in order]
    k = next(k for k, (b0, _) in enumerate(a.spans_bytes_Kx2) if b0 == 4)  # the span after "17. "
    t0 = a.spans_teacher_Kx2[k, 0]
    z, prev = a.teacher_ids_Nt[t0 - 1], a.teacher_ids_Nt[t0 - 2]
    assert strings[z] == " " and strings[prev] == "."
    support = np.array([[toy.convert_tokens_to_ids(c) for c in "#1 "] + [toy.eos_token_id]])
    mask = np.ones_like(support, bool)
    table = projection_table(pair.student, teacher, pair.teacher_end_ids)
    before, now = np.log(P[prev])[None].astype(np.float32), np.log(P[z])[None].astype(np.float32)
    plain = _project(table, now, support, mask)[0][0]
    backed = _backed_off(table, before, now, np.array([z]), support, mask, np.array([True]))[0][0]
    prev_e, want = order.index(prev), []
    for c in ("#", "1", " ", None):
        want.append(_true_given_covers(P_e, prev_e, " ", c, strings_e))
    np.testing.assert_allclose(backed, want, rtol=1e-4)
    assert plain[0] < 1e-4 and backed[0] > 0.5 and backed[0] > backed[1]  # "#" leads only after the back-off
