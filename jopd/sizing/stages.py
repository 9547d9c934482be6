"""The stages of one OPD step as `jopd aot` lowers them: the very jitted functions of `opd.step.build_step`,
from abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings; no weights read, nothing allocated),
each with the bytes per device of the other stages' buffers alive while it runs, and the compile of one
program (a compiler refusal for lack of memory is reported, not raised)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jopd import parallel as meshlib
from jopd.losses.chunked import head_params
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.batch import RolloutArrays, scoring_input, with_sampler_full_logprobs
from jopd.opd.cross_teacher import cross_batch_shapes
from jopd.opd import staleness as stale
from jopd.opd.staleness import split_window
from jopd.opd.step import OPDStep, build_step
from jopd.run.config import RunConfig
from jopd.sampling.config import RowRandomness


def abstract(tree, shardings):
    return meshlib.sharded_abstract(tree, shardings)


def bytes_per_device(tree) -> int:
    """Per-device bytes of a pytree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        itemsize = x.dtype.itemsize  # also defined for typed PRNG keys (their key data)
        total += math.prod(x.sharding.shard_shape(x.shape)) * itemsize
    return total


def compile_stage(name: str, lowered_fn, options: dict[str, Any] | None = None) -> tuple[Any, float, str | None]:
    t0 = time.perf_counter()
    try:
        lowered = lowered_fn()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    except Exception as e:  # XLA's TPU compiler refuses programs that exceed HBM (RESOURCE_EXHAUSTED)
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "memory" not in msg.lower():
            raise
        lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        return None, time.perf_counter() - t0, " ".join(lines[:2])[:400]
    return compiled, time.perf_counter() - t0, None



@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A step's long-lived buffers and per-step data as sharded abstract arrays: what its stages lower from."""

    state: Any
    teacher: Any
    key: Any  # the weight sync's noise key
    sampler_params: Any
    cache: Any  # the sampler's KV cache: one row per decode slot
    unique: tuple  # the prompts, once each: (tokens [U, P], mask [U, P])
    rand: RowRandomness
    rollout: RolloutArrays  # the scoring's input
    reference: tuple  # (the frozen KL reference's params,) or ()
    batch: Any  # the train step's input
    head: tuple  # (the teacher's LM head,) for the full-vocabulary kinds, or ()
    engine: int  # the sampler's program group (0: the static engine)
    slots: int
    carry: Any = None  # `rollout.partial`: the train state's carry (`sampling.partial.Carry`), the sampler's input
    partial_width: int = 0  # `rollout.partial`: the re-prefill's response columns sized (the largest bucket, N)


