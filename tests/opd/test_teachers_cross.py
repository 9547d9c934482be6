"""Several teachers with a cross-tokenizer `loss.kind` (`opd.routing`, `opd.scoring`): a teacher of the student's vocabulary (the toy
tokenizer) beside a teacher with SmolLM2's BPE (tiny random models), routed by task. Each row's fields are its own
teacher's alone: the cross teacher's rows those of today's one-teacher cross step on the same rollout, the other
teacher's rows the ordinary scoring's log-probs of the same ids (and, sampled, the same loss and update as
`sampled_opd`); one cross teacher in `teachers`, or routing to it by name, is today's step bit for bit; a mixture
and a bad pair are refused naming the field; a tiny mixed run trains and evaluates end to end."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
import yaml

from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io
from jopd.run import model_sources
from jopd.run.loop import train
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.opd.routing import row_teachers
from jopd.parallel import mesh as M
from tests.helpers.tiny_params import numpy_params
from tests.helpers.tiny_testbed import TINY, tiny_cache

SMOL = str(io.smollm2_gguf_path())
ARCH = "{hidden_size: 16, intermediate_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 2, head_dim: 8}"
BASE = [f"student.arch={ARCH}", "data.batch_size=8", "data.max_prompt_len=64", "sampling.max_new_tokens=16",
        "data.arithmetic.max_steps=1", "data.counting.max_items=3", "data.mix={arithmetic: 1, counting: 1}",
        "train.mismatch=estimators", "loss.top_k=8", "optim.warmup_steps=0"]
MIXED = (f"teachers=[{{name: same, tasks: [arithmetic], arch: {ARCH}}}, "
         f"{{name: smol, tasks: [counting], arch: {ARCH}, tokenizer: '{SMOL}'}}]")
ALONE = [f"teacher.arch={ARCH}", f"teacher.tokenizer={SMOL}"]  # today's one teacher with another tokenizer
MESH8 = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.on_indivisible=replicate"]  # 103 toy ids
SPANS = ("span_id_BxT", "span_mask_BxT", "end_span_BxT")
FIELDS = {"sampled": SPANS + ("span_teacher_logprobs_BxT",),
          "dense": SPANS + ("dense_mask_BxT", "teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK",
                            "support_mask_BxTxK")}


@pytest.fixture(scope="module")
def tokenizers():
    return build_toy_tokenizer(), io.load_tokenizer(SMOL)


def _models(cfg, tokenizers):
    """The configs and tiny random params of the student and each teacher (its own tokenizer's vocabulary)."""
    toy, smol = tokenizers
    s_cfg = model_sources.testbed_model_config(cfg.student, toy)
    sources = cfg.teachers or (cfg.teacher,)
    toks = [smol if src.tokenizer else toy for src in sources]
    t_cfgs = tuple(model_sources.testbed_model_config(src, tok) for src, tok in zip(sources, toks))
    # seeded by tokenizer: a teacher of either kind has the same params in every config of this file
    params = tuple(numpy_params(m, 1 + (tok is smol), head_scale=4.0) for m, tok in zip(t_cfgs, toks))
    return s_cfg, t_cfgs, toks, params


def _step(overrides, tokenizers, devices=1):
    cfg = load_config(None, BASE + list(overrides))
    s_cfg, t_cfgs, toks, params = _models(cfg, tokenizers)
    cross = model_sources.cross_teachers(cfg, tokenizers[0], toks, s_cfg, t_cfgs)
    mesh = M.make_mesh(cfg.mesh, jax.devices()[:devices])
    step = build_step(cfg, s_cfg, t_cfgs, mesh, tokenizers[0], cross)
    return step, params


def _rollout_and_score(step, teacher_params, student_params, batch=None):
    batch = next(train_iterator(step.cfg.data, step.tokenizer, kind="prompt")) if batch is None else batch
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(step.init_state(student_params), batch, 0)
        scored = step.score(jax.device_put(teacher_params, step.shardings.teacher), rollout)
    return rollout, scored


def _rows(x, rows):
    return jax.tree.map(lambda a: a[rows] if getattr(a, "ndim", 0) and a.shape[0] == len(rows) else a, x)


def _first_occurrence(ids_BxNxK):
    return np.asarray([[[k == list(r).index(v) for k, v in enumerate(r)] for r in row] for row in ids_BxNxK])


@pytest.mark.parametrize("mode,devices,mesh", [("sampled", 1, ["mesh.data=1"]), ("dense", 1, ["mesh.data=1"]),
                                               ("dense", 8, MESH8)])
def test_each_row_is_scored_by_its_own_teacher_alone(tokenizers, mode, devices, mesh):
    """Mixed routing=task on 1 device, and on 8 with the small same-vocabulary teacher held replicated."""
    placed = MIXED.replace("tasks: [arithmetic],", "tasks: [arithmetic], placement: replicated,") if devices > 1 \
        else MIXED
    step, teachers = _step([placed, f"loss.kind=xtok_{mode}", *mesh], tokenizers, devices)
    assert step.cross[0] is None and step.cross[1] is not None  # the toy teacher shares the student's tokenizer
    student = numpy_params(step.student_cfg, 0, layer_scale=3.0, head_scale=3.0)
    rollout, scored = _rollout_and_score(step, teachers, student)
    got = jax.device_get(scored.loss)
    owner = row_teachers(rollout.host_batch["task_id"], step.routing)
    assert sorted(np.bincount(owner)) == [4, 4]
    sample = jax.device_get(rollout.sample)
    valid_BxN = np.arange(sample.tokens_BxN.shape[1])[None] < sample.lengths_B[:, None]

    # the cross teacher's rows: today's one-teacher cross step, its rows aligned and scored on the same rollout
    alone, _ = _step([*ALONE, f"loss.kind=xtok_{mode}", *mesh], tokenizers, devices)
    cross_batch, reasons = alone._align(rollout.sample, rollout.host_batch)
    with jax.set_mesh(alone.mesh):
        want = jax.device_get(alone.score_fn(jax.device_put((teachers[1],), alone.shardings.teacher),
                                             rollout.arrays.replace(cross=cross_batch)).loss)
    smol = owner == 1
    assert [r for r, o in zip(rollout.cross_reasons, smol) if o] == [r for r, o in zip(reasons, smol) if o]
    assert all(r is None for r, o in zip(rollout.cross_reasons, smol) if not o)  # the other rows never fail
    assert sum(r is None for r, o in zip(reasons, smol) if o) >= 2  # some counting rows align
    for key in FIELDS[mode]:
        np.testing.assert_allclose(getattr(got, key)[smol], getattr(want, key)[smol], rtol=1e-5, atol=1e-6,
                                   err_msg=key)

    # the same-vocabulary teacher's rows: every token its own span; the ordinary scoring's log-probs of the same ids
    same = ~smol
    support = "union" if mode == "dense" else "teacher_topk"  # union: the student's top-K follow the teacher's
    ordinary, _ = _step([f"teacher.arch={ARCH}", f"loss.support={support}", *mesh], tokenizers, devices)
    with jax.set_mesh(ordinary.mesh):
        ref = jax.device_get(ordinary.score_fn(jax.device_put((teachers[0],), ordinary.shardings.teacher),
                                               rollout.arrays.replace(cross=None)).loss)
    v = valid_BxN[same]
    N = v.shape[1]
    np.testing.assert_array_equal(got.span_id_BxT[same], np.where(v, np.arange(N), N))
    np.testing.assert_array_equal(got.span_mask_BxT[same], v)
    ends = v & (np.arange(N) == sample.lengths_B[same, None] - 1) & sample.done_B[same, None]
    np.testing.assert_array_equal(got.end_span_BxT[same], ends)
    if mode == "sampled":
        np.testing.assert_allclose(got.span_teacher_logprobs_BxT[same],
                                   np.where(v, ref.teacher_target_logprobs_BxT[same], 0), rtol=1e-5, atol=1e-6)
        return
    K = step.cfg.loss.top_k
    student_ids = sample.topk_ids_BxNxK[same]
    keep = _first_occurrence(student_ids) & v[..., None]
    np.testing.assert_array_equal(got.dense_mask_BxT[same], v)
    np.testing.assert_array_equal(got.teacher_topk_ids_BxTxK[same], np.where(v[..., None], student_ids, 0))
    np.testing.assert_array_equal(got.support_mask_BxTxK[same], keep)
    np.testing.assert_array_equal(ref.teacher_topk_ids_BxTxK[same][..., K:], student_ids)  # the union's student part
    np.testing.assert_allclose(got.teacher_topk_logprobs_BxTxK[same],
                               np.where(keep, ref.teacher_topk_logprobs_BxTxK[same][..., K:], 0), rtol=1e-5, atol=1e-6)


def test_same_vocabulary_rows_of_xtok_sampled_are_sampled_opd(tokenizers):
    """On the toy teacher's rows, the span-level policy gradient with one token per span is sampled-token OPD
    (gamma 0): the same loss and the same updated student."""
    step, teachers = _step([MIXED, "loss.kind=xtok_sampled"], tokenizers)
    student = numpy_params(step.student_cfg, 0, layer_scale=3.0, head_scale=3.0)
    rollout, scored = _rollout_and_score(step, teachers, student)
    opd, _ = _step([f"teacher.arch={ARCH}", "loss.kind=sampled_opd", "loss.options.gamma=0", "loss.support=teacher_topk"],
                   tokenizers)
    ref = opd.score_fn((teachers[0],), rollout.arrays.replace(cross=None))
    same = row_teachers(rollout.host_batch["task_id"], step.routing) == 0
    results = []
    for s, batch in ((step, scored), (opd, ref)):
        batch = _rows(jax.device_get(batch), same)
        batch = dataclasses.replace(batch, loss=batch.loss.replace(task_BxT=None))
        state, metrics = s.update(s.init_state(student, seed=1), batch)
        results.append(jax.device_get((state.params, metrics)))
    (p_x, m_x), (p_o, m_o) = results
    assert m_x["num_tokens"] == m_o["num_tokens"] > 0
    for key in ("loss", "divergence", "advantage_mean", "grad_norm"):
        np.testing.assert_allclose(float(m_x[key]), float(m_o[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p_x, p_o)


@pytest.mark.parametrize("routed", ["one teacher", "routing=smol"])
def test_the_cross_teacher_alone_in_teachers_is_todays_step_bit_for_bit(tokenizers, routed):
    one = f"teachers=[{{name: smol, tasks: [arithmetic, counting], arch: {ARCH}, tokenizer: '{SMOL}'}}]"
    results = []
    for overrides in (ALONE, [one] if routed == "one teacher" else [MIXED, "routing=smol"]):
        step, teachers = _step([*overrides, "loss.kind=xtok_dense"], tokenizers)
        student = numpy_params(step.student_cfg, 0, layer_scale=3.0, head_scale=3.0)
        rollout, scored = _rollout_and_score(step, teachers, student)
        state, metrics = step.update(step.init_state(student, seed=1), scored)
        results.append(jax.device_get((rollout.cross_reasons, scored.loss, state.params, metrics)))
    (r_a, loss_a, p_a, m_a), (r_b, loss_b, p_b, m_b) = results
    assert r_a == r_b and r_a.count(None) >= 2
    for key in FIELDS["dense"]:
        np.testing.assert_array_equal(getattr(loss_a, key), getattr(loss_b, key), err_msg=key)
    assert m_a == m_b
    jax.tree.map(np.testing.assert_array_equal, p_a, p_b)


def test_the_eval_measures_each_row_per_character_against_its_own_teacher(tokenizers):
    """`evaluate.heldout_divergence_B` of a cross run: the toy teacher's rows (log p_s - log p_t of the student's tokens) /
    (characters + end of turn) with log p_t from a float64 forward; the cross teacher's rows its own measure."""
    from jopd.models import transformer as T
    from jopd.run.evaluate import cross_divergence_B, heldout_divergence_B

    step, teachers = _step([MIXED, "loss.kind=xtok_sampled"], tokenizers)
    rollout, _ = _rollout_and_score(step, teachers, numpy_params(step.student_cfg, 0, layer_scale=3.0, head_scale=3.0))
    out, batch = jax.device_get(rollout.sample), rollout.host_batch
    P, N = batch["prompt_tokens"].shape[1], out.tokens_BxN.shape[1]
    tokens = np.concatenate([batch["prompt_tokens"], out.tokens_BxN], axis=1)
    attn = np.concatenate([batch["prompt_mask"].astype(bool), out.response_mask_BxN], axis=1)
    got = heldout_divergence_B(None, teachers, batch["task_id"], s_cfg=step.student_cfg, t_cfgs=step.teacher_cfgs,
                               routing=step.routing, crosses=step.cross, per_character=True, tokenizer=tokenizers[0],
                               batch=batch, out=out, tokens=tokens, attn=attn, temperature=1.0)
    owner = row_teachers(batch["task_id"], step.routing)
    logits = np.asarray(T.forward(teachers[0], tokens, cfg=step.teacher_cfgs[0], attn_mask_BxT=attn)[0], np.float64)
    z = logits[:, P - 1:P + N - 1]
    logp = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    for b in np.flatnonzero(owner == 0):
        n = out.lengths_B[b]
        t_lp = sum(logp[b, j, out.tokens_BxN[b, j]] for j in range(n))
        chars = len(tokenizers[0].decode(out.tokens_BxN[b, :n], skip_special_tokens=True)) + int(out.done_B[b])
        want = (out.unprocessed_logprobs_BxN[b, :n].sum() - t_lp) / chars
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)
    theirs = cross_divergence_B(step.cross[1], teachers[1], step.teacher_cfgs[1], batch, out, 1.0)
    np.testing.assert_array_equal(got[owner == 1], theirs[owner == 1])
    assert np.isfinite(got[owner == 1]).sum() >= 2


def test_what_is_refused_names_the_field(tokenizers, tmp_path):
    with pytest.raises(ConfigError, match=r"^RunConfig.routing: mixture is not available with "
                                          r"loss.kind=xtok_dense \(a mixture adds"):
        load_config(None, BASE + [MIXED, "loss.kind=xtok_dense", "routing=mixture"])
    load_config(None, BASE + [MIXED, "loss.kind=xtok_dense", "routing=same"])  # to one teacher: fine
    # a teacher's pair that cannot align: the teacher's `tokenizer` field (a byte-level student, a toy teacher)
    bad = f"teachers=[{{name: a, tasks: [arithmetic]}}, {{name: b, tasks: [counting], tokenizer: '{SMOL}'}}]"
    with pytest.raises(ValueError, match=r"^RunConfig.teachers\[0\].tokenizer: .*teacher encodes .* "
                                         r"\(loss.kind=xtok_sampled\)$"):
        model_sources.precheck_sources(load_config(None, BASE + [bad, f"student.tokenizer={SMOL}",
                                                                 "loss.kind=xtok_sampled"]))
    cfg = load_config(None, BASE + [MIXED, "loss.kind=xtok_dense"])
    s_cfg, t_cfgs, toks, _ = _models(cfg, tokenizers)
    with pytest.raises(ValueError, match=r"^RunConfig.teachers\[1\]: vocab_size=49152 is not the student's \(103\)"):
        build_step(cfg, s_cfg, t_cfgs, M.make_mesh(cfg.mesh, jax.devices()[:1]), tokenizers[0], (None, None))
    with pytest.raises(ValueError, match=r"2 teachers with loss.kind=xtok_dense need `cross` as a tuple"):
        build_step(cfg, s_cfg, t_cfgs, M.make_mesh(cfg.mesh, jax.devices()[:1]), tokenizers[0],
                   model_sources.cross_teachers(cfg, tokenizers[0], toks, s_cfg, t_cfgs)[1])


@pytest.mark.slow
def test_a_mixed_run_trains_and_evaluates_per_character(tmp_path):
    """Two briefly fine-tuned teachers (their quality is not under test), one with SmolLM2's tokenizer, the other
    replicated: the loop, its misalignment count and the held-out eval (each row against its own teacher)."""
    smol = TINY["teacher"] | {"name": "smol", "tasks": ["counting"], "tokenizer": SMOL,
                              "warm_start": {"steps": 4, "batch_size": 8}}
    same = TINY["teacher"] | {"name": "same", "tasks": ["arithmetic"], "placement": "replicated"}
    spec = {k: v for k, v in TINY.items() if k != "teacher"} | {
        "teachers": [same, smol], "loss": {"top_k": 8, "kind": "xtok_dense"},
        "data": TINY["data"] | {"batch_size": 16, "max_prompt_len": 64, "mix": {"arithmetic": 1, "counting": 1},
                                "counting": {"max_items": 3, "heldout_size": 8},
                                "arithmetic": {"max_steps": 1, "heldout_size": 8}},
        "train": TINY["train"] | {"steps": 2, "eval_problems": 8}}
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    summary = train(load_config(str(path), [f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}"]),
                    log=lambda *a: None)
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(steps) == 2 and all(math.isfinite(m["loss"]) and 0 <= m["xtok_misaligned_frac"] < 1 for m in steps)
    assert all(m["task/arithmetic/num_tokens"] > 0 for m in steps)  # the same-vocabulary rows never misalign
    after = summary["after"]
    assert after["arithmetic/num_problems"] == after["counting/num_problems"] == 8
    assert math.isfinite(after["arithmetic/teacher_divergence"]) and math.isfinite(after["counting/teacher_divergence"])
    assert "arithmetic/misaligned" not in after  # scored on the student's tokens: nothing to align
