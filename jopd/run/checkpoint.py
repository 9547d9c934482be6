"""Checkpoints with Orbax: train state + Grain iterator position + JSON metadata, and preemption handling.

One `ocp.CheckpointManager` holds three items per step: `state` (any pytree of jax arrays: params, optimizer
state, step, typed PRNG keys — Orbax stores a typed key as its raw key data and rewraps it with the key impl of
the abstract target), `data` (the Grain iterator's position, one JSON file per process) and `meta` (JSON).
Saves are asynchronous: `save` returns once device arrays are copied to host and the iterator position is
written, so the caller may donate/overwrite the state and advance the iterator right away.

The loop a trainer runs (`PreemptionGuard` also serves other loops):

    ckpt = Checkpointer(cfg)
    restored = ckpt.restore_latest(abstract_state, train_iterator(...))
    state, data_it, step = restored or (init_state, train_iterator(...), 0)
    with PreemptionGuard() as guard:
        while step < num_steps:
            state = train_step(state, next(data_it)); step += 1
            stop = guard.should_stop(step)
            ckpt.save(step, state, data_it, metadata, force=stop)  # every `cfg.every` steps, or now if stopping
            if stop:
                break
    ckpt.close()  # waits for the last async save
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, NamedTuple

import grain
import jax
import orbax.checkpoint as ocp
import pydantic
from etils import epath
from jax.experimental import multihost_utils

from jopd.config_dataclass import config_dataclass


@config_dataclass
class CheckpointConfig:
    dir: str | None = None  # checkpoint directory; None disables checkpointing
    every: int = pydantic.Field(100, ge=1)  # save when step % every == 0 (and on preemption)
    keep: int = pydantic.Field(3, ge=1)  # keep the last `keep` checkpoints
    async_save: bool = True  # write in a background thread while training continues


class Restored(NamedTuple):
    state: Any  # the train state pytree, laid out as the abstract target asked
    iterator: Any  # the fresh iterator, moved to the saved position (None if none was given)
    step: int


def _abstract(tree: Any) -> Any:
    """Restore targets: ShapeDtypeStructs keep their sharding; concrete arrays lend theirs."""
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(leaf, tree)


def checkpoint_directory(path: str) -> epath.Path:
    """A local directory made absolute, or a cloud URI (gs://bucket/run) kept as is: `pathlib` would collapse
    its '//' (orbax and grain write through `etils.epath`; gs:// needs the gcsfs package)."""
    return epath.Path(path) if "://" in path else epath.Path(os.path.abspath(path))


class Checkpointer:
    """Orbax CheckpointManager wrapper: save every K steps, keep the last N, restore the latest."""

    def __init__(self, cfg: CheckpointConfig):
        if not cfg.dir:
            raise ValueError("CheckpointConfig.dir: not set (checkpointing needs a directory)")
        self.cfg = cfg
        self.directory = checkpoint_directory(cfg.dir)
        if "://" not in cfg.dir:  # local: an unwritable directory fails now, not at the first save
            try:
                os.makedirs(self.directory, exist_ok=True)
                probe = self.directory / f".jopd-write-check-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                raise ValueError(f"CheckpointConfig.dir: {cfg.dir}: cannot write ({e.strerror or e})") from None
        self._options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                                     create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=self._options)
        self._damaged: set[int] = set()  # steps on disk that failed to restore (see `restore_latest`)

    def should_save(self, step: int) -> bool:
        return step % self.cfg.every == 0

    def save(self, step: int, state: Any, data_iterator: Any = None, metadata: dict[str, Any] | None = None, *,
             force: bool = False) -> bool:
        """Save at `step` if it is a save step (or `force`) and not already saved; returns whether it saved."""
        if step in self._damaged:  # a damaged copy of this step is on disk: replace it
            self._mgr.delete(step)
            self._damaged.discard(step)
        if not (force or self.should_save(step)) or step in self._mgr.all_steps():
            return False
        items: dict[str, Any] = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        if metadata is not None:
            items["meta"] = ocp.args.JsonSave(metadata)
        return self._mgr.save(step, args=ocp.args.Composite(**items), force=True)

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def restore(self, step: int, abstract_state: Any, fresh_iterator: Any = None) -> Restored:
        """State of `step` laid out like `abstract_state` (its shardings); the iterator moved to its position."""
        saved = set(self._mgr.item_metadata(step).keys())
        items: dict[str, Any] = {"state": ocp.args.StandardRestore(_abstract(abstract_state))}
        if fresh_iterator is not None:
            if "data" not in saved:
                raise ValueError(f"checkpoint {self.directory}/{step} holds no data iterator position")
            items["data"] = grain.checkpoint.CheckpointRestore(fresh_iterator)
        if "meta" in saved:  # asked for, so Orbax does not warn that a saved item went unrestored
            items["meta"] = ocp.args.JsonRestore()
        with _quiet_orbax():
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        return Restored(state=out["state"], iterator=out["data"] if fresh_iterator is not None else None,
                        step=int(step))

    def restore_latest(self, abstract_state: Any, fresh_iterator: Any = None, warn=print) -> Restored | None:
        """`restore` of the latest step that restores, or None when the directory holds no checkpoint.

        A step that fails to restore (a truncated or deleted file inside it) is skipped with a warning naming
        it, and the previous step is tried; the damaged step is left on disk until training reaches that step
        again and overwrites it. If no step restores (e.g. a config whose shapes differ from the run's), an
        error names the steps tried and the first failure, and nothing on disk is touched."""
        failures = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                restored = self.restore(step, abstract_state, fresh_iterator)
            except Exception as e:  # noqa: BLE001  orbax/tensorstore raise many types for damaged files
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                failures.append((step, first))
                continue
            for bad, why in failures:
                warn(f"warning: checkpoint {self.directory}/{bad} does not restore ({why}); resuming from step "
                     f"{step} instead")
            self._damaged = {bad for bad, _ in failures}
            return restored
        if failures:
            tried = ", ".join(str(st) for st, _ in failures)
            raise ValueError(f"{self.directory}: no checkpoint restores (tried steps {tried}; step "
                             f"{failures[0][0]}: {failures[0][1]})")
        return None

    def metadata(self, step: int | None = None) -> dict[str, Any] | None:
        """The JSON metadata saved at `step` (default: latest), or None."""
        step = self.latest_step() if step is None else step
        if step is None or "meta" not in self._mgr.item_metadata(step).keys():
            return None
        return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        """Block until any in-flight async save is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs restore details through absl at WARNING; jopd prints its own one-line resume message."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _jax_preemption_service() -> bool:
    """Whether this is a multi-process jax.distributed job with JAX's preemption service enabled."""
    return jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)


