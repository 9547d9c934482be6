"""`jopd sweep`'s analysis on constructed run directories (no training): grouped setups get a bracket each and a
comparison with their ungrouped twin, a sweep in progress is tabled on its finished runs, and each run's wall
time and IS metrics reach the tables."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from jopd import cli
from jopd.lab import runs as runslib
from jopd.lab import sweep_report
from jopd.lab.sweep import run_dir
from jopd.lab.sweep_config import SetupConfig, load_sweep

N = 60  # problems


def fake_run(d, divergence, mismatch, wall=None, **metrics):
    """A finished `jopd train` directory: eval/after.{csv,json}, metrics.jsonl, summary.json."""
    (d / "eval").mkdir(parents=True)
    rng = np.random.default_rng(int(divergence * 1000))
    div = divergence * (1 + 0.05 * rng.standard_normal(N))
    (d / "eval" / "after.csv").write_text("index,teacher_divergence,correct\n"
                                          + "".join(f"{i},{v:.6f},{i % 3 == 0}\n" for i, v in enumerate(div)))
    (d / "eval" / "after.json").write_text(json.dumps({"accuracy": 0.3, "teacher_divergence": float(div.mean())}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "mismatch_kl": mismatch, **metrics}) + "\n"
                                             for s in (1, 2)))
    (d / "summary.json").write_text(json.dumps({"steps": 2, "after": {}}))
    if wall is not None:
        (d / runslib.WALL_FILE).write_text(json.dumps({"wall_s": wall - 10}) + "\n" + json.dumps({"wall_s": 10}) + "\n")


@pytest.fixture
def sweep(tmp_path):
    (tmp_path / "base.yaml").write_text("{}\n")
    spec = {"base": str(tmp_path / "base.yaml"), "out_dir": str(tmp_path / "out"),
            "baseline": {"name": "fp32", "seeds": [0, 1]},
            "setups": [{"name": f"n{x}", "overrides": [f"noise={x}"], "seeds": [0, 1]} for x in (1, 2, 3)]
            + [{"name": f"n{x}_tis", "group": "tis", "overrides": [f"noise={x}", "is=tis"], "seeds": [0, 1]}
               for x in (2, 3)],
            "quality": {"resamples": 200}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "sweep.yaml"


# (divergence, in-run mismatch) per setup: uncorrected fails from n3, the correction only from its n3 (mismatch 2.0)
RUNS = {"fp32": (1.0, 0.0), "n1": (1.02, 0.1), "n2": (1.05, 0.5), "n3": (1.6, 1.5), "n2_tis": (1.0, 0.6),
        "n3_tis": (1.5, 2.0)}


def test_groups_get_their_own_bracket_and_a_comparison_with_their_twin(sweep, capsys):
    cfg = load_sweep(str(sweep))
    for name, (div, mm) in RUNS.items():
        for seed in (0, 1):
            extra = {"is_frac_truncated": 0.25} if name.endswith("_tis") else {}
            fake_run(run_dir(cfg, name, seed), div, mm, wall=80.0, **extra)
    res = sweep_report.analyze(cfg)
    assert res["bracket_seed_aware"]["bracket_low"] == pytest.approx(0.5)  # the ungrouped ladder only
    assert res["bracket_seed_aware"]["bracket_high"] == pytest.approx(1.5)
    tis = res["groups"]["tis"]["bracket_seed_aware"]
    assert (tis["bracket_low"], tis["bracket_high"]) == (pytest.approx(0.6), pytest.approx(2.0))
    row = {s["setup"]: s for s in res["setups"]}
    assert row["n2_tis"]["vs_ungrouped"]["setup"] == "n2" and row["n2_tis"]["vs_ungrouped"]["rise"] < 0
    assert row["n2_tis"]["is_frac_truncated"] == pytest.approx(0.25) and row["n2"]["is_frac_truncated"] is None
    assert row["n2"]["wall_s"] == pytest.approx(160.0)  # two seeds, each two resumes summing to 80 s
    assert res["compute"] == {"runs": 12, "timed_runs": 12, "wall_s_total": pytest.approx(960.0),
                              "wall_s_median": pytest.approx(80.0), "wall_s_max": pytest.approx(80.0)}
    assert res["missing"] == []

    assert cli.main(["sweep", str(sweep), "--analyze-only"]) == 0
    out = capsys.readouterr().out
    assert "-- group tis" in out and "bracket seed aware (tis): (0.6, 2]" in out and "vs n2" in out
    assert (cfg.out_dir and (sweep.parent / "out" / "groups.png").stat().st_size > 10_000)
    header = (sweep.parent / "out" / "setups.csv").read_text().splitlines()[0]
    assert "group" in header and "vs_ungrouped_rise" in header and "wall_s" in header


def test_a_sweep_in_progress_is_tabled_on_its_finished_runs(sweep, capsys):
    cfg = load_sweep(str(sweep))
    with pytest.raises(ValueError, match="no finished baseline run yet"):
        sweep_report.analyze(cfg)
    fake_run(run_dir(cfg, "fp32", 0), 1.0, 0.0)
    fake_run(run_dir(cfg, "n2", 1), 1.05, 0.5)
    run_dir(cfg, "n3", 0).mkdir(parents=True)  # started, not finished: no summary.json with "after"
    res = sweep_report.analyze(cfg)
    assert [s["setup"] for s in res["setups"]] == ["n2"] and res["setups"][0]["seeds"] == [1]
    assert res["missing"][:3] == ["fp32/seed1", "n1/seed0", "n1/seed1"] and len(res["missing"]) == 10
    assert res["compute"]["timed_runs"] == 0
    assert cli.main(["sweep", str(sweep), "--analyze-only"]) == 0
    assert "not finished yet (10)" in capsys.readouterr().out


def test_ungrouped_twin_is_the_largest_proper_subset():
    mk = lambda name, over, group=None: SetupConfig(name=name, overrides=tuple(over), group=group)  # noqa: E731
    a, b = mk("a", ["x=1"]), mk("b", ["x=1", "y=2"])
    g = mk("g", ["x=1", "y=2", "is=tis"], "tis")
    assert sweep_report.ungrouped_twin(g, [a, b, g]) is b
    assert sweep_report.ungrouped_twin(mk("h", ["z=1", "is=tis"], "tis"), [a, b]) is None
    assert sweep_report.ungrouped_twin(g, [a, mk("c", ["x=1", "is=tis"]), b]) is None  # two equally large


def test_mean_metric_and_wall_seconds(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "m": float(s)}) + "\n" for s in range(1, 11)))
    assert runslib.mean_metric(tmp_path, "m") == pytest.approx(5.5)
    assert runslib.mean_metric(tmp_path, "m", last_frac=0.2) == pytest.approx(9.5)
    assert runslib.mean_metric(tmp_path, "nope") is None
    assert runslib.wall_seconds(tmp_path) is None
    (tmp_path / runslib.WALL_FILE).write_text('{"wall_s": 1.5}\n\n{"wall_s": 2}\n')
    assert runslib.wall_seconds(tmp_path) == pytest.approx(3.5)
    (tmp_path / runslib.WALL_FILE).write_text('{"wall": 1}\n')
    with pytest.raises(ValueError, match=r"sweep_wall.jsonl:1"):
        runslib.wall_seconds(tmp_path)


def test_only_trains_the_named_setups_or_groups_and_the_baseline(sweep, monkeypatch, capsys):
    """`jopd sweep --only tis`: the baseline and the tis group train, nothing else; an unknown name is one line."""
    from jopd.lab import sweep as sweeplib
    from jopd.run import loop

    trained = []

    def fake_train(cfg, log=None, probe_hook=None):
        trained.append(cfg)
        fake_run(Path(cfg), 1.0, 0.1)
        return {"after": {}}

    monkeypatch.setattr(sweeplib, "check_configs", lambda s: None)
    monkeypatch.setattr(sweeplib, "run_config", lambda s, setup, seed, method=None: str(run_dir(s, setup.name, seed)))
    monkeypatch.setattr(sweeplib, "_share_before_eval", lambda *a: None)
    monkeypatch.setattr(loop, "train", fake_train)
    assert cli.main(["sweep", str(sweep), "--only", "tis", "--no-screen"]) == 0
    cfg = load_sweep(str(sweep))
    assert sorted(trained) == sorted(str(run_dir(cfg, n, k)) for n in ("fp32", "n2_tis", "n3_tis") for k in (0, 1))
    assert cli.main(["sweep", str(sweep), "--only", "n9"]) == 2
    assert "--only: unknown setup or group ['n9']" in capsys.readouterr().err
