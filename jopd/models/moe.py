"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): a softmax router picks each token's top-k experts and
their SwiGLU outputs are summed with the gate weights. Dropless: every token reaches all of its k experts.

Dispatch: the N*k (token, expert) pairs are sorted by expert, and each expert's weights multiply only its own
contiguous rows (`jax.lax.ragged_dot`, a grouped matmul over group sizes), so a layer costs its chosen experts'
FLOPs where the backend lowers the ragged dot natively (TPU, GPU). XLA:CPU lowers it densely (every expert over
all N*k rows, masked): exact, but E times those FLOPs.

Routing replay (`sparse_mlp`'s `replay_BxTxk`, `train.routing_replay`): the trainer runs the experts another engine
chose, each weighted by its own router's probability at them (`gate_weights`), so the update differentiates the
rollout's expert choice and the router still gets its gradient.

Leaves of a sparse layer (E experts of width I): router_DxE, expert_gate_ExDxI, expert_up_ExDxI, expert_down_ExIxD.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.config import ModelConfig
from jopd.models.dtypes import matmul_precision

SPARSE_LEAVES = ("router", "expert_gate", "expert_up", "expert_down")  # what marks a layer's params as sparse


def router_probs(h_NxD: Float[Array, "N D"], router_DxE: Float[Array, "D E"], *, dtype) -> Float[Array, "N E"]:
    """The router's softmax over the experts (fp32). Its logits come from a matmul in the compute dtype like every
    other weight's (as in transformers); the softmax runs in fp32."""
    logits_NxE = jnp.einsum("nd,de->ne", h_NxD.astype(dtype), router_DxE.astype(dtype),
                            precision=matmul_precision(dtype))
    return jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)


def route(h_NxD: Float[Array, "N D"], router_DxE: Float[Array, "D E"], *, k: int, norm_topk_prob: bool,
          dtype) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
    """Each token's k experts (descending probability) and their gate weights (fp32): the top-k of
    `router_probs`, renormalized to sum to 1 with `norm_topk_prob` (in fp32)."""
    weights_Nxk, ids_Nxk = jax.lax.top_k(router_probs(h_NxD, router_DxE, dtype=dtype), k)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, axis=-1, keepdims=True)
    return weights_Nxk, ids_Nxk.astype(jnp.int32)


def gate_weights(probs_NxE: Float[Array, "N E"], ids_Nxk: Int[Array, "N k"], *, norm_topk_prob: bool
                 ) -> Float[Array, "N k"]:
    """The gate weights of given experts: the router's probabilities at `ids` (gathered from its full softmax, so
    an expert outside its own top-k still gets its weight and a gradient to the router), renormalized as `route`
    does. At the router's own top-k ids these are `route`'s weights bit for bit."""
    weights_Nxk = jnp.take_along_axis(probs_NxE, ids_Nxk, axis=-1)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, axis=-1, keepdims=True)
    return weights_Nxk


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


def sparse_mlp(cfg: ModelConfig, lp: dict[str, Any], h_BxTxD: Float[Array, "B T D"], dtype,
               replay_BxTxk: Int[Array, "B T k"] | None = None) -> tuple[Float[Array, "B T D"], Int[Array, "B T k"]]:
    """A sparse layer's MLP on the normed hidden states: (its output, each token's expert ids chosen by its router).

    `replay_BxTxk` (routing replay): each token's experts are these instead of the router's top-k where they are
    >= 0 (-1: the router's own choice), with `gate_weights` from the router's own probabilities; the ids returned
    are still the router's own top-k (what it would have picked)."""
    B, T, D = h_BxTxD.shape
    h_NxD = h_BxTxD.reshape(B * T, D)
    k = cfg.num_experts_per_tok
    if replay_BxTxk is None:
        weights, ids = route(h_NxD, lp["router"], k=k, norm_topk_prob=cfg.norm_topk_prob, dtype=dtype)
        own = ids
    else:
        probs_NxE = router_probs(h_NxD, lp["router"], dtype=dtype)
        own = jax.lax.top_k(probs_NxE, k)[1].astype(jnp.int32)
        replay_Nxk = replay_BxTxk.reshape(B * T, k).astype(jnp.int32)
        ids = jnp.where(replay_Nxk >= 0, replay_Nxk, own)
        weights = gate_weights(probs_NxE, ids, norm_topk_prob=cfg.norm_topk_prob)
    y = routed_swiglu(h_NxD, ids, weights, lp["expert_gate"], lp["expert_up"], lp["expert_down"], dtype=dtype)
    return y.reshape(B, T, D), own.reshape(B, T, -1)


def expert_set_flips(own_LsxBxTxk: Int[Array, "Ls B T k"], recorded_LsxBxTxk: Int[Array, "Ls B T k"]
                     ) -> tuple[Int[Array, "B T"], Bool[Array, "B T"]]:
    """Routing mismatch per token: (in how many sparse layers its expert *set* differs between `own` and
    `recorded` (the order within the k does not count), whether `recorded` holds the token at all: >= 0, -1 where
    the recording engine routed nothing). Zero where nothing was recorded."""
    recorded_BxT = recorded_LsxBxTxk[0, ..., 0] >= 0
    differ_LsxBxT = jnp.any(jnp.sort(own_LsxBxTxk, axis=-1) != jnp.sort(recorded_LsxBxTxk.astype(own_LsxBxTxk.dtype),
                                                                         axis=-1), axis=-1)
    return jnp.where(recorded_BxT, jnp.sum(differ_LsxBxT, axis=0), 0).astype(jnp.int32), recorded_BxT
