"""One OPD step, in one place: `OPDStep.rollout` -> `OPDStep.score` -> `OPDStep.update`.

    step = build_step(cfg, student_cfg, teacher_cfgs, mesh, tokenizer)   # the loss config derived from cfg
    state = step.init_state(student_params, seed)
    rollout = step.rollout(state, prompt_batch, n)       # weight sync + sampler (rollout precision, noise)
    train_batch = step.score(teacher_params, rollout)    # teachers' forward -> the loss fields
    state, metrics = step.update(state, train_batch, teacher_params)   # student forward/backward, Optax

The teachers are a tuple, one entry per teacher (`RunConfig.teacher_sources`: the one `teacher`, or `teachers`),
and so are their configs, params and cross-tokenizer objects; the `Routing` says which scores which rows
(`opd.routing`; one teacher is a routing of one).

Every device stage is jitted once here with explicit shardings (pjit's modern form), computed once per run
(`opd.shardings`); what the step derives from the config (the resolved loss config, the seeds) is
`opd.resolve`, and its arguments are checked by `opd.validate` (the config itself was checked when built). `jopd train`'s loop, `jopd aot` (which lowers the
same jitted stages from abstract inputs), the lab commands and the benchmarks all call this object; none
spells the step out again. What a loss kind needs (teacher logits, advantages, groups of rollouts) comes
from its entry in `losses.kinds.OBJECTIVES`; the stages are files: the sampler (`jopd.sampling`), the scoring
(`opd/scoring.py`), the update (`opd/student_loss.py`, `opd/train_state.py`), the RL kinds' host side
(`opd/rewards.py`).

RL kinds (`OBJECTIVES[kind].uses_rewards`): the rollout stage decodes the responses and computes the task's
rewards and the kind's per-sequence advantages on the host; score adds, with `loss.kl_coef > 0`, the frozen
reference's log-probs of the sampled tokens (the reference = the run's starting student, an argument like the
teacher, on the trainer layout: `place_reference`); `__call__` runs `rl.inner_updates` optimizer updates on
the one scored batch (GRPO), and keeps the REINFORCE running-mean baseline in the train state
(`rewards.RLTrainState`), so it is checkpointed with the params.

Randomness: step n's sampling draws are `row_randomness(rollout_seed(train.seed), global row ids)`, its
weight-noise key `weight_sync_key(state.rng, n)`; both are pure functions of (seed, n), which is what makes a
resumed run bit-identical. With `rollout.staleness` = k > 0 (`opd.staleness`) step n samples with the params
of step n - k, held in the train state's window, synced with step n - k's weight-noise key. `state.step`
counts steps (rollout batches), whatever `rl.inner_updates`; the optimizer counts its updates in its own state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jopd.data.mixture import task_sources
from jopd.losses import LossConfig
from jopd.losses.chunked import head_params
from jopd.losses.compute import needs_reference
from jopd.losses.kinds import OBJECTIVES, Objective
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.opd import packing, partial_rollout, placement, rewards, routing as routinglib, validate
from jopd.opd.cross_teacher import TEACHER_SLACK, CrossBatch, CrossTeacher, align_routed
from jopd.opd.batch import RolloutArrays, TrainBatch, scoring_input, with_sampler_full_logprobs
from jopd.opd.optim import make_optimizer
from jopd.opd.resolve import (resolve_loss_config, rollout_seed, rollouts_per_prompt, student_compute_dtype,
                              teacher_compute_dtype, weight_sync_key)
from jopd.opd.shardings import StepShardings, batch_shards, step_shardings
from jopd.opd.rewards import RLTrainState
from jopd.opd.student_loss import rollout_loss_fn
from jopd.opd.scoring import score_rollout
from jopd.opd import staleness as stale
from jopd.opd.train_state import TrainState, inner_update_metrics, make_train_step, new_train_state
from jopd import parallel as meshlib
from jopd.parallel.distributed import host_local_to_global
from jopd.sampling.config import RowRandomness, SampleOutput, SamplerShardings, row_randomness
from jopd.sampling.precision import prepare_sampler_params
from jopd.sampling.sampler import Sampler

if TYPE_CHECKING:  # the run's config is the layer above the step (jopd.run): annotations only
    from jopd.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One step's sampled batch: its device arrays (`RolloutArrays`, what scoring takes whole) and its host part,
    this process's rows of the prompt batch (index, question, answer, ...; groups repeated)."""

    arrays: RolloutArrays
    host_batch: dict[str, np.ndarray]
    reward_ema: np.float32 | None = None  # running_mean baseline: the EMA after this step's rewards
    decode_iterations: jax.Array | None = None  # the sampler's decode forward passes (`SampleOutput`)
    slots: int = 0  # the sampler's decode slots (rows, for the static engine)
    cross_reasons: tuple[str | None, ...] = ()  # cross-tokenizer: why each local row failed alignment (None: ok)
    partial: Any = None  # rollout.partial: `partial_rollout.PartialInfo` (each token's version, the step's work)

    @property
    def sample(self) -> SampleOutput:
        return self.arrays.sample

    @property
    def prompt_BxP(self) -> jax.Array:
        return self.arrays.prompt_BxP

    @property
    def prompt_mask_BxP(self) -> jax.Array:
        return self.arrays.prompt_mask_BxP

    @property
    def rewards_B(self) -> jax.Array | None:
        return self.arrays.rewards_B

    def block_until_ready(self) -> "Rollout":
        """Wait for the device part (what `jax.block_until_ready(rollout)` calls: the host part is no pytree)."""
        jax.block_until_ready(self.arrays)
        return self

    def useful_fraction(self, lengths_B: np.ndarray) -> float:
        """The share of the sampler's slot-steps that produced a real token (1: no slot idle; the static engine
        spends the longest row's steps on every row)."""
        rows, tokens = len(lengths_B), float(np.sum(lengths_B))
        if self.partial is not None:  # the tokens this step sampled (a carried row's older ones were counted before)
            rows, tokens = self.partial.picks, float(jax.device_get(self.partial.sampled_tokens))
        return tokens / (rows + self.slots * int(jax.device_get(self.decode_iterations)))

    def without_full_logprobs(self) -> "Rollout":
        """The rollout without the sampler's [B, N, V] log-softmax (freed once the update has read it)."""
        sample = self.sample._replace(full_logprobs_BxNxV=None)
        return dataclasses.replace(self, arrays=self.arrays.replace(sample=sample))


