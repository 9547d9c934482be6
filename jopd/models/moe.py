"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): a softmax router picks each token's top-k experts and
their SwiGLU outputs are summed with the gate weights. Dropless: every token reaches all of its k experts.

Dispatch: the N*k (token, expert) pairs are sorted by expert, and each expert's weights multiply only its own
contiguous rows (`jax.lax.ragged_dot`, a grouped matmul over group sizes), so a layer costs its chosen experts'
FLOPs where the backend lowers the ragged dot natively (TPU, GPU). XLA:CPU lowers it densely (every expert over
all N*k rows, masked): exact, but E times those FLOPs.

Expert parallelism (`mesh.expert` > 1: the `expert` mesh axis splits the experts and the batch): each device holds
E / expert experts. `expert_parallel_swiglu` runs the dispatch per device in a `jax.shard_map`: a device gathers the
routed tokens of its expert group (all-gather over `expert`), runs its own experts on the (token, expert) pairs that
chose them (the same sort + `ragged_dot`, the other pairs left out), and a reduce-scatter over `expert` sums each
token's contributions and hands every device back its own rows. Exact and dropless (every pair is computed once, by
the device holding its expert); only the order of the k-sum changes (fp rounding). Without the axis (or of size 1):
`routed_swiglu` as it always ran.

Routing replay (`sparse_mlp`'s `replay_BxTxk`, `train.routing_replay`): the trainer runs the experts another engine
chose, each weighted by its own router's probability at them (`gate_weights`), so the update differentiates the
rollout's expert choice and the router still gets its gradient.

Leaves of a sparse layer (E experts of width I): router_DxE, expert_gate_ExDxI, expert_up_ExDxI, expert_down_ExIxD.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
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


# `jopd aot`'s cost programs (`sizing.moe_cost`): XLA's cost analysis counts a ragged_dot over every row of its
# operand, including the rows past the groups' sizes (an expert-parallel device's other devices' pairs), so the
# cost programs run the grouped matmuls as an identity and the sizing adds the experts' work analytically.
_STAND_IN = contextvars.ContextVar("moe_grouped_matmuls_stand_in", default=False)


@contextlib.contextmanager
def grouped_matmuls_stand_in():
    """Within it, the experts' grouped matmuls are an identity on the dispatched rows (zero FLOPs): for cost
    programs only; the routing, the dispatch's gathers and collectives stay."""
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def _experts_swiglu(x_MxD, gate_ExDxI, up_ExDxI, down_ExIxD, group_sizes_E, dtype):
    """Each row through its group's expert SwiGLU (rows past the groups' sizes: left out by `ragged_dot`)."""
    if _STAND_IN.get():
        return x_MxD
    prec = matmul_precision(dtype)

    def grouped(x, w):
        return jax.lax.ragged_dot(x, w.astype(dtype), group_sizes_E, precision=prec)

    return grouped(jax.nn.silu(grouped(x_MxD, gate_ExDxI)) * grouped(x_MxD, up_ExDxI), down_ExIxD)


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
    y_MxD = _experts_swiglu(x_MxD, gate_ExDxI, up_ExDxI, down_ExIxD, group_sizes_E, dtype)
    back_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(N * k, dtype=order_M.dtype))  # inverse permutation
    y_NxkxD = y_MxD[back_M].reshape(N, k, -1)
    return jnp.einsum("nk,nkd->nd", weights_Nxk.astype(dtype), y_NxkxD, precision=prec)


EXPERT_AXIS = "expert"  # the mesh axis that splits the experts (`jopd.parallel.mesh`; models sit below parallel)
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes that split the batch (`transformer.BATCH_MESH_AXES`)


