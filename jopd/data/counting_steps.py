"""Per-step checking of the counting task's worked solutions (`jopd.data.counting`): where does a response first
go wrong? Same contract as `arithmetic_steps` (a `StepCheck` with the first error), so the teacher-reliability
probe cuts counting responses at their first error too.

Step i of `cat1 dog2 #### 2` is the i-th animal with its running count; then the final-answer part. Error kinds,
in the shared vocabulary (`arithmetic_steps.ERROR_KINDS`): `operand` a name that is not the next animal (an
object, a skipped or made-up animal), `arithmetic` a wrong running count, `missing_step` `####` while an animal
is still due, `extra_step` another name after the last animal, `truncated`, `malformed` (no count after a name,
or no `####`), `final_answer`.
"""

from __future__ import annotations

import re

from jopd.data.arithmetic_steps import FirstError, StepCheck, StepScanner

_STEP = re.compile(r"([a-z]+)(\d+)")
_SOLUTION = re.compile(r"^((?:[a-z]+\d+ )*)#### (\d+)$")
_CHAIN = re.compile(r"\s*((?:[a-z]+\d*\s*)*)####\s*(\d+)")
_NAME = re.compile(r"[a-z]+")


def parse_solution(solution: str) -> tuple[str, ...]:
    """The animals of a reference worked solution, in order (their counts checked)."""
    m = _SOLUTION.match(solution)
    if m is None:
        raise ValueError(f"solution {solution!r}: not a counting worked solution ('cat1 dog2 #### 2')")
    steps = _STEP.findall(m.group(1))
    if [int(n) for _, n in steps] != list(range(1, len(steps) + 1)) or int(m.group(2)) != len(steps):
        raise ValueError(f"solution {solution!r}: the running counts are not 1, 2, ... up to the answer")
    return tuple(name for name, _ in steps)


class _CountScanner(StepScanner):
    def __init__(self, text: str, animals: tuple[str, ...]):
        super().__init__(text, None)
        self.animals = animals

    def animal(self, i: int, name: str) -> FirstError | None:
        self.starts.append(self.pos)
        self.skip_space()
        if self.text.startswith("####", self.pos):
            return self.error("missing_step", i, (self.pos, self.pos + 4), self.pos, f"{name}{i + 1}")
        m = _NAME.match(self.text, self.pos)
        if m is None or m.group() != name:
            end = m.end() if m else min(self.pos + 1, len(self.text))
            agree = self.pos
            while agree < end and agree - self.pos < len(name) and self.text[agree] == name[agree - self.pos]:
                agree += 1
            return self.error("operand", i, (self.pos, end), agree, name)
        self.pos = m.end()
        return self.number(i, i + 1, "", "arithmetic")

    def final(self, i: int) -> FirstError | None:
        self.starts.append(self.pos)
        self.skip_space()
        m = _NAME.match(self.text, self.pos)
        if m:
            return self.error("extra_step", i, m.span(), self.pos, "####")
        err = self.literal(i, "####")
        if err:
            return err
        self.skip_space()
        return self.number(i, len(self.animals), "", "final_answer")

    def run(self) -> StepCheck:
        err = None
        for i, name in enumerate(self.animals):
            err = self.animal(i, name)
            if err:
                break
        else:
            err = self.final(len(self.animals))
        return StepCheck(tuple(self.starts), err)


def check_response(response: str, solution: str) -> StepCheck:
    """Check `response` step by step against the problem whose reference worked solution is `solution`."""
    return _CountScanner(response, parse_solution(solution)).run()


def local_violations(response: str, solution: str) -> int | None:
    """Places of a complete response that are locally wrong, each judged against what the response wrote before
    it: a name that is not the next animal (by position; a length difference counts each missing or extra one), a
    count that is not the previous written count + 1 (or a missing one), a final answer that is not the last
    written count. 1 = one error carried consistently to the end. None: not a complete response."""
    m = _CHAIN.match(response)
    if m is None:
        return None
    animals = parse_solution(solution)
    written = re.findall(r"([a-z]+)(\d*)", m.group(1))
    bad = abs(len(written) - len(animals)) + sum(w != a for (w, _), a in zip(written, animals))
    last = 0
    for _, n in written:
        bad += n == "" or int(n) != last + 1
        last = int(n) if n else last
    return bad + (int(m.group(2)) != last)


def num_steps(solution: str) -> int:
    return len(parse_solution(solution))
