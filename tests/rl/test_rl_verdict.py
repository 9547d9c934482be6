"""The broke criterion (`jopd.lab.rl_verdict`) on constructed eval CSVs and metrics, in the formats `jopd train`
writes (EvalResult.save, MetricsWriter rows)."""

import json
import math

import numpy as np
import pytest

from jopd.lab import rl_verdict as rv
from jopd.run.evaluate import EvalResult


def healthy_rows(steps=10, reward=0.3, entropy=0.6, at_cap=0.1, **last):
    rows = [{"step": s, "loss": 0.1, "reward": reward, "entropy": entropy, "response_len": 20.0,
             "response_at_cap": at_cap} for s in range(1, steps + 1)]
    for r in rows[-2:]:  # the last 20%
        r.update(last)
    return rows


def make_run(root, name, correct, rows=None, kind="grpo", max_new_tokens=32, index=None):
    d = root / name
    n = len(correct)
    idx = np.arange(n) if index is None else np.asarray(index)
    EvalResult(idx, np.full(n, 0.5), np.asarray(correct, bool), np.full(n, 7), ["x"] * n).save(d / "eval", "after")
    (d / "config.yaml").write_text(f"loss: {{kind: {kind}}}\nsampling: {{max_new_tokens: {max_new_tokens}}}\n"
                                   f"train: {{steps: 10}}\n")
    rows = healthy_rows() if rows is None else rows
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                     + json.dumps({"step": 10, "eval/accuracy": 0.5}) + "\n")  # an eval row
    return d


def base_correct(n=530, p=0.6, seed=0):
    return np.random.default_rng(seed).random(n) < p


def test_accuracy_drop_with_a_tight_interval_breaks(tmp_path):
    base = base_correct()
    run = base.copy()
    run[np.flatnonzero(base)[::7]] = False  # ~1/7 of the base's solved problems lost, none gained
    v = rv.rl_verdict(make_run(tmp_path, "run", run), make_run(tmp_path, "base", base),
                      criterion=rv.Criterion(resamples=2000))
    a = v.accuracy
    assert v.verdict == "BROKE" and a.broke and not v.collapse.broke
    assert a.diff_mean == pytest.approx(run.mean() - base.mean()) and a.diff_mean < -0.05
    assert a.ci_low < a.diff_mean < a.ci_high < 0
    assert a.n == 530 and a.base_accuracy == pytest.approx(base.mean())


def test_small_drop_or_wide_interval_is_ok(tmp_path):
    # a drop beyond the margin on 40 problems with discordant pairs both ways: the interval includes 0
    base = np.array([1] * 20 + [0] * 20, bool)
    run = base.copy()
    run[:10] = False  # 10 lost
    run[20:27] = True  # 7 gained: -3/40 = -0.075
    v = rv.rl_verdict(make_run(tmp_path, "wide", run), make_run(tmp_path, "wbase", base),
                      criterion=rv.Criterion(resamples=2000))
    assert v.accuracy.diff_mean == pytest.approx(-0.075)
    assert v.accuracy.ci_low < 0 < v.accuracy.ci_high and v.verdict == "OK" and "includes 0" in v.accuracy.reason
    # a tight but small drop (within the margin) is not a break either
    big = base_correct(seed=1)
    small = big.copy()
    small[np.flatnonzero(big)[:10]] = False  # -10/530
    v = rv.rl_verdict(make_run(tmp_path, "small", small), make_run(tmp_path, "sbase", big),
                      criterion=rv.Criterion(resamples=2000))
    assert v.accuracy.ci_high < 0 and v.verdict == "OK" and "within the margin" in v.accuracy.reason


@pytest.mark.parametrize("last, signal", [
    ({"reward": 0.0}, "reward 0.0000 < 0.02"),
    ({"entropy": 0.01}, "entropy 0.0100 < 0.05"),
    ({"response_at_cap": 0.97}, "length pinned at the cap"),
    ({"loss": math.nan}, "non-finite loss at step 9"),
])
def test_each_collapse_signal_breaks(tmp_path, last, signal):
    same = base_correct()
    v = rv.rl_verdict(make_run(tmp_path, "run", same, rows=healthy_rows(**last)), make_run(tmp_path, "base", same),
                      criterion=rv.Criterion(resamples=500))
    assert v.verdict == "BROKE" and not v.accuracy.broke
    assert len(v.collapse.signals) == 1 and v.collapse.signals[0].startswith(signal), v.collapse.signals
    assert not v.base_collapse.broke


def test_collapse_signals_read_the_tail_only_and_need_the_base_higher(tmp_path):
    same = base_correct()
    early = healthy_rows()
    early[0]["entropy"] = 0.0  # a collapse early on that recovered: not in the last 20%
    v = rv.rl_verdict(make_run(tmp_path, "early", same, rows=early), make_run(tmp_path, "base", same),
                      criterion=rv.Criterion(resamples=500))
    assert v.verdict == "OK" and v.collapse.steps == (9, 10)
    # reward ~0 in both: not the run's collapse
    zero = healthy_rows(reward=0.0)
    v = rv.rl_verdict(make_run(tmp_path, "zero", same, rows=zero), make_run(tmp_path, "zbase", same, rows=zero),
                      criterion=rv.Criterion(resamples=500))
    assert v.verdict == "OK" and v.collapse.reward == 0.0 == v.collapse.base_reward
    # without response_at_cap: mean length / cap
    rows = [{k: v for k, v in r.items() if k != "response_at_cap"} | {"response_len": 31.0} for r in healthy_rows()]
    v = rv.rl_verdict(make_run(tmp_path, "long", same, rows=rows), make_run(tmp_path, "lbase", same),
                      criterion=rv.Criterion(resamples=500))
    assert v.verdict == "BROKE" and v.collapse.at_cap == pytest.approx(31 / 32)
    assert v.collapse.at_cap_source == "response_len / max_new_tokens"


def test_bad_input_is_an_error(tmp_path):
    same = base_correct(n=50)
    with pytest.raises(ValueError, match="trains loss.kind=grpo but .* trains reinforce"):
        rv.rl_verdict(make_run(tmp_path, "a", same), make_run(tmp_path, "b", same, kind="reinforce"))
    with pytest.raises(ValueError, match="problem sets differ"):
        rv.rl_verdict(make_run(tmp_path, "c", same), make_run(tmp_path, "d", same, index=np.arange(50) + 1))
    d = make_run(tmp_path, "e", same)
    (d / "metrics.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl: no such metrics file"):
        rv.rl_verdict(d, make_run(tmp_path, "f", same))
    with pytest.raises(ValueError, match="acc_margin: must be a finite number >= 0"):
        rv.Criterion(acc_margin=-0.1)
