"""The attention's FLOPs and HBM bytes on paper, for the roofline (`jopd.sizing.cost`), where XLA's cost analysis
cannot see them: inside a Pallas kernel (splash: a custom call XLA counts as nothing) or inside a loop (chunked:
XLA counts one tile of its scans). The "xla" entry is plain einsums on the dense mask: XLA counts it itself.

Counts are global (every row of the stage), in the blocks the implementations compute:
- causal over T tokens in blocks of b: the query x key blocks at or below the diagonal, nb(nb+1)/2 of b x b
  (nb = ceil(T / b)); per layer and query head, a forward is two matmuls (scores, probs @ v) of 2 x pairs x Dh
  FLOPs; its HBM bytes are q and the output once and k, v once per query block that reads them (per query head:
  the kernel's grid runs over query heads; grouped heads re-read their kv head);
- the train step's backward (flash-style): 7 matmuls of the same size (the dq pass recomputes the scores, dP and
  dq; the dk/dv pass recomputes the scores, dv, dP and dk) and about twice the forward's bytes; with per-layer
  remat the forward runs twice (the update's pass and the backward's recompute);
- a decode step: one query per row against the slots it reads: every slot of the cache (a dense read) or, for a
  blocked/kernel read, the row's filled length in blocks of b, on average prompt + half the response over a
  rollout whose rows all decode to max_new_tokens.
"""

from __future__ import annotations

import dataclasses

from jopd.models.attention import AUTO, auto_choice
from jopd.models.config import ModelConfig

SEEN_BY_XLA = frozenset({"xla"})  # entries built from plain einsums on the dense mask
KERNEL_BLOCK = 512  # the block both splash (at long T) and chunked use
BACKWARD_MATMULS = 7  # flash-style backward: 7 matmuls of the forward's 2
BACKWARD_BYTES = 2.0  # the backward's HBM bytes over the forward's (two passes, each re-reading k/v or q/dO)


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """Global FLOPs and HBM bytes of a stage's attention (every layer and row), and which entry it is."""

    impl: str
    flops: float
    bytes: float


def implementation(cfg: ModelConfig, call: str, length: int, platform: str) -> str:
    """The entry a model runs for `call` ("causal" over `length` tokens, "cached" against `length` slots) when
    lowered for `platform`: its own `attention`, or what "auto" picks there."""
    return auto_choice(call, length, platform) if cfg.attention == AUTO else cfg.attention


def _causal_pairs(T: int, block: int) -> int:
    b = min(block, T)
    nb = -(-T // b)
    return b * b * nb * (nb + 1) // 2


def causal_forward(cfg: ModelConfig, rows: int, T: int, elem_bytes: int, block: int = KERNEL_BLOCK
                   ) -> tuple[float, float]:
    """(FLOPs, bytes) of one blockwise causal forward over `rows` rows of T tokens, every layer."""
    H, Dh, L = cfg.num_heads, cfg.head_dim, cfg.num_layers
    pairs = _causal_pairs(T, block)
    flops = 2 * 2 * pairs * Dh * H * rows * L
    b = min(block, T)
    nb = -(-T // b)
    kv_reads = 2 * b * nb * (nb + 1) // 2  # k and v slots read, summed over query blocks
    bytes_ = (2 * T + kv_reads) * Dh * H * rows * L * elem_bytes
    return float(flops), float(bytes_)


def causal_cost(cfg: ModelConfig, rows: int, T: int, elem_bytes: int, platform: str, *, train: bool = False,
                remat: bool = False) -> AttentionCost:
    """A stage's causal attention: a forward (scoring, prefill), or with `train` its backward too (and the
    forward again under `remat`). Zero when XLA counts it itself (`SEEN_BY_XLA`)."""
    impl = implementation(cfg, "causal", T, platform)
    if impl in SEEN_BY_XLA:
        return AttentionCost(impl, 0.0, 0.0)
    flops, bytes_ = causal_forward(cfg, rows, T, elem_bytes)
    if train:
        forwards = 2 if remat else 1
        flops, bytes_ = (forwards + BACKWARD_MATMULS / 2) * flops, (forwards + BACKWARD_BYTES) * bytes_
    return AttentionCost(impl, flops, bytes_)


def decode_cost(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, cache_elem_bytes: int, platform: str,
                block: int = KERNEL_BLOCK) -> AttentionCost:
    """One average decode step's attention over `rows` rows (a cache of prompt_len + new_tokens slots), read
    blockwise up to each row's filled length: zero when the entry is XLA's dense read (XLA counts the whole cache)."""
    S = prompt_len + new_tokens
    impl = implementation(cfg, "cached", S, platform)
    if impl in SEEN_BY_XLA:
        return AttentionCost(impl, 0.0, 0.0)
    filled = prompt_len + new_tokens / 2  # the average over the steps of a rollout to max_new_tokens
    slots = min(S, -(-filled // block) * block)
    H, K, Dh, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    flops = 2 * 2 * slots * Dh * H * rows * L
    bytes_ = 2 * slots * Dh * K * rows * L * cache_elem_bytes
    return AttentionCost(impl, float(flops), float(bytes_))


def causal_model_flops(cfg: ModelConfig, rows: int, T: int, factor: int) -> float:
    """The attention's model FLOPs (for MFU): the causal half of the score and value matmuls, T(T+1)/2 pairs per
    layer and head, times `factor` / 2 forwards (2: a forward, 6: forward + backward, as `roofline.model_flops`)."""
    return float(factor / 2 * 2 * 2 * (T * (T + 1) // 2) * cfg.head_dim * cfg.num_heads * cfg.num_layers * rows)
