"""A sweep over runs that mix tasks: each setup judged on each task's problems (`jopd.lab.task_report`), on eval
files constructed so the answer is known."""

import csv
import json

import numpy as np
import pytest

from jopd.config_dataclass import build
from jopd.lab import quality
from jopd.lab.sweep_config import SweepConfig
from jopd.lab.task_report import analyze_tasks, plot_tasks, tasks_table, write_tasks


def _write_eval(path, divergence, correct, tasks):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "teacher_divergence", "correct", "response_len", "response", "task"])
        for i, (d, c, t) in enumerate(zip(divergence, correct, tasks)):
            w.writerow([i, f"{d:.6g}", int(c), 5, "x, y", t])
    (path.parent.parent / "summary.json").write_text(json.dumps({"after": {}}))  # the run finished


def test_each_setup_is_judged_on_each_tasks_problems(tmp_path):
    sweep = build(SweepConfig, {"base": "unused.yaml", "out_dir": str(tmp_path), "baseline": {"name": "base",
                  "seeds": [0, 1]}, "setups": [{"name": "worse_b", "seeds": [0, 1]},
                  {"name": "unfinished", "seeds": [0]}],
                  "quality": {"resamples": 500}})
    rng = np.random.default_rng(0)
    tasks = ["a"] * 40 + ["b"] * 60
    div = {}
    for seed in (0, 1):
        base = rng.uniform(0.5, 1.5, 100)
        worse = base * np.where(np.asarray(tasks) == "b", 2.0, 1.0)  # task b's divergence doubles, a's stays
        correct = rng.random(100) < 0.5
        _write_eval(tmp_path / "base" / f"seed{seed}" / "eval" / "after.csv", base, correct, tasks)
        _write_eval(tmp_path / "worse_b" / f"seed{seed}" / "eval" / "after.csv", worse, correct, tasks)
        div[seed] = (base, worse, correct)
    (tmp_path / "unfinished" / "seed0" / "eval").mkdir(parents=True)  # a run still training: left out
    result = analyze_tasks(sweep)
    rows = {(r["setup"], r["task"]): r for r in result["rows"]}
    assert set(rows) == {("base", "a"), ("base", "b"), ("worse_b", "a"), ("worse_b", "b")}
    a, b = rows[("worse_b", "a")], rows[("worse_b", "b")]
    assert (a["n"], b["n"]) == (40, 60)
    assert a["rise"] == pytest.approx(0.0, abs=1e-6) and a["verdict"] == "PASS"
    assert b["rise"] == pytest.approx(1.0, rel=1e-6) and b["verdict"] == "FAIL"
    # the same numbers as the rule on those problems directly (the CSV keeps 6 significant digits)
    rows_b = np.asarray(tasks) == "b"
    ref = quality.seed_aware_rule([div[s][1][rows_b] for s in (0, 1)], [div[s][0][rows_b] for s in (0, 1)], 0.2,
                                  500, 0)
    assert b["rise_ci_low"] == pytest.approx(ref.rise_ci_low, rel=1e-5)
    assert b["rise_ci_high"] == pytest.approx(ref.rise_ci_high, rel=1e-5)
    assert rows[("base", "b")]["accuracy_per_seed"] == pytest.approx([div[s][2][rows_b].mean() for s in (0, 1)])
    write_tasks(result, tmp_path)
    plot_tasks(result, tmp_path / "tasks.png")
    assert (tmp_path / "tasks.png").stat().st_size > 0 and "worse_b" in tasks_table(result)
    assert len(list(csv.DictReader(open(tmp_path / "tasks.csv")))) == 4


def test_runs_with_one_task_have_no_task_report(tmp_path):
    sweep = build(SweepConfig, {"base": "unused.yaml", "out_dir": str(tmp_path), "baseline": {"name": "base"}})
    path = tmp_path / "base" / "seed0" / "eval" / "after.csv"
    path.parent.mkdir(parents=True)
    path.write_text("index,teacher_divergence,correct\n0,1.0,1\n")
    (path.parent.parent / "summary.json").write_text(json.dumps({"after": {}}))
    assert analyze_tasks(sweep) is None
