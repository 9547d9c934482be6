"""Several teachers in the step (`opd.routing`, `opd.scoring`): routing by task scores each row with its own teacher only (on one
device and sharded), the mixture is the weighted mixture of the teachers' distributions (against numpy), one
teacher in `teachers` is today's step bit for bit, and the per-task metrics are those rows' own."""

import dataclasses

import jax
import numpy as np
import pytest

from jopd.losses import LossConfig
from jopd.losses.compute import per_task_means
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import RolloutArrays, sequence_layout
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.opd.teacher_scoring import teacher_fields
from jopd.opd.routing import shard_order
from jopd.parallel import mesh as M
from jopd.sampling.config import SampleOutput
from tests.helpers.tiny_params import numpy_params

V = 64
STUDENT = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=8)
T_A = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8)
T_B = ModelConfig(vocab_size=V, hidden_size=24, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=12, tie_word_embeddings=False)
LOSS = LossConfig(top_k=6, chunk_size=4)  # the default kind: topk_rkl_tail on the union support
B, P, N = 8, 5, 6
MIX = ["data.mix={arithmetic: 1, counting: 1}"]
TWO = ["teachers=[{name: arith, tasks: [arithmetic]}, {name: count, tasks: [counting], weight: 3}]"]


def _cfg(*overrides, loss=LOSS):
    cfg = load_config(None, [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
                             "train.mismatch=estimators", "optim.warmup_steps=0", *overrides])
    return dataclasses.replace(cfg, loss=loss)


def _rollout(task_B=None):
    rng = np.random.RandomState(0)
    prompt = rng.randint(4, V, (B, P)).astype(np.int32)
    pmask = np.arange(P)[None] >= rng.randint(0, 3, (B, 1))
    lengths = rng.randint(1, N + 1, B).astype(np.int32)
    tokens = np.where(np.arange(N)[None] < lengths[:, None], rng.randint(3, V, (B, N)), 0).astype(np.int32)
    logp = np.where(np.arange(N)[None] < lengths[:, None], rng.normal(-2, 0.5, (B, N)), 0).astype(np.float32)
    topk = np.argsort(rng.rand(B, N, V), axis=-1)[..., :LOSS.top_k].astype(np.int32)
    sample = SampleOutput(tokens_BxN=tokens, lengths_B=lengths, logprobs_BxN=logp, unprocessed_logprobs_BxN=logp,
                          done_B=np.ones(B, bool), topk_ids_BxNxK=topk)
    task = None if task_B is None else np.asarray(task_B, np.int32)
    return RolloutArrays(prompt_BxP=prompt, prompt_mask_BxP=pmask, sample=sample, task_B=task)


TEACHERS = (jax.tree.map(lambda x: 3 * x, numpy_params(T_A, seed=1)),
            jax.tree.map(lambda x: 3 * x, numpy_params(T_B, seed=2)))
KEYS = ("teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK", "support_mask_BxTxK", "teacher_target_logprobs_BxT")


def _alone(i, rollout):
    """Teacher i's fields on the whole batch, by the one-teacher scoring (the reference)."""
    s = rollout.sample
    layout = sequence_layout(rollout.prompt_BxP, rollout.prompt_mask_BxP, s.tokens_BxN, s.lengths_B)
    cfg = dataclasses.replace(LOSS, temperature=1.0)
    return jax.device_get(teacher_fields(TEACHERS[i], layout, teacher_cfg=(T_A, T_B)[i], loss_cfg=cfg,
                                         student_topk_ids_BxNxK=s.topk_ids_BxNxK))


MESH8 = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
# the same two teachers, the second held whole on every device (`placement: replicated`)
TWO_PLACED = ["teachers=[{name: arith, tasks: [arithmetic]}, {name: count, tasks: [counting], weight: 3, "
              "placement: replicated}]"]


