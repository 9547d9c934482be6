"""The counting task: its problems, worked solutions and step checker."""

import re

import numpy as np
import pytest

from jopd.config_dataclass import ConfigError, build
from jopd.data import counting, counting_steps, is_correct
from jopd.data.arithmetic_steps import ERROR_KINDS
from jopd.data.counting import CountingConfig, CountingTrain, heldout_problems, worked_solution


def _letter_word(question):
    m = re.fullmatch(r"How many ([a-z]) in ([a-z]+)\?", question)
    return m.group(1), m.group(2)


def test_problems_are_well_formed_and_graded_by_the_numeric_check():
    cfg = CountingConfig(heldout_size=200)
    for p in heldout_problems(cfg)[:200] + CountingTrain(cfg)[:200]:
        letter, word = _letter_word(p.question)
        assert cfg.min_length <= len(word) <= cfg.max_length and set(word) <= set(cfg.letters)
        assert p.answer == str(word.count(letter))  # counted independently of the generator
        assert is_correct(p.solution, p.answer)
        copied = re.sub(r"\d", "", p.solution.split(" ####")[0])
        assert copied == word
        assert counting_steps.check_response(p.solution, p.solution).error is None
        assert counting_steps.local_violations(p.solution, p.solution) == 0
        assert counting_steps.num_steps(p.solution) == len(word)


def test_heldout_is_distinct_deterministic_and_disjoint_from_train():
    cfg = CountingConfig(heldout_size=300)
    held = heldout_problems(cfg)
    pairs = {_letter_word(p.question) for p in held}
    assert len(pairs) == 300
    assert held == heldout_problems(CountingConfig(heldout_size=300))
    train = CountingTrain(cfg)
    assert all(_letter_word(p.question) not in pairs for p in train[:3000])
    assert train[17] == CountingTrain(cfg)[17] and train[17] != CountingTrain(CountingConfig(seed=1))[17]
    # the letter mostly occurs in the word: "0" is not a strong guess
    assert np.mean([p.answer == "0" for p in held]) < 0.15


def test_config_errors():
    with pytest.raises(ConfigError, match=r"min_length=5 > max_length=4"):
        build(CountingConfig, {"min_length": 5, "max_length": 4})
    with pytest.raises(ConfigError, match=r"letters='aA'"):
        build(CountingConfig, {"letters": "aA"})
    with pytest.raises(ValueError, match=r"only \d+ distinct problems .* heldout_size=530"):
        heldout_problems(CountingConfig(letters="ab", min_length=1, max_length=2))


def test_worked_solution_and_its_parse():
    assert worked_solution("a", "bacada") == "ba1ca2da3 #### 3"
    assert worked_solution("z", "bcd") == "bcd #### 0"
    assert counting_steps.parse_solution("ba1ca2da3 #### 3") == ("a", "bacada", 3)
    with pytest.raises(ValueError, match="running counts"):
        counting_steps.parse_solution("ba1ca3 #### 3")


# (response, kind, step, first wrong char, local violations) against "f1f2dbebf3 #### 3"
CASES = [
    ("f1f2dbebf3 #### 4", "final_answer", 7, 16, 1),
    ("f1f3dbebf4 #### 4", "arithmetic", 1, 3, 1),  # a count off by one, carried consistently
    ("f1f2dbeb #### 2", "missing_step", 6, 8, 1),
    ("f1f2dbebf3x #### 3", "extra_step", 7, 10, 1),
    ("f1f2dxebf3 #### 3", "operand", 3, 5, 1),
    ("f1f2", "truncated", 2, 4, None),
    ("f1f2dbebf3 ####", "truncated", 7, 15, None),
    ("f1f2d1bebf3 #### 3", "operand", 3, 5, 1),  # a count after another letter
    ("f1f2dbebf #### 2", "malformed", 6, 9, 1),  # no count after the letter
]


@pytest.mark.parametrize("response,kind,step,char,violations", CASES)
def test_first_error_and_local_violations(response, kind, step, char, violations):
    check = counting_steps.check_response(response, "f1f2dbebf3 #### 3")
    assert check.error is not None and check.error.kind in ERROR_KINDS
    assert (check.error.kind, check.error.step, check.error.char) == (kind, step, char)
    assert counting_steps.local_violations(response, "f1f2dbebf3 #### 3") == violations


def test_first_error_is_where_a_mutated_solution_first_departs():
    """Replacing one character of a correct solution by another letter: the first error is exactly there."""
    rng = np.random.default_rng(0)
    for p in heldout_problems(CountingConfig())[:100]:
        body = p.solution.split(" ####")[0]
        letters = [i for i, ch in enumerate(body) if ch.isalpha()]
        i = int(rng.choice(letters))
        new = "x" if body[i] != "x" else "y"
        mutated = body[:i] + new + body[i + 1:] + p.solution[len(body):]
        err = counting_steps.check_response(mutated, p.solution).error
        assert err is not None and err.char == i, (mutated, p.solution, err)
