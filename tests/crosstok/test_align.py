"""Alignment: hand-made cases, the pair check and run-time failures, and random texts against a brute-force
aligner that sees only the tokenizers' own `decode` (not `vocab.py`'s byte strings)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jopd.crosstok import Alignment, Misaligned, Pair, PairError, align_response, check_pair, common_spans, vocab_of
from jopd.data.chat import encode_text, prompt_response_ids
from jopd.data.toy_tokenizer import CHARACTERS, TOY_CHAT_TEMPLATE, build_toy_tokenizer
from tests.crosstok.made_up import bpe, byte_bpe

MSGS = [{"role": "user", "content": "Ann has 7 pens, gets 5. How many?"}]
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _ids(tok, text, eos=True):
    return encode_text(tok, text) + ([tok.eos_token_id] if eos else [])


def _spans(a: Alignment):
    return a.spans_student_Kx2.tolist(), a.spans_teacher_Kx2.tolist(), a.spans_bytes_Kx2.tolist()


@pytest.fixture(scope="module")
def digits_pair():
    """Student merges "23", teacher merges "12": "123" is 1+2 tokens on one side, 2+1 on the other."""
    return check_pair(bpe(CHARACTERS, [("2", "3")]), bpe(CHARACTERS, [("1", "2")]))


def test_digit_string_split_1_2_against_2_1(digits_pair):
    a = align_response(digits_pair, MSGS, _ids(digits_pair.student_tok, "123"))
    assert _spans(a) == ([[0, 2], [2, 3]], [[0, 2], [2, 3]], [[0, 3], [3, 3]])  # text span, then the end span
    b = align_response(digits_pair, MSGS, _ids(digits_pair.student_tok, "12323", eos=False))
    # student 1|23|23 (cuts 1,3,5), teacher 12|3|2|3 (cuts 2,3,4,5): common cuts 3, 5; no end span
    assert _spans(b) == ([[0, 2], [2, 3]], [[0, 2], [2, 4]], [[0, 3], [3, 5]]) and not b.ends_turn
    assert b.teacher_ids_Nt.tolist() == encode_text(digits_pair.teacher_tok, "12323")


def test_whitespace_merged_into_the_next_token(toy, smollm2):
    a = align_response(check_pair(toy, smollm2), MSGS, _ids(toy, "a  b"))
    assert smollm2.convert_ids_to_tokens(a.teacher_ids_Nt.tolist()) == ["a", "Ġ", "Ġb", "<|im_end|>"]
    assert _spans(a) == ([[0, 1], [1, 2], [2, 4], [4, 5]], [[0, 1], [1, 2], [2, 3], [3, 4]],
                         [[0, 1], [1, 2], [2, 4], [4, 4]])


def test_multibyte_characters_in_bytes(smollm2):
    pair = check_pair(smollm2, byte_bpe([("Ġ", "t")]))
    a = align_response(pair, MSGS, _ids(smollm2, "é"))  # one student token (2 bytes) vs two byte tokens
    assert _spans(a) == ([[0, 1], [1, 2]], [[0, 2], [2, 3]], [[0, 2], [2, 2]])
    assert a.spans_chars_Kx2.tolist() == [[0, 1], [1, 1]]
    # SmolLM2 cuts " 😀" after byte 4 (inside the emoji: 'ĠðŁĺ' + 'Ģ'); a byte teacher cuts everywhere
    b = align_response(pair, MSGS, _ids(smollm2, " 😀", eos=False))
    assert _spans(b) == ([[0, 1], [1, 2]], [[0, 4], [4, 5]], [[0, 4], [4, 5]])
    assert b.spans_chars_Kx2.tolist() == [[0, -1], [-1, 2]]  # the common boundary splits a character
    assert b.student_offsets_Nsx2.tolist() == [[0, 4], [4, 5]]


def test_non_canonical_student_tokens(smollm2):
    ids = smollm2.convert_tokens_to_ids(["h", "e", "l", "l", "o"]) + [smollm2.eos_token_id]
    a = align_response(check_pair(smollm2, smollm2), MSGS, ids)
    assert smollm2.convert_ids_to_tokens(a.teacher_ids_Nt.tolist()) == ["hello", "<|im_end|>"]
    assert _spans(a) == ([[0, 5], [5, 6]], [[0, 1], [1, 2]], [[0, 5], [5, 5]])


def test_empty_responses(toy, smollm2):
    pair = check_pair(toy, smollm2)
    a = align_response(pair, MSGS, [toy.eos_token_id])
    assert _spans(a) == ([[0, 1]], [[0, 1]], [[0, 0]]) and a.teacher_ids_Nt.tolist() == [smollm2.eos_token_id]
    b = align_response(pair, MSGS, [])
    assert b.n_spans == 0 and b.teacher_ids_Nt.size == 0 and not b.ends_turn


def test_teacher_side_equals_the_rendered_conversation(toy, smollm2):
    """The response tokenized on its own after the rendered prompt = the teacher's full-conversation rendering
    (`data.chat.prompt_response_ids`) for ordinary responses."""
    pair = check_pair(toy, smollm2)
    for response in ("7+5=12. #### 12", "Ann has 12 pens.\n\n#### 12", "x"):
        a = align_response(pair, MSGS, _ids(toy, response))
        prompt, resp = prompt_response_ids(smollm2, MSGS[0]["content"], response)
        assert a.teacher_prompt_ids_Pt.tolist() == prompt and a.teacher_ids_Nt.tolist() == resp


def test_offsets_match_the_tokenizers_offset_mapping(toy, smollm2):
    text = "Ann has  7 pens,\ngets 5 (no: 6)! #### 12"
    a = align_response(check_pair(toy, smollm2), MSGS, _ids(toy, text))
    t_offsets = smollm2.backend_tokenizer.encode(text, add_special_tokens=False).offsets  # chars = bytes (ASCII)
    assert a.teacher_offsets_Ntx2[: a.n_teacher_text].tolist() == [list(o) for o in t_offsets]
    assert a.teacher_offsets_Ntx2[a.n_teacher_text:].tolist() == [[len(text)] * 2]
    s_offsets = toy.backend_tokenizer.encode(text, add_special_tokens=False).offsets
    assert a.student_offsets_Nsx2[:-1].tolist() == [list(o) for o in s_offsets]


# ---- the pair check (before training) ----

def test_check_pair_accepts_real_and_made_up_pairs(toy, smollm2):
    assert check_pair(toy, smollm2).teacher_end_ids == (smollm2.eos_token_id,)
    assert check_pair(smollm2, smollm2).teacher_end_ids == (smollm2.eos_token_id,)
    check_pair(smollm2, byte_bpe([]))
    check_pair(bpe(CHARACTERS, []), toy)


def test_check_pair_teacher_cannot_encode_a_student_character(toy, smollm2):
    with pytest.raises(PairError, match=r"^teacher encodes '\\x00' \(U\+0000\), a character the student can emit, "
                                        r"to <unk>$"):
        check_pair(smollm2, toy)
    with pytest.raises(PairError, match=r"teacher encodes '\\t' \(U\+0009\).* to <unk>"):
        check_pair(bpe(CHARACTERS + "\t", []), toy)


def test_check_pair_byte_level_student_needs_byte_level_teacher(smollm2):
    chars = sorted({c for b in vocab_of(smollm2).token_bytes if b for c in b.decode("utf-8", errors="ignore")})
    with pytest.raises(PairError, match="^student is byte-level .* but the teacher is not$"):
        check_pair(smollm2, bpe("".join(chars), []))


def test_check_pair_template_without_generation_marker(toy):
    no_marker = build_toy_tokenizer()
    no_marker.chat_template = TOY_CHAT_TEMPLATE.replace("{% if add_generation_prompt %}{{ '<|assistant|>' }}"
                                                        "{% endif %}", "")
    with pytest.raises(PairError, match="^teacher chat template has no generation marker"):
        check_pair(toy, no_marker)
    with pytest.raises(PairError, match="^student chat template has no generation marker"):
        check_pair(no_marker, toy)
    no_template = build_toy_tokenizer()
    no_template.chat_template = None
    with pytest.raises(PairError, match="^teacher tokenizer has no chat template$"):
        check_pair(toy, no_template)


def test_check_pair_unsupported_decoder(toy):
    from tokenizers import decoders, pre_tokenizers

    meta = bpe(CHARACTERS + "▁", [])
    meta.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    meta.backend_tokenizer.decoder = decoders.Metaspace()
    with pytest.raises(PairError, match=r"^teacher tokenizer's token strings do not concatenate .*\(decoder "
                                        r"Metaspace is not supported\)$"):
        check_pair(toy, meta)


# ---- run-time failures: a reason, never a silent drop ----

def test_runtime_failures_return_a_reason(toy, smollm2):
    sm_pair = check_pair(smollm2, smollm2)
    emoji = encode_text(smollm2, " 😀")
    assert align_response(sm_pair, MSGS, emoji[:1] + [smollm2.eos_token_id]) == Misaligned(
        "student response is not valid UTF-8 (unexpected end of data at byte 1 of 4)")
    assert align_response(sm_pair, MSGS, [smollm2.eos_token_id, 88]) == Misaligned(
        "student token 0 is the EOS before the end (only a final EOS may be special)")
    assert align_response(sm_pair, MSGS, [88, 1, 88]) == Misaligned(
        "student token 1 is the special token '<|im_start|>' (only a final EOS may be special)")
    assert align_response(sm_pair, MSGS, [88, 10**6]).reason.startswith("student token 1 is id 1000000, outside")
    # the student spells the teacher's special string character by character
    assert align_response(check_pair(toy, smollm2), MSGS, _ids(toy, "ok<|im_end|>")) == Misaligned(
        "response text contains the teacher's special token '<|im_end|>' at character 2")
    # an unchecked pair: the toy teacher has no 'é'
    unchecked = Pair(smollm2, toy, vocab_of(smollm2), vocab_of(toy), (toy.eos_token_id,))
    assert align_response(unchecked, MSGS, _ids(smollm2, "café")) == Misaligned(
        "teacher maps 'é' (U+00E9) at character 3 to <unk>")


def test_runtime_failure_of_a_template_that_alters_the_response(toy):
    trimming = build_toy_tokenizer()
    trimming.chat_template = TOY_CHAT_TEMPLATE.replace("message['content']", "(message['content'] | trim)")
    pair = check_pair(toy, trimming)  # the probe response has nothing to trim
    assert isinstance(align_response(pair, MSGS, _ids(toy, "12")), Alignment)
    assert align_response(pair, MSGS, _ids(toy, " 12 ")) == Misaligned(
        "teacher chat template does not render the response verbatim after the generation prompt")


# ---- random texts against a brute-force aligner ----

def _decoded_cuts(tok, ids) -> list[int]:
    """Byte offset after each token, from the tokenizer's own decode of prefixes (texts here are ASCII)."""
    return [len(tok.decode(ids[: k + 1]).encode()) for k in range(len(ids))]


