"""Greedy decoding of one prompt with the rollout sampler: the quick check that a checkpoint loads and generates
(`jopd generate`), and the reference continuation tests compare exports and imports against."""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.sampler import Sampler


def greedy_tokens(params, cfg: ModelConfig, prompt: list[int], max_new_tokens: int, *, compute_dtype: str = "fp32",
                  stop_token_ids: tuple[int, ...] = ()) -> Int[np.ndarray, "N"]:
    """Greedy continuation of one prompt with `jopd.sampling.Sampler`, up to and including the first stop token."""
    sampler = Sampler(cfg, SamplingConfig(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids),
                      PrecisionConfig(compute_dtype=compute_dtype))
    out = sampler.generate(params, [prompt], seed=0)
    return out.tokens_BxN[0, :out.lengths_B[0]]


def cut_at_eos(tokens_N: Int[np.ndarray, "N"], eos_ids: tuple[int, ...]) -> Int[np.ndarray, "M"]:
    """Tokens up to and excluding the first EOS."""
    hits = np.flatnonzero(np.isin(tokens_N, eos_ids)) if eos_ids else []
    return tokens_N[: hits[0]] if len(hits) else tokens_N
