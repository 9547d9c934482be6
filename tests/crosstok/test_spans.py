"""The per-span signal against a direct teacher-forced computation with two tiny random models of different
vocabularies (the toy student, 103 ids; a SmolLM2-vocabulary teacher, 49152 ids)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.crosstok import Alignment, Misaligned, align_response, at_tokens, check_pair, span_index, span_logprobs
from jopd.data.chat import encode_text, prompt_ids
from jopd.models import transformer
from jopd.models.config import ModelConfig
from tests.helpers.tiny_params import numpy_params

STUDENT = ModelConfig(vocab_size=103, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
TEACHER = ModelConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
QUESTIONS = ["Ann has 7 pens, gets 5. How many?", "2+2?", "Name a colour."]
RESPONSES = [("7+5=12. #### 12", True), ("Four:  2+2 = 4\n\n#### 4", False), ("ok<|im_end|>", True)]


S = 64  # sequence length of every forward (one compiled program per model and batch size)


def _token_logprobs(params, cfg, prompt, response) -> np.ndarray:
    """log p(response_i | prompt, response_<i) of one sequence on its own, no mask (what follows it cannot
    change a causal model's earlier logits): the direct computation."""
    seq = list(prompt) + list(response)
    tokens = jnp.asarray([seq + [0] * (S - len(seq))], jnp.int32)
    logits, _ = _forward(params, tokens, cfg)
    logp = jax.nn.log_softmax(logits[0, len(prompt) - 1:len(seq) - 1], axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(response)[:, None], axis=-1)[:, 0])


@jax.jit(static_argnames="cfg")
def _forward(params, tokens, cfg, mask=None):
    return transformer.forward(params, tokens, cfg=cfg, attn_mask_BxT=mask)


def _batched_logprobs(params, cfg, prompts, responses, n_resp) -> jax.Array:
    """The same from one right-padded batch, in the [B, N] response layout (0 at padding)."""
    tokens, mask = np.zeros((len(prompts), S), np.int32), np.zeros((len(prompts), S), bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        tokens[b, : len(seq)], mask[b, : len(seq)] = seq, True
    logits, _ = _forward(params, jnp.asarray(tokens), cfg, jnp.asarray(mask))
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = np.zeros((len(prompts), n_resp), np.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        pos = np.arange(len(p) - 1, len(p) - 1 + len(r))
        out[b, : len(r)] = np.asarray(logp[b, pos, np.asarray(r, np.int64)])
    return jnp.asarray(out)


@pytest.fixture(scope="module")
def models():
    return numpy_params(STUDENT, seed=1, std=0.5), numpy_params(TEACHER, seed=2, std=0.5)


def test_span_signal_equals_teacher_forced_sums(toy, smollm2, models):
    s_params, t_params = models
    pair = check_pair(toy, smollm2)
    s_prompts = [prompt_ids(toy, q) for q in QUESTIONS]
    s_resps = [encode_text(toy, r) + ([toy.eos_token_id] if eos else []) for r, eos in RESPONSES]
    rows = [align_response(pair, [{"role": "user", "content": q}], r) for q, r in zip(QUESTIONS, s_resps)]
    assert isinstance(rows[0], Alignment) and isinstance(rows[1], Alignment) and isinstance(rows[2], Misaligned)
    Ns, Nt, K = 24, 20, 24
    idx = span_index(rows, Ns, Nt, K, pad_id=smollm2.pad_token_id or 0)
    assert idx.reasons == (None, None, rows[2].reason)
    assert not idx.span_mask_BxK[2].any() and (idx.student_span_BxNs[2] == K).all()

    logp_s = _batched_logprobs(s_params, STUDENT, s_prompts, s_resps, Ns)
    t_prompts = [r.teacher_prompt_ids_Pt if isinstance(r, Alignment) else [0] for r in rows]
    t_resps = [r.teacher_ids_Nt if isinstance(r, Alignment) else [] for r in rows]
    logp_t = _batched_logprobs(t_params, TEACHER, t_prompts, t_resps, Nt)
    out = jax.jit(span_logprobs)(logp_s, logp_t, idx.student_span_BxNs, idx.teacher_span_BxNt, idx.span_mask_BxK)

    for b, row in enumerate(rows[:2]):
        direct_s = _token_logprobs(s_params, STUDENT, s_prompts[b], s_resps[b])
        direct_t = _token_logprobs(t_params, TEACHER, row.teacher_prompt_ids_Pt, row.teacher_ids_Nt)
        want_s = [direct_s[s0:s1].sum() for s0, s1 in row.spans_student_Kx2]
        want_t = [direct_t[t0:t1].sum() for t0, t1 in row.spans_teacher_Kx2]
        k = row.n_spans
        np.testing.assert_allclose(out.student_BxK[b, :k], want_s, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.teacher_BxK[b, :k], want_t, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.signal_BxK[b, :k], np.subtract(want_s, want_t), rtol=1e-5, atol=1e-5)
        # chain rule: the spans partition both responses, so they sum to the sequences' log-probs
        np.testing.assert_allclose(out.student_BxK[b].sum(), direct_s.sum(), rtol=1e-5)
        np.testing.assert_allclose(out.teacher_BxK[b].sum(), direct_t.sum(), rtol=1e-5)
        assert (np.asarray(out.signal_BxK[b, k:]) == 0).all()
        assert idx.end_span_BxK[b, k - 1] == row.ends_turn and idx.end_span_BxK[b].sum() == row.ends_turn
        assert (idx.teacher_ids_BxNt[b, : len(row.teacher_ids_Nt)] == row.teacher_ids_Nt).all()
        assert (idx.student_start_BxK[b, :k] == row.spans_student_Kx2[:, 0]).all()
    assert rows[0].ends_turn and not rows[1].ends_turn


def test_span_index_rows_that_do_not_fit_get_a_reason(toy, smollm2):
    pair = check_pair(toy, smollm2)
    row = align_response(pair, [{"role": "user", "content": "q"}], encode_text(toy, "a b c") + [toy.eos_token_id])
    idx = span_index([row, row], 6, 5, 3)
    assert idx.reasons[0] == idx.reasons[1] and idx.reasons[0].startswith("alignment does not fit: 6 student tokens")
    assert not idx.span_mask_BxK.any()
    assert span_index([row], 6, 5, 6).reasons == (None,)


def test_span_logprobs_gradient_and_broadcast():
    span_s = jnp.asarray([[0, 0, 1, 2, 3]])  # 3 = K: padding
    span_t = jnp.asarray([[0, 1, 1, 2, 3, 3]])
    mask = jnp.asarray([[True, True, True]])
    rng = np.random.default_rng(0)
    ls, lt = jnp.asarray(-rng.random((1, 5))), jnp.asarray(-rng.random((1, 6)))
    out = span_logprobs(ls, lt, span_s, span_t, mask)
    np.testing.assert_allclose(out.signal_BxK[0], [ls[0, 0] + ls[0, 1] - lt[0, 0], ls[0, 2] - lt[0, 1] - lt[0, 2],
                                                   ls[0, 3] - lt[0, 3]], rtol=1e-6)
    g_s, g_t = jax.grad(lambda a, b: span_logprobs(a, b, span_s, span_t, mask).signal_BxK.sum(), (0, 1))(ls, lt)
    assert g_s.tolist() == [[1, 1, 1, 1, 0]] and g_t.tolist() == [[-1, -1, -1, -1, 0, 0]]
    np.testing.assert_allclose(at_tokens(out.signal_BxK, span_s)[0], [*out.signal_BxK[0, [0, 0, 1, 2]], 0])