def _run(cuts: list[int], a: int, b: int) -> list[int] | None:
    """The token range whose bytes are exactly [a, b), if one exists."""
    starts = [0, *cuts[:-1]]
    return [starts.index(a), cuts.index(b) + 1] if a in starts and b in cuts else None


def _brute_force(text: str, s_tok, s_ids, t_tok, t_ids):
    """Enumerate every set of cut points; keep the partitions whose every piece is exactly a contiguous run of
    whole tokens on both sides (checked by decoding the runs); return the finest."""
    L = len(text.encode())
    s_cuts, t_cuts = _decoded_cuts(s_tok, s_ids), _decoded_cuts(t_tok, t_ids)
    best = None
    for r in range(L):
        for inner in itertools.combinations(range(1, L), r):
            cuts, spans = (0, *inner, L), []
            for a, b in zip(cuts, cuts[1:]):
                si, ti = _run(s_cuts, a, b), _run(t_cuts, a, b)
                if si is None or ti is None or s_tok.decode(s_ids[si[0]:si[1]]) != text[a:b] \
                        or t_tok.decode(t_ids[ti[0]:ti[1]]) != text[a:b]:
                    break
                spans.append((si, ti, [a, b]))
            else:
                best = spans  # later r = more cuts = finer
    return [list(x) for x in zip(*best)] if best else [[], [], []]


