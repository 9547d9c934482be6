"""Where an OPD step's slots go: per stage, the useful fraction (real tokens processed / token slots executed) and
tokens/s, today's padded step ("before": the static engine, padded scoring and update) beside the one that
wastes nothing ("after": the slot engine, packed scoring and update), in one run, on three workloads:

  testbed  configs/testbed.yaml: its cached (or freshly SFT-made) models, its prompts, EOS on.
  smollm2  configs/smollm2_arith.yaml: the fine-tuned SmolLM2-135M teacher and its 20-layer student (cached by
           `jopd train configs/smollm2_arith.yaml`, or made here), the arithmetic prompts.
  skewed   SmolLM2-135M's architecture with random weights (teacher 30 layers, student `--skewed-student-layers`),
           random prompts of 8-56 tokens, up to 256 new tokens; a stop-token set of 1/48 of the vocabulary makes
           each row stop with probability ~1/48 per token (the near-uniform random model): response lengths
           spread from 1 to 256 with a long tail (geometric, mean ~48). `--skewed-arch CONFIG_JSON` takes another
           architecture (e.g. configs/arch/qwen2.5-0.5b-instruct/config.json: the teacher has all its layers, the
           student the same shape with `--skewed-student-layers`, both random); `--skewed-max-new-tokens` caps N.

`--partial` (or `--modes after,partial`) adds a third mode, "partial": "after" with partial rollouts (rollout.partial,
rollout.staleness=1; rows left when the batch is full carry into the next step, `jopd.sampling.partial`); its
rollout fraction is the tokens it sampled in the step over its picks (rows + slots) and slots x decode passes, the
carried rows' re-prefill reported apart (real tokens, and the positions it ran: slots x (P + its response columns,
the longest carried response's power-of-two bucket, N/4 .. N) per step).

Useful fractions: rollout = response tokens / slot-steps (rows + slots x decode passes: every row's first token
comes from the prefill); forward = real prompt + response tokens / the rows x columns the teacher's and the
student's forwards run (padded: B x (P + N); packed: the packed rows); head = response tokens / the positions
the LM head, the teacher's top-K and the loss's per-position terms run on (padded: B x N; packed: the compact
rows). Stage times are medians of `--steps` blocked steps after `--warmup` (packed shapes compile per row
bucket), the two modes' steps interleaved so that the shared machine's drift hits both; the full step is the median of
`--steps` whole steps (rollout, scoring, update dispatched as the loop does, blocked at the end of each) that
compiled nothing.

    PYTHONPATH=. python benchmarks/step_waste.py [--workloads testbed,smollm2,skewed] [--slots auto]
Writes step_waste.json / .png under --out (default benchmarks/results/; `--tag T`: step_waste_T.json / .png).
Runs on CPU unless JAX_PLATFORMS is set (e.g. JAX_PLATFORMS=cuda on a GPU machine: the environment wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jopd.data.pipeline import train_iterator  # noqa: E402
from jopd.models import transformer  # noqa: E402
from jopd.models.config import ModelConfig  # noqa: E402
from jopd.models.hf_io import read_hf_config  # noqa: E402
from jopd.run import loop  # noqa: E402
from jopd.run.config import load_config  # noqa: E402
from jopd.opd import partial_rollout, staleness as stale  # noqa: E402
from jopd.opd.step import Rollout, build_step  # noqa: E402
from jopd.parallel import mesh as meshlib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "score", "update")
MODES = {"before": ["sampling.slots=0", "train.pack=false"], "after": ["train.pack=true"],
         # `--partial`: "after" with partial rollouts (rows carried across steps; staleness 1, which they need)
         "partial": ["train.pack=true", "rollout.staleness=1", "rollout.partial=true"]}


@dataclasses.dataclass
class Workload:
    name: str
    run: loop.OPDRun
    state: object
    batches: object  # iterator of prompt batches


PACK_WIDTH_FACTOR = 2  # packed rows of 2 x (P + N) columns by default (`--pack-width-factor`)
PACK_GRANULARITY: int | None = None  # `--pack-granularity` (None: train.pack_granularity's default)


def _mode_overrides(mode: str, slots: int, width: int) -> list[str]:
    after = [f"sampling.slots={slots}", f"train.pack_width={width}"]
    if PACK_GRANULARITY is not None:
        after.append(f"train.pack_granularity={PACK_GRANULARITY}")
    return MODES[mode] + (after if mode != "before" else [])


def testbed(mode: str, slots: int, cache: str | None) -> Workload:
    over = _mode_overrides(mode, slots, PACK_WIDTH_FACTOR * (64 + 32)) + ([f"train.cache_dir={cache}"] if cache else [])
    cfg = load_config(str(REPO / "configs/testbed.yaml"), over + ["mesh.data=1"])
    run, state = loop.build(cfg, log=lambda m: None)
    return Workload("testbed", run, state, train_iterator(cfg.data, run.tokenizer, kind="prompt"))


def smollm2(mode: str, slots: int, cache: str | None, untuned: bool = False) -> Workload:
    over = _mode_overrides(mode, slots, PACK_WIDTH_FACTOR * (56 + 28)) + ([f"train.cache_dir={cache}"] if cache else [])
    if untuned:  # SmolLM2-135M-Instruct as shipped (no fine-tunes to make): its answers run longer
        over += ["teacher.warm_start.steps=0", "student.warm_start.steps=0"]
    cfg = load_config(str(REPO / "configs/smollm2_arith.yaml"), over + ["mesh.data=1"])
    run, state = loop.build(cfg, log=lambda m: None)
    return Workload("smollm2", run, state, train_iterator(cfg.data, run.tokenizer, kind="prompt"))


SKEWED_ARCH = "configs/arch/smollm2-135m-instruct/config.json"


def skewed_arch(path: str):
    """The architecture of `--skewed-arch`: an HF config.json, or a directory holding one (relative to the repo
    when not found as given)."""
    p = Path(path)
    if not p.exists() and (REPO / p).exists():
        p = REPO / p
    if p.is_dir():
        return read_hf_config(p)
    return ModelConfig.from_hf_dict(json.loads(p.read_text()), source=str(p))


def skewed(mode: str, slots: int, student_layers: int, batch: int, arch_path: str = SKEWED_ARCH,
           max_new_tokens: int = 256) -> Workload:
    arch = skewed_arch(arch_path)
    if not 1 <= student_layers <= arch.num_layers:
        raise ValueError(f"--skewed-student-layers={student_layers}: must be 1..{arch.num_layers} "
                         f"(the teacher's layers in {arch_path})")
    t_cfg = dataclasses.replace(arch, eos_token_id=None)
    s_cfg = dataclasses.replace(t_cfg, num_layers=student_layers)
    V, P, N = t_cfg.vocab_size, 56, max_new_tokens
    stop = list(range(V - V // 48, V))  # ~1/48 of a near-uniform distribution: a stop per ~48 tokens
    cfg = load_config(None, _mode_overrides(mode, slots, PACK_WIDTH_FACTOR * (P + N)) + [
        f"data.batch_size={batch}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
        "sampling.top_p=0.95", f"sampling.stop_token_ids={stop}", "train.mismatch=estimators", "mesh.data=1",
        "loss.kind=topk_rkl_tail", "loss.top_k=32", "optim.warmup_steps=0"])
    step = build_step(cfg, s_cfg, (t_cfg,), meshlib.make_mesh(cfg.mesh, jax.devices()[:1]))
    teacher = jax.device_put((transformer.init_params(t_cfg, jax.random.key(1)),), step.shardings.teacher)
    run = loop.OPDRun(cfg, step, teacher, tokenizer=None)
    state = step.init_state(transformer.init_params(s_cfg, jax.random.key(0)))

    def prompts():
        rng = np.random.default_rng(0)
        while True:
            n = rng.integers(8, P + 1, batch)
            mask = (np.arange(P)[None] >= (P - n)[:, None]).astype(np.int32)
            yield {"prompt_tokens": np.where(mask, rng.integers(100, V - V // 48, (batch, P)), 0).astype(np.int32),
                   "prompt_mask": mask}

    return Workload("skewed", run, state, prompts())


def _blocked(fn, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t


def fractions(run, rollout, train_batch) -> dict:
    lengths = np.asarray(jax.device_get(rollout.sample.lengths_B))
    partial = {}
    if rollout.partial is not None:  # this step's own sampling work (a carried row's older tokens counted before)
        info = rollout.partial
        partial = {"sampled_tokens": int(jax.device_get(info.sampled_tokens)), "picks": info.picks,
                   "slot_steps": info.picks + rollout.slots * int(jax.device_get(rollout.decode_iterations)),
                   "reprefill_tokens": int(jax.device_get(info.reprefill_tokens)),
                   "reprefill_positions": info.reprefill_positions}
    prompt_lens = np.asarray(rollout.host_batch["prompt_mask"]).astype(bool).sum(1)
    B, P, N = len(lengths), rollout.prompt_BxP.shape[1], run.step.sampler.sampling.max_new_tokens
    real = float(prompt_lens.sum() + lengths.sum())
    if train_batch.plan is None:
        fwd_slots, head_slots = B * (P + N), B * N
    else:
        fwd_slots = float(np.prod(train_batch.tokens_BxS.shape))
        head_slots = float(np.prod(train_batch.plan.compact.shape))
    return {"rollout": rollout.useful_fraction(lengths), "forward": real / fwd_slots,
            "head": float(lengths.sum()) / head_slots, "response_tokens": int(lengths.sum()),
            "lengths": lengths.tolist()} | partial


def _compiled_shapes(st) -> int:
    """Programs the step's jitted stages hold: it grows when a step meets a shape (a packed row bucket) anew."""
    fns = [st.score_fn, st.update_fn] + list(st.sampler._programs.values())  # the partial program among them
    return sum(f._cache_size() for f in fns)


