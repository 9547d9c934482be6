"""The OPD step's rollout through both engines: `sampling.slots` and `sampling.samples_per_prompt` change how the
rows are decoded, never what they sample; the loop's `rollout_useful_frac` counts the slot-steps spent."""

import jax
import numpy as np
import pytest

from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.run import model_sources
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from jopd.sampling.slots import slot_iterations
from tests.helpers.tiny_params import numpy_params

_ARCH = ["hidden_size=16", "intermediate_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim=8"]
BASE = ([f"{role}.arch.{a}" for role in ("student", "teacher") for a in _ARCH]
        + ["data.batch_size=4", "data.max_prompt_len=64", "sampling.max_new_tokens=12", "sampling.top_p=0.9",
           "data.arithmetic.max_steps=1", "train.mismatch=exact", "mesh.data=1", "loss.top_k=8"])


def _rollout(*overrides, devices=1):
    tok = build_toy_tokenizer()
    cfg = load_config(None, BASE + list(overrides))
    s_cfg, t_cfg = (model_sources.testbed_model_config(src, tok) for src in (cfg.student, cfg.teacher))
    step = build_step(cfg, s_cfg, (t_cfg,), M.make_mesh(cfg.mesh, jax.devices()[:devices]), tok)
    student = numpy_params(s_cfg, 0, layer_scale=5.0, head_scale=4.0)
    batch = next(train_iterator(cfg.data, tok, kind="prompt"))
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(step.init_state(student), batch, 3)
        scored = step.score(jax.device_put((numpy_params(t_cfg, 1),), step.shardings.teacher), rollout)
    return step, batch, rollout, jax.device_get(scored)


def test_samples_per_prompt_and_slots_change_the_schedule_not_the_samples():
    step, batch, static, scored = _rollout("sampling.samples_per_prompt=3")
    assert step.rollout_rows == 12 and static.sample.tokens_BxN.shape == (12, 12)
    np.testing.assert_array_equal(static.host_batch["index"], np.repeat(batch["index"], 3))
    np.testing.assert_array_equal(np.asarray(static.prompt_BxP), np.repeat(batch["prompt_tokens"], 3, axis=0))
    assert scored.tokens_BxS.shape[0] == 12
    lengths = np.asarray(static.sample.lengths_B)
    assert len(set(lengths.tolist())) > 2  # rows end apart
    # every row its own slot: until the longest row stops
    assert int(static.decode_iterations) == lengths.max() - 1 and static.slots == 12
    assert static.useful_fraction(lengths) == pytest.approx(lengths.sum() / (12 * lengths.max()))

    _, _, slots, scored_slots = _rollout("sampling.samples_per_prompt=3", "sampling.slots=4")
    for name in ("tokens_BxN", "lengths_B", "done_B"):
        np.testing.assert_array_equal(getattr(slots.sample, name), getattr(static.sample, name))
    np.testing.assert_allclose(np.asarray(slots.sample.logprobs_BxN), np.asarray(static.sample.logprobs_BxN),
                               atol=2e-5)
    np.testing.assert_allclose(scored_slots.loss.teacher_topk_logprobs_BxTxK, scored.loss.teacher_topk_logprobs_BxTxK,
                               atol=2e-5)
    assert slots.slots == 4
    iterations = int(slots.decode_iterations)
    assert iterations == slot_iterations(lengths, 4)  # the schedule the slot engine promises: no idle slot mid-run
    assert slots.useful_fraction(lengths) == pytest.approx(lengths.sum() / (12 + 4 * iterations))
    assert slots.useful_fraction(lengths) >= static.useful_fraction(lengths)


def test_fewer_prompts_than_shards_prefill_each_row_and_sample_the_same():
    # 4 prompts x 2 samples on 8 batch shards: a shard cannot hold a whole group, so each row prefills its copy
    one_shard, _, shared, _ = _rollout("sampling.samples_per_prompt=2")
    eight, _, rows, _ = _rollout("sampling.samples_per_prompt=2", "mesh.data=8", devices=8)
    assert one_shard.prefill_group == 2 and eight.prefill_group == 1 and eight.rollout_rows == 8
    for name in ("tokens_BxN", "lengths_B"):
        np.testing.assert_array_equal(np.asarray(getattr(rows.sample, name)), np.asarray(getattr(shared.sample, name)))
    np.testing.assert_array_equal(np.asarray(rows.prompt_BxP), np.asarray(shared.prompt_BxP))


def test_samples_per_prompt_must_agree_with_grpo_groups():
    with pytest.raises(ValueError, match=r"sampling.samples_per_prompt=3: loss.kind=grpo samples rl.group_size=4"):
        _rollout("loss.kind=grpo", "rl.group_size=4", "sampling.samples_per_prompt=3")
