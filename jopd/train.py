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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jopd import mesh as meshlib
from jopd import rl
from jopd.checkpoint import Checkpointer, PreemptionGuard
from jopd.config import RunConfig, to_yaml
from jopd.data.pipeline import train_iterator
from jopd.data.toy_tokenizer import special_token_ids
from jopd.distributed import host_local_to_global, maybe_initialize
from jopd.evaluate import compare_table, evaluate_heldout
from jopd.losses import LossConfig
from jopd.losses.objectives import PG_KINDS
from jopd.metrics import MetricsWriter, plot_curves
from jopd.models.config import ModelConfig
from jopd.models_setup import check_compatible, get_model, precheck_sources, run_tokenizer
from jopd.rollout import loss_batch, score_with_teacher, sequence_layout
from jopd.sampler import row_randomness
from jopd.stages import Stages, build_stages
from jopd.train_step import TrainState, init_train_state

CURVES = ["loss", "reward", "divergence", "teacher_kl_k1", "topk_mass", "mismatch_kl", "response_len", "tokens_per_s"]


def resolve_loss_config(cfg: RunConfig, tokenizer) -> LossConfig:
    """Fill run-dependent loss fields: special-token mask from the tokenizer (EOS stays trained, so the student
    keeps learning when to stop), and the sampler's temperature (the loss compares distributions at it)."""
    special = cfg.loss.special_token_ids
    if not special and cfg.train.mask_special_tokens and tokenizer is not None:
        eos = {tokenizer.eos_token_id}
        special = tuple(sorted(set(special_token_ids(tokenizer)) - eos))
    return dataclasses.replace(cfg.loss, special_token_ids=special, temperature=cfg.sampling.temperature)


@dataclasses.dataclass
class Engines:
    """Everything built once per run: models, mesh and the jitted stages."""

    cfg: RunConfig
    tokenizer: Any
    student_cfg: ModelConfig
    teacher_cfg: ModelConfig
    teacher_params: Any
    mesh: Any
    stages: Stages

    @property
    def loss_cfg(self) -> LossConfig:
        return self.stages.loss_cfg


