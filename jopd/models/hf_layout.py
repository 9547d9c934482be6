"""Correspondence between jopd's params layout and HF tensor names/layouts (used by every reader and the export).

Each jopd leaf is cut from one HF tensor per layer: `hf_tensor.reshape(split).transpose(perm)`, e.g. HF
`q_proj.weight` [H*Dh, D] -> split (H, Dh, D) -> perm (2, 0, 1) -> jopd q[i] [D, H, Dh]. The same description
turns a jopd index (tuple of slices) into the HF rows/columns to read, and jopd arrays back into HF tensors.
An expert leaf (a MoE layer's, [E, ...] per layer) stacks E such tensors, one per expert (`mlp.experts.{e}.*`, the
layout of released checkpoints and of transformers' `save_pretrained`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jopd.models.config import ModelConfig
from jopd.models.transformer import param_shapes

LAYER = "{i}"  # placeholder for the layer number in per-layer HF names
EXPERT = "{e}"  # placeholder for the expert number in per-expert HF names


@dataclasses.dataclass(frozen=True)
class TensorView:
    """jopd (per-layer) array = HF tensor `name`.reshape(flattened split).transpose(perm)."""

    name: str  # HF tensor name; contains "{i}" for per-layer tensors
    split: tuple[tuple[int, ...], ...]  # for each HF axis, the sizes it is split into (outer first)
    perm: tuple[int, ...]  # jopd axis j is split axis perm[j]
    experts: int = 0  # > 0: `name` holds "{e}"; the jopd array stacks that many tensors on a leading axis

    @property
    def per_layer(self) -> bool:
        return LAYER in self.name

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Shape of each HF tensor (one expert's, for per-expert tensors)."""
        return tuple(math.prod(g) for g in self.split)

    @property
    def jopd_shape(self) -> tuple[int, ...]:
        """Shape of the jopd array (one layer's, for per-layer tensors; [E, ...] for per-expert ones)."""
        flat = [n for g in self.split for n in g]
        return (self.experts,) * bool(self.experts) + tuple(flat[p] for p in self.perm)

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        name = self.name.replace(LAYER, str(layer)) if self.per_layer else self.name
        return name.replace(EXPERT, str(expert)) if self.experts else name

    def hf_names(self, layer: int | None = None) -> list[str]:
        """The HF tensors of one layer's jopd array (or of the whole array, for a view that is not per-layer)."""
        return [self.hf_name(layer, e) for e in range(self.experts)] if self.experts else [self.hf_name(layer)]

    def read_named(self, fetch_named, index: tuple[slice, ...], layer: int | None = None) -> np.ndarray:
        """`read` of one layer's jopd array through `fetch_named(hf_name, hf_index)`; an expert view reads only
        the experts `index[0]` selects."""
        if not self.experts:
            name = self.hf_name(layer)
            return self.read(lambda hf_index: fetch_named(name, hf_index), index)
        blocks = [self.read(lambda hf_index, n=self.hf_name(layer, e): fetch_named(n, hf_index), index[1:])
                  for e in range(index[0].start, index[0].stop)]
        return np.stack(blocks) if blocks else np.zeros([0, *(s.stop - s.start for s in index[1:])])

    def hf_tensors(self, arr: np.ndarray, layer: int | None = None) -> dict[str, np.ndarray]:
        """One layer's jopd array (or the whole, not per-layer) -> its HF tensors by name."""
        if self.experts:
            return {self.hf_name(layer, e): self.to_hf(arr[e]) for e in range(self.experts)}
        return {self.hf_name(layer): self.to_hf(arr)}

    def read(self, fetch, index: tuple[slice, ...]) -> np.ndarray:
        """Read jopd[index] through `fetch(hf_index) -> hf_tensor[hf_index]`, fetching only needed rows/cols (one
        HF tensor: for an expert view, one expert's array).

        A split HF axis (e.g. H*Dh) is read over the outer slice's whole blocks and the inner slice is applied
        after reshaping, so a slice over heads reads only those heads' rows.
        """
        flat_split = [n for g in self.split for n in g]
        split_index: list[slice] = [slice(0, n) for n in flat_split]
        for j, s in enumerate(index):
            split_index[self.perm[j]] = s
        hf_index, local_shape, inner_index, axis = [], [], [], 0
        for group in self.split:
            outer = split_index[axis]
            inner_size = math.prod(group[1:])
            hf_index.append(slice(outer.start * inner_size, outer.stop * inner_size))
            local_shape.extend([outer.stop - outer.start, *group[1:]])
            inner_index.extend([slice(None), *split_index[axis + 1: axis + len(group)]])
            axis += len(group)
        block = np.asarray(fetch(tuple(hf_index)))
        return block.reshape(local_shape)[tuple(inner_index)].transpose(self.perm)

    def to_hf(self, arr: np.ndarray) -> np.ndarray:
        """Inverse of the view: one layer's jopd array (one expert's) -> the HF tensor."""
        return np.ascontiguousarray(np.transpose(arr, np.argsort(self.perm)).reshape(self.hf_shape))


