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
