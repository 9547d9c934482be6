"""The counting task: its problems, worked solutions and step checker."""

import re

import numpy as np
import pytest

from jopd.config_dataclass import ConfigError, build
from jopd.data import counting_steps, is_correct
from jopd.data.arithmetic_steps import ERROR_KINDS
from jopd.data.counting import ANIMALS, OBJECTS, CountingConfig, CountingTrain, heldout_problems, worked_solution


def _things(question):
    m = re.fullmatch(r"How many animals: ([a-z, ]+)\?", question)
    return tuple(m.group(1).split(", "))


def test_problems_are_well_formed_and_graded_by_the_numeric_check():
    cfg = CountingConfig(heldout_size=200)
    for p in heldout_problems(cfg) + CountingTrain(cfg)[:200]:
        things = _things(p.question)
        assert cfg.min_items <= len(things) <= cfg.max_items and len(set(things)) == len(things)
        animals = [t for t in things if t in ANIMALS]  # counted independently of the generator
        assert p.answer == str(len(animals)) and is_correct(p.solution, p.answer)
        assert re.findall(r"[a-z]+", p.solution) == animals
        assert counting_steps.check_response(p.solution, p.solution).error is None
        assert counting_steps.local_violations(p.solution, p.solution) == 0
        assert counting_steps.num_steps(p.solution) == len(animals)


def test_heldout_is_distinct_deterministic_and_disjoint_from_train():
    cfg = CountingConfig(heldout_size=300)
    held = heldout_problems(cfg)
    lists = {_things(p.question) for p in held}
    assert len(lists) == 300
    assert held == heldout_problems(CountingConfig(heldout_size=300))
    train = CountingTrain(cfg)
    assert all(_things(p.question) not in lists for p in train[:3000])
    assert train[17] == CountingTrain(cfg)[17] and train[17] != CountingTrain(CountingConfig(seed=1))[17]
    answers = np.asarray([int(p.answer) for p in held])
    assert len(set(answers)) >= 4 and np.mean(answers == np.bincount(answers).argmax()) < 0.5  # no strong guess
    assert not set(ANIMALS) & set(OBJECTS)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"min_items=5 > max_items=4"):
        build(CountingConfig, {"min_items": 5, "max_items": 4})
    with pytest.raises(ValueError, match=r"only \d+ distinct problems .* heldout_size=530"):
        heldout_problems(CountingConfig(min_items=1, max_items=1))


def test_worked_solution_and_its_parse():
    assert worked_solution(("fig", "cat", "pen", "dog")) == "cat1 dog2 #### 2"
    assert worked_solution(("fig", "pen")) == "#### 0"
    assert counting_steps.parse_solution("cat1 dog2 #### 2") == ("cat", "dog")
    with pytest.raises(ValueError, match="running counts"):
        counting_steps.parse_solution("cat1 dog3 #### 3")


# (response, kind, step, first wrong char, local violations) against "cat1 dog2 #### 2"
CASES = [
    ("cat1 dog2 #### 3", "final_answer", 2, 15, 1),
    ("cat1 dog3 #### 3", "arithmetic", 1, 8, 1),  # a count off by one, carried consistently
    ("cat1 #### 1", "missing_step", 1, 5, 1),
    ("cat1 dog2 pen3 #### 3", "extra_step", 2, 10, 1),
    ("cat1 pen2 #### 2", "operand", 1, 5, 1),  # an object counted in place of the next animal
    ("cat1 dot2 #### 2", "operand", 1, 7, 1),  # the first wrong character is the t
    ("cat1 do", "truncated", 1, 7, None),
    ("cat1 dog2 ####", "truncated", 2, 14, None),
    ("cat1 dog #### 1", "malformed", 1, 8, 1),  # no count after the name (the total follows what it wrote)
]


@pytest.mark.parametrize("response,kind,step,char,violations", CASES)
def test_first_error_and_local_violations(response, kind, step, char, violations):
    check = counting_steps.check_response(response, "cat1 dog2 #### 2")
    assert check.error is not None and check.error.kind in ERROR_KINDS
    assert (check.error.kind, check.error.step, check.error.char) == (kind, step, char)
    assert counting_steps.local_violations(response, "cat1 dog2 #### 2") == violations


def test_first_error_is_where_a_mutated_solution_first_departs():
    """Replacing one letter of a correct solution: the first error is exactly there."""
    rng = np.random.default_rng(0)
    for p in [p for p in heldout_problems(CountingConfig()) if p.answer != "0"][:100]:
        body = p.solution.split(" ####")[0]
        i = int(rng.choice([i for i, ch in enumerate(body) if ch.isalpha()]))
        mutated = body[:i] + ("q" if body[i] != "q" else "z") + body[i + 1:] + p.solution[len(body):]
        err = counting_steps.check_response(mutated, p.solution).error
        assert err is not None and err.kind == "operand" and err.char == i, (mutated, p.solution, err)
