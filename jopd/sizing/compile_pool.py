"""`jopd aot`'s compiles, several at once: each program is lowered in the caller's thread (tracing needs the
GIL and the caller's mesh context), then compiled on worker threads, the largest first.

XLA's compile releases the GIL and, for a TPU target, runs mostly on one core (libtpu's code generation), so on
a 2-core machine two programs compile side by side in about the time of one; taking the largest (the longest
StableHLO text) first keeps one long program from starting last (longest-processing-time-first scheduling). The
programs are independent: each one's result is what it would be compiled alone."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from tqdm.auto import tqdm

MAX_DEFAULT_THREADS = 4  # each compile of a large program holds GBs of host memory: more only when asked


def default_threads() -> int:
    """Programs compiled at once by default: the cores this process may use, at most `MAX_DEFAULT_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_THREADS))


class CompilePool:
    """Jobs added with `add` (a lowered program, its size, what to do with it) start on `run`, largest first;
    `wait` returns their results. With one thread the jobs run in `run`'s thread, one after the other."""

    def __init__(self, threads: int | None = None):
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"--compile-threads: must be at least 1, got {self.threads}")
        self._executor = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._queued: list[tuple[str, int, Callable[[], Any]]] = []
        self._futures: dict[str, Future] = {}

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def add(self, key: str, size: int, job: Callable[[], Any]) -> None:
        """Queue `job` (a compile and what is read from it) under `key`; `size` orders the queue (largest first)."""
        if key in self._futures or any(k == key for k, _, _ in self._queued):
            raise ValueError(f"compile pool: {key!r} added twice")
        self._queued.append((key, size, job))

    def run(self) -> None:
        """Start every queued job, largest first."""
        queued, self._queued = sorted(self._queued, key=lambda q: -q[1]), []
        for key, _, job in queued:
            if self._executor is not None:
                self._futures[key] = self._executor.submit(job)
                continue
            future: Future = Future()
            try:
                future.set_result(job())
            except BaseException as e:  # re-raised by `wait`, as a thread's would be
                future.set_exception(e)
            self._futures[key] = future

    def wait(self, keys: Iterable[str], desc: str = "compile", progress: bool = False) -> dict[str, Any]:
        """The results of the jobs `keys` (started by `run`), as they finish; a job's exception is raised here."""
        futures = {self._futures[k]: k for k in keys}
        bar = tqdm(total=len(futures), desc=desc, disable=not progress, dynamic_ncols=True, leave=False)
        out = {}
        with bar:
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                bar.set_postfix_str(futures[future][:60])
                bar.update()
        return out
