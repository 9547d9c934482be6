"""Export round trip: jopd params -> `save_hf` -> transformers loads the directory -> same logits; and
`load_params` of the exported directory gives back identical params (fp32 and bf16), tokenizer included."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from jopd import cli
from jopd.commands import generate as G
from jopd.data.chat import user_prompt_ids
from jopd.models import io
from jopd.models import transformer as T
from jopd.models.config import ModelConfig, RopeScaling
from tests.helpers.hf_models import hf_logits, right_padded_batch

BASE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama_untied_llama3": ModelConfig(family="llama", rope_theta=5000.0, tie_word_embeddings=False,
                                       rope_scaling=RopeScaling(original_max_position_embeddings=64), **BASE),
    "qwen2_tied": ModelConfig(family="qwen2", rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True, **BASE),
    "qwen3_untied_hd24": ModelConfig(family="qwen3", rope_theta=2e4, tie_word_embeddings=False, qk_norm=True,
                                     **{**BASE, "head_dim": 24}),
}


def random_params(cfg: ModelConfig, seed: int = 0):
    """All leaves random (norms around 1, biases non-zero), so every tensor's placement matters (numpy RNG:
    no per-shape jit compiles)."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        base = 1.0 if path[-1].key.endswith("norm") else 0.0
        return jnp.asarray(base + 0.15 * rng.standard_normal(shape), jnp.float32)

    return jax.tree.map_with_path(leaf, jax.tree.map(lambda s: s.shape, T.abstract_params(cfg)),
                                  is_leaf=lambda x: isinstance(x, tuple))


def _ours(params, cfg, toks, mask):
    logits, _ = T.forward(jax.tree.map(lambda a: a.astype(jnp.float32), params), jnp.asarray(toks), cfg=cfg,
                          attn_mask_BxT=jnp.asarray(mask))
    return np.asarray(logits)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_export_loads_in_transformers_with_same_logits(case, tmp_path):
    cfg = CONFIGS[case]
    params = random_params(cfg)
    io.save_hf(params, cfg, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[cfg.family]
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings == cfg.tie_word_embeddings
    toks, mask = right_padded_batch(cfg.vocab_size, seed=1)
    delta = float(np.abs(_ours(params, cfg, toks, mask) - hf_logits(model, toks, mask))[mask].max())
    print(f"\n[export] {case}: max|Δlogit| jopd vs transformers(exported) = {delta:.2e}")
    assert delta <= 1e-5
    cfg2, params2 = io.load_params(tmp_path)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params2, params)


def test_export_bf16_keeps_dtype(tmp_path):
    cfg = CONFIGS["qwen2_tied"]
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), random_params(cfg, seed=4))
    io.save_hf(params, cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    _, lazy = io.open_checkpoint(tmp_path)
    assert lazy["embed"].dtype == jnp.bfloat16
    _, back = io.load_params(tmp_path, dtype=jnp.bfloat16)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    toks, mask = right_padded_batch(cfg.vocab_size, seed=2)
    # bf16 weights upcast exactly on both sides, so fp32 logits agree as tightly as in the fp32 test.
    assert np.abs(_ours(params, cfg, toks, mask) - hf_logits(model, toks, mask))[mask].max() <= 1e-5


def test_export_rejects_config_not_expressible_in_hf(tmp_path):
    cfg = dataclasses.replace(CONFIGS["llama_untied_llama3"], qkv_bias=True)
    with pytest.raises(ValueError, match="qkv_bias"):
        io.save_hf(random_params(cfg), cfg, tmp_path)


def tiny_tokenizer():
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world", "the", "sea", "is", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    return fast


def test_export_with_tokenizer_and_generate_command(tmp_path, capsys):
    cfg = CONFIGS["qwen2_tied"]
    params = random_params(cfg, seed=9)
    tok = tiny_tokenizer()
    io.save_hf(params, cfg, tmp_path, tokenizer=tok)
    back = io.load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hello the sea"}]
    ids = user_prompt_ids(back, "hello the sea")
    assert back.chat_template == tok.chat_template
    direct = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == direct["input_ids"]
    assert ids == [1, 3, 5, 7, 8, 2, 1, 4]

    # `jopd generate` on the exported dir prints transformers' greedy text for the same model.
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "hello the sea", "--max-new-tokens", "6"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model.generation_config.eos_token_id = None  # compare all 6 steps; the command cuts at EOS itself
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=6, do_sample=False)[0, len(ids):].numpy()
    expected = back.decode(G.cut_at_eos(ref, cfg.eos_ids), skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()
