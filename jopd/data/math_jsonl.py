"""JSONL math problems, one object per line: `{"question": ..., "answer": "... #### 42"}` (GSM8K's format), with an
optional `"task": "label"` that `data.mix` can draw on (several teachers route rows by it)."""

from __future__ import annotations

import json
from pathlib import Path

from jopd.data.answers import extract_answer, parse_number
from jopd.data.problem import Problem

REQUIRED_FIELDS = ("question", "answer")


def load_math_jsonl(path: str | Path) -> list[Problem]:
    """All problems of a JSONL file; any bad line -> ValueError naming file, line number and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"math JSONL file not found: {path}")
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                problems.append(_parse_line(line, f"{path}:{lineno}"))
    if not problems:
        raise ValueError(f"{path}: file is empty (no problems)")
    return problems


def _parse_line(line: str, where: str) -> Problem:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {list(REQUIRED_FIELDS)}, "
                         f"got {type(record).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in record:
            raise ValueError(f"{where}: missing field '{field}'")
        if not isinstance(record[field], str) or not record[field].strip():
            raise ValueError(f"{where}: field '{field}' must be a non-empty string")
    task = record.get("task")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        raise ValueError(f"{where}: field 'task' must be a non-empty string when given")
    final = extract_answer(record["answer"])
    if parse_number(final) is None:
        raise ValueError(f"{where}: field 'answer' does not end with a '#### <number>' final answer")
    return Problem(question=record["question"].strip(), solution=record["answer"].strip(),
                   answer=final.replace(" ", ""), where=where, task=task)
