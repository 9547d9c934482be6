"""`sampling.mesh`: the sampler on a mesh of its own over the trainer's devices (here the trainer's fsdp=8 beside a
sampler's data=2 x tensor=4) samples the same rollouts as on the trainer's mesh, and the step scores and updates
them to the same loss; its weights are really split over the sampler's `tensor`; bad layouts are one-line errors."""

import jax
import numpy as np
import pytest

from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from jopd.run import model_sources
from jopd.run.config import load_config
from tests.helpers.tiny_params import numpy_params

# heads and kv heads divisible by tensor=4
_ARCH = ["hidden_size=16", "intermediate_size=32", "num_layers=1", "num_heads=4", "num_kv_heads=4", "head_dim=4"]
BASE = ([f"{role}.arch.{a}" for role in ("student", "teacher") for a in _ARCH]
        + ["data.batch_size=8", "data.max_prompt_len=48", "sampling.max_new_tokens=8", "sampling.top_p=0.9",
           "data.arithmetic.max_steps=1", "mesh.data=1", "mesh.fsdp=8", "loss.top_k=8",
           "optim.learning_rate=1e-2", "optim.warmup_steps=0"])


def _build(*overrides):
    tok = build_toy_tokenizer()
    cfg = load_config(None, BASE + list(overrides))
    s_cfg, t_cfg = (model_sources.testbed_model_config(src, tok) for src in (cfg.student, cfg.teacher))
    return build_step(cfg, s_cfg, (t_cfg,), M.make_mesh(cfg.mesh), tok), tok, s_cfg, t_cfg


def _run(*overrides):
    """One step (rollout, scoring, update) from fixed params and seeds: (step, rollout, scored batch, metrics)."""
    step, tok, s_cfg, t_cfg = _build(*overrides)
    batch = next(train_iterator(step.cfg.data, tok, kind="prompt"))
    teacher = jax.device_put((numpy_params(t_cfg, 1),), step.shardings.teacher)
    with jax.set_mesh(step.mesh):
        state = step.init_state(numpy_params(s_cfg, 0, layer_scale=5.0, head_scale=4.0))
        rollout = step.rollout(state, batch, 3)
        scored = step.score(teacher, rollout)
        _, metrics = step.update(state, scored)
    return step, rollout, jax.device_get(scored), jax.device_get(metrics)


# the toy vocabulary (103 ids) splits over no tensor axis: replicated there, the heads and the mlp split
LAYOUT = ["sampling.mesh.data=2", "sampling.mesh.tensor=4", "sampling.mesh.on_indivisible=replicate"]


@pytest.mark.slow
def test_a_sampler_mesh_of_its_own_samples_and_trains_the_same():
    # 2 samples per prompt: the sampler prefills each of the 8 prompts once on its 2 batch shards, and the trainer
    # gets all 16 rows on its 8
    ref_step, ref, ref_scored, ref_m = _run("sampling.samples_per_prompt=2")
    step, got, scored, m = _run("sampling.samples_per_prompt=2", *LAYOUT)
    assert not ref_step.shardings.own_sampler_layout and step.shardings.own_sampler_layout
    tensor = 4
    assert dict(step.sampler_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": tensor}
    assert step.prefill_group == ref_step.prefill_group == 2 and step.rollout_rows == 16
    assert list(step.sampler_mesh.devices.flat) == list(step.mesh.devices.flat)  # the trainer's devices, in order
    # the rollout weights: heads split over the sampler's tensor axis, nothing over the trainer's fsdp
    q = step.shardings.sampler_params["layers"][0]["q"]
    assert q.mesh is step.sampler_mesh and "tensor" in q.spec and "fsdp" not in q.spec
    assert "fsdp" in str(step.shardings.student["layers"]["q"].spec)
    assert step.sampler.shards == 8 // tensor and step.batch_shards == 8
    # handed to scoring on the trainer's batch layout
    assert got.sample.tokens_BxN.sharding.is_equivalent_to(step.shardings.batch, 2)
    assert got.prompt_BxP.sharding.is_equivalent_to(step.shardings.batch, 2)
    for name in ("tokens_BxN", "lengths_B", "done_B"):
        np.testing.assert_array_equal(np.asarray(getattr(got.sample, name)), np.asarray(getattr(ref.sample, name)))
    assert len(set(np.asarray(ref.sample.lengths_B).tolist())) > 1  # rows end apart: a real sample
    for name in ("logprobs_BxN", "unprocessed_logprobs_BxN"):
        np.testing.assert_allclose(np.asarray(getattr(got.sample, name)), np.asarray(getattr(ref.sample, name)),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.prompt_BxP), np.asarray(ref.prompt_BxP))
    np.testing.assert_array_equal(np.asarray(got.prompt_mask_BxP), np.asarray(ref.prompt_mask_BxP))
    np.testing.assert_allclose(scored.loss.teacher_topk_logprobs_BxTxK, ref_scored.loss.teacher_topk_logprobs_BxTxK,
                               rtol=1e-5, atol=1e-6)
    assert float(ref_m["loss"]) > 0
    np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["sampling.mesh.tensor=3"], r"^sampling.mesh.tensor=3: does not divide the 8 devices"),
    (["sampling.mesh.data=4", "sampling.mesh.tensor=4"],
     r"^sampling.mesh.data=4 x sampling.mesh.tensor=4: 16 devices, but the trainer's mesh has 8"),
    (["sampling.mesh.data=1", "sampling.mesh.tensor=8"],  # the vocabulary's 103 ids, or the 4 heads
     (r"^sampling.mesh.tensor=8: \S+: dim \d \(logical axis '\w+', size \d+\) is not divisible by mesh axis tensor "
      r"\(size 8\)")),
    (["sampling.mesh.data=8", "data.batch_size=4"],
     r"^sampling.mesh.data x sampling.mesh.fsdp \(4 rollouts: data.batch_size 4 x 1 per prompt\): dim 0"),
])
def test_bad_sampler_layouts_are_one_line_errors(overrides, message):
    # (the trainer's fsdp=8 would refuse 4 rows first: a trainer of tensor=2 keeps 4 batch shards)
    base = ["mesh.fsdp=4", "mesh.tensor=2", "mesh.on_indivisible=replicate"] if "data.batch_size=4" in overrides else []
    with pytest.raises(ValueError, match=message) as e:
        _build(*base, *overrides)
    assert "\n" not in str(e.value)
