"""The target devices of `jopd aot`: a TPU topology described by libtpu (no TPU needed) or the local devices,
their HBM per device, and the chip whose peaks the roofline uses."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from jopd.sizing.roofline import CHIP_PEAKS, chip_of

# HBM per chip (GiB) by `device.device_kind`, with the chip's usual name. Public figures: v4 32 GiB,
# v5e 16 GiB, v5p 95 GiB, v6e (Trillium) 32 GiB. A chip may appear as several devices (v4 topologies list
# each TensorCore): the budget per device is the chip's HBM divided by its devices.
HBM_GIB_PER_CHIP: dict[str, tuple[str, float]] = {
    "TPU v4": ("v4", 32.0),
    "TPU v5 lite": ("v5e", 16.0),
    "TPU v5e": ("v5e", 16.0),
    "TPU v5": ("v5p", 95.0),
    "TPU v5p": ("v5p", 95.0),
    "TPU v6 lite": ("v6e", 32.0),
    "TPU v6e": ("v6e", 32.0),
}
GiB = 1 << 30


def topology_devices(name: str) -> list:
    """The devices of a TPU topology such as "v5e:2x2", "v5e:4x4", "v5p:2x2x2" (libtpu's names: chip type,
    then the chip grid), described by libtpu without any TPU attached. Compile-only: nothing can run on them."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"--topology {name}: needs libtpu (pip install 'jopd[tpu]', i.e. jax[tpu]); "
                         f"without --topology the stages compile for the local devices")
    for key, value in compile_only_env(name).items():  # before libtpu initializes (in get_topology_desc)
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu raises its own error types for bad names
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--topology {name}: not a TPU topology libtpu knows ({first}); "
                         f"examples: v5e:2x2, v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:2x2") from None
    return list(topo.devices)


def compile_only_env(name: str) -> dict[str, str]:
    """What libtpu asks the host's metadata server for when it initializes, for a compile-only run of topology
    `name` (e.g. "v5e:2x2"): on a machine without one (a CPU host) libtpu otherwise prints warnings and an
    `E0000 ... unexpected worker hostname` line that read like a failure. Set only where unset (a TPU VM's own
    values win); neither value changes the compiled programs (the topology does). Also: do not wait for the lock
    of another process that holds libtpu (compiling needs no chip)."""
    chip, _, grid = name.partition(":")
    chips = math.prod(int(d) for d in grid.split("x")) if re.fullmatch(r"\d+(x\d+)*", grid) else 1
    # Cloud TPU's accelerator types: v5e counts chips (v5litepod-16), v4 and v5p TensorCores (v5p-16: 8 chips)
    accelerator = {"v5e": f"v5litepod-{chips}", "v4": f"v4-{2 * chips}", "v5p": f"v5p-{2 * chips}"}.get(
        chip, f"{chip}-{chips}")
    return {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_ACCELERATOR_TYPE": accelerator,
            "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}


def devices_per_chip(devices: Sequence[Any]) -> int:
    coords = {tuple(d.coords) for d in devices if getattr(d, "coords", None) is not None}
    return max(1, len(devices) // len(coords)) if coords else 1


def hbm_bytes_per_device(devices: Sequence[Any]) -> int | None:
    """HBM budget of one device from `HBM_GIB_PER_CHIP`, or None for an unknown kind (e.g. CPU)."""
    kind = devices[0].device_kind
    if kind not in HBM_GIB_PER_CHIP:
        return None
    return int(HBM_GIB_PER_CHIP[kind][1] * GiB) // devices_per_chip(devices)



def chip_name(devices: Sequence[Any], chip: str | None) -> str:
    name = chip or chip_of(devices[0].device_kind, HBM_GIB_PER_CHIP)
    if name not in CHIP_PEAKS:
        raise ValueError(f"roofline: no chip peaks for {chip or devices[0].device_kind!r} (known: "
                         f"{', '.join(CHIP_PEAKS)}); compile for a TPU topology, or skip it with --no-cost")
    return name
