"""The per-step checker of the arithmetic task: it finds the planted first error (kind, step, character span,
first wrong character) and maps it to the response token that produced it, for the toy tokenizer, a tokenizer
with multi-character tokens and SmolLM2's BPE."""

import pytest

from jopd.data.arithmetic import ArithmeticConfig, heldout_problems
from jopd.data.arithmetic_steps import (check_response, fraction_cuts, local_violations, locate_first_error,
                                        parse_reference, prefix_char_lengths, token_at_char)
from jopd.data.chat import prompt_response_ids
from jopd.data.toy_tokenizer import build_toy_tokenizer

SOLUTION = "3*4=12. 12+5=17. 17-6=11. #### 11"
QUESTION = "Bo has 3 bags of 4 figs, gets 5, loses 6. How many?"


def _at(text: str, needle: str, plus: int = 0) -> int:
    return text.index(needle) + plus


# (response, kind, step, span of the erroneous element, first wrong char); every error planted on purpose
CASES = {
    "arithmetic": ("3*4=12. 12+5=18. 18-6=12. #### 12", "arithmetic", 1, (13, 15), 14),
    "arithmetic_short": ("3*4=1. 1+5=6. 6-6=0. #### 0", "arithmetic", 0, (4, 5), 5),  # the '.' ends it early
    "carry": ("3*4=12. 13+5=18. 18-6=12. #### 12", "carry", 1, (8, 10), 9),
    "carry_last": ("3*4=12. 12+5=17. 7-6=1. #### 1", "carry", 2, (17, 18), 17),
    "start": ("4*4=16. 16+5=21. 21-6=15. #### 15", "operand", 0, (0, 1), 0),
    "operator": ("3*4=12. 12-5=7. 7-6=1. #### 1", "operand", 1, (10, 11), 10),
    "operand": ("3*4=12. 12+6=18. 18-6=12. #### 12", "operand", 1, (11, 12), 11),
    "truncated_mid_step": ("3*4=12. 12+5=", "truncated", 1, (13, 13), 13),
    "truncated_mid_number": ("3*4=12. 12+5=1", "truncated", 1, (13, 14), 14),
    "truncated_no_answer": ("3*4=12. 12+5=17. 17-6=11.", "truncated", 3, (25, 25), 25),
    "missing_step": ("3*4=12. 12+5=17. #### 17", "missing_step", 2, (17, 21), 17),
    "extra_step": ("3*4=12. 12+5=17. 17-6=11. 11+1=12. #### 12", "extra_step", 3, (26, 34), 26),
    "malformed": ("3*4=12. 12+5=17, 17-6=11. #### 11", "malformed", 1, (15, 16), 15),
    "final_answer": ("3*4=12. 12+5=17. 17-6=11. #### 12", "final_answer", 3, (31, 33), 32),
}


def test_reference_parse_and_correct_responses_have_no_error():
    ref = parse_reference(SOLUTION)
    assert [(s.a, s.op, s.b, s.c) for s in ref.steps] == [(3, "*", 4, 12), (12, "+", 5, 17), (17, "-", 6, 11)]
    assert ref.answer == 11
    assert locate_first_error(SOLUTION, SOLUTION) is None
    assert locate_first_error("3*4=12.12+5=17.  17-6=11.####11", SOLUTION) is None  # spacing is not checked
    assert locate_first_error(SOLUTION + " and more", SOLUTION) is None  # graded by the first ####
    for p in heldout_problems(ArithmeticConfig(max_steps=4))[:200]:  # every generated solution checks clean
        assert locate_first_error(p.solution, p.solution) is None
    with pytest.raises(ValueError, match="not an arithmetic worked solution"):
        parse_reference("The answer is 5. #### 5")
    with pytest.raises(ValueError, match="step 2"):
        parse_reference("3*4=12. 13+5=18. #### 18")


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_error_kind_span_and_char(name):
    response, kind, step, span, char = CASES[name]
    err = locate_first_error(response, SOLUTION)
    assert err is not None, name
    assert (err.kind, err.step, err.span, err.char) == (kind, step, span, char), err
    assert err.got == response[span[0]:span[1]]
    # the first wrong char is where the response leaves the correct solution (same layout in every case)
    agree = 0
    while agree < min(len(response), len(SOLUTION)) and response[agree] == SOLUTION[agree]:
        agree += 1
    assert err.char == agree, (name, err.char, agree)


def test_offsets_map_a_cut_between_responses():
    err = locate_first_error(CASES["carry"][0], SOLUTION)
    ref = check_response(SOLUTION, SOLUTION)
    assert ref.error is None and ref.segment_starts == (0, 7, 16, 25)
    assert ref.char_of(err.step, err.offset, len(SOLUTION)) == err.char  # the same place in the reference
    short = check_response("3*4=12. #### 12", SOLUTION)
    assert short.char_of(err.step, err.offset, 15) == 9 and short.char_of(3, 0, 15) == 15  # clipped to the text


