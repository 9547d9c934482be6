"""The attention seam: the two calls a transformer layer makes, one per job, and the registry of implementations.

- `Attention.causal`: prefill / training / scoring over T tokens, each attending to the tokens at or before it
  that are real (`mask_BxT`, padding on either side) and, for packed rows, in its own segment (`segment_ids_BxT`).
- `Attention.cached`: T new tokens against a KV cache of S slots, the first new token at slot `slot` (a scalar,
  or one slot per row: rows at different decode steps); a token attends to the slots at or before its own that
  `kv_mask_BxS` marks real (None: all of them). The new tokens' K/V are already written into the cache.

q is [B, T, H, Dh]; k, v are head-major [B, K, S, Dh] (the cache's layout; S = T without a cache), with K
dividing H (grouped-query attention: query head h reads kv head h // (H / K)). Both return [B, T, H, Dh].

Inputs are structural (a padding mask, segment ids, slot indices), never a prebuilt [B, T, S] mask, so an
implementation may work blockwise and never materialize one. An implementation is one
`ATTENTION.add(name, Attention(...))`; a model's `ModelConfig.attention` (or `transformer.forward(..., attention=name)`)
picks it. "xla" is plain einsum + softmax over the dense mask.

"auto" (the default) picks per call, by the platform the program is lowered for and the length: on a TPU
"splash" (its causal kernel and its decode kernel); on a GPU "cudnn" when registered; elsewhere "xla" below
`CPU_CHUNKED_FROM_T` tokens (the CPU testbed keeps today's numerics bit for bit) and "chunked" from there on, where
it is also faster on CPU (benchmarks/long_context.py). The decode call stays "xla" below `CPU_CHUNKED_FROM_S` cache
slots and "chunked" (tiles past every row's slot skipped) from there on. The platform is the one the program is
lowered for: known while tracing under a mesh (a program is lowered for its mesh's devices) or where the caller
says where it runs (`attention_mesh.runs_on`: SFT), and then only that branch is traced; otherwise read at
lowering (`lax.platform_dependent`: every branch traced, one kept). Never the host's alone: `jopd aot --topology
v5e:...` on a CPU host compiles what a TPU would run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jopd.models.attention_mesh import traced_platform
from jopd.models.dtypes import matmul_precision
from jopd.registry import Registry


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention implementation: `causal(q, k, v, *, mask_BxT, segment_ids_BxT, dtype)` and
    `cached(q, k_cache, v_cache, *, slot, kv_mask_BxS, dtype)` (see the module docstring)."""

    causal: Callable[..., jax.Array]
    cached: Callable[..., jax.Array]


ATTENTION: Registry[Attention] = Registry("attention implementation")


AUTO = "auto"
CPU_CHUNKED_FROM_T = 1024  # causal calls this long or longer use "chunked" on CPU (and GPU without "cudnn")
CPU_CHUNKED_FROM_S = 4096  # decode calls against a cache this long or longer likewise


def check_attention_name(name: str) -> str:
    """`name` if it is a registered implementation or "auto"; else one line naming them (a config field's check,
    run when the config is built, so entries registered by plugins count)."""
    if name != AUTO and name not in ATTENTION:
        raise ValueError(f"{ATTENTION.unknown(name)} (or {AUTO!r})")
    return name


def attention_impl(name: str) -> Attention:
    """The registered implementation `name`, or the "auto" choice; an unknown name is one line listing them."""
    try:
        check_attention_name(name)
    except ValueError as e:
        raise ValueError(f"attention: {e}") from None
    return AUTO_ATTENTION if name == AUTO else ATTENTION[name]


# ---------------------------------------------------------------------------------------------
# "xla": the dense mask, einsum, softmax


def causal_mask(mask_BxT: Bool[Array, "B T"], segment_ids_BxT: Int[Array, "B T"] | None = None
                ) -> Bool[Array, "B T T"]:
    """Token i sees token j iff j <= i, j is real and (packed rows) both are in the same segment."""
    T = mask_BxT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & mask_BxT[:, None, :].astype(bool)
    if segment_ids_BxT is not None:
        mask = mask & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
    return mask


def cache_mask(slot: Int[Array, ""] | Int[Array, "B"] | int, T: int, kv_mask_BxS: Bool[Array, "B S"]
               ) -> Bool[Array, "B T S"]:
    """New token i (at slot `slot` + i, `slot` a scalar or one per row) sees slot j iff j <= its own and real."""
    S = kv_mask_BxS.shape[1]
    if jnp.ndim(slot) == 0:
        q_slot = slot + jnp.arange(T)
        return (jnp.arange(S)[None, :] <= q_slot[:, None])[None] & kv_mask_BxS[:, None, :].astype(bool)
    q_slot_BxT = slot[:, None] + jnp.arange(T)[None, :]  # one write slot per row
    return (jnp.arange(S)[None, None, :] <= q_slot_BxT[:, :, None]) & kv_mask_BxS[:, None, :].astype(bool)


