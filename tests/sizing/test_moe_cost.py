"""A mixture-of-experts layer on paper (`sizing.moe_cost`): the roofline counts the experts a token runs (k of E)
by hand, not XLA's count of `ragged_dot` (every row of its operand, on CPU every expert's product), and the
stage's FLOPs then match its model FLOPs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import moe
from jopd.models.config import ModelConfig
from jopd.run.config import load_config
from jopd.sizing import aot, arch
from jopd.sizing.moe_cost import expert_cost
from tests.helpers.tiny_params import numpy_params

MOE = ["family=qwen3_moe", "num_experts=8", "num_experts_per_tok=2", "moe_intermediate_size=128", "hidden_size=32",
       "intermediate_size=64", "num_heads=2", "num_kv_heads=1", "head_dim=16", "num_layers=2"]
# a MoE teacher (2 sparse layers, 8 experts, top 2) beside the dense testbed student; experts over 2 devices
TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "mesh.data=4", "mesh.expert=2"] + [f"teacher.arch.{a}" for a in MOE]


def test_expert_cost_by_hand():
    cfg = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=12, mlp_only_layers=(1,))
    c = expert_cost(cfg, 100, num_devices=4, expert_group=2, weight_bytes=2, act_bytes=2)
    assert c.flops == 2 * 3 * 2 * (100 * 2 / 4) * 16 * 12  # 2 sparse layers, 3 matmuls, 50 pairs per device
    # 50 tokens reach each expert shard (its group's); it holds 4 experts, each missed with (1 - 2/8)^50
    assert c.touched == pytest.approx(4 * (1 - 0.75 ** 50))
    assert c.bytes == pytest.approx(2 * c.touched * 3 * 16 * 12 * 2 + 2 * 50 * (2 * 16 + 3 * 12) * 2)
    one = expert_cost(cfg, 1, num_devices=1, expert_group=1, weight_bytes=2, act_bytes=2)
    assert one.touched == pytest.approx(2)  # one token touches its k experts
    train = expert_cost(cfg, 100, num_devices=4, expert_group=2, weight_bytes=4, act_bytes=2, train=True, remat=True)
    assert train.flops == 4 * c.flops
    dense = dataclasses.replace(cfg, family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                mlp_only_layers=())
    assert expert_cost(dense, 100, num_devices=4, expert_group=1, weight_bytes=2, act_bytes=2).flops == 0


def test_the_stand_in_removes_the_grouped_matmuls_from_xlas_count():
    cfg = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=128)
    lp = jax.tree.map(lambda x: x[0], numpy_params(cfg, 0)["layers"])
    h = jnp.ones((4, 16, 32), jnp.float32)

    def flops():
        fn = jax.jit(lambda p, x: moe.sparse_mlp(cfg, p, x, jnp.float32)[0])
        return fn.lower(lp, h).compile().cost_analysis()["flops"]

    real = flops()
    with moe.grouped_matmuls_stand_in():
        stand_in = flops()
    owed = 2 * 3 * (64 * 2) * 32 * 128  # 64 tokens x k pairs through 3 matmuls
    assert real - stand_in >= owed  # XLA:CPU's dense lowering counts every expert: E / k = 4x what is owed
    assert stand_in < 0.1 * owed


@pytest.fixture(scope="module")
def costed():
    cfg = load_config(None, TINY)
    return cfg, aot.compile_opd_step(cfg, progress=False, cost=True, chip="v5e")


@pytest.mark.slow
def test_the_roofline_counts_a_moe_teachers_active_experts(costed):
    cfg, report = costed
    scoring = next(s for s in report.roofline.stages if s.name == "teacher_scoring")
    assert [(p.name, p.count) for p in scoring.parts] == [("forward", 1), ("experts[teacher]", 1)]
    teacher = arch.model_config_of(cfg.teacher, "teacher")
    rows_x_tokens = 8 * (16 + 8)
    by_hand = 2 * 3 * 2 * (rows_x_tokens * 2 / 8) * 32 * 128  # 2 sparse layers, k = 2, 8 devices
    assert scoring.parts[1].cost.flops == by_hand == expert_cost(
        teacher, rows_x_tokens, num_devices=8, expert_group=2, weight_bytes=4, act_bytes=4).flops
    # the stage's count (XLA's for the rest, by hand for the experts) against its model FLOPs (active parameters)
    model = report.roofline.model_flops["teacher_scoring"] / 8
    assert model <= scoring.total("flops") <= 1.15 * model
    assert not any(p.name.startswith("experts") for s in report.roofline.stages if s.name != "teacher_scoring"
                   for p in s.parts)  # the dense student's stages have none
    assert np.isfinite(report.roofline.step_s) and 0 < report.roofline.mfu < 1
