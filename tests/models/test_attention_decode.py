"""The "splash" entry's cached call, the decode kernel (`jopd.models.attention_decode`): in Pallas interpret mode on
CPU it equals the "xla" entry's cached call at a scalar and per-row slots, with left-padded prompts and grouped-query
heads, reads nothing past a row's slot, and runs per device under a mesh; with libtpu, one decode step of a tiny model
compiles ahead of time for a TPU chip with the real kernel in it."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import attention_decode, transformer
from jopd.models.attention import ATTENTION
from jopd.models.attention_decode import decode_cached
from jopd.models.config import ModelConfig

B, H, K, Dh, S = 4, 4, 2, 128, 384  # three 128-slot blocks (no larger block divides S); GQA 2:1
F32 = jnp.float32


def case(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, 1, H, Dh)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, S, Dh)).astype(np.float32) for _ in range(2))
    mask = np.ones((B, S), bool)
    mask[0, :37] = False  # left-padded prompts of different lengths
    mask[1, :100] = False
    mask[2, :130] = False  # padding past the first block
    return q, k, v, mask


def test_registered_as_the_splash_entrys_cached_call():
    assert ATTENTION["splash"].cached is decode_cached


@pytest.mark.parametrize("per_row", [False, True])
def test_cached_equals_xla_with_left_padding_and_gqa(per_row):
    q, k, v, mask = case()
    slot = jnp.asarray([300, 127, 131, 5] if per_row else 140, jnp.int32)
    out = np.asarray(decode_cached(q, k, v, slot=slot, kv_mask_BxS=mask, dtype=F32))
    ref = np.asarray(ATTENTION["xla"].cached(q, k, v, slot=slot, kv_mask_BxS=mask, dtype=F32))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    if per_row:  # the blocks past a row's slot are never read: NaN there changes nothing
        k2, v2 = k.copy(), v.copy()
        assert attention_decode._block(S, K, Dh, 4) == 128
        for b, s in enumerate([300, 127, 131, 5]):
            k2[b, :, (s // 128 + 1) * 128:] = np.nan
            v2[b, :, (s // 128 + 1) * 128:] = np.nan
        again = np.asarray(decode_cached(q, k2, v2, slot=slot, kv_mask_BxS=mask, dtype=F32))
        np.testing.assert_array_equal(again, out)


def test_under_a_mesh_and_for_several_new_tokens():
    """Per device under a (data, fsdp, tensor) = (2, 2, 2) mesh (a row and a kv head each); T > 1 new tokens take
    the blocked path. Both equal the "xla" entry."""
    q, k, v, mask = case(1)
    slot = jnp.asarray([300, 127, 131, 5], jnp.int32)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda q_, k_, v_: decode_cached(q_, k_, v_, slot=slot, kv_mask_BxS=mask, dtype=F32))
        assert "shard_map" in fn.trace(q, k, v).jaxpr.pretty_print()
        out = np.asarray(fn(q, k, v))
    ref = np.asarray(ATTENTION["xla"].cached(q, k, v, slot=slot, kv_mask_BxS=mask, dtype=F32))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    q3 = np.concatenate([q, q[:, :1] * 0.5, q[:, :1] * 2.0], axis=1)  # three new tokens per row
    out3 = np.asarray(decode_cached(q3, k, v, slot=slot, kv_mask_BxS=mask, dtype=F32))
    ref3 = np.asarray(ATTENTION["xla"].cached(q3, k, v, slot=slot, kv_mask_BxS=mask, dtype=F32))
    np.testing.assert_allclose(out3, ref3, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra installs it)")
def test_a_decode_step_compiles_for_a_tpu_chip():
    """One decode step (one token per row at per-row slots) of a tiny two-layer model, bf16, for a v5e chip: one
    Mosaic call per layer, not the interpreter's loop."""
    from jopd.sizing.topology import topology_devices

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=H,
                      num_kv_heads=K, head_dim=Dh, max_position_embeddings=512)
    sharding = jax.sharding.SingleDeviceSharding(topology_devices("v5e:2x2")[0])
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    params = abstract(transformer.abstract_params(cfg, jnp.bfloat16))
    cache = abstract(jax.eval_shape(lambda: transformer.init_cache(cfg, B, S, jnp.bfloat16)))
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    def step(params, tok_B, cache, slot_B, kv_mask_BxS):
        return transformer.forward(params, tok_B[:, None], cfg=cfg, cache=cache, cache_index=slot_B,
                                   positions_BxT=slot_B[:, None], kv_mask_BxS=kv_mask_BxS, dtype=jnp.bfloat16,
                                   attention="splash")

    lowered = jax.jit(step).trace(params, i32((B,)), cache, i32((B,)),
                                  jax.ShapeDtypeStruct((B, S), bool, sharding=sharding)).lower()
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == cfg.num_layers and "stablehlo.while" not in text
    assert lowered.compile().memory_analysis() is not None
