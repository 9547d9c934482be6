"""A mixture-of-experts layer on a data-parallel mesh (no `expert` axis, `moe.data_parallel_swiglu`): each device
dispatches only its own tokens. The forward and the gradient on 8 CPU devices equal one device's, and the compiled
program gathers no other device's expert ids for the dispatch's sort and all-reduces no batch-wide token buffer
(what XLA's partitioner did before: every device ran every token's experts)."""

import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd import parallel as meshlib
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=12, mlp_only_layers=(1,))
B, S = 16, 8  # 128 tokens, 16 per device


def _loss(params, tokens):
    logits = T.forward(params, tokens, cfg=CFG)[0]
    return jax.numpy.mean(jax.nn.log_softmax(logits)[..., 3] ** 2)


def test_each_device_dispatches_its_own_tokens_and_the_results_equal_one_device():
    params = numpy_params(CFG, seed=2, std=0.5)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, S)).astype(np.int32)
    ref_loss, ref_grad = jax.jit(jax.value_and_grad(_loss))(params, tokens)
    mc = meshlib.MeshConfig(data=2, fsdp=4)
    mesh = meshlib.make_mesh(mc)
    sharded = jax.device_put(params, meshlib.param_shardings(CFG, mesh, meshlib.rules_for("train", mc)))
    rows = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        fn = jax.jit(jax.value_and_grad(_loss))
        loss, grad = fn(sharded, rows)
        text = fn.lower(sharded, rows).compile().as_text()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(grad)), jax.tree.leaves(ref_grad)):  # relative to the leaf's max
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(b)).max()
    k = CFG.num_experts_per_tok
    # the dispatch sorts B*S*k/8 = 32 local pairs per device, never the batch's 256
    sorts = [int(m) for m in re.findall(r"= \(s32\[(\d+)\]\{0\}, s32\[\d+\]\{0\}\) sort\(", text)]
    assert sorts and max(sorts) == B * S * k // 8, sorts
    assert not re.search(rf"= s32\[{B * S * k}\]\S* all-gather\(", text)
    assert not re.search(rf"= f32\[{B * S * k},{CFG.hidden_size}\]\S* all-reduce\(", text)
