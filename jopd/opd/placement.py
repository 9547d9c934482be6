"""Where the sampler runs (`rollout.placement`): on the trainer's devices (`colocated`, the default), or on
devices of its own (`disaggregated`): the first `rollout.sampler_devices` of the process's devices hold the
sampler's mesh (`sampling.mesh`'s shape, `{data: -1}` when unset) and the rest the trainer's (`mesh:`).

Disaggregated, the weight sync is a copy between the two device sets (`jax.device_put` of the policy's fp32
params into the sampler's layout, then the cast / quantization / noise on the sampler's devices) and the
rollouts are copied back to the trainer's batch layout for scoring. With `rollout.staleness` k >= 1 the step's
window of past params is not an output of the update (`staleness.split_window`), so the sampler's program of
step n+1, dispatched while the update of step n is still running, has its inputs ready and runs beside it: a
two-stage pipeline whose queue is one rollout deep, its staleness bounded by k. The samples are the in-place
k-lag mode's (row-seeded sampling does not depend on the layout: tests/opd/test_disaggregated.py).

`process`: the sampler in a worker process of its own on the same host (`jopd.run.sampler_process`): the trainer
writes each step's request and the policy's fp32 params, the worker its rollout, as TensorStore arrays in an
exchange directory; a worker that dies is restarted from the last params written and the pending request. The
samples are again the in-place k-lag mode's (tests/opd/test_process_sampler.py). A multi-process (multi-host)
trainer starts one worker per process, which samples that process's rows
(tests/opd/test_process_sampler_multihost.py). The worker sees the devices its environment gives it (the same as
the trainer's on CPU) unless `rollout.sampler_devices` = N gives it devices of its own: the first N of the host's,
the trainer keeping the rest (`run.device_split`: on GPU / TPU each process is restricted before its backend starts;
on CPU the worker gets N simulated devices and the trainer's mesh here skips the process's first N). `jopd aot`
sizes and predicts the disaggregated split on a TPU topology (`jopd.sizing`: the sampler's stages on its chips, the
trainer's on the rest, the weight transfer timed on the ICI)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:  # the run's config is the layer above the step (jopd.run): annotations only
    from jopd.run.config import RunConfig


def disaggregated(cfg: RunConfig) -> bool:
    return cfg.rollout.placement == "disaggregated"


def in_process_of_its_own(cfg: RunConfig) -> bool:
    return cfg.rollout.placement == "process"


def worker_devices(cfg: RunConfig) -> int:
    """N: the devices of the sampler's worker process of its own (`rollout.placement=process` with
    `rollout.sampler_devices`; `run.device_split`), 0 when it shares the trainer's."""
    return cfg.rollout.sampler_devices if in_process_of_its_own(cfg) else 0


def check_placement(cfg: RunConfig, num_devices: int) -> None:
    """`rollout.placement` / `rollout.sampler_devices` against the devices: one-line errors naming the field."""
    n = cfg.rollout.sampler_devices  # colocated, a count is refused by `validate.check_run`
    if worker_devices(cfg):
        from jopd.opd.shardings import sampler_mesh_sizes

        if jax.process_count() > 1:
            raise ValueError(f"rollout.sampler_devices={n}: with rollout.placement=process, one trainer process "
                             f"only (a multi-process trainer's workers on devices of their own are not built)")
        sampler_mesh_sizes(cfg.sampling.mesh, n, "rollout.sampler_devices gives the sampler process")
    if not disaggregated(cfg):
        return
    if jax.process_count() > 1:
        raise ValueError("rollout.placement=disaggregated: one process only (a sampler in processes of its own is "
                         "not built)")
    if not 1 <= n < num_devices:
        raise ValueError(f"rollout.sampler_devices={n}: must be between 1 and {num_devices - 1} (the sampler's "
                         f"share of the {num_devices} devices; the trainer keeps the rest)")


def split_devices(cfg: RunConfig, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """(the trainer's devices, the sampler's): all of them for both when colocated; disaggregated, the first
    `rollout.sampler_devices` are the sampler's and the rest the trainer's; in a worker process of its own (with
    `rollout.sampler_devices`) the trainer's share, and none for the sampler here."""
    devices = list(jax.devices() if devices is None else devices)
    check_placement(cfg, len(devices))
    n = cfg.rollout.sampler_devices
    if worker_devices(cfg):
        # in the sampler's worker process: on CPU it has N simulated devices of its own, the trainer's mesh leaves
        # the first N of this process's alone; on an accelerator this process sees only its own share already
        if devices[0].platform != "cpu":
            return devices, []
        if not 1 <= n < len(devices):
            raise ValueError(f"rollout.sampler_devices={n}: must be between 1 and {len(devices) - 1} (the sampler "
                             f"process's share of the {len(devices)} devices; the trainer keeps the rest)")
        return devices[n:], []
    if not disaggregated(cfg):
        return devices, devices
    return devices[n:], devices[:n]


def sampler_devices(cfg: RunConfig, mesh, devices: Sequence[jax.Device] | None = None) -> list[jax.Device] | None:
    """The sampler's own devices for a step built on the trainer's `mesh` (None when colocated): those of `devices`
    (default: the process's; `jopd aot`: a TPU topology's) the trainer's mesh leaves, which must be
    `rollout.sampler_devices` of them (`trainer_mesh`)."""
    if not disaggregated(cfg):
        return None
    devices = list(jax.devices() if devices is None else devices)
    own = set(mesh.devices.flat)
    free = [d for d in devices if d not in own]
    if len(free) != cfg.rollout.sampler_devices:
        raise ValueError(f"rollout.sampler_devices={cfg.rollout.sampler_devices}: the trainer's mesh leaves "
                         f"{len(free)} of the {len(devices)} devices (build it with opd.placement.trainer_mesh)")
    return free


def trainer_mesh(cfg: RunConfig):
    """The trainer's mesh (`mesh:`) over its share of the process's devices (all of them when colocated)."""
    from jopd import parallel as meshlib

    return meshlib.make_mesh(cfg.mesh, split_devices(cfg)[0])