@pytest.mark.parametrize("name", ["arithmetic", "carry", "operand", "truncated_mid_step", "missing_step",
                                  "final_answer"])
def test_toy_tokenizer_token_index(name):
    tok = build_toy_tokenizer()
    response, _, _, _, char = CASES[name]
    _, ids = prompt_response_ids(tok, QUESTION, response)
    assert ids[-1] == tok.eos_token_id and len(ids) == len(response) + 1  # one token per character + <|end|>
    err = locate_first_error(tok.decode(ids, skip_special_tokens=True), SOLUTION)
    t = token_at_char(prefix_char_lengths(tok, ids), err.char)
    assert t == char  # character level: token index == character index; the stop token when it ends early
    if err.kind == "truncated":
        assert ids[t] == tok.eos_token_id
    else:
        assert tok.decode(ids[:t + 1]) == response[:char + 1]


class _ChunkTokenizer:
    """Multi-character tokens (as BPE merges digits, ' ####', ...): id i decodes to PIECES[i]; id 0 is special."""

    PIECES = ["<end>", "3*", "4=", "12.", " 12", "+5=", "18", ".", " ####", " 18"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


def test_multi_character_tokens():
    tok = _ChunkTokenizer()
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == CASES["arithmetic"][0].replace(" 18-6=12. #### 12", " #### 18")
    lengths = prefix_char_lengths(tok, ids)
    err = locate_first_error(text, "3*4=12. 12+5=17. #### 17")
    assert (err.kind, err.char) == ("arithmetic", 14)
    assert token_at_char(lengths, err.char) == 5  # "18": the token holding the wrong digit
    assert token_at_char(lengths, 0) == 0
    assert token_at_char(lengths, 17) == 7  # inside " ####"
    assert token_at_char(lengths, len(text)) == 9  # past the text: the stop token
    assert token_at_char(lengths[:-1], len(text)) is None  # ... or none when the response has no stop token
    assert token_at_char([0], 0) == 0  # an empty response: its stop token


def test_local_violations_count_errors_carried_consistently():
    assert local_violations(SOLUTION, SOLUTION) == 0
    carried = {"arithmetic": "3*4=13. 13+5=18. 18-6=12. #### 12", "start": "4*4=16. 16+5=21. 21-6=15. #### 15",
               "operand": "3*4=12. 12+6=18. 18-6=12. #### 12", "missing": "3*4=12. 12+5=17. #### 17",
               "final": "3*4=12. 12+5=17. 17-6=11. #### 12", "extra": "3*4=12. 12+5=17. 17-6=11. 11+1=12. #### 12"}
    for name, text in carried.items():  # one error, every later step right given what was written
        assert local_violations(text, SOLUTION) == 1, name
    assert local_violations("3*4=13. 12+5=17. 17-6=11. #### 11", SOLUTION) == 2  # the error, then a correction
    assert local_violations("3*4=12. 12+5=18. 18-6=11. #### 11", SOLUTION) == 2  # 18-6=11 is wrong too
    assert local_violations("3*4=12. 12+5=", SOLUTION) is None  # not a complete chain


def test_fraction_cuts():
    assert fraction_cuts(8, (0.25, 0.5, 0.75)) == [2, 4, 6]
    assert fraction_cuts(10, (0.25, 0.5, 0.75, 1.0)) == [3, 5, 8, 10]
    assert fraction_cuts(1, (0.25,)) == [1]  # at least one token
    with pytest.raises(ValueError, match="fractions"):
        fraction_cuts(4, (0.0,))


@pytest.mark.slow
def test_smollm2_bpe_token_index():
    """SmolLM2's BPE: ' ####' is one token, so a missing step's first wrong character sits inside it."""
    from jopd.models import io

    try:
        gguf = io.smollm2_gguf_path()
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    tok = io.load_tokenizer(gguf)  # transformers' conversion (tests/data/test_data_tasks.py), cached
    for name in ("arithmetic", "missing_step", "final_answer", "truncated_mid_step"):
        response, kind, _, _, char = CASES[name]
        _, ids = prompt_response_ids(tok, QUESTION, response)
        err = locate_first_error(tok.decode(ids, skip_special_tokens=True), SOLUTION)
        assert (err.kind, err.char) == (kind, char)
        t = token_at_char(prefix_char_lengths(tok, ids), err.char)
        before, through = tok.decode(ids[:t], skip_special_tokens=True), tok.decode(ids[:t + 1],
                                                                                   skip_special_tokens=True)
        if kind == "truncated":
            assert ids[t] == tok.eos_token_id
        else:
            assert len(before) <= char < len(through)  # token t produced the first wrong character