def masked_attention(q_BxTxHxDh: Float[Array, "B T H Dh"], k_BxKxSxDh: Float[Array, "B K S Dh"],
                     v_BxKxSxDh: Float[Array, "B K S Dh"], mask_BxTxS: Bool[Array, "B T S"], dtype
                     ) -> Float[Array, "B T H Dh"]:
    """Softmax attention under a dense mask, scores and softmax in fp32, grouped-query heads."""
    B, T, H, Dh = q_BxTxHxDh.shape
    K = k_BxKxSxDh.shape[1]
    # Both dots in batch-leading [b, k, g, t, ...] form: an output with t between b and k ("btkgd") made XLA:CPU
    # run the probs @ v dot ~8x slower at decode shapes (T = 1); one transpose of the [B, T, H, Dh] result instead.
    q = q_BxTxHxDh.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4)
    prec = matmul_precision(dtype)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k_BxKxSxDh, precision=prec).astype(jnp.float32)
    scores = scores / math.sqrt(Dh)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v_BxKxSxDh, precision=prec)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _xla_causal(q, k, v, *, mask_BxT, segment_ids_BxT=None, dtype):
    return masked_attention(q, k, v, causal_mask(mask_BxT, segment_ids_BxT), dtype)


def _xla_cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype):
    if kv_mask_BxS is None:
        kv_mask_BxS = jnp.ones((k_cache.shape[0], k_cache.shape[2]), bool)
    return masked_attention(q, k_cache, v_cache, cache_mask(slot, q.shape[1], kv_mask_BxS), dtype)


ATTENTION.add("xla", Attention(causal=_xla_causal, cached=_xla_cached))


# ---------------------------------------------------------------------------------------------
# the other entries live in their own modules, which do not import this one (registering them here makes no circle):
# "chunked", blockwise online softmax, memory O(T·block); "splash", Pallas TPU: the splash kernel for the causal call,
# a decode kernel reading each row's cache up to its own slot for the cached one (attention_decode.py)

from jopd.models.attention_chunked import chunked_cached, chunked_causal  # noqa: E402
from jopd.models.attention_splash import splash_cached, splash_causal  # noqa: E402
from jopd.models.attention_cudnn import cudnn_cached, cudnn_causal  # noqa: E402

ATTENTION.add("chunked", Attention(causal=chunked_causal, cached=chunked_cached))
ATTENTION.add("splash", Attention(causal=splash_causal, cached=splash_cached))
ATTENTION.add("cudnn", Attention(causal=cudnn_causal, cached=cudnn_cached))


# ---------------------------------------------------------------------------------------------
# "auto": one of the above per call, by the lowering platform and the length (module docstring)


def auto_choice(call: str, length: int, platform: str) -> str:
    """The entry "auto" runs for `call` ("causal": `length` = T tokens; "cached": `length` = S cache slots) on
    `platform` ("tpu", "cuda", anything else)."""
    long = length >= (CPU_CHUNKED_FROM_T if call == "causal" else CPU_CHUNKED_FROM_S)
    plain = "chunked" if long else "xla"
    if platform == "tpu":  # splash's causal kernel, and its decode kernel (reads each row up to its slot)
        return "splash"
    if platform == "cuda" and call == "causal" and "cudnn" in ATTENTION:
        return "cudnn"
    return plain


def _auto(call: str, length: int, run: Callable[[str], jax.Array], operand: jax.Array) -> jax.Array:
    names = {p: auto_choice(call, length, p) for p in ("tpu", "cuda", "cpu")}
    if len(set(names.values())) == 1:
        return run(names["cpu"])
    if (platform := traced_platform()) is not None:  # known while tracing: only its branch is traced
        return run(names[platform])
    # Only the branch of the platform lowered for is compiled; the others are traced and dropped.
    return jax.lax.platform_dependent(operand, tpu=lambda _: run(names["tpu"]), cuda=lambda _: run(names["cuda"]),
                                      default=lambda _: run(names["cpu"]))


def _auto_causal(q, k, v, *, mask_BxT, segment_ids_BxT=None, dtype):
    return _auto("causal", q.shape[1], lambda name: ATTENTION[name].causal(
        q, k, v, mask_BxT=mask_BxT, segment_ids_BxT=segment_ids_BxT, dtype=dtype), q)


def _auto_cached(q, k_cache, v_cache, *, slot, kv_mask_BxS=None, dtype):
    return _auto("cached", k_cache.shape[2], lambda name: ATTENTION[name].cached(
        q, k_cache, v_cache, slot=slot, kv_mask_BxS=kv_mask_BxS, dtype=dtype), q)


AUTO_ATTENTION = Attention(causal=_auto_causal, cached=_auto_cached)  # not a registry entry: a choice among them
