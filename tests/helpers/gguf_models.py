"""Write a tiny GGUF file from a transformers model the way llama.cpp's converter does (names from the gguf
package's own `TensorNameMap`, llama q/k rows permuted with the converter's formula), for tests."""

from __future__ import annotations

import gguf
import numpy as np

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave the two halves of each head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, *, arch_name: str | None = None,
               raw_types: dict[str, gguf.GGMLQuantizationType] | None = None, drop: tuple[str, ...] = ()) -> None:
    """`raw_types` maps GGUF tensor names to a type to declare for them (bytes are written unchecked), to make
    files that carry quantization types jopd cannot read; `drop` omits GGUF tensors."""
    c = hf_model.config
    family = c.model_type
    L, H, K = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // H
    w = gguf.GGUFWriter(str(path), arch_name or family)
    w.add_block_count(L)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    if head_dim != c.hidden_size // H:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = gguf.get_tensor_name_map(ARCH[family], L)
    raw_types = raw_types or {}
    for hf_name, t in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name in drop:
            continue
        arr = t.detach().float().numpy()
        if family == "llama" and ".q_proj." in hf_name:
            arr = llamacpp_permute(arr, H)
        elif family == "llama" and ".k_proj." in hf_name:
            arr = llamacpp_permute(arr, K)
        if name in raw_types:
            qt = raw_types[name]
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * nbytes), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
