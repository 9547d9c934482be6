"""Decode cost vs the cache's filled length on CPU: the attention of one decode step (a new query per row against
one layer's KV cache of `--slots` slots, the seam's cached call) when the rows have filled only part of it, `xla`
(reads every slot) vs `chunked` (skips the slot tiles past every row's write slot) side by side. Only the
attention is timed: the rest of a decode step (projections, the cache write) does not depend on the fill.

  same     every row at the same slot F (the static engine): F = 512 ... S
  ragged   the rows at different slots, the longest at F (the slot engine): rows at F/8, F/4, F/2, F

The shapes are long_context.py's model's (8 query / 2 KV heads of 64, fp32), batch 4. Time is the
median of `--repeats` runs after a warm-up (compile excluded).

    PYTHONPATH=. python benchmarks/decode_fill.py [--slots 8192] [--repeats 5]
Writes decode_fill.json under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jopd.models.attention import ATTENTION  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
B, H, K, Dh = 4, 8, 2, 64


def step_fn(attention: str):
    def step(q_Bx1xHxDh, k_BxKxSxDh, v_BxKxSxDh, slot_B, kv_mask_BxS):
        return ATTENTION[attention].cached(q_Bx1xHxDh, k_BxKxSxDh, v_BxKxSxDh, slot=slot_B, kv_mask_BxS=kv_mask_BxS,
                                           dtype=jnp.float32)

    return jax.jit(step)


def seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results"))
    args = ap.parse_args()
    S = args.slots
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, 1, H, Dh))
    k, v = (jax.random.normal(key, (B, K, S, Dh)) for key in keys[1:])
    fills = [f for f in (512, 1024, 2048, 4096, 8192, 16384) if f <= S]
    fns = {name: step_fn(name) for name in ("xla", "chunked")}
    rows = []
    for kind in ("same", "ragged"):
        for F in tqdm(fills, desc=kind, leave=False):
            slot_B = (jnp.full((B,), F - 1, jnp.int32) if kind == "same"
                      else jnp.asarray([F // 8 - 1, F // 4 - 1, F // 2 - 1, F - 1], jnp.int32))
            mask_BxS = jnp.arange(S)[None, :] <= slot_B[:, None]
            rec = {"kind": kind, "fill": F}
            for name, fn in fns.items():
                rec[f"{name}_ms"] = 1e3 * seconds(fn, (q, k, v, slot_B, mask_BxS), args.repeats)
            rows.append(rec)
    print(f"one decode step's attention, {B} rows, one layer's cache of {S} slots (ms; median of {args.repeats})")
    print(f"{'rows at':<8} {'longest fill':>12} {'xla':>8} {'chunked':>8} {'chunked/xla':>12}")
    for r in rows:
        print(f"{r['kind']:<8} {r['fill']:>12} {r['xla_ms']:>8.2f} {r['chunked_ms']:>8.2f} "
              f"{r['chunked_ms'] / r['xla_ms']:>11.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "slots": S, "rows": B, "repeats": args.repeats}
    (out / "decode_fill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'decode_fill.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
