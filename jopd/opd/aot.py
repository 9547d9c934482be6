"""Ahead-of-time compile of one OPD step for a device topology, with per-device memory: size a TPU pod run
before paying for it.

Each jitted stage of `jopd.opd.loop` (weight sync, sampler, teacher scoring, train step) is built from the same
functions, rules and dtypes the trainer uses, lowered with abstract inputs only (`jax.ShapeDtypeStruct`s that
carry their shardings; no weights read, nothing allocated) and compiled for the target devices: a TPU topology
described by libtpu (`topology_devices("v5e:4x4")`, from any machine, no TPU needed) or the local devices.

XLA's `memory_analysis()` gives each program's per-device bytes (arguments, outputs, aliased, temporaries,
generated code). While one stage runs, buffers owned by the others stay alive (the train state while
sampling, the teacher while training, the kept KV cache, ...); `resident` adds those, from shapes and
shardings, so `peak = total + resident` is what must fit in the device's HBM (`HBM_GIB_PER_CHIP`).

With `cost=True` it also predicts the step's time on the chip (`jopd.opd.roofline`): XLA's `cost_analysis()`
counts a loop body once, so the FLOPs and bytes come from loop-free cost programs (`cost_programs`) lowered with
the same shardings, each multiplied by how often the real stage runs it; the memory report stays the real,
looped programs'.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jopd import parallel as meshlib
from jopd.opd.run_config import ModelSource, RunConfig
from jopd.models import io, transformer
from jopd.models.config import ModelConfig
from jopd.models.hf_io import INDEX_FILE, SINGLE_FILE, read_hf_config
from jopd.losses.chunked import head_params
from jopd import crosstok
from jopd.opd.batch import RolloutArrays, scoring_input, with_sampler_full_logprobs
from jopd.opd import validate
from jopd.opd.cross_teacher import CrossTeacher, cross_batch_shapes
from jopd.opd.roofline import CHIP_PEAKS, Cost, Roofline, chip_of
from jopd.opd.step import OPDStep, build_step, rollouts_per_prompt
from jopd.sampling.config import RowRandomness

# HBM per chip (GiB) by `device.device_kind`, with the chip's usual name. Public figures: v4 32 GiB,
# v5e 16 GiB, v5p 95 GiB, v6e (Trillium) 32 GiB. A chip may appear as several devices (v4 topologies list
# each TensorCore): the budget per device is the chip's HBM divided by its devices.
HBM_GIB_PER_CHIP: dict[str, tuple[str, float]] = {
    "TPU v4": ("v4", 32.0),
    "TPU v5 lite": ("v5e", 16.0),
    "TPU v5e": ("v5e", 16.0),
    "TPU v5": ("v5p", 95.0),
    "TPU v5p": ("v5p", 95.0),
    "TPU v6 lite": ("v6e", 32.0),
    "TPU v6e": ("v6e", 32.0),
}
STAGES: tuple[str, ...] = ("weight_sync", "sample", "teacher_scoring", "train_step")
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# devices and their memory


def topology_devices(name: str) -> list:
    """The devices of a TPU topology such as "v5e:2x2", "v5e:4x4", "v5p:2x2x2" (libtpu's names: chip type,
    then the chip grid), described by libtpu without any TPU attached. Compile-only: nothing can run on them."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"--topology {name}: needs libtpu (pip install 'jopd[tpu]', i.e. jax[tpu]); "
                         f"without --topology the stages compile for the local devices")
    # Compiling needs no chip: do not wait for the lock of another process that holds libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu raises its own error types for bad names
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--topology {name}: not a TPU topology libtpu knows ({first}); "
                         f"examples: v5e:2x2, v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:2x2") from None
    return list(topo.devices)


