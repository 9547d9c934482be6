"""The loop never waits silently on a program that does not finish (`train.stall_timeout_s`): on a pod a hung
collective or a lost device blocks `jax.device_get` forever. Before reading a step's results the loop polls them in
dispatch order (the sampler's rollout, then the update) and, past the timeout, raises naming the side that has not
finished (with `rollout.placement=disaggregated`, the sampler's own devices or the trainer's; with
`rollout.placement=process`, the sampler process by its pid: `run.sampler_process`). In a multi-process run the
process that raises it exits at once (`jopd.cli`, `parallel.distributed.exit_if_multiprocess`): the others may be
blocked in a collective with it, and jax's exit-time shutdown barrier would wait 300 s for them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax


class StallError(TimeoutError):
    """A step's program did not finish within `train.stall_timeout_s` (the CLI prints it as one line)."""


def wait_ready(parts: Sequence[tuple[str, Any]], timeout_s: float | None, what: str, poll_s: float = 0.005) -> None:
    """Wait until every array of each (name, tree) of `parts` is computed, in order; past `timeout_s` seconds in
    all, raise `StallError` naming the first part not done. `timeout_s` None: return at once (the caller's read
    then waits as long as it takes)."""
    if timeout_s is None:
        return
    deadline = time.monotonic() + timeout_s
    for name, tree in parts:
        arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "is_ready")]  # jax.Arrays (host values: ready)
        while not all(x.is_ready() for x in arrays):
            if time.monotonic() > deadline:
                raise stall_error(timeout_s, what, name)
            time.sleep(poll_s)


def stall_error(timeout_s: float, what: str, name: str) -> StallError:
    """The one line that names the side `name` that has not finished `what` within `timeout_s`."""
    return StallError(f"train.stall_timeout_s={timeout_s:g}: {what}: {name} has not finished after {timeout_s:g} s "
                      f"(a hung collective, a lost device, or a step slower than the timeout); the last checkpoint "
                      f"is intact")
