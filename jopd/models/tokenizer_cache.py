"""GGUF tokenizers converted once per machine: transformers builds a GGUF file's tokenizer by parsing the whole file's
metadata (6-10 s for SmolLM2's 49152-token vocabulary on 2 cores), so every process that needs it (a run, `jopd
generate`, each test worker) would pay that again. The converted tokenizer is saved next to the SFT cache
(`$JOPD_CACHE`, default ~/.cache/jopd) under a key of the file's version and the transformers version, and read back
from its tokenizer.json (~0.2 s). The saved copy is what `save_pretrained` writes (tokenizer.json, its config, the
chat template): the same vocabulary, merges, special tokens and chat template as the built one (tests check)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable


def jopd_cache_dir() -> Path:
    """Where jopd caches what it builds (SFT'd testbed models, converted tokenizers): $JOPD_CACHE, else
    ~/.cache/jopd (a run's `train.cache_dir` overrides it for its models)."""
    return Path(os.environ.get("JOPD_CACHE") or Path.home() / ".cache" / "jopd")


def entry_dir(version: tuple[str, int, int], root: Path | None = None) -> Path:
    """The cache entry of one GGUF file version ((resolved path, size, mtime ns)) under this transformers."""
    import transformers

    digest = hashlib.sha256(repr((version, transformers.__version__)).encode()).hexdigest()[:12]
    return (root or jopd_cache_dir()) / "tokenizers" / f"{Path(version[0]).stem}-{digest}"


def load_or_build(version: tuple[str, int, int], build: Callable[[], Any], root: Path | None = None) -> Any:
    """The cached tokenizer of this file version, or `build()` saved to the cache first. A cache that cannot be
    written (read-only home) only costs the build; two processes building at once both succeed (the first rename
    wins, the other's copy is dropped)."""
    from transformers import PreTrainedTokenizerFast

    entry = entry_dir(version, root)
    if (entry / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(entry))
    tokenizer = build()
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, entry)  # atomic: a reader never sees a half-written entry
    except OSError:  # not writable, or another process's entry landed first: ours is not needed
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