def devices_per_chip(devices: Sequence[Any]) -> int:
    coords = {tuple(d.coords) for d in devices if getattr(d, "coords", None) is not None}
    return max(1, len(devices) // len(coords)) if coords else 1


def hbm_bytes_per_device(devices: Sequence[Any]) -> int | None:
    """HBM budget of one device from `HBM_GIB_PER_CHIP`, or None for an unknown kind (e.g. CPU)."""
    kind = devices[0].device_kind
    if kind not in HBM_GIB_PER_CHIP:
        return None
    return int(HBM_GIB_PER_CHIP[kind][1] * GiB) // devices_per_chip(devices)


# ---------------------------------------------------------------------------------------------
# model architectures without weights


def model_config_of(src: ModelSource, role: str, tokenizer=None) -> ModelConfig:
    """The architecture of a run's model from metadata only: an HF directory's `config.json` (weights need not
    be there: `configs/arch/<name>/` holds config-only directories of real models), a .gguf's metadata, or,
    for `path: null`, the testbed recipe (`arch` with `tokenizer`'s vocabulary; default the toy tokenizer's)."""
    if src.path is None:
        from jopd.data.toy_tokenizer import build_toy_tokenizer
        from jopd.opd.model_sources import testbed_model_config

        return testbed_model_config(src, tokenizer or build_toy_tokenizer())
    p = io.resolve_model_path(src.path)
    if not p.exists():
        raise FileNotFoundError(f"RunConfig.{role}.path: {p} does not exist (for sizing, point it at a directory "
                                f"with the model's config.json, e.g. configs/arch/qwen3-8b)")
    if p.is_dir():
        has_weights = (p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file()
        if not has_weights:
            cfg = read_hf_config(p)
            return dataclasses.replace(cfg, num_layers=src.num_layers) if src.num_layers else cfg
    return io.open_checkpoint(p, src.num_layers)[0]  # validates every tensor's shape (metadata only)


def cross_tokenizers(cfg: RunConfig) -> tuple[Any, tuple[Any, ...]]:
    """(student tokenizer, each teacher's) of a run with a cross-tokenizer kind, as `jopd train` loads them; None
    for a model given by a directory without tokenizer files (a config-only `configs/arch/<name>/`)."""
    from jopd.data.toy_tokenizer import build_toy_tokenizer
    from jopd.opd import model_sources

    def get(fn, *args):
        try:
            return fn(*args)
        except FileNotFoundError:
            return None

    teachers = tuple(get(lambda s: model_sources.model_tokenizer(s) or build_toy_tokenizer(), src)
                     for src in cfg.teacher_sources())
    return get(model_sources.run_tokenizer, cfg), teachers


def sizing_crosses(cfg: RunConfig, student_tok, teacher_toks, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...]):
    """`build_step`'s `cross` for sizing, one per teacher: its `sizing_cross_teacher`, None for a teacher that scores
    the student's tokens (`model_sources.scores_student_tokens`)."""
    from jopd.opd.model_sources import scores_student_tokens

    return tuple(None if scores_student_tokens(cfg, student_tok, tok, s_cfg, m) else
                 sizing_cross_teacher(student_tok, tok, s_cfg, m, cfg.data.system_prompt)
                 for tok, m in zip(teacher_toks, t_cfgs))


def sizing_cross_teacher(student_tok, teacher_tok, s_cfg: ModelConfig, t_cfg: ModelConfig,
                         system_prompt: str | None) -> CrossTeacher:
    """The cross teacher the step is lowered with: the run's own (`CrossTeacher.make`: the pair checked, the exact
    projection table) when both tokenizers are there, else a stand-in with a table of the models' vocabulary
    sizes and an estimated number of sparse entries (`crosstok.project.placeholder_table`): it lowers and sizes
    the step, and cannot align anything."""
    if student_tok is not None and teacher_tok is not None:
        return CrossTeacher.make(student_tok, teacher_tok, s_cfg, t_cfg, system_prompt)
    return CrossTeacher(pair=None, table=crosstok.placeholder_table(s_cfg.vocab_size, t_cfg.vocab_size),
                        system_prompt=system_prompt, teacher_pad_id=0)


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(transformer.abstract_params(cfg)))


# ---------------------------------------------------------------------------------------------
# reports


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one compiled program, from XLA's `memory_analysis()`."""

    argument: int
    output: int
    alias: int  # outputs written into donated arguments (counted once)
    temp: int
    generated_code: int

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp + self.generated_code

    @classmethod
    def of(cls, compiled) -> "StageMemory":
        m = compiled.memory_analysis()
        return cls(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
                   alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes),
                   generated_code=int(m.generated_code_size_in_bytes))