@dataclasses.dataclass(frozen=True)
class OPDStep:
    """The jitted stages of one step and the host logic between them (see the module docstring)."""

    cfg: RunConfig
    student_cfg: ModelConfig
    teacher_cfgs: tuple[ModelConfig, ...]  # one per teacher (`RunConfig.teacher_sources`)
    mesh: Any
    loss_cfg: LossConfig
    objective: Objective
    optimizer: optax.GradientTransformation
    shardings: StepShardings
    sampler: Sampler
    tokenizer: Any  # decodes responses for rewards (RL kinds); None is fine for the others
    sync_fn: Any  # jit: (params, key) -> sampler params (rollout precision, weight noise, unstacked layers)
    # jit: (teacher, RolloutArrays[, reference]) -> TrainBatch; the third argument, the reference params
    # (trainer layout), exists iff `uses_reference`
    score_fn: Any
    # jit: (state, TrainBatch[, teacher head]) -> (state, metrics); state donated; the teacher's LM head (its
    # `lm_head` or `embed` leaf, teacher layout) exists iff `uses_teacher_head`
    update_fn: Any
    init_fn: Any  # jit: (params, rng) -> TrainState, laid out as `shardings.state`
    repeat_fn: Any  # jit: (prompt_UxP, mask_UxP) -> each prompt G times, rows r*G .. r*G+G-1 (the scored layout)
    # per teacher, with loss.cross_tokenizer: its `CrossTeacher` when it has another tokenizer (the rollout is
    # aligned to it on the host), None when it scores the student's tokens (always None with it off)
    cross: tuple[CrossTeacher | None, ...]
    routing: routinglib.Routing  # which teacher scores which rows (one teacher: a routing of one)
    # rollout.staleness > 0 (`opd.staleness`): jit params -> a copy of them (trainer layout; enters the window)
    copy_fn: Any = None
    # ... and with train.mismatch=exact, jit (params, prompt, mask, tokens, lengths) -> the trainer's [B, N, V]
    # log-softmax with the rollout's own params (the staleness split's r)
    lagged_fn: Any = None
    # rollout.placement=process: the client of the sampler process (`jopd.run.sampler_process.ProcessSampler`;
    # set by the loop's `build`): `sample(step, policy_step, policy, key, rows)` -> (host `SampleOutput`, iterations)
    remote: Any = None
    # rollout.partial: the train state's carry before step 0 (`partial_rollout.carry_template`)
    carry0: Any = None

    # -- sizes ------------------------------------------------------------------------------------------

    @property
    def rollouts_per_prompt(self) -> int:
        return rollouts_per_prompt(self.cfg)

    @property
    def prefill_group(self) -> int:
        """Samples per prefilled prompt: G when the prompts split evenly over the batch shards (each shard then
        holds whole groups), else 1 (each row prefills its own copy: 4 prompts x 16 samples on 8 shards)."""
        G = self.rollouts_per_prompt
        return G if self.cfg.data.batch_size % self.sampler.shards == 0 else 1

    @property
    def batch_shards(self) -> int:
        """Batch shards of the trainer's layout (scoring, packing, routing); the sampler's are `sampler.shards`
        (the same unless `sampling.mesh` gives the sampler a mesh of its own)."""
        return batch_shards(self.shardings.batch)

    @property
    def local_shards(self) -> int:
        """Trainer batch shards of this process's rows."""
        return max(1, self.batch_shards // jax.process_count())

    @property
    def sampler_mesh(self):
        """The mesh the sampler runs on (`sampling.mesh`; the trainer's `mesh` by default)."""
        return self.shardings.sampler_mesh

    @property
    def devices(self) -> list:
        """Every device the step runs on: the trainer mesh's, after the sampler's own when disaggregated (the order
        `build_step`'s `devices` splits them in: `opd.placement`)."""
        own = list(self.sampler_mesh.devices.flat) if placement.disaggregated(self.cfg) else []
        return own + list(self.mesh.devices.flat)

    @property
    def rollout_rows(self) -> int:
        """Rows of one step's global rollout batch."""
        return self.cfg.data.batch_size * self.rollouts_per_prompt

    @property
    def compute_dtype(self):
        """The dtype of the student's matmuls in the update (`resolve.student_compute_dtype`): what the trainer's
        side of a mismatch measurement computes in."""
        return student_compute_dtype(self.cfg)

    @property
    def staleness(self) -> int:
        """k: step n samples with the params of step n - k (`rollout.staleness`)."""
        return self.cfg.rollout.staleness

    @property
    def uses_reference(self) -> bool:
        """score needs the frozen reference's params (RL kinds with loss.kl_coef > 0)."""
        return needs_reference(self.loss_cfg)

    @property
    def uses_running_baseline(self) -> bool:
        """The train state is an `RLTrainState` (REINFORCE with rl.baseline=running_mean)."""
        return rewards.uses_running_baseline(self.objective, self.cfg.rl)

    @property
    def crosses(self) -> tuple[CrossTeacher, ...]:
        """The run's teachers with another tokenizer (what the rollout is aligned to on the host)."""
        return tuple(c for c in self.cross if c is not None)

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
        window = stale.window_size(self.cfg.rollout)
        shapes = jax.eval_shape(lambda p: _initial_state(p, self.optimizer, jax.random.key(0),
                                                         self.uses_running_baseline, window, self.carry0), params)
        return meshlib.sharded_abstract(shapes, self.shardings.state)

    def place_reference(self, params):
        """A copy of `params` (the starting student) in the trainer layout, as the frozen KL reference: its own
        buffers, never the train state's (which each update donates)."""
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.shardings.student)
        return copy(jax.device_put(params, self.shardings.student))

    def abstract_teacher(self):
        """ShapeDtypeStructs of the teachers' params (a tuple, one per teacher), with their shardings."""
        params = tuple(transformer.abstract_params(c, DTYPES[src.dtype])
                       for c, src in zip(self.teacher_cfgs, self.cfg.teacher_sources()))
        return meshlib.sharded_abstract(params, self.shardings.teacher)

    # -- the step ---------------------------------------------------------------------------------------

    def rollout(self, state: TrainState, batch: dict[str, np.ndarray], step: int, policy=None,
                policy_step: int | None = None) -> Rollout:
        """Weight sync, then the sampler on this process's rows of the prompt batch (Grain's dict): G =
        `rollouts_per_prompt` samples of each prompt (rows r*G .. r*G+G-1), its prefill shared. `policy`: the
        params to sample with (trainer layout; default `state.params`), synced with the weight-noise key of
        `policy_step` (default `step`); the row randomness is always step `step`'s. With a `remote` sampler
        (`rollout.placement=process`) the sync and the sampler run in its process, and its rows come back here."""
        batch = self.host_rows(batch)
        policy, policy_step = (state.params, step) if policy is None else (policy, policy_step)
        key = weight_sync_key(state.rng, policy_step)
        if self.remote is None:
            sample, iterations, prompt, mask = self.sample_rows(self.sync_policy(policy, key), batch, step)
        else:  # the sampler process's rows (host arrays) to the trainer's batch layout, as with `sampling.mesh`
            sample, iterations = self.remote.sample(step, policy_step, policy, key, batch)
            sample = host_local_to_global(sample, self.shardings.batch)
            prompt, mask = host_local_to_global((batch["prompt_tokens"], batch["prompt_mask"].astype(bool)),
                                                self.shardings.batch)
        return self.finish_rollout(state, batch, sample, iterations, prompt, mask)

    def host_rows(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This process's host rows of the prompt batch, one per rollout: each shard's rows teacher by teacher
        (`routing.mode` task), each prompt repeated G times."""
        if self.routing.mode == "task":  # each shard's rows teacher by teacher
            order = routinglib.shard_order(batch["task_id"], self.routing, self.local_shards)
            batch = {k: v[order] for k, v in batch.items()}
        G = self.rollouts_per_prompt
        return rewards.repeat_for_groups(batch, G) if G > 1 else batch  # the host rows, one per rollout

    def sync_policy(self, policy, key: jax.Array):
        """The weight sync: `policy` (fp32, trainer layout) -> the sampler's params (rollout precision, noise of
        `key`); disaggregated, after the policy's transfer to the sampler's devices."""
        if self.shardings.sampler_student is None:
            return self.sync_fn(policy, key)
        # disaggregated: the weight transfer between the device sets, then the sync on the sampler's
        policy = jax.device_put(policy, self.shardings.sampler_student)
        key = jax.device_put(key, NamedSharding(self.sampler_mesh, PartitionSpec()))
        with jax.set_mesh(self.sampler_mesh):
            return self.sync_fn(policy, key)

    def sample_rows(self, sampler_params, batch: dict[str, np.ndarray], step: int,
                    process: tuple[int, int] | None = None):
        """The sampler on the host rows `batch` (`host_rows`: its prompt_tokens / prompt_mask) with step `step`'s
        row randomness -> (the `SampleOutput` in the trainer's batch layout, the decode iterations, the prompts and
        masks in that layout). `process`: (index, count) of the trainer process whose rows these are (default this
        one's; a sampler process serves one trainer process of a multi-process run: its rows' global indices)."""
        shared = self.prefill_group
        local_rows = batch["prompt_tokens"].shape[0]
        index, count = (jax.process_index(), jax.process_count()) if process is None else process
        first = step * local_rows * count + index * local_rows
        rand = row_randomness(rollout_seed(self.cfg.train.seed), first + np.arange(local_rows),
                              self.sampler.sampling.max_new_tokens)
        every = shared  # one prefilled prompt per `shared` consecutive rows
        prompts = (batch["prompt_tokens"][::every], batch["prompt_mask"][::every].astype(bool))
        prompt_UxP, mask_UxP, u, k = host_local_to_global(prompts + tuple(rand), self.shardings.sampler_batch)
        if not self.shardings.own_sampler_layout:
            sample = self.sampler.sample_padded(sampler_params, prompt_UxP, mask_UxP, RowRandomness(u, k),
                                                group=shared)
            iterations, sample = sample.decode_iterations, sample._replace(decode_iterations=None)
            prompt, mask = (prompt_UxP, mask_UxP) if shared == 1 else self.repeat_fn(prompt_UxP, mask_UxP)
        else:
            with jax.set_mesh(self.sampler_mesh):  # the sampler's activation constraints: its own mesh's axes
                sample = self.sampler.sample_padded(sampler_params, prompt_UxP, mask_UxP, RowRandomness(u, k),
                                                    group=shared)
            iterations, sample = sample.decode_iterations, sample._replace(decode_iterations=None)
            # the rows to the trainer's batch layout, where scoring (and the host's reads) expect them: an explicit
            # copy between the two meshes (jit refuses an argument laid out otherwise); the prompts from the host
            # rows (the sampler's unique prompts need not split over the trainer's batch shards)
            sample = jax.device_put(sample, self.shardings.batch)
            prompt, mask = host_local_to_global((batch["prompt_tokens"], batch["prompt_mask"].astype(bool)),
                                                self.shardings.batch)
        return sample, iterations, prompt, mask

    def finish_rollout(self, state: TrainState, batch: dict[str, np.ndarray], sample: SampleOutput, iterations,
                       prompt_BxP: jax.Array, prompt_mask_BxP: jax.Array) -> Rollout:
        """The `Rollout` of a sample in the trainer's batch layout: the per-task ids, rewards and advantages (RL
        kinds), the cross-tokenizer alignment (all on the host rows `batch`)."""
        local_rows = batch["prompt_tokens"].shape[0]
        arrays, ema = RolloutArrays(prompt_BxP=prompt_BxP, prompt_mask_BxP=prompt_mask_BxP, sample=sample), None
        if self.loss_cfg.task_names:  # several tasks: each row's, for the per-task metrics
            arrays = arrays.replace(task_B=host_local_to_global(batch["task_id"].astype(np.int32), self.shardings.batch))
        if self.objective.uses_rewards:
            r, adv, ema = self._rewards(sample, batch, state)
            arrays = arrays.replace(rewards_B=r, advantages_B=adv)
        reasons = ()
        if self.crosses:  # the teachers' own tokenization of each response, aligned on the host
            cross, reasons = self._align(sample, batch)
            arrays = arrays.replace(cross=cross)
        slots = self.sampler.engine(local_rows * jax.process_count(), self.prefill_group)[1]
        return Rollout(arrays, batch, ema, iterations, slots, tuple(reasons))

    def pack_plan(self, rollout: Rollout):
        """The packing of this rollout's sequences (`train.pack`), from their real lengths (read to the host:
        the scoring waits for the sampler anyway), as global arrays: each batch shard packs its own rows."""
        lengths = np.asarray(self.local_rows(rollout.sample.lengths_B))
        prompt_lens = np.asarray(rollout.host_batch["prompt_mask"]).astype(bool).sum(axis=1)
        shards = self.local_shards
        plan = packing.plan_packing(prompt_lens, lengths, rollout.prompt_BxP.shape[1],
                                    self.sampler.sampling.max_new_tokens, shards=shards,
                                    width=self.cfg.train.pack_width, granularity=self.cfg.train.pack_granularity)
        plan = host_local_to_global(plan, self.shardings.batch)
        return plan.replace(compact=plan.compact.replace(shards=self.batch_shards))  # the global shard count

    def score(self, teacher_params, rollout: Rollout, reference_params=None) -> TrainBatch:
        arrays = rollout.arrays
        if self.cfg.train.pack:
            arrays = arrays.replace(plan=self.pack_plan(rollout))
        args = (teacher_params, scoring_input(arrays))
        if self.uses_reference:
            if reference_params is None:
                raise ValueError(f"RunConfig.loss.kl_coef={self.loss_cfg.kl_coef}: OPDStep.score needs the reference "
                                 f"params (the starting student, `place_reference`)")
            args += (reference_params,)
        return with_sampler_full_logprobs(self.score_fn(*args), arrays)

    @property
    def uses_teacher_head(self) -> bool:
        """update needs the teacher's LM head (the full-vocabulary kinds project its hidden states per chunk)."""
        return self.objective.reads_teacher_head

    def update(self, state: TrainState, batch: TrainBatch, teacher_params=None) -> tuple[TrainState, dict]:
        if isinstance(state, (stale.LaggedTrainState, stale.LaggedRLTrainState)):
            # the update takes the state without its window, so the window is no output of it: the next step's
            # rollout (its oldest params) can run while this update does (`opd.placement`); it passes its key
            # through unchanged but donates it, so the state keeps a copy made now (ready at once)
            rng = (jax.device_put(state.rng, state.rng.sharding, may_alias=False) if state.rng.is_fully_addressable
                   else jax.jit(jnp.copy)(state.rng))  # device_put takes only this process's devices
            core, window = stale.split_window(state)
            core, metrics = self.update(core, batch, teacher_params)
            return stale.with_policies(core.replace(rng=rng), window, stale.carry_of(state)), metrics
        if not self.uses_teacher_head:
            return self.update_fn(state, batch)
        if teacher_params is None:
            raise ValueError(f"RunConfig.loss.kind={self.loss_cfg.kind}: OPDStep.update needs the teacher params (its "
                             f"LM head projects the teacher's hidden states chunk by chunk)")
        # the full-vocabulary kinds route to one teacher (`build_step`): its head
        return self.update_fn(state, batch, head_params(teacher_params[self.routing.scorer]))

    def queue_requests(self, state: TrainState, batches, step: int) -> None:
        """The sampler process's requests (`rollout.queue`) of steps `step`, `step` + 1, ... (one per prompt batch
        of `batches`, in step order), each with the window's params of its step (step + j samples with step
        + j - k's, the window's j-th while j < k) and its weight-noise key; those written before are kept."""
        for j, batch in enumerate(batches):
            version = stale.policy_step(step + j, self.staleness)
            self.remote.request(step + j, version, state.policies[j], weight_sync_key(state.rng, version),
                                self.host_rows(batch))

    def __call__(self, state: TrainState, teacher_params, batch: dict[str, np.ndarray], step: int,
                 reference_params=None, ahead=()):
        """rollout -> score -> `rl.inner_updates` updates on the scored batch, dispatched back to back.
        Returns (state, metrics, rollout); metrics as `inner_update_metrics`. With `rollout.staleness` = k > 0
        the rollout samples with the window's oldest params (step n - k's), the staleness split is measured
        (train.mismatch=exact), this step's params enter the window, and `rollout_lag` is logged. `ahead`: the
        prompt batches of the next steps (at most `rollout.queue` - 1 are read): with a sampler process their
        requests are queued now, so it samples them while this step trains."""
        ahead = tuple(ahead)[:self.cfg.rollout.queue - 1]
        if ahead and self.remote is not None:
            self.queue_requests(state, (batch, *ahead), step)
        if not self.staleness:
            rollout = self.rollout(state, batch, step)
            train_batch = self.score(teacher_params, rollout, reference_params)
        elif self.cfg.rollout.partial:  # the window's entry -k samples; a carried row's older tokens: its oldest
            version, window = stale.policy_step(step, self.staleness), state.policies
            (arrays, host, iterations, slots, info), carry = partial_rollout.rollout(
                self, state, batch, step, window[-self.staleness], version)
            rollout = Rollout(arrays, host, None, iterations, slots, (), partial=info)
            train_batch = self.score(teacher_params, rollout, reference_params)
            if self.lagged_fn is not None:
                older = stale.policy_step(step - 1, self.staleness)
                log_r = partial_rollout.lagged_logprobs(self, window, rollout, version, older)
                train_batch = stale.with_lagged_logprobs(train_batch, log_r)
            del window
            state = stale.advance(state, self.copy_fn(state.params)).replace(carry=carry)
        else:
            version, policy = stale.policy_step(step, self.staleness), state.policies[0]
            rollout = self.rollout(state, batch, step, policy, version)
            train_batch = self.score(teacher_params, rollout, reference_params)
            if self.lagged_fn is not None:
                a = rollout.arrays
                log_r = self.lagged_fn(policy, a.prompt_BxP, a.prompt_mask_BxP, a.sample.tokens_BxN, a.sample.lengths_B)
                train_batch = stale.with_lagged_logprobs(train_batch, log_r)
            del policy  # the window's oldest copy: freed once the sampler (and r) are done, not held through the update
            state = stale.advance(state, self.copy_fn(state.params))  # before the update donates them
        history = []
        for i in range(self.cfg.rl.inner_updates):
            if i:  # XLA:CPU can deadlock two queued programs' collectives (8 simulated devices): one at a time
                jax.block_until_ready(state)
            state, metrics = self.update(state, train_batch, teacher_params)
            history.append(metrics)
        if len(history) > 1:  # state.step counts rollout batches (the loop, checkpoints and resume rely on it)
            state = state.replace(step=state.step - (len(history) - 1))
        if rollout.reward_ema is not None:
            state = state.replace(reward_ema=jax.device_put(rollout.reward_ema, self.shardings.state.reward_ema))
        metrics = inner_update_metrics(history)
        if rollout.partial is not None:  # per token: the mean lag and the older version's share
            metrics = dict(metrics, **partial_rollout.metrics(rollout, step, version))
        elif self.staleness:
            metrics = dict(metrics, rollout_lag=np.float32(step - version))
        return state, metrics, rollout

    # -- host helpers -----------------------------------------------------------------------------------

    def local_rows(self, tree):
        """This process's rows of global batch arrays, as numpy."""
        if jax.process_count() == 1:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils
        return multihost_utils.global_array_to_host_local_array(tree, self.mesh, self.shardings.batch.spec)

    def _align(self, sample: SampleOutput, batch: dict[str, np.ndarray]):
        """This process's responses aligned with the tokenization of the teacher that scores each (a teacher with
        another tokenizer aligns its own rows) -> a global `CrossBatch`, and each local row's failure reason (None:
        aligned)."""
        tokens, lengths = (np.asarray(x) for x in self.local_rows((sample.tokens_BxN, sample.lengths_B)))
        P, N = batch["prompt_tokens"].shape[1], tokens.shape[1]
        owner = routinglib.row_teachers(batch["task_id"], self.routing)
        arrays, reasons = align_routed(self.cross, owner, batch["user_turn"], tokens, lengths, P, N + TEACHER_SLACK)
        return CrossBatch(**host_local_to_global(arrays, self.shardings.batch)), reasons

    def _rewards(self, sample: SampleOutput, batch: dict[str, np.ndarray], state: TrainState):
        """The task's rewards of this process's responses -> the kind's per-sequence advantages: (rewards,
        advantages) as global arrays and, for the running-mean baseline, the EMA after this step (from the
        global batch's mean reward; else None)."""
        tokens, lengths = (np.asarray(x) for x in self.local_rows((sample.tokens_BxN, sample.lengths_B)))
        texts = [self.tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(tokens, lengths)]
        sources = task_sources(self.cfg.data)
        reward_B = rewards.correctness_rewards([sources[i].task for i in batch["task_id"]], texts, batch["answer"])
        running, ema = None, None
        if self.uses_running_baseline:
            decay = self.cfg.rl.baseline_decay
            ema_before, steps_before = jax.device_get((state.reward_ema, state.step))
            running = rewards.running_baseline(ema_before, int(steps_before), decay)
        adv = self.objective.advantages(reward_B, self.cfg.rl, running)
        r, a = host_local_to_global((reward_B, adv), self.shardings.batch)
        if self.uses_running_baseline:
            ema = rewards.ema_update(ema_before, float(jax.device_get(jnp.mean(r))), decay)
        return r, a, ema


