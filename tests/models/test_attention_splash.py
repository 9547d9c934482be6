"""The "splash" attention entry (`jopd.models.attention_splash`): on CPU, in Pallas interpret mode, its causal call and
its gradient equal the "xla" entry's with padding, packed segments and grouped-query heads, alone and per device under
a mesh; with libtpu, the real kernel lowers and compiles ahead of time for a TPU topology at a long length, and under a
4-chip mesh on each chip's block. (The entry's cached call: tests/models/test_attention_decode.py.)"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import attention_splash
from jopd.models.attention import ATTENTION

# T = 200 is rounded up to the kernel's 256 (two 128-blocks) inside the entry; two query heads share one kv head.
B, T, H, K, Dh = 2, 200, 2, 1, 128


def test_causal_and_gradient_equal_xla_with_padding_segments_and_gqa():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, H, Dh)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, T, Dh)).astype(np.float32) for _ in range(2))
    mask = np.ones((B, T), bool)
    mask[0, :37] = False  # left padding
    mask[1, 170:] = False  # right padding
    seg = np.zeros((B, T), np.int32)
    seg[1, 60:] = 1  # row 1 packs three segments, the second starting inside the first 128-block
    seg[1, 140:] = 2
    cot = rng.normal(size=(B, T, H, Dh)).astype(np.float32) * mask[:, :, None, None]  # padded outputs unused

    def run(name):
        f = lambda q_, k_, v_: ATTENTION[name].causal(q_, k_, v_, mask_BxT=mask, segment_ids_BxT=seg,
                                                      dtype=jnp.float32)
        out, vjp = jax.vjp(f, q, k, v)
        return np.asarray(out), [np.asarray(g) for g in vjp(cot)]

    out, grads = run("splash")
    ref, ref_grads = run("xla")
    # fp32 flash accumulation (online softmax, blockwise sums) against one dense softmax
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        scale = np.abs(r).max()
        assert np.abs(g - r).max() <= 1e-5 * scale, (name, np.abs(g - r).max(), scale)
    # a segment's output does not depend on another segment's keys (through the kernel's segment ids)
    k2 = k.copy()
    k2[1, :, 60:140] += 10.0
    again = np.asarray(ATTENTION["splash"].causal(q, k2, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32))
    np.testing.assert_array_equal(again[1, :60], out[1, :60])
    np.testing.assert_array_equal(again[1, 140:170], out[1, 140:170])
    assert not np.array_equal(again[1, 60:140], out[1, 60:140])


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra installs it)")
def test_compiles_for_a_tpu_topology_at_a_long_length():
    """The real (not interpreted) kernel, forward and backward, for a v5e chip at T = 4096: Mosaic's custom call
    in the program, no interpreter loop (`stablehlo.while`, what the CPU lowering holds), and scratch far below one
    head's dense [T, T] fp32 scores."""
    from jopd.sizing.topology import topology_devices

    Tl = 4096
    device = topology_devices("v5e:2x2")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def loss(q, k, v, mask, seg):
        out = ATTENTION["splash"].causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.bfloat16)
        return out.astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        spec((1, Tl, H, Dh), jnp.bfloat16), spec((1, K, Tl, Dh), jnp.bfloat16), spec((1, K, Tl, Dh), jnp.bfloat16),
        spec((1, Tl), bool), spec((1, Tl), jnp.int32)).lower()
    text = lowered.as_text()
    assert "tpu_custom_call" in text and "stablehlo.while" not in text
    memory = lowered.compile().memory_analysis()
    assert memory.temp_size_in_bytes < Tl * Tl * 4
    assert attention_splash._kernel.cache_info().currsize >= 1  # built once per shape


def test_under_a_mesh_each_device_runs_its_block_and_equals_xla():
    """Under a (data, fsdp, tensor) = (2, 2, 2) mesh of the 8 CPU devices the kernel runs per device on its
    batch x head block (a shard_map): output and gradient still equal the "xla" entry's, GQA, padding, segments."""
    Bm, Tm, Hm, Km = 4, 128, 4, 2  # per device: 1 row, 2 query heads on 1 kv head
    rng = np.random.default_rng(1)
    q = rng.normal(size=(Bm, Tm, Hm, Dh)).astype(np.float32)
    k, v = (rng.normal(size=(Bm, Km, Tm, Dh)).astype(np.float32) for _ in range(2))
    mask = np.ones((Bm, Tm), bool)
    mask[0, :21] = False
    mask[3, 90:] = False
    seg = np.zeros((Bm, Tm), np.int32)
    seg[2, 50:] = 1
    cot = rng.normal(size=q.shape).astype(np.float32) * mask[:, :, None, None]
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)

    def run(name):
        def f(q_, k_, v_):
            return ATTENTION[name].causal(q_, k_, v_, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32)

        def out_and_grads(q_, k_, v_):
            out, vjp = jax.vjp(f, q_, k_, v_)
            return out, vjp(cot)

        with jax.set_mesh(mesh):
            fn = jax.jit(out_and_grads)
            if name == "splash":
                assert "shard_map" in fn.trace(q, k, v).jaxpr.pretty_print()  # the kernel runs per device
            out, grads = fn(q, k, v)
        return np.asarray(out), [np.asarray(g) for g in grads]

    out, grads = run("splash")
    ref, ref_grads = run("xla")
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max(), name


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra installs it)")
def test_compiles_under_a_tpu_mesh_without_gathering_the_batch():
    """Forward and backward under a (data, fsdp, tensor) = (1, 2, 2) mesh of 4 v5e chips: the Mosaic calls get
    each chip's [B/2, H/2, T, Dh] block (the SPMD partitioner cannot split them itself: without the shard_map this
    does not lower) and the program gathers nothing."""
    from jopd.sizing.topology import topology_devices

    Bm, Tm, Hm, Km = 4, 256, 4, 2
    mesh = jax.sharding.Mesh(np.array(topology_devices("v5e:2x2")).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    P = jax.sharding.PartitionSpec

    def spec(shape, dtype, *axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, P(*axes)))

    def loss(q, k, v, mask, seg):
        out = ATTENTION["splash"].causal(q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.bfloat16)
        return out.astype(jnp.float32).sum()

    batch = ("data", "fsdp")
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            spec((Bm, Tm, Hm, Dh), jnp.bfloat16, batch, None, "tensor"),
            spec((Bm, Km, Tm, Dh), jnp.bfloat16, batch, "tensor"), spec((Bm, Km, Tm, Dh), jnp.bfloat16, batch, "tensor"),
            spec((Bm, Tm), bool, batch), spec((Bm, Tm), jnp.int32, batch)).lower().compile()
    text = compiled.as_text()
    calls = [ln for ln in text.splitlines() if "custom-call(" in ln and "splash_mha" in ln]
    assert len(calls) == 3  # forward, dq, dkv
    assert all(f"bf16[{Bm // 2},{Hm // 2},{Tm},{Dh}]" in ln for ln in calls if "_fwd_" in ln or "_dq_" in ln)
    assert "all-gather" not in text
