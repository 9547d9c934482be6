"""Every attention implementation of the seam ("xla", "chunked", "cudnn", "splash") equals a float64 numpy reference,
forward and gradient, in fp32 and bf16, at a short and a long (2k-token) length, with grouped-query heads, padding
on either side and packed segments. "chunked" runs with small blocks (several query and key tiles, a ragged last
one); "cudnn" runs its non-GPU branch (the same `jax.nn.dot_product_attention` call, implementation "xla"), which
tests its argument mapping; "splash" runs in Pallas interpret mode, at the short length only (the interpreter is
slow).

Tolerances, as a bound on max|error| over max|reference| per array (padded queries' outputs are never read, so
they are not compared; their cotangent is zero):
- fp32: 1e-5 (accumulation order only: online vs one-shot softmax, blockwise sums over up to 2k keys).
- bf16: the reference is taken on the bf16-rounded inputs, so only the implementation's own roundings count. bf16
  keeps 8 significant bits: each rounding is off by at most u = 2^-8 relative. The forward rounds the
  probabilities and the output (scores and sums stay fp32): 2u, plus 2u for the softmax normaliser computed
  from unrounded probabilities and for slack: 4u. The backward rounds the output cotangent's products once more
  per dot (dP = dO V^T, dS, dQ = dS K, dK = dS^T Q, dV = P^T dO): 8u.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models.attention import ATTENTION
from jopd.models.attention_chunked import chunked_causal
from tests.helpers.bf16_tolerance import BF16_UNIT_ROUNDOFF

Dh = 8
U = BF16_UNIT_ROUNDOFF  # 2^-8
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (4 * U, 8 * U)}  # (forward, gradient)


def case(T_: int, segments: bool, seed: int):
    """q, k, v and the structure of the rows. Short: padding on both sides (a prompt + response row), right padding
    (with `segments`: one long and several short packed segments), left padding. Long: one row (the time goes as
    B H T^2), padded on both sides, with `segments` holding one long and several short segments."""
    B, H_, K_ = (3, 4, 2) if T_ < 1024 else (1, 2, 1)  # two query heads per kv head
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T_, H_, Dh)).astype(np.float32)
    k, v = (rng.normal(size=(B, K_, T_, Dh)).astype(np.float32) for _ in range(2))
    mask = np.ones((B, T_), bool)
    mask[0, :T_ // 7], mask[0, T_ - T_ // 6:] = False, False
    if B > 1:
        mask[1, T_ - T_ // 9:] = False
        mask[2, :T_ // 5] = False
    seg = None
    if segments:
        seg = np.zeros((B, T_), np.int32)
        for s, start in enumerate((T_ // 2, T_ // 2 + T_ // 8, T_ // 2 + T_ // 4, T_ - T_ // 5)):
            seg[B - 2, start:] = s + 1
    cot = rng.normal(size=q.shape).astype(np.float32) * mask[:, :, None, None]
    return q, k, v, mask, seg, cot


def allowed(mask_BxT, seg_BxT):
    T_ = mask_BxT.shape[1]
    out = np.tril(np.ones((T_, T_), bool))[None] & mask_BxT[:, None, :]
    if seg_BxT is not None:
        out &= seg_BxT[:, :, None] == seg_BxT[:, None, :]
    return out


def reference_vjp(q, k, v, allowed_BxTxS, cot):
    """float64 softmax attention over the allowed keys, and its vjp with the cotangent `cot` (one [T, S] score
    matrix at a time: dS = P * (dP - rowsum(P * dP)), dQ = dS K / sqrt(Dh), dK = dS^T Q / sqrt(Dh), dV = P^T dO)."""
    q, k, v, cot = (np.asarray(a, np.float64) for a in (q, k, v, cot))
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    G, Dh_ = q.shape[2] // k.shape[1], q.shape[3]
    for b in range(q.shape[0]):
        ok = allowed_BxTxS[b]
        seen = ok.any(1)
        for h in range(q.shape[2]):
            kv = h // G
            s = q[b, :, h] @ k[b, kv].T / np.sqrt(Dh_)
            s = np.where(ok, s, -np.inf)
            s = s - np.where(seen, s.max(1), 0.0)[:, None]
            p = np.where(ok, np.exp(s), 0.0)
            p /= np.where(seen, p.sum(1), 1.0)[:, None]
            out[b, :, h] = p @ v[b, kv]
            dp = cot[b, :, h] @ v[b, kv].T
            ds = p * (dp - (p * dp).sum(1, keepdims=True))
            dq[b, :, h] = ds @ k[b, kv] / np.sqrt(Dh_)
            dk[b, kv] += ds.T @ q[b, :, h] / np.sqrt(Dh_)
            dv[b, kv] += p.T @ cot[b, :, h]
    return out, (dq, dk, dv)


SHORT, LONG = 40, 2048
CHUNK_BLOCK = {SHORT: 16, LONG: 256}  # 3 tiles a side (the last ragged) at 40 tokens; 8 a side at 2k


def implementation(name: str, T_: int):
    if name == "chunked":
        return functools.partial(chunked_causal, block_q=CHUNK_BLOCK[T_], block_k=CHUNK_BLOCK[T_])
    return ATTENTION[name].causal


@functools.lru_cache(maxsize=None)
def expected(T_, segments, dtype):
    q, k, v, mask, seg, cot = case(T_, segments, seed=T_ + segments)
    if dtype == "bfloat16":  # the reference sees the inputs the implementation sees
        q, k, v, cot = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (q, k, v, cot))
    return (q, k, v, mask, seg, cot), reference_vjp(q, k, v, allowed(mask, seg), cot)


def run(fn, inputs, dtype):
    q, k, v, mask, seg, cot = inputs
    dt = jnp.dtype(dtype)

    @jax.jit
    def fwd_bwd(q, k, v, cot):
        out, pullback = jax.vjp(lambda q_, k_, v_: fn(q_, k_, v_, mask_BxT=mask, segment_ids_BxT=seg, dtype=dt),
                                q, k, v)
        return out, pullback(cot.astype(out.dtype))

    out, grads = fwd_bwd(*(jnp.asarray(a, dt) for a in (q, k, v, cot)))
    assert out.dtype == dt
    return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]


def assert_close(got, ref, tol, what):
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert err <= tol * scale, f"{what}: max|error| {err:.3g} > {tol:.3g} x max|ref| {scale:.3g}"


# Segments given, every implementation sees padding on either side and packed segments in one call; "cudnn" runs
# without (its rolled rows): packed rows it hands to "chunked" (tests/models/test_attention_cudnn.py). At 2k
# tokens: "chunked" in fp32 and bf16 (its sums span the most tiles), "cudnn" by its rolled rows;
# "xla" at 2k is in tests/models/test_parity_hf.py (a Qwen3's logits against transformers').
CASES = ([(name, SHORT, True, dtype) for name in ("xla", "chunked", "splash") for dtype in ("float32", "bfloat16")]
         + [("cudnn", SHORT, False, dtype) for dtype in ("float32", "bfloat16")]
         + [("chunked", LONG, True, "float32"), ("chunked", LONG, True, "bfloat16"), ("cudnn", LONG, False, "float32")])


@pytest.mark.parametrize("name,T_,segments,dtype", CASES)
def test_forward_and_gradient_equal_the_reference(name, T_, segments, dtype):
    inputs, (ref, ref_grads) = expected(T_, segments, dtype)
    mask = inputs[3]
    out, grads = run(implementation(name, T_), inputs, dtype)
    tol_fwd, tol_grad = TOL[dtype]
    assert_close(out[mask], ref[mask], tol_fwd, "output")
    for what, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert np.isfinite(g).all(), what
        assert_close(g, r, tol_grad, what)
