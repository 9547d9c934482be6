"""The attention on paper (`jopd.sizing.attention_cost`): its block count is the tiles the blockwise entries
compute, its FLOPs at one block are what XLA counts for the dense einsums, and only the entries XLA cannot see
get a cost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models.attention import ATTENTION
from jopd.models.config import ModelConfig
from jopd.sizing import attention_cost

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, attention="chunked")


@pytest.mark.parametrize("T,block", [(64, 64), (130, 64), (512, 128), (1000, 256)])
def test_the_causal_pairs_are_the_tiles_at_or_below_the_diagonal(T, block):
    pos = np.arange(T)
    tiles = 0
    for qb in range(0, T, block):
        for kb in range(0, T, block):
            q, k = pos[qb:qb + block], pos[kb:kb + block]
            # a tile the chunked entry computes: some query sees some key (the others are skipped by lax.cond)
            tiles += bool((k[None, :] <= q[:, None]).any())
    b = min(block, T)
    assert attention_cost._causal_pairs(T, block) == tiles * b * b


def test_one_block_of_flops_is_what_xla_counts_for_the_dense_einsums():
    B, T = 2, 128
    q = jax.ShapeDtypeStruct((B, T, CFG.num_heads, CFG.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, CFG.num_kv_heads, T, CFG.head_dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    fn = jax.jit(lambda q, k, v, m: ATTENTION["xla"].causal(q, k, v, mask_BxT=m, dtype=jnp.float32))
    ca = fn.lower(q, kv, kv, mask).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    one_layer = dict(CFG.__dict__, num_layers=1)
    flops, _ = attention_cost.causal_forward(ModelConfig(**one_layer), B, T, 4, block=T)
    # XLA adds the softmax's elementwise work (a few FLOPs per score) to the two matmuls' 4 x T^2 x Dh per head
    assert flops <= ca["flops"] <= flops * (1 + 8 / CFG.head_dim)


def test_only_entries_xla_cannot_see_get_a_cost_and_train_counts_the_backward():
    xla_cfg = ModelConfig(**dict(CFG.__dict__, attention="xla"))
    assert attention_cost.causal_cost(xla_cfg, 2, 4096, 4, "cpu").flops == 0.0
    auto_cfg = ModelConfig(**dict(CFG.__dict__, attention="auto"))
    assert attention_cost.causal_cost(auto_cfg, 2, 128, 4, "cpu").impl == "xla"
    assert attention_cost.causal_cost(auto_cfg, 2, 128, 4, "tpu").impl == "splash"
    fwd = attention_cost.causal_cost(CFG, 2, 4096, 4, "cpu")
    train = attention_cost.causal_cost(CFG, 2, 4096, 4, "cpu", train=True, remat=True)
    assert fwd.impl == "chunked" and train.flops == pytest.approx(fwd.flops * (2 + 3.5))
    # a decode step reads the filled blocks only: half a 16k response past a 1k prompt, in 512-slot blocks
    dec = attention_cost.decode_cost(CFG, 4, 1024, 16384, 2, "cpu")
    assert dec.bytes == 2 * (1024 + 8192) * CFG.head_dim * CFG.num_kv_heads * 4 * CFG.num_layers * 2
