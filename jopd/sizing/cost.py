"""The step on paper for `jopd aot --topology` (`jopd.sizing.roofline`): loop-free cost programs whose XLA cost
analysis, times their runs, is each looped stage's (XLA counts a loop body once), and the prediction built from
them: per stage FLOPs and bytes per device, the roofline time on the chip's peaks, the step time, rollout
tokens/s per chip and MFU."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jopd.models import moe, transformer
from jopd.models.dtypes import DTYPES
from jopd.models.config import ModelConfig
from jopd import parallel as meshlib
from jopd.sizing.report import StageReport
from jopd.sizing.stages import (StepInputs, abstract, bytes_per_device, compile_stage, kv_cache, sampler_side,
                                step_inputs, sync_inputs, update_state)
from jopd.opd.batch import scoring_input
from jopd.opd.resolve import teacher_compute_dtype
from jopd.sizing.compile_pool import CompilePool
from jopd.sizing.attention_cost import (SEEN_BY_XLA, AttentionCost, causal_cost, causal_forward, causal_model_flops,
                                        decode_cost, implementation)
from jopd.sizing.moe_cost import expert_cost
from jopd.sizing.roofline import CHIP_PEAKS, F32_PASSES, Cost, Part, Roofline, StageCost, loop_notes, model_flops
from jopd.run.config import RunConfig
from jopd.losses.chunked import unrolled_chunks
from jopd.losses.compute import loss_chunk
from jopd.opd.step import OPDStep, build_step
from jopd.sampling import decode
from jopd.sampling.engines import engine_of
from jopd.sampling.partial import partial_schedule, reprefill


# ---------------------------------------------------------------------------------------------
# cost programs: loop-free, so that XLA's cost analysis (a loop body counted once) sees all the work


@dataclasses.dataclass(frozen=True)
class CostProgram:
    """A part of a stage run `count` times per step, whose cost is sum(coefficient x cost of program) over
    `terms` (program keys of `Programs.lower`): one program, or a loop body (`derived`: two programs that differ
    only by the body's size)."""

    name: str
    count: int
    terms: tuple[tuple[float, str], ...]
    derived: bool = False


@dataclasses.dataclass
class Programs:
    """The stages' cost programs and the loop-free programs they combine, each lowered (and compiled) once."""

    parts: dict[str, list[CostProgram]]
    lower: dict[str, Callable[[], Any]]
    fallback: dict[str, list[CostProgram]] = dataclasses.field(default_factory=dict)


SAMPLER = "sampler program"  # the memory pass's own sampler program: prefill + one decode step (its loop body once)
ROLLOUT_PROGRAMS = ("prefill", "decode", "re-prefill")  # the sampler's cost programs (`_rollout_programs`)


def cost_programs(step: OPDStep, ins: StepInputs, sampler: bool = False) -> Programs:
    """The programs whose cost, times their runs, is each looped stage's: the rollout as one prefill and one decode
    step (every row at the full cache length; the static engine's worst case: every row decodes max_new_tokens,
    i.e. max_new_tokens - 1 steps after the prefill's token; with `sampler`, the prefill is the sampler program
    already compiled for memory (key `SAMPLER`: XLA counts its decode loop's body once) minus one decode step, so
    it is not compiled again); teacher scoring and the train step with the layers unrolled
    (`transformer.unstack_layers`) and the loss chunks run one after another (`chunked.unrolled_chunks`): one
    program each. The weight sync has no loop: its own program is its cost program.

    `Programs.fallback`, for a stage whose unrolled chunks the compiler refuses (they may hold more than one
    chunk's logits at once): the chunk loop kept, its body counted once there and its other chunks' from one-layer
    steps at chunk sizes c and c' (the body taken as linear in its positions: body(c) = c / (c - c') x
    (P(c) - P(c')))."""
    cfg = step.cfg
    variants = _Variants(step)
    N = cfg.sampling.max_new_tokens
    c = min(cfg.loss.chunk_size, N)
    c2 = c // 2 if c > 1 else 2
    # gradient accumulation: the update costed as one micro-batch, run grad_accum_steps times (`micro_batches`)
    micro = micro_batches(step)
    updates = cfg.rl.inner_updates * micro
    lower: dict[str, Callable[[], Any]] = {}

    def key(kind: str, layers: tuple[int, ...], chunk: int, unrolled: bool = False) -> str:
        split = micro if kind == "update" else 1
        k = f"{kind} layers={','.join(map(str, layers))} chunk={chunk}" + (" unrolled" if unrolled else "") + (
            f" micro=1/{split}" if split > 1 else "")
        if k not in lower:
            lower[k] = variants.lowering(kind, layers, chunk, split, unrolled)
        return k

    full, one, chunk = variants.layers, (1,) * len(variants.layers), cfg.loss.chunk_size
    sample = variants.rollout_counts(ins)
    parts = {
        "sample": [CostProgram(name, count, ((1.0, key(name, full, chunk)),)) for name, count in sample.items()],
        "teacher_scoring": [CostProgram("forward", 1, ((1.0, key("score", full, chunk, unrolled=True)),))],
        "train_step": [CostProgram("update", updates, ((1.0, key("update", full, chunk, unrolled=True)),))],
    }
    if sampler:
        decode = key("decode", full, chunk)
        parts["sample"][0] = CostProgram("prefill", 1, ((1.0, SAMPLER), (-1.0, decode)))
    fallback = {"teacher_scoring": [CostProgram("forward", 1, ((1.0, key("score", full, chunk)),))],
                "train_step": [CostProgram("update", updates, ((1.0, key("update", full, chunk)),))]}
    chunks = -(-N // c)  # the scoring's chunks; the update's run loss_chunk positions each
    update_chunks = -(-N // min(loss_chunk(step.loss_cfg), N))
    scale = c / (c - c2)
    # the update's chunk at loss.chunk_size c runs loss_chunk(c) positions: the difference still gives its body
    for stage, kind, name, count in (("teacher_scoring", "score", "chunk", chunks - 1),
                                     ("train_step", "update", "loss chunk", (update_chunks - 1) * updates)):
        if count > 0:
            fallback[stage].append(CostProgram(name, count, ((scale, key(kind, one, c)),
                                                             (-scale, key(kind, one, c2))), derived=True))
    return Programs(parts, lower, fallback)


class _Variants:
    """The step rebuilt with its models' layers unrolled, some layers only (the chunk bodies) and another loss
    chunk size (one optimizer batch: no gradient accumulation loop), and its cost programs' lowerings, built on
    first use."""

    def __init__(self, step: OPDStep):
        self.step = step
        self.models = (step.student_cfg, *step.teacher_cfgs)
        self.layers = tuple(m.num_layers for m in self.models)
        self._built: dict[tuple, tuple[OPDStep, StepInputs]] = {}

    def at(self, layers: tuple[int, ...], chunk: int, split: int = 1) -> tuple[OPDStep, StepInputs]:
        if (layers, chunk, split) not in self._built:
            step = self.step
            s_cfg, *t_cfgs = (dataclasses.replace(m, num_layers=n) for m, n in zip(self.models, layers))
            flat = build_step(_cost_config(step.cfg, chunk, split), s_cfg, tuple(t_cfgs), step.mesh,
                              cross=step.cross, devices=step.devices)
            self._built[layers, chunk, split] = flat, step_inputs(flat)
        return self._built[layers, chunk, split]

    def rollout_counts(self, ins: StepInputs) -> dict[str, int]:
        return {name: count for name, (count, _) in _rollout_programs(self.step, ins).items()}

    def lowering(self, kind: str, layers: tuple[int, ...], chunk: int, split: int = 1,
                 unrolled: bool = False) -> Callable[[], Any]:
        def lower():
            flat, ins = self.at(layers, chunk, split)  # outside the mesh: building a step runs optax's init eagerly
            # the experts' grouped matmuls are counted analytically (`moe_parts`), not by XLA's cost analysis
            with jax.set_mesh(flat.sampler_mesh if kind in ROLLOUT_PROGRAMS else flat.mesh), \
                    moe.grouped_matmuls_stand_in(), unrolled_chunks() if unrolled else contextlib.nullcontext():
                return self._lower(kind, flat, ins)

        return lower

    @staticmethod
    def _lower(kind: str, flat: OPDStep, ins: StepInputs):
        if kind in ROLLOUT_PROGRAMS:
            return _rollout_programs(flat, ins)[kind][1]()
        if kind == "score":
            score = jax.jit(_unjitted(flat.score_fn), out_shardings=flat.shardings.batch)
            return score.lower(_unstacked(ins.teacher), scoring_input(ins.rollout), *_unstacked(ins.reference))
        state = _unstacked(update_state(flat, ins.state))
        update = jax.jit(_unjitted(flat.update_fn), out_shardings=(_shardings_of(state), None), donate_argnums=0)
        return update.lower(state, ins.batch, *ins.head)


def _cost_config(cfg: RunConfig, chunk_size: int, split: int = 1) -> RunConfig:
    # no gradient-accumulation loop in a cost program: the whole batch, or (`split`) one micro-batch of it
    return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, chunk_size=chunk_size),
                               optim=dataclasses.replace(cfg.optim, grad_accum_steps=1),
                               data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size // split))


def micro_batches(step: OPDStep) -> int:
    """How many programs of one micro-batch the update's cost is (`optim.grad_accum_steps`): the update splits its
    rows into that many micro-batches, each a forward and backward over its rows (the cost of the whole batch in
    one program would need every micro-batch's activations at once, which may not fit a chip). 1 when the prompts
    do not split evenly (then the whole batch is one program, its weights read once: noted)."""
    accum = step.cfg.optim.grad_accum_steps
    prompts = step.cfg.data.batch_size
    if accum <= 1 or prompts % accum or (step.rollout_rows // accum) % step.batch_shards:
        return 1
    return accum


def _unjitted(fn):
    """The Python function a `jax.jit` wraps (jit keeps it as `__wrapped__`), to jit it again with other shardings."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        raise TypeError(f"cost programs: {fn!r} is not a jax.jit-wrapped function")
    return inner


def _shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _unstacked(tree):
    """`tree` with every params dict (one with a stacked `layers` dict: the params, Adam's moments) split into
    per-layer dicts, each leaf keeping its stacked leaf's sharding minus the layers dim: the forward then runs
    its layers as an unrolled loop instead of a `lax.scan`."""
    is_params = lambda x: isinstance(x, dict) and isinstance(x.get("layers"), dict)  # noqa: E731

    def unstack(params):
        if not is_params(params):  # another leaf (an optimizer count, the step, the key)
            return params
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        shardings = meshlib.unstacked_layer_shardings(_shardings_of(params), n)
        return abstract(jax.eval_shape(transformer.unstack_layers, params), shardings)

    return jax.tree.map(unstack, tree, is_leaf=is_params)


def _choice_out(step: OPDStep, c: decode.Choice, cache) -> dict[str, Any]:
    """What the rollout keeps per token of `decode.pick`'s choice (the full log-softmax and top-k ids only when
    returned), and the cache."""
    sampling = step.sampler.sampling
    out = {"tok": c.tok_B, "logp": c.logp_B, "ulogp": c.ulogp_B}
    if sampling.return_full_logprobs:
        out["full"] = c.full_BxV
    if sampling.return_topk:
        out["topk"] = c.topk_BxK
    return out | {"cache": cache}


def _prefill(step: OPDStep, params, prompt_BxP, mask_BxP, u_B, noise_Bx2, cache):
    """The prompts into the KV cache (`decode.prefill`) and token 0 chosen (`decode.pick`)."""
    precision, sampling = step.sampler.precision, step.sampler.sampling
    logits, cache = decode.prefill(params, prompt_BxP, mask_BxP, cache, cfg=step.student_cfg, precision=precision,
                                   max_new_tokens=step.cfg.sampling.max_new_tokens)
    c = decode.pick(logits, u_B, noise_Bx2, jnp.zeros((), jnp.int32), precision=precision, sampling=sampling)
    return _choice_out(step, c, cache)


def _decode(step: OPDStep, params, tok_B, cache, kv_mask_BxS, positions_B, cache_index, u_B, noise_Bx2, t):
    """One decode step (`decode.decode_step`): every row's last token against the whole cache, the next chosen."""
    c, cache = decode.decode_step(params, tok_B, cache, cache_index, positions_B, kv_mask_BxS, u_B, noise_Bx2, t,
                                  cfg=step.student_cfg, precision=step.sampler.precision,
                                  sampling=step.sampler.sampling)
    return _choice_out(step, c, cache)


def _reprefill(step: OPDStep, params, carry, cache):
    """The partial program's re-prefill (`sampling.partial.reprefill`) at its largest width: every carried row's
    prompt + N response columns into its slot, its next token chosen."""
    P, N = step.cfg.data.max_prompt_len, step.cfg.sampling.max_new_tokens
    c, cache = reprefill(params, carry, cache, cfg=step.student_cfg, precision=step.sampler.precision,
                         sampling=step.sampler.sampling, P=P, N=N, width=N)
    return _choice_out(step, c, cache)


def partial_decode_steps(rows: int, slots: int, new_tokens: int) -> int:
    """The partial program's decode passes (`sampling.partial.partial_schedule`, exact) when every row runs to
    `new_tokens`, the worse of the carried rows not started (the priming's) or each holding one token."""
    S, R, N = slots, rows, new_tokens
    return max(partial_schedule([held] * S, [False] * S, [N] * (S + R), S, R).passes for held in (0, 1))


def _rollout_programs(step: OPDStep, ins: StepInputs) -> dict[str, tuple[int, Callable[[], Any]]]:
    """The prefill (U prompts) and the decode step (one row per slot) with the sampler's shardings, each with how
    often it runs: the decode steps the engine runs when every row decodes max_new_tokens (`Engine.decode_steps`).
    With `rollout.partial` (the carry in `ins`), the carried rows' re-prefill too, at the largest width (the worst
    case: every carried row over P + N positions), and the partial program's decode passes."""
    cfg, sh = step.cfg, step.shardings
    rows, S = step.rollout_rows, ins.slots
    U = rows // step.prefill_group
    Pl, N = cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
    sds, b = jax.ShapeDtypeStruct, sh.sampler_batch
    per_row = lambda n, dtype, *tail: sds((n, *tail), dtype, sharding=b)  # noqa: E731
    engine = engine_of(ins.engine)
    # the static engine writes every row at one slot index (a scalar); the slot engine's rows are at their own steps
    scalar = sds((), jnp.int32, sharding=NamedSharding(step.sampler_mesh, PartitionSpec()))
    index = per_row(S, jnp.int32) if engine.per_row else scalar
    prefill_cache = kv_cache(step, U) if engine.per_row else ins.cache
    token_out = {k: b for k in _token_keys(step)}
    prefill = jax.jit(functools.partial(_prefill, step), donate_argnums=5,
                      out_shardings=token_out | {"cache": _shardings_of(prefill_cache)})
    decode = jax.jit(functools.partial(_decode, step), donate_argnums=2,
                     out_shardings=token_out | {"cache": _shardings_of(ins.cache)})
    steps = _decode_steps(step, ins)
    programs = {
        "prefill": (1, lambda: prefill.lower(ins.sampler_params, *ins.unique, per_row(U, jnp.float32),
                                             per_row(U, jnp.uint32, 2), prefill_cache)),
        "decode": (steps, lambda: decode.lower(ins.sampler_params, per_row(S, jnp.int32), ins.cache,
                                               per_row(S, jnp.bool_, Pl + N), per_row(S, jnp.int32), index,
                                               per_row(S, jnp.float32), per_row(S, jnp.uint32, 2), index)),
    }
    if ins.carry is not None:
        again = jax.jit(functools.partial(_reprefill, step), donate_argnums=2,
                        out_shardings=token_out | {"cache": _shardings_of(ins.cache)})
        programs["re-prefill"] = (1, lambda: again.lower(ins.sampler_params, ins.carry, ins.cache))
    return programs


def _decode_steps(step: OPDStep, ins: StepInputs) -> int:
    """The sampler's decode passes when every row decodes max_new_tokens: the engine's, or the partial program's."""
    rows, N = step.rollout_rows, step.cfg.sampling.max_new_tokens
    if ins.carry is not None:
        return partial_decode_steps(rows, ins.slots, N)
    return engine_of(ins.engine).decode_steps(np.full(rows, N), ins.slots, step.sampler.shards)


def _token_keys(step: OPDStep) -> tuple[str, ...]:
    sampling = step.sampler.sampling
    return ("tok", "logp", "ulogp") + (("full",) if sampling.return_full_logprobs else ()) + (
        ("topk",) if sampling.return_topk else ())


# ---------------------------------------------------------------------------------------------
# the prediction


@dataclasses.dataclass
class CostJobs:
    """The cost programs of some stages, queued on a `CompilePool` (`submit_cost_programs`)."""

    programs: Programs
    keys: list[str]  # the queued programs (`Programs.lower`'s keys)
    sampler: bool  # the memory pass's sampler program stands for the prefill (key `SAMPLER`, not queued)


def submit_cost_programs(step: OPDStep, ins: StepInputs, stages: Sequence[str], pool: CompilePool,
                         sampler: bool) -> CostJobs:
    """Lower the cost programs of `stages` (here: tracing needs the mesh) and queue their compiles on `pool`; with
    `sampler`, the memory pass's sampler program is reused for the prefill (`cost_programs`)."""
    programs = cost_programs(step, ins, sampler=sampler)
    keys = [k for k in dict.fromkeys(k for s in stages for p in programs.parts.get(s, ()) for _, k in p.terms)
            if k != SAMPLER]
    for k in keys:
        _queue_cost(step, programs, k, pool)
    return CostJobs(programs, keys, sampler)


def _queue_cost(step: OPDStep, programs: Programs, key: str, pool: CompilePool) -> None:
    """One loop-free program lowered and queued: its job returns (cost, lowering + compile seconds, the
    compiler's refusal)."""
    on_sampler = sampler_side(step)  # disaggregated: the rollout's programs run on the sampler's own devices
    rollout_program = key.split(" ", 1)[0] in ROLLOUT_PROGRAMS
    devices = len((step.sampler_mesh if on_sampler and rollout_program else step.mesh).devices.flat)
    t0 = time.perf_counter()
    lowered = programs.lower[key]()
    text = lowered.as_text()
    lower_s = time.perf_counter() - t0

    def job():
        with jax.set_mesh(step.mesh):
            compiled, secs, error = compile_stage("cost program", lambda: lowered, _cost_options(step.mesh))
        return None if compiled is None else Cost.of(compiled, text, devices), lower_s + secs, error

    pool.add(key, len(text), job)


def predict_step(step: OPDStep, ins: StepInputs, reports: Sequence[StageReport], chip: str, num_devices: int,
                 per_chip: int = 1, progress: bool = False, pool: CompilePool | None = None,
                 jobs: CostJobs | None = None) -> Roofline:
    """Predict the step on `chip` (`roofline.Roofline`) from the cost programs of the reported stages (each
    loop-free program compiled once, whichever parts share it): `jobs` already queued on `pool` (`jopd aot`
    compiles them beside the memory pass), or compiled here. The weight sync's cost is its own (loop-free)
    program's, from `reports`."""
    sampler = next((r.cost for r in reports if r.name == "sample" and r.cost is not None), None)
    with contextlib.ExitStack() as stack:
        pool = pool or stack.enter_context(CompilePool(1))
        if jobs is None:
            # the sampler program compiled for memory runs a MoE student's real grouped matmuls, or the partial
            # program's re-prefill (its own cost program): not the prefill's cost program then
            jobs = submit_cost_programs(step, ins, [r.name for r in reports], pool,
                                        sampler=sampler is not None and not step.student_cfg.sparse_layers
                                        and ins.carry is None)
            pool.run()
        programs = jobs.programs
        compiled: dict[str, tuple[Cost | None, float, str | None]] = {SAMPLER: (sampler, 0.0, None)}
        compiled |= pool.wait(jobs.keys, "cost programs", progress)
        if jobs.sampler and sampler is None:  # the memory pass's sampler program refused: the prefill on its own
            own = cost_programs(step, ins, sampler=False)
            programs.parts["sample"] = own.parts["sample"]
            programs.lower.update({k: v for k, v in own.lower.items() if k not in programs.lower})
        # a stage whose chunks unrolled the compiler refused (memory): its chunk loop kept, the body derived
        refused = {}
        for report in reports:
            errors = [compiled[k][2] for p in programs.parts.get(report.name, ()) for _, k in p.terms
                      if compiled.get(k, (None, 0.0, None))[2]]
            if errors and report.name in programs.fallback:
                refused[report.name] = errors[0]
                programs.parts[report.name] = programs.fallback[report.name]
        missing = [k for k in dict.fromkeys(k for r in reports for p in programs.parts.get(r.name, ())
                                            for _, k in p.terms) if k not in compiled]
        for k in missing:
            _queue_cost(step, programs, k, pool)
        pool.run()
        compiled |= pool.wait(missing, "cost programs (chunk loops)", progress)
    on_sampler = sampler_side(step)
    own, trainer = len(step.sampler_mesh.devices.flat), len(step.mesh.devices.flat)
    stages, seen = [], set()
    for report in reports:
        if report.name not in programs.parts:
            stages.append(StageCost(report.name, (Part(report.name, 1, report.cost, 0.0, report.error),)
                                    + transfer_parts(step, ins, report.name)))
            continue
        parts = []
        for p in programs.parts[report.name]:
            new = [k for _, k in p.terms if k not in seen]
            seen.update(new)
            parts.append(_part(p, compiled, sum(compiled[k][1] for k in new)))
        n = own if report.name in on_sampler else trainer
        stages.append(StageCost(report.name, tuple(parts) + attention_parts(step, ins, report.name, n)
                                + moe_parts(step, ins, report.name, n) + transfer_parts(step, ins, report.name)))
    notes = _notes(step, stages, options=_cost_options(step.mesh)) + [
        f"{name}: its loss chunks unrolled did not compile ({error[:120]}); the chunk loop's body derived from "
        f"one-layer programs at two chunk sizes (taken as linear in its positions)" for name, error in refused.items()]
    return Roofline(chip=chip, peak=CHIP_PEAKS[chip], num_devices=num_devices, devices_per_chip=per_chip,
                    stages=stages, rollout_tokens=step.rollout_rows * step.cfg.sampling.max_new_tokens,
                    model_flops=step_model_flops(step), compile_s=sum(v[1] for v in compiled.values()), notes=notes,
                    sampler_stages=on_sampler, sampler_devices=own if on_sampler else 0,
                    sides_overlap=bool(on_sampler) and step.staleness > 0)


def transfer_parts(step: OPDStep, ins: StepInputs, stage: str) -> tuple[Part, ...]:
    """Disaggregated (`opd.placement`), what crosses between the two device sets, as ICI traffic of the sampler's
    devices: the policy's fp32 params into the sampler's layout before the weight sync (each sampler device
    receives its shard: `jax.device_put` in `OPDStep.rollout`), and the rollout back to the trainer's batch layout
    after sampling (the whole rollout, split over the sampler's devices). Each is timed as one ring step of a
    device's ICI (`Cost.ici_seconds`): a point-to-point copy at the rate a device sends along one torus axis, an
    assumption (the copy's route between the two sets is the runtime's)."""
    if stage not in sampler_side(step):
        return ()
    if stage == "weight_sync":
        policy, _ = sync_inputs(step, ins.state.params, ins.key)
        return (Part("weight transfer", 1, Cost(0.0, 0.0, ici_bytes=float(bytes_per_device(policy)), ici_steps=1.0)),)
    rollout = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(ins.rollout.sample))
    sent = rollout / len(step.sampler_mesh.devices.flat)
    return (Part("rollout back", 1, Cost(0.0, 0.0, ici_bytes=float(sent), ici_steps=1.0)),)


# XLA's TPU compiler turns an FSDP all-gather (reduce-scatter) and its matmul into a loop over the shards (a
# windowed einsum), whose body its cost analysis counts once: the cost programs compile without it.
TPU_COST_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def _cost_options(mesh) -> dict[str, Any] | None:
    return TPU_COST_OPTIONS if mesh.devices.flat[0].platform == "tpu" else None


def _part(program: CostProgram, compiled: dict[str, tuple[Cost | None, float, str | None]], secs: float) -> Part:
    error = next((compiled[k][2] for _, k in program.terms if compiled[k][2]), None)
    cost = None if error else Cost.linear([(coef, compiled[k][0]) for coef, k in program.terms])
    if cost is not None and program.terms[0][1] == SAMPLER:  # the prefill's own loops: not the decode loop's
        looped, decode = (compiled[k][0] for _, k in program.terms)
        cost = dataclasses.replace(cost, loops=max(0, looped.loops - decode.loops - 1))
    return Part(program.name, program.count, cost, secs, error, program.derived)


def _passes(dtype) -> int:
    """bf16 MXU passes of one of this dtype's matmuls (`models.dtypes.matmul_precision`: fp32 at HIGHEST)."""
    return F32_PASSES["HIGHEST"] if jnp.dtype(dtype) == jnp.float32 else 1


def _itemsize(name: str) -> int:
    return jnp.dtype(DTYPES[name]).itemsize


def _expert_group(mesh) -> int:
    return dict(mesh.shape).get("expert", 1)


def moe_parts(step: OPDStep, ins: StepInputs, stage: str, num_devices: int) -> tuple[Part, ...]:
    """The stage's experts' grouped matmuls (`sizing.moe_cost`; the cost programs ran them as an identity), per
    device: one `experts[<model>]` part per mixture-of-experts model the stage runs, as often as its program."""
    cfg = step.cfg
    B, Pl, N = step.rollout_rows, cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
    T, s_cfg = Pl + N, step.student_cfg
    runs = []  # (name, count, model, tokens per run, weight bytes, matmul dtype, train, expert group)
    if stage == "sample" and s_cfg.sparse_layers:
        dtype = step.sampler.precision.dtype
        size, group = jnp.dtype(dtype).itemsize, _expert_group(step.sampler_mesh)
        runs.append(("experts[student prefill]", 1, s_cfg, (B // step.prefill_group) * Pl, size, dtype, False, group))
        steps = _decode_steps(step, ins)
        runs.append(("experts[student decode]", steps, s_cfg, ins.slots, size, dtype, False, group))
    elif stage == "teacher_scoring":
        dtype, group = teacher_compute_dtype(cfg), _expert_group(step.mesh)
        for t_cfg, src, rows in zip(step.teacher_cfgs, cfg.teacher_sources(), teacher_rows(step)):
            if t_cfg.sparse_layers and rows:
                runs.append((f"experts[{getattr(src, 'name', None) or 'teacher'}]", 1, t_cfg, rows * T,
                             _itemsize(src.dtype), dtype, False, group))
        if step.uses_reference and s_cfg.sparse_layers:
            runs.append(("experts[reference]", 1, s_cfg, B * T, _itemsize(cfg.student.dtype), step.compute_dtype,
                         False, group))
    elif stage == "train_step" and s_cfg.sparse_layers:
        runs.append(("experts[student]", cfg.rl.inner_updates, s_cfg, B * T, _itemsize(cfg.student.dtype),
                     step.compute_dtype, True, _expert_group(step.mesh)))
    out = []
    for name, count, m_cfg, tokens, weight_bytes, dtype, train, group in runs:
        c = expert_cost(m_cfg, tokens, num_devices=num_devices, expert_group=group, weight_bytes=weight_bytes,
                        act_bytes=jnp.dtype(dtype).itemsize, train=train, remat=train and cfg.train.remat)
        out.append(Part(name, count, Cost(c.flops, c.bytes, (_passes(dtype) - 1) * c.flops)))
    return tuple(out)


def attention_parts(step: OPDStep, ins: StepInputs, stage: str, num_devices: int) -> tuple[Part, ...]:
    """The stage's attention where XLA's cost analysis cannot see it (`sizing.attention_cost`: a Pallas kernel, or
    the chunked entry's loops), per device (the rows split evenly): one `attention` part, run as often as the
    program it belongs to; none where the entry is XLA's own einsums."""
    cfg = step.cfg
    platform = step.mesh.devices.flat[0].platform
    B, Pl, N = step.rollout_rows, cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
    T = Pl + N
    costs = []  # (count, AttentionCost, matmul dtype)
    if stage == "sample":
        precision = step.sampler.precision
        U = B // step.prefill_group
        costs.append((1, causal_cost(step.student_cfg, U, Pl, jnp.dtype(precision.dtype).itemsize, platform),
                      precision.dtype))
        steps = _decode_steps(step, ins)
        costs.append((steps, decode_cost(step.student_cfg, ins.slots, Pl, N, jnp.dtype(precision.cache_dtype).itemsize,
                                         platform), precision.dtype))
        # the re-prefill: T = P + N queries against as many cache slots, a cached call of T > 1 (the decode
        # kernel's entry, splash, runs chunked's blocks then), taken as a blockwise causal forward
        impl = implementation(step.student_cfg, "cached", T, platform)
        impl = "chunked" if impl == "splash" else impl
        if ins.carry is not None and impl not in SEEN_BY_XLA:
            flops, bytes_ = causal_forward(step.student_cfg, ins.slots, T, jnp.dtype(precision.dtype).itemsize)
            costs.append((1, AttentionCost(impl + " re-prefill", flops, bytes_), precision.dtype))
    elif stage == "teacher_scoring":
        dtype = teacher_compute_dtype(cfg)
        for t_cfg, rows in zip(step.teacher_cfgs, teacher_rows(step)):
            costs.append((1, causal_cost(t_cfg, rows, T, jnp.dtype(dtype).itemsize, platform), dtype))
    elif stage == "train_step":
        dtype = step.compute_dtype
        cost = causal_cost(step.student_cfg, B, T, jnp.dtype(dtype).itemsize, platform, train=True,
                           remat=cfg.train.remat)
        costs.append((cfg.rl.inner_updates, cost, dtype))
    out = []
    for count, c, dtype in costs:
        if c.flops:
            per_device = Cost(c.flops / num_devices, c.bytes / num_devices,
                              (_passes(dtype) - 1) * c.flops / num_devices)
            out.append(Part(f"attention[{c.impl}]", count, per_device))
    return tuple(out)


def active_layer_and_head_params(cfg: ModelConfig) -> tuple[int, int]:
    """(the layers' parameters a token's forward multiplies, the LM head's): a mixture-of-experts layer counts its
    experts' weights at top-k / experts (each token runs k of the E experts), its router whole."""
    layers = transformer.abstract_params(cfg)["layers"]
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    def is_expert(path) -> bool:  # the experts' weights, stacked or per layer (a mixed dense/sparse schedule)
        return any(str(getattr(k, "key", "")).startswith("expert_") for k in path)

    count = sum(math.prod(x.shape) * (share if is_expert(path) else 1.0)
                for path, x in jax.tree_util.tree_leaves_with_path(layers))
    return int(round(count)), cfg.hidden_size * cfg.vocab_size


def step_model_flops(step: OPDStep) -> dict[str, float]:
    """The step's model FLOPs by stage (`roofline.model_flops`), every row at its full prompt and response length:
    the rollout's prefill and decode forwards, the teacher's (and the KL reference's) forward over prompt +
    response, the update's forward + backward; the LM head at the positions projected to logits (the response's);
    the attention's score and value matmuls over the causal pairs (`attention_cost.causal_model_flops`; a decode
    step's query against the tokens before it)."""
    cfg = step.cfg
    B, Pl, N = step.rollout_rows, cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
    U = B // step.prefill_group
    student = active_layer_and_head_params(step.student_cfg)
    s_cfg, T = step.student_cfg, Pl + N
    scoring = sum(model_flops(*active_layer_and_head_params(t_cfg), rows * T, rows * N, 2)
                  + causal_model_flops(t_cfg, rows, T, 2)
                  for t_cfg, rows in zip(step.teacher_cfgs, teacher_rows(step)))
    if step.uses_reference:
        scoring += model_flops(*student, B * T, B * N, 2) + causal_model_flops(s_cfg, B, T, 2)
    # decode: step i's query reads Pl + i cached tokens; summed over the N - 1 steps after the prefill's token
    decode_pairs = B * ((N - 1) * Pl + (N - 1) * N // 2)
    decode_attention = 2 * 2 * decode_pairs * s_cfg.head_dim * s_cfg.num_heads * s_cfg.num_layers
    sample = (model_flops(*student, U * Pl + B * (N - 1), B * N, 2) + causal_model_flops(s_cfg, U, Pl, 2)
              + decode_attention)
    train = model_flops(*student, B * T, B * N, 6) + causal_model_flops(s_cfg, B, T, 6)
    return {"weight_sync": 0.0, "sample": float(sample), "teacher_scoring": scoring,
            "train_step": cfg.rl.inner_updates * train}


def teacher_rows(step: OPDStep) -> tuple[int, ...]:
    """The rows each teacher scores per step: all of them (a mixture), its own (routing=task), or all for the one a
    routing names (the one teacher) and none for the others."""
    B, routing = step.rollout_rows, step.routing
    if routing.mode == "mixture":
        return (B,) * len(step.teacher_cfgs)
    if routing.mode == "task":
        return tuple(n * routing.shards for n in routing.shard_rows)
    return tuple(B if i == routing.scorer else 0 for i in range(len(routing.names)))


def _notes(step: OPDStep, stages: Sequence[StageCost], options) -> list[str]:
    cfg = step.cfg
    notes = ["ICI: each collective of the cost programs as a bidirectional ring along one torus axis (bytes / "
             "(chip ICI bandwidth / ports) + ring steps x hop latency), added to its program's compute/HBM time "
             "(not overlapped; 'overlapped s' hides it under that time)",
             "not modeled: host work and dispatch, the loops' control, overlap of stages, collectives over several "
             "torus axes, compiler efficiency (each program at 100% of the bound that binds)"]
    if options:
        notes.append("cost programs compiled without XLA's windowed einsum (FSDP all-gather/reduce-scatter looped "
                     "with the matmul): the same FLOPs, the collectives' overlap with the matmuls not modeled")
    if any(s.total("extra_pass_flops") for s in stages):
        notes.append("+passes: fp32 matmuls at Precision.HIGHEST run 6 bf16 MXU passes (HIGH: 3); XLA counts one")
    if step.sampler.engine(step.rollout_rows, step.prefill_group)[0]:
        notes.append("sample: the slot engine's refills (prompt KV copied into a slot) are not counted")
    if cfg.rollout.partial:
        S, P, N = step.sampler.engine(step.rollout_rows)[1], cfg.data.max_prompt_len, cfg.sampling.max_new_tokens
        notes.append(f"sample: the partial program (rollout.partial); its re-prefill at the largest width, the worst "
                     f"case: every one of the {S} carried rows re-prefilled over P + N = {P + N} positions (a step "
                     f"runs the longest carried response's bucket); its decode passes with every row to "
                     f"max_new_tokens (`partial_decode_steps`); the final selection of the R rows not counted")
    if sampler_side(step):
        notes.append("disaggregated: the weight transfer and the rollout's copy back each timed as one ring step of "
                     "the sender's ICI (a point-to-point copy between the two device sets, an assumption); with "
                     "rollout.staleness >= 1 the sampler side (next rollout) runs while the trainer side does, "
                     "so a step takes the longer side (a one-rollout-deep queue; dispatch and host work not modeled)")
    elif step.shardings.own_sampler_layout:
        notes.append("sample: the rollouts' copy from the sampler's mesh (sampling.mesh) to the trainer's batch layout "
                     "(a jax.device_put after the sampler) is not counted; the weight sync's reshard is")
    if micro_batches(step) > 1:
        notes.append(f"train_step: costed as {micro_batches(step)} micro-batches (optim.grad_accum_steps), each a "
                     f"program of its rows with the optimizer's update (counted {micro_batches(step)} times where "
                     f"the step applies it once: its state's reads and writes are over-counted)")
    elif cfg.optim.grad_accum_steps > 1:
        notes.append(f"train_step: costed as one batch; the weights' reads per micro-batch "
                     f"(optim.grad_accum_steps={cfg.optim.grad_accum_steps}) are counted once")
    return notes + loop_notes(stages)