class PreemptionGuard:
    """Turns a preemption notice (SIGTERM) or Ctrl-C (SIGINT) into a flag the training loop polls once per step.

    Single process: a Python signal handler sets the flag; the loop finishes its step, saves, exits 0. A second
    SIGINT while the flag is set raises KeyboardInterrupt at once (the user insists; nothing more is saved).
    Multi-process under `jax.distributed` with its preemption service (the default on TPU pods): JAX's own
    notifier receives SIGTERM on any host and `multihost_utils.reached_preemption_sync_point(step)` turns True
    on every host at the same step, so all hosts save the same step together. No Python handler is installed
    then for SIGTERM (it would replace JAX's). Call `should_stop(step)` on every process at every step, with
    increasing steps. Signals can only be caught on the main thread; elsewhere the guard only polls JAX.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self._flag = threading.Event()
        self._previous: dict[int, Any] = {}
        self._use_jax = False

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT and self._flag.is_set():
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without the save
        self._flag.set()

    def __enter__(self) -> PreemptionGuard:
        self._use_jax = _jax_preemption_service()
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if not (self._use_jax and sig == signal.SIGTERM):  # JAX's notifier owns SIGTERM then
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """A preemption notice arrived in this process (single-process mode)."""
        return self._flag.is_set()

    def request(self) -> None:
        """Ask the loop to stop as if a notice had arrived (tests, time limits); multi-process: on every host."""
        self._flag.set()

    def should_stop(self, step: int) -> bool:
        """True once the loop should save and exit; consistent across hosts in multi-process jobs."""
        if self._use_jax:
            return bool(multihost_utils.reached_preemption_sync_point(step)) or self._flag.is_set()
        return self._flag.is_set()
