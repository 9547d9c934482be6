"""Two teachers end to end: a tiny run on the arithmetic + counting mix, each teacher SFT-made on its own task and
routed to its rows, logs per-task metrics every step, evaluates and probes per task, and `jopd aot` sizes both
teachers; `jopd compare` judges each task of two such evals."""

import csv
import json

import jax
import numpy as np
import pytest
import yaml

from jopd import cli
from jopd.lab.probe import training_probe
from jopd.sizing.aot import compile_opd_step
from jopd.sizing.arch import model_config_of
from jopd.run.loop import train
from jopd.run.config import load_config
from jopd.models import transformer
from tests.helpers.tiny_testbed import TINY, tiny_cache

COUNTING = {"max_items": 4, "heldout_size": 24}
TEACHERS = [dict(TINY["teacher"], name="arith", tasks=["arithmetic"]),
            dict(TINY["teacher"], name="count", tasks=["counting"])]


def _config(tmp_path, *overrides):
    # 16 rows on the suite's 8 CPU devices: each batch shard holds one row of each teacher
    spec = {k: v for k, v in TINY.items() if k != "teacher"} | {
        "teachers": TEACHERS, "data": TINY["data"] | {"batch_size": 16, "mix": {"arithmetic": 1, "counting": 1}, "counting": COUNTING},
        "train": TINY["train"] | {"steps": 2, "probe_every": 2, "probe_problems": 6}}
    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_config(str(path), [f"train.out_dir={tmp_path / 'run'}", f"train.cache_dir={tiny_cache()}",
                                   *overrides])


@pytest.fixture(scope="module")
def multi_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi")
    cfg = _config(tmp)
    summary = train(cfg, log=lambda *_: None, probe_hook=training_probe)
    return tmp, cfg, summary


@pytest.mark.slow
def test_a_two_teacher_run_logs_evaluates_and_probes_per_task(multi_run):
    tmp, cfg, summary = multi_run
    out = tmp / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        for task in ("arithmetic", "counting"):
            assert r[f"task/{task}/num_tokens"] > 0
            assert np.isfinite(r[f"task/{task}/teacher_kl_k1"]) and np.isfinite(r[f"task/{task}/loss"])
            assert r[f"task/{task}/response_len"] > 0
        # the batch's k1 is the token-weighted mean of the tasks'
        n = [r[f"task/{t}/num_tokens"] for t in ("arithmetic", "counting")]
        k1 = [r[f"task/{t}/teacher_kl_k1"] for t in ("arithmetic", "counting")]
        assert r["teacher_kl_k1"] == pytest.approx(np.dot(n, k1) / sum(n), rel=1e-4)
    after = summary["after"]
    assert after["num_problems"] == 48 and after["arithmetic/num_problems"] == after["counting/num_problems"] == 24
    assert after["accuracy"] == pytest.approx((after["arithmetic/accuracy"] + after["counting/accuracy"]) / 2)
    with open(out / "eval" / "after.csv", newline="") as f:
        assert [r["task"] for r in csv.DictReader(f)] == ["arithmetic"] * 24 + ["counting"] * 24
    probes = {k for r in rows for k in r if k.startswith("probe/")}
    assert {"probe/arith/arithmetic/n_wrong", "probe/count/counting/n_wrong"} <= probes
    assert not any(k.startswith("probe/arith/counting") or k.startswith("probe/count/arithmetic") for k in probes)


def test_compare_judges_each_task(multi_run, tmp_path, capsys):
    tmp, _, _ = multi_run
    with open(tmp / "run" / "eval" / "after.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    other = tmp_path / "other"
    (other / "eval").mkdir(parents=True)
    # a run whose counting problems diverge twice as much, its arithmetic ones as much as the base's
    with open(other / "eval" / "after.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow(r | {"teacher_divergence": 2 * float(r["teacher_divergence"])} if r["task"] == "counting" else r)
    code = cli.main(["compare", str(other), str(tmp / "run"), "--json", str(tmp_path / "c.json")])
    per_task = json.loads((tmp_path / "c.json").read_text())["per_task"]
    assert per_task["arithmetic"]["rise"] == pytest.approx(0.0) and per_task["arithmetic"]["verdict"] == "PASS"
    assert per_task["counting"]["rise"] == pytest.approx(1.0) and per_task["counting"]["verdict"] == "FAIL"
    assert "per task" in capsys.readouterr().out and code in (0, 1)


def test_aot_sizes_both_teachers(tmp_path):
    cfg = _config(tmp_path)
    report = compile_opd_step(cfg, jax.devices()[:1], stages=("teacher_scoring",), progress=False)
    assert set(report.models) == {"student", "arith", "count"}
    shapes = transformer.abstract_params(model_config_of(cfg.teachers[0], "teachers[0]"))
    per_teacher = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert report.buffers["teacher_params"] == 2 * per_teacher  # both teachers held, fp32
    assert report.stages[0].memory is not None and report.stages[0].error is None