def expert_group_size() -> int:
    """The context mesh's `expert` axis size (1 without a mesh, without the axis, or inside a manual one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or EXPERT_AXIS in mesh.manual_axes:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[EXPERT_AXIS]


def _local_experts_swiglu(h_bxTxD, ids_bxTxk, weights_bxTxk, gate_exDxI, up_exDxI, down_exIxD, *, dtype,
                          gathered: bool) -> jax.Array:
    """One device's block: its experts' share of every routed token of the group (the other pairs contribute 0);
    `gathered`: the rows are split over `expert` (gather them, reduce-scatter the result), else whole on each."""
    if gathered:
        h_bxTxD, ids_bxTxk, weights_bxTxk = (jax.lax.all_gather(x, EXPERT_AXIS, axis=0, tiled=True)
                                             for x in (h_bxTxD, ids_bxTxk, weights_bxTxk))
    b, T, D = h_bxTxD.shape
    k = ids_bxTxk.shape[-1]
    e = gate_exDxI.shape[0]
    local_Nxk = ids_bxTxk.reshape(b * T, k) - jax.lax.axis_index(EXPERT_AXIS) * e
    mine_Nxk = (local_Nxk >= 0) & (local_Nxk < e)
    # The other devices' pairs go to a last group past this device's e experts: `ragged_dot` leaves rows past the
    # groups' sizes out (and the `where` below drops whatever they hold).
    ids_Nxk = jnp.where(mine_Nxk, local_Nxk, e)
    flat_M = ids_Nxk.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    group_sizes_e = jnp.bincount(flat_M, length=e).astype(jnp.int32)
    x_MxD = h_bxTxD.reshape(b * T, D).astype(dtype)[order_M // k]
    prec = matmul_precision(dtype)
    y_MxD = _experts_swiglu(x_MxD, gate_exDxI, up_exDxI, down_exIxD, group_sizes_e, dtype)
    back_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(order_M.shape[0], dtype=order_M.dtype))
    y_NxkxD = jnp.where(mine_Nxk[..., None], y_MxD[back_M].reshape(b * T, k, D), 0)
    weights_Nxk = weights_bxTxk.reshape(b * T, k).astype(dtype)
    y_bxTxD = jnp.einsum("nk,nkd->nd", weights_Nxk, y_NxkxD, precision=prec).reshape(b, T, D)
    if gathered:
        return jax.lax.psum_scatter(y_bxTxD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y_bxTxD, EXPERT_AXIS)


def expert_parallel_swiglu(h_BxTxD: Float[Array, "B T D"], ids_BxTxk: Int[Array, "B T k"],
                           weights_BxTxk: Float[Array, "B T k"], gate_ExDxI: Float[Array, "E D I"],
                           up_ExDxI: Float[Array, "E D I"], down_ExIxD: Float[Array, "E I D"], *, dtype
                           ) -> Float[Array, "B T D"]:
    """`routed_swiglu` with the experts split over the context mesh's `expert` axis (see the module docstring): per
    device in a `jax.shard_map` over every free mesh axis. The rows go over the batch axes that divide B, in order
    (as `transformer.constrain_batch` puts them); each device holds E / expert whole experts inside (their other
    dims, split over fsdp / tensor by the rules, are gathered on entry, as FSDP gathers a layer's weights)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    E = gate_ExDxI.shape[0]
    if E % sizes[EXPERT_AXIS]:
        raise ValueError(f"mesh.expert={sizes[EXPERT_AXIS]}: does not divide the model's num_experts={E}")
    free = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    batch, n = [], 1
    for a in BATCH_AXES:
        if a in free and h_BxTxD.shape[0] % (n * sizes[a]) == 0:
            batch.append(a)
            n *= sizes[a]
    rows = P(tuple(batch) or None)
    experts = P(EXPERT_AXIS)
    fn = functools.partial(_local_experts_swiglu, dtype=dtype, gathered=EXPERT_AXIS in batch)
    return jax.shard_map(fn, in_specs=(rows, rows, rows, experts, experts, experts), out_specs=rows,
                         axis_names=free)(h_BxTxD, ids_BxTxk, weights_BxTxk, gate_ExDxI, up_ExDxI, down_ExIxD)


def _rows_spec(h_BxTxD, mesh, free) -> tuple[P, list[str]]:
    """The batch axes (in `BATCH_AXES` order, free in the context mesh) that split the rows evenly."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    batch, n = [], 1
    for a in BATCH_AXES:
        if a in free and sizes[a] > 1 and h_BxTxD.shape[0] % (n * sizes[a]) == 0:
            batch.append(a)
            n *= sizes[a]
    return P(tuple(batch) or None), batch


def _local_routed_swiglu(h_bxTxD, ids_bxTxk, weights_bxTxk, gate_ExDxI, up_ExDxI, down_ExIxD, *, dtype):
    b, T, D = h_bxTxD.shape
    k = ids_bxTxk.shape[-1]
    y = routed_swiglu(h_bxTxD.reshape(b * T, D), ids_bxTxk.reshape(b * T, k), weights_bxTxk.reshape(b * T, k),
                      gate_ExDxI, up_ExDxI, down_ExIxD, dtype=dtype)
    return y.reshape(b, T, D)


def data_parallel_swiglu(h_BxTxD: Float[Array, "B T D"], ids_BxTxk: Int[Array, "B T k"],
                         weights_BxTxk: Float[Array, "B T k"], gate_ExDxI: Float[Array, "E D I"],
                         up_ExDxI: Float[Array, "E D I"], down_ExIxD: Float[Array, "E I D"], *, dtype
                         ) -> Float[Array, "B T D"]:
    """`routed_swiglu` on each device's own rows, in a `jax.shard_map` over the context mesh's free axes, every
    expert whole on every device (gathered on entry, as FSDP gathers a layer's weights). Without it XLA's
    partitioner all-gathers every device's expert ids for the dispatch's sort and all-reduces the whole batch's
    gathered tokens, so each device ran every token's experts (seen in the compiled programs for CPU and TPU)."""
    mesh = jax.sharding.get_abstract_mesh()
    free = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    rows, _ = _rows_spec(h_BxTxD, mesh, free)
    fn = functools.partial(_local_routed_swiglu, dtype=dtype)
    return jax.shard_map(fn, in_specs=(rows, rows, rows, P(), P(), P()), out_specs=rows,
                         axis_names=free)(h_BxTxD, ids_BxTxk, weights_BxTxk, gate_ExDxI, up_ExDxI, down_ExIxD)


def _splits_rows(h_BxTxD) -> bool:
    """The context mesh has a free batch axis that splits these rows (a data-parallel layer's dispatch)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    free = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    return bool(_rows_spec(h_BxTxD, mesh, free)[1])


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
    experts = (lp["expert_gate"], lp["expert_up"], lp["expert_down"])
    if expert_group_size() > 1:
        y = expert_parallel_swiglu(h_BxTxD, ids.reshape(B, T, k), weights.reshape(B, T, k), *experts, dtype=dtype)
    elif _splits_rows(h_BxTxD):
        y = data_parallel_swiglu(h_BxTxD, ids.reshape(B, T, k), weights.reshape(B, T, k), *experts, dtype=dtype)
    else:
        y = routed_swiglu(h_NxD, ids, weights, *experts, dtype=dtype).reshape(B, T, D)
    return y, own.reshape(B, T, -1)


def load_balancing_loss(probs_NxE: Float[Array, "N E"], ids_Nxk: Int[Array, "N k"], mask_N: Bool[Array, "N"]
                        ) -> Float[Array, ""]:
    """The router's load-balancing loss over the tokens in `mask_N` (Switch / Qwen3-MoE form, one layer):
    E * sum_e f_e * P_e, f_e the fraction of those tokens with e among their k experts (so sum_e f_e = k), P_e their
    mean router probability of e. Its gradient reaches the router through P only (f counts). A balanced router
    scores k, one taking every token to the same k experts E."""
    E = probs_NxE.shape[-1]
    m_N = mask_N.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m_N), 1.0)
    chosen_NxE = jnp.sum(jax.nn.one_hot(ids_Nxk, E, dtype=jnp.float32), axis=1)
    f_E = jnp.einsum("n,ne->e", m_N, chosen_NxE) / n
    P_E = jnp.einsum("n,ne->e", m_N, probs_NxE.astype(jnp.float32)) / n
    return E * jnp.sum(f_E * P_E)


def router_balance(cfg: ModelConfig, lp: dict[str, Any], h_BxTxD: Float[Array, "B T D"], dtype,
                   mask_BxT: Bool[Array, "B T"]) -> Float[Array, ""]:
    """A sparse layer's `load_balancing_loss` over its router's own choice (its top-k, replayed or not) on the
    tokens in `mask_BxT` (the same router matmul and softmax as `sparse_mlp`'s, merged with it by XLA)."""
    B, T, D = h_BxTxD.shape
    probs_NxE = router_probs(h_BxTxD.reshape(B * T, D), lp["router"], dtype=dtype)
    ids_Nxk = jax.lax.top_k(probs_NxE, cfg.num_experts_per_tok)[1]
    return load_balancing_loss(probs_NxE, ids_Nxk, mask_BxT.reshape(B * T))


def expert_set_flips(own_LsxBxTxk: Int[Array, "Ls B T k"], recorded_LsxBxTxk: Int[Array, "Ls B T k"]
                     ) -> tuple[Int[Array, "B T"], Bool[Array, "B T"]]:
    """Routing mismatch per token: (in how many sparse layers its expert *set* differs between `own` and
    `recorded` (the order within the k does not count), whether `recorded` holds the token at all: >= 0, -1 where
    the recording engine routed nothing). Zero where nothing was recorded."""
    recorded_BxT = recorded_LsxBxTxk[0, ..., 0] >= 0
    differ_LsxBxT = jnp.any(jnp.sort(own_LsxBxTxk, axis=-1) != jnp.sort(recorded_LsxBxTxk.astype(own_LsxBxTxk.dtype),
                                                                         axis=-1), axis=-1)
    return jnp.where(recorded_BxT, jnp.sum(differ_LsxBxT, axis=0), 0).astype(jnp.int32), recorded_BxT
