"""The roofline's model FLOPs of a mixture-of-experts model count the experts a token runs (top-k of E), not all
of them: `cost.active_layer_and_head_params` against a count by hand from the config's dimensions."""

import pytest

from jopd.models.config import ModelConfig
from jopd.sizing.cost import active_layer_and_head_params

H, V, I, IM, E, K, HD = 16, 37, 32, 12, 8, 2, 8


def _by_hand(num_layers: int, sparse: list[int]) -> int:
    attn = H * 2 * HD + 2 * H * 1 * HD + 2 * HD * H + 2 * HD  # q, k, v, o (2 heads, 1 kv head) + q/k norms
    norms = 2 * H
    dense_mlp = 3 * H * I
    active_moe = K * 3 * H * IM + H * E  # k experts' gate/up/down + the whole router
    return sum(attn + norms + (active_moe if i in sparse else dense_mlp) for i in range(num_layers))


@pytest.mark.parametrize("mlp_only", [(), (1,)])
def test_a_moe_layer_counts_k_of_its_e_experts(mlp_only):
    cfg = ModelConfig(family="qwen3_moe", vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=HD, qk_norm=True, num_experts=E, num_experts_per_tok=K,
                      moe_intermediate_size=IM, mlp_only_layers=mlp_only)
    layers, head = active_layer_and_head_params(cfg)
    assert layers == _by_hand(3, [i for i in range(3) if i not in mlp_only])
    assert head == H * V


def test_a_dense_model_counts_every_weight():
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=HD, qk_norm=True)
    assert active_layer_and_head_params(cfg)[0] == _by_hand(3, [])