def _layer_views(cfg: ModelConfig, sparse: bool, pre: str) -> dict[str, TensorView]:
    """One decoder layer's views; `pre` is its HF name prefix ("model.layers.{i}." for a stack)."""
    D, H, K, Dh, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    attn = pre + "self_attn."

    def vec(name, n):
        return TensorView(name, ((n,),), (0,))

    layers = {
        "attn_norm": vec(pre + "input_layernorm.weight", D),
        "q": TensorView(attn + "q_proj.weight", ((H, Dh), (D,)), (2, 0, 1)),
        "k": TensorView(attn + "k_proj.weight", ((K, Dh), (D,)), (2, 0, 1)),
        "v": TensorView(attn + "v_proj.weight", ((K, Dh), (D,)), (2, 0, 1)),
        "o": TensorView(attn + "o_proj.weight", ((D,), (H, Dh)), (1, 2, 0)),
        "mlp_norm": vec(pre + "post_attention_layernorm.weight", D),
    }
    if sparse:
        experts = pre + "mlp.experts." + EXPERT + "."
        layers["router"] = TensorView(pre + "mlp.gate.weight", ((E,), (D,)), (1, 0))
        layers["expert_gate"] = TensorView(experts + "gate_proj.weight", ((I,), (D,)), (1, 0), experts=E)
        layers["expert_up"] = TensorView(experts + "up_proj.weight", ((I,), (D,)), (1, 0), experts=E)
        layers["expert_down"] = TensorView(experts + "down_proj.weight", ((D,), (I,)), (1, 0), experts=E)
    else:
        layers["gate"] = TensorView(pre + "mlp.gate_proj.weight", ((F,), (D,)), (1, 0))
        layers["up"] = TensorView(pre + "mlp.up_proj.weight", ((F,), (D,)), (1, 0))
        layers["down"] = TensorView(pre + "mlp.down_proj.weight", ((D,), (F,)), (1, 0))
    if cfg.qkv_bias:
        layers["q_bias"] = TensorView(attn + "q_proj.bias", ((H, Dh),), (0, 1))
        layers["k_bias"] = TensorView(attn + "k_proj.bias", ((K, Dh),), (0, 1))
        layers["v_bias"] = TensorView(attn + "v_proj.bias", ((K, Dh),), (0, 1))
    if cfg.qk_norm:
        layers["q_norm"] = vec(attn + "q_norm.weight", Dh)
        layers["k_norm"] = vec(attn + "k_norm.weight", Dh)
    return layers


def hf_views(cfg: ModelConfig) -> dict[str, Any]:
    """Pytree with the structure of `param_shapes(cfg)` whose leaves are `TensorView`s (a mixed dense/sparse
    schedule's per-layer dicts name their layer's tensors outright: those views are not per-layer)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    if cfg.uniform_layers:
        layers: Any = _layer_views(cfg, bool(cfg.sparse_layers), "model.layers." + LAYER + ".")
    else:
        layers = tuple(_layer_views(cfg, cfg.is_sparse(i), f"model.layers.{i}.") for i in range(cfg.num_layers))
    out: dict[str, Any] = {
        "embed": TensorView("model.embed_tokens.weight", ((V,), (D,)), (0, 1)),
        "final_norm": TensorView("model.norm.weight", ((D,),), (0,)),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = TensorView("lm_head.weight", ((V,), (D,)), (1, 0))
    _check_matches_param_shapes(cfg, out)
    return out


def _check_matches_param_shapes(cfg: ModelConfig, views: dict[str, Any]) -> None:
    # Guards against the params layout changing in transformer.py without this table following.
    def walk(shapes, vs, path):
        if isinstance(shapes, tuple):  # a mixed schedule's per-layer dicts
            assert isinstance(vs, tuple) and len(vs) == len(shapes), (path, type(vs))
            for i, (s, v) in enumerate(zip(shapes, vs)):
                walk(s, v, f"{path}{i}/")
            return
        assert shapes.keys() == vs.keys(), (path, shapes.keys(), vs.keys())
        for k, spec in shapes.items():
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], tuple)):  # not a leaf
                walk(spec, vs[k], f"{path}{k}/")
                continue
            v = vs[k]
            got = v.jopd_shape
            want = spec[0][1:] if v.per_layer else spec[0]
            assert got == want, (path + k, got, want)

    walk(param_shapes(cfg), views, "")


def normalize_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Turn an index from `jax.make_array_from_callback` (slices, maybe open-ended or short) into explicit
    unit-step slices over every axis."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice):
            raise ValueError(f"LazyParam.read: index entries must be slices, got {s!r}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"LazyParam.read: slice step must be 1, got {step}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)
