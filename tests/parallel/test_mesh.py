"""Mesh, logical-axis rules and sharded forward on 8 simulated CPU devices (see jopd/parallel/)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd import parallel as M
from jopd.config_dataclass import ConfigError, build
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from tests.helpers import sharding as H

# Tiny GQA model (4 heads / 2 kv heads), untied head so lm_head is sharded too.
CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
# SmolLM2-135M's shapes (9 heads, 3 kv heads): indivisible by tensor=2.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
B, L = 8, 16


@pytest.fixture(scope="module")
def reference():
    # x4 (std 0.08, norms 4) so the logits are O(1-10) and a sharding mistake cannot hide under the 1e-4 tolerance
    params = jax.tree.map(lambda x: 4.0 * x, T.init_params(CFG, jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, CFG.vocab_size)
    mask = jnp.arange(L)[None] < jnp.array([16, 12, 9, 16, 3, 16, 16, 7])[:, None]  # right padding
    logits, _ = jax.jit(lambda p, t, m: T.forward(p, t, cfg=CFG, attn_mask_BxT=m))(params, tokens, mask)
    return params, tokens, mask, np.asarray(logits)


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind,sizes", [
    ("train", dict(data=8)),
    ("train", dict(data=1, fsdp=8)),
    ("train", dict(data=2, fsdp=2, tensor=2)),
    ("sample", dict(data=2, fsdp=2, tensor=2)),
])
def test_sharded_forward_equals_unsharded(reference, kind, sizes):
    params, tokens, mask, want = reference
    mesh = M.make_mesh(M.MeshConfig(**sizes))
    assert mesh.devices.size == 8 and dict(mesh.shape) == {**dict(data=1, fsdp=1, tensor=1), **sizes}
    rules = M.rules_for(kind)
    shardings = M.param_shardings(CFG, mesh, rules)
    if kind == "sample":  # created directly in the layout (never whole on one device), same values
        created = H.init_sharded_params(CFG, jax.random.key(0), shardings)
        assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, created, shardings))
        for a, b in zip(jax.tree.leaves(created), jax.tree.leaves(params)):
            np.testing.assert_allclose(4.0 * np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    sharded = jax.device_put(params, shardings)
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, sharded, shardings))
    fwd = M.make_sharded_forward(CFG, mesh, rules, (B, L))
    logits = fwd(sharded, tokens, mask)
    assert logits.sharding.spec == P(("data", "fsdp"), None, "tensor")
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)


def test_params_are_distributed_under_fsdp8(reference):
    params, tokens, mask, _ = reference
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=8))
    shardings = M.param_shardings(CFG, mesh, M.TRAIN_RULES)
    sharded = jax.device_put(params, shardings)
    assert H.shardings_of(sharded) == shardings
    per_device = H.per_device_bytes(sharded)
    assert len(per_device) == 8
    assert max(per_device.values()) <= _bytes(params) / 6, (per_device, _bytes(params))
    assert M.sharded_bytes_per_device(T.abstract_params(CFG), shardings) == max(per_device.values())

    def arg_bytes(mesh):
        fwd = M.make_sharded_forward(CFG, mesh, M.TRAIN_RULES, (B, L))
        abstract = M.sharded_abstract(T.abstract_params(CFG), M.param_shardings(CFG, mesh, M.TRAIN_RULES))
        compiled = fwd.lower(abstract, jax.ShapeDtypeStruct((B, L), jnp.int32),
                             jax.ShapeDtypeStruct((B, L), bool)).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    one_device = M.make_mesh(M.MeshConfig(), devices=jax.devices()[:1])
    full, split = arg_bytes(one_device), arg_bytes(mesh)
    assert full >= _bytes(params)
    assert split <= full / 6, (split, full)


def test_sample_rules_replicate_over_fsdp_and_split_over_tensor():
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    train = M.param_shardings(CFG, mesh, M.TRAIN_RULES)
    sample = M.param_shardings(CFG, mesh, M.SAMPLE_RULES)
    assert train["layers"]["q"].spec == P(None, "fsdp", "tensor", None)
    assert sample["layers"]["q"].spec == P(None, None, "tensor", None)
    assert sample["embed"].spec == P("tensor", None)
    for sh in jax.tree.leaves(sample):
        assert "fsdp" not in jax.tree.leaves(tuple(sh.spec)) and "data" not in jax.tree.leaves(tuple(sh.spec))
    abstract = T.abstract_params(CFG)
    total = sum(np.prod(a.shape) * 4 for a in jax.tree.leaves(abstract))
    norms = (1 + 2 * CFG.num_layers) * CFG.hidden_size * 4  # RMSNorm scales: not split over tensor
    assert M.sharded_bytes_per_device(abstract, sample) <= total / 2 + norms
    assert M.sharded_bytes_per_device(abstract, train) <= total / 4 + norms


def test_reshard_for_sampling_moves_and_casts_without_consuming(reference):
    params = reference[0]
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    train = jax.device_put(params, M.param_shardings(CFG, mesh, M.TRAIN_RULES))
    sample_sh = M.param_shardings(CFG, mesh, M.SAMPLE_RULES)
    out = H.reshard_for_sampling(train, sample_sh, jnp.bfloat16)
    for x, y, sh, p in zip(jax.tree.leaves(train), jax.tree.leaves(out), jax.tree.leaves(sample_sh),
                           jax.tree.leaves(params)):
        assert not x.is_deleted()  # the trainer keeps its copy
        assert y.dtype == jnp.bfloat16 and y.sharding == sh
        np.testing.assert_array_equal(np.asarray(y), np.asarray(p.astype(jnp.bfloat16)))
    hits = H._cast_fn.cache_info().hits
    H.reshard_for_sampling(train, sample_sh, jnp.bfloat16)  # the next weight sync reuses the compiled copy
    assert H._cast_fn.cache_info().hits == hits + 1



def test_unstacked_layer_shardings_place_each_layer_like_its_stacked_slice(reference):
    params = reference[0]
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    stacked = M.param_shardings(CFG, mesh, M.SAMPLE_RULES)
    per_layer = M.unstacked_layer_shardings(stacked, CFG.num_layers)
    out = jax.jit(T.unstack_layers, out_shardings=per_layer)(jax.device_put(params, stacked))
    assert len(out["layers"]) == CFG.num_layers
    for i, layer in enumerate(out["layers"]):
        for name, x in layer.items():
            assert x.sharding.spec == P(*stacked["layers"][name].spec[1:])
            np.testing.assert_array_equal(np.asarray(x), np.asarray(params["layers"][name][i]))
    bad = dict(stacked, layers=jax.tree.map(lambda sh: NamedSharding(mesh, P("data")), stacked["layers"]))
    with pytest.raises(ValueError, match="layers dim is split"):
        M.unstacked_layer_shardings(bad, CFG.num_layers)


def test_teacher_on_split_submesh():
    cfg = build(H.PlacementConfig, {"teacher_devices": "split", "teacher_num_devices": 2,
                                    "student": {"data": -1}, "teacher": {"data": 1, "fsdp": -1}})
    student_mesh, teacher_mesh = H.make_meshes(cfg)
    assert dict(student_mesh.shape) == dict(data=6, fsdp=1, tensor=1)
    assert dict(teacher_mesh.shape) == dict(data=1, fsdp=2, tensor=1)
    assert not set(student_mesh.devices.flat) & set(teacher_mesh.devices.flat)
    same_s, same_t = H.make_meshes(H.PlacementConfig())
    assert same_s is same_t and same_s.devices.size == 8
    # teacher params live only on the teacher's devices; a copy moves to the student's devices on device
    params = T.init_params(CFG, jax.random.key(3))
    teacher = jax.device_put(params, M.param_shardings(CFG, teacher_mesh, M.TRAIN_RULES))
    assert H.per_device_bytes(teacher).keys() == set(teacher_mesh.devices.flat)
    moved = H.reshard_for_sampling(teacher, M.param_shardings(CFG, student_mesh, M.SAMPLE_RULES), jnp.float32)
    assert H.per_device_bytes(moved).keys() == set(student_mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(moved["layers"]["q"]), np.asarray(params["layers"]["q"]))


def test_indivisible_heads_fall_back_to_head_dim_when_replicate():
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    sh = M.param_shardings(SMOLLM2, mesh, M.TRAIN_RULES.with_policy("replicate"))
    assert sh["layers"]["q"].spec == P(None, "fsdp", None, "tensor")  # 9 heads: tensor moves to head_dim
    assert sh["layers"]["k"].spec == P(None, "fsdp", None, "tensor")  # 3 kv heads
    assert sh["layers"]["o"].spec == P(None, None, "tensor", "fsdp")
    assert sh["layers"]["gate"].spec == P(None, "fsdp", "tensor")
    assert sh["embed"].spec == P("tensor", "fsdp")


# ---- bad input: one clear error naming the axis and the sizes ----

def test_strict_mode_names_param_axis_and_sizes():
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"layers/k: dim 2 \(logical axis 'kv_heads', size 3\) is not divisible by "
                                         r"mesh axis tensor \(size 2\)"):
        M.param_shardings(SMOLLM2, mesh, M.rules_for("train", M.MeshConfig(data=2, fsdp=2, tensor=2)))
    with pytest.raises(ValueError, match=r"tokens_BxT: dim 0 \(logical axis 'batch', size 6\) .*data x fsdp "
                                         r"\(size 4\)"):
        M.make_sharded_forward(CFG, mesh, M.TRAIN_RULES, (6, L))


def test_mesh_shape_errors():
    with pytest.raises(ValueError, match=r"mesh \(data=3, fsdp=1, tensor=1\) has 3 devices but 8 devices"):
        M.make_mesh(M.MeshConfig(data=3))
    with pytest.raises(ValueError, match=r"8 devices are not divisible by the fixed axes \(fsdp=3, tensor=1\)"):
        M.make_mesh(M.MeshConfig(data=-1, fsdp=3))
    with pytest.raises(ConfigError, match=r"MeshConfig.*tensor: must be a positive size or -1"):
        build(M.MeshConfig, {"tensor": 0})
    with pytest.raises(ConfigError, match=r"MeshConfig.*at most one axis may be -1"):
        build(M.MeshConfig, {"data": -1, "fsdp": -1})
    with pytest.raises(ConfigError, match=r"MeshConfig.model: unknown key"):
        build(M.MeshConfig, {"model": 2})


def test_rule_errors_name_the_axis():
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    bad = M.AxisRules.from_dict("custom", {**dict(M.TRAIN_RULES.rules), "heads": ["model"]})
    with pytest.raises(ValueError, match=r"logical axis 'heads' maps to mesh axis 'model', which is not in the "
                                         r"mesh \(data=2, fsdp=2, tensor=2\)"):
        M.param_shardings(CFG, mesh, bad)
    # (an axis no rule names; `experts` has had one since the MoE family)
    with pytest.raises(ValueError, match=r"w: logical axis 'patches' has no rule in train rules"):
        M.logical_to_sharding({"w": ("patches", "embed")}, mesh, M.TRAIN_RULES, {"w": (4, 64)})