def _abstract_with_sharding(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def build(cfg: RunConfig, log=print) -> tuple[Engines, TrainState]:
    maybe_initialize()
    precheck_sources(cfg)  # vocab / template mismatch, missing files: fail before any compute
    tokenizer = run_tokenizer(cfg)
    teacher_cfg, teacher_params, t_from = get_model("teacher", cfg.teacher, cfg, tokenizer)
    student_cfg, student_params, s_from = get_model("student", cfg.student, cfg, tokenizer)
    check_compatible(student_cfg, teacher_cfg, None, None)
    log(f"teacher: {t_from}  student: {s_from}")

    mesh = meshlib.make_mesh(cfg.mesh)
    stages = build_stages(cfg, student_cfg, teacher_cfg, mesh, resolve_loss_config(cfg, tokenizer))
    student_params = jax.device_put(student_params, stages.student_shardings)
    teacher_params = jax.device_put(teacher_params, stages.teacher_shardings)
    state = init_train_state(student_params, stages.optimizer, jax.random.key(cfg.train.seed))
    return Engines(cfg, tokenizer, student_cfg, teacher_cfg, teacher_params, mesh, stages), state


def rollout_and_score(eng: Engines, state: TrainState, batch: dict[str, np.ndarray], step: int):
    """One step's data: sample with the current student, score with the teacher -> the train step's batch."""
    cfg = eng.cfg
    rl_kind = eng.loss_cfg.kind if eng.loss_cfg.kind in PG_KINDS else None
    if rl_kind == "grpo":
        batch = rl.repeat_for_groups(batch, cfg.rl.group_size)
    B = batch["prompt_tokens"].shape[0] * jax.process_count()
    step_key = jax.random.fold_in(state.rng, step)
    sampler_params = eng.stages.sync(state.params, jax.random.fold_in(step_key, 1))
    first = step * B + jax.process_index() * batch["prompt_tokens"].shape[0]
    rand = row_randomness(cfg.train.seed * 1_000_003 + 7, first + np.arange(batch["prompt_tokens"].shape[0]),
                          eng.stages.sampler.sampling.max_new_tokens)
    local = {"prompt": batch["prompt_tokens"], "mask": batch["prompt_mask"].astype(bool), "u": rand.uniforms_BxN,
             "k": rand.noise_key_data_Bx2}
    glob = host_local_to_global(local, eng.stages.batch_sharding)
    out = eng.stages.sampler.sample_padded(sampler_params, glob["prompt"], glob["mask"],
                                    type(rand)(glob["u"], glob["k"]))
    layout = sequence_layout(glob["prompt"], glob["mask"], out.tokens_BxN, out.lengths_B)
    teacher = score_with_teacher(eng.teacher_params, layout, **eng.stages.score_kw)
    is_lp = out.unprocessed_logprobs_BxN if cfg.train.is_logprobs == "unprocessed" else out.logprobs_BxN
    lb = loss_batch(layout, teacher, sampler_logprobs_BxN=is_lp, sampler_full_logprobs_BxNxV=out.full_logprobs_BxNxV)
    if rl_kind is not None:
        lb["advantages"], rewards = _rl_advantages(eng, rl_kind, out, batch)
        lb["reward"] = rewards  # not read by the loss; logged by the loop
    return lb, out


def _rl_advantages(eng: Engines, kind: str, out, batch):
    """Correctness rewards of this process's rows -> per-token advantages [B, N] as a global array."""
    tokens, lengths = (np.asarray(x) for x in _local_rows(eng, (out.tokens_BxN, out.lengths_B)))
    texts = [eng.tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(tokens, lengths)]
    rewards = rl.correctness_rewards(texts, batch["answer"])
    adv = rl.sequence_advantages(kind, rewards, eng.cfg.rl)
    adv_BxN = np.repeat(adv[:, None], tokens.shape[1], axis=1)
    return host_local_to_global({"a": adv_BxN, "r": rewards}, eng.stages.batch_sharding).values()


def _local_rows(eng: Engines, tree):
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.global_array_to_host_local_array(tree, eng.mesh, eng.stages.batch_sharding.spec)


def run_eval(eng: Engines, params, name: str, out_dir: Path) -> dict[str, float]:
    cfg = eng.cfg
    eval_sampling = dataclasses.replace(cfg.sampling, max_new_tokens=cfg.train.eval_max_new_tokens,
                                        return_full_logprobs=False)
    params = jax.device_get(params) if jax.process_count() == 1 else params
    teacher = jax.device_get(eng.teacher_params) if jax.process_count() == 1 else eng.teacher_params
    res = evaluate_heldout(params, teacher, s_cfg=eng.student_cfg, t_cfg=eng.teacher_cfg, tokenizer=eng.tokenizer,
                           data_cfg=cfg.data, sampling=eval_sampling, seed=cfg.train.seed + 99991,
                           max_problems=cfg.train.eval_problems, desc=f"eval {name}")
    return res.save(out_dir / "eval", name)


def train(cfg: RunConfig, log=print) -> dict[str, Any]:
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(to_yaml(cfg))
    eng, state = build(cfg, log)
    ckpt_cfg = dataclasses.replace(cfg.checkpoint, dir=cfg.checkpoint.dir or str(out_dir / "checkpoints"))
    ckpt = Checkpointer(ckpt_cfg)
    data_it = train_iterator(cfg.data, eng.tokenizer, kind="prompt")
    restored = ckpt.restore_latest(_abstract_with_sharding(state), data_it)
    start = 0
    if restored is not None:
        state, data_it, start = restored.state, restored.iterator, int(restored.step)
        log(f"resumed from {ckpt_cfg.dir} at step {start}")
    is_main = jax.process_index() == 0
    writer = MetricsWriter(str(out_dir), enabled=is_main)
    before_path = out_dir / "eval" / "before.json"
    if before_path.exists():
        before = json.loads(before_path.read_text())
    else:
        before = run_eval(eng, state.params, "before", out_dir)
    writer.write(start, before, prefix="eval/")

    pending: tuple | None = None
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps, desc="OPD", dynamic_ncols=True,
               disable=not is_main)
    t_last = time.perf_counter()

    rollouts = open(out_dir / "rollouts.jsonl", "a", buffering=1) if is_main else None

    def flush(pending):
        step, metrics, t0, out, batch, reward = pending
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if reward is not None:
            m["reward"] = float(np.mean(jax.device_get(reward)))
        lengths = np.asarray(jax.device_get(out.lengths_B))
        if rollouts is not None:
            tokens = np.asarray(jax.device_get(out.tokens_BxN))
            texts = [eng.tokenizer.decode(tokens[b, :lengths[b]]) for b in range(min(cfg.train.log_rollouts, len(tokens)))]
            rollouts.write(json.dumps({"step": step, "index": batch["index"].tolist(), "lengths": lengths.tolist(),
                                       "examples": [{"question": str(q), "response": r} for q, r in
                                                    zip(batch["question"], texts)]}) + "\n")
        dt = time.perf_counter() - t0
        m |= {"response_len": float(lengths.mean()), "step_time_s": dt,
              "tokens_per_s": float(lengths.sum()) / max(dt, 1e-9)}
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            writer.write(step, m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", kl=f"{m.get('teacher_kl_k1', float('nan')):.3f}")

    step = start
    with PreemptionGuard() as guard:
        for step in bar:
            batch = next(data_it)
            with jax.set_mesh(eng.mesh):  # activations' batch constraints (transformer.constrain_batch)
                lb, out = rollout_and_score(eng, state, batch, step)
                state, metrics = eng.stages.train_step(state, {k: v for k, v in lb.items() if k != "reward"})
            reward = lb.get("reward")
            del lb  # freed once the step ran, not held through the next rollout ([B,N,V] with mismatch=exact)
            if pending is not None:
                flush(pending)  # previous step's metrics: read while this step runs
            pending = (step + 1, metrics, t_last, out._replace(full_logprobs_BxNxV=None), batch, reward)
            t_last = time.perf_counter()
            done = step + 1
            stop = guard.should_stop(done)
            if ckpt.should_save(done) or stop or done == cfg.train.steps:
                ckpt.save(done, state, data_it, metadata={"step": done}, force=stop or done == cfg.train.steps)
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.steps:
                writer.write(done, run_eval(eng, state.params, f"step_{done}", out_dir), prefix="eval/")
            if stop:
                log(f"preemption requested: saved step {done}, exiting")
                break
        if pending is not None:
            flush(pending)
    ckpt.wait()
    if rollouts is not None:
        rollouts.close()
    final_step = int(jax.device_get(state.step))
    summary: dict[str, Any] = {"steps": final_step, "before": before}
    if final_step >= cfg.train.steps:
        after = run_eval(eng, state.params, "after", out_dir)
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
