"""Random tiny transformers checkpoints for the I/O and parity tests (created in the test, never downloaded)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small original context so the tiny head dim's wavelengths fall in all three llama3 regimes
               "original_max_position_embeddings": 64}

# name -> (config class, kwargs): GQA / MQA / MHA, tied and untied heads, non-default theta, llama3 scaling,
# q/k/v biases (qwen2), q/k norm with head_dim != D/H (qwen3).
CASES = {
    "llama_untied_llama3": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False)),
    "llama_tied_mha": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen2_tied_mqa": (transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen2_untied": (transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=20000.0, tie_word_embeddings=False)),
    "qwen3_untied_hd24": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=20000.0, tie_word_embeddings=False)),
    "qwen3_tied": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)),
}
# Mixture-of-experts cases (tests/models/test_moe.py): every layer sparse, as released Qwen3-MoE checkpoints are;
# 8 experts, top-2, unnormalized gate weights
MOE_CASES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e6, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False)),
}


def make_hf_model(case: str, seed: int = 0, **overrides):
    """A random model whose norm weights and biases are non-trivial (HF init leaves them at 1 and 0); `overrides`
    change the case's config keys."""
    cls, kw = {**CASES, **MOE_CASES}[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **kw, **overrides}),
                                                          dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:  # larger than the 0.02 init so attention patterns are far from uniform
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


def right_padded_batch(vocab: int, lengths=(11, 7, 3), seed: int = 0):
    """Tokens [B,T] and attention mask [B,T] with real tokens first and padding (token 0) after."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    toks = rng.integers(1, vocab, (len(lengths), T))
    mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    return np.where(mask, toks, 0), mask


def hf_logits(model, tokens_BxT: np.ndarray, mask_BxT: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens_BxT), attention_mask=torch.as_tensor(mask_BxT.astype(np.int64)))
    return out.logits.float().numpy()
