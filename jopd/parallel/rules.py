"""Logical-axis rules -> `NamedSharding`s: which mesh axes each dim of a parameter, batch or activation goes over.

Rules map each logical axis name (from `transformer.param_logical_axes`, plus activation names) to an ORDERED list
of candidate mesh axes. For each array, dims are resolved left to right: a dim takes its first candidate whose
mesh axes are not already used by an earlier dim of the same array and whose size divides the dim. So
`heads -> tensor` wins on q/o, and `head_dim -> tensor` only takes over where the heads dim could not (e.g.
SmolLM2's 9 heads under tensor=2). A dim whose every candidate failed on divisibility follows `on_indivisible`:
"error" (strict: a ValueError naming the param path, logical axis, mesh axis and sizes) or "replicate".

TRAIN_RULES: params split over fsdp (embed) x tensor; SAMPLE_RULES: params split only over tensor and replicated
over data/fsdp, so decoding a token never all-gathers weights. Both put the batch over data x fsdp (x expert), and a
mixture-of-experts layer's experts over `expert` (its router stays whole: every device routes its own tokens).
A candidate naming an optional mesh axis (`mesh.OPTIONAL_AXES`: expert) the mesh lacks goes without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.parallel.mesh import OPTIONAL_AXES, MeshConfig, OnIndivisible, fmt_sizes

MeshAxes = str | tuple[str, ...] | None  # one candidate: a mesh axis, several (product), or None (replicate)


def _as_axes(cand: MeshAxes) -> tuple[str, ...]:
    if cand is None:
        return ()
    if isinstance(cand, str):
        return (cand,)
    return tuple(cand)


def _mesh_axes(cand: MeshAxes, mesh: Mesh) -> tuple[str, ...]:
    """A candidate's axes on this mesh: an optional axis the mesh lacks (size 1, `make_mesh` leaves it out) dropped."""
    return tuple(a for a in _as_axes(cand) if a in mesh.shape or a not in OPTIONAL_AXES)


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
                for axis in _mesh_axes(cand, mesh):
                    if axis not in mesh.shape:
                        raise ValueError(f"{self.name} rules: logical axis '{logical}' maps to mesh axis "
                                         f"'{axis}', which is not in the mesh {fmt_sizes(dict(mesh.shape))}")


_ACTIVATION_RULES: dict[str, Sequence[MeshAxes]] = {
    # The batch goes over `expert` too: the dense parts of a model (attention, the head, the loss) then split their
    # rows over every device instead of repeating them on each device of an expert group, and the sparse layer
    # gathers its group's rows itself (`moe.sparse_mlp`). No fallback without `expert` where it does not divide: the
    # step's batch sharding is one spec for every batch leaf, so an indivisible batch is an error (data.batch_size).
    "batch": [("data", "fsdp", "expert")],
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
    # A dense weight's embed dim goes over the expert axis too (an expert leaf's experts dim took it already), so a
    # dense student beside a MoE teacher is not replicated over the expert groups; fsdp alone where that does not divide.
    "embed": [("fsdp", "expert"), "fsdp"],
    "layers": [None],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": ["tensor", None],  # only where heads/kv_heads could not take `tensor` (used left to right)
    "mlp": ["tensor"],
    "experts": ["expert"],  # a MoE layer's experts: 1/expert of them per device
    "router_experts": [None],  # the router's E columns: whole everywhere (every device routes its own tokens)
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
    "experts": ["expert"],  # as in training: decoding runs each device's experts on the group's rows
    "router_experts": [None],
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
                axes = _mesh_axes(cand, mesh)
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
                        f"axis {' x '.join(axes)} (size {size}) of mesh {fmt_sizes(dict(mesh.shape))}; change the "
                        f"mesh or set on_indivisible='replicate'")
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
    if isinstance(shardings["layers"], (tuple, list)):  # already per layer (a mixed dense/sparse MoE schedule)
        return shardings
    layer = jax.tree.map(per_layer, shardings["layers"])
    return dict(shardings, layers=tuple(layer for _ in range(num_layers)))


def batch_sharding(mesh: Mesh, rules: AxisRules, shape: Sequence[int] | None = None, ndim: int = 2,
                   where: str = "batch") -> NamedSharding:
    """Sharding of a [B, T, ...] input/label array: B over the `batch` rule (data x fsdp), the rest replicated."""
    ndim = len(shape) if shape is not None else ndim
    logical = ("batch",) + (None,) * (ndim - 1)
    rules.check_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(logical, mesh, rules, shape, where))


def activation_sharding(logical: Sequence[str | None], mesh: Mesh, rules: AxisRules,
                        shape: Sequence[int] | None = None, where: str = "activation") -> NamedSharding:
    """E.g. logits: `activation_sharding(("batch", "length", "act_vocab"), mesh, rules, (B, T, V))`."""
    rules.check_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(tuple(logical), mesh, rules, shape, where))


def cache_logical_axes() -> dict[str, tuple[str, ...]]:
    """Logical axes of each per-layer KV-cache buffer {"k","v": L x [B, K, S, Dh]} from `transformer.init_cache`."""
    axes = ("batch", "act_kv_heads", "cache_length", "act_head_dim")
    return {"k": axes, "v": axes}
