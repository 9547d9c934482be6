"""Sample completions of JSONL prompts with the jopd rollout sampler (configurable precision and noise).

Input: one JSON object per line with a "prompt" string (the tokenizer's chat template is applied unless
--no-chat-template). Output: one line per prompt with "prompt", "completion", "tokens" (response token ids,
the stop token included), "logprobs" (processed: under the distribution actually sampled from) and
"finish_reason" ("stop" or "length").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jopd.config_dataclass import ConfigError, build
from jopd.data.chat import user_prompt_ids
from jopd.models import io
from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PRESETS, PrecisionConfig, prepare_sampler_params
from jopd.sampling.sampler import Sampler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="HF model directory, .gguf file, or a built-in name (smollm2-135m-instruct)")
    parser.add_argument("--prompts", required=True, help="JSONL file, one {\"prompt\": ...} per line")
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--precision", default="fp32", help=f"rollout precision ({' | '.join(PRESETS)})")
    parser.add_argument("--logit-noise", type=float, default=0.0, help="sigma (nats) of Gaussian logit noise")
    parser.add_argument("--weight-noise", type=float, default=0.0, help="relative sigma of weight noise")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per sampler call")
    parser.add_argument("--slots", type=int, default=0,
                        help="decode slots of the slot engine (a finished row's slot takes the next prompt of the "
                             "call; with a large --batch-size, a few slots serve many prompts); 0: the static engine, "
                             "every row of a call decoding until its longest stops. Same samples either way")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the raw prompt text")


def _flag_error(e: ConfigError) -> ValueError:
    """`where.top_p: msg` -> `--top-p: msg` (name the flag the user typed)."""
    field, _, msg = str(e).partition(": ")
    return ValueError(f"--{field.split('.')[-1].replace('_', '-')}: {msg}")


def read_prompts(path: str) -> list[tuple[int, str]]:
    """(line number, prompt text) for every non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such prompts file")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{p}:{n}: expected an object with a \"prompt\" string")
        out.append((n, row["prompt"]))
    if not out:
        raise ValueError(f"{p}: no prompts (the file is empty)")
    return out


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.precision not in PRESETS:
        raise ValueError(f"--precision: unknown precision {args.precision!r} (choose one of {', '.join(PRESETS)})")
    try:
        precision = build(PrecisionConfig, {**PRESETS[args.precision], "logit_noise": args.logit_noise,
                                            "weight_noise": args.weight_noise}, "precision")
        sampling = build(SamplingConfig, {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                          "greedy": args.greedy, "max_new_tokens": args.max_new_tokens,
                                          "seed": args.seed, "slots": args.slots}, "sampling")
    except ConfigError as e:
        raise _flag_error(e) from None
    rows = read_prompts(args.prompts)

    cfg, params = io.load_params(args.model, dtype=jnp.float32, progress=sys.stderr.isatty())
    tokenizer = io.load_tokenizer(args.model)
    ids = [user_prompt_ids(tokenizer, text, not args.no_chat_template) for _, text in rows]
    for (line, _), p in zip(rows, ids):
        if not p:
            raise ValueError(f"{args.prompts}:{line}: the prompt is empty after tokenization")
        cfg.check_context(len(p) + args.max_new_tokens,
                          f"{args.prompts}:{line}: prompt of {len(p)} tokens + --max-new-tokens {args.max_new_tokens}")
    eos = () if cfg.eos_ids or tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    sampling = dataclasses.replace(sampling, stop_token_ids=eos)

    sampler = Sampler(cfg, sampling, precision)
    rollout_params = prepare_sampler_params(params, precision, jax.random.key(args.seed))
    del params
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as f:
        for start in tqdm(range(0, len(ids), args.batch_size), desc="sampling", unit="batch"):
            batch = ids[start:start + args.batch_size]
            out = sampler.generate(rollout_params, batch, seed=args.seed, first_index=start,
                                   min_batch=args.batch_size)  # the last, smaller batch reuses the program
            for i in range(len(batch)):
                n = int(out.lengths_B[i])
                tokens = out.tokens_BxN[i, :n].tolist()
                f.write(json.dumps({
                    "prompt": rows[start + i][1],
                    "completion": tokenizer.decode(tokens, skip_special_tokens=True),
                    "tokens": tokens,
                    "logprobs": np.asarray(out.logprobs_BxN[i, :n], np.float64).tolist(),
                    "finish_reason": "stop" if out.done_B[i] else "length",
                }) + "\n")
    print(f"wrote {len(ids)} completions to {out_path}", file=sys.stderr)
    return 0
