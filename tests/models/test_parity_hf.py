"""Logit parity with transformers (PyTorch, fp32) for random tiny Llama / Qwen2 / Qwen3 checkpoints written by
`save_pretrained` and read back with `jopd.models.io.load_params` (no torch on the jopd side)."""

import glob
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import io
from jopd.models import transformer as T
from tests.helpers.hf_models import CASES, hf_logits, make_hf_model, right_padded_batch

TOL = 1e-4  # issue [A]: max |Δlogit| in fp32


def _max_delta(model, model_dir, **load_kw):
    cfg, params = io.load_params(model_dir, **load_kw)
    toks, mask = right_padded_batch(cfg.vocab_size)
    ours, _ = T.forward(params, jnp.asarray(toks), cfg=cfg, attn_mask_BxT=jnp.asarray(mask))
    ref = hf_logits(model, toks, mask)
    # Only real positions: padded queries have no defined output (HF even gives them different positions).
    return float(np.abs(np.asarray(ours) - ref)[mask].max()), float(np.abs(ref[mask]).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    model = make_hf_model(case)
    model.save_pretrained(tmp_path)
    delta, scale = _max_delta(model, tmp_path)
    print(f"\n[parity] {case}: max|Δlogit| = {delta:.2e} (max|logit| = {scale:.1f})")
    assert delta <= TOL


def test_sharded_index_checkpoint(tmp_path):
    model = make_hf_model("qwen3_untied_hd24", seed=3)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = glob.glob(str(tmp_path / "model-*.safetensors"))
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    assert len(set(weight_map.values())) == len(shards)
    delta, _ = _max_delta(model, tmp_path)
    print(f"\n[parity] qwen3 sharded index ({len(shards)} files): max|Δlogit| = {delta:.2e}")
    assert delta <= TOL


LONG = 2048


def test_long_context_logits_match_transformers_with_each_attention(tmp_path):
    """A tiny random Qwen3 (q/k norm, head dim != D / H) at 2k tokens, one row left-padded by a third (its real
    tokens still past 1k positions), with attention "xla" and "chunked" (its default blocks: several tiles a side).
    The positions count real tokens only, as jopd's do: transformers gets them as `position_ids`."""
    import torch

    model = make_hf_model("qwen3_untied_hd24", seed=5)
    model.save_pretrained(tmp_path)
    cfg, params = io.load_params(tmp_path)
    rng = np.random.default_rng(5)
    toks = rng.integers(1, cfg.vocab_size, (1, LONG))
    mask = np.ones((1, LONG), bool)
    mask[0, :LONG // 3] = False
    toks = np.where(mask, toks, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(toks), attention_mask=torch.as_tensor(mask.astype(np.int64)),
                    position_ids=torch.as_tensor(positions)).logits.float().numpy()
    for attention in ("xla", "chunked"):
        ours, _ = T.forward(params, jnp.asarray(toks), cfg=cfg, attn_mask_BxT=jnp.asarray(mask), attention=attention)
        delta, scale = float(np.abs(np.asarray(ours) - ref)[mask].max()), float(np.abs(ref[mask]).max())
        print(f"\n[parity] qwen3 at {LONG} tokens, attention {attention}: max|Δlogit| = {delta:.2e} "
              f"(max|logit| = {scale:.1f})")
        assert delta <= TOL and delta <= 1e-5 * scale
