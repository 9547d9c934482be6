"""Test-only sharding helpers: params created, moved and measured in a layout, and a teacher on its own sub-mesh
carved from the devices (jopd's step does not use these; the mesh tests check the layouts with them)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import pydantic
from jax.sharding import Mesh

from jopd.config_dataclass import config_dataclass
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.parallel.mesh import MeshConfig, make_mesh


def shardings_of(tree):
    """The shardings of a pytree of arrays, e.g. an optimizer state made by `jax.jit(opt.init)(params)` (which
    inherits the params' layout)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def init_sharded_params(cfg: ModelConfig, key: jax.Array, shardings, dtype=jnp.float32):
    """`transformer.init_params` materialized directly into the given layout (never whole on one device)."""
    leaves, treedef = jax.tree.flatten(shardings)
    return _init_fn(cfg, jnp.dtype(dtype), treedef, tuple(leaves))(key)


@functools.lru_cache(maxsize=16)
def _init_fn(cfg: ModelConfig, dtype, treedef, sharding_leaves):
    # Cached so a second init (another seed) does not recompile: the random init is slow to compile on CPU.
    out_shardings = jax.tree.unflatten(treedef, sharding_leaves)
    return jax.jit(lambda k: transformer.init_params(cfg, k, dtype), out_shardings=out_shardings)


def per_device_bytes(tree) -> dict[jax.Device, int]:
    """Bytes each addressable device holds for a pytree of arrays (read from the arrays' shards)."""
    out: dict[jax.Device, int] = {}
    for arr in jax.tree.leaves(tree):
        for shard in arr.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _device_set(tree) -> set:
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def reshard_for_sampling(params, sampling_shardings, dtype=None):
    """Copy params from the trainer layout into the sampler layout, cast to `dtype`, all on device.

    The trainer keeps its params (nothing is donated). On the same devices this is one jitted program
    (cast, then XLA's collectives to the new layout); onto other devices (a split sub-mesh) it is a
    device-to-device `device_put` followed by the cast on the target devices.
    """
    leaves, treedef = jax.tree.flatten(sampling_shardings)
    target_devices = {d for sh in leaves for d in sh.device_set}
    dtype = None if dtype is None else jnp.dtype(dtype)
    if _device_set(params) == target_devices:
        return _cast_fn(dtype, treedef, tuple(leaves), False)(params)
    moved = jax.device_put(params, sampling_shardings)
    if dtype is None:
        return moved
    return _cast_fn(dtype, treedef, tuple(leaves), True)(moved)  # `moved` is ours to donate


@functools.lru_cache(maxsize=16)
def _cast_fn(dtype, treedef, sharding_leaves, donate: bool):
    # Cached: a repeated weight sync must not recompile.
    def cast(tree):
        return tree if dtype is None else jax.tree.map(lambda x: x.astype(dtype), tree)

    return jax.jit(cast, out_shardings=jax.tree.unflatten(treedef, sharding_leaves),
                   donate_argnums=(0,) if donate else ())


@config_dataclass
class PlacementConfig:
    """Where student and teacher live: one shared mesh, or two disjoint sub-meshes carved from the devices."""

    student: MeshConfig = pydantic.Field(default_factory=MeshConfig)
    teacher: MeshConfig = pydantic.Field(default_factory=lambda: MeshConfig(data=1, fsdp=-1))  # used if "split"
    teacher_devices: Literal["same", "split"] = "same"
    teacher_num_devices: int = 0  # with "split": devices given to the teacher; 0 = half

    def __post_init__(self):
        if self.teacher_num_devices < 0:
            raise ValueError(f"PlacementConfig.teacher_num_devices: must be >= 0, got {self.teacher_num_devices}")


def split_devices(devices: Sequence[jax.Device], num_teacher: int) -> tuple[list, list]:
    """Carve (student_devices, teacher_devices): the teacher takes the LAST `num_teacher` devices in
    (process, id) order, so with whole hosts per model no cross-host traffic is needed inside either model."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if not 0 < num_teacher < len(ordered):
        raise ValueError(f"PlacementConfig.teacher_num_devices: {num_teacher} must be between 1 and "
                         f"{len(ordered) - 1} for {len(ordered)} devices")
    return ordered[:-num_teacher], ordered[-num_teacher:]


def make_meshes(cfg: PlacementConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
    """(student_mesh, teacher_mesh); the same object when `teacher_devices == "same"`."""
    devices = list(jax.devices() if devices is None else devices)
    if cfg.teacher_devices == "same":
        mesh = make_mesh(cfg.student, devices)
        return mesh, mesh
    student_devs, teacher_devs = split_devices(devices, cfg.teacher_num_devices or len(devices) // 2)
    return make_mesh(cfg.student, student_devs), make_mesh(cfg.teacher, teacher_devs)
