"""Where every array of a step lives: the student's parameters by the TRAIN logical-axis rules (fsdp x tensor),
its optimizer moments in their parameter's layout, each teacher by its `placement`, the rollout copy by the SAMPLE
rules (tensor only, layers unstacked: decoding does no per-token FSDP gather), every batch array with its
leading dimension over data x fsdp, the KV cache. Computed once per run (`step_shardings`); the same shardings
place the initial state, describe the state a checkpoint is restored into, and constrain the step."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.opd.resolve import rollouts_per_prompt
from jopd.opd.rewards import RLTrainState
from jopd.opd.staleness import with_policies
from jopd.opd.train_state import TrainState, opt_state_shardings
from jopd import parallel as meshlib

if TYPE_CHECKING:  # the run's config is the layer above the step (jopd.run): annotations only
    from jopd.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class StepShardings:
    student: Any  # trainer layout of the student params
    teacher: tuple[Any, ...]  # each teacher's params (held all run long; each by its `placement`)
    sampler_params: Any  # rollout layout of the student, layers unstacked (what the weight sync returns)
    state: TrainState  # the train state's, from eval_shape of the initial state
    batch: NamedSharding  # leading dim over data x fsdp; its rank-1 spec fits every batch leaf of rank >= 1
    cache: NamedSharding  # every per-layer [B, K, S, Dh] KV-cache buffer


def step_shardings(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...], mesh,
                   optimizer: optax.GradientTransformation, running_baseline: bool = False) -> StepShardings:
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
    if running_baseline:
        state = RLTrainState(**vars(state), reward_ema=replicated)
    if cfg.rollout.staleness:  # the window of past params (`opd.staleness`), each in the trainer layout
        state = with_policies(state, (student,) * cfg.rollout.staleness)
    # A clear error at build time: the rollouts (prompts x their G samples) are split over the batch shards.
    meshlib.batch_sharding(mesh, sample_rules, (cfg.data.batch_size * rollouts_per_prompt(cfg),),
                           where="data.batch_size")
    teacher = tuple(teacher_shardings(c, mesh, train_rules, src.placement)
                    for c, src in zip(t_cfgs, cfg.teacher_sources()))
    return StepShardings(
        student=student, teacher=teacher, sampler_params=sampler_params,
        state=state, batch=meshlib.batch_sharding(mesh, sample_rules, ndim=1),
        cache=meshlib.logical_to_sharding(meshlib.cache_logical_axes(), mesh, sample_rules)["k"])


def teacher_shardings(t_cfg: ModelConfig, mesh, train_rules: meshlib.AxisRules, placement: str):
    """A teacher's parameter shardings for its `placement`: `fsdp`, the trainer's rules (FSDP x tensor); `replicated`,
    every leaf whole on every device (P()), so its forward never all-gathers a weight."""
    if placement == "replicated":
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), transformer.abstract_params(t_cfg))
    return meshlib.param_shardings(t_cfg, mesh, train_rules)
