"""Models made by SFT on the task's worked solutions, then cached: the CPU testbed's (trained from scratch,
`ModelSource.path: null`) and fine-tuned checkpoints (`path` with `warm_start.steps` > 0).

Each is cached under `<cache>/{testbed,sft}-<role>-<hash>` as an HF directory (the hash covers everything that
changes the result), so the second run starts in seconds; the cache entry is written atomically, so a killed
run never leaves half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
from tqdm.auto import tqdm

from jopd.data.pipeline import DataConfig, train_iterator
from jopd.data import mixture
from jopd.data.mixture import batch_rows, task_sources
from jopd.models import io, transformer
from jopd.models.attention_mesh import runs_on
from jopd.models.tokenizer_cache import jopd_cache_dir
from jopd.models.config import ModelConfig
from jopd.models.dtypes import DTYPES
from jopd.opd.optim import OptimConfig, make_optimizer
from jopd.run.config import EXPERT_FIELDS, ModelSource, RunConfig, WarmStartConfig
from jopd.opd.student_loss import sft_loss_fn
from jopd.opd.train_state import init_train_state, make_train_step

_FORMAT_VERSION = 1  # bump when the testbed recipe changes in a way the hash does not see


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.train.cache_dir) if cfg.train.cache_dir else jopd_cache_dir()


def run_sft(model_cfg: ModelConfig, params, data_cfg: DataConfig, tokenizer, warm: WarmStartConfig,
            desc: str = "sft", dtype=DTYPES["fp32"]):
    """Plain SFT (cross-entropy on the worked solution) with the generic train step; returns the params."""
    if data_cfg.mix:  # each task's share of an SFT batch must be whole too
        batch_rows(task_sources(data_cfg), warm.batch_size, f"{desc}: warm_start.batch_size")
    data_cfg = dataclasses.replace(data_cfg, batch_size=warm.batch_size, seed=warm.seed)
    it = train_iterator(data_cfg, tokenizer, kind="sft")
    opt = make_optimizer(OptimConfig(learning_rate=warm.learning_rate, warmup_steps=warm.warmup_steps,
                                     weight_decay=0.0), warm.steps)
    state = init_train_state(params, opt, jax.random.key(warm.seed))
    loss_fn = sft_loss_fn(model_cfg, dtype, response_from=data_cfg.max_prompt_len)
    step = jax.jit(make_train_step(loss_fn, opt), donate_argnums=0)
    bar = tqdm(range(warm.steps), desc=desc, dynamic_ncols=True)
    pending = None
    for i in bar:
        b = next(it)
        with runs_on(jax.default_backend()):  # on this host's devices: only its attention branch traced
            state, metrics = step(state, {k: b[k] for k in ("tokens", "attn_mask", "loss_mask")})
        if pending is not None and (i % 10 == 0 or i == warm.steps - 1):
            bar.set_postfix(loss=f"{float(pending['loss']):.3f}")  # previous step's: never stalls dispatch
        pending = metrics
    return state.params


def _checkpoint_fingerprint(path: str) -> dict[str, Any]:
    """Which checkpoint a fine-tune started from: its resolved path and the sizes of its files."""
    root = io.resolve_model_path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {"path": str(root), "files": [[str(p.relative_to(root.parent)), p.stat().st_size] for p in files]}


def sft_key(role: str, src: ModelSource, data_cfg: DataConfig, tokenizer) -> str:
    fields = {
        "v": _FORMAT_VERSION, "role": role, "warm": dataclasses.asdict(src.resolved_warm_start()),
        "dtype": src.dtype,
        "task": mixture.cache_key(data_cfg), "lens": [data_cfg.max_prompt_len, data_cfg.max_response_len],
        "system": data_cfg.system_prompt, "vocab": sorted(tokenizer.get_vocab().items()),
        "template": tokenizer.chat_template,
    }
    if src.path is None:
        dense = {k: v for k, v in dataclasses.asdict(src.arch).items() if k not in EXPERT_FIELDS}
        fields["arch"] = dense | src.arch.experts()  # a dense model's key is the one it had before MoE fields
    else:
        fields.update(start=_checkpoint_fingerprint(src.path), num_layers=src.num_layers)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def sft_model(role: str, src: ModelSource, cfg: RunConfig, tokenizer,
              initial: Callable[[], tuple[ModelConfig, Any]], data: DataConfig | None = None
              ) -> tuple[ModelConfig, Any, str]:
    """(model config, params, where from): the cached entry, or `initial()` trained by SFT on `data` (default:
    the run's) now (then cached)."""
    dtype = DTYPES[src.dtype]
    data = cfg.data if data is None else data
    prefix = "testbed" if src.path is None else "sft"
    model_dir = cache_root(cfg) / f"{prefix}-{role}-{sft_key(role, src, data, tokenizer)}"
    if (model_dir / "config.json").is_file():
        model_cfg, params = io.load_params(model_dir, dtype=dtype)
        return model_cfg, params, f"{model_dir} (cached)"
    model_cfg, params = initial()
    name = getattr(src, "name", "") or role
    params = run_sft(model_cfg, params, data, tokenizer, src.resolved_warm_start(), desc=f"SFT {name}", dtype=dtype)
    tmp = model_dir.with_name(f"{model_dir.name}.tmp{os.getpid()}")  # this process's own: two runs may share a cache
    shutil.rmtree(tmp, ignore_errors=True)
    io.save_hf(jax.device_get(params), model_cfg, tmp, tokenizer=tokenizer)
    try:
        os.replace(tmp, model_dir)  # atomic: a killed run never leaves a half-written cache entry
    except OSError:
        if not (model_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another run cached this key first (the same recipe): keep its copy
    return model_cfg, params, f"{model_dir} (trained now)"


def testbed_model(role: str, src: ModelSource, cfg: RunConfig, model_cfg: ModelConfig, tokenizer,
                  data: DataConfig | None = None) -> tuple[ModelConfig, Any, str]:
    """A testbed model: `model_cfg` initialized at random, then SFT on `data` (or its cached result)."""
    init = lambda: (model_cfg, transformer.init_params(model_cfg, jax.random.key(src.resolved_warm_start().seed),
                                                       DTYPES[src.dtype]))
    return sft_model(role, src, cfg, tokenizer, init, data)
