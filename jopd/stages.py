"""The jitted stages of one OPD step and their layouts, built in one place for the trainer and for `jopd aot`.

weight sync (trainer params -> rollout precision + noise, sampling layout), sampler, teacher scoring and the
train step, each jitted once with explicit shardings: TRAIN rules (fsdp x tensor) for the student and the
teacher, SAMPLE rules (tensor only) for the rollout copy, batch over data x fsdp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd import mesh as meshlib
from jopd.config import MODEL_DTYPES, RunConfig
from jopd.losses import LossConfig
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.objectives import rollout_loss_fn
from jopd.optim import make_optimizer
from jopd.precision import prepare_sampler_params
from jopd.sampler import Sampler, SamplerShardings
from jopd.train_step import TrainState, make_train_step, opt_state_shardings

FULL_TEACHER_KINDS = ("rkl", "fkl", "jsd")  # losses that need the teacher's full logits


@dataclasses.dataclass(frozen=True)
class Stages:
    loss_cfg: LossConfig
    optimizer: optax.GradientTransformation
    student_shardings: Any  # trainer layout of the student params
    teacher_shardings: Any
    sample_shardings: Any  # rollout layout of the student params, layers unstacked (what `sync` returns)
    state_shardings: TrainState
    batch_sharding: NamedSharding  # leading dim over data x fsdp (rank-1 spec: valid for any rank >= 1)
    cache_sharding: NamedSharding
    sampler: Sampler
    sync: Callable  # (params, key) -> sampler params
    train_step: Callable  # (state, loss batch) -> (state, metrics); state donated
    score_kw: dict  # static kwargs of `rollout.score_with_teacher`


def train_state_shardings(optimizer: optax.GradientTransformation, params_abstract, mesh) -> TrainState:
    """The train state's layout from the params' (ShapeDtypeStructs with shardings): optimizer moments follow
    their param, scalars are replicated."""
    replicated = NamedSharding(mesh, P())
    return TrainState(step=replicated, params=jax.tree.map(lambda x: x.sharding, params_abstract),
                      opt_state=opt_state_shardings(optimizer, params_abstract), rng=replicated)


def build_stages(cfg: RunConfig, s_cfg: ModelConfig, t_cfg: ModelConfig, mesh, loss_cfg: LossConfig) -> Stages:
    train_rules, sample_rules = meshlib.rules_for("train", cfg.mesh), meshlib.rules_for("sample", cfg.mesh)
    student_sh = meshlib.param_shardings(s_cfg, mesh, train_rules)
    teacher_sh = meshlib.param_shardings(t_cfg, mesh, train_rules)
    # The sampler decodes over per-layer weights: the sync hands them over unstacked, so the sampler program
    # does not copy them (see `transformer.forward`).
    sample_sh = meshlib.unstacked_layer_shardings(meshlib.param_shardings(s_cfg, mesh, sample_rules), s_cfg.num_layers)
    dtype = jnp.dtype(MODEL_DTYPES[cfg.student.dtype])
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    state_sh = train_state_shardings(
        optimizer, meshlib.sharded_abstract(transformer.abstract_params(s_cfg, dtype), student_sh), mesh)
    batch_sh = meshlib.batch_sharding(mesh, sample_rules, ndim=1)
    cache_sh = meshlib.logical_to_sharding(meshlib.cache_logical_axes(), mesh, sample_rules)["k"]

    sampling = dataclasses.replace(cfg.sampling, return_full_logprobs=cfg.train.mismatch == "exact")
    sampler = Sampler(s_cfg, sampling, cfg.rollout_precision,
                      shardings=SamplerShardings(params=sample_sh, batch=batch_sh, cache=cache_sh))
    precision = cfg.rollout_precision
    sync = jax.jit(lambda p, k: transformer.unstack_layers(prepare_sampler_params(p, precision, k)),
                   out_shardings=sample_sh)
    step_fn = make_train_step(rollout_loss_fn(s_cfg, loss_cfg, dtype, remat=cfg.train.remat), optimizer,
                              cfg.optim.grad_accum_steps)
    train_step = jax.jit(step_fn, in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0)
    score_kw = dict(teacher_cfg=t_cfg, loss_cfg=loss_cfg, full_teacher_logits=loss_cfg.kind in FULL_TEACHER_KINDS)
    return Stages(loss_cfg, optimizer, student_sh, teacher_sh, sample_sh, state_sh, batch_sh, cache_sh, sampler, sync,
                  train_step, score_kw)
