"""Opt-in glibc malloc settings for XLA:CPU's large per-execution buffers (`JOPD_HOST_MALLOC=1`).

XLA:CPU takes each execution's buffers (temporaries, outputs) from malloc on its worker threads. glibc serves a
request above its mmap threshold (32 MiB at most) with a fresh mmap and unmaps it on free, and a worker thread's
own arena cannot hold more than 64 MiB either, so every execution of a program with large intermediates faults
all their pages in again. One arena, no mmap and no trimming keep freed buffers in the heap for the next
execution.

The trade-off (measured by benchmarks/opd_step.py; figures in docs/performance.md): the update part gets
faster, but the sampler's decode loop gets slower (its threads then contend for the one arena), so a full OPD
step gains nothing and it is off by default. torch in the same process gains most, which is why the TRL
comparison is reported both ways. The heap also never shrinks after a peak (the memory is reused, not returned
to the OS).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc <malloc.h>
# mallopt takes an int; -1 as the trim threshold becomes SIZE_MAX (never trim).
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))


def should_tune(env_value: str | None, libc: str) -> bool:
    """`env_value` is JOPD_HOST_MALLOC: "1" turns the settings on (glibc only); anything else leaves malloc alone."""
    return env_value == "1" and libc == "glibc"


def tune_glibc_malloc() -> bool:
    """Apply SETTINGS with mallopt when `should_tune` says so; True if applied. Call before XLA's threads start
    (jopd's CPU defaults do): M_ARENA_MAX only binds threads that have no arena yet."""
    if not should_tune(os.environ.get("JOPD_HOST_MALLOC"), platform.libc_ver()[0]):
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
