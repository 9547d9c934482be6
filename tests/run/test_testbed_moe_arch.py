"""A mixture-of-experts testbed model (`student.arch.num_experts` ...): checked in one line at load, built as a
Qwen3-MoE ModelConfig with every layer sparse, and keyed apart from the dense model in the SFT cache."""

import jax
import pytest

from jopd.config_dataclass import ConfigError
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import transformer
from jopd.run.config import load_config
from jopd.run import model_sources
from jopd.run.warm_start import sft_key

TOK = build_toy_tokenizer()
MOE = ["student.arch.family=qwen3_moe", "student.arch.num_experts=8", "student.arch.num_experts_per_tok=2",
       "student.arch.moe_intermediate_size=96"]


@pytest.mark.parametrize("over, message", [
    (["student.arch.num_experts=8"], r"^RunConfig.student.arch: num_experts=8: family 'llama' has no experts"),
    (MOE[:2] + ["student.arch.num_experts_per_tok=9", MOE[3]], r"num_experts_per_tok=9: must be in \[1, num_experts=8\]"),
    (MOE[:3], r"moe_intermediate_size: must be >= 1"),
    (["student.arch.num_experts_per_tok=2"], r"set num_experts > 0"),
])
def test_bad_moe_arch_is_one_line(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/testbed.yaml", over)


def test_moe_arch_builds_a_sparse_student_and_its_own_cache_key():
    dense, moe = (load_config("configs/testbed.yaml", over) for over in ([], MOE))
    cfg = model_sources.testbed_model_config(moe.student, TOK)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 2, 96)
    assert cfg.norm_topk_prob and cfg.sparse_layers == tuple(range(moe.student.arch.num_layers))
    shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
    assert shapes["layers"]["expert_gate"].shape == (2, 8, 64, 96)
    assert model_sources.testbed_model_config(dense.student, TOK).num_experts == 0
    keys = {sft_key("student", c.student, c.data, TOK) for c in (dense, moe, load_config(
        "configs/testbed_moe.yaml", ["student.arch.num_experts=4"]))}
    assert len(keys) == 3
    assert load_config("configs/testbed_moe.yaml", []).student.arch == moe.student.arch  # the shipped MoE config
