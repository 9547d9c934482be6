"""Metrics sinks: one JSON line per step, TensorBoard scalars, and PNG curves at the end of a run."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


def _scalar(v: Any) -> float | int | str:
    if isinstance(v, (str, int)):
        return v
    a = np.asarray(v)
    return a.item() if a.size == 1 else float(a.mean())


def tensorboard_writer(log_dir: str):
    """tensorboardX's SummaryWriter on `log_dir`, or None when tensorboardX is not installed.

    tensorboardX imports torch when it can (to take torch tensors as values), seconds of every `jopd train`'s start
    where torch is installed. jopd logs Python floats, so unless torch is already loaded, that
    import is refused (a None in sys.modules makes `import torch` raise ImportError, which tensorboardX handles)
    for the moment tensorboardX is imported; torch stays importable afterwards."""
    import sys

    refuse = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if refuse:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    finally:
        if refuse:
            del sys.modules["torch"]
    return SummaryWriter(log_dir)


class MetricsWriter:
    """Writes `metrics.jsonl` (+ TensorBoard events when tensorboardX is importable) under `out_dir`.

    Only process 0 writes; other processes get a no-op writer so multi-host runs produce one log.
    """

    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = True):
        self.out_dir = out_dir
        self.enabled = enabled
        self._tb = None
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            self._jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "a", buffering=1)
            if tensorboard:  # TensorBoard is optional; JSONL is the source of truth
                self._tb = tensorboard_writer(os.path.join(out_dir, "tb"))

    def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        row = {f"{prefix}{k}": _scalar(v) for k, v in metrics.items()}
        row["step"] = int(step)
        if self.enabled:
            self._jsonl.write(json.dumps(row) + "\n")
            if self._tb is not None:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(k, v, step)
        return row

    def close(self):
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(jsonl_path: str, png_path: str, keys: list[str], title: str = "") -> str:
    """One subplot per metric key found in the JSONL (x = step); returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(jsonl_path)
    logged = [k for k in keys if any(k in r for r in rows)]
    if not logged:
        raise ValueError(f"{jsonl_path}: none of the metrics {keys} were logged")
    keys = logged
    cols = min(4, len(keys))
    rows_n = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, k in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if k in r and isinstance(r[k], (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    # fixed margins in inches, not tight_layout: that draws the whole figure once more to measure its text (a third
    # of the plot's time, paid at the end of every run)
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=0.65 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - (0.6 if title else 0.3) / height, wspace=0.32, hspace=0.42)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