@dataclasses.dataclass
class StageReport:
    name: str
    memory: StageMemory | None  # None when the compiler itself refused the program (out of memory)
    resident: dict[str, int]  # bytes per device of other stages' buffers alive meanwhile, by buffer
    compile_s: float
    error: str | None = None
    cost: Cost | None = None  # XLA's cost of this (looped) program: loop bodies counted once (not reported)

    @property
    def peak(self) -> int | None:
        return None if self.memory is None else self.memory.total + sum(self.resident.values())

    def to_dict(self) -> dict[str, Any]:
        mem = dataclasses.asdict(self.memory) | {"total": self.memory.total} if self.memory else None
        return {"name": self.name, "memory": mem, "resident": self.resident,
                "resident_total": sum(self.resident.values()), "peak": self.peak,
                "compile_s": round(self.compile_s, 2), "error": self.error}


@dataclasses.dataclass
class AotReport:
    target: str  # topology name, or "local"
    device_kind: str
    num_devices: int
    devices_per_chip: int
    hbm_per_device: int | None
    mesh: dict[str, int]
    models: dict[str, dict[str, Any]]
    shapes: dict[str, int]
    buffers: dict[str, int]  # long-lived buffers, bytes per device
    stages: list[StageReport]
    roofline: Roofline | None = None  # the predicted time (compile_opd_step(cost=True))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        d["fits"] = not self.failures()
        d["roofline"] = None if self.roofline is None else self.roofline.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def failures(self) -> list[str]:
        """One line per stage that does not fit (compiler refusal, or peak above the HBM budget)."""
        out = []
        where = f"{self.device_kind} ({self.target})"
        for s in self.stages:
            if s.error is not None:
                out.append(f"stage {s.name}: the compiler rejected it for {where}: {s.error}")
            elif self.hbm_per_device is not None and s.peak > self.hbm_per_device:
                out.append(f"stage {s.name}: needs {_gib(s.peak)} GiB per device (program {_gib(s.memory.total)} + "
                           f"held by other stages {_gib(sum(s.resident.values()))}) > {_gib(self.hbm_per_device)} "
                           f"GiB HBM of {where}")
        return out

    def table(self) -> str:
        biggest = max([s.peak or 0 for s in self.stages] + list(self.buffers.values()) + [1])
        unit, scale = ("GiB", GiB) if biggest >= GiB // 4 else ("MiB", 1 << 20)
        num = lambda n: "-" if n is None else f"{n / scale:.2f}"  # noqa: E731
        hbm = f"{self.hbm_per_device / GiB:.2f} GiB HBM per device" if self.hbm_per_device else "HBM unknown"
        chips = f", {self.devices_per_chip} devices per chip" if self.devices_per_chip > 1 else ""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"target {self.target}: {self.num_devices} x {self.device_kind} ({hbm}{chips}), mesh {mesh}"]
        for role, m in self.models.items():
            placed = f", {m['placement']} ({num(m['bytes_per_device'])} {unit} per device)" if "placement" in m else ""
            lines.append(f"{role}: {m['family']} {m['params'] / 1e9:.3f}B params, {m['dtype']}, {m['source']}{placed}")
        lines.append("shapes: " + " ".join(f"{k}={v}" for k, v in self.shapes.items()))
        lines.append(f"long-lived buffers per device ({unit}): "
                     + ", ".join(f"{k} {num(v)}" for k, v in self.buffers.items()))
        head = ("stage", "argument", "output", "alias", "temp", "code", "total", "+held", "=peak", "HBM", "fits")
        rows = [head]
        hbm_cell = num(self.hbm_per_device)
        for s in self.stages:
            if s.memory is None:
                rows.append((s.name, *["-"] * 8, hbm_cell, "NO"))
                continue
            m = s.memory
            fits = "-" if self.hbm_per_device is None else ("yes" if s.peak <= self.hbm_per_device else "NO")
            rows.append((s.name, *(num(x) for x in (m.argument, m.output, m.alias, m.temp, m.generated_code,
                                                    m.total, sum(s.resident.values()), s.peak)), hbm_cell, fits))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths)))
        lines.append(f"per-device memory ({unit}); +held = buffers of other stages alive meanwhile:")
        lines += [fmt(r) for r in rows]
        lines += [f"  {s.name}: {s.error}" for s in self.stages if s.error]
        if self.roofline is not None:
            lines.append(self.roofline.table())
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def check_fits(report: AotReport) -> None:
    """Raise ValueError listing every stage that does not fit the devices' HBM."""
    failures = report.failures()
    if failures:
        raise ValueError("does not fit: " + "; ".join(failures) + ". Use more chips (a larger fsdp axis), a "
                         "smaller data.batch_size or sequence lengths, optim.grad_accum_steps, bf16 weights")


