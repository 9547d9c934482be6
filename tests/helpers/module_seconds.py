"""Writes tests/module_seconds.json from a `pytest --durations=0` report read on stdin: each test module's total
seconds (setup + call + teardown), which tests/conftest.py uses to start the longest modules first. Regenerate it
after adding slow tests: `python -m pytest -q -n 2 --dist loadfile --durations=0 | python tests/helpers/module_seconds.py`.
"""

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::")


def main() -> None:
    seconds: Counter[str] = Counter()
    for line in sys.stdin:
        if m := LINE.match(line):
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        sys.exit("module_seconds: no `--durations=0` lines on stdin")
    out = Path(__file__).resolve().parents[1] / "module_seconds.json"
    out.write_text(json.dumps({k: round(v, 1) for k, v in seconds.most_common()}, indent=0) + "\n")
    print(f"{out}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
