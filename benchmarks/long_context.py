"""Long context on CPU: the `xla` and `chunked` attention implementations side by side, one training step and
one decode step of a small random model at each length T, peak memory and time.

  train   `jax.value_and_grad` of the mean next-token cross-entropy of `transformer.forward(params, tokens_1xT,
          attention=impl, remat=True)` (batch 1, the layers stacked and scanned, each layer recomputed in the
          backward pass).
  decode  `transformer.forward` of one new token against a KV cache of T slots (`transformer.init_cache`,
          `cache_index=T-1`, every slot real in `kv_mask_BxS`): the last step of a T-token rollout.

Memory is XLA's own account of the compiled program (`compiled.memory_analysis()`): `temp` is the scratch the
program allocates (activations, attention scores, gradients' intermediates), `peak` = temp + argument + output
bytes (XLA:CPU aliases no buffers here, so it is an upper bound of what the program holds at once). The table
shows temp (what the attention implementation changes); the JSON has all three. Time is the median of
`--repeats` blocked runs after one warm-up run (compile excluded). A length where an implementation fails
(XLA's refusal to compile, an allocation failure) is recorded as failed with its one-line reason, not fatal; a
program whose compiled peak exceeds `--max-run-gib` is compiled (its memory reported) but not run, since this
machine's memory is shared.

The model is tiny so that the default lengths (128 and 512 ... 8192) run in minutes on a 2-core CPU: 2 layers,
hidden 256, 8 query heads, 2 KV heads (GQA), head_dim 64, SwiGLU 512, vocab 512; fp32. Attention dominates
the work at long T, which is the point. T=128 is the testbed's scale (prompt + response ~100 tokens), where
`chunked` should cost no more than `xla`. `--block` sets chunked's query/key block (default 512: the
implementation's own default, registered under a new name when changed).

    PYTHONPATH=. python benchmarks/long_context.py [--lengths 128,512,1024,2048,4096,8192] [--smoke]
Writes long_context.json / .png under --out (default benchmarks/results/; `--tag T`: long_context_T.json /
.png). Runs on CPU unless JAX_PLATFORMS is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jopd.models import transformer  # noqa: E402
from jopd.models.attention import ATTENTION, Attention  # noqa: E402
from jopd.models.attention_chunked import BLOCK, chunked_cached, chunked_causal  # noqa: E402
from jopd.models.config import ModelConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("xla", "chunked")
MiB = 2**20


def model_config(max_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=max(max_len, 8192))


def chunked_name(block: int) -> str:
    """The registry name of chunked attention at `block` (the registered "chunked" at its default block)."""
    if block == BLOCK:
        return "chunked"
    name = f"chunked_b{block}"
    if name not in ATTENTION:
        ATTENTION.add(name, Attention(causal=functools.partial(chunked_causal, block_q=block, block_k=block),
                                      cached=functools.partial(chunked_cached, block_q=block, block_k=block)))
    return name


def train_fn(cfg: ModelConfig, attention: str):
    def loss(params, tokens_1xT):
        logits_1xTxV, _ = transformer.forward(params, tokens_1xT, cfg=cfg, attention=attention, remat=True)
        logp_1xTxV = jax.nn.log_softmax(logits_1xTxV[:, :-1], axis=-1)
        nll_1xT = -jnp.take_along_axis(logp_1xTxV, tokens_1xT[:, 1:, None], axis=-1)[..., 0]
        return nll_1xT.mean()

    return jax.jit(jax.value_and_grad(loss))


def decode_fn(cfg: ModelConfig, attention: str):
    def step(params, token_1x1, cache, kv_mask_1xS):
        S = kv_mask_1xS.shape[1]
        return transformer.forward(params, token_1x1, cfg=cfg, cache=cache, cache_index=S - 1,
                                   kv_mask_BxS=kv_mask_1xS, positions_BxT=jnp.full((1, 1), S - 1, jnp.int32),
                                   attention=attention)

    return jax.jit(step)


def _error_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def measure(fn, args: tuple, repeats: int, max_run_bytes: int) -> dict:
    """Compile `fn` for `args`, read its memory, then (if it fits the limit) time it: a dict, or one with
    `error` when compiling or running failed."""
    try:
        compiled = fn.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - XLA's refusal is a result here
        return {"error": "compile: " + _error_line(e)}
    ma = compiled.memory_analysis()
    rec = {"temp_bytes": int(ma.temp_size_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
           "output_bytes": int(ma.output_size_in_bytes)}
    rec["peak_bytes"] = rec["temp_bytes"] + rec["argument_bytes"] + rec["output_bytes"]
    if rec["peak_bytes"] > max_run_bytes:
        rec["error"] = f"not run: peak {rec['peak_bytes'] / MiB:.0f} MiB > --max-run-gib"
        return rec
    try:
        jax.block_until_ready(compiled(*args))  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - e.g. an allocation failure at run time
        rec["error"] = "run: " + _error_line(e)
        return rec
    rec["seconds"] = statistics.median(times)
    rec["all_seconds"] = times
    return rec


def run(lengths: list[int], impls: dict[str, str], repeats: int, max_run_bytes: int) -> dict:
    """results[str(T)][label] = {"train": {...}, "decode": {...}}."""
    cfg = model_config(max(lengths))
    params = transformer.init_params(cfg, jax.random.key(0))
    results: dict = {}
    jobs = [(T, label) for T in lengths for label in impls]
    for T, label in tqdm(jobs, desc="long context", unit="cell"):
        name = impls[label]
        tokens_1xT = jax.random.randint(jax.random.key(T), (1, T), 0, cfg.vocab_size, jnp.int32)
        train = measure(train_fn(cfg, name), (params, tokens_1xT), repeats, max_run_bytes)
        cache = transformer.init_cache(cfg, 1, T)
        decode = measure(decode_fn(cfg, name), (params, tokens_1xT[:, -1:], cache, jnp.ones((1, T), bool)),
                         repeats, max_run_bytes)
        results.setdefault(str(T), {})[label] = {"train": train, "decode": decode}
        tqdm.write(f"T={T} {label}: train {_cell(train, 'temp')} / {_cell(train, 's')}, "
                   f"decode {_cell(decode, 'temp')} / {_cell(decode, 'ms')}", file=sys.stderr)
    return results


def _cell(rec: dict, what: str) -> str:
    if what == "temp":
        return f"{rec['temp_bytes'] / MiB:.1f}" if "temp_bytes" in rec else "failed"
    if "seconds" not in rec:
        return "failed" if "temp_bytes" not in rec else "not run"
    return f"{rec['seconds']:.3f}" if what == "s" else f"{rec['seconds'] * 1e3:.2f}"


def _ratio(a: dict, b: dict, key: str) -> str:
    if key in a and key in b and b[key]:
        return f"{a[key] / b[key]:.2f}x"
    return "-"


def print_table(results: dict) -> None:
    head = f"{'T':>6s} {'impl':>8s} {'train temp MiB':>15s} {'train s':>9s} {'decode temp MiB':>16s} {'decode ms':>10s}"
    print(head)
    print("-" * len(head))
    for T, row in results.items():
        for label, rec in row.items():
            tr, de = rec["train"], rec["decode"]
            print(f"{T:>6s} {label:>8s} {_cell(tr, 'temp'):>15s} {_cell(tr, 's'):>9s} {_cell(de, 'temp'):>16s} "
                  f"{_cell(de, 'ms'):>10s}")
        if set(IMPLS) <= set(row):
            c, x = row["chunked"], row["xla"]
            print(f"{T:>6s} {'chk/xla':>8s} {_ratio(c['train'], x['train'], 'temp_bytes'):>15s} "
                  f"{_ratio(c['train'], x['train'], 'seconds'):>9s} "
                  f"{_ratio(c['decode'], x['decode'], 'temp_bytes'):>16s} "
                  f"{_ratio(c['decode'], x['decode'], 'seconds'):>10s}")
    for rec_T, row in results.items():
        for label, rec in row.items():
            for stage in ("train", "decode"):
                if "error" in rec[stage]:
                    print(f"T={rec_T} {label} {stage}: {rec[stage]['error']}")


def targets(results: dict) -> dict:
    """The issue's checks, where the lengths they need were measured (None: not measured)."""
    def get(T, label, stage, key):
        return results.get(str(T), {}).get(label, {}).get(stage, {}).get(key)

    out = {}
    c2, c8 = get(2048, "chunked", "train", "temp_bytes"), get(8192, "chunked", "train", "temp_bytes")
    out["chunked_train_temp_growth_2k_to_8k"] = c8 / c2 if c2 and c8 else None
    x8 = get(8192, "xla", "train", "temp_bytes")
    out["chunked_over_xla_train_temp_at_8k"] = c8 / x8 if c8 and x8 else None
    speed = {}
    for T in results:
        a, b = get(T, "chunked", "train", "seconds"), get(T, "xla", "train", "seconds")
        if a and b:
            speed[T] = a / b
    out["chunked_over_xla_train_seconds"] = speed
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib  # a base dependency of jopd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage in zip(axes, ("train", "decode")):
        for label, color in zip(next(iter(results.values())), ("C3", "C2", "C0", "C1")):
            cells = [(int(T), row[label][stage]) for T, row in results.items()
                     if "temp_bytes" in row.get(label, {}).get(stage, {})]
            if cells:
                Ts = [T for T, _ in cells]
                ax.plot(Ts, [c["temp_bytes"] / MiB for _, c in cells], "o-", color=color, label=f"{label} temp")
                ax.plot(Ts, [c["peak_bytes"] / MiB for _, c in cells], "--", color=color, alpha=0.5,
                        label=f"{label} peak (temp+args+out)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("MiB (XLA memory_analysis)")
        ax.set_title({"train": "one train step (value_and_grad, remat)", "decode": "one decode step, cache of T"}[stage])
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Attention memory vs T, xla vs chunked (jopd benchmarks/long_context.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,2048,4096,8192")
    ap.add_argument("--smoke", action="store_true", help="T=128,256 only (a quick check of the script)")
    ap.add_argument("--block", type=int, default=BLOCK, help="chunked attention's query/key block")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (the median is reported)")
    ap.add_argument("--max-run-gib", type=float, default=8.0,
                    help="compile but do not run a program whose compiled peak exceeds this (shared machine)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results"))
    ap.add_argument("--tag", default="", help="write long_context_TAG.json / .png")
    args = ap.parse_args()
    lengths = [128, 256] if args.smoke else [int(t) for t in args.lengths.split(",")]
    impls = {"xla": "xla", "chunked": chunked_name(args.block)}
    t0 = time.perf_counter()
    results = run(lengths, impls, args.repeats, int(args.max_run_gib * 2**30))
    print()
    print_table(results)
    checks = targets(results)
    print(json.dumps(checks, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(max(lengths))
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats, "block": args.block,
            "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                                                   "num_kv_heads", "head_dim", "vocab_size")},
            "memory": "XLA memory_analysis: temp = scratch; peak = temp + argument + output bytes",
            "wall_seconds": time.perf_counter() - t0}
    stem = "long_context" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results, "targets": checks}, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.json'} and {stem}.png ({meta['wall_seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
