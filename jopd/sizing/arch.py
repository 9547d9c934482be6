"""The models of a run as `jopd aot` sizes them, from metadata only: architectures (an HF `config.json`, a .gguf's
metadata or the testbed recipe), parameter counts, and the cross-tokenizer teachers the step is lowered with
(the run's own, or a stand-in table without tokenizers)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jopd import crosstok
from jopd.models import io, transformer
from jopd.models.config import ModelConfig
from jopd.models.hf_io import INDEX_FILE, SINGLE_FILE, read_hf_config
from jopd.opd.cross_teacher import CrossTeacher
from jopd.run.config import ModelSource, RunConfig


def model_config_of(src: ModelSource, role: str, tokenizer=None) -> ModelConfig:
    """`_architecture_of(src, ...)` as `src` runs it (its `attention`)."""
    from jopd.run.model_sources import with_attention

    return with_attention(_architecture_of(src, role, tokenizer), src)


def _architecture_of(src: ModelSource, role: str, tokenizer=None) -> ModelConfig:
    """The architecture of a run's model from metadata only: an HF directory's `config.json` (weights need not
    be there: `configs/arch/<name>/` holds config-only directories of real models), a .gguf's metadata, or,
    for `path: null`, the testbed recipe (`arch` with `tokenizer`'s vocabulary; default the toy tokenizer's)."""
    if src.path is None:
        from jopd.data.toy_tokenizer import build_toy_tokenizer
        from jopd.run.model_sources import testbed_model_config

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
    from jopd.run import model_sources

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
    from jopd.run.model_sources import scores_student_tokens

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