# ---------------------------------------------------------------------------------------------
# the stages, built as jopd.opd.loop builds them, lowered from abstract inputs


def _abstract(tree, shardings):
    return meshlib.sharded_abstract(tree, shardings)


def _bytes(tree) -> int:
    """Per-device bytes of a pytree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        itemsize = x.dtype.itemsize  # also defined for typed PRNG keys (their key data)
        total += math.prod(x.sharding.shard_shape(x.shape)) * itemsize
    return total


def _compile(name: str, lowered_fn, options: dict[str, Any] | None = None) -> tuple[Any, float, str | None]:
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


def compile_opd_step(cfg: RunConfig, devices: Sequence[Any] | None = None, *, target: str = "local",
                     stages: Sequence[str] = STAGES, hbm_bytes: int | None = None,
                     progress: bool = True, cost: bool = False, chip: str | None = None) -> AotReport:
    """Compile the requested stages of one OPD step of `cfg` for `devices` (default: the local devices) and
    report per-device memory. `hbm_bytes` overrides the HBM budget per device (default: `HBM_GIB_PER_CHIP`).
    `cost`: also compile the cost programs and predict the step's time on `chip` (default: the devices' chip,
    `roofline.CHIP_PEAKS`)."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown} (choose from {', '.join(STAGES)})")
    devices = list(jax.devices() if devices is None else devices)
    chip = _chip(devices, chip) if cost else None  # before any compile: an unknown chip fails fast
    crossed = cfg.loss.cross_tokenizer != "off"
    roles = list(zip(cfg.teacher_roles(), cfg.teacher_sources()))
    s_tok, t_toks = cross_tokenizers(cfg) if crossed else (None, (None,) * len(roles))
    s_cfg = model_config_of(cfg.student, "student", s_tok)
    t_cfgs = tuple(model_config_of(src, role, tok) for (role, src), tok in zip(roles, t_toks))
    cross = sizing_crosses(cfg, s_tok, t_toks, s_cfg, t_cfgs) if crossed else (None,) * len(roles)
    own_tok = cross  # None: the student's vocabulary
    # the vocabularies and the contexts, as `jopd train` checks them
    validate.check_models(cfg, s_cfg, t_cfgs, validate.own_tokenizers(cross, len(roles)))
    mesh = meshlib.make_mesh(cfg.mesh, devices)
    step = build_step(cfg, s_cfg, t_cfgs, mesh, cross=cross)
    inputs = step_inputs(step)
    programs, buffers = _stage_programs(step, inputs)

    reports = []
    bar = tqdm([s for s in STAGES if s in stages], desc=f"AOT compile ({target})", disable=not progress,
               dynamic_ncols=True, leave=False)
    for name in bar:
        bar.set_postfix_str(name)
        lower, resident = programs[name]
        with jax.set_mesh(mesh):  # activations' batch constraints (transformer.constrain_batch) need the mesh
            compiled, secs, error = _compile(name, lower)
        reports.append(StageReport(name, None if compiled is None else StageMemory.of(compiled), resident, secs,
                                   error, None if compiled is None else Cost.of(compiled)))

    models = {role: {"family": m.family, "params": param_count(m), "dtype": src.dtype,
                     "source": src.path or "testbed arch", "layers": m.num_layers, "hidden": m.hidden_size,
                     "vocab": m.vocab_size}
              for role, m, src in [("student", s_cfg, cfg.student)]
              + [(t.name, m, t) for t, m in zip(cfg.teacher_sources(), t_cfgs)]}
    # each teacher's parameters per device under its `placement` (held all run long: in `teacher_params`)
    for name, src, params in zip(list(models)[1:], cfg.teacher_sources(), inputs.teacher):
        models[name] |= {"placement": src.placement, "bytes_per_device": _bytes(params)}
    shapes = {"batch": cfg.data.batch_size * rollouts_per_prompt(cfg), "prompt_len": cfg.data.max_prompt_len,
              "new_tokens": cfg.sampling.max_new_tokens, "top_k": cfg.loss.top_k,
              "grad_accum_steps": cfg.optim.grad_accum_steps, "remat": int(cfg.train.remat)}
    if crossed:  # the projection tables' sparse entries: from the tokenizers, or estimated without them
        shapes["cross_tokenizer"] = cfg.loss.cross_tokenizer
        pairs = {name: f"{c.table.pair_student_E.shape[0]}" + ("" if c.pair is not None else " (estimated: no "
                                                                                               "tokenizer)")
                 for name, c in zip(list(models)[1:], own_tok) if c is not None}
        if pairs:
            shapes["xtok_pairs"] = next(iter(pairs.values())) if not cfg.teachers else \
                ", ".join(f"{k}: {v}" for k, v in pairs.items())
    roofline = None
    if chip is not None:
        from jopd.opd.aot_cost import predict_step  # it builds on this module's stage inputs

        roofline = predict_step(step, inputs, reports, chip, len(devices), devices_per_chip(devices),
                                progress=progress)
    return AotReport(target=target, device_kind=devices[0].device_kind, num_devices=len(devices),
                     devices_per_chip=devices_per_chip(devices),
                     hbm_per_device=hbm_bytes if hbm_bytes is not None else hbm_bytes_per_device(devices),
                     mesh=dict(mesh.shape), models=models, shapes=shapes, buffers=buffers, stages=reports,
                     roofline=roofline)


