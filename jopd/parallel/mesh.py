"""The device mesh: its config (`MeshConfig`, in a run config's `mesh:`) and `make_mesh`.

Mesh axes (outermost first, so `data` spans hosts/slices and `tensor` stays inside a host's fast links):
  data   - batch split, params replicated (pure data parallelism)
  fsdp   - batch split AND params split on their `embed` dim (gathered per layer by XLA in training)
  expert - a mixture-of-experts layer's experts split (expert parallelism, `models/moe.py`), the batch split too
  tensor - heads / kv heads / mlp / vocab split (Megatron style)

Which array dims go over which axes is `jopd.parallel.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jopd.config_dataclass import config_dataclass

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
# Axes a mesh holds only where their size is > 1 (`make_mesh`), and rules naming them skip where a mesh lacks them:
# every mesh without expert parallelism is the (data, fsdp, tensor) mesh it always was, so its programs are unchanged.
OPTIONAL_AXES: tuple[str, ...] = ("expert",)
OnIndivisible = Literal["error", "replicate"]


def fmt_sizes(sizes: dict[str, int]) -> str:
    """`(data=2, fsdp=2, tensor=2)`: how errors show a mesh (an optional axis only where it is not 1)."""
    return "(" + ", ".join(f"{a}={s}" for a, s in sizes.items() if a not in OPTIONAL_AXES or s != 1) + ")"


@config_dataclass
class MeshConfig:
    """Mesh shape over the devices. Sizes multiply to the device count; one of them may be -1 (the rest)."""

    data: int = -1  # batch split, params replicated
    fsdp: int = 1  # batch split and params split (ZeRO-3 style)
    tensor: int = 1  # heads / mlp / vocab split
    expert: int = 1  # experts split (expert parallelism; a mixture-of-experts model only), the batch split too
    on_indivisible: OnIndivisible = "error"  # a dim no candidate mesh axis divides: raise, or replicate it

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"MeshConfig.{name}: must be a positive size or -1 (all remaining devices), "
                                 f"got {size}")
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {sizes}")

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Concrete (data, fsdp, expert, tensor) sizes for `num_devices`; -1 takes the remaining factor."""
    sizes = cfg.sizes()
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices % known:
            raise ValueError(f"MeshConfig: {num_devices} devices are not divisible by the fixed axes "
                             f"{fmt_sizes({a: s for a, s in sizes.items() if s != -1})} (product {known})")
        sizes = {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"MeshConfig: mesh {fmt_sizes(sizes)} has {math.prod(sizes.values())} devices but "
                         f"{num_devices} devices are available (the product must equal the device count)")
    return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes (data, fsdp, tensor) in a topology-aware device order; with `expert` > 1, (data, fsdp,
    expert, tensor) (the expert group's all-gathers and reduce-scatters inside a host's fast links, after `tensor`).

    Uses `mesh_utils.create_device_mesh` (ring/torus-aware on TPU; a plain reshape on CPU/GPU) and, on a
    multi-slice TPU pod, `create_hybrid_device_mesh` with the slices on the `data` axis (DCN carries only the
    gradient all-reduce). Axis types are `Auto`: shardings are given by jit's in/out_shardings.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(zip(MESH_AXES, resolve_mesh_shape(cfg, len(devices))))
    names = tuple(a for a in MESH_AXES if a not in OPTIONAL_AXES or sizes[a] > 1)
    shape = tuple(sizes[a] for a in names)
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if num_slices > 1:
        if shape[0] % num_slices:
            raise ValueError(f"MeshConfig.data: {shape[0]} is not divisible by the {num_slices} TPU slices")
        ici = (shape[0] // num_slices, *shape[1:])
        device_array = mesh_utils.create_hybrid_device_mesh(ici, (num_slices,) + (1,) * (len(shape) - 1), devices)
    else:
        device_array = None
        for split_physical_axes in (False, True):  # as jax.make_mesh: prefer whole physical axes
            try:
                device_array = mesh_utils.create_device_mesh(
                    shape, devices, allow_split_physical_axes=split_physical_axes)
                break
            except (ValueError, NotImplementedError, AssertionError):
                pass
        if device_array is None:
            # A device subset that is no physical sub-torus (e.g. a carved teacher sub-mesh): keep id order.
            device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, names, axis_types=(AxisType.Auto,) * len(names))
