"""Device mesh from config, logical-axis rules -> `NamedSharding`s, and jit-with-explicit-shardings helpers.

Mesh axes (outermost first, so `data` spans hosts/slices and `tensor` stays inside a host's fast links):
  data   - batch split, params replicated (pure data parallelism)
  fsdp   - batch split AND params split on their `embed` dim (gathered per layer by XLA in training)
  tensor - heads / kv heads / mlp / vocab split (Megatron style)

Rules map each logical axis name (from `transformer.param_logical_axes`, plus activation names) to an ORDERED list
of candidate mesh axes. For each array, dims are resolved left to right: a dim takes its first candidate whose
mesh axes are not already used by an earlier dim of the same array and whose size divides the dim. So
`heads -> tensor` wins on q/o, and `head_dim -> tensor` only takes over where the heads dim could not (e.g.
SmolLM2's 9 heads under tensor=2). A dim whose every candidate failed on divisibility follows `on_indivisible`:
"error" (strict: a ValueError naming the param path, logical axis, mesh axis and sizes) or "replicate".

TRAIN_RULES: params split over fsdp (embed) x tensor; SAMPLE_RULES: params split only over tensor and replicated
over data/fsdp, so decoding a token never all-gathers weights. Both put the batch over data x fsdp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jopd.config_dataclass import config_dataclass
from jopd.models import transformer
from jopd.models.config import ModelConfig

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
OnIndivisible = Literal["error", "replicate"]
MeshAxes = str | tuple[str, ...] | None  # one candidate: a mesh axis, several (product), or None (replicate)


# ---------------------------------------------------------------------------------------------
# config and mesh


def _as_axes(cand: MeshAxes) -> tuple[str, ...]:
    if cand is None:
        return ()
    if isinstance(cand, str):
        return (cand,)
    return tuple(cand)


def _fmt(sizes: dict[str, int]) -> str:
    return "(" + ", ".join(f"{a}={s}" for a, s in sizes.items()) + ")"


@config_dataclass
class MeshConfig:
    """Mesh shape over the devices. Sizes multiply to the device count; one of them may be -1 (the rest)."""

    data: int = -1  # batch split, params replicated
    fsdp: int = 1  # batch split and params split (ZeRO-3 style)
    tensor: int = 1  # heads / mlp / vocab split
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
    """Concrete (data, fsdp, tensor) sizes for `num_devices`; -1 takes the remaining factor."""
    sizes = cfg.sizes()
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices % known:
            raise ValueError(f"MeshConfig: {num_devices} devices are not divisible by the fixed axes "
                             f"{_fmt({a: s for a, s in sizes.items() if s != -1})} (product {known})")
        sizes = {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"MeshConfig: mesh {_fmt(sizes)} has {math.prod(sizes.values())} devices but "
                         f"{num_devices} devices are available (the product must equal the device count)")
    return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes (data, fsdp, tensor) in a topology-aware device order.

    Uses `mesh_utils.create_device_mesh` (ring/torus-aware on TPU; a plain reshape on CPU/GPU) and, on a
    multi-slice TPU pod, `create_hybrid_device_mesh` with the slices on the `data` axis (DCN carries only the
    gradient all-reduce). Axis types are `Auto`: shardings are given by jit's in/out_shardings.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if num_slices > 1:
        if shape[0] % num_slices:
            raise ValueError(f"MeshConfig.data: {shape[0]} is not divisible by the {num_slices} TPU slices")
        ici = (shape[0] // num_slices, shape[1], shape[2])
        device_array = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1), devices)
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
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


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


# ---------------------------------------------------------------------------------------------
# logical axis rules


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Ordered candidate mesh axes per logical axis name, plus the indivisible-dim policy."""

    name: str
    rules: tuple[tuple[str, tuple[MeshAxes, ...]], ...]
    on_indivisible: OnIndivisible = "error"

    def __post_init__(self):
        names = [n for n, _ in self.rules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"AxisRules {self.name}: logical axes listed twice: {sorted(dup)}")
        if self.on_indivisible not in ("error", "replicate"):
            raise ValueError(f"AxisRules.on_indivisible: {self.on_indivisible!r} is not 'error' or 'replicate'")

    @classmethod
    def from_dict(cls, name: str, rules: dict[str, Sequence[MeshAxes]], on_indivisible: OnIndivisible = "error"):
        return cls(name, tuple((k, tuple(_as_axes(c) or None for c in v)) for k, v in rules.items()),
                   on_indivisible)

    def with_policy(self, on_indivisible: OnIndivisible) -> "AxisRules":
        return dataclasses.replace(self, on_indivisible=on_indivisible)

    def candidates(self, logical: str, where: str) -> tuple[MeshAxes, ...]:
        for name, cands in self.rules:
            if name == logical:
                return cands
        raise ValueError(f"{where}: logical axis '{logical}' has no rule in {self.name} rules "
                         f"(known: {', '.join(n for n, _ in self.rules)})")

    def check_mesh(self, mesh: Mesh) -> None:
        """Every mesh axis the rules name must exist in the mesh."""
        for logical, cands in self.rules:
            for cand in cands:
                for axis in _as_axes(cand):
                    if axis not in mesh.shape:
                        raise ValueError(f"{self.name} rules: logical axis '{logical}' maps to mesh axis "
                                         f"'{axis}', which is not in the mesh {_fmt(dict(mesh.shape))}")