def _chip(devices: Sequence[Any], chip: str | None) -> str:
    name = chip or chip_of(devices[0].device_kind, HBM_GIB_PER_CHIP)
    if name not in CHIP_PEAKS:
        raise ValueError(f"roofline: no chip peaks for {chip or devices[0].device_kind!r} (known: "
                         f"{', '.join(CHIP_PEAKS)}); compile for a TPU topology, or skip it with --no-cost")
    return name


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
    sampler_params = _abstract(jax.eval_shape(step.sync_fn, state.params, key), sh.sampler_params)
    cache = _cache(step, slots)

    sds = jax.ShapeDtypeStruct
    prompt = sds((B, Pl), jnp.int32, sharding=sh.batch)
    prompt_mask = sds((B, Pl), jnp.bool_, sharding=sh.batch)
    unique = sds((U, Pl), jnp.int32, sharding=sh.batch), sds((U, Pl), jnp.bool_, sharding=sh.batch)
    rand = RowRandomness(sds((B, N), jnp.float32, sharding=sh.batch), sds((B, 2), jnp.uint32, sharding=sh.batch))
    program = step.sampler.program_for(engine)
    sample = jax.eval_shape(program, sampler_params, *unique, rand, cache)._replace(cache=None, decode_iterations=None)
    sample = _abstract(sample, jax.tree.map(lambda _: sh.batch, sample))
    per_row = sds((B,), jnp.float32, sharding=sh.batch) if step.objective.uses_rewards else None
    task = sds((B,), jnp.int32, sharding=sh.batch) if step.loss_cfg.task_names else None  # several tasks
    cross = None
    if step.crosses:  # the teachers' own token rows and the span arrays (`OPDStep._align`)
        cross = cross_batch_shapes(B, Pl, N)
        cross = _abstract(cross, jax.tree.map(lambda _: sh.batch, cross))
    rollout = RolloutArrays(prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, sample=sample, advantages_B=per_row,
                            rewards_B=per_row, task_B=task, cross=cross)
    # the frozen KL reference (loss.kl_coef > 0): the starting student's shapes in the trainer layout
    reference = (state.params,) if step.uses_reference else ()
    batch = with_sampler_full_logprobs(jax.eval_shape(step.score_fn, teacher, scoring_input(rollout), *reference),
                                       rollout)
    batch = _abstract(batch, jax.tree.map(lambda _: sh.batch, batch))
    # the full-vocabulary kinds read the scoring teacher's head per chunk
    head = (head_params(teacher[step.routing.scorer]),) if step.uses_teacher_head else ()
    return StepInputs(state=state, teacher=teacher, key=key, sampler_params=sampler_params, cache=cache,
                      unique=unique, rand=rand, rollout=rollout, reference=reference, batch=batch, head=head,
                      engine=engine, slots=slots)


