"""glibc malloc settings for XLA:CPU's large per-execution buffers (applied with jopd's CPU defaults).

XLA:CPU takes each execution's buffers (temporaries, outputs) from malloc on its worker threads. glibc serves a
request above its mmap threshold (32 MiB at most) with a fresh mmap and unmaps it on free, and a worker thread's
own arena cannot hold more than 64 MiB either, so every execution of a program with large intermediates faults
all their pages in again: ~250 k page faults (1 GB) per SmolLM2 6-layer train step, ~0.3 s of its 2.1 s on the
project's VM (benchmarks/opd_step.py). One arena, no mmap and no trimming keep freed buffers in the heap for the
next execution. The price: the heap does not shrink after a peak (the memory is reused, not returned to the OS).

Applied only where XLA computes on the CPU (no TPU/GPU device files), and only with glibc; `JOPD_HOST_MALLOC=0`
leaves malloc alone, `=1` applies it anyway.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc <malloc.h>
# mallopt takes an int; -1 as the trim threshold becomes SIZE_MAX (never trim).
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
ACCELERATOR_DEVICES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")  # TPU VMs, GPUs


def accelerator_present() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def should_tune(env_value: str | None, libc: str, accelerator: bool) -> bool:
    """`env_value` is JOPD_HOST_MALLOC ("0": never, "1": always, unset: only for CPU compute); glibc only."""
    if libc != "glibc" or env_value == "0":
        return False
    return env_value == "1" or not accelerator


def tune_glibc_malloc() -> bool:
    """Apply SETTINGS with mallopt when `should_tune` says so; True if applied. Call before XLA's threads start:
    M_ARENA_MAX only binds threads that have no arena yet."""
    if not should_tune(os.environ.get("JOPD_HOST_MALLOC"), platform.libc_ver()[0], accelerator_present()):
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
