"""The run's metric sinks: metrics.jsonl, TensorBoard scalars (read back from the event file's records), the
curves PNG, and that opening TensorBoard's writer does not import torch."""

import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jopd.run.metrics_log import MetricsWriter, plot_curves, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _tensorboard_scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    """(step, tag) -> value of every scalar in the event files (TFRecord framing: length, its CRC, the Event, its
    CRC), parsed with tensorboardX's own Event proto."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            out |= {(event.step, v.tag): v.simple_value for v in event.summary.value}
            i += 12 + n + 4
    return out


def test_rows_go_to_jsonl_and_finite_numbers_to_tensorboard(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": 0.25, "kl": np.float32(0.5)})
    writer.write(2, {"loss": float("nan"), "note": "x", "per_row": np.array([1.0, 3.0])}, prefix="eval/")
    writer.close()
    assert read_jsonl(str(tmp_path / "metrics.jsonl"))[0] == {"loss": 0.25, "kl": 0.5, "step": 1}
    second = read_jsonl(str(tmp_path / "metrics.jsonl"))[1]
    assert math.isnan(second["eval/loss"]) and second["eval/note"] == "x" and second["eval/per_row"] == 2.0
    # the NaN and the string are not scalars TensorBoard can plot: left out there, kept in the JSONL
    assert _tensorboard_scalars(tmp_path / "tb") == {(1, "loss"): 0.25, (1, "kl"): 0.5, (2, "eval/per_row"): 2.0}


def test_opening_tensorboards_writer_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # installed with the test extra: tensorboardX would import it
    code = ("import sys; from jopd.run.metrics_log import MetricsWriter; "
            f"w = MetricsWriter({str(tmp_path)!r}); w.write(1, {{'loss': 1.0}}); w.close(); "
            "assert w._tb is not None, 'no TensorBoard writer'; "
            "assert 'torch' not in sys.modules, 'torch was imported'; import torch")  # and torch still imports
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert _tensorboard_scalars(tmp_path / "tb") == {(1, "loss"): 1.0}


def test_curves_png_has_a_panel_per_logged_key_and_an_empty_log_is_named(tmp_path):
    import matplotlib.image

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"loss": 1.0 / step, "reward": 0.1 * step})
    writer.close()
    jsonl = str(tmp_path / "metrics.jsonl")
    one = matplotlib.image.imread(plot_curves(jsonl, str(tmp_path / "one.png"), ["loss", "missing"]))
    two = matplotlib.image.imread(plot_curves(jsonl, str(tmp_path / "two.png"), ["loss", "reward", "missing"]))
    assert one.shape[0] == two.shape[0] and two.shape[1] > 1.5 * one.shape[1]  # one more panel, side by side
    assert one.std() > 0.05  # something was drawn
    with pytest.raises(ValueError, match=r"metrics.jsonl: none of the metrics \[.missing.\] were logged"):
        plot_curves(jsonl, str(tmp_path / "none.png"), ["missing"])
