"""Final-answer extraction (GSM8K-style `#### 42`, optional last-number fallback) and exact numeric checking."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"[-+]?(?:\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_MARKED_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_NUMBER_RE = re.compile(_NUMBER)


def extract_answer(text: str, *, fallback_last_number: bool = False) -> str | None:
    """The number after the first `####`; else, if `fallback_last_number`, the last number in the text; else None."""
    marked = _MARKED_RE.search(text)
    if marked:
        return marked.group(1)
    if fallback_last_number:
        numbers = _NUMBER_RE.findall(text)
        if numbers:
            return numbers[-1]
    return None


def parse_number(text: str | None) -> Fraction | None:
    """Exact value of a number string such as `1,234`, `$5`, `-3.50`, `7.`; None if it is not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not cleaned:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(response: str, reference: str, *, fallback_last_number: bool = False) -> bool:
    """Whether the answer extracted from `response` equals `reference` (a bare number or text with `####`).

    Numbers compare exactly as rationals after stripping commas and `$` (so `1,000` == `1000.0`).
    """
    ref_text = extract_answer(reference) if "####" in reference else reference
    ref = parse_number(ref_text)
    if ref is None:
        raise ValueError(f"reference answer {reference!r} is not a number")
    got = parse_number(extract_answer(response, fallback_last_number=fallback_last_number))
    return got is not None and got == ref
