"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): a softmax router picks each token's top-k experts and
their SwiGLU outputs are summed with the gate weights. Dropless: every token reaches all of its k experts.

Dispatch: the N*k (token, expert) pairs are sorted by expert, and each expert's weights multiply only its own
contiguous rows (`jax.lax.ragged_dot`, a grouped matmul over group sizes), so a layer costs its chosen experts'
FLOPs where the backend lowers the ragged dot natively (TPU, GPU). XLA:CPU lowers it densely (every expert over
all N*k rows, masked): exact, but E times those FLOPs.

Leaves of a sparse layer (E experts of width I): router_DxE, expert_gate_ExDxI, expert_up_ExDxI, expert_down_ExIxD.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jopd.models.config import ModelConfig
from jopd.models.dtypes import matmul_precision

SPARSE_LEAVES = ("router", "expert_gate", "expert_up", "expert_down")  # what marks a layer's params as sparse


def route(h_NxD: Float[Array, "N D"], router_DxE: Float[Array, "D E"], *, k: int, norm_topk_prob: bool,
          dtype) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
    """Each token's k experts (descending probability) and their gate weights (fp32). The router's logits come
    from a matmul in the compute dtype like every other weight's (as in transformers); the softmax, the top-k
    and the renormalization run in fp32."""
    logits_NxE = jnp.einsum("nd,de->ne", h_NxD.astype(dtype), router_DxE.astype(dtype),
                            precision=matmul_precision(dtype))
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_Nxk, ids_Nxk = jax.lax.top_k(probs_NxE, k)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, axis=-1, keepdims=True)
    return weights_Nxk, ids_Nxk.astype(jnp.int32)


def routed_swiglu(h_NxD: Float[Array, "N D"], ids_Nxk: Int[Array, "N k"], weights_Nxk: Float[Array, "N k"],
                  gate_ExDxI: Float[Array, "E D I"], up_ExDxI: Float[Array, "E D I"],
                  down_ExIxD: Float[Array, "E I D"], *, dtype) -> Float[Array, "N D"]:
    """sum_j weights[n, j] * SwiGLU_{ids[n, j]}(h[n]), each expert applied only to the rows routed to it."""
    N, k = ids_Nxk.shape
    E = gate_ExDxI.shape[0]
    prec = matmul_precision(dtype)
    flat_M = ids_Nxk.reshape(-1)  # M = N*k assignments, token-major
    order_M = jnp.argsort(flat_M, stable=True)  # grouped by expert, in token order within a group
    group_sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
    x_MxD = h_NxD.astype(dtype)[order_M // k]

    def grouped(x, w):
        return jax.lax.ragged_dot(x, w.astype(dtype), group_sizes_E, precision=prec)

    hidden_MxI = jax.nn.silu(grouped(x_MxD, gate_ExDxI)) * grouped(x_MxD, up_ExDxI)
    y_MxD = grouped(hidden_MxI, down_ExIxD)
    back_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(N * k, dtype=order_M.dtype))  # inverse permutation
    y_NxkxD = y_MxD[back_M].reshape(N, k, -1)
    return jnp.einsum("nk,nkd->nd", weights_Nxk.astype(dtype), y_NxkxD, precision=prec)


def sparse_mlp(cfg: ModelConfig, lp: dict[str, Any], h_BxTxD: Float[Array, "B T D"], dtype
               ) -> tuple[Float[Array, "B T D"], Int[Array, "B T k"]]:
    """A sparse layer's MLP on the normed hidden states: (its output, each token's expert ids)."""
    B, T, D = h_BxTxD.shape
    h_NxD = h_BxTxD.reshape(B * T, D)
    weights, ids = route(h_NxD, lp["router"], k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                         dtype=dtype)
    y = routed_swiglu(h_NxD, ids, weights, lp["expert_gate"], lp["expert_up"], lp["expert_down"], dtype=dtype)
    return y.reshape(B, T, D), ids.reshape(B, T, -1)