def _partial_rollout(st, state, batch, i):
    """`OPDStep.__call__`'s partial rollout, blocked on its own: (the rollout, the state with the window and the
    carry moved on, as the step leaves them for its update)."""
    version, window = stale.policy_step(i, st.staleness), state.policies
    (arrays, host, iters, slots, info), carry = partial_rollout.rollout(st, state, batch, i, window[-st.staleness],
                                                                       version)
    state = stale.advance(state, st.copy_fn(state.params)).replace(carry=carry)
    return Rollout(arrays, host, None, iters, slots, (), partial=info), state


def _timed_step(w: Workload, state, i: int):
    st = w.run.step
    batch = next(w.batches)
    before = _compiled_shapes(st)
    with jax.set_mesh(st.mesh):
        if st.cfg.rollout.partial:
            (rollout, state), t_r = _blocked(_partial_rollout, st, state, batch, i)
        else:
            rollout, t_r = _blocked(st.rollout, state, batch, i)
        tb, t_s = _blocked(st.score, w.run.teacher_params, rollout)
        (state, _), t_u = _blocked(st.update, state, tb, w.run.teacher_params)
    return state, (t_r, t_s, t_u), fractions(w.run, rollout, tb) | {"compiled": _compiled_shapes(st) > before}


def measure(workloads: dict[str, Workload], steps: int, warmup: int) -> dict:
    """Blocked stages, the modes' steps interleaved (this shared machine's drift hits both alike); a step that
    compiled a program (a new packed shape) is left out of the stage medians and counted; then the full step of
    each mode, dispatched as the loop runs it (steps that compiled left out too)."""
    states = {m: w.state for m, w in workloads.items()}
    times = {m: {k: [] for k in STAGES} for m in workloads}
    fracs = {m: [] for m in workloads}
    for i in range(warmup + steps):
        for m, w in workloads.items():
            states[m], t, f = _timed_step(w, states[m], i)
            if i >= warmup:
                for k, v in zip(STAGES, t):
                    times[m][k].append(v)
                fracs[m].append(f)
    out = {}
    for m, w in workloads.items():
        st, state = w.run.step, states[m]
        tokens = float(np.mean([f["response_tokens"] for f in fracs[m]]))
        # full steps, each blocked; one that compiled a program (a packed row count met anew) is left out, up to
        # 3 x `steps` tries
        full, i = [], warmup + steps
        with jax.set_mesh(st.mesh):
            while len(full) < steps and i < warmup + 4 * steps:
                before, t0 = _compiled_shapes(st), time.perf_counter()
                state, metrics, _ = st(state, w.run.teacher_params, next(w.batches), i)
                jax.block_until_ready((state, metrics))
                if _compiled_shapes(st) == before:
                    full.append(time.perf_counter() - t0)
                i += 1
        step_s = float(np.median(full)) if full else float("nan")
        warm = [j for j, f in enumerate(fracs[m]) if not f["compiled"]] or list(range(len(fracs[m])))
        med = {k: float(np.median([v[j] for j in warm])) for k, v in times[m].items()}
        part = [f for f in fracs[m] if "sampled_tokens" in f]
        if part:  # partial rollouts: the sampled tokens over the slot-steps of all measured steps together
            agg = {k: int(sum(f[k] for f in part)) for k in ("sampled_tokens", "slot_steps", "reprefill_tokens",
                                                             "reprefill_positions")}
            out_partial = {"partial": agg | {"rollout_useful_pooled": agg["sampled_tokens"] / agg["slot_steps"],
                                             "decode_slot_steps": agg["slot_steps"]}}
        else:
            out_partial = {}
        out[m] = out_partial | {"stage_s": med, "stage_tokens_per_s": {k: tokens / v for k, v in med.items()},
                  "useful": {k: float(np.mean([f[k] for f in fracs[m]])) for k in ("rollout", "forward", "head")},
                  "step_s": step_s, "step_tokens_per_s": tokens / step_s, "response_tokens_per_step": tokens,
                  "lengths": [f["lengths"] for f in fracs[m]], "slots": st.sampler.engine(st.rollout_rows)[1],
                  "rows": st.rollout_rows, "compiling_steps": sum(f["compiled"] for f in fracs[m]),
                  "programs": _compiled_shapes(st)}
    return out


