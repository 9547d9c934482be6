"""The one record every task produces."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str  # what the user asks
    solution: str  # worked solution ending with `#### <answer>` (the SFT target)
    answer: str  # the reference final answer, a bare number string
    where: str  # where it came from, for error messages: "arithmetic train #17", "gsm8k.jsonl:12"
    task: str | None = None  # a JSONL line's optional `task` label (`data.mix` can draw on it; `jopd.data.mixture`)
