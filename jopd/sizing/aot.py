"""`jopd aot`: ahead-of-time compile of one OPD step for a device topology, with per-device memory: size a TPU
pod run before paying for it.

Each jitted stage of the step (weight sync, sampler, teacher scoring, train step: `opd.step.build_step`, the very
functions `jopd train`'s loop calls) is lowered from abstract inputs (`sizing.stages`) and compiled for the target
devices: a TPU topology described by libtpu (`sizing.topology.topology_devices("v5e:4x4")`, from any machine, no
TPU needed) or the local devices; the models come from metadata only (`sizing.arch`).

XLA's `memory_analysis()` gives each program's per-device bytes (arguments, outputs, aliased, temporaries,
generated code). While one stage runs, buffers owned by the others stay alive (the train state while
sampling, the teacher while training, the kept KV cache, ...); `resident` adds those, from shapes and
shardings, so `peak = total + resident` is what must fit in the device's HBM (`sizing.report`).

With `cost=True` it also predicts the step's time on the chip (`sizing.cost`, `sizing.roofline`): XLA's
`cost_analysis()` counts a loop body once, so the FLOPs, bytes and collectives come from loop-free cost programs
lowered with the same shardings, each compiled once and multiplied by how often the real stage runs it; the memory report stays the real, looped programs'.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax

from jopd import parallel as meshlib
from jopd.config_dataclass import ConfigError, build
from jopd.opd import placement, validate
from jopd.opd.resolve import rollouts_per_prompt
from jopd.opd.step import build_step
from jopd.run.config import RunConfig
from jopd.sizing.compile_pool import CompilePool
from jopd.sizing.cost import predict_step, submit_cost_programs
from jopd.sizing.arch import cross_tokenizers, model_config_of, param_count, sizing_crosses
from jopd.sizing.report import AotReport, LayoutRow, StageMemory, StageReport
from jopd.sizing.roofline import Cost
from jopd.sizing.stages import (
    bytes_per_device,
    compile_stage,
    programs_of,
    sampler_side,
    step_inputs,
)
from jopd.sizing.topology import (
    chip_name,
    devices_per_chip,
    hbm_bytes_per_device,
)

STAGES: tuple[str, ...] = ("weight_sync", "sample", "teacher_scoring", "train_step")


def compile_opd_step(cfg: RunConfig, devices: Sequence[Any] | None = None, *, target: str = "local",
                     stages: Sequence[str] = STAGES, hbm_bytes: int | None = None,
                     progress: bool = True, cost: bool = False, chip: str | None = None,
                     compile_threads: int | None = None) -> AotReport:
    """Compile the requested stages of one OPD step of `cfg` for `devices` (default: the local devices) and
    report per-device memory. `hbm_bytes` overrides the HBM budget per device (default: `HBM_GIB_PER_CHIP`).
    `cost`: also compile the cost programs and predict the step's time on `chip` (default: the devices' chip,
    `roofline.CHIP_PEAKS`). `compile_threads`: programs compiled at once (`compile_pool`; default: the cores, at
    most 4)."""
    start = time.perf_counter()
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown} (choose from {', '.join(STAGES)})")
    devices = list(jax.devices() if devices is None else devices)
    chip = chip_name(devices, chip) if cost else None  # before any compile: an unknown chip fails fast
    crossed = cfg.loss.cross_tokenizer != "off"
    roles = list(zip(cfg.teacher_roles(), cfg.teacher_sources()))
    s_tok, t_toks = cross_tokenizers(cfg) if crossed else (None, (None,) * len(roles))
    s_cfg = model_config_of(cfg.student, "student", s_tok)
    t_cfgs = tuple(model_config_of(src, role, tok) for (role, src), tok in zip(roles, t_toks))
    cross = sizing_crosses(cfg, s_tok, t_toks, s_cfg, t_cfgs) if crossed else (None,) * len(roles)
    # the vocabularies and the contexts, as `jopd train` checks them
    validate.check_models(cfg, s_cfg, t_cfgs, validate.own_tokenizers(cross, len(roles)))
    # disaggregated (`opd.placement`): the trainer's mesh over the devices the sampler's first ones leave
    trainer_devices, own_devices = placement.split_devices(cfg, devices)
    mesh = meshlib.make_mesh(cfg.mesh, trainer_devices)
    step = build_step(cfg, s_cfg, t_cfgs, mesh, cross=cross, devices=devices)
    inputs = step_inputs(step)
    programs, buffers = programs_of(step, inputs)
    on_sampler = sampler_side(step)
    count = {name: len(own_devices) if name in on_sampler else len(trainer_devices) for name in STAGES}

    wanted = [s for s in STAGES if s in stages]
    with CompilePool(compile_threads) as pool:
        # every program lowered here (tracing needs the mesh), then compiled on the pool's threads, the largest
        # first: the memory pass's stages and the cost programs side by side
        for name in wanted:
            lower, resident = programs[name]
            t0 = time.perf_counter()
            # activations' batch constraints (transformer.constrain_batch) need the mesh: the sampler's for its program
            stage_mesh = step.sampler_mesh if name == "sample" or name in on_sampler else mesh
            with jax.set_mesh(stage_mesh):
                lowered = lower()
            # the StableHLO text orders the pool, and gives the fp32 matmuls' MXU passes (`Cost.of`)
            text = lowered.as_text()
            pool.add(name, len(text), functools.partial(_memory_report, name, lowered, text if chip else None,
                                                        resident, count[name], stage_mesh,
                                                        time.perf_counter() - t0))
        jobs = None
        if chip is not None:  # the memory pass's sampler program stands for the prefill (a MoE student's, or the
            # partial program with its re-prefill: not)
            jobs = submit_cost_programs(step, inputs, wanted, pool, sampler="sample" in wanted and
                                        not s_cfg.sparse_layers and inputs.carry is None)
        pool.run()
        done = pool.wait(wanted, f"AOT compile ({target}, {pool.threads} at once)", progress)
        reports = [done[name] for name in wanted]
        roofline = None
        if chip is not None:
            roofline = predict_step(step, inputs, reports, chip, len(devices), devices_per_chip(devices),
                                    progress=progress, pool=pool, jobs=jobs)

    models = {role: {"family": m.family, "params": param_count(m), "dtype": src.dtype,
                     "source": src.path or "testbed arch", "layers": m.num_layers, "hidden": m.hidden_size,
                     "vocab": m.vocab_size}
              for role, m, src in [("student", s_cfg, cfg.student)]
              + [(t.name, m, t) for t, m in zip(cfg.teacher_sources(), t_cfgs)]}
    # each teacher's parameters per device under its `placement` (held all run long: in `teacher_params`)
    for name, src, params in zip(list(models)[1:], cfg.teacher_sources(), inputs.teacher):
        models[name] |= {"placement": src.placement, "bytes_per_device": bytes_per_device(params)}
    shapes = {"batch": cfg.data.batch_size * rollouts_per_prompt(cfg), "prompt_len": cfg.data.max_prompt_len,
              "new_tokens": cfg.sampling.max_new_tokens, "top_k": cfg.loss.top_k,
              "grad_accum_steps": cfg.optim.grad_accum_steps, "remat": int(cfg.train.remat)}
    if crossed:  # the projection tables' sparse entries: from the tokenizers, or estimated without them
        shapes["cross_tokenizer"] = cfg.loss.cross_tokenizer
        pairs = {name: f"{c.table.pair_student_E.shape[0]}" + ("" if c.pair is not None else " (estimated: no "
                                                                                               "tokenizer)")
                 for name, c in zip(list(models)[1:], cross) if c is not None}
        if pairs:
            shapes["xtok_pairs"] = next(iter(pairs.values())) if not cfg.teachers else \
                ", ".join(f"{k}: {v}" for k, v in pairs.items())
    return AotReport(target=target, device_kind=devices[0].device_kind, num_devices=len(devices),
                     devices_per_chip=devices_per_chip(devices),
                     hbm_per_device=hbm_bytes if hbm_bytes is not None else hbm_bytes_per_device(devices),
                     mesh=dict(mesh.shape), models=models, shapes=shapes, buffers=buffers, stages=reports,
                     roofline=roofline,
                     sampler_mesh=dict(step.sampler_mesh.shape) if step.shardings.own_sampler_layout else None,
                     sampler_devices=len(own_devices) if on_sampler else 0,
                     compile_threads=pool.threads, wall_s=time.perf_counter() - start,
                     notes=partial_notes(step, inputs) if "sample" in wanted else [])


def partial_notes(step, ins) -> list[str]:
    """What the sample stage is with `rollout.partial` (empty otherwise): the partial program, at which width."""
    if ins.carry is None:
        return []
    P, N, S = step.cfg.data.max_prompt_len, ins.partial_width, ins.slots
    return [f"sample: the partial-rollouts program (rollout.partial) at re-prefill width {N}, the largest bucket "
            f"(worst case: all {S} carried rows re-prefilled over P + {N} = {P + N} positions; a step runs the "
            f"longest carried response's bucket), with the carry ({S} rows) as its argument"]


def _memory_report(name: str, lowered, text: str | None, resident: dict[str, int], devices: int, stage_mesh,
                   lower_s: float) -> StageReport:
    """One stage's compile (on a pool thread): its memory, and with `text` its looped program's cost."""
    with jax.set_mesh(stage_mesh):
        compiled, secs, error = compile_stage(name, lambda: lowered)
    return StageReport(name, None if compiled is None else StageMemory.of(compiled), resident, lower_s + secs, error,
                       None if compiled is None else Cost.of(compiled, text, devices))


# -- the sampler's layout: one report per candidate mesh (`sampling.mesh`) -------------------------------------

LAYOUT_STAGES: tuple[str, ...] = ("weight_sync", "sample")  # what a sampler layout changes


def parse_sampler_layouts(text: str) -> list[tuple[str, meshlib.MeshConfig | None]]:
    """`--sampler-layouts`: candidates separated by ';', each `axis=size` pairs separated by ',' (a `sampling.mesh`,
    e.g. "data=-1 ; data=-1,tensor=4"; `on_indivisible=replicate` too), or `trainer` (the trainer's mesh:
    `sampling.mesh` unset). Returns (the candidate as written, its MeshConfig or None)."""
    out = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        if item == "trainer":
            out.append((item, None))
            continue
        sizes = {}
        for pair in (p.strip() for p in item.split(",")):
            axis, eq, size = (x.strip() for x in pair.partition("="))
            if axis == "on_indivisible" and eq:
                sizes[axis] = size
                continue
            if not eq or not size.lstrip("-").isdigit():
                raise ConfigError(f"--sampler-layouts: {pair!r} in {item!r} is not axis=size (e.g. "
                                  f"'data=-1,tensor=4'; candidates separated by ';', or 'trainer')")
            sizes[axis] = int(size)
        out.append((item, build(meshlib.MeshConfig, sizes, "--sampler-layouts " + repr(item))))
    if not out:
        raise ConfigError("--sampler-layouts: no candidate given (e.g. 'data=-1 ; data=-1,tensor=4')")
    return out


def compare_sampler_layouts(cfg: RunConfig, layouts: Sequence[tuple[str, meshlib.MeshConfig | None]],
                            devices: Sequence[Any] | None = None, **options) -> list[LayoutRow]:
    """`compile_opd_step` of `cfg` with each candidate as its `sampling.mesh` (same devices, same trainer mesh),
    `options` as there (`stages` defaults to `LAYOUT_STAGES`). A candidate the run refuses (a size that does not
    divide the devices, the heads or the rows) is a row with its error, not a failure of the comparison."""
    options.setdefault("stages", LAYOUT_STAGES)
    rows = []
    for name, layout in layouts:
        variant = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, mesh=layout))
        try:
            rows.append(LayoutRow(name, compile_opd_step(variant, devices, **options)))
        except ValueError as e:
            rows.append(LayoutRow(name, None, str(e).splitlines()[0]))
    return rows
