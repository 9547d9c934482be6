"""Where every array of a step lives: the student's parameters by the TRAIN logical-axis rules (fsdp x tensor),
its optimizer moments in their parameter's layout, each teacher by its `placement`, the rollout copy by the SAMPLE
rules (tensor only, layers unstacked: decoding does no per-token FSDP gather), every batch array with its
leading dimension over data x fsdp, the KV cache. Computed once per run (`step_shardings`); the same shardings
place the initial state, describe the state a checkpoint is restored into, and constrain the step.

The sampler has a layout of its own (`sampling.mesh`, `sampler_mesh`): another mesh shape over the same devices,
e.g. {data: 4, tensor: 4} beside the trainer's {fsdp: 16}. The rollout weights, the sampler's rows and its KV
cache live there; the rows it returns are moved to the trainer's batch layout before scoring (`OPDStep.rollout`).
Without it the sampler's mesh is the trainer's (the very same shardings). With `rollout.placement=disaggregated`
(`opd.placement`) the sampler's mesh is over devices of its own."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.opd.resolve import rollouts_per_prompt
from jopd.opd.rewards import RLTrainState
from jopd.opd.staleness import window_size, with_policies
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
    cache: NamedSharding  # every per-layer [B, K, S, Dh] KV-cache buffer (the sampler's mesh)
    # the sampler's rows (prompts, randomness, its outputs): `batch` itself when the sampler runs on the trainer's
    # mesh, else the same leading-dim split over the sampler mesh's data x fsdp
    sampler_batch: NamedSharding
    # disaggregated (`opd.placement`): the student's params (stacked, the trainer's dtype) on the sampler's devices,
    # what the weight transfer writes and the sync reads; None when the sampler shares the trainer's devices
    sampler_student: Any = None

    @property
    def sampler_mesh(self) -> Mesh:
        return self.sampler_batch.mesh

    @property
    def own_sampler_layout(self) -> bool:
        """The sampler runs on a mesh of its own (`sampling.mesh`): its rows are moved to `batch` for scoring."""
        return self.sampler_batch is not self.batch


def batch_shards(batch: NamedSharding) -> int:
    """How many blocks a batch sharding splits the rows into (the product of its leading dim's mesh axes)."""
    axes = batch.spec[0] if len(batch.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(batch.mesh.shape[a] for a in axes)


def sampler_mesh(cfg: RunConfig, mesh: Mesh, devices=None) -> Mesh:
    """The sampler's mesh: `sampling.mesh`'s shape over the trainer mesh's devices in the trainer's device order
    (jit wants one device order across a program's arguments and results, and the weight sync reads the trainer's
    layout and writes the sampler's); the trainer's mesh itself when `sampling.mesh` is unset. `devices`: the
    sampler's own devices (`rollout.placement=disaggregated`, `opd.placement`), `{data: -1}` when unset."""
    layout = cfg.sampling.mesh
    if layout is None and devices is None:
        return mesh
    pool = np.asarray(mesh.devices).reshape(-1) if devices is None else np.asarray(list(devices), dtype=object)
    where = "the trainer's mesh has" if devices is None else "rollout.sampler_devices gives the sampler"
    full = sampler_mesh_sizes(layout, pool.size, where)
    # as `make_mesh`: an optional axis (expert) of size 1 is left out, so the rules' programs match the trainer's
    names = tuple(a for a in full if a not in meshlib.OPTIONAL_AXES or full[a] > 1)
    return Mesh(pool.reshape(tuple(full[a] for a in names)), names,
                axis_types=(mesh.axis_types[0],) * len(names))


def sampler_mesh_sizes(layout: meshlib.MeshConfig | None, n: int, where: str) -> dict[str, int]:
    """`layout`'s (`sampling.mesh`; `{data: -1}` when None) axis sizes over `n` devices; one-line errors naming
    `sampling.mesh` and the devices (`where` says whose)."""
    layout = meshlib.MeshConfig() if layout is None else layout
    sizes = layout.sizes()
    fixed = {a: s for a, s in sizes.items() if s != -1}
    for a, s in fixed.items():
        if n % s:
            raise ValueError(f"sampling.mesh.{a}={s}: does not divide the {n} devices {where}")
    known = math.prod(fixed.values())
    if n % known or (-1 not in sizes.values() and known != n):
        axes = " x ".join(f"sampling.mesh.{a}={s}" for a, s in fixed.items() if s != 1)
        raise ValueError(f"{axes or 'sampling.mesh'}: {known} devices, but {where} {n} (the sizes "
                         f"must multiply to the device count; one axis may be -1)")
    return {a: n // known if s == -1 else s for a, s in sizes.items()}


def step_shardings(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...], mesh,
                   optimizer: optax.GradientTransformation, running_baseline: bool = False,
                   sampler_devices=None) -> StepShardings:
    """`sampler_devices`: the sampler's own devices (`rollout.placement=disaggregated`); None: the trainer's."""
    if cfg.rollout.placement == "process" and cfg.rollout.sampler_devices:
        # the sampler's mesh is the worker's own, over its devices (`run.sampler_process`): this side never samples
        cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, mesh=None))
    train_rules = meshlib.rules_for("train", cfg.mesh)
    own = sampler_devices is not None
    layout = cfg.sampling.mesh if cfg.sampling.mesh is not None or not own else \
        meshlib.MeshConfig(on_indivisible=cfg.mesh.on_indivisible)
    smesh = sampler_mesh(cfg, mesh, sampler_devices)
    sample_rules = meshlib.rules_for("sample", cfg.mesh if layout is None else layout)
    student = meshlib.param_shardings(s_cfg, mesh, train_rules)
    # The sampler decodes over per-layer weights: the sync hands them over unstacked, so the sampler program
    # does not copy them (see `transformer.forward`).
    try:
        sampler_params = meshlib.param_shardings(s_cfg, smesh, sample_rules)
    except ValueError as e:  # the SAMPLE rules split the params over `tensor` only
        if layout is None:
            raise
        raise ValueError(f"sampling.mesh.tensor={smesh.shape['tensor']}: {e}") from None
    # disaggregated: the policy's fp32 params are copied into this layout (stacked) before the sync runs there
    sampler_student = sampler_params if own else None
    sampler_params = meshlib.unstacked_layer_shardings(sampler_params, s_cfg.num_layers)
    params = meshlib.sharded_abstract(transformer.abstract_params(s_cfg, DTYPES[cfg.student.dtype]), student)
    replicated = NamedSharding(mesh, P())
    state = TrainState(step=replicated, params=student, opt_state=opt_state_shardings(optimizer, params),
                       rng=replicated)
    if running_baseline:
        state = RLTrainState(**vars(state), reward_ema=replicated)
    if cfg.rollout.staleness:  # the window of past params (`opd.staleness`), each in the trainer layout
        state = with_policies(state, (student,) * window_size(cfg.rollout))
    # A clear error at build time: the rollouts (prompts x their G samples) are split over the batch shards.
    rows = cfg.data.batch_size * rollouts_per_prompt(cfg)
    meshlib.batch_sharding(mesh, meshlib.rules_for("sample", cfg.mesh), (rows,), where="data.batch_size")
    batch = meshlib.batch_sharding(mesh, meshlib.rules_for("sample", cfg.mesh), ndim=1)
    sampler_batch = batch
    if layout is not None:
        meshlib.batch_sharding(smesh, sample_rules, (rows,), where=(
            f"sampling.mesh.data x sampling.mesh.fsdp ({rows} rollouts: data.batch_size {cfg.data.batch_size} x "
            f"{rollouts_per_prompt(cfg)} per prompt)"))
        sampler_batch = meshlib.batch_sharding(smesh, sample_rules, ndim=1)
    teacher = tuple(teacher_shardings(c, mesh, train_rules, src.placement)
                    for c, src in zip(t_cfgs, cfg.teacher_sources()))
    return StepShardings(
        student=student, teacher=teacher, sampler_params=sampler_params,
        state=state, batch=batch,
        cache=cache_sharding(s_cfg, smesh, sample_rules),
        sampler_batch=sampler_batch, sampler_student=sampler_student)


def cache_sharding(s_cfg: ModelConfig, mesh: Mesh, rules: meshlib.AxisRules) -> NamedSharding:
    """Every per-layer [B, K, S, Dh] KV-cache buffer's sharding, the kv heads checked against `tensor` (with
    on_indivisible=replicate a kv-head count `tensor` does not divide is not split; the rows' count varies with the
    engine: a multiple of every batch split stands in for it)."""
    shape = (mesh.size, s_cfg.num_kv_heads, 1, s_cfg.head_dim)
    return meshlib.logical_to_sharding(meshlib.cache_logical_axes(), mesh, rules, {"k": shape, "v": shape})["k"]


def teacher_shardings(t_cfg: ModelConfig, mesh, train_rules: meshlib.AxisRules, placement: str):
    """A teacher's parameter shardings for its `placement`: `fsdp`, the trainer's rules (FSDP x tensor); `replicated`,
    every leaf whole on every device (P()), so its forward never all-gathers a weight."""
    if placement == "replicated":
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), transformer.abstract_params(t_cfg))
    return meshlib.param_shardings(t_cfg, mesh, train_rules)
