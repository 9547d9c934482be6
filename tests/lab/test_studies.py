"""`jopd.lab.studies` on constructed run directories: the rise difference between two methods of a contrast
sweep, accuracy and probe curves read from metrics.jsonl, and their plots."""

import json

import numpy as np
import pytest
import yaml

from jopd.lab import runs, studies
from jopd.lab.sweep import run_dir
from jopd.lab.sweep_config import load_sweep


def test_rise_difference_matches_the_rises_and_its_interval_covers_them():
    rng = np.random.default_rng(0)
    base = [1.0 + 0.1 * rng.standard_normal(200) for _ in range(2)]
    runs_a = [b * 1.1 for b in base]  # +10%
    runs_b = [b * 1.5 for b in base]  # +50%
    d = studies.rise_difference(runs_a, base, runs_b, base, resamples=500)
    assert d["rise_a"] == pytest.approx(0.1) and d["rise_b"] == pytest.approx(0.5)
    assert d["diff"] == pytest.approx(0.4) and d["ci_low"] < 0.4 < d["ci_high"]
    assert d["ci_low"] > 0.3  # runs exactly proportional to their bases: little spread
    with pytest.raises(ValueError, match="side a: runs have 200 problems, bases 3"):
        studies.rise_difference(runs_a, [np.ones(3)], runs_b, base, resamples=100)


def _run(d, divergence, probe=None, evals=()):
    (d / "eval").mkdir(parents=True)
    (d / "eval" / "after.csv").write_text("index,teacher_divergence\n" + "".join(f"{i},{divergence * (1 + i / 100)}\n"
                                                                                 for i in range(20)))
    (d / "summary.json").write_text(json.dumps({"after": {}}))
    lines = [{"step": s, "eval/accuracy": a, "eval/teacher_divergence": 1.0} for s, a in evals]
    lines += [{"step": s, **{f"probe/{k}": v for k, v in p.items()}} for s, p in (probe or {}).items()]
    lines += [{"step": s, "loss": 1.0} for s in (1, 2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_method_gaps_compare_each_setup_across_two_horizons(tmp_path):
    (tmp_path / "base.yaml").write_text("{}\n")
    spec = {"base": str(tmp_path / "base.yaml"), "out_dir": str(tmp_path / "out"),
            "methods": {"short": {"overrides": []}, "long": {"overrides": ["x=1"]}},
            "baseline": {"name": "truncated", "seeds": [0, 1]},
            "setups": [{"name": "sampled", "seeds": [0, 1]}, {"name": "unfinished", "seeds": [0]}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))  # the methods in file order
    sweep = load_sweep(str(tmp_path / "s.yaml"))
    for method, factor in (("short", 2.0), ("long", 3.0)):
        for k in (0, 1):
            _run(run_dir(sweep, "truncated", k, method), 1.0)
            _run(run_dir(sweep, "sampled", k, method), factor)
    (row,) = studies.method_gaps(sweep)
    assert row["setup"] == "sampled" and row["methods"] == ["short", "long"]
    assert row["rise_short"] == pytest.approx(1.0) and row["rise_long"] == pytest.approx(2.0)
    assert row["diff"] == pytest.approx(1.0)
    assert "short" in studies.gaps_table([row]) and "+100.0%" in studies.gaps_table([row])


def test_curves_read_the_eval_and_probe_rows(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, 1.0, probe={0: {"recovery": 0.1, "agreement": 0.2}, 100: {"recovery": 0.3}},
         evals=[(0, 0.04), (150, 0.08), (300, 0.11)])
    _run(b, 1.0, probe={0: {"recovery": 0.3}, 100: {"n_wrong": 0.0}})  # no prefix at step 100: rates missing
    assert studies.accuracy_curve(a) == [(0, 0.04), (150, 0.08), (300, 0.11)]
    assert studies.probe_curve([a, b], "recovery") == [(0, pytest.approx(0.2), [0.1, 0.3]), (100, 0.3, [0.3])]
    assert runs.prefixed_rows(a, "probe/")[0] == {"recovery": 0.1, "agreement": 0.2}
    assert runs.prefixed_rows(tmp_path / "none", "probe/") == {}
    studies.plot_accuracy_curves({"reinforce": studies.accuracy_curve(a)}, tmp_path / "acc.png")
    studies.plot_horizon({"short": {"truncated": {"before": [1.8, 1.8], "after": [0.4, 0.35]}},
                          "long": {"truncated": {"before": [2.0], "after": [0.9]}}},
                         {"long": {"recovery": studies.probe_curve([a, b], "recovery")}}, tmp_path / "h.png")
    assert (tmp_path / "acc.png").stat().st_size > 5000 and (tmp_path / "h.png").stat().st_size > 5000
