"""Per-step checking of the counting task's worked solutions (`jopd.data.counting`): where does a response first
go wrong? Same contract as `arithmetic_steps` (a `StepCheck` with the first error), so the teacher-reliability
probe cuts counting responses at their first error too.

Step i of `ba1ca2da3 #### 3` is the word's i-th character, followed by the running count when it is the counted
letter; then the final-answer part. Error kinds, in the shared vocabulary (`arithmetic_steps.ERROR_KINDS`):
`operand` a character that is not the word's next one (a copy error), `arithmetic` a wrong running count,
`missing_step` `####` before the word is copied, `extra_step` more characters after it, `truncated`,
`malformed` (a count missing after the letter, or no `####`), `final_answer`.
"""

from __future__ import annotations

import re

from jopd.data.arithmetic_steps import FirstError, StepCheck, StepScanner

_SOLUTION = re.compile(r"^([a-z0-9]*) #### (\d+)$")
_CHAIN = re.compile(r"\s*((?:[a-z]\d*)+)\s*####\s*(\d+)")
_LETTER_COUNT = re.compile(r"([a-z])(\d*)")
_EXTRA = re.compile(r"[a-z0-9]+")


def parse_solution(solution: str) -> tuple[str, str, int]:
    """(letter, word, count) of a reference worked solution; the letter is the one the counts follow."""
    m = _SOLUTION.match(solution)
    if m is None:
        raise ValueError(f"solution {solution!r}: not a counting worked solution ('ba1ca2 #### 2')")
    pairs = _LETTER_COUNT.findall(m.group(1))
    counted = {ch for ch, n in pairs if n}
    word = "".join(ch for ch, _ in pairs)
    count = int(m.group(2))
    if len(counted) > 1 or [int(n) for _, n in pairs if n] != list(range(1, count + 1)):
        raise ValueError(f"solution {solution!r}: the running counts are not 1, 2, ... up to the answer")
    letter = counted.pop() if counted else ""  # a count of 0: no letter in the word is counted
    return letter, word, count


class _CountScanner(StepScanner):
    def __init__(self, text: str, letter: str, word: str, count: int):
        super().__init__(text, None)
        self.letter, self.word, self.count = letter, word, count

    def char_step(self, i: int, ch: str, seen: int) -> FirstError | None:
        self.starts.append(self.pos)
        rest = self.text[self.pos:]
        if rest.lstrip().startswith("####"):
            return self.error("missing_step", i, (self.pos, self.pos + len(rest) - len(rest.lstrip()) + 4), self.pos,
                              ch)
        if self.pos >= len(self.text) or self.text[self.pos] != ch:
            return self.error("operand", i, (self.pos, min(self.pos + 1, len(self.text))), self.pos, ch)
        self.pos += 1
        if ch == self.letter:
            return self.number(i, seen + 1, "", "arithmetic")
        return None

    def final(self, i: int) -> FirstError | None:
        self.starts.append(self.pos)
        self.skip_space()
        m = _EXTRA.match(self.text, self.pos)
        if m:
            return self.error("extra_step", i, m.span(), self.pos, "####")
        err = self.literal(i, "####")
        if err:
            return err
        self.skip_space()
        return self.number(i, self.count, "", "final_answer")

    def run(self) -> StepCheck:
        seen, err = 0, None
        for i, ch in enumerate(self.word):
            err = self.char_step(i, ch, seen)
            if err:
                break
            seen += ch == self.letter
        else:
            err = self.final(len(self.word))
        return StepCheck(tuple(self.starts), err)


def check_response(response: str, solution: str) -> StepCheck:
    """Check `response` step by step against the problem whose reference worked solution is `solution`."""
    return _CountScanner(response, *parse_solution(solution)).run()


def local_violations(response: str, solution: str) -> int | None:
    """Places of a complete response that are locally wrong, each judged against what the response wrote before
    it: a character that is not the word's (by position; a length difference counts each missing or extra
    character), a count after the letter that is not the previous written count + 1 (or a missing one), a count
    after another letter, a final answer that is not the last written count. None: not a complete response."""
    m = _CHAIN.match(response)
    if m is None:
        return None
    letter, word, _ = parse_solution(solution)
    pairs = _LETTER_COUNT.findall(m.group(1))
    bad = abs(len(pairs) - len(word)) + sum(ch != w for (ch, _), w in zip(pairs, word))
    last = 0
    for ch, n in pairs:
        if ch == letter:
            bad += n == "" or int(n) != last + 1
            last = int(n) if n else last
        else:
            bad += n != ""
    return bad + (int(m.group(2)) != last)


def num_steps(solution: str) -> int:
    return len(parse_solution(solution)[1])