ALPHABET = "ab 12\n.X!"
texts = st.text(alphabet=ALPHABET, min_size=1, max_size=9)


def _check_random(pair, s_ids, text):
    a = align_response(pair, MSGS, s_ids)
    assert isinstance(a, Alignment), a
    assert a.text == text
    want = _brute_force(text, pair.student_tok, s_ids, pair.teacher_tok, a.teacher_ids_Nt.tolist())
    assert list(_spans(a)) == want


@pytest.fixture(scope="module")
def toy_smollm2(toy, smollm2):
    return check_pair(toy, smollm2)


@pytest.fixture(scope="module")
def smollm2_toy_unchecked(toy, smollm2):
    """SmolLM2 student, toy teacher: check_pair refuses it (SmolLM2 emits non-ASCII); fine for ASCII texts."""
    return Pair(smollm2, toy, vocab_of(smollm2), vocab_of(toy), (toy.eos_token_id,))


@SETTINGS
@given(text=texts)
def test_random_texts_toy_student_smollm2_teacher(text, toy, toy_smollm2):
    _check_random(toy_smollm2, _ids(toy, text, eos=False), text)


@SETTINGS
@given(text=texts, seed=st.integers(0, 2**16))
def test_random_texts_non_canonical_smollm2_student(text, seed, smollm2, smollm2_toy_unchecked):
    """The student's ids: the text cut at random points, each piece tokenized on its own (a valid non-canonical
    tokenization); the teacher: the toy tokenizer."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
    s_ids = [i for p in pieces for i in encode_text(smollm2, p)]
    _check_random(smollm2_toy_unchecked, s_ids, text)


@SETTINGS
@given(text=st.text(alphabet="123 ab", min_size=1, max_size=9))
def test_random_texts_made_up_pair(text):
    pair = _made_up_pair()
    _check_random(pair, _ids(pair.student_tok, text, eos=False), text)


_MADE_UP: list[Pair] = []


def _made_up_pair() -> Pair:
    if not _MADE_UP:
        _MADE_UP.append(check_pair(bpe(CHARACTERS, [("2", "3"), ("a", "b"), (" ", "a"), ("1", "23")]),
                                   bpe(CHARACTERS, [("1", "2"), ("b", " "), ("3", " "), ("12", "3 ")])))
    return _MADE_UP[0]


def test_common_spans_against_brute_force_on_random_lengths():
    rng = np.random.default_rng(0)
    for _ in range(200):
        L = int(rng.integers(1, 10))
        s_cuts = np.sort(rng.choice(np.arange(1, L), rng.integers(0, L), replace=False)) if L > 1 else []
        t_cuts = np.sort(rng.choice(np.arange(1, L), rng.integers(0, L), replace=False)) if L > 1 else []
        s_len, t_len = np.diff([0, *s_cuts, L]), np.diff([0, *t_cuts, L])
        common = sorted(set(s_cuts) & set(t_cuts))
        bounds = [0, *common, L]
        _, _, b = common_spans(s_len, t_len)
        assert b.tolist() == [[x, y] for x, y in zip(bounds, bounds[1:])]
    with pytest.raises(ValueError, match="equal totals"):
        common_spans(np.array([1, 2]), np.array([2]))
