"""`jopd sweep` on a tiny testbed: every (setup, seed) trains once, an interrupted sweep resumes without redoing
finished runs, and the analysis pairs each run with the baseline run of its seed."""

import json

import pytest
import yaml

from jopd import cli
from jopd.lab import sweep as sweeplib
from jopd.lab.sweep_config import load_sweep
from jopd.run import loop
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

class Killed(Exception):
    pass


@pytest.fixture
def sweep_file(tmp_path):
    base = write_tiny(tmp_path / "tiny.yaml")
    spec = {"base": str(base), "out_dir": str(tmp_path / "sweep"), "overrides": [f"train.cache_dir={tiny_cache()}"],
            "baseline": {"name": "fp32", "seeds": [0, 1]},
            "setups": [{"name": "noise_3", "overrides": ["rollout_precision.logit_noise=3.0"], "seeds": [0, 1]}],
            "quality": {"resamples": 500}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_interrupted_sweep_resumes_without_redoing_finished_runs(sweep_file, monkeypatch, capsys):
    calls, deaths = [], []
    real_train = loop.train

    def train_then_die(cfg, log=print, **hooks):
        calls.append((cfg.train.out_dir, cfg.train.seed, cfg.rollout_precision.logit_noise))
        if len(calls) == 2 and not deaths:
            deaths.append(cfg.train.out_dir)
            raise Killed  # the process dies during the second run
        return real_train(cfg, log=lambda *_: None, **hooks)

    monkeypatch.setattr(loop, "train", train_then_die)
    sweep = load_sweep(str(sweep_file))
    with pytest.raises(Killed):
        sweeplib.run_sweep(sweep, log=lambda *_: None)
    first = calls[0][0]
    assert first.endswith("fp32/seed0") and sweeplib.is_finished(first)

    calls.clear()
    records = sweeplib.run_sweep(sweep, log=lambda *_: None)
    assert [c[0] for c in calls] == [str(sweeplib.run_dir(sweep, s, k)) for s, k in
                                     [("fp32", 1), ("noise_3", 0), ("noise_3", 1)]]  # fp32/seed0 not redone
    assert [r["status"] for r in records] == ["done", "trained", "trained", "trained"]
    assert [c[1:] for c in calls] == [(1, 0.0), (0, 3.0), (1, 3.0)]  # seeds and setups reach the run configs
    before = [json.loads((sweeplib.run_dir(sweep, s, k) / "eval" / "before.json").read_text())
              for s, k in [("fp32", 0), ("noise_3", 1)]]
    assert before[0] == before[1]  # the shared starting student's eval, computed once

    monkeypatch.setattr(loop, "train", real_train)
    assert cli.main(["sweep", str(sweep_file), "--analyze-only"]) == 0
    out = sweep.out_dir
    summary = json.loads(open(f"{out}/summary.json").read())
    runs = {(r["setup"], r["seed"]): r for r in summary["runs"]}
    assert set(runs) == {("fp32", 1), ("noise_3", 0), ("noise_3", 1)}
    assert runs[("noise_3", 1)]["paired_with_base_seed"] == 1 and runs[("fp32", 1)]["baseline"]
    assert runs[("noise_3", 0)]["mismatch"] > 0.1 > runs[("fp32", 1)]["mismatch"]
    (setup,) = summary["setups"]
    assert setup["seed_aware"]["pairs"] and len(setup["per_run_verdicts"]) == 2
    assert (sweeplib.Path(out) / "bracket.png").stat().st_size > 10_000
    assert "noise_3" in capsys.readouterr().out


def test_sweep_file_errors_name_the_field(tmp_path, sweep_file):
    spec = yaml.safe_load(sweep_file.read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec | {"setups": [{"name": "fp32"}]}))
    with pytest.raises(ValueError, match="duplicate names"):
        load_sweep(str(bad))
    bad.write_text(yaml.safe_dump(spec | {"setups": [{"name": "x", "overrides": ["rollout_precision.logit_nois=1"]}]}))
    with pytest.raises(ValueError, match=r"sweep setup 'x': RunConfig.rollout_precision.logit_nois: unknown key"):
        sweeplib.check_configs(load_sweep(str(bad)))
    assert cli.main(["sweep", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.slow
def test_contrast_sweep_judges_each_method_by_its_own_rule(tmp_path, capsys):
    base = write_tiny(tmp_path / "tiny.yaml")
    spec = {"base": str(base), "out_dir": str(tmp_path / "contrast"), "overrides": [f"train.cache_dir={tiny_cache()}"],
            "methods": {"opd": {"overrides": ["loss.kind=topk_rkl"]},
                        "grpo": {"overrides": ["loss.kind=grpo", "rl.group_size=2", "data.batch_size=4"],
                                 "rule": "broke"}},
            "baseline": {"name": "standard", "seeds": [0]},
            "setups": [{"name": "noise_3", "overrides": ["rollout_precision.logit_noise=3.0"], "seeds": [0]}],
            "quality": {"resamples": 200}}
    path = tmp_path / "contrast.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert cli.main(["sweep", str(path)]) == 0
    out = tmp_path / "contrast"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["grpo", "opd"]
    assert "kind: grpo" in (out / "grpo" / "standard" / "seed0" / "config.yaml").read_text()
    c = json.loads((out / "contrast.json").read_text())
    rows = {(r["method"], r["setup"]): r for r in c["rows"]}
    assert set(rows) == {("opd", "noise_3"), ("grpo", "noise_3")}
    assert rows[("opd", "noise_3")]["rule"] == "quality" and rows[("opd", "noise_3")]["verdicts"][0] in ("PASS", "FAIL")
    assert rows[("grpo", "noise_3")]["rule"] == "broke" and rows[("grpo", "noise_3")]["verdicts"][0] in ("OK", "BROKE")
    assert rows[("grpo", "noise_3")]["mismatch"] > 0.1
    assert (out / "contrast.png").stat().st_size > 10_000
    assert "grpo" in capsys.readouterr().out


def test_a_second_sweep_on_the_same_out_dir_is_refused_while_the_first_trains(sweep_file, monkeypatch, capsys):
    import subprocess
    import sys
    import textwrap

    sweep = load_sweep(str(sweep_file))
    # the first sweep is another process (flock is per open file, so a second process is the real case)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from jopd.lab.sweep import locked_out_dir
        from jopd.lab.sweep_config import load_sweep
        with locked_out_dir(load_sweep({str(sweep_file)!r})):
            print("locked", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        trained = []
        monkeypatch.setattr(loop, "train", lambda cfg, log=print, **hooks: trained.append(cfg))
        assert cli.main(["sweep", str(sweep_file)]) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "another jopd sweep" in err and len(err.strip().splitlines()) == 1
        assert trained == []  # nothing trained into the busy directory
    finally:
        holder.kill()
        holder.wait()
    # the lock dies with its process (SIGKILL included): the sweep now trains
    monkeypatch.setattr(loop, "train",
                        lambda cfg, log=print, **hooks: trained.append(cfg.train.out_dir) or {"steps": 0})
    sweeplib.run_sweep(sweep, log=lambda *_: None)
    assert len(trained) == 1  # the fake run "was preempted" (no "after"), so the sweep stopped after it


def test_only_runs_with_the_same_student_teacher_and_eval_share_the_before_eval():
    from jopd.run.config import load_config

    key = lambda *o: sweeplib._before_eval_key(load_config(None, list(o)))  # noqa: E731
    assert key() == key("rollout_precision.logit_noise=3.0", "train.seed=1", "loss.kind=rkl")  # the bracket's setups
    assert key() != key("teacher.arch.num_layers=3")  # another teacher judges the starting student
    assert key() != key("loss.kind=xtok_sampled")  # scored per character by another tokenizer's teacher
    assert key() != key("train.eval_problems=7")


def test_contrast_plot_draws_one_panel_per_rule_present(tmp_path):
    """A sweep of quality-rule methods only (e.g. two horizons) gets no empty RL panel: the PNG is half as wide."""
    from matplotlib.image import imread

    from jopd.lab import sweep_report

    def row(method, rule, setup, mismatch, effect, verdict):
        return {"method": method, "rule": rule, "setup": setup, "mismatch": mismatch, "verdicts": [verdict],
                "bad": int(verdict in ("FAIL", "BROKE")), "n": 1, "effect_per_seed": [effect], "effect_mean": effect}

    quality_only = {"rows": [row("short", "quality", "noise_2", 0.5, 0.1, "PASS"),
                             row("long", "quality", "noise_2", 0.6, 0.4, "FAIL")]}
    both = {"rows": quality_only["rows"] + [row("grpo", "broke", "noise_2", 0.5, -0.02, "OK")]}
    sweep_report.plot_contrast(quality_only, tmp_path / "one.png")
    sweep_report.plot_contrast(both, tmp_path / "two.png")
    width_one, width_two = imread(tmp_path / "one.png").shape[1], imread(tmp_path / "two.png").shape[1]
    assert width_two == 2 * width_one


def test_baseline_curves_are_drawn_only_for_rl_runs_evaluated_along_the_way(tmp_path):
    from jopd.lab import sweep_report

    def rl(curves):
        return {"rule": "broke", "baseline": {"seeds": list(range(len(curves))), "accuracy_curve_per_seed": curves}}

    along = {"reinforce": rl([[(0, 0.045), (150, 0.081), (300, 0.062)]]), "opd": {"rule": "quality", "baseline": {}}}
    assert sweep_report.plot_baseline_curves(along, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 10_000
    end_only = {"reinforce": rl([[(0, 0.045)]])}
    assert not sweep_report.plot_baseline_curves(end_only, tmp_path / "b.png")
    assert not (tmp_path / "b.png").exists()
