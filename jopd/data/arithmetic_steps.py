"""Per-step checking of the arithmetic task's worked solutions: where does a response first go wrong?

A worked solution is a chain of steps `a op b = c.` separated by spaces, then ` #### answer`
(`3*4=12. 12+5=17. 17-6=11. #### 11`, see `jopd.data.arithmetic`). The problem's own reference solution gives
its operations: step i applies the problem's i-th (op, b) to the carried value, and the first step starts from
the problem's first number. A response is checked against that, step by step, left to right:

- `operand`: step i's operator or right operand is not the problem's i-th (or step 0 does not start from the
  problem's first number);
- `carry`: step i > 0 does not start from the previous step's (correct) result;
- `arithmetic`: the step's result is not `a op b`;
- `missing_step`: `####` where a step is still due; `extra_step`: another step after the last one;
- `truncated`: the text stops before the solution is complete (mid-step, or without a final answer);
- `malformed`: any other character where the grammar wants a number, an operator, `=`, `.` or `####`;
- `final_answer`: every step right, the number after `####` wrong.

Whitespace between steps and around `####` is not checked; inside a step no whitespace is allowed. Text after
a correct final answer is ignored (the task's grading reads the first `####` only).

The first error has a character span (the erroneous element: a number, an operator, a step, the marker) and
one *first wrong character*: where the response stops agreeing with what a correct response has at that point,
e.g. the `3` of `3*4=13.` (the `1` is still right), the `.` of `3*4=1.`, or len(response) when it ends early.
`token_at_char` maps a character to the response token that produced it by decoding token prefixes, so the same
code serves the character-level toy tokenizer and BPE ones; `fraction_cuts` is the fallback for tasks whose
steps cannot be checked (JSONL math): cut a response at fixed fractions of its tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
import re
from collections.abc import Sequence
from typing import Literal

ErrorKind = Literal["operand", "carry", "arithmetic", "missing_step", "extra_step", "truncated", "malformed",
                    "final_answer"]
ERROR_KINDS: tuple[str, ...] = ("operand", "carry", "arithmetic", "missing_step", "extra_step", "truncated",
                                "malformed", "final_answer")

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_NUM = re.compile(r"-?\d+")
_REF_STEP = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)\.")
_REF_FINAL = re.compile(r"####\s*(-?\d+)\s*$")
_WS = re.compile(r"\s*")


@dataclasses.dataclass(frozen=True)
class Step:
    """One worked step `a op b = c.`"""

    a: int
    op: str
    b: int
    c: int


@dataclasses.dataclass(frozen=True)
class Reference:
    """A problem's worked solution, parsed: its steps and final answer."""

    steps: tuple[Step, ...]
    answer: int


@dataclasses.dataclass(frozen=True)
class FirstError:
    """The first place a response departs from a correct worked solution."""

    kind: ErrorKind
    step: int  # 0-based step it lies in; == the number of steps for the final-answer part
    span: tuple[int, int]  # [start, end) chars of the erroneous element in the response
    char: int  # the first wrong character (len(response) when the response stops early)
    offset: int  # char - the start of its segment (the step, or the final-answer part, leading spaces included)
    expected: str  # what a correct response has at the span
    got: str  # what the response has there


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """A response checked step by step: the start of every segment reached (step 0, 1, ..., then the
    final-answer part; leading whitespace belongs to the segment) and the first error, if any."""

    segment_starts: tuple[int, ...]
    error: FirstError | None

    def char_of(self, step: int, offset: int, text_len: int) -> int:
        """The character at (segment `step`, `offset`) of this response, clipped to its length: where a cut made
        on another response at the same place lands here (len(text) when this response has no such segment)."""
        if step >= len(self.segment_starts):
            return text_len
        return min(self.segment_starts[step] + offset, text_len)


def parse_reference(solution: str) -> Reference:
    """The steps and answer of a reference worked solution (`jopd.data.arithmetic`'s format, checked)."""
    steps = tuple(Step(int(a), op, int(b), int(c)) for a, op, b, c in _REF_STEP.findall(solution))
    final = _REF_FINAL.search(solution)
    if not steps or final is None:
        raise ValueError(f"solution {solution!r}: not an arithmetic worked solution ('a op b=c. ... #### n')")
    value = steps[0].a
    for i, s in enumerate(steps):
        if s.a != value or _OPS[s.op](s.a, s.b) != s.c:
            raise ValueError(f"solution {solution!r}: step {i + 1} is not a correct carried step")
        value = s.c
    if int(final.group(1)) != value:
        raise ValueError(f"solution {solution!r}: final answer is not the last step's result")
    return Reference(steps, value)


def _agree(text: str, start: int, expected: str) -> int:
    """The first character at or after `start` where `text` stops matching `expected`."""
    n = 0
    while n < len(expected) and start + n < len(text) and text[start + n] == expected[n]:
        n += 1
    return start + n


