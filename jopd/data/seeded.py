"""What the seeded synthetic tasks (arithmetic, counting) share: a held-out split of distinct draws and an
index-addressable train stream that redraws any problem the held-out split holds.

A task supplies `draw(namespace, index, attempt)` (a pure function of its seed and those three numbers), the
`key` that makes two draws the same problem (e.g. the arithmetic expression, whatever the wording), and how a
draw becomes a `Problem`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, overload

from jopd.data.problem import Problem

TRAIN, HELDOUT = 0, 1  # seed namespaces of the two splits
MAX_ATTEMPTS = 1000

Draw = Callable[[int, int, int], Any]  # (namespace, index, attempt) -> a draw


def distinct_draws(draw: Draw, key: Callable[[Any], Hashable], size: int, what: str) -> tuple[Any, ...]:
    """The held-out draws in order, the first occurrence of each key kept, until `size` exist. `what` names the
    config for the error when the space runs out (e.g. "ArithmeticConfig ... raise max_number or max_steps")."""
    seen: set[Hashable] = set()
    out = []
    index, misses = 0, 0
    while len(out) < size:
        if misses > max(1000, 20 * size):  # that many repeats in a row: the space is exhausted
            name, hint = what.split(":", 1)
            raise ValueError(f"{name}: only {len(out)} distinct problems exist at these settings, fewer than "
                             f"heldout_size={size};{hint}")
        d = draw(HELDOUT, index, 0)
        k = key(d)
        if k in seen:
            misses += 1
        else:
            seen.add(k)
            out.append(d)
            misses = 0
        index += 1
    return tuple(out)


class SeededStream(Sequence[Problem]):
    """Index-addressable train stream: problem i is `draw(TRAIN, i, attempt)` for the first attempt whose key
    is not held out; `make(draw, i)` turns it into a Problem."""

    def __init__(self, size: int, draw: Draw, key: Callable[[Any], Hashable], heldout: frozenset,
                 make: Callable[[Any, int], Problem], name: str):
        self._size, self._draw, self._key, self._heldout, self._make, self._name = size, draw, key, heldout, make, name

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> Problem: ...
    @overload
    def __getitem__(self, index: slice) -> list[Problem]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"train problem {index} out of range [0, {len(self)})")
        for attempt in range(MAX_ATTEMPTS):
            d = self._draw(TRAIN, index, attempt)
            if self._key(d) not in self._heldout:
                return self._make(d, index)
        raise ValueError(f"{self._name}: train problem {index} collides with the held-out split {MAX_ATTEMPTS} "
                         f"times; the settings leave too few distinct problems")
