"""Peak memory of the reverse-KL losses + gradient: the full-vocabulary RKL as the step computes it (the teacher's
hidden states and head in the batch, its logits projected one chunk at a time beside the student's) and as it
did before (the teacher's [B,T,V] logits in the batch, the student's unchunked), and the truncated RKL (chunked;
on the teacher's top-K, and on its union with the student's top-K, `loss.support=union`).

Compiles `jax.grad` of each loss (w.r.t. the output head and the hidden states) on abstract shapes
(`jax.ShapeDtypeStruct` -> lower -> compile -> memory_analysis), so it runs in seconds and allocates nothing.
Peak = arguments + outputs + temporaries - aliased; the "loss side" column excludes the [V,D] head and its
gradient (present in every variant) to show what the loss itself adds. The chunked temporaries are ~2 chunk-sized
logits buffers plus one [V,D] buffer: each chunk's head-gradient contribution before it is added to the scan's
accumulator (XLA:CPU does not fuse the dot into the add), a constant independent of B and T.

    PYTHONPATH=. python benchmarks/loss_memory.py                      # T=512 V=49152 K=32 D=576, B=1 and 4
    PYTHONPATH=. python benchmarks/loss_memory.py --time               # also time each loss+grad (B=1 only)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jopd.losses import LossBatch, LossConfig, reverse_kl, token_loss, token_loss_from_logits  # noqa: E402
from jopd.opd.teacher_scoring import teacher_scores, teacher_topk  # noqa: E402
from jopd.models import transformer as tfm  # noqa: E402
from jopd.models.config import ModelConfig  # noqa: E402

MB = 1 << 20


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def student_variants(B, T, V, D, K, chunks):
    """name -> (function of (head, hidden, batch) returning grads, abstract batch)."""
    mc = ModelConfig(vocab_size=V, hidden_size=D)
    base = LossBatch(targets_BxT=_sds((B, T), jnp.int32), response_mask_BxT=_sds((B, T), jnp.bool_))
    topk = base.replace(teacher_topk_ids_BxTxK=_sds((B, T, K), jnp.int32), teacher_topk_logprobs_BxTxK=_sds((B, T, K)))
    full = base.replace(teacher_hidden_BxTxD=_sds((B, T, D)))
    t_head = {"embed": _sds((V, D))}
    union = base.replace(teacher_topk_ids_BxTxK=_sds((B, T, 2 * K), jnp.int32),
                         teacher_topk_logprobs_BxTxK=_sds((B, T, 2 * K)), support_mask_BxTxK=_sds((B, T, 2 * K), jnp.bool_))

    def grad_of(loss):
        return jax.grad(lambda head, hidden, batch: loss(head, hidden, batch)[0], argnums=(0, 1))

    def unchunked(cfg):
        return grad_of(lambda h, x, b: token_loss_from_logits(cfg, tfm.logits_from_hidden(h, x), b))

    def materialized_rkl(h, x, teacher_logits_BxTxV):  # full RKL as the step computed it before: the teacher's
        student = tfm.logits_from_hidden(h, x)  # [B, T, V] logits in the batch, the student's unchunked
        return (jnp.mean(reverse_kl(student, teacher_logits_BxTxV)),)

    c = chunks[len(chunks) // 2]
    rkl = LossConfig(kind="rkl", chunk_size=c)
    out = {"full-vocab RKL, teacher logits [B,T,V] in the batch (before)": (grad_of(materialized_rkl),
                                                                          _sds((B, T, V))),
           f"full-vocab RKL, chunked from the teacher's hidden + head (chunk={c})": (
               grad_of(lambda h, x, b: token_loss(rkl, h, mc, x, b[0], teacher_head=b[1])), (full, t_head)),
           "top-K RKL, unchunked student [B,T,V]": (
               unchunked(LossConfig(kind="topk_rkl", top_k=K, support="teacher_topk")), topk)}
    for c in chunks:
        cfg = LossConfig(kind="topk_rkl", top_k=K, chunk_size=c, support="teacher_topk")
        out[f"top-K RKL, chunked (chunk={c})"] = (grad_of(lambda h, x, b, cfg=cfg: token_loss(cfg, h, mc, x, b)), topk)
    cfg = LossConfig(kind="topk_rkl", top_k=K, chunk_size=c, support="union")
    out[f"union-support RKL (2K ids), chunked (chunk={c})"] = (
        grad_of(lambda h, x, b, cfg=cfg: token_loss(cfg, h, mc, x, b)), union)
    return out


def teacher_variants(B, T, V, D, K, chunk):
    def full(head, hidden):
        logprobs = jax.nn.log_softmax(tfm.logits_from_hidden(head, hidden), axis=-1)
        vals, ids = jax.lax.top_k(logprobs, K)
        return ids, vals

    def union(head, hidden, student_ids_BxTxK):
        return teacher_scores(hidden, head, k=K, chunk=chunk, extra_ids_BxTxE=student_ids_BxTxK)

    return {"teacher log-softmax [B,T,V] + top-K": (full, ()),
            f"teacher_topk chunked (chunk={chunk})": (lambda head, hidden: teacher_topk(hidden, head, K, chunk), ()),
            f"teacher at top-K + student top-K ids, chunked (chunk={chunk})": (
                union, (_sds((B, T, K), jnp.int32),))}


def analyse(fn, *abstract_args):
    m = jax.jit(fn).lower(*abstract_args).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes, peak


def time_it(fn, *abstract_args, reps=3):
    rng = np.random.default_rng(0)

    def concrete(s):
        if s.dtype == jnp.int32:
            return jnp.asarray(rng.integers(0, 32, s.shape), jnp.int32)
        if s.dtype == jnp.bool_:
            return jnp.ones(s.shape, bool)
        return jnp.asarray(rng.normal(size=s.shape) * 0.05, s.dtype)

    args = jax.tree.map(concrete, abstract_args)
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--time", action="store_true", help="also run each loss+grad on random data (B=1 only)")
    args = ap.parse_args()
    T, V, D, K = args.seq, args.vocab, args.hidden, args.top_k
    head_bytes = V * D * 4
    print(f"# loss + grad peak memory, T={T} V={V} K={K} D={D}, fp32, {jax.devices()[0].platform} compile")
    for B in args.batch:
        rows = []
        head, hidden = {"embed": _sds((V, D))}, _sds((B, T, D))
        variants = student_variants(B, T, V, D, K, args.chunks)
        for name, (fn, batch) in tqdm(variants.items(), desc=f"B={B} student", leave=False):
            a, t, o, peak = analyse(fn, head, hidden, batch)
            ms = time_it(fn, head, hidden, batch) if args.time and B == 1 else None
            rows.append((name, a, t, o, peak, peak - 2 * head_bytes, ms))
        print(f"\n## B={B}: student loss + gradient (w.r.t. the [V,D] head and hidden [B,T,D])\n")
        hdr = "| variant | args MB | temp MB | out MB | peak MB | peak ratio | loss-side MB | loss-side ratio |"
        hdr += " ms (CPU) |" if args.time and B == 1 else ""
        print(hdr)
        print("|" + "---|" * (hdr.count("|") - 1))
        base_peak, base_side = rows[0][4], rows[0][5]
        for name, a, t, o, peak, side, ms in rows:
            line = (f"| {name} | {a / MB:.1f} | {t / MB:.1f} | {o / MB:.1f} | {peak / MB:.1f} | "
                    f"{base_peak / peak:.2f}x | {side / MB:.1f} | {base_side / side:.1f}x |")
            if args.time and B == 1:
                line += f" {ms:.0f} |"
            print(line)
        print(f"\n## B={B}: teacher scoring (forward only, top-K ids + log-probs out)\n")
        print("| variant | args MB | temp MB | out MB | peak MB | ratio |")
        print("|---|---|---|---|---|---|")
        trows = [(name, *analyse(fn, head, hidden, *extra)) for name, (fn, extra) in
                 teacher_variants(B, T, V, D, K, args.chunks[len(args.chunks) // 2]).items()]
        for name, a, t, o, peak in trows:
            print(f"| {name} | {a / MB:.1f} | {t / MB:.1f} | {o / MB:.1f} | {peak / MB:.1f} | "
                  f"{trows[0][4] / peak:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
