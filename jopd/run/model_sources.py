"""Getting the run's teacher, student and tokenizer: load checkpoints (optionally fine-tuned on the task), or
the CPU-testbed models (`warm_start`: trained by SFT once, then cached). Mismatched teacher/student vocabularies or chat templates are
rejected here, before any compute (`precheck_sources`, with `opd.validate`'s checks of the models' configs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.models.families import FAMILIES
from jopd.run import warm_start
from jopd.data.mixture import task_sources
from jopd.data.pipeline import DataConfig
from jopd.data.tasks import TASKS
from jopd.run.config import ModelSource, RunConfig, TeacherSource
from jopd.opd.validate import check_compatible, check_models


def model_tokenizer(src: ModelSource):
    """A model's tokenizer: its `tokenizer` setting, else its checkpoint's, else None (a testbed model)."""
    if src.tokenizer is not None:
        return io.load_tokenizer(src.tokenizer)
    return io.load_tokenizer(src.path) if src.path is not None else None


def run_tokenizer(cfg: RunConfig):
    """The student's tokenizer, which formats the prompts and decodes the rollouts. Without loss.cross_tokenizer
    the models share it: the (first) teacher's, else the student's, else the toy one."""
    sources = (cfg.student,) if cfg.loss.cross_tokenizer != "off" else (*cfg.teacher_sources(), cfg.student)
    for src in sources:
        tok = model_tokenizer(src)
        if tok is not None:
            return tok
    return build_toy_tokenizer()


def teacher_tokenizers(cfg: RunConfig) -> tuple[Any, ...]:
    """Each teacher's tokenizer, in `teacher_sources` order: the run's with loss.cross_tokenizer off; else its own
    (its `tokenizer`, else its checkpoint's, else the toy one)."""
    if cfg.loss.cross_tokenizer == "off":
        return (run_tokenizer(cfg),) * len(cfg.teacher_sources())
    return tuple(model_tokenizer(src) or build_toy_tokenizer() for src in cfg.teacher_sources())


def teacher_tokenizer(cfg: RunConfig):
    """The (first) teacher's tokenizer (the run's with loss.cross_tokenizer off)."""
    return teacher_tokenizers(cfg)[0]


def shares_vocabulary(student_tok, teacher_tok) -> bool:
    """The same token ids, EOS and chat template: a teacher that can score the student's tokens as they are."""
    return (student_tok.get_vocab() == teacher_tok.get_vocab() and student_tok.eos_token_id == teacher_tok.eos_token_id
            and (student_tok.chat_template or "") == (teacher_tok.chat_template or ""))


def scores_student_tokens(cfg: RunConfig, student_tok, teacher_tok, student_cfg: ModelConfig | None = None,
                          teacher_cfg: ModelConfig | None = None) -> bool:
    """In a loss.cross_tokenizer run, whether a teacher scores the student's tokens directly
    (`cross_teacher.same_vocab_fields`): one of `teachers` that shares the student's vocabulary (without both
    tokenizers, as `jopd aot` may size a run: the same vocabulary size); the run's one `teacher` always scores its
    own tokenization (the cross path its config asks for)."""
    if not cfg.teachers:
        return False
    if student_tok is None or teacher_tok is None:
        return student_cfg.vocab_size == teacher_cfg.vocab_size
    return shares_vocabulary(student_tok, teacher_tok)


def cross_teachers(cfg: RunConfig, student_tok, teacher_toks, student_cfg: ModelConfig,
                   teacher_cfgs: tuple[ModelConfig, ...]):
    """`build_step`'s `cross`, one entry per teacher: its `CrossTeacher` (its pair checked, its projection table
    built) with loss.cross_tokenizer, None for a teacher that scores the student's tokens (`scores_student_tokens`;
    its vocab_size then checked like any same-vocabulary teacher's), None for every teacher with it off."""
    from jopd.opd.cross_teacher import CrossTeacher

    if cfg.loss.cross_tokenizer == "off":
        return (None,) * len(teacher_cfgs)
    out = []
    for role, tok, t_cfg in zip(cfg.teacher_roles(), teacher_toks, teacher_cfgs):
        direct = scores_student_tokens(cfg, student_tok, tok)
        if direct:
            check_compatible(student_cfg, t_cfg, None, None, role)
        out.append(None if direct else CrossTeacher.make(student_tok, tok, student_cfg, t_cfg, cfg.data.system_prompt))
    return tuple(out)


def testbed_model_config(src: ModelSource, tokenizer) -> ModelConfig:
    a = src.arch
    return ModelConfig(
        family=a.family, vocab_size=len(tokenizer), hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, tie_word_embeddings=a.tie_word_embeddings,
        **FAMILIES[a.family].switches(), **a.experts(),
        max_position_embeddings=a.max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def get_model(role: str, src: ModelSource, cfg: RunConfig, tokenizer, data: DataConfig | None = None
              ) -> tuple[ModelConfig, Any, str]:
    """(model config, params, where it came from) for `role` in {teacher, student}. `data`: what its SFT warm
    start trains on (default: the run's data)."""
    model_cfg, params, where = _get_model(role, src, cfg, tokenizer, data)
    return with_attention(model_cfg, src), params, where


def with_attention(model_cfg: ModelConfig, src: ModelSource) -> ModelConfig:
    """The model as `src` runs it: its `attention` implementation (how it computes, not what it is: the SFT warm
    start and its cache key do not depend on it)."""
    return dataclasses.replace(model_cfg, attention=src.attention)


def _get_model(role: str, src: ModelSource, cfg: RunConfig, tokenizer, data: DataConfig | None
               ) -> tuple[ModelConfig, Any, str]:
    dtype = DTYPES[src.dtype]
    data = cfg.data if data is None else data
    if src.path is not None:
        load = lambda: io.load_params(src.path, dtype=dtype, num_layers=src.num_layers)
        if src.resolved_warm_start().steps > 0:  # fine-tune the checkpoint on the task first (cached)
            return warm_start.sft_model(role, src, cfg, tokenizer, load, data)
        cut = f" (first {src.num_layers} layers)" if src.num_layers else ""
        return *load(), f"{io.resolve_model_path(src.path)}{cut}"
    return warm_start.testbed_model(role, src, cfg, testbed_model_config(src, tokenizer), tokenizer, data)


def teacher_data(cfg: RunConfig, src: TeacherSource) -> DataConfig:
    """What a teacher's SFT warm start trains on: its `tasks` alone (one registered task as `data.task`, so the
    specialist is the same cached model a single-task run makes), else the run's whole stream."""
    if not src.tasks:
        return cfg.data
    if len(src.tasks) == 1 and src.tasks[0] in TASKS.names():
        return dataclasses.replace(cfg.data, task=src.tasks[0], mix={})
    weights = {s.name: s.weight for s in task_sources(cfg.data)}
    return dataclasses.replace(cfg.data, mix={t: weights[t] for t in src.tasks})


def get_teachers(cfg: RunConfig, tokenizers: tuple[Any, ...]) -> tuple[tuple[ModelConfig, ...], tuple[Any, ...],
                                                                   list[str]]:
    """Every teacher of the run (`teachers`, or `teacher`), each made or loaded like the one teacher, with its
    tokenizer (`teacher_tokenizers`: a testbed teacher's vocabulary and its SFT warm start's)."""
    out = [get_model("teacher", src, cfg, tok, teacher_data(cfg, src))
           for src, tok in zip(cfg.teacher_sources(), tokenizers)]
    return tuple(o[0] for o in out), tuple(o[1] for o in out), [o[2] for o in out]


def precheck_sources(cfg: RunConfig) -> None:
    """Cheap checks on configs/metadata only (no weights read): files exist, vocabularies agree."""
    cfgs = {}
    roles = list(zip(cfg.teacher_roles(), cfg.teacher_sources()))
    for role, src in roles + [("student", cfg.student)]:
        if src.path is not None:
            if not io.resolve_model_path(src.path).exists():
                raise FileNotFoundError(f"RunConfig.{role}.path: {src.path} does not exist")
            try:
                cfgs[role] = io.open_checkpoint(src.path, src.num_layers)[0]
            except ValueError as e:
                raise ValueError(f"RunConfig.{role}: {e}") from None
        elif src.num_layers is not None:
            raise ValueError(f"RunConfig.{role}.num_layers: only applies to a checkpoint `path` (the testbed "
                             f"recipe sets its size in `arch`)")
    own = [False] * len(roles)
    if cfg.loss.cross_tokenizer != "off":  # another tokenizer: the pair must align (one line if not)
        from jopd import crosstok

        student_tok = run_tokenizer(cfg)
        for i, ((role, _), tok) in enumerate(zip(roles, teacher_tokenizers(cfg))):
            if scores_student_tokens(cfg, student_tok, tok):  # scored directly: one vocabulary
                continue
            own[i] = True
            try:
                crosstok.check_pair(student_tok, tok)
            except crosstok.PairError as e:
                where = f"{role}.tokenizer" if cfg.teachers else "loss.kind"
                raise ValueError(f"RunConfig.{where}: {e}" + (f" (loss.kind={cfg.loss.kind})" if cfg.teachers else "")
                                 ) from None
    check_models(cfg, cfgs.get("student"), [cfgs.get(role) for role, _ in roles], own)
    if cfg.loss.cross_tokenizer == "off" and "student" in cfgs:  # same size: the same ids and chat template too
        for role, src in roles:
            if role in cfgs:
                check_compatible(cfgs["student"], cfgs[role], run_tokenizer(cfg),
                                 model_tokenizer(src) or teacher_tokenizer(cfg), role)