_ACTIVATION_RULES: dict[str, Sequence[MeshAxes]] = {
    "batch": [("data", "fsdp")],
    "length": [None],
    "act_embed": [None],
    "act_heads": ["tensor"],
    "act_kv_heads": ["tensor"],
    "act_head_dim": ["tensor", None],
    "act_mlp": ["tensor"],
    "act_vocab": ["tensor", None],
    "cache_length": [None],
}

TRAIN_RULES = AxisRules.from_dict("train", {
    "vocab": ["tensor"],
    "embed": ["fsdp"],
    "layers": [None],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": ["tensor", None],  # only where heads/kv_heads could not take `tensor` (used left to right)
    "mlp": ["tensor"],
    **_ACTIVATION_RULES,
})

SAMPLE_RULES = AxisRules.from_dict("sample", {
    "vocab": ["tensor"],
    "embed": [None],  # no fsdp split: one decode step must not all-gather the weights
    "layers": [None],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": ["tensor", None],
    "mlp": ["tensor"],
    **_ACTIVATION_RULES,
})


def rules_for(kind: Literal["train", "sample"], cfg: MeshConfig | None = None) -> AxisRules:
    """The built-in rule set for `kind` with the config's indivisible-dim policy."""
    base = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}[kind]
    return base.with_policy(cfg.on_indivisible) if cfg is not None else base


def logical_to_spec(logical: Sequence[str | None], mesh: Mesh, rules: AxisRules,
                    shape: Sequence[int] | None = None, where: str = "array") -> P:
    """PartitionSpec for one array (see the module docstring for the resolution order)."""
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"{where}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(logical):
        chosen: tuple[str, ...] = ()
        if name is not None:
            rejected = []
            for cand in rules.candidates(name, where):
                axes = _as_axes(cand)
                if used & set(axes):
                    continue
                size = math.prod(mesh.shape[a] for a in axes)
                if shape is not None and shape[dim] % size:
                    rejected.append((axes, size))
                    continue
                chosen = axes
                break
            else:
                if rejected and rules.on_indivisible == "error":
                    axes, size = rejected[0]
                    raise ValueError(
                        f"{where}: dim {dim} (logical axis '{name}', size {shape[dim]}) is not divisible by mesh "
                        f"axis {' x '.join(axes)} (size {size}) of mesh {_fmt(dict(mesh.shape))}; change the mesh "
                        f"or set on_indivisible='replicate'")
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return P(*spec)


def _is_logical(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _shape_of(x) -> tuple[int, ...] | None:
    if x is None:
        return None
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def logical_to_sharding(logical_tree, mesh: Mesh, rules: AxisRules, shapes=None):
    """Pytree of `NamedSharding` for a pytree whose leaves are tuples of logical axis names.

    `shapes` (optional, same structure; leaves are shape tuples, arrays or ShapeDtypeStructs) enables the
    divisibility check; without it every first usable candidate is taken.
    """
    rules.check_mesh(mesh)
    if shapes is None:
        return jax.tree_util.tree_map_with_path(
            lambda p, lg: NamedSharding(mesh, logical_to_spec(lg, mesh, rules, None, _path_str(p))),
            logical_tree, is_leaf=_is_logical)
    return jax.tree_util.tree_map_with_path(
        lambda p, lg, s: NamedSharding(mesh, logical_to_spec(lg, mesh, rules, _shape_of(s), _path_str(p))),
        logical_tree, shapes, is_leaf=_is_logical)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: AxisRules):
    """NamedSharding per parameter (divisibility checked against the model's shapes)."""
    return logical_to_sharding(transformer.param_logical_axes(cfg), mesh, rules,
                               shapes=transformer.abstract_params(cfg))


