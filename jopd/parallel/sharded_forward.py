"""A sharded forward: `transformer.forward` jitted with explicit in/out shardings from the rules (the pattern the
step follows; the mesh tests and `benchmarks/mesh_memory.py` measure it directly)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.parallel.rules import AxisRules, activation_sharding, batch_sharding, param_shardings


def make_sharded_forward(cfg: ModelConfig, mesh: Mesh, rules: AxisRules, batch_shape: tuple[int, int], *,
                         dtype=jnp.float32, logits_dtype=jnp.float32) -> Callable:
    """`fn(params, tokens_BxT, attn_mask_BxT) -> logits_BxTxV`: `transformer.forward` jitted once with explicit
    in/out shardings (params per `rules`, batch over data x fsdp, logits' vocab over tensor).

    The same pattern serves a train step: `jax.jit(step, in_shardings=(param_shardings(..), batch_sharding(..)),
    out_shardings=..., donate_argnums=...)` (as `opd.step.build_step` does).
    """
    B, T = batch_shape
    p_sh = param_shardings(cfg, mesh, rules)
    tok_sh = batch_sharding(mesh, rules, (B, T), where="tokens_BxT")
    logits_sh = activation_sharding(("batch", "length", "act_vocab"), mesh, rules, (B, T, cfg.vocab_size),
                                    where="logits_BxTxV")

    def fwd(params, tokens_BxT, attn_mask_BxT):
        logits_BxTxV, _ = transformer.forward(params, tokens_BxT, cfg=cfg, attn_mask_BxT=attn_mask_BxT,
                                              dtype=dtype, logits_dtype=logits_dtype)
        return logits_BxTxV

    return jax.jit(fwd, in_shardings=(p_sh, tok_sh, tok_sh), out_shardings=logits_sh)