def step_inputs(step: OPDStep) -> StepInputs:
    """Every stage's inputs, abstract and sharded as `jopd train` places them; each stage's output shapes from
    `jax.eval_shape` of the stage itself."""
    cfg, sh = step.cfg, step.shardings
    B, Pl, N = step.rollout_rows, cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
    G = step.prefill_group  # B = U prefilled prompts x G samples each
    U = B // G
    meshlib.batch_sharding(step.mesh, meshlib.rules_for("sample", cfg.mesh), (B,), where="data.batch_size")
    engine, slots = step.sampler.engine(B, G)

    state, teacher = step.abstract_state(), step.abstract_teacher()
    key = jax.ShapeDtypeStruct((), state.rng.dtype, sharding=sh.state.rng)
    sampler_params = abstract(jax.eval_shape(step.sync_fn, *sync_inputs(step, state.params, key)), sh.sampler_params)
    cache = kv_cache(step, slots)

    sds = jax.ShapeDtypeStruct
    prompt = sds((B, Pl), jnp.int32, sharding=sh.batch)
    prompt_mask = sds((B, Pl), jnp.bool_, sharding=sh.batch)
    sb = sh.sampler_batch  # the sampler's rows: on its own mesh with `sampling.mesh`
    unique = sds((U, Pl), jnp.int32, sharding=sb), sds((U, Pl), jnp.bool_, sharding=sb)
    rand = RowRandomness(sds((B, N), jnp.float32, sharding=sb), sds((B, 2), jnp.uint32, sharding=sb))
    carry = stale.carry_of(state)
    if carry is not None:  # the partial program's R handed-on rows: the slot engine's shapes, from its own program
        sample = jax.eval_shape(step.sampler.partial_program(N), *partial_args(step, sampler_params, unique, rand,
                                                                              cache, carry)).sample
    else:
        sample = jax.eval_shape(step.sampler.program_for(engine), sampler_params, *unique, rand, cache)
    sample = sample._replace(cache=None, decode_iterations=None)
    sample = abstract(sample, jax.tree.map(lambda _: sh.batch, sample))  # what scoring gets: the trainer's layout
    per_row = sds((B,), jnp.float32, sharding=sh.batch) if step.objective.uses_rewards else None
    task = sds((B,), jnp.int32, sharding=sh.batch) if step.loss_cfg.task_names else None  # several tasks
    cross = None
    if step.crosses:  # the teachers' own token rows and the span arrays (`OPDStep._align`)
        cross = cross_batch_shapes(B, Pl, N)
        cross = abstract(cross, jax.tree.map(lambda _: sh.batch, cross))
    rollout = RolloutArrays(prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, sample=sample, advantages_B=per_row,
                            rewards_B=per_row, task_B=task, cross=cross)
    # the frozen KL reference (loss.kl_coef > 0): the starting student's shapes in the trainer layout
    reference = (state.params,) if step.uses_reference else ()
    batch = with_sampler_full_logprobs(jax.eval_shape(step.score_fn, teacher, scoring_input(rollout), *reference),
                                       rollout)
    batch = abstract(batch, jax.tree.map(lambda _: sh.batch, batch))
    # the full-vocabulary kinds read the scoring teacher's head per chunk
    head = (head_params(teacher[step.routing.scorer]),) if step.uses_teacher_head else ()
    return StepInputs(state=state, teacher=teacher, key=key, sampler_params=sampler_params, cache=cache,
                      unique=unique, rand=rand, rollout=rollout, reference=reference, batch=batch, head=head,
                      engine=engine, slots=slots, carry=carry, partial_width=N if carry is not None else 0)


def partial_args(step: OPDStep, params, unique: tuple, rand: RowRandomness, cache, carry) -> tuple:
    """What `opd.partial_rollout.rollout` passes the partial program (`Sampler.partial_program`): the params, the
    R new rows' prompts, masks, randomness and row ids on the sampler's rows, the kept cache of S slots, the train
    state's carry (its own, replicated layout) and the version, a scalar."""
    rows = unique[0].shape[0]
    row_id = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=step.shardings.sampler_batch)
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(step.sampler_mesh, PartitionSpec()))
    return params, *unique, rand, row_id, cache, carry, version


def sample_lowering(step: OPDStep, ins: StepInputs):
    """A thunk lowering the sample stage's program: with `rollout.partial` the partial program at the worst-case
    re-prefill width (every carried row at the largest bucket, N; `opd.partial_rollout.rollout` picks the width per
    step), with the carry as input; else the engine's program."""
    if ins.carry is not None:
        args = partial_args(step, ins.sampler_params, ins.unique, ins.rand, ins.cache, ins.carry)
        return lambda: step.sampler.partial_program(ins.partial_width).lower(*args)
    program = step.sampler.program_for(ins.engine)
    return lambda: program.lower(ins.sampler_params, *ins.unique, ins.rand, ins.cache)


def sync_inputs(step: OPDStep, params, key) -> tuple:
    """What the weight sync's program takes: the policy and the key in the trainer's layout, or disaggregated
    (`opd.placement`) as the weight transfer leaves them on the sampler's devices (`OPDStep.rollout`)."""
    own = step.shardings.sampler_student
    if own is None:
        return params, key
    on_sampler = NamedSharding(step.sampler_mesh, PartitionSpec())
    return abstract(params, own), jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=on_sampler)


def update_state(step: OPDStep, state):
    """What the train step takes: the state without its window of past params (`rollout.staleness`; the window
    passes the update by, `opd.staleness.split_window`), else the state."""
    return split_window(state)[0] if step.staleness else state


def kv_cache(step: OPDStep, rows: int):
    """The sampler's abstract KV cache of `rows` rows at the full length (prompt + max_new_tokens)."""
    length = step.cfg.data.max_prompt_len + step.cfg.sampling.max_new_tokens
    shapes = jax.eval_shape(lambda: transformer.init_cache(step.student_cfg, rows, length,
                                                           step.cfg.rollout_precision.cache_dtype))
    return abstract(shapes, jax.tree.map(lambda _: step.shardings.cache, shapes))