def _initial_state(params, optimizer: optax.GradientTransformation, rng: jax.Array, running_baseline: bool,
                   window: int = 0, carry=None) -> TrainState:
    state = new_train_state(params, optimizer, rng)
    if running_baseline:
        state = RLTrainState(**vars(state), reward_ema=jnp.zeros((), jnp.float32))
    # the window before step 0: k copies of the initial params (steps 0 .. k-1 sample with them; k + 1 with partial
    # rollouts, and their empty carry)
    return stale.with_policies(state, (params,) * window, carry) if window else state


def build_step(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...], mesh,
               tokenizer=None, cross: tuple[CrossTeacher | None, ...] | None = None, devices=None) -> OPDStep:
    """The step of `cfg`: its loss config is `cfg.loss` resolved against the run (`resolve_loss_config`: masks
    from `tokenizer`, the sampler's temperature) — one config path, so a caller that wants another loss passes
    another `cfg`. `tokenizer` (the student's) also decodes responses for the RL kinds' rewards (None: no
    masks, no rewards). `t_cfgs`: the teachers' configs, one per teacher in `cfg.teacher_sources()` order.
    `cross` (a cross-tokenizer `loss.kind`; `model_sources.cross_teachers`): per teacher, its `CrossTeacher` when
    it has another tokenizer, None when it scores the student's tokens; None: no teacher has another tokenizer.
    `devices`: every device of the run, the sampler's own among them (`rollout.placement=disaggregated`; default:
    the process's, `jopd aot`: a topology's).
    The config's own checks ran when it was built (`validate.check_run`); here only the arguments are checked."""
    loss_cfg = resolve_loss_config(cfg, tokenizer)
    objective = OBJECTIVES[loss_cfg.kind]
    validate.check_cross(cfg, cross)
    cross = (None,) * len(cfg.teacher_sources()) if cross is None else cross
    validate.check_teacher_tuples(cfg, s_cfg, t_cfgs, cross)
    validate.check_routing_replay(cfg, s_cfg)
    validate.check_experts(cfg, s_cfg, t_cfgs)
    # the schedule's horizon in optimizer updates: inner_updates of them per step
    optimizer = make_optimizer(cfg.optim, cfg.train.steps * cfg.rl.inner_updates)
    running = rewards.uses_running_baseline(objective, cfg.rl)
    sh = step_shardings(cfg, s_cfg, t_cfgs, mesh, optimizer, running, placement.sampler_devices(cfg, mesh, devices))
    batch = sh.batch

    # the union support takes the student's top-K ids from the sampler, where its logits already exist
    union = loss_cfg.support == "union" or objective.student_support
    # a mixture-of-experts student's sampler records its routing: the flip metrics, and routing replay
    sampling = dataclasses.replace(cfg.sampling, return_full_logprobs=cfg.train.mismatch == "exact",
                                   return_topk=loss_cfg.top_k if union else 0,
                                   return_routing=bool(s_cfg.sparse_layers))
    sampler = Sampler(s_cfg, sampling, cfg.rollout_precision,
                      shardings=SamplerShardings(params=sh.sampler_params, batch=sh.sampler_batch, cache=sh.cache))
    routing = routinglib.resolve_routing(cfg, rollouts_per_prompt(cfg), batch_shards(batch))
    precision = cfg.rollout_precision
    # disaggregated: the sync runs on the sampler's devices, after the policy's transfer there (`OPDStep.rollout`)
    sync_in = (sh.student, sh.state.rng) if sh.sampler_student is None else \
        (sh.sampler_student, NamedSharding(sh.sampler_mesh, PartitionSpec()))
    sync_fn = jax.jit(lambda p, k: transformer.unstack_layers(prepare_sampler_params(p, precision, k)),
                      in_shardings=sync_in, out_shardings=sh.sampler_params)
    dtype = student_compute_dtype(cfg)  # fp32 master weights and moments (`student.dtype`), matmuls in this dtype
    tables = tuple(None if c is None else c.table for c in cross)
    score = functools.partial(score_rollout, teacher_cfgs=t_cfgs, student_cfg=s_cfg, loss_cfg=loss_cfg,
                              is_logprobs=cfg.train.is_logprobs, dtype=dtype, teacher_dtype=teacher_compute_dtype(cfg),
                              routing=routing, cross_tables=tables, routing_replay=cfg.train.routing_replay)
    # pjit takes no keyword or defaulted arguments with in_shardings: the reference is a third positional one
    # only when the loss reads it
    in_sh = (sh.teacher, batch) + ((sh.student,) if needs_reference(loss_cfg) else ())
    score_fn = jax.jit(score, in_shardings=in_sh, out_shardings=batch)
    loss_fn = rollout_loss_fn(s_cfg, loss_cfg, dtype, remat=cfg.train.remat)
    # with a window of past params (rollout.staleness) the update takes the state without it (`__call__`)
    update_state = stale.split_window(sh.state)[0] if cfg.rollout.staleness else sh.state
    in_sh = (update_state, batch) + ((head_params(sh.teacher[routing.scorer]),) if objective.reads_teacher_head else ())
    update_fn = jax.jit(make_train_step(loss_fn, optimizer, cfg.optim.grad_accum_steps, skip_nonfinite=True),
                        in_shardings=in_sh, out_shardings=(update_state, None), donate_argnums=0)
    G = rollouts_per_prompt(cfg)
    repeat_fn = jax.jit(lambda *xs: tuple(jnp.repeat(x, G, axis=0) for x in xs), in_shardings=batch,
                        out_shardings=batch)
    lag = cfg.rollout.staleness
    carry0 = None
    if cfg.rollout.partial:  # the carried rows: a field of the state, split like the sampler's batch
        carry0 = partial_rollout.carry_template(cfg, sampler, rows=cfg.data.batch_size * G)
        sh = dataclasses.replace(sh, state=stale.with_policies(
            stale.split_window(sh.state)[0], sh.state.policies,
            partial_rollout.carry_shardings(carry0, sh.sampler_batch)))
    window = stale.window_size(cfg.rollout)
    init_fn = jax.jit(lambda p, rng: _initial_state(p, optimizer, rng, running, window, carry0),
                      in_shardings=(sh.student, sh.state.rng), out_shardings=sh.state)
    copy_fn = lagged_fn = None
    if lag:
        copy_fn = jax.jit(lambda p: jax.tree.map(jnp.copy, p), in_shardings=(sh.student,), out_shardings=sh.student)
    if lag and cfg.train.mismatch == "exact":
        lagged = functools.partial(stale.lagged_logprobs, model_cfg=s_cfg, temperature=cfg.sampling.temperature,
                                   chunk=loss_cfg.chunk_size, dtype=dtype)
        lagged_fn = jax.jit(lagged, in_shardings=(sh.student,) + (batch,) * 4, out_shardings=batch)
    step = OPDStep(cfg=cfg, student_cfg=s_cfg, teacher_cfgs=t_cfgs, mesh=mesh, loss_cfg=loss_cfg, objective=objective,
                   optimizer=optimizer, shardings=sh, sampler=sampler, tokenizer=tokenizer, sync_fn=sync_fn,
                   score_fn=score_fn, update_fn=update_fn, init_fn=init_fn, repeat_fn=repeat_fn, cross=cross,
                   routing=routing, copy_fn=copy_fn, lagged_fn=lagged_fn, carry0=carry0)
    if cfg.rollout.partial:
        partial_rollout.check_step(step)
    return step
