"""One OPD step, in one place: `OPDStep.rollout` -> `OPDStep.score` -> `OPDStep.update`.

    step = build_step(cfg, student_cfg, teacher_cfg, mesh, loss_cfg, tokenizer)
    state = step.init_state(student_params, seed)
    rollout = step.rollout(state, prompt_batch, n)       # weight sync + sampler (rollout precision, noise)
    train_batch = step.score(teacher_params, rollout)    # teacher forward -> the loss fields
    state, metrics = step.update(state, train_batch)     # student forward/backward, Optax

Every device stage is jitted once here with explicit shardings (pjit's modern form): TRAIN rules (fsdp x
tensor) for the student, its optimizer state and the teacher; SAMPLE rules (tensor only) for the rollout copy
of the student; the batch over data x fsdp. The shardings are computed once, from `eval_shape` of the initial
state, and the same ones serve init, restore and the step. `jopd train`'s loop, `jopd aot` (which lowers the
same jitted stages from abstract inputs), the lab commands and the benchmarks all call this object; none
spells the step out again. What a loss kind needs (teacher logits, advantages, groups of rollouts) comes
from its entry in `losses.objectives.OBJECTIVES`.

Randomness: step n's sampling draws are `row_randomness(rollout_seed(train.seed), global row ids)`, its
weight-noise key `weight_sync_key(state.rng, n)`; both are pure functions of (seed, n), which is what makes a
resumed run bit-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd import rl
from jopd.losses import LossBatch, LossConfig
from jopd.losses.objectives import OBJECTIVES, Objective
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.opd.batch import SequenceLayout, TrainBatch, sequence_layout
from jopd.opd.optim import make_optimizer
from jopd.opd.run_config import RunConfig
from jopd.opd.student_loss import rollout_loss_fn
from jopd.opd.teacher import teacher_fields
from jopd.opd.train_state import TrainState, make_train_step, new_train_state, opt_state_shardings
from jopd.parallel import mesh as meshlib
from jopd.parallel.distributed import host_local_to_global
from jopd.sampling.precision import prepare_sampler_params
from jopd.sampling.sampler import RowRandomness, SampleOutput, Sampler, SamplerShardings, row_randomness


def rollout_seed(train_seed: int) -> int:
    """Seed of the sampler's per-row draws (`row_randomness`): a function of `train.seed` only, kept apart
    from every other stream that seed feeds (model init, weight noise)."""
    return train_seed * 1_000_003 + 7


def weight_sync_key(rng: jax.Array, step: int | jax.Array) -> jax.Array:
    """Key of step n's weight noise (`rollout_precision.weight_noise`, drawn once per weight sync)."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), 1)


@dataclasses.dataclass(frozen=True)
class StepShardings:
    student: Any  # trainer layout of the student params
    teacher: Any  # the teacher params (train rules: it is held all run long)
    sampler_params: Any  # rollout layout of the student, layers unstacked (what the weight sync returns)
    state: TrainState  # the train state's, from eval_shape of the initial state
    batch: NamedSharding  # leading dim over data x fsdp; its rank-1 spec fits every batch leaf of rank >= 1
    cache: NamedSharding  # every per-layer [B, K, S, Dh] KV-cache buffer


class Rollout(NamedTuple):
    """One step's sampled batch: global device arrays, plus this process's host rows of the prompt batch."""

    prompt_BxP: jax.Array
    prompt_mask_BxP: jax.Array
    sample: SampleOutput  # tokens, lengths, sampler log-probs (and full log-softmax with train.mismatch=exact)
    host_batch: dict[str, np.ndarray]  # this process's rows (index, question, answer, ...), groups repeated
    rewards_B: jax.Array | None = None  # loss kinds with `uses_rewards`: correctness of each response
    advantages_B: jax.Array | None = None  # ... and the per-sequence advantage from those rewards


def resolve_loss_config(cfg: RunConfig, tokenizer) -> LossConfig:
    """Fill run-dependent loss fields: special-token mask from the tokenizer (EOS stays trained, so the student
    keeps learning when to stop), and the sampler's temperature (the loss compares distributions at it)."""
    from jopd.data.toy_tokenizer import special_token_ids

    special = cfg.loss.special_token_ids
    if not special and cfg.train.mask_special_tokens and tokenizer is not None:
        special = tuple(sorted(set(special_token_ids(tokenizer)) - {tokenizer.eos_token_id}))
    return dataclasses.replace(cfg.loss, special_token_ids=special, temperature=cfg.sampling.temperature)