def stage_programs(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...], mesh):
    """The stages of `opd.step.build_step` (the very jitted functions `jopd train` calls), each with a thunk
    lowering it from abstract inputs, and the bytes per device of other stages' buffers alive while it runs.
    Returns ({stage: (lower, resident)}, {long-lived buffer: bytes per device})."""
    # Special-token masking needs the tokenizer but does not change any shape or memory.
    step = build_step(cfg, s_cfg, t_cfgs, mesh)
    return programs_of(step, step_inputs(step))


def programs_of(step: OPDStep, ins: StepInputs):
    state, teacher, reference = ins.state, ins.teacher, ins.reference
    buffers = {"train_state": bytes_per_device(state), "teacher_params": bytes_per_device(teacher),
               "sampler_params": bytes_per_device(ins.sampler_params), "kv_cache": bytes_per_device(ins.cache),
               "rollout": bytes_per_device(ins.rollout.sample)}
    frozen = ("teacher_params",)  # held all run long
    if step.crosses:
        # the teacher's rows and span arrays (an argument of the scoring, alive from the rollout on) and the
        # projection tables (constants of the scoring program: memory_analysis does not count them, they are held
        # as long as the program is loaded)
        buffers["cross_batch"] = bytes_per_device(ins.rollout.cross)
        buffers["projection_table"] = sum(x.nbytes for c in step.crosses for x in jax.tree.leaves(c.table))
        frozen += ("projection_table",)
    if reference:
        buffers["reference_params"] = bytes_per_device(reference)
        frozen += ("reference_params",)
    held = lambda *names: {k: buffers[k] for k in names}  # noqa: E731
    # the rollout's part that is not the scoring's argument (the sampler's full log-softmax): alive meanwhile
    rollout_not_scored = buffers["rollout"] - bytes_per_device(scoring_input(ins.rollout).sample)
    # rollout.partial: the carry, a field of the train state; the partial program's argument, not the update's
    carry = {}
    if ins.carry is not None:
        buffers["carry"] = bytes_per_device(ins.carry)
        carry = {"carry": buffers["carry"]}
    # the window of past params (`rollout.staleness`): held beside the update, not its argument
    window = {"policy_window": bytes_per_device(split_window(state)[1])} if step.staleness else {}
    sync_in = sync_inputs(step, state.params, ins.key)
    if step.shardings.sampler_student is not None:  # the transferred policy, per sampler device (fp32, stacked)
        buffers["weight_transfer"] = bytes_per_device(sync_in[0])
    # `jopd train`'s loop: the sampler keeps its KV cache between steps; the sampler params and the rollout live
    # until the train step is dispatched; the train state is donated to (and replaced by) the train step.
    programs = {
        "weight_sync": (lambda: step.sync_fn.lower(*sync_in),
                        {"opt_state": buffers["train_state"] - bytes_per_device(state.params)}
                        | held(*frozen, "kv_cache")),
        "sample": (sample_lowering(step, ins),
                   (held("train_state", *frozen) if not carry else  # the carry: an argument, counted there
                    {"train_state_but_carry": buffers["train_state"] - buffers["carry"]} | held(*frozen))),
        "teacher_scoring": (lambda: step.score_fn.lower(teacher, scoring_input(ins.rollout), *reference),
                            held("train_state", "sampler_params", "kv_cache",
                                 *(("projection_table",) if step.crosses else ()))
                            | {"rollout": rollout_not_scored}),
        "train_step": (lambda: step.update_fn.lower(update_state(step, state), ins.batch, *ins.head),
                       held(*frozen, "kv_cache") | window | carry),
    }
    if step.shardings.sampler_student is not None:
        # disaggregated: the sampler's devices hold its params and KV cache only, the trainer's everything else
        programs["weight_sync"] = (programs["weight_sync"][0], held("kv_cache"))
        programs["sample"] = (programs["sample"][0], {})
        programs["teacher_scoring"] = (programs["teacher_scoring"][0],
                                       held("train_state", *(("projection_table",) if step.crosses else ()))
                                       | {"rollout": rollout_not_scored})
        programs["train_step"] = (programs["train_step"][0], held(*frozen) | window)
    return programs, buffers


def sampler_side(step: OPDStep) -> tuple[str, ...]:
    """The stages that run on the sampler's own devices (disaggregated, `opd.placement`); () when colocated."""
    return ("weight_sync", "sample") if step.shardings.sampler_student is not None else ()
