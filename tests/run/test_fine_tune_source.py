"""A checkpoint `path` with `warm_start.steps` > 0 is fine-tuned on the task by SFT, then cached; steps=0 (the
default for a path) uses the checkpoint as it is."""

import jax
import numpy as np

from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io, transformer
from jopd.models.config import ModelConfig
from jopd.run.model_sources import get_model
from jopd.run.config import load_config
from jopd.run.warm_start import sft_key

TOK = build_toy_tokenizer()
START = ModelConfig(family="llama", vocab_size=len(TOK), hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True, max_position_embeddings=128,
                    bos_token_id=TOK.bos_token_id, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)


def _config(tmp_path, ckpt, *extra):
    return load_config(None, [f"student.path={ckpt}", "student.num_layers=1", f"train.cache_dir={tmp_path / 'cache'}",
                              "data.arithmetic.max_steps=1", "student.warm_start.batch_size=8",
                              "student.warm_start.learning_rate=1e-2", "student.warm_start.warmup_steps=0", *extra])


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_fine_tuned_checkpoint_is_trained_cached_and_keyed_by_its_recipe(tmp_path):
    ckpt = io.save_hf(jax.device_get(transformer.init_params(START, jax.random.key(0))), START, tmp_path / "start",
                      tokenizer=TOK)
    as_is_cfg = _config(tmp_path, ckpt)
    _, as_is, where = get_model("student", as_is_cfg.student, as_is_cfg, TOK)
    assert "cached" not in where and "trained" not in where
    _, truncated = io.load_params(ckpt, num_layers=1)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(as_is), _leaves(truncated)))

    cfg = _config(tmp_path, ckpt, "student.warm_start.steps=4")
    model_cfg, tuned, where = get_model("student", cfg.student, cfg, TOK)
    assert where.endswith("(trained now)") and "sft-student-" in where
    assert model_cfg.num_layers == 1
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(tuned), _leaves(truncated)))

    _, again, where = get_model("student", cfg.student, cfg, TOK)
    assert where.endswith("(cached)")
    assert all(np.allclose(a, b) for a, b in zip(_leaves(again), _leaves(tuned)))

    other = _config(tmp_path, ckpt, "student.warm_start.steps=4", "student.warm_start.learning_rate=2e-2")
    keys = {sft_key("student", c.student, c.data, TOK) for c in (cfg, other)}
    assert len(keys) == 2  # a different recipe never reuses the entry
    two_layers = _config(tmp_path, ckpt, "student.warm_start.steps=4", "student.num_layers=2")
    assert sft_key("student", two_layers.student, two_layers.data, TOK) not in keys


def test_sft_loss_projecting_only_response_positions_equals_the_full_projection():
    from jopd.data.pipeline import DataConfig, train_iterator
    from jopd.opd.student_loss import sft_loss_fn

    data = DataConfig(batch_size=4, max_prompt_len=128, max_response_len=64, arithmetic={"max_steps": 1})
    b = next(train_iterator(data, TOK, kind="sft"))
    batch = {k: b[k] for k in ("tokens", "attn_mask", "loss_mask")}
    params = transformer.init_params(START, jax.random.key(1))
    full, _ = sft_loss_fn(START)(params, batch)
    sliced, _ = sft_loss_fn(START, response_from=data.max_prompt_len)(params, batch)
    np.testing.assert_allclose(float(sliced), float(full), rtol=1e-6)
