"""Decoder-only transformer (Llama / Qwen2 / Qwen3) as pure functions over a params pytree.

One forward implementation serves the trainer (full sequences), the teacher (scoring) and the sampler
(prefill + KV-cache decode). Layers are stacked on a leading `L` axis and run with `lax.scan`, so compile
time does not grow with depth. With a KV cache the layers run as an unrolled Python loop instead, over
per-layer weights (`unstack_layers`) and per-layer cache buffers: inside a decode `while_loop` nothing is then
sliced, copied or transposed per step (a scan over stacked weights and an [L, ...] cache copies each layer's
weights and cache slice every step, which more than doubled the CPU decode step). `Transformer` (Flax NNX)
is a thin stateful wrapper over the same functions.
Attention is a seam (`jopd.models.attention`): the forward names an implementation and hands it the mask's
structure (padding, segments, cache slots).

Params layout (shape suffixes: V vocab, D hidden, L layers, H heads, K kv heads, Dh head dim, F mlp):
  embed_VxD, final_norm_D, lm_head_DxV (absent when tied), layers/{attn_norm_LxD, q_LxDxHxDh,
  k_LxDxKxDh, v_LxDxKxDh, o_LxHxDhxD, [q_bias_LxHxDh, k_bias_LxKxDh, v_bias_LxKxDh],
  [q_norm_LxDh, k_norm_LxDh], mlp_norm_LxD, gate_LxDxF, up_LxDxF, down_LxFxD}.
A sparse (mixture-of-experts) layer has router_LxDxE, expert_gate_LxExDxI, expert_up_LxExDxI, expert_down_LxExIxD
instead of gate/up/down (`moe.py`; E experts of width I); a model mixing dense and sparse layers keeps `layers` as
a tuple of per-layer dicts (no L axis), run unrolled (`param_shapes`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jopd.models import moe
from jopd.models.attention import attention_impl
from jopd.models.config import ModelConfig
from jopd.models.dtypes import matmul

Params = dict[str, Any]
KVCache = dict[str, tuple[jax.Array, ...]]  # {"k": L x [B,K,S,Dh], "v": L x [B,K,S,Dh]} (head-major: batched dots
# over (B, K) read each buffer in place)


def _layer_shapes(cfg: ModelConfig, sparse: bool, L: int | None) -> dict[str, Any]:
    """One layer's leaves (shape, logical axes); with `L`, stacked on a leading layers axis."""
    D, H, K, Dh, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    lead, lead_axes = ((L,), ("layers",)) if L is not None else ((), ())
    shapes = {
        "attn_norm": ((D,), ("embed",)),
        "q": ((D, H, Dh), ("embed", "heads", "head_dim")),
        "k": ((D, K, Dh), ("embed", "kv_heads", "head_dim")),
        "v": ((D, K, Dh), ("embed", "kv_heads", "head_dim")),
        "o": ((H, Dh, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ((D,), ("embed",)),
    }
    if sparse:  # the routed experts (`moe.sparse_mlp`) in place of the dense SwiGLU
        shapes["router"] = ((D, E), ("embed", "router_experts"))  # whole on every expert shard: it routes all E
        shapes["expert_gate"] = ((E, D, I), ("experts", "embed", "mlp"))
        shapes["expert_up"] = ((E, D, I), ("experts", "embed", "mlp"))
        shapes["expert_down"] = ((E, I, D), ("experts", "mlp", "embed"))
    else:
        shapes["gate"] = ((D, F), ("embed", "mlp"))
        shapes["up"] = ((D, F), ("embed", "mlp"))
        shapes["down"] = ((F, D), ("mlp", "embed"))
    if cfg.qkv_bias:
        shapes["q_bias"] = ((H, Dh), ("heads", "head_dim"))
        shapes["k_bias"] = ((K, Dh), ("kv_heads", "head_dim"))
        shapes["v_bias"] = ((K, Dh), ("kv_heads", "head_dim"))
    if cfg.qk_norm:
        shapes["q_norm"] = ((Dh,), ("head_dim",))
        shapes["k_norm"] = ((Dh,), ("head_dim",))
    return {name: (lead + shape, lead_axes + axes) for name, (shape, axes) in shapes.items()}


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shape and logical axis names of every parameter (the single source of the params layout).

    Layers of one kind (all dense, or all sparse) stack on a leading L axis; a mixed dense/sparse schedule is a
    tuple of per-layer dicts (the unstacked form, run as an unrolled loop): their leaves differ, so no one stack
    holds them, and such schedules are rare (released Qwen3-MoE checkpoints are sparse in every layer)."""
    if cfg.uniform_layers:
        layers: Any = _layer_shapes(cfg, bool(cfg.sparse_layers), cfg.num_layers)
    else:
        layers = tuple(_layer_shapes(cfg, cfg.is_sparse(i), None) for i in range(cfg.num_layers))
    out: dict[str, Any] = {
        "embed": ((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "final_norm": ((cfg.hidden_size,), ("embed",)),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    return out


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def param_logical_axes(cfg: ModelConfig) -> Params:
    """Pytree matching the params whose leaves are tuples of logical axis names (for mesh rules)."""
    return jax.tree.map(lambda s: s[1], param_shapes(cfg), is_leaf=_is_spec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """`jax.ShapeDtypeStruct` pytree of the params (for AOT lowering and checkpoint restore)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dtype), param_shapes(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random init: N(0, 0.02) matrices, zero biases, unit norms (the HF convention).

    Jitted as one program: eager init compiles one RNG kernel per parameter shape (slow on CPU)."""
    return _init_params_jit(cfg, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params_jit(cfg: ModelConfig, key: jax.Array, dtype) -> Params:
    specs = param_shapes(cfg)
    flat, treedef = jax.tree.flatten_with_path(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, (shape, _)), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------
# building blocks


def rms_norm(x: Float[Array, "... D"], w: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    """RMSNorm computed in fp32 and cast back to the input dtype (as the HF reference does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [Dh/2] (float64 host math, like the reference), with llama3 scaling if set."""
    dh = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh))
    rs = cfg.rope_scaling
    if rs is not None:
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(is_medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x_BxTxNxDh: jax.Array, positions_BxT: Int[Array, "B T"], inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (HF layout: first half / second half of the head dim)."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # B,T,Dh/2
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x_BxTxNxDh.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x_BxTxNxDh.dtype)
    half = x_BxTxNxDh.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxNxDh[..., half:], x_BxTxNxDh[..., :half]], -1)
    return x_BxTxNxDh * cos + rotated * sin


BATCH_MESH_AXES = ("data", "fsdp", "expert")  # mesh axes that split the batch (`jopd.parallel.rules`' batch rule)


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pin an activation's leading (batch) dim to the data x fsdp (x expert) mesh axes, other dims left to XLA, when
    traced under a mesh context (`with jax.set_mesh(mesh)`); a no-op without one. Without it GSPMD may resolve the
    conflict between a batch-split activation and an fsdp-split weight by gathering the batch, not the weight."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH_MESH_AXES if a in mesh.axis_names) if not mesh.empty else ()
    if not axes:
        return x
    spec = jax.sharding.PartitionSpec(axes, *([jax.sharding.PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def _layer(cfg: ModelConfig, lp: Params, x_BxTxD, positions_BxT, inv_freq, k_cache, v_cache, write_index,
           attend, dtype, replay_BxTxk=None, aux_mask_BxT=None):
    """One block. With a cache (this layer's [B,K,S,Dh] buffers), the new K/V are written at slot `write_index`
    (a scalar, or one slot per row: [B]) and attention reads the whole buffer. `attend(q, k, v)` is the attention
    seam's call for this forward (`jopd.models.attention`: causal, or against the cache). Returns (x, k_cache,
    v_cache, each token's expert ids [B,T,k] for a sparse layer, else None, its router's load-balancing loss over
    `aux_mask_BxT` when given, else None). `replay_BxTxk`: a sparse layer's replayed expert ids (`moe.sparse_mlp`)."""

    def _write_cache(cache_BxKxSxDh, new_BxKxTxDh):
        new = new_BxKxTxDh.astype(cache_BxKxSxDh.dtype)
        if jnp.ndim(write_index) == 0:
            return jax.lax.dynamic_update_slice(cache_BxKxSxDh, new, (0, 0, write_index, 0))
        B, _, T, _ = new.shape  # per-row slots (the slot engine's rows are at different steps): a scatter
        slots_BxT = write_index[:, None] + jnp.arange(T)[None, :]
        return cache_BxKxSxDh.at[jnp.arange(B)[:, None], :, slots_BxT, :].set(new.transpose(0, 2, 1, 3))

    # every projection: operands in `dtype`, a narrow one accumulated in fp32 (`dtypes.matmul`); activations in `dtype`
    mm = lambda spec, a, name: matmul(spec, a, lp[name], dtype=dtype)  # noqa: E731
    w = lambda name: lp[name].astype(dtype)  # noqa: E731
    h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_norm_eps)
    q = mm("btd,dhe->bthe", h, "q")
    k = mm("btd,dke->btke", h, "k")
    v = mm("btd,dke->btke", h, "v")
    if cfg.qkv_bias:
        q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,K,T,Dh]
    if k_cache is not None:
        k_cache, v_cache = _write_cache(k_cache, k), _write_cache(v_cache, v)
        k_all, v_all = k_cache.astype(dtype), v_cache.astype(dtype)
    else:
        k_all, v_all = k, v
    attn = attend(q, k_all, v_all)
    x = x_BxTxD + mm("bthe,hed->btd", attn, "o")
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    aux = None
    if "router" in lp:  # a sparse layer (`ModelConfig.is_sparse`): the routed experts
        mlp_out, expert_ids = moe.sparse_mlp(cfg, lp, h, dtype, replay_BxTxk)
        if aux_mask_BxT is not None:
            aux = moe.router_balance(cfg, lp, h, dtype, aux_mask_BxT)
    else:
        gate = mm("btd,df->btf", h, "gate")
        up = mm("btd,df->btf", h, "up")
        mlp_out, expert_ids = mm("btf,fd->btd", jax.nn.silu(gate) * up, "down"), None
    return x + mlp_out, k_cache, v_cache, expert_ids, aux


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return {"k": zeros(), "v": zeros()}


def unstack_layers(params: Params) -> Params:
    """The params with `layers` as a tuple of per-layer dicts (the form the cached forward runs on). Under jit
    these are static slices, i.e. one copy of the layer weights: do it once outside a decode loop."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return dict(params, layers=tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)))


def lm_head_DxV(params: Params) -> jax.Array:
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def logits_from_hidden(params: Params, hidden_BxTxD: jax.Array, *, dtype=jnp.float32,
                       logits_dtype=jnp.float32) -> Float[Array, "B T V"]:
    """Final projection; split out so losses can project in chunks over T (no full [B,T,V] kept). In a narrow
    `dtype` the head's matmul accumulates in fp32 and the logits are rounded once, to `logits_dtype`."""
    return matmul("btd,dv->btv", hidden_BxTxD, lm_head_DxV(params), dtype=dtype, out_dtype=logits_dtype)


def logits_at_ids(params: Params, hidden_BxTxD: jax.Array, ids_BxTxK: Int[Array, "B T K"], *, dtype=jnp.float32,
                  logits_dtype=jnp.float32) -> Float[Array, "B T K"]:
    """`logits_from_hidden(...)` at K given token ids per position, from the K gathered head rows: O(K D) per
    position instead of O(V D), forward and backward (the head's gradient is a scatter of K rows)."""
    ids = ids_BxTxK.astype(jnp.int32)
    if "lm_head" in params:
        rows = jnp.take(params["lm_head"].T, ids, axis=0)  # [B,T,K,D]
    else:
        rows = params["embed"][ids]
    return matmul("btd,btkd->btk", hidden_BxTxD, rows, dtype=dtype, out_dtype=logits_dtype)


def positions_from_mask(attn_mask_BxT: jax.Array) -> jax.Array:
    """RoPE positions for left- or right-padded rows: count of real tokens before each position."""
    m = attn_mask_BxT.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def forward(
    params: Params,
    tokens_BxT: Int[Array, "B T"],
    *,
    cfg: ModelConfig,
    attn_mask_BxT: Bool[Array, "B T"] | None = None,
    positions_BxT: Int[Array, "B T"] | None = None,
    cache: KVCache | None = None,
    cache_index: Int[Array, ""] | Int[Array, "B"] | int = 0,
    kv_mask_BxS: Bool[Array, "B S"] | None = None,
    dtype=jnp.float32,
    logits_dtype=jnp.float32,
    return_hidden: bool = False,
    remat: bool = False,
    segment_ids_BxT: Int[Array, "B T"] | None = None,
    attention: str | None = None,
    return_routing: bool = False,
    replay_experts_LsxBxTxk: Int[Array, "Ls B T k"] | None = None,
    router_aux_mask_BxT: Bool[Array, "B T"] | None = None,
) -> tuple[jax.Array, ...]:
    """Returns (logits_BxTxV or final hidden_BxTxD, updated cache or None), and with `return_routing` a third
    element: each token's expert ids in every sparse layer, [Ls, B, T, k] int32 (sparse layers in depth order,
    each token's k ids in descending router probability; None for a model without sparse layers).

    Without a cache, token i attends to tokens j <= i with `attn_mask_BxT[j]` set (padding on either side).
    With a cache of S slots, the T new tokens occupy slots [cache_index, cache_index + T) and attend to
    slots j <= their own where `kv_mask_BxS[j]` is set (the caller marks real tokens, the new ones included);
    `cache_index` may give each row its own first slot ([B]: rows at different decode steps).
    Positions default to `positions_from_mask(attn_mask)` (or 0..T-1 without a mask).
    With a cache, or params whose `layers` are already unstacked (`unstack_layers`), the layers run as an
    unrolled loop; otherwise as a `lax.scan` over the stacked layers.
    `remat` recomputes each layer in the backward pass (`jax.checkpoint` on the layer): the gradient then keeps
    only each layer's input [B,T,D], not its attention scores and MLP activations.
    `segment_ids_BxT` (no cache): packed rows, a token attends only within its own segment (pass the positions
    restarting at each segment, `opd.packing`).
    `attention` names the implementation of the attention seam (`jopd.models.attention.ATTENTION`, or "auto");
    None: the model's own `cfg.attention`. The forward hands it the structure (padding mask, segment ids, or the
    cache's slot index and kv mask), not a dense mask.
    `replay_experts_LsxBxTxk` (routing replay, the layout `return_routing` returns): every sparse layer runs these
    experts where they are >= 0 (-1: its router's own choice), weighted by its router's probabilities at them
    (`moe.sparse_mlp`); the routing returned is still each router's own top-k.
    `router_aux_mask_BxT` (`loss.router_aux_coef`): one more last element, each sparse layer's router
    load-balancing loss over these tokens ([Ls] fp32, `moe.router_balance`; None for a model without sparse layers).
    """
    B, T = tokens_BxT.shape
    if attn_mask_BxT is None:
        attn_mask_BxT = jnp.ones((B, T), bool)
    if positions_BxT is None:
        positions_BxT = positions_from_mask(attn_mask_BxT)
    inv_freq = rope_inv_freq(cfg)
    x = constrain_batch(params["embed"].astype(dtype)[tokens_BxT])
    impl = attention_impl(cfg.attention if attention is None else attention)
    if cache is None:
        def attend(q, k, v):
            return impl.causal(q, k, v, mask_BxT=attn_mask_BxT, segment_ids_BxT=segment_ids_BxT, dtype=dtype)
    else:
        def attend(q, k, v):
            return impl.cached(q, k, v, slot=cache_index, kv_mask_BxS=kv_mask_BxS, dtype=dtype)

    replay = replay_experts_LsxBxTxk
    if replay is not None and replay.shape[0] != len(cfg.sparse_layers):
        raise ValueError(f"forward: replay_experts_LsxBxTxk holds {replay.shape[0]} sparse layers, the model "
                         f"{len(cfg.sparse_layers)}")

    def layer_fn(lp, x, k_l, v_l, replay_l=None):
        x, k_l, v_l, ids, aux = _layer(cfg, lp, x, positions_BxT, inv_freq, k_l, v_l, cache_index, attend, dtype,
                                       replay_l, router_aux_mask_BxT)
        return constrain_batch(x), k_l, v_l, (ids if return_routing else None), aux

    if remat:  # prevent_cse=False is safe (and faster) inside scan (and harmless in the unrolled loop)
        layer_fn = jax.checkpoint(layer_fn, prevent_cse=False)
    if cache is not None or isinstance(params["layers"], (tuple, list)):
        layers = unstack_layers(params)["layers"]
        ks = list(cache["k"]) if cache is not None else [None] * len(layers)
        vs = list(cache["v"]) if cache is not None else [None] * len(layers)
        routed, balance, sparse_i = [], [], 0
        for i, lp in enumerate(layers):
            replay_l = None
            if replay is not None and "router" in lp:  # this sparse layer's replayed ids
                replay_l, sparse_i = replay[sparse_i], sparse_i + 1
            x, ks[i], vs[i], ids, aux = layer_fn(lp, x, ks[i], vs[i], replay_l)
            routed += [] if ids is None else [ids]
            balance += [] if aux is None else [aux]
        experts = jnp.stack(routed) if routed else None
        aux_Ls = jnp.stack(balance) if balance else None
        new_cache = None if cache is None else {"k": tuple(ks), "v": tuple(vs)}
    else:
        def scan_body(x, xs):
            lp, replay_l = xs  # replay: every layer of a stack is sparse, or none is (then it is None)
            x, _, _, ids, aux = layer_fn(lp, x, None, None, replay_l)
            return x, (ids, aux)
        x, (experts, aux_Ls) = jax.lax.scan(scan_body, x, (params["layers"], replay))
        new_cache = None
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    out = hidden if return_hidden else logits_from_hidden(params, hidden, dtype=dtype, logits_dtype=logits_dtype)
    extra = ((experts,) if return_routing else ()) + ((aux_Ls,) if router_aux_mask_BxT is not None else ())
    return (out, new_cache, *extra)


def response_hidden(params: Params, cfg: ModelConfig, tokens_BxS: Int[Array, "B S"], attn_mask_BxS: Bool[Array, "B S"],
                    n_response: int, dtype=jnp.float32) -> Float[Array, "B N D"]:
    """Final hidden states at the N positions that predict the last N tokens (a prompt + response sequence),
    stop-gradient: what a frozen model's scoring reads."""
    hidden, _ = forward(params, tokens_BxS, cfg=cfg, attn_mask_BxT=attn_mask_BxS, dtype=dtype, return_hidden=True)
    S = tokens_BxS.shape[1]
    return jax.lax.stop_gradient(hidden[:, S - n_response - 1:S - 1])


class Transformer(nnx.Module):
    """Flax NNX wrapper: holds the params as `nnx.Param`s and calls the pure `forward`.

    `nnx.split(model)` gives (graphdef, state); `params_of(model)` gives the plain pytree that the sampler,
    the trainer and the checkpoint code pass around.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 params: Params | None = None):
        self.cfg = cfg
        self.dtype = dtype
        p = params if params is not None else init_params(cfg, rngs.params(), param_dtype)
        self.weights = nnx.data(jax.tree.map(nnx.Param, p))

    def __call__(self, tokens_BxT, **kwargs):
        kwargs.setdefault("dtype", self.dtype)
        return forward(params_of(self), tokens_BxT, cfg=self.cfg, **kwargs)


def params_of(model: Transformer) -> Params:
    return jax.tree.map(lambda v: v[...], model.weights, is_leaf=lambda v: isinstance(v, nnx.Variable))