class StepScanner:
    """A left-to-right scan of one response against its reference; `run` returns the StepCheck. Its element
    readers (`literal`, `number`, `error`, ...) serve other tasks' checkers too (`counting_steps`)."""

    def __init__(self, text: str, ref: Reference):
        self.text, self.ref = text, ref
        self.pos = 0
        self.starts: list[int] = []

    def error(self, kind: ErrorKind, step: int, span: tuple[int, int], char: int, expected: str) -> FirstError:
        if char >= len(self.text):
            kind, char = "truncated", len(self.text)  # it stops where it should go on
        return FirstError(kind, step, span, char, char - self.starts[step], expected,
                          self.text[span[0]:span[1]])

    def unexpected(self, step: int, expected: str) -> FirstError:
        p = self.pos
        return self.error("malformed", step, (p, min(p + 1, len(self.text))), p, expected)

    def literal(self, step: int, lit: str) -> FirstError | None:
        if self.text.startswith(lit, self.pos):
            self.pos += len(lit)
            return None
        return self.unexpected(step, lit)

    def number(self, step: int, want: int, then: str, kind: ErrorKind) -> FirstError | None:
        """A number that must equal `want` (the correct text goes on with `then`)."""
        m = _NUM.match(self.text, self.pos)
        if m is None:
            return self.unexpected(step, str(want))
        self.pos = m.end()
        if int(m.group()) == want:
            return None
        return self.error(kind, step, m.span(), _agree(self.text, m.start(), f"{want}{then}"), str(want))

    def skip_space(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()

    def step(self, i: int, value: int, want: Step) -> FirstError | None:
        self.starts.append(self.pos)
        self.skip_space()
        if self.text.startswith("####", self.pos):
            return self.error("missing_step", i, (self.pos, self.pos + 4), self.pos,
                              f"{value}{want.op}{want.b}={want.c}.")
        err = self.number(i, value, want.op, "operand" if i == 0 else "carry")
        if err:
            return err
        if self.pos < len(self.text) and self.text[self.pos] in _OPS and self.text[self.pos] != want.op:
            return self.error("operand", i, (self.pos, self.pos + 1), self.pos, want.op)
        return (self.literal(i, want.op) or self.number(i, want.b, "=", "operand") or self.literal(i, "=")
                or self.number(i, want.c, ".", "arithmetic") or self.literal(i, "."))

    def final(self, i: int) -> FirstError | None:
        self.starts.append(self.pos)
        self.skip_space()
        if _NUM.match(self.text, self.pos):
            m = _REF_STEP.match(self.text, self.pos)
            end = m.end() if m else _NUM.match(self.text, self.pos).end()
            return self.error("extra_step", i, (self.pos, end), self.pos, "####")
        err = self.literal(i, "####")
        if err:
            return err
        self.skip_space()
        return self.number(i, self.ref.answer, "", "final_answer")

    def run(self) -> StepCheck:
        value = self.ref.steps[0].a
        err = None
        for i, want in enumerate(self.ref.steps):
            err = self.step(i, value, want)
            if err:
                break
            value = want.c
        else:
            err = self.final(len(self.ref.steps))
        return StepCheck(tuple(self.starts), err)


def check_response(response: str, solution: str) -> StepCheck:
    """Check `response` step by step against the problem whose reference worked solution is `solution`."""
    return StepScanner(response, parse_reference(solution)).run()


def locate_first_error(response: str, solution: str) -> FirstError | None:
    """The first error of `response` (None: a correct worked solution with the right final answer)."""
    return check_response(response, solution).error


_CHAIN = re.compile(r"\s*(?:(?:-?\d+)[+\-*](?:-?\d+)=(?:-?\d+)\.\s*)+####\s*(-?\d+)")
_CHAIN_STEP = re.compile(r"(-?\d+)([+\-*])(-?\d+)=(-?\d+)\.")


def local_violations(response: str, solution: str) -> int | None:
    """How many places of a complete worked response are locally wrong, each step judged against what the
    response itself wrote before it: a left operand that is not the previous written result (step 0: the
    problem's first number), an operator / right operand that is not the problem's, a result that is not
    `a op b` of the written operands, a missing or extra step, a final answer that is not the last written
    result. 1 = a chain that carries one error consistently to its end. None: not a complete chain of steps."""
    m = _CHAIN.match(response)
    if m is None:
        return None
    ref = parse_reference(solution)
    steps = [(int(a), op, int(b), int(c)) for a, op, b, c in _CHAIN_STEP.findall(response[:m.start(1)])]
    bad = abs(len(steps) - len(ref.steps))
    value = ref.steps[0].a
    for (a, op, b, c), want in zip(steps, ref.steps):
        bad += (a != value) + (op != want.op or b != want.b) + (c != _OPS[op](a, b))
        value = c
    value = steps[-1][3]
    return bad + (int(m.group(1)) != value)


# ---------------------------------------------------------------------------------------------
# characters -> tokens


def prefix_char_lengths(tokenizer, response_ids: Sequence[int]) -> list[int]:
    """len(decode(ids[:t+1])) for every t (special tokens skipped): how many characters tokens 0..t produce.
    Decoding prefixes (not single tokens) keeps BPE merges and multi-byte characters right."""
    return [len(tokenizer.decode(list(response_ids[:t + 1]), skip_special_tokens=True))
            for t in range(len(response_ids))]


def token_at_char(lengths: Sequence[int], char: int) -> int | None:
    """Index of the token that produced character `char`, given `prefix_char_lengths`. For a character at or
    past the end of the text: the token after the last one that produced text (e.g. the stop token of a
    response that ended early), or None when there is none (the response ran out of tokens)."""
    t = bisect.bisect_right(lengths, char)  # first t with lengths[t] > char
    if t < len(lengths):
        return t
    t = bisect.bisect_left(lengths, char)  # the token that produced the last character ...
    t += 1 if char > 0 else 0  # ... and the one after it (no token produced an empty text)
    return t if t < len(lengths) else None


def fraction_cuts(n_tokens: int, fractions: Sequence[float]) -> list[int]:
    """Tokens kept when a response of `n_tokens` tokens is cut at each fraction (at least one, at most all)."""
    for f in fractions:
        if not 0 < f <= 1:
            raise ValueError(f"fractions: {f} is not in (0, 1]")
    return [min(n_tokens, max(1, math.ceil(f * n_tokens - 1e-9))) for f in fractions]
