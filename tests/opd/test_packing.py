"""Packed scoring and update (`train.pack`) against the padded computation: the plan covers every real token
once, the packed forward equals the padded one, and for every loss kind that reads per-token fields the loss,
its metrics and its gradient equal the padded step's (also sharded over 8 devices)."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from jopd.losses.chunked import head_params
from jopd.losses.layout import from_compact, to_compact
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.opd.batch import RolloutArrays
from jopd.opd.packing import pack_tokens, packed_hidden, plan_packing
from jopd.run.config import load_config
from jopd.opd.step import Rollout, build_step
from jopd.opd.student_loss import rollout_loss_fn
from jopd.parallel import mesh as M
from jopd.sampling.config import SampleOutput
from tests.helpers.tiny_params import numpy_params

STUDENT = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, tie_word_embeddings=False)
TEACHER = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=12)
B, P, N, K = 8, 12, 16, 8


def test_the_plan_places_every_real_token_once_and_inverts():
    rng = np.random.default_rng(0)
    prompt_lens, lengths = rng.integers(1, P + 1, 32), rng.integers(0, N + 1, 32)
    for shards in (1, 4):
        plan = plan_packing(prompt_lens, lengths, P, N, shards=shards)
        rows = 32 // shards
        Bp, C = plan.src_row_BpxC.shape
        assert C == P + N and Bp % shards == 0 and Bp // shards <= rows
        seen = set()
        for r in range(Bp):
            s, real = r // (Bp // shards), plan.segment_BpxC[r] > 0
            for j in np.nonzero(real)[0]:
                key = (s * rows + plan.src_row_BpxC[r, j], plan.src_col_BpxC[r, j])
                assert key not in seen
                seen.add(key)
            for g in np.unique(plan.segment_BpxC[r][real]):  # a sequence's columns are contiguous, positions 0..n-1
                cols = np.nonzero(plan.segment_BpxC[r] == g)[0]
                assert cols[-1] - cols[0] + 1 == len(cols)
                np.testing.assert_array_equal(plan.position_BpxC[r, cols], np.arange(len(cols)))
        expected = {(i, c) for i in range(32) for c in range(P - prompt_lens[i], P + lengths[i])}
        assert seen == expected  # every prompt and response token exactly once
        compact = plan.compact
        assert compact.valid_QxC.sum() == lengths.sum()
        x = np.arange(32 * N).reshape(32, N)
        back = np.asarray(from_compact(to_compact(x, compact), compact, fill=-1))
        np.testing.assert_array_equal(back, np.where(np.arange(N)[None] < lengths[:, None], x, -1))
    assert plan_packing(prompt_lens, lengths, P, N).src_row_BpxC.shape[0] < 32  # it packs: fewer rows
    wide = plan_packing(prompt_lens, lengths, P, N, width=3 * (P + N))  # wider rows: fewer, fuller
    assert wide.segment_BpxC.shape[1] == 3 * (P + N)
    assert (wide.segment_BpxC > 0).mean() > (plan.segment_BpxC > 0).mean()
    with pytest.raises(ValueError, match=r"rows of 20 columns cannot hold a prompt \+ response of up to 28"):
        plan_packing(prompt_lens, lengths, P, N, width=20)


def _rollout(seed=0):
    """Mixed lengths, short prompts: several sequences share a packed row."""
    rng = np.random.RandomState(seed)
    prompt_lens = rng.randint(1, P + 1, B)
    pmask = np.arange(P)[None] >= (P - prompt_lens)[:, None]
    prompt = np.where(pmask, rng.randint(4, 64, (B, P)), 0).astype(np.int32)
    lengths = rng.randint(1, N + 1, B).astype(np.int32)
    valid = np.arange(N)[None] < lengths[:, None]
    tokens = np.where(valid, rng.randint(3, 64, (B, N)), 0).astype(np.int32)
    logp = np.where(valid, rng.normal(-2, 0.5, (B, N)), 0).astype(np.float32)
    full = np.log(rng.dirichlet(np.ones(64), (B, N))).astype(np.float32)
    topk = np.argsort(rng.rand(B, N, 64), axis=-1)[..., :K].astype(np.int32)
    sample = SampleOutput(tokens_BxN=tokens, lengths_B=lengths, logprobs_BxN=logp, unprocessed_logprobs_BxN=logp,
                          done_B=np.ones(B, bool), full_logprobs_BxNxV=full, topk_ids_BxNxK=topk)
    adv = rng.normal(size=B).astype(np.float32)
    return RolloutArrays(prompt_BxP=prompt, prompt_mask_BxP=pmask, sample=sample, advantages_B=adv), \
        {"prompt_mask": pmask.astype(np.int32)}


def _step(overrides, devices, mesh=("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1")):
    cfg = load_config(None, [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
                             f"loss.top_k={K}", "loss.chunk_size=5", "optim.learning_rate=1e-2",
                             "optim.warmup_steps=0", *mesh, *overrides])
    return build_step(cfg, STUDENT, (TEACHER,), M.make_mesh(cfg.mesh, devices))


def _loss_and_grad(step, arrays, host, teacher, student, reference=None):
    with jax.set_mesh(step.mesh):
        teachers = jax.device_put((teacher,), step.shardings.teacher)
        batch = step.score(teachers, Rollout(arrays, host), reference)
        fn = jax.jit(jax.value_and_grad(rollout_loss_fn(step.student_cfg, step.loss_cfg), has_aux=True))
        head = (head_params(teachers[0]),) if step.uses_teacher_head else ()
        (loss, metrics), grads = fn(jax.device_put(student, step.shardings.student), batch, *head)
    return float(loss), jax.device_get(metrics), jax.device_get(grads), batch


KINDS = {
    "topk_rkl_tail, wide rows": ["loss.kind=topk_rkl_tail", f"train.pack_width={3 * (P + N)}"],
    "topk_rkl_tail, granularity 1": ["loss.kind=topk_rkl_tail", "train.pack_granularity=1"],
    "topk_rkl union+sampled, tis": ["loss.kind=topk_rkl", "loss.support_sampled=true", "loss.is_mode=tis"],
    "topk_rkl teacher_topk": ["loss.kind=topk_rkl", "loss.support=teacher_topk"],
    "sampled_opd gamma": ["loss.kind=sampled_opd", "loss.options.gamma=0.9"],
    "rkl, exact mismatch": ["loss.kind=rkl", "train.mismatch=exact"],
    "fkl": ["loss.kind=fkl"],
    "jsd": ["loss.kind=jsd", "loss.options.beta=0.3"],
    "reinforce kl": ["loss.kind=reinforce", "loss.kl_coef=0.1", "loss.template_token_ids=[5]"],
    "grpo icepop, token_sum_norm": ["loss.kind=grpo", "rl.group_size=2", "loss.is_mode=icepop", "loss.icepop_low=1e-6",
                                    "loss.icepop_high=1e6",
                                    "loss.token_sum_norm=true", "loss.special_token_ids=[7]"],
}


def test_granularity_rounds_the_packed_row_counts_and_1_leaves_no_empty_row():
    rng = np.random.default_rng(1)
    prompt_lens, lengths = rng.integers(1, P + 1, 32), rng.integers(0, N + 1, 32)
    Cq = min(N, 32)
    for shards in (1, 2):  # rows per shard rounded up to a multiple of an eighth of the shard's rows by default
        auto = plan_packing(prompt_lens, lengths, P, N, shards=shards)
        assert (auto.src_row_BpxC.shape[0] // shards) % (32 // shards // 8) == 0
    auto = plan_packing(prompt_lens, lengths, P, N)
    exact = plan_packing(prompt_lens, lengths, P, N, granularity=1)
    used = (exact.segment_BpxC > 0).any(axis=1)
    assert used.all()  # granularity 1: every packed row holds a sequence
    assert (auto.segment_BpxC > 0).any(axis=1).sum() == len(used) < auto.src_row_BpxC.shape[0]  # same packing, no pad
    assert exact.compact.valid_QxC.shape[0] == -(-lengths.sum() // Cq) < auto.compact.valid_QxC.shape[0]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_packed_loss_and_gradient_equal_the_padded_ones(kind):
    student = jax.tree.map(lambda x: 3 * x, numpy_params(STUDENT, seed=0))
    teacher = jax.tree.map(lambda x: 3 * x, numpy_params(TEACHER, seed=7))
    arrays, host = _rollout()
    out = {}
    for pack in (False, True):
        step = _step(KINDS[kind] + [f"train.pack={pack}"], jax.devices()[:1])
        if not step.cfg.train.mismatch == "exact":
            arrays = arrays.replace(sample=arrays.sample._replace(full_logprobs_BxNxV=None))
        reference = step.place_reference(student) if step.uses_reference else None
        out[pack] = _loss_and_grad(step, arrays, host, teacher, student, reference)
    (l0, m0, g0, _), (l1, m1, g1, b1) = out[False], out[True]
    assert b1.plan is not None and b1.tokens_BxS.shape[0] < B  # packed: fewer rows than the padded batch
    assert abs(l0) > 1e-4 and l1 == pytest.approx(l0, rel=1e-5, abs=1e-7)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    rel = optax.tree.norm(jax.tree.map(np.subtract, g1, g0)) / optax.tree.norm(g0)
    assert optax.tree.norm(g0) > 0 and rel < 1e-5, rel


def test_packed_step_on_eight_devices_equals_the_padded_one_device_step():
    student = jax.tree.map(lambda x: 3 * x, numpy_params(STUDENT, seed=0))
    teacher = jax.tree.map(lambda x: 3 * x, numpy_params(TEACHER, seed=7))
    arrays, host = _rollout(seed=3)
    arrays = arrays.replace(sample=arrays.sample._replace(full_logprobs_BxNxV=None))
    one = _loss_and_grad(_step([], jax.devices()[:1]), arrays, host, teacher, student)
    eight_step = _step(["train.pack=true"], jax.devices(), ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"))
    eight = _loss_and_grad(eight_step, arrays, host, teacher, student)
    assert eight[3].plan.shards == 4 and eight[3].plan.compact.shards == 4
    assert eight[0] == pytest.approx(one[0], rel=1e-5)
    rel = optax.tree.norm(jax.tree.map(np.subtract, eight[2], one[2])) / optax.tree.norm(one[2])
    assert rel < 1e-4, rel


def test_pack_with_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match=r"train.pack: not with optim.grad_accum_steps=2"):
        _step(["train.pack=true", "optim.grad_accum_steps=2"], jax.devices()[:1])



PACK_P, PACK_N = 8, 112
PACK_PROMPTS, PACK_LENGTHS = np.array([6, 3, 8, 2]), np.array([84, 7, 4, 5])  # 90 + 10 + 12 + 7 tokens: one row


@functools.lru_cache(maxsize=None)
def long_and_short_sequences():
    """The sequences, their padded layout [4, P + N] (prompt left-padded, response right-padded), the params, and
    each sequence's logits from its own forward, alone and unpadded ("xla")."""
    params = numpy_params(STUDENT, 3, layer_scale=5.0)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, STUDENT.vocab_size, p + n) for p, n in zip(PACK_PROMPTS, PACK_LENGTHS)]
    tokens = np.zeros((4, PACK_P + PACK_N), np.int32)
    for i, (s, p) in enumerate(zip(seqs, PACK_PROMPTS)):
        tokens[i, PACK_P - p:PACK_P - p + len(s)] = s
    alone = [np.asarray(jax.jit(lambda p_, t: T.forward(p_, t, cfg=STUDENT, attention="xla")[0])(params, s[None]))[0]
             for s in seqs]
    return seqs, tokens, params, alone