@pytest.mark.parametrize("devices,mesh,teachers", [(1, ["mesh.data=1"], TWO), (8, MESH8, TWO), (8, MESH8, TWO_PLACED)],
                         ids=["1dev", "8dev-fsdp", "8dev-replicated"])
def test_routing_by_task_scores_each_row_with_its_own_teacher(devices, mesh, teachers):
    """On 8 devices with either placement of the second teacher, against each teacher alone on one device."""
    cfg = _cfg(*MIX, *teachers, *mesh)
    step = build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:devices]))
    specs = [{tuple(sh.spec) for sh in jax.tree.leaves(t)} for t in step.shardings.teacher]
    assert len(specs[0]) > 1  # fsdp: the trainer's rules split some leaves
    assert (specs[1] == {()}) == (teachers is TWO_PLACED)  # replicated: every leaf whole on every device
    S = step.sampler.shards
    assert step.routing.mode == "task" and step.routing.shard_rows == (4 // S, 4 // S)
    # the host's order: within each shard's block of B/S rows, teacher 0's rows then teacher 1's
    task = np.asarray([0] * 4 + [1] * 4)
    order = shard_order(task, step.routing, S)
    assert sorted(order) == list(range(B))
    task = task[order]
    assert (task.reshape(S, -1) == np.repeat([0, 1], 4 // S)[None]).all()
    rollout = _rollout(task)
    with jax.set_mesh(step.mesh):
        batch = step.score(jax.device_put(TEACHERS, step.shardings.teacher), _as_rollout(rollout))
    got = jax.device_get(batch.loss)
    ref = [_alone(0, rollout), _alone(1, rollout)]
    for key in KEYS:
        want = np.where(task.reshape((B,) + (1,) * (ref[0][key].ndim - 1)) == 0, ref[0][key], ref[1][key])
        if want.dtype.kind in "ib":
            np.testing.assert_array_equal(getattr(got, key), want, err_msg=key)
        else:
            np.testing.assert_allclose(getattr(got, key), want, rtol=2e-6, atol=2e-6, err_msg=key)
    np.testing.assert_array_equal(got.task_BxT, np.broadcast_to(task[:, None], (B, N)))


def _as_rollout(arrays):
    from jopd.opd.step import Rollout
    return Rollout(arrays, host_batch={})


def test_mixture_is_the_weighted_mixture_of_the_teachers_distributions():
    cfg = _cfg(*MIX, *TWO, "routing=mixture")
    step = build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    rollout = _rollout()
    got = jax.device_get(step.score(TEACHERS, _as_rollout(rollout)).loss)
    # numpy reference: each teacher's full softmax at every response position, mixed 1:3 in float64
    layout = sequence_layout(rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample.tokens_BxN,
                             rollout.sample.lengths_B)
    logp = []
    for params, t_cfg in zip(TEACHERS, (T_A, T_B)):
        logits, _ = transformer.forward(params, layout.tokens_BxS, cfg=t_cfg, attn_mask_BxT=layout.attn_mask_BxS)
        z = np.asarray(logits, np.float64)[:, P - 1:P + N - 1]
        logp.append(z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True))
    mix = np.log(0.25 * np.exp(logp[0]) + 0.75 * np.exp(logp[1]))
    top = np.argsort(-mix, axis=-1)[..., :LOSS.top_k]
    ids = got.teacher_topk_ids_BxTxK
    np.testing.assert_array_equal(ids[..., :LOSS.top_k], top)
    np.testing.assert_array_equal(ids[..., LOSS.top_k:], rollout.sample.topk_ids_BxNxK)  # the union's student part
    np.testing.assert_allclose(got.teacher_topk_logprobs_BxTxK, np.take_along_axis(mix, ids, -1), rtol=1e-5,
                               atol=1e-5)
    target = np.take_along_axis(mix, layout.targets_BxN[..., None].astype(int), -1)[..., 0]
    np.testing.assert_allclose(got.teacher_target_logprobs_BxT, target, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ["task", "mixture", "only"])
def test_one_teacher_in_teachers_is_the_one_teacher_step_bit_for_bit(routing):
    one = ["teachers=[{name: only, weight: 0.3}]", f"routing={routing}"]
    if routing == "task":
        one = ["teachers=[{name: only, tasks: [arithmetic]}]", "routing=task"]
    student = numpy_params(STUDENT, seed=3)
    results = []
    for overrides, t_cfg, teacher in (([], (T_A,), (TEACHERS[0],)), (one, (T_A,), (TEACHERS[0],))):
        cfg = _cfg(*overrides)
        step = build_step(cfg, STUDENT, t_cfg, M.make_mesh(cfg.mesh, jax.devices()[:1]))
        state = step.init_state(student, seed=1)
        batch = step.score(teacher, _as_rollout(_rollout()))
        state, metrics = step.update(state, batch)
        results.append(jax.device_get((batch.loss, state.params, metrics)))
    (loss_a, params_a, m_a), (loss_b, params_b, m_b) = results
    for key in KEYS:
        np.testing.assert_array_equal(getattr(loss_a, key), getattr(loss_b, key), err_msg=key)
    assert m_a == m_b
    jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


def test_per_task_metrics_are_each_tasks_rows_own():
    cfg = _cfg(*MIX, *TWO, "routing=mixture")
    step = build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    assert step.loss_cfg.task_names == ("arithmetic", "counting")
    task = np.asarray([0, 1, 1, 0, 1, 0, 0, 1])
    batch = step.score(TEACHERS, _as_rollout(_rollout(task)))
    state = step.init_state(numpy_params(STUDENT, seed=3), seed=1)
    _, metrics = step.update(state, batch)
    m = per_task_means({k: float(v) for k, v in jax.device_get(metrics).items()})
    # the reference: the same step on each task's rows alone (their masks; the loss is a token mean)
    for t, name in enumerate(("arithmetic", "counting")):
        rows = task == t
        mask = jax.device_get(batch.loss.response_mask_BxT)[rows]
        assert m[f"task/{name}/num_tokens"] == mask.sum() > 0
        alone = jax.tree.map(lambda x: x[rows] if getattr(x, "ndim", 0) and x.shape[0] == B else x,
                             jax.device_get(batch))
        _, m_t = step.update(step.init_state(numpy_params(STUDENT, seed=3), seed=1),
                             dataclasses.replace(alone, loss=alone.loss.replace(task_BxT=None)))
        np.testing.assert_allclose(m[f"task/{name}/teacher_kl_k1"], float(m_t["teacher_kl_k1"]), rtol=1e-5)
        np.testing.assert_allclose(m[f"task/{name}/loss"], float(m_t["loss"]), rtol=1e-5)
    assert not any(k.endswith("_sum") for k in m)


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"routing=task: teacher 'arith' scores 2 rows per step, which do not split "
                                         r"over the 4 batch shards"):
        cfg = load_config(None, ["data.batch_size=4", *MIX, *TWO, "mesh.data=4"])
        build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:4]))
    with pytest.raises(ValueError, match=r"routing=mixture: loss.kind=rkl projects one teacher's hidden states"):
        cfg = _cfg(*MIX, *TWO, "routing=mixture", loss=LossConfig(kind="rkl"))  # refused as the config is built
        build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    with pytest.raises(ValueError, match=r"train.pack: not with routing=task over several teachers"):
        cfg = _cfg(*MIX, *TWO, "train.pack=true")
        build_step(cfg, STUDENT, (T_A, T_B), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    with pytest.raises(ValueError, match=r"2 teachers in RunConfig.teachers, but t_cfg is one ModelConfig"):
        cfg = _cfg(*MIX, *TWO)
        build_step(cfg, STUDENT, T_A, M.make_mesh(cfg.mesh, jax.devices()[:1]))
