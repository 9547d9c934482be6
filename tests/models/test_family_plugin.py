"""A model family from outside the package: docs/examples/my_family.py (the file docs/extending.md shows), imported
by a run config's `plugins`, names the student's family, and a tiny testbed run trains that student end to end."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from jopd.models import io
from jopd.run.loop import train
from jopd.run.config import load_config
from tests.helpers.tiny_testbed import TINY, tiny_cache, write_tiny

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "my_family.py"


@pytest.mark.slow
def test_family_from_a_plugin_file_trains_end_to_end(tmp_path):
    student = TINY["student"] | {"arch": TINY["student"]["arch"] | {"family": "llama_qk_norm"}}
    path = write_tiny(tmp_path / "tiny.yaml", plugins=[str(EXAMPLE)], student=student, train={"steps": 6},
                      optim={"learning_rate": 1e-2, "warmup_steps": 0})
    out = tmp_path / "run"
    logs = []
    summary = train(load_config(str(path), [f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}"]),
                    log=logs.append)

    # The student has the family's extra leaves, and the SFT warm start (AdamW, no weight decay: a zero gradient
    # leaves a weight exactly where it is) moved them off their init of 1, so the forward applied them.
    layers = summary["state"].params["layers"]
    assert layers["q_norm"].shape == layers["k_norm"].shape == (1, TINY["student"]["arch"]["head_dim"])
    student_dir = Path(re.search(r"student: (\S+) \(trained now\)", " ".join(map(str, logs))).group(1))
    config_json = json.loads((student_dir / "config.json").read_text())
    assert (config_json["model_type"], config_json["architectures"]) == ("llama_qk_norm", ["LlamaQkNormForCausalLM"])
    cached_cfg, cached = io.load_params(student_dir)  # recognized from config.json's model_type alone
    assert cached_cfg.family == "llama_qk_norm" and cached_cfg.qk_norm and not cached_cfg.qkv_bias
    for leaf in ("q_norm", "k_norm"):
        assert np.abs(np.asarray(cached["layers"][leaf]) - 1.0).max() > 1e-3, leaf

    # OPD trained it: every step's loss finite, held-out teacher divergence down (35% in the measured run)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in steps if "loss" in m]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    before, after = summary["before"]["teacher_divergence"], summary["after"]["teacher_divergence"]
    assert after < 0.9 * before, (before, after)
    # the saved run config names the plugin by absolute path, so it loads back from anywhere
    assert load_config(str(out / "config.yaml")).student.arch.family == "llama_qk_norm"


def test_extending_doc_shows_the_example_file_as_it_is():
    doc = (EXAMPLE.parents[1] / "extending.md").read_text()
    section = doc.split("## A model family", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{EXAMPLE.read_text()}```" in section
    assert "plugins: [docs/examples/my_family.py]" in section and "family: llama_qk_norm" in section
