"""GGUF files (llama.cpp format) read through the `gguf` package: config from metadata, tensors dequantized
with numpy (`gguf.quants.dequantize`), presented under HF tensor names so `hf_layout` serves both formats.

The family comes from `general.architecture` (`Family.gguf_arch`); where llama.cpp's converter permuted the
rows of `attn_q`/`attn_k` (`Family.gguf_qk_permuted`: llama), `fetch` undoes that.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import quants

from jopd.models.config import ModelConfig
from jopd.models.families import FAMILIES, family_of_gguf_arch

_HF_TO_GGUF = [  # (HF name pattern, GGUF name template)
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "blk.{}.attn_q.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "blk.{}.attn_k.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "blk.{}.attn_v.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "blk.{}.attn_output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "blk.{}.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "blk.{}.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "blk.{}.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "blk.{}.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{}.ffn_down.weight"),
]

# F32/F16 are handled directly by `quants.dequantize`; the rest need a registered numpy implementation.
DEQUANTIZABLE = frozenset({QType.F32, QType.F16} | set(quants._type_traits))


def gguf_name(hf_name: str) -> str:
    for pattern, template in _HF_TO_GGUF:
        m = re.fullmatch(pattern, hf_name)
        if m:
            return template.format(*m.groups())
    raise KeyError(hf_name)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows (head, pair, 2) -> HF's (head, 2, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_READERS: dict[tuple[str, int, int], gguf.GGUFReader] = {}


def file_version(path: Path) -> tuple[str, int, int]:
    """A key that changes when the file at `path` is replaced or rewritten: (resolved path, size, mtime in ns)."""
    st = Path(path).stat()
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns


def _reader(path: Path) -> gguf.GGUFReader:
    """The file's reader, parsed once per file version per process (seconds for SmolLM2's 49152-token vocabulary
    metadata); it maps the file read-only, so callers can share it."""
    key = file_version(path)
    if key not in _READERS:
        try:
            _READERS[key] = gguf.GGUFReader(str(path))
        except Exception as e:  # the reader raises ValueError/struct errors on a corrupt header
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    return _READERS[key]


class GGUFSource:
    """Tensors of one GGUF file under their HF names, dequantized to float32 one whole tensor at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = _reader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config_where = f"{path} (GGUF metadata)"
        self.cfg = self._config()

    # ---- metadata ----
    def _field(self, key: str, default: Any = None, required: bool = False):
        f = self.reader.fields.get(key)
        if f is None:
            if required:
                raise ValueError(f"{self.path}: GGUF metadata lacks {key}")
            return default
        return f.contents()

    def _config(self) -> ModelConfig:
        arch = self._field("general.architecture", required=True)
        family = FAMILIES[family_of_gguf_arch(arch, str(self.path))]
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path}: tensor rope_freqs.weight (llama.cpp's RoPE frequency scaling) is not "
                             f"supported; convert the HF checkpoint instead")
        a = lambda key, **kw: self._field(f"{arch}.{key}", **kw)  # noqa: E731
        heads = int(a("attention.head_count", required=True))
        hidden = int(a("embedding_length", required=True))
        vocab = a("vocab_size")
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else int(self.tensors["token_embd.weight"].shape[1])
        hf = {
            "model_type": family.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(a("feed_forward_length", required=True)),
            "num_hidden_layers": int(a("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(a("attention.head_count_kv", default=heads)),
            "head_dim": int(a("attention.key_length", default=hidden // heads)),
            "rope_theta": float(a("rope.freq_base", default=10000.0)),
            "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", default=1e-6)),
            "max_position_embeddings": int(a("context_length", default=2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
        }
        return ModelConfig.from_hf_dict(hf, source=self.config_where)

    # ---- tensors, by HF name ----
    def where(self, name: str) -> str:
        return str(self.path)

    def display_name(self, name: str) -> str:
        return gguf_name(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(gguf_name(name))
        return None if t is None else tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims inner-first

    def dtype(self, name: str) -> np.dtype:
        t = self.tensors[gguf_name(name)]
        if t.tensor_type not in DEQUANTIZABLE:
            raise ValueError(f"{self.path}: tensor {t.name} has quantization type {t.tensor_type.name}, which the "
                             f"gguf package cannot dequantize (supported: "
                             f"{', '.join(sorted(q.name for q in DEQUANTIZABLE))})")
        return np.dtype(np.float32)

    def fetch(self, name: str, hf_index: tuple[slice, ...]) -> np.ndarray:
        t = self.tensors[gguf_name(name)]
        w = quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if FAMILIES[self.cfg.family].gguf_qk_permuted and re.search(r"\.(q|k)_proj\.", name):
            n = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
            w = llama_unpermute(w, n)
        return np.asarray(w[hf_index], np.float32)
