"""`jopd compare` on fake run directories written in the format `jopd train` writes (EvalResult.save)."""

import json

import numpy as np
import pytest

from jopd import cli
from jopd.run.evaluate import EvalResult

N = 530
DIFFICULTY = np.random.default_rng(0).gamma(2.0, 0.3, N)


def make_run(tmp_path, name, factor, noise=0.05, seed=1, index=None, config=None, metrics=None):
    """RUN_DIR/eval/after.csv with per-problem divergence = difficulty x factor x (1 + noise)."""
    d = tmp_path / name
    idx = np.arange(N) if index is None else np.asarray(index)
    div = DIFFICULTY[idx % N] * factor * (1 + noise * np.random.default_rng(seed).standard_normal(len(idx)))
    EvalResult(idx, div, np.zeros(len(idx), bool), np.full(len(idx), 7), ["1+1=2"] * len(idx)).save(d / "eval", "after")
    if config is not None:
        (d / "config.yaml").write_text(config)
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


def compare(*args):
    return cli.main(["compare", "--resamples", "2000", *map(str, args)])


def written_means(d):
    """The divergences as written (6 significant digits), read with numpy: an independent reference."""
    rows = np.genfromtxt(d / "eval" / "after.csv", delimiter=",", skip_header=1, usecols=(0, 1))
    return rows[np.argsort(rows[:, 0]), 1]


def test_fail_exit_1_and_json_fields(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1.0, metrics=[{"step": 1, "mismatch_kl": 0.0}])
    run = make_run(tmp_path, "noisy", 1.3, seed=2, metrics=[{"step": 1, "mismatch_kl": 0.3},
                                                           {"step": 2, "mismatch_kl": 0.5}])
    out = tmp_path / "out" / "cmp.json"
    assert compare(run, base, "--json", out) == 1
    table = capsys.readouterr().out
    assert "530 problems paired" in table and "FAIL" in table and "95% CI" in table
    r = json.loads(out.read_text())
    b_ref, r_ref = written_means(base), written_means(run)
    assert r["rise"] == pytest.approx(r_ref.mean() / b_ref.mean() - 1, rel=1e-9)
    assert r["diff_mean"] == pytest.approx(r_ref.mean() - b_ref.mean(), rel=1e-9)
    assert r["n"] == N and r["threshold"] == 0.2 and r["verdict"] == "FAIL"
    assert 0 < r["ci_low"] < r["diff_mean"] < r["ci_high"]
    assert r["run_eval"] == str(run / "eval" / "after.csv") and r["base_eval"] == str(base / "eval" / "after.csv")
    assert r["run_mismatch_kl"] == pytest.approx(0.4) and r["base_mismatch_kl"] == 0.0
    assert r["decided_by"] == "per-run" and "seed_aware" not in r


def test_pass_exit_0(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1.0)
    assert compare(make_run(tmp_path, "small", 1.1, seed=2), base) == 0  # +10%: significant but under 20%
    assert compare(make_run(tmp_path, "better", 0.8, seed=3), base) == 0  # a fall
    assert compare(make_run(tmp_path, "small2", 1.1, seed=4), base, "--threshold", "0.05") == 1
    assert "PASS" in capsys.readouterr().out


def test_differing_problem_sets_exit_2_with_the_count(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1.0)
    run = make_run(tmp_path, "short", 1.3, index=np.arange(3, N))
    assert compare(run, base) == 2
    err = capsys.readouterr().err
    assert err.startswith("jopd compare: error: problem sets differ: 3 of the 530 problems")
    assert err.count("\n") == 1


def test_bad_input_exit_2(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1.0)
    assert compare(tmp_path / "missing", base) == 2
    assert "missing: no such run directory" in capsys.readouterr().err
    assert compare(make_run(tmp_path, "r", 1.3), base, "--eval", "step_100") == 2
    assert "step_100.csv: no such eval file (this run has: after)" in capsys.readouterr().err
    assert compare(make_run(tmp_path, "r2", 1.3), base, "--resamples", "0") == 2
    (base / "eval" / "after.csv").write_text("index,teacher_divergence\n0,oops\n")
    assert compare(make_run(tmp_path, "r3", 1.3), base) == 2
    assert "after.csv:2: teacher_divergence 'oops' is not a number" in capsys.readouterr().err


def test_after_evals_at_different_steps_exit_2(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1.0, config="train: {steps: 400, seed: 0}\n")
    run = make_run(tmp_path, "run", 1.3, config="train: {steps: 200, seed: 0}\n")
    assert compare(run, base) == 2
    assert "not at the same step" in capsys.readouterr().err


def test_seeds_add_the_seed_aware_verdict_which_decides_the_exit_code(tmp_path, capsys):
    bases = [make_run(tmp_path, f"base{i}", f, seed=10 + i, config=f"train: {{seed: {i}}}\n")
             for i, f in enumerate([0.5 / 0.6, 1.0, 0.7 / 0.6])]
    runs = [make_run(tmp_path, f"run{i}", f, seed=20 + i, config=f"train: {{seed: {i}}}\n")
            for i, f in enumerate([0.95, 1.25, 1.55])]
    out = tmp_path / "seeds.json"
    # runs[2] vs bases[0] alone: +86%, a clear per-run FAIL; over the seeds the rise is +25% but within their spread
    assert compare(runs[2], bases[0], "--run-also", runs[0], "--run-also", runs[1], "--base-also", bases[1],
                   "--base-also", bases[2], "--json", out) == 0
    text = capsys.readouterr().out
    assert "seed-aware: 3 run seed(s), 3 base seed(s)" in text and "disagrees with the seed-aware verdict" in text
    r = json.loads(out.read_text())
    assert r["verdict"] == "FAIL" and r["decided_by"] == "seed-aware"
    s = r["seed_aware"]
    assert s["verdict"] == "PASS" and s["ci_low"] < 0 < s["ci_high"] and s["rise"] >= 0.2
    assert s["run_dirs"] == [str(runs[2]), str(runs[0]), str(runs[1])] and len(s["pairs"]) == 9
    assert s["base_rel_std"] > 0.1
    # two dirs of one training seed are not two seeds
    assert compare(runs[0], bases[0], "--run-also", runs[0]) == 2
    assert compare(runs[0], bases[0], "--base-also", make_run(tmp_path, "dup", 1.0, config="train: {seed: 0}\n")) == 2
    assert "same train.seed=0" in capsys.readouterr().err