def _cache(step: OPDStep, rows: int):
    """The sampler's abstract KV cache of `rows` rows at the full length (prompt + max_new_tokens)."""
    length = step.cfg.data.max_prompt_len + step.cfg.sampling.max_new_tokens
    shapes = jax.eval_shape(lambda: transformer.init_cache(step.student_cfg, rows, length,
                                                           step.cfg.rollout_precision.cache_dtype))
    return _abstract(shapes, jax.tree.map(lambda _: step.shardings.cache, shapes))


def stage_programs(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs: tuple[ModelConfig, ...], mesh):
    """The stages of `opd.step.build_step` (the very jitted functions `jopd train` calls), each with a thunk
    lowering it from abstract inputs, and the bytes per device of other stages' buffers alive while it runs.
    Returns ({stage: (lower, resident)}, {long-lived buffer: bytes per device})."""
    # Special-token masking needs the tokenizer but does not change any shape or memory.
    step = build_step(cfg, s_cfg, t_cfgs, mesh)
    return _stage_programs(step, step_inputs(step))


def _stage_programs(step: OPDStep, ins: StepInputs):
    state, teacher, reference = ins.state, ins.teacher, ins.reference
    buffers = {"train_state": _bytes(state), "teacher_params": _bytes(teacher),
               "sampler_params": _bytes(ins.sampler_params), "kv_cache": _bytes(ins.cache),
               "rollout": _bytes(ins.rollout.sample)}
    frozen = ("teacher_params",)  # held all run long
    if step.crosses:
        # the teacher's rows and span arrays (an argument of the scoring, alive from the rollout on) and the
        # projection tables (constants of the scoring program: memory_analysis does not count them, they are held
        # as long as the program is loaded)
        buffers["cross_batch"] = _bytes(ins.rollout.cross)
        buffers["projection_table"] = sum(x.nbytes for c in step.crosses for x in jax.tree.leaves(c.table))
        frozen += ("projection_table",)
    if reference:
        buffers["reference_params"] = _bytes(reference)
        frozen += ("reference_params",)
    held = lambda *names: {k: buffers[k] for k in names}  # noqa: E731
    # the rollout's part that is not the scoring's argument (the sampler's full log-softmax): alive meanwhile
    rollout_not_scored = buffers["rollout"] - _bytes(scoring_input(ins.rollout).sample)
    program = step.sampler.program_for(ins.engine)
    # `jopd train`'s loop: the sampler keeps its KV cache between steps; the sampler params and the rollout live
    # until the train step is dispatched; the train state is donated to (and replaced by) the train step.
    programs = {
        "weight_sync": (lambda: step.sync_fn.lower(state.params, ins.key),
                        {"opt_state": buffers["train_state"] - _bytes(state.params)}
                        | held(*frozen, "kv_cache")),
        "sample": (lambda: program.lower(ins.sampler_params, *ins.unique, ins.rand, ins.cache),
                   held("train_state", *frozen)),
        "teacher_scoring": (lambda: step.score_fn.lower(teacher, scoring_input(ins.rollout), *reference),
                            held("train_state", "sampler_params", "kv_cache",
                                 *(("projection_table",) if step.crosses else ()))
                            | {"rollout": rollout_not_scored}),
        "train_step": (lambda: step.update_fn.lower(state, ins.batch, *ins.head), held(*frozen, "kv_cache")),
    }
    return programs, buffers
