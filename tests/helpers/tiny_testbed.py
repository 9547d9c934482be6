"""The smallest testbed run config the end-to-end tests train (seconds per run; models cached per test)."""

import os
from pathlib import Path

import yaml

TINY = {
    "teacher": {"arch": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                         "num_kv_heads": 1, "head_dim": 16}, "warm_start": {"steps": 30, "batch_size": 16}},
    "student": {"arch": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2,
                         "num_kv_heads": 1, "head_dim": 8}, "warm_start": {"steps": 10, "batch_size": 16}},
    "data": {"batch_size": 8, "eval_batch_size": 16, "arithmetic": {"max_steps": 1, "heldout_size": 24}},
    "sampling": {"max_new_tokens": 10},
    "loss": {"top_k": 16},
    "train": {"steps": 3, "eval_problems": 24, "eval_max_new_tokens": 10, "log_rollouts": 0},
    "checkpoint": {"every": 100, "async_save": False},
}


def write_tiny(path: Path, **sections) -> Path:
    """TINY with some sections merged over (e.g. train={"steps": 2}), written as YAML to `path`."""
    data = {k: (v | sections[k] if k in sections else v) for k, v in TINY.items()}
    data |= {k: v for k, v in sections.items() if k not in TINY}
    path.write_text(yaml.safe_dump(data))
    return path


_CACHE: list[Path] = []


def tiny_cache() -> Path:
    """One model cache for the whole test session: the tiny testbed models are trained once (by the first test
    that needs them), not once per test or per xdist worker: the session's $JOPD_CACHE (tests/conftest.py; two
    workers training the same model at once each keep their own, `warm_start.sft_model`), else a temporary
    directory removed at exit."""
    if not _CACHE and os.environ.get("JOPD_CACHE"):
        _CACHE.append(Path(os.environ["JOPD_CACHE"]) / "tiny-testbed")
    if not _CACHE:
        import atexit
        import shutil
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="jopd-tiny-cache-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _CACHE.append(path)
    return _CACHE[0]