# -- --rl: the broke criterion for reward-trained runs ------------------------------------------------------------


def make_rl_run(tmp_path, name, correct, kind="grpo", **last):
    """An RL run directory: eval/after.csv with per-problem correctness, metrics.jsonl with 10 training rows
    (the last two updated by `last`), config.yaml with the loss kind and the response cap."""
    d = tmp_path / name
    n = len(correct)
    EvalResult(np.arange(n), np.full(n, 0.5), np.asarray(correct, bool), np.full(n, 9), ["x"] * n).save(d / "eval",
                                                                                                        "after")
    (d / "config.yaml").write_text(f"loss: {{kind: {kind}}}\nsampling: {{max_new_tokens: 32}}\ntrain: {{steps: 10}}\n")
    rows = [{"step": s, "loss": 0.1, "reward": 0.3, "entropy": 0.5, "response_len": 12.0, "response_at_cap": 0.0}
            | (last if s > 8 else {}) for s in range(1, 11)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_rl_broke_exit_1_ok_exit_0_and_the_numbers(tmp_path, capsys):
    base_ok = np.random.default_rng(0).random(N) < 0.5
    worse = base_ok.copy()
    worse[np.flatnonzero(base_ok)[::4]] = False  # a quarter of the solved problems lost
    base = make_rl_run(tmp_path, "base", base_ok)
    out = tmp_path / "rl.json"
    assert compare("--rl", make_rl_run(tmp_path, "worse", worse), base, "--json", out) == 1
    text = capsys.readouterr().out
    assert "jopd compare --rl" in text and "BROKE" in text and f"{N} problems paired" in text
    assert f"{base_ok.mean():.3f}" in text and f"{worse.mean():.3f}" in text
    r = json.loads(out.read_text())
    assert r["verdict"] == "BROKE" and r["accuracy"]["broke"] and r["accuracy"]["ci_high"] < 0
    assert r["accuracy"]["diff_mean"] == pytest.approx(worse.mean() - base_ok.mean())

    assert compare("--rl", make_rl_run(tmp_path, "same", base_ok), base) == 0
    assert "verdict" in capsys.readouterr().out
    # the same accuracy but entropy collapsed over the last 20% of steps
    assert compare("--rl", make_rl_run(tmp_path, "collapsed", base_ok, entropy=0.01), base) == 1
    assert "entropy 0.0100 < 0.05" in capsys.readouterr().out
    # a looser margin or threshold flips each back
    assert compare("--rl", make_rl_run(tmp_path, "worse2", worse), base, "--acc-margin", "0.5") == 0
    assert compare("--rl", make_rl_run(tmp_path, "collapsed2", base_ok, entropy=0.01), base,
                   "--collapse-entropy", "0.001") == 0


def test_rl_bad_input_exit_2(tmp_path, capsys):
    ok = np.random.default_rng(1).random(40) < 0.5
    grpo, reinforce = make_rl_run(tmp_path, "g", ok), make_rl_run(tmp_path, "r", ok, kind="reinforce")
    assert compare("--rl", grpo, reinforce) == 2
    assert "trains loss.kind=grpo" in capsys.readouterr().err
    assert compare("--rl", grpo, make_rl_run(tmp_path, "g2", ok), "--run-also", grpo) == 2
    assert compare("--rl", grpo, make_rl_run(tmp_path, "g3", ok), "--acc-margin", "-1") == 2
    (tmp_path / "g" / "metrics.jsonl").unlink()
    assert compare("--rl", grpo, make_rl_run(tmp_path, "g4", ok)) == 2
    # without --rl the same directories still get the quality rule (teacher divergence equal: PASS)
    assert compare(make_rl_run(tmp_path, "q1", ok), make_rl_run(tmp_path, "q2", ok)) == 0


def test_unscored_problems_are_left_out_of_the_whole_set_and_each_task(tmp_path, capsys):
    """A cross-tokenizer eval writes NaN for a response it could not align: compare pairs the rest, per task too."""
    tasks = ["arithmetic" if i % 2 else "counting" for i in range(N)]
    dirs = {}
    for name, factor, seed in (("base", 1.0, 1), ("run", 1.3, 2)):
        div = DIFFICULTY * factor * (1 + 0.05 * np.random.default_rng(seed).standard_normal(N))
        if name == "run":
            div[[1, 2, 3]] = np.nan  # one arithmetic, then counting, then arithmetic
        dirs[name] = tmp_path / name
        EvalResult(np.arange(N), div, np.zeros(N, bool), np.full(N, 7), ["x"] * N, tasks).save(
            dirs[name] / "eval", "after")
    out = tmp_path / "cmp.json"
    with pytest.warns(UserWarning, match="3 of 530 problems left out"):
        assert compare(dirs["run"], dirs["base"], "--json", out) == 1
    r = json.loads(out.read_text())
    assert r["n"] == N - 3
    assert r["per_task"]["arithmetic"]["n"] == N // 2 - 2 and r["per_task"]["counting"]["n"] == N // 2 - 1
