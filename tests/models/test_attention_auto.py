"""The "auto" attention choice (`jopd.models.attention`): on CPU it is exactly "xla" below the length thresholds and
exactly "chunked" from them on; lowered for a TPU from this CPU host it is the splash kernel; a run's
`student.attention` reaches the model's forward, and a bad name is one line naming the field."""

import importlib.util

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.models import attention, transformer
from jopd.models.attention import ATTENTION, attention_impl
from jopd.models.attention_mesh import runs_on
from jopd.models.config import ModelConfig
from jopd.run.config import load_config
from jopd.sizing.arch import model_config_of

B, H, K, Dh = 2, 4, 2, 16


def _qkv(T, S, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, Dh)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("T", [63, 64])
def test_causal_is_xla_below_the_threshold_and_chunked_from_it(monkeypatch, T):
    monkeypatch.setattr(attention, "CPU_CHUNKED_FROM_T", 64)
    q, k, v = _qkv(T, T)
    mask = np.ones((B, T), bool)
    mask[0, :5] = False  # left padding
    seg = np.zeros((B, T), np.int32)
    seg[1, 30:] = 1  # a packed row
    call = lambda name: np.asarray(jax.jit(lambda q, k, v: attention_impl(name).causal(
        q, k, v, mask_BxT=mask, segment_ids_BxT=seg, dtype=jnp.float32))(q, k, v))
    expected = "chunked" if T >= 64 else "xla"
    other = "xla" if expected == "chunked" else "chunked"
    got = call("auto")
    np.testing.assert_array_equal(got, call(expected))
    assert not np.array_equal(got, call(other))  # the two differ in the last bits: the check can tell them apart


@pytest.mark.parametrize("S", [95, 96])
def test_decode_is_xla_below_the_threshold_and_chunked_from_it(monkeypatch, S):
    monkeypatch.setattr(attention, "CPU_CHUNKED_FROM_S", 96)
    q, k, v = _qkv(1, S, seed=1)
    slot = jnp.asarray([40, 90], jnp.int32)  # rows at different decode steps
    kv_mask = np.ones((B, S), bool)
    kv_mask[1, :7] = False
    call = lambda name: np.asarray(jax.jit(lambda q, k, v: attention_impl(name).cached(
        q, k, v, slot=slot, kv_mask_BxS=kv_mask, dtype=jnp.float32))(q, k, v))
    expected = "chunked" if S >= 96 else "xla"
    np.testing.assert_array_equal(call("auto"), call(expected))


def test_the_choice_per_platform_and_length():
    assert [attention.auto_choice("causal", T, "cpu") for T in (128, 1023, 1024, 16384)] == [
        "xla", "xla", "chunked", "chunked"]
    assert attention.auto_choice("causal", 128, "tpu") == attention.auto_choice("cached", 128, "tpu") == "splash"
    assert attention.auto_choice("cached", 100, "cpu") == "xla"
    assert attention.auto_choice("cached", 16384, "cpu") == "chunked"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra installs it)")
def test_lowered_for_a_tpu_auto_is_the_splash_kernel_and_for_cpu_it_is_not():
    from jopd.sizing.topology import topology_devices

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=128)
    params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0), jnp.float32))

    def lowered_text(device):
        sharding = jax.sharding.SingleDeviceSharding(device)
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        fn = jax.jit(lambda p, t: transformer.forward(p, t, cfg=cfg)[0])
        return fn.trace(jax.tree.map(spec, params), spec(jax.ShapeDtypeStruct((1, 256), jnp.int32))).lower().as_text()

    assert "tpu_custom_call" in lowered_text(topology_devices("v5e:2x2")[0])
    assert "tpu_custom_call" not in lowered_text(jax.devices("cpu")[0])


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra installs it)")
def test_under_a_mesh_only_its_platforms_branch_is_traced_and_computes_the_same():
    """Without a mesh in context every platform's branch is traced (the splash kernel's too) and lowering keeps one;
    under a mesh, or where the caller says where it runs (`runs_on`), only that platform's branch is traced: no
    kernel on CPU, the kernel under a TPU topology's mesh, and on CPU the same bits as without either."""
    from jopd.sizing.topology import topology_devices

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=128)
    params = transformer.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 256)), jnp.int32)
    forward = lambda p, t: transformer.forward(p, t, cfg=cfg)[0]  # noqa: E731

    def traced(mesh):  # a function of its own each time: jit's trace cache is not keyed by `runs_on`
        fresh = lambda p, t: forward(p, t)  # noqa: E731
        if mesh is None:
            return _primitives(jax.make_jaxpr(fresh)(params, tokens).jaxpr)
        with jax.set_mesh(mesh):
            return _primitives(jax.make_jaxpr(fresh)(params, tokens).jaxpr)

    cpu = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    tpu = jax.sharding.Mesh(np.array(topology_devices("v5e:2x2")[:1]), ("data",))
    assert {"platform_index", "pallas_call"} <= traced(None)
    assert not {"platform_index", "pallas_call"} & traced(cpu)
    with runs_on("cpu"):  # no mesh, the caller says where it runs (SFT)
        assert not {"platform_index", "pallas_call"} & traced(None)
        with runs_on("gpu"):  # "gpu" is CUDA or ROCm: left to lowering
            assert "platform_index" in traced(None)
        on_tpu = traced(tpu)  # a mesh says more than the caller
    assert "pallas_call" in on_tpu and "platform_index" not in on_tpu
    plain = np.asarray(jax.jit(forward)(params, tokens)).tobytes()
    with jax.set_mesh(cpu):
        assert np.asarray(jax.jit(forward)(params, tokens)).tobytes() == plain
    with runs_on("cpu"):
        assert np.asarray(jax.jit(lambda p, t: forward(p, t) + 0)(params, tokens)).tobytes() == plain


def test_a_runs_attention_reaches_the_models_forward_and_a_bad_name_is_one_line():
    cfg = load_config("configs/smoke.yaml", ["student.attention=chunked"])
    assert model_config_of(cfg.student, "student").attention == "chunked"
    assert model_config_of(cfg.teacher, "teacher").attention == "auto"
    with pytest.raises(ConfigError, match=r"RunConfig.teacher.attention: unknown attention implementation 'flash' "
                                          r"\(registered: xla, chunked, splash.*\) \(or 'auto'\)$"):
        load_config("configs/smoke.yaml", ["teacher.attention=flash"])
    assert set(ATTENTION.names()) >= {"xla", "chunked", "splash"}
