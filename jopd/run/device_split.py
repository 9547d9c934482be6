"""`rollout.placement=process` with `rollout.sampler_devices=N`: the sampler's worker process on N accelerator
devices of its own, the trainer on the rest of the host's (`run.sampler_process`).

Each side is restricted before its jax backend starts, through its environment and jax options (a backend, once
started, holds what it was given: on TPU a chip opens in one process only, on GPU the first process to start
preallocates most of each visible GPU's memory):
- GPU: the worker's `CUDA_VISIBLE_DEVICES` is the first N of the trainer's visible GPUs (their physical ids, as the
  trainer's own `CUDA_VISIBLE_DEVICES` names them); the trainer keeps the others through the jax option
  `jax_cuda_visible_devices` (indices into its visible set).
- TPU (one host): two independent libtpu processes, each with its chips (`TPU_VISIBLE_CHIPS`), their sub-box
  (`TPU_CHIPS_PER_PROCESS_BOUNDS`), a one-process slice (`TPU_PROCESS_BOUNDS=1,1,1`) and ports of its own (the
  older libtpu spellings set too). Only the sub-boxes of `TPU_BOXES` are accepted, on both sides.
- CPU (the tests): the worker's `--xla_force_host_platform_device_count` (and `jax_num_cpu_devices`) is N; the
  trainer keeps its process's devices and builds its mesh over all but the first N (`opd.placement`).
The GPU and TPU environments are computed and tested here, never run on hardware (docs/architecture.md).

The first functions are pure (platform, visible devices, N -> `DeviceSplit`); `host_split` and `restrict_trainer`
read this host and apply the trainer's side, once per process."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from jopd.config_dataclass import ConfigError

# a sub-box of chips per count (x, y, z), as jax's own multi-process TPU harness lays out one host's chips
TPU_BOXES = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
TPU_PORTS = 2  # ports per side: the mesh controller's and the process's
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    platform: str  # "gpu", "tpu" or "cpu"
    n: int  # the worker's devices
    worker_env: dict[str, str]  # set in the worker's environment before its backend starts
    worker_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # jax options, ditto
    trainer_env: dict[str, str] = dataclasses.field(default_factory=dict)  # the trainer's, before its backend
    trainer_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def restricts_trainer(self) -> bool:
        """The trainer's side is set before its backend starts (GPU, TPU); on CPU its mesh skips the worker's."""
        return bool(self.trainer_env or self.trainer_options)


def _check_count(n: int, total: int, what: str) -> None:
    if not 1 <= n < total:
        raise ConfigError(f"rollout.sampler_devices={n}: must be between 1 and {total - 1} (the sampler process's "
                          f"share of this host's {total} {what}; the trainer keeps the rest)")


def gpu_split(n: int, visible: Sequence[str]) -> DeviceSplit:
    """`visible`: the trainer's visible GPUs' ids as CUDA names them (its CUDA_VISIBLE_DEVICES, or 0..m-1)."""
    _check_count(n, len(visible), "visible GPUs")
    rest = ",".join(str(i) for i in range(n, len(visible)))  # jax's option indexes the visible set
    return DeviceSplit("gpu", n, {"CUDA_VISIBLE_DEVICES": ",".join(visible[:n])},
                       trainer_options={"jax_cuda_visible_devices": rest})


def tpu_env(chips: Sequence[int], ports: Sequence[int]) -> dict[str, str]:
    """One independent (non-communicating) libtpu process on `chips` (a `TPU_BOXES` count), with `TPU_PORTS` ports
    of its own."""
    box = TPU_BOXES.get(len(chips))
    if box is None:
        raise ConfigError(f"rollout.sampler_devices: {len(chips)} TPU chips are not a sub-box of a host (one of "
                          f"{sorted(TPU_BOXES)} chips on each side)")
    ids, bounds = ",".join(map(str, chips)), ",".join(map(str, box))
    controller, process = ports
    return {"TPU_VISIBLE_CHIPS": ids, "TPU_VISIBLE_DEVICES": ids,
            "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds, "TPU_CHIPS_PER_HOST_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_HOST_BOUNDS": "1,1,1",
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{controller}", "TPU_MESH_CONTROLLER_PORT": str(controller),
            "TPU_PROCESS_ADDRESSES": f"localhost:{process}", "TPU_PROCESS_PORT": str(process),
            "CLOUD_TPU_TASK_ID": "0",
            # libtpu otherwise refuses a second process on the host (its lock file), even on other chips
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def tpu_split(n: int, chips: int, ports: Sequence[int], environ: Mapping[str, str] | None = None) -> DeviceSplit:
    """`chips`: this host's TPU chips; `ports`: 2 * `TPU_PORTS` distinct free ports (the worker's, then the
    trainer's); `environ`: the trainer's environment (a multi-host slice, or chips already restricted, refused)."""
    environ = {} if environ is None else environ
    if "," in environ.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in environ:
        raise ConfigError(f"rollout.sampler_devices={n}: with rollout.placement=process on a multi-host TPU slice "
                          f"is not built (one host only for now)")
    given = [k for k in ("TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES") if k in environ]
    if given:
        raise ConfigError(f"rollout.sampler_devices={n}: {given[0]} is set already (the split takes the host's chips "
                          f"itself)")
    _check_count(n, chips, "TPU chips")
    if len(set(ports)) != 2 * TPU_PORTS:
        raise ValueError(f"tpu_split: {2 * TPU_PORTS} distinct ports needed, got {list(ports)}")
    for side in (n, chips - n):
        if side not in TPU_BOXES:
            raise ConfigError(f"rollout.sampler_devices={n}: {n} of this host's {chips} TPU chips leaves sides of "
                              f"{n} and {chips - n} chips, each must be a sub-box ({sorted(TPU_BOXES)} chips)")
    return DeviceSplit("tpu", n, tpu_env(range(n), ports[:TPU_PORTS]),
                       trainer_env=tpu_env(range(n, chips), ports[TPU_PORTS:]))


def cpu_split(n: int, num_devices: int, xla_flags: str) -> DeviceSplit:
    """`num_devices`: the trainer process's CPU devices; `xla_flags`: its XLA_FLAGS (the worker's count replaces
    its own)."""
    _check_count(n, num_devices, "CPU devices")
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = _COUNT_FLAG.sub(flag, xla_flags) if _COUNT_FLAG.search(xla_flags) else f"{xla_flags} {flag}".strip()
    # the option, when the trainer sets it (passed on to the worker), would win over the flag
    return DeviceSplit("cpu", n, {"XLA_FLAGS": flags}, worker_options={"jax_num_cpu_devices": n})


# -- this host ----------------------------------------------------------------------------------------------------

_SPLIT: DeviceSplit | None = None  # this process's split (its ports chosen once)
_APPLIED: DeviceSplit | None = None  # the split whose trainer side this process applied


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public query; it must not start the backend itself

    return xla_bridge.backends_are_initialized()


def host_platform() -> str:
    """"gpu", "tpu" or "cpu": the started backend's, else the first of `jax_platforms`, else the hardware's (PCI,
    device files), so nothing starts the backend before the trainer's side is set."""
    import jax

    if _backend_started():
        name = jax.default_backend()
    else:
        name = (jax.config.jax_platforms or "").split(",")[0].strip()
        if not name:
            from jax._src import hardware_utils

            name = "tpu" if hardware_utils.num_available_tpu_chips_and_device_id()[0] else \
                "gpu" if hardware_utils.has_visible_nvidia_gpu() else "cpu"
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs a process sees: its CUDA_VISIBLE_DEVICES, else each /dev/nvidiaN."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    ids = sorted(int(p[len("/dev/nvidia"):]) for p in glob.glob("/dev/nvidia[0-9]*") if p[11:].isdigit())
    return [str(i) for i in ids]


