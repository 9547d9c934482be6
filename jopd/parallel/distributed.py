"""Multi-process wiring: `jax.distributed.initialize` from config/env, and per-process batch helpers.

Every process runs the same program (multi-controller JAX). Each loads only its rows of the global batch
(`process_batch_slice`) and `host_local_to_global` stitches the per-process pieces into one global `jax.Array`
over the mesh; jitted functions then see the global batch.

Env (used where the config leaves a field unset): JAX_COORDINATOR_ADDRESS ("host:port" of process 0),
JAX_NUM_PROCESSES, JAX_PROCESS_ID. On a TPU pod none are needed: JAX detects them from the TPU metadata.
JOPD_DISTRIBUTED=on|off|auto overrides an "auto" config: Cloud TPU VMs made with gcloud keep the worker list
in their metadata server, not in TPU_WORKER_HOSTNAMES, so `tpu_scripts/run.sh` sets JOPD_DISTRIBUTED=on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jopd.config_dataclass import build, config_dataclass


@config_dataclass
class DistributedConfig:
    """How this process joins a multi-process JAX job."""

    # auto: initialize iff a coordinator is known (config/env) or a multi-host TPU pod is detected;
    # on: always (JAX's cluster auto-detection: TPU pod, SLURM, Open MPI, Kubernetes); off: single process.
    enabled: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"DistributedConfig.num_processes: must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"DistributedConfig.process_id: must be >= 0, got {self.process_id}")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError(f"DistributedConfig.coordinator_address: expected 'host:port', "
                             f"got {self.coordinator_address!r}")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def config_from_env(base: DistributedConfig | None = None) -> DistributedConfig:
    """`base` with unset fields filled from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    base = base or DistributedConfig()
    enabled = base.enabled
    if enabled == "auto" and os.environ.get("JOPD_DISTRIBUTED"):
        enabled = os.environ["JOPD_DISTRIBUTED"]
        if enabled not in ("auto", "on", "off"):
            raise ValueError(f"environment variable JOPD_DISTRIBUTED: expected auto, on or off, got {enabled!r}")
    return DistributedConfig(
        enabled=enabled,
        coordinator_address=base.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=base.num_processes if base.num_processes is not None else _env_int("JAX_NUM_PROCESSES"),
        process_id=base.process_id if base.process_id is not None else _env_int("JAX_PROCESS_ID"),
        initialization_timeout_s=base.initialization_timeout_s,
    )


def _on_multihost_tpu() -> bool:
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def maybe_initialize(cfg_or_env: DistributedConfig | Mapping[str, Any] | None = None) -> bool:
    """Call `jax.distributed.initialize` when the config/env asks for several processes. Call it before any
    other JAX use. Returns True when this process is part of a multi-process job (also if already joined)."""
    if jax.distributed.is_initialized():
        return True
    if isinstance(cfg_or_env, Mapping):
        cfg_or_env = build(DistributedConfig, dict(cfg_or_env), "DistributedConfig")
    cfg = config_from_env(cfg_or_env)
    if cfg.enabled == "off":
        return False
    explicit = cfg.coordinator_address is not None
    if cfg.enabled == "auto" and not explicit and not _on_multihost_tpu():
        return False
    if explicit:
        for field in ("num_processes", "process_id"):
            if getattr(cfg, field) is None:
                raise ValueError(f"DistributedConfig.{field}: required with coordinator_address "
                                 f"{cfg.coordinator_address} (or set JAX_{field.upper()})")
        if cfg.process_id >= cfg.num_processes:
            raise ValueError(f"DistributedConfig.process_id: {cfg.process_id} must be < num_processes "
                             f"{cfg.num_processes}")
    # CPU processes exchange collectives over gloo (TCP); the setting does not affect TPU/GPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                               initialization_timeout=cfg.initialization_timeout_s)
    return True


def process_batch_slice(global_batch: int, sharding: NamedSharding | None = None) -> slice:
    """Rows [start, stop) of the global batch that this process must load.

    With `sharding` (the batch's sharding, batch on dim 0) the rows are those its addressable devices own;
    without it, an even split by process index.
    """
    if sharding is None:
        n, i = jax.process_count(), jax.process_index()
        if global_batch % n:
            raise ValueError(f"global batch {global_batch} is not divisible by the {n} processes")
        per = global_batch // n
        return slice(i * per, (i + 1) * per)
    idx_map = sharding.addressable_devices_indices_map((global_batch,))
    rows = sorted({r for idx in idx_map.values() for r in range(*idx[0].indices(global_batch))})
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"this process's batch rows are not contiguous under {sharding.spec}: {rows}")
    return slice(rows[0], rows[-1] + 1)


def host_local_to_global(local_tree, shardings, global_shapes=None):
    """Per-process pieces (numpy/jax, this process's rows) -> global `jax.Array`s with the given shardings.

    `shardings`: one NamedSharding for every leaf, or a matching pytree. `global_shapes` (optional pytree of
    shape tuples) is needed only when it cannot be inferred from the sharding (uneven pieces).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, local_tree)
    if global_shapes is None:
        return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
                            local_tree, shardings)
    return jax.tree.map(lambda x, s, g: jax.make_array_from_process_local_data(s, np.asarray(x), tuple(g)),
                        local_tree, shardings, global_shapes)


def gather_to_host(tree):
    """Global arrays -> full numpy arrays on every process (for logging/tests; costs a transfer)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def exit_if_multiprocess(code: int) -> None:
    """In a multi-process run, end this process now with exit status `code` (stdout and stderr flushed); in one
    process, return. For a process that stops on a hang (`train.stall_timeout_s`) while the others may be blocked
    in a collective with it: a normal exit runs jax's `jax.distributed.shutdown`, whose barrier waits for every
    process (`shutdown_timeout_seconds`, 300 s) and then aborts them all. Without it, the others are ended by the
    coordination service: at once when this is process 0 (the service ends with it), else once this process
    misses its heartbeats (`heartbeat_timeout_seconds`, 100 s)."""
    if not jax.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
