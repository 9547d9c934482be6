"""A teacher with another tokenizer through the OPD step (`loss.kind: xtok_sampled | xtok_dense`): the toy
character-level student and a teacher with SmolLM2's 49152-token BPE (a tiny random model). The scored fields
against direct teacher-forced computations, the dense projection against the teacher's next-character
distribution, failures counted, bad pairs refused before any compute, and tiny runs end to end."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from jopd import crosstok
from jopd.config_dataclass import ConfigError
from jopd.crosstok.template import generation_prompt
from jopd.data.pipeline import train_iterator
from jopd.data.tasks import TASKS
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io
from jopd.models import transformer as T
from jopd.run import model_sources
from jopd.opd.cross_teacher import CrossTeacher
from jopd.run.loop import train
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from tests.helpers.tiny_params import numpy_params
from tests.helpers.tiny_testbed import TINY, tiny_cache, write_tiny

_ARCH = ["hidden_size=16", "intermediate_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim=8"]
BASE = [f"{role}.arch.{a}" for role in ("student", "teacher") for a in _ARCH] + [
    "data.batch_size=8", "data.max_prompt_len=64", "sampling.max_new_tokens=16", "data.arithmetic.max_steps=1",
    "train.mismatch=estimators", "mesh.data=1", "loss.top_k=8", f"teacher.tokenizer={io.smollm2_gguf_path()}"]


@pytest.fixture(scope="module")
def tokenizers():
    return build_toy_tokenizer(), io.load_tokenizer(io.smollm2_gguf_path())


def _scored(mode, tokenizers, *overrides):
    """A rollout of a random toy student, aligned to and scored by a random SmolLM2-vocabulary teacher."""
    toy, smol = tokenizers
    cfg = load_config(None, BASE + [f"loss.kind=xtok_{mode}", *overrides])
    s_cfg, t_cfg = model_sources.testbed_model_config(cfg.student, toy), model_sources.testbed_model_config(
        cfg.teacher, smol)
    cross = CrossTeacher.make(toy, smol, s_cfg, t_cfg)
    step = build_step(cfg, s_cfg, (t_cfg,), M.make_mesh(cfg.mesh, jax.devices()[:1]), toy, (cross,))
    student, teacher = numpy_params(s_cfg, 0, layer_scale=3.0, head_scale=3.0), numpy_params(t_cfg, 1, head_scale=4.0)
    batch = next(train_iterator(cfg.data, toy, kind="prompt"))
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(step.init_state(student), batch, 0)
        scored = step.score(jax.device_put((teacher,), step.shardings.teacher), rollout)
    return step, cross, batch, rollout, jax.device_get(scored), teacher, t_cfg


def _alignments(cross, batch, rollout):
    tokens, lengths = np.asarray(rollout.sample.tokens_BxN), np.asarray(rollout.sample.lengths_B)
    return [crosstok.align_response(cross.pair, cross.messages(q), tokens[b, :lengths[b]].tolist())
            for b, q in enumerate(batch["user_turn"])]


def _teacher_logprobs(teacher, t_cfg, alignment):
    """The teacher's log-probs of its own tokens of one aligned response, teacher-forced, no padding."""
    prompt, resp = alignment.teacher_prompt_ids_Pt, alignment.teacher_ids_Nt
    tokens = np.concatenate([prompt, resp])[None].astype(np.int32)
    logits = np.asarray(T.forward(teacher, tokens, cfg=t_cfg)[0][0], np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    P = len(prompt)
    return logp, np.array([logp[P - 1 + j, t] for j, t in enumerate(resp)])


@pytest.fixture
def framed_task():
    """A plugin-style task whose user turn is not the question: the arithmetic problems, asked as "Solve: ..."."""
    arithmetic = TASKS["arithmetic"]
    TASKS.add("framed_arithmetic", dataclasses.replace(arithmetic, user_turn=lambda p: f"Solve: {p.question}",
                                                       cache_key=lambda d: ["framed", arithmetic.cache_key(d)]))
    yield "framed_arithmetic"
    TASKS.remove("framed_arithmetic")


def test_sampled_span_logprobs_equal_the_teachers_own_tokens_teacher_forced(tokenizers, framed_task):
    """With a task whose user turn differs from the question, the teacher's prompt is its own template's rendering
    of that user turn (as the student's prompt renders it in the student's), then the span sums."""
    step, cross, batch, rollout, scored, teacher, t_cfg = _scored("sampled", tokenizers, f"data.task={framed_task}")
    assert step.loss_cfg.kind == "xtok_sampled"
    toy, smol = tokenizers
    prompts = np.asarray(rollout.arrays.cross.prompt_BxPt)
    for b, question in enumerate(batch["question"]):
        turn = f"Solve: {question}"
        assert batch["user_turn"][b] == turn and turn in toy.decode(batch["prompt_tokens"][b])
        if rollout.cross_reasons[b] is None:
            want = generation_prompt(smol, [{"role": "user", "content": turn}])
            assert smol.decode(prompts[b], skip_special_tokens=False).endswith(want)
    rows = _alignments(cross, batch, rollout)
    aligned = [b for b, r in enumerate(rows) if isinstance(r, crosstok.Alignment)]
    assert len(aligned) >= 4 and rollout.cross_reasons.count(None) == len(aligned)
    for b in aligned:
        r = rows[b]
        _, lp = _teacher_logprobs(teacher, t_cfg, r)
        expected = [lp[t0:t1].sum() for t0, t1 in r.spans_teacher_Kx2]
        got = scored.loss.span_teacher_logprobs_BxT[b, :r.n_spans]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert not scored.loss.span_mask_BxT[b, r.n_spans:].any()
        for k, (s0, s1) in enumerate(r.spans_student_Kx2):  # the student's span ids
            assert (scored.loss.span_id_BxT[b, s0:s1] == k).all()
    for b in set(range(len(rows))) - set(aligned):  # a failed row: no spans, so no signal; its reason is kept
        assert not scored.loss.span_mask_BxT[b].any() and rollout.cross_reasons[b] == rows[b].reason


def test_dense_projection_is_the_teachers_next_character_distribution(tokenizers):
    """Toy (character) student against the teacher backed off to the start of its last token z (text tau):
    pi(c) = (sum of p_j over teacher tokens starting with tau + c, plus p_j(z) times the sum of p_{j+1} over those
    starting with c) / (sum of p_j over those starting with tau), pi(EOS) = p_j(z) p_{j+1}(end of turn) / the same;
    at the response's first span, pi(c) = p_{j+1} of the tokens starting with c. By brute force over the
    teacher's vocabulary."""
    step, cross, batch, rollout, scored, teacher, t_cfg = _scored("dense", tokenizers)
    assert step.loss_cfg.kind == "xtok_dense" and step.sampler.sampling.return_topk == 8
    smol_vocab, toy_vocab = cross.pair.teacher, cross.pair.student
    text_ids = np.array([t for t in range(len(smol_vocab)) if smol_vocab.is_text(t)])
    first_byte = np.array([smol_vocab.token_bytes[t][0] for t in text_ids])
    strings = [smol_vocab.token_bytes[t] for t in text_ids]
    rows = _alignments(cross, batch, rollout)
    checked = backed = 0
    for b, r in enumerate(rows):
        if not isinstance(r, crosstok.Alignment):
            assert not scored.loss.dense_mask_BxT[b].any()
            continue
        logp, _ = _teacher_logprobs(teacher, t_cfg, r)
        P = len(r.teacher_prompt_ids_Pt)
        for (s0, _), (t0, _) in zip(r.spans_student_Kx2, r.spans_teacher_Kx2):
            assert scored.loss.dense_mask_BxT[b, s0]
            p = np.exp(logp[P - 1 + t0])
            if t0 > 0:  # the distribution at the start of the last teacher token, over the tokens extending it
                z = r.teacher_ids_Nt[t0 - 1]
                tau, pb = smol_vocab.token_bytes[z], np.exp(logp[P - 2 + t0])
                ext = [(i, s[len(tau)]) for i, s in zip(text_ids, strings) if len(s) > len(tau) and s.startswith(tau)]
                D = pb[z] + sum(pb[i] for i, _ in ext)
            ids = scored.loss.teacher_topk_ids_BxTxK[b, s0]
            keep = scored.loss.support_mask_BxTxK[b, s0]
            for s, ok, got in zip(ids, keep, scored.loss.teacher_topk_logprobs_BxTxK[b, s0]):
                if s == toy_vocab.eos_id:
                    want = p[cross.pair.teacher_end_ids[0]]
                    if t0 > 0:
                        want = pb[z] * want / D
                elif toy_vocab.is_text(s):
                    c = toy_vocab.token_bytes[s][0]
                    want = p[text_ids[first_byte == c]].sum()
                    if t0 > 0:
                        want = (sum(pb[i] for i, nxt in ext if nxt == c) + pb[z] * want) / D
                else:  # a special student token the teacher cannot express: in the tail
                    assert not ok
                    continue
                if ok:
                    np.testing.assert_allclose(math.exp(got), want, rtol=2e-4)
                    checked += 1
                    backed += t0 > 0 and len(ext) > 0
        assert scored.loss.dense_mask_BxT[b].sum() == r.n_spans
    assert checked > 40 and backed > 20


def test_a_pair_that_cannot_align_is_refused_before_any_compute(tmp_path):
    with pytest.raises(ValueError, match=r"^RunConfig.loss.kind: .*teacher encodes '\\x00'"):
        model_sources.precheck_sources(load_config(None, [
            f"student.tokenizer={io.smollm2_gguf_path()}", "loss.kind=xtok_sampled"]))
    # the key that once selected these kinds: an earlier config still loads (its kind), else one line naming loss.kind
    with pytest.raises(ConfigError, match=r"^RunConfig.loss.cross_tokenizer: True: .* loss.kind=xtok_dense or "):
        load_config(None, ["loss.cross_tokenizer=yes"])
    assert load_config(None, ["loss.cross_tokenizer=off"]).loss.cross_tokenizer == "off"  # YAML's `off` is false
    assert load_config(None, ["loss.cross_tokenizer=dense"]).loss.kind == "xtok_dense"
    assert load_config(None, ["loss.cross_tokenizer=sampled", "loss.kind=sampled_opd"]).loss.kind == "xtok_sampled"
    with pytest.raises(ValueError, match=r"loss.cross_tokenizer=dense: runs xtok_dense .* got loss.kind=rkl"):
        build_step(load_config(None, BASE + ["loss.cross_tokenizer=dense", "loss.kind=rkl"]), None, None, None)
    with pytest.raises(ValueError, match=r"loss.kind=rkl: needs a teacher of the student's vocabulary"):
        build_step(load_config(None, BASE + ["loss.kind=rkl"]), None, None, None, cross=(object(),))
    with pytest.raises(ValueError, match=r"loss.kind=xtok_dense: scores a teacher with another tokenizer and needs"):
        build_step(load_config(None, BASE + ["loss.kind=xtok_dense"]), None, None, None)
    with pytest.raises(ValueError, match=r"vocab mismatch: .* set loss.kind=xtok_dense or xtok_sampled"):
        model_sources.check_compatible(T.ModelConfig(vocab_size=10), T.ModelConfig(vocab_size=12), None, None)
    out = tmp_path / "probed"
    with pytest.raises(ValueError, match=r"probe_every: the probe feeds the teacher the student.s token ids"):
        train(load_config(None, BASE + ["loss.kind=xtok_sampled", "train.probe_every=2",
                                        f"train.out_dir={out}"]), probe_hook=lambda run: None)
    assert not out.exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sampled", "dense"])
def test_cross_tokenizer_runs_end_to_end_and_counts_what_it_cannot_align(tmp_path, mode):
    # a briefly fine-tuned teacher (its quality is not under test: every step's 49152-way head costs)
    teacher = TINY["teacher"] | {"tokenizer": str(io.smollm2_gguf_path()), "warm_start": {"steps": 4, "batch_size": 8}}
    path = write_tiny(tmp_path / "tiny.yaml", teacher=teacher, loss={"top_k": 8, "kind": f"xtok_{mode}"},
                      train={"steps": 3, "eval_problems": 8})
    out = tmp_path / "run"
    summary = train(load_config(str(path), [f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}"]),
                    log=lambda *a: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "loss" in m]
    assert len(steps) == 3 and all(math.isfinite(m["loss"]) for m in steps)
    assert all(0.0 <= m["xtok_misaligned_frac"] <= 1.0 for m in steps)
    assert all(m["num_tokens"] > 0 for m in steps)  # positions with a signal
    after = summary["after"]
    assert math.isfinite(after["teacher_divergence"]) and after["num_problems"] == 8
