"""Truncated-RKL supports beyond the teacher's top-K (union with the student's top-K, the sampled token) and the
masking with no free escape, against independent numpy formulas and finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax, logsumexp

from jopd.losses import LossBatch, LossConfig, token_loss_from_logits
from jopd.opd.teacher_scoring import teacher_scores
from jopd.losses.masks import loss_mask

B, T, V, K = 2, 5, 13, 3


def _rand(seed, shape, scale=2.0):
    return np.random.default_rng(seed).normal(size=shape) * scale


def _support(t_logits, s_logits, targets, union, sampled):
    """Numpy: the support ids per position and whether each is the first occurrence of its id."""
    t_top = np.argsort(-t_logits, axis=-1, kind="stable")[..., :K]
    parts = [t_top]
    if union:
        parts.append(np.argsort(-s_logits, axis=-1, kind="stable")[..., :K])
    if sampled:
        parts.append(targets[..., None])
    ids = np.concatenate(parts, -1)
    first = np.ones(ids.shape, bool)
    for j in range(ids.shape[-1]):
        first[..., j] = ~(ids[..., :j] == ids[..., j:j + 1]).any(-1)
    return ids, first


def _np_loss(s_logits, t_logits, ids, first, tail):
    """Reverse KL on the unique support ids: renormalized on S, or S + one tail outcome (full softmaxes)."""
    log_ps, log_pt = log_softmax(s_logits, -1), log_softmax(t_logits, -1)
    out = np.zeros(ids.shape[:-1])
    for idx in np.ndindex(*ids.shape[:-1]):
        u = ids[idx][first[idx]]
        ps, pt = log_ps[idx][u], log_pt[idx][u]
        if tail:
            ps_t, pt_t = np.log1p(-np.exp(logsumexp(ps))), np.log1p(-np.exp(logsumexp(pt)))
            out[idx] = np.sum(np.exp(ps) * (ps - pt)) + np.exp(ps_t) * (ps_t - pt_t)
        else:
            ps, pt = ps - logsumexp(ps), pt - logsumexp(pt)
            out[idx] = np.sum(np.exp(ps) * (ps - pt))
    return out


def _batch(s, t, targets, union, sampled):
    """The loss batch as the step builds it: the teacher scores at the support (teacher_scores with extra ids)."""
    extra = []
    if union:
        extra.append(np.argsort(-s, axis=-1, kind="stable")[..., :K])
    if sampled:
        extra.append(targets[..., None])
    hidden = jnp.asarray(t, jnp.float32)  # identity "head": the teacher's logits are its hidden states
    head = {"lm_head": jnp.eye(V, dtype=jnp.float32)}
    scores = teacher_scores(hidden, head, k=K, chunk=2, targets_BxT=jnp.asarray(targets),
                            extra_ids_BxTxE=jnp.asarray(np.concatenate(extra, -1)) if extra else None)
    return LossBatch(targets_BxT=jnp.asarray(targets), response_mask_BxT=jnp.ones((B, T), bool), **scores)


CASES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("union,sampled", CASES)
def test_each_support_equals_numpy_value_and_finite_difference_gradient(union, sampled, tail):
    s, t = _rand(0, (B, T, V)), _rand(1, (B, T, V))
    s[0, 1, :3] = t[0, 1, :3] - 10  # some positions where the two top-K sets differ, some where they share ids
    targets = np.random.default_rng(2).integers(0, V, (B, T))
    ids, first = _support(t, s, targets, union, sampled)
    batch = _batch(s, t, targets, union, sampled)
    np.testing.assert_array_equal(batch.teacher_topk_ids_BxTxK, ids)
    if union or sampled:
        np.testing.assert_array_equal(batch.support_mask_BxTxK, first)
        assert (~first).any()  # the constructed case does repeat ids
    np.testing.assert_allclose(batch.teacher_topk_logprobs_BxTxK, np.take_along_axis(log_softmax(t, -1), ids, -1),
                               rtol=1e-5, atol=1e-6)
    cfg = LossConfig(kind="topk_rkl_tail" if tail else "topk_rkl", top_k=K, support="union" if union else "teacher_topk",
                     support_sampled=sampled)
    loss_of = jax.jit(lambda x: token_loss_from_logits(cfg, x, batch)[0])
    x = jnp.asarray(s, jnp.float32)
    expected = _np_loss(s, t, ids, first, tail).mean()  # every position counts, so the token mean is the mean
    np.testing.assert_allclose(loss_of(x), expected, rtol=1e-5)
    grad = np.asarray(jax.grad(loss_of)(x), np.float64)
    rng = np.random.default_rng(3)
    for _ in range(6):  # central differences of the numpy loss along random directions
        d = rng.normal(size=s.shape)
        eps = 1e-4
        fd = (_np_loss(s + eps * d, t, ids, first, tail).mean() - _np_loss(s - eps * d, t, ids, first, tail).mean())
        np.testing.assert_allclose(np.sum(grad * d), fd / (2 * eps), rtol=2e-3, atol=1e-6)


def test_union_with_k_equal_vocab_is_the_full_reverse_kl():
    global K
    s, t = _rand(4, (B, T, V)), _rand(5, (B, T, V))
    targets = np.zeros((B, T), np.int64)
    k0, K = K, V
    try:
        batch = _batch(s, t, targets, union=True, sampled=False)
        cfg = LossConfig(kind="topk_rkl", top_k=V, support="union")
        loss = float(token_loss_from_logits(cfg, jnp.asarray(s, jnp.float32), batch)[0])
    finally:
        K = k0
    full = np.sum(np.exp(log_softmax(s, -1)) * (log_softmax(s, -1) - log_softmax(t, -1)), -1).mean()
    np.testing.assert_allclose(loss, full, rtol=1e-5)


def test_mass_off_the_teacher_top_k_is_penalized_by_union_and_tail_not_by_teacher_topk():
    t = _rand(6, (B, T, V))
    targets = np.zeros((B, T), np.int64)
    t_top = np.argsort(-t, -1)[..., :K]
    s_on = t.copy()  # the student matches the teacher's shape on its top-K ...
    s_off = t.copy()
    outside = np.argsort(-t, -1)[..., -1]  # ... and one moves most of its mass to a token the teacher rules out
    np.put_along_axis(s_off, outside[..., None], t.max() + 6.0, -1)
    losses = {}
    for name, union, tail in (("teacher_topk", False, False), ("union", True, False), ("tail", False, True)):
        cfg = LossConfig(kind="topk_rkl_tail" if tail else "topk_rkl", top_k=K, support="union" if union else "teacher_topk")
        losses[name] = [float(token_loss_from_logits(cfg, jnp.asarray(x, jnp.float32),
                                                     _batch(x, t, targets, union, False))[0]) for x in (s_on, s_off)]
    assert abs(losses["teacher_topk"][1] - losses["teacher_topk"][0]) < 1e-5  # blind to it
    assert losses["union"][1] > losses["union"][0] + 1.0 and losses["tail"][1] > losses["tail"][0] + 1.0
    assert not (outside[..., None] == t_top).any()  # the moved-to token is outside every top-K


def test_default_masking_trains_emitted_special_tokens_and_masks_template_first_occurrences():
    PAD, BOS, UNK, START = 0, 1, 2, 9
    targets = jnp.asarray([[START, 5, PAD, BOS, START, UNK], [4, START, 6, 7, 8, START]])
    response = jnp.ones((2, 6), bool).at[1, 5].set(False)
    mask = np.asarray(loss_mask(response, targets, (), (START,)))
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 0]])  # pad/bos/unk count
    both = np.asarray(loss_mask(response, targets, (PAD,), (START,)))  # special ids: masked everywhere
    np.testing.assert_array_equal(both, [[0, 1, 0, 1, 1, 1], [1, 0, 1, 1, 1, 0]])


def test_run_config_masking_resolves_from_the_tokenizer():
    from jopd.data.toy_tokenizer import build_toy_tokenizer
    from jopd.run.config import load_config
    from jopd.opd.resolve import resolve_loss_config

    tok = build_toy_tokenizer()
    default = resolve_loss_config(load_config(None), tok)
    assert default.special_token_ids == () and default.template_token_ids == ()
    old = resolve_loss_config(load_config(None, ["train.mask=all_special"]), tok)
    assert tok.pad_token_id in old.special_token_ids and tok.eos_token_id not in old.special_token_ids
    named = resolve_loss_config(load_config(None, ["train.template_tokens=[<|assistant|>]"]), tok)
    assert named.template_token_ids == (tok.convert_tokens_to_ids("<|assistant|>"),)
    with pytest.raises(ValueError, match=r"train.template_tokens: \['<nope>'\] not in the tokenizer"):
        resolve_loss_config(load_config(None, ["train.template_tokens=[<nope>]"]), tok)


def test_configs_saved_before_train_mask_still_load(tmp_path):
    from jopd.run.config import load_config

    old = tmp_path / "config.yaml"
    old.write_text("train: {mask_special_tokens: true, steps: 3}\n")
    assert load_config(str(old)).train.mask == "all_special"
    old.write_text("train: {mask_special_tokens: false}\n")
    assert load_config(str(old)).train.mask == "none"
