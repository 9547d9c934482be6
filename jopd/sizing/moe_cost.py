"""The experts' grouped matmuls on paper, for `jopd aot`'s roofline: a mixture-of-experts layer's FLOPs are its
active experts' (each token runs k of E), its HBM reads the experts its tokens touch.

XLA's cost analysis counts a `ragged_dot` over every row of its operand, rows past the groups' sizes included: on
an expert-parallel device that is every pair of its expert group, of which it owns E / group's share (measured on
Qwen3-30B-A3B's scoring over 8 expert shards: 5.2x the model FLOPs of the whole stage). So the cost programs run the
grouped matmuls as an identity (`models.moe.grouped_matmuls_stand_in`; the routing, the dispatch's gathers and
its collectives stay in them) and `expert_cost` adds the matmuls per device:

  FLOPs = passes x sparse layers x 3 matmuls x 2 x (tokens x k) x D x I / devices   (pairs split evenly)
  bytes = weight reads x sparse layers x (experts touched per device) x 3 x D x I x weight bytes
          + passes x sparse layers x (pairs per device) x (2 D + 3 I) x activation bytes

where a device holds E / g experts (g: the `expert` group, 1 without expert parallelism), the tokens that reach its
experts are its group's, and it touches E / g x (1 - (1 - k / E)^tokens) of them (uniform routing, an assumption:
a trained router is not uniform). Passes: a forward 1; the update's forward and backward 3 FLOP passes (+1 with
remat), its weights read twice and their gradients written once."""

from __future__ import annotations

import dataclasses

from jopd.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ExpertCost:
    flops: float  # per device
    bytes: float  # per device
    touched: float  # experts read per device per pass (of the E / group it holds)


def expert_cost(cfg: ModelConfig, tokens: int, *, num_devices: int, expert_group: int, weight_bytes: int,
                act_bytes: int, train: bool = False, remat: bool = False) -> ExpertCost:
    """The grouped matmuls of `cfg`'s sparse layers over `tokens` tokens (global: all devices' rows) in one pass
    (a forward; `train`: the update's forward and backward), per device. Zero for a dense model."""
    layers = len(cfg.sparse_layers)
    if not layers or not tokens:
        return ExpertCost(0.0, 0.0, 0.0)
    E, k, D, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    pairs_per_device = tokens * k / num_devices
    flop_passes = (3 + int(remat)) if train else 1
    flops = flop_passes * layers * 3 * 2 * pairs_per_device * D * I
    # the tokens an expert shard sees: its group's (the data-parallel replicas of the group split the rest)
    reaching = tokens * expert_group / num_devices
    held = E / expert_group
    touched = held * (1.0 - (1.0 - k / E) ** reaching)
    weight_passes = 3 if train else 1  # forward read; backward read + gradient write
    weights = weight_passes * layers * touched * 3 * D * I * weight_bytes
    activations = flop_passes * layers * pairs_per_device * (2 * D + 3 * I) * act_bytes
    return ExpertCost(float(flops), float(weights + activations), float(touched))