def unstacked_layer_shardings(shardings, num_layers: int):
    """Param shardings for `transformer.unstack_layers(params)`: each layer's leaves take the stacked leaf's
    sharding minus its leading (layers) dim, which the rules never split."""
    def per_layer(sh: NamedSharding) -> NamedSharding:
        spec = tuple(sh.spec)
        if spec and spec[0] is not None:
            raise ValueError(f"unstacked_layer_shardings: the layers dim is split ({sh.spec}); it cannot be unstacked")
        return NamedSharding(sh.mesh, P(*spec[1:]))
    layer = jax.tree.map(per_layer, shardings["layers"])
    return dict(shardings, layers=tuple(layer for _ in range(num_layers)))


def batch_sharding(mesh: Mesh, rules: AxisRules, shape: Sequence[int] | None = None, ndim: int = 2,
                   where: str = "batch") -> NamedSharding:
    """Sharding of a [B, T, ...] input/label array: B over the `batch` rule (data x fsdp), the rest replicated."""
    ndim = len(shape) if shape is not None else ndim
    logical = ("batch",) + (None,) * (ndim - 1)
    rules.check_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(logical, mesh, rules, shape, where))


def batch_shardings(batch_tree, mesh: Mesh, rules: AxisRules):
    """`batch_sharding` for every leaf of a batch pytree (arrays or ShapeDtypeStructs), leading dim = batch."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: batch_sharding(mesh, rules, _shape_of(x), where=f"batch/{_path_str(p)}"), batch_tree)


def activation_sharding(logical: Sequence[str | None], mesh: Mesh, rules: AxisRules,
                        shape: Sequence[int] | None = None, where: str = "activation") -> NamedSharding:
    """E.g. logits: `activation_sharding(("batch", "length", "act_vocab"), mesh, rules, (B, T, V))`."""
    rules.check_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(tuple(logical), mesh, rules, shape, where))


def cache_logical_axes() -> dict[str, tuple[str, ...]]:
    """Logical axes of each per-layer KV-cache buffer {"k","v": L x [B, K, S, Dh]} from `transformer.init_cache`."""
    axes = ("batch", "act_kv_heads", "cache_length", "act_head_dim")
    return {"k": axes, "v": axes}


def shardings_of(tree):
    """The shardings of a pytree of arrays, e.g. an optimizer state made by `jax.jit(opt.init)(params)` (which
    inherits the params' layout), to pass as a train step's in/out_shardings."""
    return jax.tree.map(lambda x: x.sharding, tree)


def sharded_abstract(shapes_tree, shardings_tree, dtype=None):
    """ShapeDtypeStructs carrying shardings, for AOT `jit(f).lower(...)` (no device memory touched)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh),
                        shapes_tree, shardings_tree)


# ---------------------------------------------------------------------------------------------
# creating, moving and using sharded params


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


def sharded_bytes_per_device(abstract_tree, shardings_tree) -> int:
    """Max bytes per device of a pytree under shardings, from shapes only (no arrays needed)."""
    total = 0
    for s, sh in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings_tree)):
        total += math.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
    return total


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
    # Cached: the sampler re-syncs weights every step and must not recompile each time.
    def cast(tree):
        return tree if dtype is None else jax.tree.map(lambda x: x.astype(dtype), tree)

    return jax.jit(cast, out_shardings=jax.tree.unflatten(treedef, sharding_leaves),
                   donate_argnums=(0,) if donate else ())


def make_sharded_forward(cfg: ModelConfig, mesh: Mesh, rules: AxisRules, batch_shape: tuple[int, int], *,
                         dtype=jnp.float32, logits_dtype=jnp.float32) -> Callable:
    """`fn(params, tokens_BxT, attn_mask_BxT) -> logits_BxTxV`: `transformer.forward` jitted once with explicit
    in/out shardings (params per `rules`, batch over data x fsdp, logits' vocab over tensor).

    The same pattern serves a train step: `jax.jit(step, in_shardings=(param_shardings(..), batch_shardings(..)),
    out_shardings=..., donate_argnums=...)`.
    """
    B, T = batch_shape
    p_sh = param_shardings(cfg, mesh, rules)
    tok_sh = batch_sharding(mesh, rules, (B, T), where="tokens_BxT")
    logits_sh = activation_sharding(("batch", "length", "act_vocab"), mesh, rules, (B, T, cfg.vocab_size),
                                    where="logits_BxTxV")

    def fwd(params, tokens_BxT, attn_mask_BxT):
        logits_BxTxV, _ = transformer.forward(params, tokens_BxT, cfg=cfg, attn_mask_BxT=attn_mask_BxT,
                                              dtype=dtype, logits_dtype=logits_dtype)
        return logits_BxTxV

    return jax.jit(fwd, in_shardings=(p_sh, tok_sh, tok_sh), out_shardings=logits_sh)
