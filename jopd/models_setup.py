"""Getting the run's teacher, student and tokenizer: load checkpoints, or build the CPU-testbed models.

A testbed model (`ModelSource.path: null`) is trained from scratch by SFT on worked solutions and cached under
`<cache>/testbed-<role>-<hash>` as an HF directory (the hash covers everything that changes the result), so the
second run starts in seconds. Mismatched teacher/student vocabularies or chat templates are rejected here,
before any compute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jopd.config import MODEL_DTYPES, ModelSource, RunConfig, WarmStartConfig
from jopd.data.pipeline import DataConfig, train_iterator
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.losses import LossConfig
from jopd.models import io, transformer
from jopd.models.config import ModelConfig
from jopd.objectives import sft_loss_fn
from jopd.optim import OptimConfig, make_optimizer
from jopd.train_step import init_train_state, jit_train_step, make_train_step

_FORMAT_VERSION = 1  # bump when the testbed recipe changes in a way the hash does not see


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.train.cache_dir or os.environ.get("JOPD_CACHE") or Path.home() / ".cache" / "jopd")


def run_tokenizer(cfg: RunConfig):
    """The tokenizer both models share: the teacher's checkpoint's, else the student's, else the toy one."""
    for src in (cfg.teacher, cfg.student):
        if src.path is not None:
            return io.load_tokenizer(src.path)
    return build_toy_tokenizer()


def testbed_model_config(src: ModelSource, tokenizer) -> ModelConfig:
    a = src.arch
    return ModelConfig(
        family=a.family, vocab_size=len(tokenizer), hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, tie_word_embeddings=a.tie_word_embeddings,
        qkv_bias=a.family == "qwen2", qk_norm=a.family == "qwen3",
        max_position_embeddings=a.max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def run_sft(model_cfg: ModelConfig, params, data_cfg: DataConfig, tokenizer, warm: WarmStartConfig,
            desc: str = "sft", dtype=jnp.float32):
    """Plain SFT (cross-entropy on the worked solution) with the generic train step; returns the params."""
    data_cfg = dataclasses.replace(data_cfg, batch_size=warm.batch_size, seed=warm.seed)
    it = train_iterator(data_cfg, tokenizer, kind="sft")
    opt = make_optimizer(OptimConfig(learning_rate=warm.learning_rate, warmup_steps=warm.warmup_steps,
                                     weight_decay=0.0), warm.steps)
    state = init_train_state(params, opt, jax.random.key(warm.seed))
    step = jit_train_step(make_train_step(sft_loss_fn(model_cfg, LossConfig(kind="sft"), dtype), opt))
    bar = tqdm(range(warm.steps), desc=desc, dynamic_ncols=True)
    pending = None
    for i in bar:
        b = next(it)
        state, metrics = step(state, {k: b[k] for k in ("tokens", "attn_mask", "loss_mask")})
        if pending is not None and (i % 10 == 0 or i == warm.steps - 1):
            bar.set_postfix(loss=f"{float(pending['loss']):.3f}")  # previous step's: never stalls dispatch
        pending = metrics
    return state.params


def _testbed_key(role: str, src: ModelSource, data_cfg: DataConfig, tokenizer) -> str:
    blob = json.dumps({
        "v": _FORMAT_VERSION, "role": role, "arch": dataclasses.asdict(src.arch),
        "warm": dataclasses.asdict(src.warm_start), "dtype": src.dtype,
        "task": dataclasses.asdict(data_cfg.arithmetic) if data_cfg.task == "arithmetic" else
        [data_cfg.train_path], "lens": [data_cfg.max_prompt_len, data_cfg.max_response_len],
        "system": data_cfg.system_prompt, "vocab": sorted(tokenizer.get_vocab().items()),
        "template": tokenizer.chat_template,
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def get_model(role: str, src: ModelSource, cfg: RunConfig, tokenizer) -> tuple[ModelConfig, Any, str]:
    """(model config, params, where it came from) for `role` in {teacher, student}."""
    dtype = jnp.dtype(MODEL_DTYPES[src.dtype])
    if src.path is not None:
        model_cfg, params = io.load_params(src.path, dtype=dtype, num_layers=src.num_layers)
        cut = f" (first {src.num_layers} layers)" if src.num_layers else ""
        return model_cfg, params, f"{io.resolve_model_path(src.path)}{cut}"
    model_dir = cache_root(cfg) / f"testbed-{role}-{_testbed_key(role, src, cfg.data, tokenizer)}"
    if (model_dir / "config.json").is_file():
        model_cfg, params = io.load_params(model_dir, dtype=dtype)
        return model_cfg, params, f"{model_dir} (cached)"
    model_cfg = testbed_model_config(src, tokenizer)
    params = transformer.init_params(model_cfg, jax.random.key(src.warm_start.seed), dtype)
    params = run_sft(model_cfg, params, cfg.data, tokenizer, src.warm_start, desc=f"SFT {role}", dtype=dtype)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    io.save_hf(jax.device_get(params), model_cfg, tmp, tokenizer=tokenizer)
    os.replace(tmp, model_dir)  # atomic: a killed run never leaves a half-written cache entry
    return model_cfg, params, f"{model_dir} (trained now)"


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
    if len(cfgs) == 2:
        check_compatible(cfgs["student"], cfgs["teacher"], None, None)
        check_compatible(cfgs["student"], cfgs["teacher"], io.load_tokenizer(cfg.student.path),
                         io.load_tokenizer(cfg.teacher.path))


def check_compatible(student_cfg: ModelConfig, teacher_cfg: ModelConfig, student_tok, teacher_tok) -> None:
    """Distillation compares distributions token by token: the two models must share the vocabulary."""
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        raise ValueError(f"teacher/student vocab mismatch: teacher vocab_size={teacher_cfg.vocab_size}, "
                         f"student vocab_size={student_cfg.vocab_size}")
    if student_tok is not None and teacher_tok is not None:
        if student_tok.get_vocab() != teacher_tok.get_vocab():
            raise ValueError("teacher/student tokenizer mismatch: same size but different token ids")
        if (student_tok.chat_template or "") != (teacher_tok.chat_template or ""):
            raise ValueError("teacher/student chat_template mismatch: prompts would be formatted differently")
