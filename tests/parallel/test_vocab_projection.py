"""The full-vocabulary kinds project the teacher's hidden states with its head split over V on the mesh
(`jopd.parallel.vocab_projection`): same loss and gradient as one device, and no chip holds the whole head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jopd.losses import LossBatch, LossConfig, token_loss
from jopd.models.config import ModelConfig
from jopd.parallel import vocab_projection

ROWS = P(("data", "fsdp"))
HEAD = P("fsdp", "tensor")  # [D, V] as the train rules place an lm_head: embed over fsdp, vocab over tensor


def _mesh():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _loss_and_grads(cfg, mc, student, hidden, batch, t_head):
    f = lambda p, h: token_loss(cfg, p, mc, h, batch, teacher_head=t_head)  # noqa: E731
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(student, hidden)


@pytest.mark.parametrize("kind", ["rkl", "jsd"])
def test_sharded_full_vocabulary_loss_equals_one_device(kind):
    mc = ModelConfig(vocab_size=96, hidden_size=16, tie_word_embeddings=False)
    rng = np.random.default_rng(0)
    B, T, D, V = 8, 6, mc.hidden_size, mc.vocab_size
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    student, t_head = {"lm_head": f32(D, V) * 0.3}, {"lm_head": f32(D, V) * 0.3}
    hidden = f32(B, T, D)
    batch = LossBatch(targets_BxT=jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32),
                      response_mask_BxT=jnp.asarray(rng.random((B, T)) < 0.8), teacher_hidden_BxTxD=f32(B, T, D))
    cfg = LossConfig(kind=kind, chunk_size=4, options={"beta": 0.3} if kind == "jsd" else None)
    (l_ref, _), g_ref = jax.jit(_loss_and_grads, static_argnums=(0, 1))(cfg, mc, student, hidden, batch, t_head)

    mesh = _mesh()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    with jax.set_mesh(mesh):
        assert vocab_projection.vocab_axes(V) == ("tensor", "data", "fsdp")
        (l_sh, _), g_sh = jax.jit(_loss_and_grads, static_argnums=(0, 1))(
            cfg, mc, {"lm_head": put(student["lm_head"], HEAD)}, put(hidden, ROWS),
            jax.tree.map(lambda x: put(x, ROWS), batch), {"lm_head": put(t_head["lm_head"], HEAD)})
    assert float(l_ref) > 1e-3
    np.testing.assert_allclose(l_sh, l_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(g_ref)):
        assert float(jnp.linalg.norm(a - b)) <= 1e-5 * float(jnp.linalg.norm(b))


def test_vocab_axes_fall_back_without_a_mesh_or_an_even_split():
    assert vocab_projection.vocab_axes(96) == ()  # no mesh context: the plain projection
    with jax.set_mesh(_mesh()):
        assert vocab_projection.vocab_axes(100) == ()  # 100 does not split 8 ways


def _temp_bytes_per_device(monkeypatch, split: bool, big: str) -> tuple[int, int]:
    """Compiled temp bytes per device of rkl's loss + gradient on 8 devices, both heads [D, V] in the train rules'
    layout, the `big` side's ("teacher" or "student") 16x wider than the other; `split=False` forces the plain
    projection (no vocabulary split). Returns (temp bytes, the big head's bytes)."""
    if not split:
        monkeypatch.setattr(vocab_projection, "vocab_axes", lambda vocab: ())
    B, T, V = 8, 16, 16384
    D_s, D_t = (1024, 64) if big == "student" else (64, 1024)
    mc = ModelConfig(vocab_size=V, hidden_size=D_s, tie_word_embeddings=False)
    mesh = _mesh()
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))  # noqa
    batch = LossBatch(targets_BxT=jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, ROWS)),
                      response_mask_BxT=jax.ShapeDtypeStruct((B, T), bool, sharding=NamedSharding(mesh, ROWS)),
                      teacher_hidden_BxTxD=sds((B, T, D_t), ROWS))
    cfg = LossConfig(kind="rkl", chunk_size=8)
    with jax.set_mesh(mesh):
        # a new function object per call: jit's trace cache would otherwise reuse the first call's projection
        fn = jax.jit(lambda *a: _loss_and_grads(cfg, mc, *a))
        compiled = fn.lower({"lm_head": sds((D_s, V), HEAD)}, sds((B, T, D_s), ROWS), batch,
                            {"lm_head": sds((D_t, V), HEAD)}).compile()
    return compiled.memory_analysis().temp_size_in_bytes, max(D_s, D_t) * V * 4


@pytest.mark.parametrize("big", ["teacher", "student"])
def test_no_device_holds_a_whole_head(monkeypatch, big):
    """Per device, the plain projection holds the big head gathered whole (64 MiB here; on the Qwen3 v5e-16
    config, the 8B teacher's head is 2.3 GiB and the 1.7B student's 1.2 GiB, held with its whole gradient); the
    vocabulary-split one stays under half of it. The student's head gets a gradient, the teacher's does not."""
    split, head_bytes = _temp_bytes_per_device(monkeypatch, split=True, big=big)
    plain, _ = _temp_bytes_per_device(monkeypatch, split=False, big=big)
    assert plain >= head_bytes, (plain, head_bytes)  # the failure this guards against is real on this mesh
    assert split < head_bytes / 2, (split, head_bytes)
