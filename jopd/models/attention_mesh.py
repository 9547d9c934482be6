"""Pallas attention kernels under a device mesh: a Mosaic call is opaque to the SPMD partitioner (it refuses to
split one), so under a mesh in context (`jax.set_mesh`: the train step, teacher scoring, sampling, `jopd aot`)
each kernel runs in a `jax.shard_map` on its device's block: rows over the batch axes that divide them, heads
over `tensor` when it divides every head count, the sequence and slot axes whole. Without a mesh: called as is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax

# The mesh axes that split the batch (`transformer.BATCH_MESH_AXES`, which the attention modules cannot import:
# transformer imports the seam) and the one that splits heads (`jopd.parallel.mesh`; models sit below parallel).
BATCH_AXES = ("data", "fsdp", "expert")
HEAD_AXIS = "tensor"

Specs = Callable[[tuple[str, ...] | None, str | None], tuple[tuple, object]]


_RUNS_ON: contextvars.ContextVar[str | None] = contextvars.ContextVar("jopd_attention_runs_on", default=None)


@contextlib.contextmanager
def runs_on(platform: str):
    """Programs traced in this block without a mesh run on `platform`: for a caller that places nothing on another
    platform's devices (SFT runs on this host's: `runs_on(jax.default_backend())`). Only around a jit made for the
    block (SFT's step is made per call): jit's trace cache is not keyed by this context, so a shared jitted function
    traced here would keep this platform's branch for a later lowering elsewhere."""
    token = _RUNS_ON.set(platform)
    try:
        yield
    finally:
        _RUNS_ON.reset(token)


def traced_platform() -> str | None:
    """"cpu" or "tpu": the platform the program being traced is lowered for, where the context says it. A program
    traced under a mesh is lowered for that mesh's devices (the step's stages, the sampler, `jopd aot` on a TPU
    topology); without one, `runs_on`'s. The attention seam then traces only that platform's branch instead of
    every platform's with one kept at lowering (`lax.platform_dependent`: the train step traced the splash kernel's
    forward and backward on CPU, ~40% of its equations). None otherwise, and on GPUs: "gpu" names CUDA and ROCm
    alike, which only lowering tells apart."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = _RUNS_ON.get() if device is None else device.platform
    return platform if platform in ("cpu", "tpu") else None


def by_platform(*args, tpu: Callable, default: Callable):
    """`lax.platform_dependent(*args, tpu=tpu, default=default)`, with only one branch traced where `traced_platform`
    knows the platform."""
    platform = traced_platform()
    if platform is None:
        return jax.lax.platform_dependent(*args, tpu=tpu, default=default)
    return (tpu if platform == "tpu" else default)(*args)


def per_device_axes(B: int, heads: tuple[int, ...]):
    """(free mesh axes, batch axes or None, head axis or None) under the context mesh, or None without one. The
    batch goes over the batch axes that divide it, in order; every other free axis replicates."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)  # manual ones: an outer shard_map's
    if not free:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    batch, n = [], 1
    for a in BATCH_AXES:
        if a in free and B % (n * sizes[a]) == 0:
            batch.append(a)
            n *= sizes[a]
    head = HEAD_AXIS if HEAD_AXIS in free and all(h % sizes[HEAD_AXIS] == 0 for h in heads) else None
    return frozenset(free), (tuple(batch) or None), head


def on_each_device(fn: Callable, args: tuple, *, B: int, heads: tuple[int, ...], specs: Specs):
    """`fn(*args)` per device under the context mesh; `specs(batch_axes, head_axis)` gives (in_specs, out_specs)."""
    axes = per_device_axes(B, heads)
    if axes is None:
        return fn(*args)
    free, batch, head = axes
    in_specs, out_specs = specs(batch, head)
    # check_vma off: a Pallas call carries no varying-axes annotation for shard_map's checker
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=free, check_vma=False)(*args)
