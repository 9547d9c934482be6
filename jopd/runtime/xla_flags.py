"""XLA:CPU settings jopd runs with by default (set in `XLA_FLAGS` before the CPU backend starts).

jaxlib 0.10-0.11 hands dots, reductions and elementwise ops on CPU to the YNNPACK library; for reductions and
elementwise ops (e.g. the loss's vocabulary-wide logsumexp) its kernels were several times slower than XLA's
own here, so jopd keeps YNNPACK for dots only (the measured effect: docs/performance.md;
benchmarks/opd_step.py and sampler.py measure it).
Only the CPU backend reads these flags; a user's own setting of the same flag wins. Set JOPD_XLA_DEFAULTS=0
to leave XLA_FLAGS alone.

One numerics default (`NUMERICS_FLAGS`, read by every backend): a program rounds to a narrow dtype where it says
so. XLA may otherwise keep excess precision (drop an f32 -> bf16 -> f32 round trip), and it does so differently in
different programs (a fused decode step, the whole-sequence forward of the update), so a bf16 sampler and a bf16
trainer running the same code would disagree (`train.compute_dtype`; docs/lab.md). fp32 programs hold no such
round trip: they are unaffected.
"""

from __future__ import annotations

import os

import jaxlib

from jopd.runtime.host_malloc import tune_glibc_malloc

CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "dot"}
# The flag is experimental: XLA aborts on unknown flags, so it is only added for jaxlib versions it exists in.
_TESTED_JAXLIB = ("0.10.", "0.11.")


def with_cpu_defaults(xla_flags: str, jaxlib_version: str = jaxlib.__version__) -> str:
    """`xla_flags` plus jopd's CPU defaults that it does not already set (unchanged for untested jaxlibs)."""
    if not jaxlib_version.startswith(_TESTED_JAXLIB):
        return xla_flags
    extra = [f"--{k}={v}" for k, v in CPU_FLAGS.items() if f"--{k}=" not in xla_flags]
    return " ".join([xla_flags.strip(), *extra]).strip()


NUMERICS_FLAGS = {"xla_allow_excess_precision": "false"}


def with_numerics_defaults(xla_flags: str) -> str:
    """`xla_flags` plus `NUMERICS_FLAGS` that it does not already set (a long-standing flag: every jaxlib)."""
    extra = [f"--{k}={v}" for k, v in NUMERICS_FLAGS.items() if f"--{k}=" not in xla_flags]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_cpu_defaults() -> None:
    """Add the defaults to the XLA_FLAGS environment variable, and apply the opt-in glibc malloc settings for
    XLA:CPU's buffers when JOPD_HOST_MALLOC=1 (`jopd.runtime.host_malloc`). Call before the first jax computation (the CPU backend reads XLA_FLAGS once, when it
    starts, and its threads take their malloc arena then); a later call has no effect on the running backend."""
    if os.environ.get("JOPD_XLA_DEFAULTS", "1") != "0":
        os.environ["XLA_FLAGS"] = with_numerics_defaults(with_cpu_defaults(os.environ.get("XLA_FLAGS", "")))
    tune_glibc_malloc()
