"""jopd's XLA:CPU defaults: added once, never over a user's own value, never for an untested jaxlib."""

import os

import jax
import jaxlib

from jopd.runtime.xla_flags import CPU_FLAGS, with_cpu_defaults

FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def test_defaults_are_added_once_and_keep_other_flags():
    out = with_cpu_defaults("--xla_force_host_platform_device_count=8", "0.10.2")
    assert out.split() == ["--xla_force_host_platform_device_count=8", f"{FLAG}={CPU_FLAGS[FLAG[2:]]}"]
    assert with_cpu_defaults(out, "0.10.2") == out


def test_a_users_own_value_wins():
    assert with_cpu_defaults(f"{FLAG}=dot,reduce", "0.11.2") == f"{FLAG}=dot,reduce"


def test_untested_jaxlib_gets_no_experimental_flag():
    assert with_cpu_defaults("--xla_force_host_platform_device_count=8", "0.14.0") == (
        "--xla_force_host_platform_device_count=8")


def test_the_suite_runs_with_the_defaults():
    # conftest applies them before the backend starts; XLA would abort on a flag it does not know
    assert FLAG in os.environ["XLA_FLAGS"] or not jaxlib.__version__.startswith(("0.10.", "0.11."))
    assert float(jax.jit(lambda x: jax.numpy.sum(x * 2.0))(jax.numpy.ones(4))) == 8.0
