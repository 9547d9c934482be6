"""A loss kind from outside the package: docs/examples/alpha_divergence.py (the file docs/extending.md shows),
imported by a run config's `plugins`, equals its numpy formula, tends to `topk_rkl_tail` as alpha -> 1, and
trains a tiny testbed run end to end."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from jopd import registry
from jopd.losses import LossBatch, LossConfig, token_loss_from_logits
from jopd.losses.kinds import OBJECTIVES, Objective
from jopd.run.loop import train
from jopd.run.config import load_config, to_yaml
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "alpha_divergence.py"
B, T, V, K = 3, 5, 23, 6


def _example():
    registry.load_plugins([str(EXAMPLE)])
    import sys
    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(EXAMPLE))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    s_logits = rng.normal(0, 2, (B, T, V)).astype(np.float32)
    t_logits = rng.normal(0, 2, (B, T, V)).astype(np.float32)
    t_logp = special.log_softmax(t_logits.astype(np.float64), -1)
    ids = np.argsort(-t_logp, -1)[..., :K].astype(np.int32)
    mask = np.arange(T)[None] < np.array([5, 3, 1])[:, None]
    batch = LossBatch(targets_BxT=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32), response_mask_BxT=jnp.asarray(mask),
                      teacher_topk_ids_BxTxK=jnp.asarray(ids),
                      teacher_topk_logprobs_BxTxK=jnp.asarray(np.take_along_axis(t_logp, ids, -1), jnp.float32))
    return s_logits, t_logp, ids, mask, batch


def test_alpha_divergence_equals_its_formula_and_tends_to_the_tail_reverse_kl():
    _example()
    assert {"alpha_0.5", "alpha_0.9"} <= set(OBJECTIVES)
    s_logits, t_logp, ids, mask, batch = _batch()
    s_logp = special.log_softmax(s_logits.astype(np.float64), -1)
    p, q = np.exp(np.take_along_axis(s_logp, ids, -1)), np.exp(np.take_along_axis(t_logp, ids, -1))
    for alpha in (0.5, 0.9):
        cfg = LossConfig(kind=f"alpha_{alpha}", top_k=K, support="teacher_topk")
        loss, metrics = token_loss_from_logits(cfg, jnp.asarray(s_logits), batch)
        mixed = (p ** alpha * q ** (1 - alpha)).sum(-1) + (1 - p.sum(-1)) ** alpha * (1 - q.sum(-1)) ** (1 - alpha)
        expected = ((mixed - 1) / (alpha * (alpha - 1)))[mask].mean()
        np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
        np.testing.assert_allclose(float(metrics["divergence"]), expected, rtol=2e-5)

    module = _example()
    OBJECTIVES.add("alpha_near_1", Objective(OBJECTIVES["alpha_0.5"].chunk_fields, (),
                                             module.alpha_divergence(1 - 1e-3)))
    try:
        near = float(token_loss_from_logits(LossConfig(kind="alpha_near_1", top_k=K, support="teacher_topk"),
                                            jnp.asarray(s_logits), batch)[0])
    finally:
        OBJECTIVES.remove("alpha_near_1")
    tail = float(token_loss_from_logits(LossConfig(kind="topk_rkl_tail", top_k=K, support="teacher_topk"),
                                        jnp.asarray(s_logits), batch)[0])
    assert tail > 0.1 and abs(near - tail) < 3e-3 * tail, (near, tail)


def test_alpha_divergence_gradient_matches_finite_differences():
    _example()
    s_logits, _, _, _, batch = _batch(seed=1)
    cfg = LossConfig(kind="alpha_0.5", top_k=K, support="teacher_topk")
    f = lambda z: token_loss_from_logits(cfg, z, batch)[0]  # noqa: E731
    z = jnp.asarray(s_logits, jnp.float64) if jax.config.jax_enable_x64 else jnp.asarray(s_logits)
    g = np.asarray(jax.grad(f)(z))
    rng = np.random.default_rng(2)
    for _ in range(3):
        d = rng.normal(size=z.shape).astype(np.float32)
        h = 1e-2
        fd = (float(f(z + h * d)) - float(f(z - h * d))) / (2 * h)
        np.testing.assert_allclose(float(np.sum(g * d)), fd, rtol=2e-2, atol=1e-4)


def test_loss_from_a_plugin_file_trains_end_to_end(tmp_path):
    path = write_tiny(tmp_path / "tiny.yaml", plugins=[str(EXAMPLE)], loss={"kind": "alpha_0.5", "top_k": 16},
                      train={"steps": 6}, optim={"learning_rate": 1e-2, "warmup_steps": 0})
    out = tmp_path / "run"
    summary = train(load_config(str(path), [f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}"]),
                    log=lambda *a: None)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in steps if "loss" in m]
    assert len(losses) == 6 and all(math.isfinite(x) and x > 0 for x in losses)
    assert all(m["num_tokens"] > 0 for m in steps if "loss" in m)
    assert "after" in summary
    assert load_config(str(out / "config.yaml")).loss.kind == "alpha_0.5"  # the saved config names the plugin


def test_an_unknown_kind_is_one_line_naming_the_registered_ones():
    from jopd.config_dataclass import ConfigError
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.kind: .*unknown loss kind 'nope' \(registered: topk_rkl,"):
        load_config(None, ["loss.kind=nope"])


def test_extending_doc_shows_the_example_file_as_it_is():
    doc = (EXAMPLE.parents[1] / "extending.md").read_text()
    section = doc.split("## A loss kind", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{EXAMPLE.read_text()}```" in section
    assert "plugins: [docs/examples/alpha_divergence.py]" in section and "kind: alpha_0.5" in section


def test_a_plugin_kinds_options_are_validated_from_yaml(tmp_path):
    """`loss.options` of the plugin's `alpha` kind: read from the YAML into its `AlphaOptions` (the loss then equals
    the fixed alpha_0.9's), saved and read back; a bad or unknown option, or options for a kind without them, is
    one line naming the field as the config loads."""
    from jopd.config_dataclass import ConfigError

    path = write_tiny(tmp_path / "tiny.yaml", plugins=[str(EXAMPLE)],
                      loss={"kind": "alpha", "options": {"alpha": 0.9}, "top_k": K, "support": "teacher_topk"})
    cfg = load_config(str(path))
    module = _example()
    assert cfg.loss.options == module.AlphaOptions(alpha=0.9)
    assert load_config(str(path), ["loss.options=null"]).loss.options.alpha == 0.5  # the kind's defaults
    s_logits, _, _, _, batch = _batch(seed=3)
    fixed = dataclasses.replace(cfg.loss, kind="alpha_0.9", options=None)
    assert float(token_loss_from_logits(cfg.loss, jnp.asarray(s_logits), batch)[0]) == \
        float(token_loss_from_logits(fixed, jnp.asarray(s_logits), batch)[0])
    saved = tmp_path / "saved.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(str(saved)).loss == cfg.loss
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.options.alpha: Input should be less than 1$"):
        load_config(str(path), ["loss.options.alpha=1.5"])
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.options.beta: unknown key$"):
        load_config(str(path), ["loss.options.beta=0.3"])
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.options: loss kind 'alpha_0.5' takes no options, "
                                          r"got \['alpha'\]$"):
        load_config(str(path), ["loss.kind=alpha_0.5"])
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.options: expected a mapping of loss kind 'alpha'"):
        load_config(str(path), ["loss.options=3"])


def test_a_moved_setting_points_to_its_new_place():
    """The built-in kinds' own settings, once `loss.*`, are `loss.options.*`: an earlier config still loads when
    its kind is the one that read it (a saved config's default values are dropped), else one line names the
    new place."""
    from jopd.config_dataclass import ConfigError

    assert load_config(None, ["loss.kind=jsd", "loss.jsd_beta=0.3"]).loss.options.beta == 0.3
    assert load_config(None, ["loss.kind=sampled_opd", "loss.gamma=0.9"]).loss.options.gamma == 0.9
    assert load_config(None, ["loss.jsd_beta=0.5", "loss.gamma=0.0", "loss.clip_eps=0.2"]).loss.options is None
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.jsd_beta: now loss.options.beta of loss.kind=jsd "
                                          r"\(loss.kind=rkl does not read it\)$"):
        load_config(None, ["loss.kind=rkl", "loss.jsd_beta=0.3"])
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.clip_eps=0.3 and loss.options.clip_eps=0.25: set "):
        load_config(None, ["loss.kind=grpo", "loss.clip_eps=0.3", "loss.options.clip_eps=0.25"])
