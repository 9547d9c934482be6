"""Optax optimizer for the student: AdamW, linear warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

import optax
import pydantic

from jopd.config_dataclass import config_dataclass


@config_dataclass
class OptimConfig:
    learning_rate: float = pydantic.Field(1e-4, gt=0)  # peak LR after warmup
    warmup_steps: int = pydantic.Field(10, ge=0)
    decay_steps: int = pydantic.Field(0, ge=0)  # cosine decay horizon; 0 = the run's total steps
    end_lr_fraction: float = pydantic.Field(0.1, ge=0, le=1)  # final LR = peak * this
    weight_decay: float = pydantic.Field(0.0, ge=0)
    b1: float = pydantic.Field(0.9, ge=0, lt=1)
    b2: float = pydantic.Field(0.95, ge=0, lt=1)
    eps: float = pydantic.Field(1e-8, gt=0)
    grad_clip_norm: float = pydantic.Field(1.0, ge=0)  # 0 disables clipping
    grad_accum_steps: int = pydantic.Field(1, ge=1)  # micro-batches per update (scanned inside the step)


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=decay, end_value=cfg.learning_rate * cfg.end_lr_fraction)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm > 0 else []
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
