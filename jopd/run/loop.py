"""The OPD loop: sample with the student, score with the teacher, update the student; checkpoint, log, eval.

Every stage is a jitted pure function with explicit shardings; the Python loop only moves batches, and reads
step n-1's metrics after dispatching step n so the host never stalls the device. Resume is automatic and
bit-identical: the Grain iterator is checkpointed beside the state, and all randomness of step n is derived
from (seed, n).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import special_token_ids
from jopd.losses.compute import per_task_means
from jopd.run.checkpoint import Checkpointer, PreemptionGuard
from jopd.run.evaluate import compare_table, evaluate_heldout
from jopd.run import device_split, stall
from jopd.run.lookahead import Lookahead
from jopd.run.sampler_process import ProcessSampler
from jopd.run.guards import RunGuard, loggable
from jopd.run.metrics_log import MetricsWriter, plot_curves
from jopd.opd.cross_teacher import misaligned_summary
from jopd.opd import placement, validate
from jopd.run.model_sources import (cross_teachers, get_model, get_teachers, precheck_sources,
                                   run_tokenizer, teacher_tokenizers)
from jopd.run.config import RunConfig, to_yaml
from jopd.opd.step import OPDStep, build_step
from jopd.opd.train_state import TrainState
from jopd.parallel.distributed import maybe_initialize

CURVES = ["loss", "reward", "entropy", "clip_frac", "divergence", "teacher_kl_k1", "topk_mass", "mismatch_kl",
          "response_len", "tokens_per_s"]


@dataclasses.dataclass
class OPDRun:
    """What a run builds once: the step (models' configs, mesh, jitted stages), the teacher, the tokenizer."""

    cfg: RunConfig
    step: OPDStep
    teacher_params: tuple[Any, ...]  # one per teacher (`teacher_sources`), on the trainer's mesh
    tokenizer: Any
    reference_params: Any = None  # RL kinds with loss.kl_coef > 0: the starting student, frozen (trainer layout)


def build(cfg: RunConfig, log=print) -> tuple[OPDRun, TrainState]:
    """Models (loaded, or the testbed's, trained once and cached), mesh and step; the initial train state."""
    # a sampler process on devices of its own: this process keeps the rest, set before its backend starts (`jopd
    # train` did it already; an error if the backend started first)
    device_split.restrict_trainer(cfg)
    maybe_initialize()
    precheck_sources(cfg)  # vocab / template mismatch, missing files: fail before any compute
    # a mesh the devices cannot form fails here, before any model is trained; disaggregated, over the trainer's share
    mesh = placement.trainer_mesh(cfg)
    tokenizer = run_tokenizer(cfg)
    validate.check_tokenizer(cfg, tokenizer)  # where it is first read: before any model is trained
    t_toks = teacher_tokenizers(cfg)  # the student's, unless a cross-tokenizer loss.kind
    # a tuple of each, one per teacher (`teacher_sources`: the one `teacher`, or `teachers` in order)
    t_cfgs, teacher_params, t_from = get_teachers(cfg, t_toks)
    student_cfg, student_params, s_from = get_model("student", cfg.student, cfg, tokenizer)
    cross = cross_teachers(cfg, tokenizer, t_toks, student_cfg, t_cfgs)
    # the testbed models' configs exist now (their vocabulary is their tokenizer's)
    validate.check_models(cfg, student_cfg, t_cfgs, validate.own_tokenizers(cross, len(t_cfgs)))
    sources = cfg.teacher_sources()
    named = [f"{t.name} {where}" for t, where in zip(sources, t_from)] if cfg.teachers else t_from
    log(f"teacher{'s' if cfg.teachers else ''}: {', '.join(named)}  student: {s_from}")
    direct = [t.name for t, c in zip(sources, cross) if c is None]
    if cfg.loss.cross_tokenizer != "off" and direct:  # teachers that score the student's tokens directly
        own = [t.name for t, c in zip(sources, cross) if c is not None]
        log(f"loss.kind={cfg.loss.kind}: with their own tokenizer {', '.join(own) or 'none'}; "
            f"the others score the student's tokens directly")
    idle = [t.name for t in sources if cfg.scoring_routing == "task" and not t.tasks]
    if idle:  # held (e.g. the other routings of a study share the config), but it scores no row
        log(f"warning: routing=task gives teacher(s) {', '.join(idle)} no rows (no `tasks`)")
    step = build_step(cfg, student_cfg, t_cfgs, mesh, tokenizer, cross)
    if placement.in_process_of_its_own(cfg):  # the sampler's worker process, started now (`run.sampler_process`)
        step = dataclasses.replace(step, remote=ProcessSampler(cfg, student_cfg, t_cfgs, log))
    teacher_params = jax.device_put(teacher_params, step.shardings.teacher)
    # the starting student as loaded, also on resume (the restored state replaces only the trained copy)
    reference = step.place_reference(student_params) if step.uses_reference else None
    return OPDRun(cfg, step, teacher_params, tokenizer, reference), step.init_state(student_params)


def run_eval(run: OPDRun, params, name: str, out_dir: Path) -> dict[str, float]:
    """Held-out evaluation of `params` under the study's fixed `train.eval_seed` -> OUT/eval/NAME.{json,csv}."""
    cfg = run.cfg
    eval_sampling = dataclasses.replace(cfg.sampling, max_new_tokens=cfg.train.eval_max_new_tokens,
                                        return_full_logprobs=False)
    params = jax.device_get(params) if jax.process_count() == 1 else params
    teacher = jax.device_get(run.teacher_params) if jax.process_count() == 1 else run.teacher_params
    res = evaluate_heldout(params, teacher, s_cfg=run.step.student_cfg, t_cfgs=run.step.teacher_cfgs,
                           tokenizer=run.tokenizer, data_cfg=cfg.data, sampling=eval_sampling,
                           seed=cfg.train.eval_seed, max_problems=cfg.train.eval_problems, desc=f"eval {name}",
                           crosses=run.step.cross, per_character=run.step.loss_cfg.cross_tokenizer != "off",
                           routing=run.step.routing)
    return res.save(out_dir / "eval", name)


def per_task_rollout(names, task_id_B: np.ndarray, lengths_B: np.ndarray, rewards_B: np.ndarray | None
                     ) -> dict[str, float]:
    """Each task's mean response length (and reward) in a step: `task/<name>/response_len`, `.../reward`."""
    out = {}
    for t, name in enumerate(names):
        rows = np.asarray(task_id_B) == t
        if rows.any():
            out[f"task/{name}/response_len"] = float(lengths_B[rows].mean())
            if rewards_B is not None:
                out[f"task/{name}/reward"] = float(rewards_B[rows].mean())
    return out


# `train.probe_every`'s measurement, built once per run: (run) -> (student params -> metrics logged as probe/*).
# The lab provides it (`jopd train` passes `jopd.lab.probe.training_probe`); the loop only schedules it.
ProbeHook = Callable[[OPDRun], Callable[[Any], dict[str, float]]]


def train(cfg: RunConfig, log=print, probe_hook: ProbeHook | None = None) -> dict[str, Any]:
    if cfg.train.probe_every and probe_hook is None:
        raise ValueError("RunConfig.train.probe_every: needs the probe hook (train(cfg, probe_hook=...); `jopd "
                         "train` passes jopd.lab.probe.training_probe)")
    out_dir = Path(cfg.train.out_dir)
    try:  # an output directory that cannot be written fails now, before any compute
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    except OSError as e:
        raise ValueError(f"RunConfig.train.out_dir: {out_dir}: cannot write ({e.strerror or e})") from None
    run, state = build(cfg, log)
    try:
        return _train_built(cfg, run, state, out_dir, log, probe_hook)
    finally:
        if run.step.remote is not None:  # the sampler process (`rollout.placement=process`) ends with the run
            run.step.remote.close()


def _train_built(cfg: RunConfig, run: OPDRun, state: TrainState, out_dir: Path, log, probe_hook) -> dict[str, Any]:
    opd = run.step
    ckpt_cfg = dataclasses.replace(cfg.checkpoint, dir=cfg.checkpoint.dir or str(out_dir / "checkpoints"))
    ckpt = Checkpointer(ckpt_cfg)
    data_it = train_iterator(cfg.data, run.tokenizer, kind="prompt")
    restored = ckpt.restore_latest(opd.abstract_state(), data_it)
    start = 0
    if restored is not None:
        state, data_it, start = restored.state, restored.iterator, int(restored.step)
        log(f"resumed from {ckpt_cfg.dir} at step {start}")
    is_main = jax.process_index() == 0
    writer = MetricsWriter(str(out_dir), enabled=is_main)
    probe = probe_hook(run) if cfg.train.probe_every else None  # the probed problems are fixed for the run

    def log_probe(step: int, params) -> None:
        writer.write(step, probe(params), prefix="probe/")

    if probe and start == 0:
        log_probe(0, state.params)
    before_path = out_dir / "eval" / "before.json"
    if before_path.exists():
        before = json.loads(before_path.read_text())
    else:
        before = run_eval(run, state.params, "before", out_dir)
    writer.write(start, before, prefix="eval/")

    pending: tuple | None = None
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps, desc="OPD", dynamic_ncols=True,
               disable=not is_main)
    t_last = time.perf_counter()

    rollouts = open(out_dir / "rollouts.jsonl", "a", buffering=1) if is_main else None
    special = set(special_token_ids(run.tokenizer)) - {run.tokenizer.eos_token_id} if run.tokenizer else set()
    run_guard = RunGuard(cfg.train.guard, special, cfg.sampling.max_new_tokens)

    sampler_side = "the sampler's rollout" + (
        f" (on its own devices: {', '.join(str(d.id) for d in opd.sampler_mesh.devices.flat)})"
        if placement.disaggregated(cfg) else "")  # a sampler process is waited for (and named) by its client

    def flush(pending) -> str | None:
        """Log step n-1's metrics (read while step n runs); returns why the run must stop, if it must."""
        step, metrics, t0, rollout = pending
        out, batch, reward = rollout.sample, rollout.host_batch, rollout.rewards_B
        stall.wait_ready(((sampler_side, out), ("the update (teacher scoring and the train step)", metrics)),
                         cfg.train.stall_timeout_s, f"step {step}")
        m = per_task_means({k: float(v) for k, v in jax.device_get(metrics).items()})
        lengths = np.asarray(jax.device_get(out.lengths_B))
        tokens = np.asarray(jax.device_get(out.tokens_BxN))
        if reward is not None:  # RL kinds (their entropy, clip_frac, ratio_mean, kl_ref come from the update)
            r = np.asarray(jax.device_get(reward), np.float64)
            m |= {"reward": float(r.mean()), "reward_std": float(r.std())}
        if rollouts is not None:
            texts = [run.tokenizer.decode(tokens[b, :lengths[b]]) for b in range(min(cfg.train.log_rollouts, len(tokens)))]
            rollouts.write(json.dumps({"step": step, "index": batch["index"].tolist(), "lengths": lengths.tolist(),
                                       "examples": [{"question": str(q), "response": r} for q, r in
                                                    zip(batch["question"], texts)]}) + "\n")
        dt = time.perf_counter() - t0
        m |= {"response_len": float(lengths.mean()), "step_time_s": dt,
              "tokens_per_s": float(lengths.sum()) / max(dt, 1e-9)}
        m["rollout_useful_frac"] = rollout.useful_fraction(lengths)  # of the sampler's slot-steps
        if opd.loss_cfg.task_names:  # several tasks: each one's responses (and rewards)
            m |= per_task_rollout(opd.loss_cfg.task_names, batch["task_id"], lengths,
                                  None if reward is None else np.asarray(jax.device_get(reward)))
        if rollout.cross_reasons:  # a teacher with another tokenizer: rollouts it could not align are counted
            failed = [r for r in rollout.cross_reasons if r is not None]
            m["xtok_misaligned_frac"] = len(failed) / len(rollout.cross_reasons)
            if failed and is_main and step % 25 == 1:
                log(f"step {step}: {len(failed)} of {len(rollout.cross_reasons)} rollouts not aligned with the "
                    f"teacher's tokenization ({misaligned_summary(rollout.cross_reasons)})")
        m |= run_guard.rollout_metrics(tokens, lengths, m.get("num_tokens", 0.0))
        warning, reason = run_guard.check(step, m)  # response_at_cap: also `compare --rl`'s collapse signal
        if warning and is_main:
            log(f"warning: {warning}")
        if step % cfg.train.log_every == 0 or step == cfg.train.steps or reason:
            writer.write(step, loggable(m))
        kl = m.get("teacher_kl_k1", m.get("divergence", float("nan")))  # cross-tokenizer kinds: no k1, their own
        bar.set_postfix(loss=f"{m.get('loss', float('nan')):.4f}", kl=f"{kl:.3f}")
        if reason:
            reason += f" (problems {batch['index'].tolist()})"
        return reason

    step = start
    stopped = None
    # rollout.queue > 1: the next steps' prompt batches, their requests sent to the sampler process early
    lookahead = (Lookahead(train_iterator(cfg.data, run.tokenizer, kind="prompt"), data_it, cfg.rollout.queue - 1)
                 if opd.remote is not None and cfg.rollout.queue > 1 else None)
    with PreemptionGuard() as guard:
        for step in bar:
            batch = next(data_it)
            ahead = lookahead.ahead()[:cfg.train.steps - step - 1] if lookahead else ()
            with jax.set_mesh(opd.mesh):  # activations' batch constraints (transformer.constrain_batch)
                state, metrics, rollout = opd(state, run.teacher_params, batch, step, run.reference_params, ahead)
            # the [B,N,V] sampler log-softmax (mismatch=exact) is freed now, not held through the next rollout
            rollout = rollout.without_full_logprobs()
            if pending is not None:
                stopped = flush(pending)  # previous step's metrics: read while this step runs
                if stopped:
                    pending = None
                    break  # nothing after the bad step is saved
            pending = (step + 1, metrics, t_last, rollout)
            t_last = time.perf_counter()
            done = step + 1
            stop = guard.should_stop(done)
            if ckpt.should_save(done) or stop or done == cfg.train.steps:
                ckpt.save(done, state, data_it, metadata={"step": done}, force=stop or done == cfg.train.steps)
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.steps:
                writer.write(done, run_eval(run, state.params, f"step_{done}", out_dir), prefix="eval/")
            if probe and done % cfg.train.probe_every == 0:
                log_probe(done, state.params)
            if stop:
                log(f"preemption requested: saved step {done}, exiting")
                break
        if pending is not None and not stopped:
            stopped = flush(pending)
    ckpt.wait()
    if rollouts is not None:
        rollouts.close()
    final_step = int(jax.device_get(state.step))
    summary: dict[str, Any] = {"steps": final_step, "before": before}
    if stopped:
        last = ckpt.latest_step()
        summary["stopped"] = (f"{stopped}; last good checkpoint: "
                              f"{f'{ckpt.directory}/{last}' if last is not None else 'none'}")
        log(f"stopped: {summary['stopped']}")
    elif final_step >= cfg.train.steps:
        after = run_eval(run, state.params, "after", out_dir)
        writer.write(final_step, after, prefix="eval/")
        summary["after"] = after
        if is_main:
            log(compare_table(before, after))
    writer.close()
    ckpt.close()
    if is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if (out_dir / "metrics.jsonl").exists():
            try:
                summary["plot"] = plot_curves(str(out_dir / "metrics.jsonl"), str(out_dir / "curves.png"), CURVES,
                                              title=f"OPD ({cfg.loss.kind}) — {out_dir.name}")
            except ValueError:
                pass
    summary["state"] = state
    return summary
