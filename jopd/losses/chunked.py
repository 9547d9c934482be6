"""Chunked projection to logits: map a per-position function over T-chunks so that at most one chunk of
[B, chunk, V] logits exists at a time (and, under `jax.checkpoint`, the backward pass recomputes each chunk's
logits instead of storing them). The student's loss and the teacher's scoring (`jopd.opd.teacher_scoring`) both use it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jopd.models.transformer import logits_at_ids, logits_from_hidden
from jopd.parallel.vocab_projection import vocab_sharded_head, vocab_sharded_logits

ChunkFn = Callable[[jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]

_UNROLLED = contextvars.ContextVar("chunked_map_unrolled", default=False)


@contextlib.contextmanager
def unrolled_chunks() -> Iterator[None]:
    """Within it (at trace time), `chunked_map` runs its chunks one after another without a loop: for cost
    programs (`sizing.cost`), whose XLA cost analysis would count a loop's body once. The outputs are the loop's."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


def head_params(params: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Only the leaves `logits_from_hidden` reads, so the scan does not carry the whole model."""
    return {"lm_head": params["lm_head"]} if "lm_head" in params else {"embed": params["embed"]}


def chunked_logits_map(
    fn: ChunkFn,
    params: Mapping[str, Any],
    hidden_BxTxD: Float[Array, "B T D"],
    inputs: Mapping[str, jax.Array],
    chunk: int,
    *,
    dtype=jnp.float32,
    remat: bool = True,
    support_ids_key: str | None = None,
    vocab_split: bool = False,
) -> dict[str, jax.Array]:
    """`fn(logits_BxCxV, inputs_chunk) -> {name: [B, C, ...]}` over T-chunks of C positions; returns [B, T, ...].

    `inputs` are [B, T, ...] arrays sliced along T with the hidden states. T need not be a multiple of
    `chunk`: the tail is zero-padded (finite logits) and cut from the outputs, so padding gets no gradient.
    `remat=True` wraps each chunk in `jax.checkpoint` (for differentiated use); logits are fp32.

    `support_ids_key` names an [B, T, K] ids input: the full logits handed to `fn` are then stop-gradient and
    `inputs_chunk["support_logits"]` holds the differentiable logits at those ids (`logits_at_ids`). For a loss
    whose gradient only needs K logits per position (the truncated reverse KL: its renormalization on the
    support cancels the full-vocabulary logsumexp), the backward pass then skips the [B, C, V] softmax and
    the two V-wide matmuls (the head gradient and the hidden-state gradient through it).

    `vocab_split`: on a mesh, the head that projects the full logits is laid out with V split over every axis
    once, outside the loop, and each chunk projected on V-slices (`parallel.vocab_projection`): no chip holds the
    whole head, nor (for a differentiated projection) its whole gradient, which the head's train layout (D over
    fsdp) would otherwise gather in full. With `support_ids_key`, the support logits still come from the head as
    laid out (a gather of K rows).
    """
    def project(p, h_BxCxD):
        if vocab_split:
            return vocab_sharded_logits(p, h_BxCxD, dtype=dtype)
        return logits_from_hidden(p, h_BxCxD, dtype=dtype, logits_dtype=jnp.float32)

    def per_chunk(heads, inp):
        head, full_head = heads
        h_BxCxD = inp.pop("_hidden")
        if support_ids_key is None:
            return fn(project(full_head, h_BxCxD), inp)
        logits = project(jax.lax.stop_gradient(full_head), jax.lax.stop_gradient(h_BxCxD))
        support = logits_at_ids(head, h_BxCxD, inp[support_ids_key], dtype=dtype, logits_dtype=jnp.float32)
        return fn(logits, dict(inp, support_logits=support))

    head = head_params(params)
    full_head = head
    if vocab_split:
        full_head = vocab_sharded_head(head if support_ids_key is None else jax.lax.stop_gradient(head))
    return chunked_map(lambda inp: per_chunk((head, full_head), dict(inp)), dict(inputs, _hidden=hidden_BxTxD),
                       chunk, remat=remat)


def chunked_map(fn: Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]], inputs: Mapping[str, jax.Array],
                chunk: int, *, remat: bool = False) -> dict[str, jax.Array]:
    """`fn(inputs_chunk) -> {name: [B, C, ...]}` over T-chunks of C positions of [B, T, ...] `inputs`; returns
    [B, T, ...]. The tail chunk is zero-padded and cut from the outputs; `remat` wraps each chunk in
    `jax.checkpoint` (only the chunk's inputs are saved for the backward pass)."""
    B, T = next(iter(inputs.values())).shape[:2]
    c = max(1, min(int(chunk), T))
    n = -(-T // c)
    pad = n * c - T

    def split(x):  # [B, T, ...] -> [n, B, c, ...]
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(B, n, c, *x.shape[2:]), 0, 1)

    def merge(y):  # [n, B, c, ...] -> [B, T, ...]
        return jnp.swapaxes(y, 0, 1).reshape(B, n * c, *y.shape[3:])[:, :T]

    if remat:
        # Saves only the chunk's inputs; prevent_cse=False is safe (and faster) inside scan.
        fn = jax.checkpoint(fn, prevent_cse=False)

    def body(carry, xs):
        return carry, fn(xs)

    chunks = {k: split(v) for k, v in inputs.items()}
    if _UNROLLED.get():
        return jax.tree.map(merge, _unrolled(fn, chunks, n))
    _, out = jax.lax.scan(body, None, chunks)
    return jax.tree.map(merge, out)


def _unrolled(fn, chunks: Mapping[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """The chunks in sequence, each chunk's inputs tied to the previous chunk's outputs by an optimization barrier,
    so that, as in the loop, one chunk's logits are live at a time (unordered, the compiler may overlap them)."""
    outs, prev = [], None
    for i in range(n):
        xs = {k: v[i] for k, v in chunks.items()}
        if prev is not None:
            xs, _ = jax.lax.optimization_barrier((xs, prev))
        prev = fn(xs)
        outs.append(prev)
    return jax.tree.map(lambda *ys: jnp.stack(ys), *outs)