def _score(teacher_params, prompt_BxP, prompt_mask_BxP, sample: SampleOutput, advantages_B, *,
           teacher_cfg: ModelConfig, loss_cfg: LossConfig, is_logprobs: str) -> TrainBatch:
    layout: SequenceLayout = sequence_layout(prompt_BxP, prompt_mask_BxP, sample.tokens_BxN, sample.lengths_B)
    teacher = teacher_fields(teacher_params, layout, teacher_cfg=teacher_cfg, loss_cfg=loss_cfg)
    is_lp = sample.unprocessed_logprobs_BxN if is_logprobs == "unprocessed" else sample.logprobs_BxN
    advantages = None
    if advantages_B is not None:
        advantages = jnp.broadcast_to(advantages_B[:, None], layout.targets_BxN.shape).astype(jnp.float32)
    loss = LossBatch(targets_BxT=layout.targets_BxN, response_mask_BxT=layout.response_mask_BxN,
                     sampler_logprobs_BxT=is_lp, sampler_full_logprobs_BxTxV=sample.full_logprobs_BxNxV,
                     advantages_BxT=advantages, **teacher)
    return TrainBatch(tokens_BxS=layout.tokens_BxS, attn_mask_BxS=layout.attn_mask_BxS, loss=loss)


@dataclasses.dataclass(frozen=True)
class OPDStep:
    """The jitted stages of one step and the host logic between them (see the module docstring)."""

    cfg: RunConfig
    student_cfg: ModelConfig
    teacher_cfg: ModelConfig
    mesh: Any
    loss_cfg: LossConfig
    objective: Objective
    optimizer: optax.GradientTransformation
    shardings: StepShardings
    sampler: Sampler
    tokenizer: Any  # decodes responses for rewards (RL kinds); None is fine for the others
    sync_fn: Any  # jit: (params, key) -> sampler params (rollout precision, weight noise, unstacked layers)
    score_fn: Any  # jit: (teacher, prompt, prompt mask, sample, advantages | None) -> TrainBatch
    update_fn: Any  # jit: (state, TrainBatch) -> (state, metrics); state donated
    init_fn: Any  # jit: (params, rng) -> TrainState, laid out as `shardings.state`

    # -- sizes ------------------------------------------------------------------------------------------

    @property
    def rollouts_per_prompt(self) -> int:
        return self.cfg.rl.group_size if self.objective.grouped else 1

    @property
    def rollout_rows(self) -> int:
        """Rows of one step's global rollout batch."""
        return self.cfg.data.batch_size * self.rollouts_per_prompt

    # -- state ------------------------------------------------------------------------------------------

    def init_state(self, params, seed: int | None = None) -> TrainState:
        """The train state of `params` (placed in the trainer layout), laid out by `shardings.state`."""
        seed = self.cfg.train.seed if seed is None else seed
        params = jax.device_put(params, self.shardings.student)
        return self.init_fn(params, jax.random.key(seed))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with the state's shardings: what restore and `jopd aot` lower against."""
        dtype = DTYPES[self.cfg.student.dtype]
        params = transformer.abstract_params(self.student_cfg, dtype)
        shapes = jax.eval_shape(lambda p: new_train_state(p, self.optimizer, jax.random.key(0)), params)
        return meshlib.sharded_abstract(shapes, self.shardings.state)

    def abstract_teacher(self):
        params = transformer.abstract_params(self.teacher_cfg, DTYPES[self.cfg.teacher.dtype])
        return meshlib.sharded_abstract(params, self.shardings.teacher)

    # -- the step ---------------------------------------------------------------------------------------

    def rollout(self, state: TrainState, batch: dict[str, np.ndarray], step: int) -> Rollout:
        """Weight sync, then the sampler on this process's rows of the prompt batch (Grain's dict)."""
        if self.rollouts_per_prompt > 1:
            batch = rl.repeat_for_groups(batch, self.rollouts_per_prompt)
        local_rows = batch["prompt_tokens"].shape[0]
        sampler_params = self.sync_fn(state.params, weight_sync_key(state.rng, step))
        first = step * local_rows * jax.process_count() + jax.process_index() * local_rows
        rand = row_randomness(rollout_seed(self.cfg.train.seed), first + np.arange(local_rows),
                              self.sampler.sampling.max_new_tokens)
        local = (batch["prompt_tokens"], batch["prompt_mask"].astype(bool), rand.uniforms_BxN, rand.noise_key_data_Bx2)
        prompt, mask, u, k = host_local_to_global(local, self.shardings.batch)
        sample = self.sampler.sample_padded(sampler_params, prompt, mask, RowRandomness(u, k))
        out = Rollout(prompt, mask, sample, batch)
        if self.objective.uses_rewards:
            out = out._replace(**self._rewards(sample, batch))
        return out

    def score(self, teacher_params, rollout: Rollout) -> TrainBatch:
        return self.score_fn(teacher_params, rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample,
                             rollout.advantages_B)

    def update(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.update_fn(state, batch)

    def __call__(self, state: TrainState, teacher_params, batch: dict[str, np.ndarray], step: int):
        """rollout -> score -> update, dispatched back to back. Returns (state, metrics, rollout)."""
        rollout = self.rollout(state, batch, step)
        state, metrics = self.update(state, self.score(teacher_params, rollout))
        return state, metrics, rollout

    # -- host helpers -----------------------------------------------------------------------------------

    def local_rows(self, tree):
        """This process's rows of global batch arrays, as numpy."""
        if jax.process_count() == 1:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils
        return multihost_utils.global_array_to_host_local_array(tree, self.mesh, self.shardings.batch.spec)

    def _rewards(self, sample: SampleOutput, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Correctness of this process's responses -> per-sequence advantages, as global arrays."""
        tokens, lengths = (np.asarray(x) for x in self.local_rows((sample.tokens_BxN, sample.lengths_B)))
        texts = [self.tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(tokens, lengths)]
        rewards = rl.correctness_rewards(texts, batch["answer"])
        adv = rl.sequence_advantages(self.loss_cfg.kind, rewards, self.cfg.rl)
        r, a = host_local_to_global((rewards, adv), self.shardings.batch)
        return {"rewards_B": r, "advantages_B": a}


def step_shardings(cfg: RunConfig, s_cfg: ModelConfig, t_cfg: ModelConfig, mesh,
                   optimizer: optax.GradientTransformation) -> StepShardings:
    train_rules, sample_rules = meshlib.rules_for("train", cfg.mesh), meshlib.rules_for("sample", cfg.mesh)
    student = meshlib.param_shardings(s_cfg, mesh, train_rules)
    # The sampler decodes over per-layer weights: the sync hands them over unstacked, so the sampler program
    # does not copy them (see `transformer.forward`).
    sampler_params = meshlib.unstacked_layer_shardings(meshlib.param_shardings(s_cfg, mesh, sample_rules),
                                                       s_cfg.num_layers)
    params = meshlib.sharded_abstract(transformer.abstract_params(s_cfg, DTYPES[cfg.student.dtype]), student)
    replicated = NamedSharding(mesh, P())
    state = TrainState(step=replicated, params=student, opt_state=opt_state_shardings(optimizer, params),
                       rng=replicated)
    meshlib.batch_sharding(mesh, sample_rules, (cfg.data.batch_size,), where="data.batch_size")  # clear error
    return StepShardings(
        student=student, teacher=meshlib.param_shardings(t_cfg, mesh, train_rules), sampler_params=sampler_params,
        state=state, batch=meshlib.batch_sharding(mesh, sample_rules, ndim=1),
        cache=meshlib.logical_to_sharding(meshlib.cache_logical_axes(), mesh, sample_rules)["k"])


def build_step(cfg: RunConfig, s_cfg: ModelConfig, t_cfg: ModelConfig, mesh, loss_cfg: LossConfig,
               tokenizer=None) -> OPDStep:
    objective = OBJECTIVES[loss_cfg.kind]
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    sh = step_shardings(cfg, s_cfg, t_cfg, mesh, optimizer)
    batch = sh.batch

    sampling = dataclasses.replace(cfg.sampling, return_full_logprobs=cfg.train.mismatch == "exact")
    sampler = Sampler(s_cfg, sampling, cfg.rollout_precision,
                      shardings=SamplerShardings(params=sh.sampler_params, batch=batch, cache=sh.cache))
    precision = cfg.rollout_precision
    sync_fn = jax.jit(lambda p, k: transformer.unstack_layers(prepare_sampler_params(p, precision, k)),
                      in_shardings=(sh.student, sh.state.rng), out_shardings=sh.sampler_params)
    score = lambda tp, prompt, mask, sample, adv: _score(  # noqa: E731
        tp, prompt, mask, sample, adv, teacher_cfg=t_cfg, loss_cfg=loss_cfg, is_logprobs=cfg.train.is_logprobs)
    score_fn = jax.jit(score, in_shardings=(sh.teacher, batch, batch, batch, batch), out_shardings=batch)
    dtype = DTYPES[cfg.student.dtype]
    loss_fn = rollout_loss_fn(s_cfg, loss_cfg, dtype, remat=cfg.train.remat)
    update_fn = jax.jit(make_train_step(loss_fn, optimizer, cfg.optim.grad_accum_steps),
                        in_shardings=(sh.state, batch), out_shardings=(sh.state, None), donate_argnums=0)
    init_fn = jax.jit(lambda p, rng: new_train_state(p, optimizer, rng), in_shardings=(sh.student, sh.state.rng),
                      out_shardings=sh.state)
    return OPDStep(cfg=cfg, student_cfg=s_cfg, teacher_cfg=t_cfg, mesh=mesh, loss_cfg=loss_cfg, objective=objective,
                   optimizer=optimizer, shardings=sh, sampler=sampler, tokenizer=tokenizer, sync_fn=sync_fn,
                   score_fn=score_fn, update_fn=update_fn, init_fn=init_fn)
