"""The "chunked" attention entry (`jopd.models.attention_chunked`) equals the "xla" entry: forward and gradient with
padding on either side, packed segments, grouped-query heads, lengths not a multiple of the block (a block of 4
here, so every call spans several), the cached call at a scalar and per-row slots, bf16, a whole forward; and
its program never holds a [T, T] score tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import transformer as T
from jopd.models.attention import ATTENTION
from jopd.models.attention_chunked import chunked_cached, chunked_causal
from tests.models.test_attention import CFG, qkv

BLK = 4  # small blocks: T = 11 is three query blocks (the last one padded), S = 13 four key blocks
XLA = ATTENTION["xla"]
F32 = jnp.float32


def causal_case():
    T_ = 11
    q, k, v = qkv(T_, T_, seed=5)
    mask = np.ones((3, T_), bool)
    mask[0, :3] = False  # left padding: query 0..2 of row 0 see nothing
    mask[1, 8:] = False  # right padding
    seg = np.array([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0] * 11, [0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3]])
    return q, k, v, mask, seg


def chunked(q, k, v, **kw):
    return chunked_causal(q, k, v, block_q=BLK, block_k=BLK, **kw)


def test_registered_under_its_name():
    assert ATTENTION["chunked"].causal is chunked_causal and ATTENTION["chunked"].cached is chunked_cached


@pytest.mark.parametrize("segments", [False, True])
def test_causal_equals_xla_with_padding_segments_gqa_and_a_ragged_last_block(segments):
    q, k, v, mask, seg = causal_case()
    seg = seg if segments else None
    ref = np.asarray(XLA.causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=F32))
    out = np.asarray(chunked(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=F32))
    assert out.shape == ref.shape
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)  # a padded query's output is unused
    assert np.isfinite(out).all()


@pytest.mark.parametrize("per_row", [False, True])
def test_cached_equals_xla_at_slots(per_row):
    S, T_ = 13, 2
    q, k, v = qkv(T_, S, seed=6)
    kv_mask = np.ones((3, S), bool)
    kv_mask[0, :2] = False  # a left-padded prompt
    kv_mask[2, 4] = False
    slot = jnp.asarray([3, 7, 11]) if per_row else jnp.int32(5)
    for m in (kv_mask, None):
        ref = XLA.cached(q, k, v, slot=slot, kv_mask_BxS=m, dtype=F32)
        out = chunked_cached(q, k, v, slot=slot, kv_mask_BxS=m, dtype=F32, block_q=BLK, block_k=BLK)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_gradient_equals_xla_on_real_rows_and_is_finite_everywhere():
    q, k, v, mask, seg = causal_case()
    w = np.random.default_rng(7).normal(size=q.shape).astype(np.float32) * mask[:, :, None, None]

    def loss(fn):
        # only real queries' outputs are read, as in the model (the loss masks padded rows)
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=F32) * w)

    ref = jax.grad(loss(XLA.causal), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(chunked), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, ref):
        g = np.asarray(g)
        assert np.isfinite(g).all(), name  # row 0's first queries see nothing: no NaN leaks into the gradient
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)
    # and a loss reading every output, the fully masked queries' too, still has a finite gradient
    every = jax.grad(lambda q, k, v: jnp.sum(chunked(q, k, v, mask_BxT=mask, dtype=F32)), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in every)


def test_bf16_is_within_tolerance_of_fp32():
    q, k, v, mask, seg = causal_case()
    ref = np.asarray(XLA.causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=F32))
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    out = chunked(*bf, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    # bf16 keeps 8 mantissa bits: inputs, probabilities and output each round at ~4e-3 relative
    np.testing.assert_allclose(np.asarray(out, np.float32)[mask], ref[mask], rtol=3e-2, atol=3e-2)


def test_a_forward_with_it_gives_the_xla_logits_and_decodes_alike():
    params = T.init_params(CFG, jax.random.key(2))
    toks = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 7)))
    mask = jnp.asarray([[True] * 7, [False, False] + [True] * 5])
    real = np.asarray(mask)
    ref, _ = T.forward(params, toks, cfg=CFG, attn_mask_BxT=mask)
    out, _ = T.forward(params, toks, cfg=CFG, attn_mask_BxT=mask, attention="chunked")
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-4, atol=1e-5)
    # prefill into a cache, then one decode step: the cached call
    kv_mask = jnp.concatenate([mask, jnp.ones((2, 3), bool)], axis=1)
    logits = {}
    for name in ("xla", "chunked"):
        _, cache = T.forward(params, toks, cfg=CFG, attn_mask_BxT=mask, cache=T.init_cache(CFG, 2, 10),
                             cache_index=0, kv_mask_BxS=kv_mask, attention=name)
        logits[name], _ = T.forward(params, toks[:, -1:], cfg=CFG, cache=cache, cache_index=7,
                                    kv_mask_BxS=kv_mask, positions_BxT=jnp.asarray([[7], [5]]), attention=name)
    np.testing.assert_allclose(np.asarray(logits["chunked"]), np.asarray(logits["xla"]), rtol=1e-4, atol=1e-5)


def _largest_intermediate(closed_jaxpr) -> int:
    """The most elements of any value an equation of the program (its scans, conds and checkpoints included)
    produces."""
    most = 0
    todo = [closed_jaxpr.jaxpr]
    while todo:
        jaxpr = todo.pop()
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                most = max(most, int(np.prod(getattr(var.aval, "shape", ()))))
            for p in eqn.params.values():
                for sub in p if isinstance(p, tuple | list) else (p,):
                    if hasattr(sub, "eqns"):
                        todo.append(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        todo.append(sub.jaxpr)
    return most


def test_no_intermediate_holds_a_score_tensor_of_the_full_length():
    # T = 64 tokens in blocks of 8: a [B, H, T, T] score tensor is B*H*4096 elements; the chunked program's
    # largest value (a query block's stacked tiles in the backward pass) is B*H*T*8
    B_, T_, H_, K_, Dh_ = 1, 64, 2, 1, 4
    rng = np.random.default_rng(8)
    q = rng.normal(size=(B_, T_, H_, Dh_)).astype(np.float32)
    k, v = (rng.normal(size=(B_, K_, T_, Dh_)).astype(np.float32) for _ in range(2))
    mask = np.ones((B_, T_), bool)
    bound = B_ * H_ * T_ * T_ // 4

    def fwd(fn, **kw):
        return lambda q, k, v: fn(q, k, v, mask_BxT=mask, dtype=F32, **kw)

    def grad(fn, **kw):
        return jax.grad(lambda q, k, v: jnp.sum(fwd(fn, **kw)(q, k, v) ** 2), argnums=(0, 1, 2))

    for program in (fwd(chunked_causal, block_q=8, block_k=8), grad(chunked_causal, block_q=8, block_k=8)):
        assert _largest_intermediate(jax.make_jaxpr(program)(q, k, v)) < bound
    # the check can fail: the dense entry's program holds the whole [B, H, T, T] scores
    assert _largest_intermediate(jax.make_jaxpr(fwd(XLA.causal))(q, k, v)) >= B_ * H_ * T_ * T_
