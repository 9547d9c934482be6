"""The "cudnn" attention entry (`jopd.models.attention_cudnn`) beyond its numbers (tests/models/
test_attention_reference.py runs its mapping against the reference): the structure of its program on a host with
a CUDA backend (cuDNN's call for bf16, "chunked" for fp32, the xla call for any other platform), packed rows (the
"chunked" call on every platform), and its decode call, which is "chunked"'s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import attention_cudnn
from jopd.models.attention import ATTENTION
from tests.models.test_attention import qkv


def test_decode_is_the_chunked_call():
    S, T_ = 12, 1
    q, k, v = qkv(T_, S, seed=9)
    kv_mask = np.ones((3, S), bool)
    kv_mask[0, :3] = False
    slot = jnp.asarray([4, 8, 11])
    out = ATTENTION["cudnn"].cached(q, k, v, slot=slot, kv_mask_BxS=kv_mask, dtype=jnp.float32)
    ref = ATTENTION["chunked"].cached(q, k, v, slot=slot, kv_mask_BxS=kv_mask, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.skipif(attention_cudnn.cuda_backend(), reason="checks what a CPU-only host traces for a CUDA one")
def test_with_a_cuda_backend_the_gpu_branch_is_cudnn_for_bf16_and_chunked_for_fp32(monkeypatch):
    q, k, v = qkv(8, 8, seed=10)
    mask = np.ones((3, 8), bool)
    mask[0, :2] = False
    causal = lambda q_, k_, v_, dtype: ATTENTION["cudnn"].causal(q_, k_, v_, mask_BxT=mask, dtype=dtype)  # noqa: E731
    assert "platform_index" not in str(jax.make_jaxpr(lambda *a: causal(*a, jnp.float32))(q, k, v))  # the xla call
    monkeypatch.setattr(attention_cudnn, "cuda_backend", lambda: True)
    program = str(jax.make_jaxpr(lambda *a: causal(*a, jnp.float32))(q, k, v))
    assert "platform_index" in program and "scan" in program  # a platform switch; the fp32 GPU branch is blockwise
    # bf16: the GPU branch is jax's cuDNN call, which cannot even be traced without cuDNN
    with pytest.raises(RuntimeError, match="cuDNN"):
        jax.make_jaxpr(lambda *a: causal(*a, jnp.bfloat16))(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)))


def test_packed_rows_run_the_chunked_call_on_every_platform(monkeypatch):
    q, k, v = qkv(8, 8, seed=11)
    mask = np.ones((3, 8), bool)
    seg = np.array([[0, 0, 0, 1, 1, 1, 2, 2]] * 3)
    ref = np.asarray(ATTENTION["chunked"].causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32))
    monkeypatch.setattr(attention_cudnn, "cuda_backend", lambda: True)  # a GPU host: still no platform switch
    packed = lambda *a: ATTENTION["cudnn"].causal(*a, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32)  # noqa: E731
    assert "platform_index" not in str(jax.make_jaxpr(packed)(q, k, v))
    np.testing.assert_array_equal(np.asarray(packed(q, k, v)), ref)