@pytest.mark.parametrize("attention", ["xla", "chunked", "splash", "cudnn"])
def test_a_packed_long_and_short_responses_equal_each_alone_with_each_attention(attention):
    """One packed row holds a long and three short prompt + response sequences (`packed_hidden`, the scoring's and
    the update's forward, handing the segment ids to the attention seam); with each implementation ("splash" in
    Pallas interpret mode) the logits at every real position equal each sequence's own forward, alone and unpadded."""
    seqs, tokens, params, alone = long_and_short_sequences()
    plan = plan_packing(PACK_PROMPTS, PACK_LENGTHS, PACK_P, PACK_N)
    assert plan.segment_BpxC.shape == (1, PACK_P + PACK_N) and plan.segment_BpxC.max() == 4
    cfg = dataclasses.replace(STUDENT, attention=attention)

    @jax.jit
    def packed_logits(params, tokens, plan):
        return T.logits_from_hidden(params, packed_hidden(params, cfg, pack_tokens(tokens, plan), plan))

    packed = np.asarray(packed_logits(params, tokens, plan))[0]
    for i, ref in enumerate(alone):
        cols = np.nonzero((plan.src_row_BpxC[0] == i) & (plan.segment_BpxC[0] > 0))[0]
        assert len(cols) == len(seqs[i])
        np.testing.assert_allclose(packed[cols], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
