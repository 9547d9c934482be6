"""HF model directories: `config.json` + safetensors (single file or sharded index) in, and export out.

Reading goes through `safetensors.safe_open(..., framework="np").get_slice(name)[...]` so only requested
rows/columns leave the disk (no torch anywhere on this path).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy

from jopd.models.config import ModelConfig
from jopd.models.families import FAMILIES
from jopd.models.hf_layout import hf_views

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}


def read_hf_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (an HF model directory needs config.json and "
                                f"{SINGLE_FILE} or {INDEX_FILE})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    try:
        return ModelConfig.from_hf_dict(data, source=str(path))
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


class SafetensorsSource:
    """Tensors of an HF directory by name, each readable by slices; file handles opened once, lazily."""

    def __init__(self, model_dir: Path):
        self.config_where = str(model_dir / "config.json")
        index_path = model_dir / INDEX_FILE
        single = model_dir / SINGLE_FILE
        if single.is_file():
            self._file_of = {name: single for name in self._keys(single)}
        elif index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index_path}: not a safetensors index (needs a 'weight_map'): {e}") from None
            self._file_of = {}
            for name, fname in weight_map.items():
                f = model_dir / fname
                if not f.is_file():
                    raise FileNotFoundError(f"{index_path}: lists {name} in {fname}, which does not exist")
                self._file_of[name] = f
        else:
            extra = " (only safetensors weights are supported)" if any(
                model_dir.glob("*.bin")) else ""
            raise FileNotFoundError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found{extra}")
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safetensors.safe_open(str(path), framework="np") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None

    def _handle(self, name: str):
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safetensors.safe_open(str(path), framework="np")
        return self._handles[path]

    def where(self, name: str) -> str:
        f = self._file_of.get(name)
        return str(f) if f is not None else str(next(iter(self._file_of.values()), "safetensors"))

    def display_name(self, name: str) -> str:
        return name

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._file_of:
            return None
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> np.dtype:
        st = self._handle(name).get_slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise ValueError(f"{self.where(name)}: {name} has dtype {st}, expected a float type")
        return np.dtype(_ST_DTYPES[st])

    def fetch(self, name: str, hf_index: tuple[slice, ...]) -> np.ndarray:
        return self._handle(name).get_slice(name)[hf_index]


def save_hf(params: dict[str, Any], cfg: ModelConfig, out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """Write `config.json` + `model.safetensors` (in the params' dtype) that transformers (and so vLLM) load
    directly, plus the tokenizer files when a tokenizer is given. Returns the directory."""
    for field, fixed in FAMILIES[cfg.family].switches().items():
        if getattr(cfg, field) != fixed:  # config.json has no key for these: the model type implies them
            raise ValueError(f"save_hf: ModelConfig.{field}={getattr(cfg, field)} cannot be expressed in an HF "
                             f"{cfg.family} config.json (it is {fixed} for that model type)")
    hf = cfg.to_hf_dict()
    implied = ModelConfig.from_hf_dict(hf, source="save_hf")
    if implied != cfg:
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(implied, f.name)]
        raise ValueError(f"save_hf: ModelConfig field(s) {', '.join(diff)} cannot be expressed in an HF "
                         f"{cfg.family} config.json")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = jax.device_get(params)
    dtype = np.asarray(host["embed"]).dtype
    views = hf_views(cfg)
    if jax.tree.structure(views) != jax.tree.structure(host):
        raise ValueError(f"save_hf: params do not have the structure that the config implies "
                         f"({jax.tree.structure(host)} vs {jax.tree.structure(views)})")
    tensors: dict[str, np.ndarray] = {}
    for (path, view), arr in zip(jax.tree.flatten_with_path(views)[0], jax.tree.leaves(host)):
        arr = np.asarray(arr).astype(dtype, copy=False)
        if view.per_layer:
            for i in range(cfg.num_layers):
                tensors.update(view.hf_tensors(arr[i], i))
        else:
            tensors.update(view.hf_tensors(arr))
    # "format": "pt" is what transformers checks for in the safetensors metadata.
    safetensors.numpy.save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    hf["dtype"] = hf["torch_dtype"] = dtype.name
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
