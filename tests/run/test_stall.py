"""`train.stall_timeout_s` (`jopd.run.stall`): a step's program that does not finish in time is an error naming the
side that stalled, not a silent wait; in time, nothing changes."""

import time

import jax
import jax.numpy as jnp
import pytest

from jopd.run import stall


class _Running:
    """A result that becomes ready `seconds` from now (XLA:CPU runs a test-sized program before its dispatch
    returns, so a real not-yet-ready array cannot be made on demand here): what `jax.Array.is_ready` reports."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def is_ready(self) -> bool:
        return time.monotonic() >= self.at


def test_a_program_past_the_timeout_is_named():
    done = jnp.ones(3) + 1
    jax.block_until_ready(done)
    t0 = time.monotonic()
    with pytest.raises(stall.StallError, match=r"^train.stall_timeout_s=0.3: step 7: the update has not finished "
                                               r"after 0.3 s"):
        stall.wait_ready((("the sampler's rollout", done), ("the update", {"loss": _Running(60)})), 0.3, "step 7")
    assert 0.3 <= time.monotonic() - t0 < 5  # it waited for the timeout, not for the program
    assert isinstance(stall.StallError("x"), OSError)  # the CLI prints OSErrors as one line
    with pytest.raises(stall.StallError, match=r"the sampler's rollout has not finished"):
        stall.wait_ready((("the sampler's rollout", _Running(60)), ("the update", done)), 0.3, "step 8")


def test_programs_in_time_and_no_timeout_pass():
    soon = _Running(0.2)
    stall.wait_ready((("the sampler's rollout", soon), ("the update", {"a": jnp.ones(2), "b": None})), 5.0, "step 1")
    assert soon.is_ready()
    t0 = time.monotonic()
    stall.wait_ready((("the update", _Running(60)),), None, "step 2")  # None: returns at once, the read will wait
    assert time.monotonic() - t0 < 0.5


def test_the_field_is_checked():
    """(The loop's own wait with a timeout runs in tests/opd/test_disaggregated.py's loop test.)"""
    from jopd.config_dataclass import ConfigError
    from jopd.run.config import load_config

    assert load_config(None, ["train.stall_timeout_s=90"]).train.stall_timeout_s == 90
    with pytest.raises(ConfigError, match=r"stall_timeout_s"):
        load_config(None, ["train.stall_timeout_s=0"])