def free_ports(k: int) -> list[int]:
    """`k` distinct ports free now (bound together, so distinct)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def host_split(cfg) -> DeviceSplit | None:
    """This host's split for `cfg` (None unless placement process with sampler_devices), computed once."""
    global _SPLIT
    n = cfg.rollout.sampler_devices
    if cfg.rollout.placement != "process" or not n:
        return None
    if _SPLIT is None or _SPLIT.n != n:
        platform = host_platform()
        if platform == "gpu":
            _SPLIT = gpu_split(n, visible_gpus(os.environ))
        elif platform == "tpu":
            from jax._src import hardware_utils

            chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]
            _SPLIT = tpu_split(n, chips, free_ports(2 * TPU_PORTS), os.environ)
        else:
            import jax

            _SPLIT = cpu_split(n, jax.local_device_count(), os.environ.get("XLA_FLAGS", ""))
    return _SPLIT


def restrict_trainer(cfg) -> DeviceSplit | None:
    """Restrict this (the trainer's) process to the devices the sampler process leaves: before its backend starts
    (GPU, TPU: `jopd train` calls it right after loading the config). A backend started already is an error, not
    a silently shared device; on CPU there is nothing to set (the trainer's mesh skips the worker's devices)."""
    global _APPLIED
    split = host_split(cfg)
    if split is None or not split.restricts_trainer or _APPLIED == split:
        return split
    if _APPLIED is not None or _backend_started():
        raise ConfigError(f"rollout.sampler_devices={split.n}: jax's {split.platform} backend had started in this "
                          f"process before the trainer could be restricted to the devices the sampler process "
                          f"leaves (set rollout.placement=process before any jax computation, as `jopd train` does)")
    import jax

    os.environ.update(split.trainer_env)
    for k, v in split.trainer_options.items():
        jax.config.update(k, v)
    _APPLIED = split
    return split
