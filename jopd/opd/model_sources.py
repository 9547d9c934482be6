"""Getting the run's teacher, student and tokenizer: load checkpoints (optionally fine-tuned on the task), or
the CPU-testbed models (`warm_start`: trained by SFT once, then cached). Mismatched teacher/student vocabularies or chat templates are
rejected here, before any compute.
"""

from __future__ import annotations

from typing import Any

from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.models.families import FAMILIES
from jopd.opd import warm_start
from jopd.opd.run_config import ModelSource, RunConfig


def _own_tokenizer(src: ModelSource):
    """A model's tokenizer: its `tokenizer` setting, else its checkpoint's, else None (a testbed model)."""
    if src.tokenizer is not None:
        return io.load_tokenizer(src.tokenizer)
    return io.load_tokenizer(src.path) if src.path is not None else None


def run_tokenizer(cfg: RunConfig):
    """The student's tokenizer, which formats the prompts and decodes the rollouts. Without loss.cross_tokenizer
    both models share it: the teacher's, else the student's, else the toy one."""
    sources = (cfg.student,) if cfg.loss.cross_tokenizer != "off" else (cfg.teacher, cfg.student)
    for src in sources:
        tok = _own_tokenizer(src)
        if tok is not None:
            return tok
    return build_toy_tokenizer()


def teacher_tokenizer(cfg: RunConfig):
    """The teacher's tokenizer (the run's with loss.cross_tokenizer off)."""
    if cfg.loss.cross_tokenizer == "off":
        return run_tokenizer(cfg)
    return _own_tokenizer(cfg.teacher) or build_toy_tokenizer()


def testbed_model_config(src: ModelSource, tokenizer) -> ModelConfig:
    a = src.arch
    return ModelConfig(
        family=a.family, vocab_size=len(tokenizer), hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, tie_word_embeddings=a.tie_word_embeddings,
        **FAMILIES[a.family].switches(),
        max_position_embeddings=a.max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def get_model(role: str, src: ModelSource, cfg: RunConfig, tokenizer) -> tuple[ModelConfig, Any, str]:
    """(model config, params, where it came from) for `role` in {teacher, student}."""
    dtype = DTYPES[src.dtype]
    if src.path is not None:
        load = lambda: io.load_params(src.path, dtype=dtype, num_layers=src.num_layers)
        if src.resolved_warm_start().steps > 0:  # fine-tune the checkpoint on the task first (cached)
            return warm_start.sft_model(role, src, cfg, tokenizer, load)
        cut = f" (first {src.num_layers} layers)" if src.num_layers else ""
        return *load(), f"{io.resolve_model_path(src.path)}{cut}"
    return warm_start.testbed_model(role, src, cfg, testbed_model_config(src, tokenizer), tokenizer)


def precheck_sources(cfg: RunConfig) -> None:
    """Cheap checks on configs/metadata only (no weights read): files exist, vocabularies agree."""
    cfgs = {}
    for role, src in (("teacher", cfg.teacher), ("student", cfg.student)):
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
    if cfg.loss.cross_tokenizer != "off":  # another tokenizer: the pair must align (one line if not)
        from jopd import crosstok

        try:
            crosstok.check_pair(run_tokenizer(cfg), teacher_tokenizer(cfg))
        except crosstok.PairError as e:
            raise ValueError(f"RunConfig.loss.cross_tokenizer: {e}") from None
    elif len(cfgs) == 2:
        check_compatible(cfgs["student"], cfgs["teacher"], None, None)
        check_compatible(cfgs["student"], cfgs["teacher"], run_tokenizer(cfg), teacher_tokenizer(cfg))


def check_compatible(student_cfg: ModelConfig, teacher_cfg: ModelConfig, student_tok, teacher_tok) -> None:
    """Distillation compares distributions token by token: the two models must share the vocabulary."""
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        raise ValueError(f"teacher/student vocab mismatch: teacher vocab_size={teacher_cfg.vocab_size}, "
                         f"student vocab_size={student_cfg.vocab_size} (a teacher with another tokenizer: set "
                         f"loss.cross_tokenizer)")
    if student_tok is not None and teacher_tok is not None:
        if student_tok.get_vocab() != teacher_tok.get_vocab():
            raise ValueError("teacher/student tokenizer mismatch: same size but different token ids")
        if (student_tok.chat_template or "") != (teacher_tok.chat_template or ""):
            raise ValueError("teacher/student chat_template mismatch: prompts would be formatted differently")