def print_table(results: dict) -> None:
    head = (f"{'workload':9s} {'mode':7s} {'rows/slots':>10s} {'len mean/max':>12s} {'roll%':>6s} {'fwd%':>6s} "
            f"{'head%':>6s} {'rollout tok/s':>13s} {'score tok/s':>11s} {'update tok/s':>12s} {'step tok/s':>10s}")
    print(head)
    print("-" * len(head))
    for name, modes in results.items():
        for mode, r in modes.items():
            lens = np.concatenate([np.asarray(x) for x in r["lengths"]])
            u, s = r["useful"], r["stage_tokens_per_s"]
            print(f"{name:9s} {mode:7s} {r['rows']:>5d}/{r['slots']:<4d} {lens.mean():6.1f}/{lens.max():<5d} "
                  f"{100 * u['rollout']:6.1f} {100 * u['forward']:6.1f} {100 * u['head']:6.1f} "
                  f"{s['rollout']:13.1f} {s['score']:11.1f} {s['update']:12.1f} {r['step_tokens_per_s']:10.1f}")
        if "partial" in modes:
            p = modes["partial"]["partial"]
            print(f"{name:9s} partial: sampled {p['sampled_tokens']} tokens in {p['slot_steps']} slot-steps "
                  f"({100 * p['rollout_useful_pooled']:.1f}%); re-prefill ran {p['reprefill_tokens']} real tokens of "
                  f"{p['reprefill_positions']} positions")
        if {"before", "after"} <= set(modes):
            b, a = modes["before"], modes["after"]
            ratio = {k: a["stage_tokens_per_s"][k] / b["stage_tokens_per_s"][k] for k in STAGES}
            print(f"{name:9s} {'after/before':>18s} {'':>19s} {'':>20s} {ratio['rollout']:12.2f}x "
                  f"{ratio['score']:10.2f}x {ratio['update']:11.2f}x {a['step_tokens_per_s'] / b['step_tokens_per_s']:9.2f}x")


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not drawn", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    width = 0.12
    for j, (mode, color) in enumerate((("before", "C3"), ("after", "C2"))):
        for k, stage in enumerate(("rollout", "forward", "head")):
            vals = [100 * results[n][mode]["useful"][stage] for n in names if mode in results[n]]
            axes[0].bar(np.arange(len(vals)) + (j * 3 + k - 2.5) * width, vals, width, color=color,
                        alpha=0.4 + 0.2 * k, label=f"{mode} {stage}")
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_ylabel("useful fraction (%)")
    axes[0].axhline(90, color="k", lw=0.5, ls="--")
    axes[0].legend(fontsize=7, ncol=2)
    speed = [results[n]["after"]["step_tokens_per_s"] / results[n]["before"]["step_tokens_per_s"] for n in names
             if {"before", "after"} <= set(results[n])]
    axes[1].bar(range(len(speed)), speed, color="C0")
    axes[1].axhline(1.0, color="k", lw=0.5)
    axes[1].set_xticks(range(len(speed)), names[:len(speed)])
    axes[1].set_ylabel("full-step tokens/s, after / before")
    fig.suptitle("One OPD step: slots spent on real tokens (jopd benchmarks/step_waste.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="testbed,smollm2,skewed")
    ap.add_argument("--slots", default="auto", help="decode slots of 'after' (auto: half the rows)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cache", default=None, help="model cache (default: $JOPD_CACHE or ~/.cache/jopd)")
    ap.add_argument("--pack-width-factor", type=int, default=2,
                    help="'after' packs into rows of this many times P + N columns")
    ap.add_argument("--pack-granularity", type=int, default=None,
                    help="'after': train.pack_granularity (default: its own, an eighth of the rows)")
    ap.add_argument("--smollm2-untuned", action="store_true",
                    help="smollm2: the shipped SmolLM2 weights, no fine-tunes (none to make or cache)")
    ap.add_argument("--skewed-student-layers", type=int, default=12)
    ap.add_argument("--skewed-batch", type=int, default=16)
    ap.add_argument("--skewed-arch", default=SKEWED_ARCH, metavar="CONFIG_JSON",
                    help="skewed: the architecture (HF config.json or its directory) of the random-weight models")
    ap.add_argument("--skewed-max-new-tokens", type=int, default=256, help="skewed: new tokens per row at most")
    ap.add_argument("--partial", action="store_true",
                    help="also measure 'partial': 'after' with partial rollouts (rollout.partial, staleness 1)")
    ap.add_argument("--modes", default=None, help="comma-separated modes to build (default: before,after[,partial])")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results"))
    ap.add_argument("--tag", default="", help="write step_waste_TAG.json / .png (two runs into one --out)")
    args = ap.parse_args()
    global PACK_WIDTH_FACTOR, PACK_GRANULARITY
    PACK_WIDTH_FACTOR, PACK_GRANULARITY = args.pack_width_factor, args.pack_granularity
    builders = {"testbed": (lambda mode, s: testbed(mode, s, args.cache), 32),
                "smollm2": (lambda mode, s: smollm2(mode, s, args.cache, args.smollm2_untuned), 8),
                "skewed": (lambda mode, s: skewed(mode, s, args.skewed_student_layers, args.skewed_batch,
                                                  args.skewed_arch, args.skewed_max_new_tokens), args.skewed_batch)}
    results = {}
    for name in args.workloads.split(","):
        build, rows = builders[name]
        slots = rows // 2 if args.slots == "auto" else int(args.slots)
        print(f"[{name}] building both modes, measuring them step by step ...", file=sys.stderr)
        modes = args.modes.split(",") if args.modes else ["before", "after"] + (["partial"] if args.partial else [])
        results[name] = measure({mode: build(mode, slots) for mode in modes}, args.steps, args.warmup)
        print_table({name: results[name]})
    print()
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "warmup": args.warmup}
    if "skewed" in results:
        meta["skewed"] = {"arch": args.skewed_arch, "student_layers": args.skewed_student_layers,
                          "batch": args.skewed_batch, "max_new_tokens": args.skewed_max_new_tokens}
    stem = "step_waste" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.json'} and {stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
