"""The SFT model cache shared by runs that start at once (a sweep's runs, the test suite's workers): each writes its
own temporary directory, and the one that finds the entry already cached by another keeps that copy and goes on."""

import os

import jax
import numpy as np

from jopd.run import model_sources, warm_start
from jopd.run.config import load_config

ARCH = ["hidden_size=16", "intermediate_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim=8"]


def test_a_run_that_finds_its_model_cached_by_another_meanwhile_keeps_that_copy(tmp_path, monkeypatch):
    cfg = load_config(None, [f"student.arch.{a}" for a in ARCH] + [
        "student.warm_start.steps=2", "student.warm_start.batch_size=4", f"train.cache_dir={tmp_path}"])
    tok = model_sources.run_tokenizer(cfg)
    real_save, saved = warm_start.io.save_hf, []

    def save_while_another_run_caches_it(params, model_cfg, path, **kw):
        entry = path.with_name(path.name.rsplit(".tmp", 1)[0])
        real_save(params, model_cfg, entry, **kw)  # the other run (same recipe, same key) lands first
        saved.append(path)
        real_save(params, model_cfg, path, **kw)

    monkeypatch.setattr(warm_start.io, "save_hf", save_while_another_run_caches_it)
    _, params, where = model_sources.get_model("student", cfg.student, cfg, tok)
    assert where.endswith("(trained now)") and len(saved) == 1
    assert saved[0].name.endswith(f".tmp{os.getpid()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [saved[0].name.rsplit(".tmp", 1)[0]]  # no tmp left
    monkeypatch.undo()
    _, cached, where = model_sources.get_model("student", cfg.student, cfg, tok)
    assert where.endswith("(cached)")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(cached)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
