"""The prompt batches of the steps after the current one (`rollout.queue` > 1: a sampler process is sent their
requests early), read from a Grain iterator of their own, moved to the loop's position: the loop's iterator, the
one checkpointed, stays at the current step's batch, so a checkpoint and its resume are what they are without it.
Grain's iterators are deterministic: the two yield the same batches."""

from __future__ import annotations

import collections


class Lookahead:
    """`ahead()` after the loop has read step n's batch: the batches of steps n+1 .. n+depth (fewer where the
    iterator ends). `it`: a fresh iterator at the loop's position (its next batch is the loop's next)."""

    def __init__(self, it, loop_it, depth: int):
        it.set_state(loop_it.get_state())
        next(it, None)  # the loop's own batch of its next step
        self.it, self.depth, self.buffer = it, depth, collections.deque()

    def ahead(self) -> tuple:
        while len(self.buffer) < self.depth and (batch := next(self.it, None)) is not None:
            self.buffer.append(batch)
        out = tuple(self.buffer)
        if self.buffer:  # the next step's batch is the loop's own then
            self.buffer.popleft()
        return out
