"""Guards against silent failure: a run whose loss counts no tokens stops (or warns) naming the step, logs its
loss metrics as missing rather than 0; a non-finite update is never applied and stops the run with the last
good checkpoint named."""

import json

import numpy as np
import pytest

from jopd import cli
from jopd.run.guards import GuardConfig, RunGuard, loggable
from tests.helpers.tiny_testbed import tiny_cache, write_tiny


def test_run_guard_streak_and_actions():
    lengths = np.full(4, 3)
    g = RunGuard(GuardConfig(patience=3), special_ids={1, 2}, max_new_tokens=10)
    empty = {"num_tokens": 0.0, "counted_token_frac": 0.0}
    assert g.check(1, empty) == (None, None) and g.check(2, empty) == (None, None)
    assert g.check(3, {"num_tokens": 5.0, "counted_token_frac": 0.5}) == (None, None)  # streak broken
    for step in (4, 5):
        assert g.check(step, empty) == (None, None)
    warning, stop = g.check(6, empty)
    assert warning is None and "no response token counts" in stop and "3 consecutive steps" in stop
    w = RunGuard(GuardConfig(patience=1, degenerate="warn", min_token_frac=0.2), set(), 10)
    warning, stop = w.check(1, {"num_tokens": 1.0, "counted_token_frac": 0.1})
    assert stop is None and "only 10.0%" in warning
    assert w.check(2, {"num_tokens": 1.0, "counted_token_frac": 0.1}) == (None, None)  # warned once
    pinned = RunGuard(GuardConfig(patience=1), {7}, max_new_tokens=3)
    tokens = np.full((4, 3), 7)
    m = {"num_tokens": 12.0} | pinned.rollout_metrics(tokens, lengths, 12.0)
    assert m["special_token_frac"] == 1.0 and m["response_at_cap"] == 1.0
    assert "hit max_new_tokens" in pinned.check(1, m)[1]
    nan = {"nonfinite": 1.0, "loss": float("nan")}
    assert "non-finite" in RunGuard(GuardConfig(), set(), 10).check(9, nan)[1]
    assert "non-finite" in RunGuard(GuardConfig(nonfinite="skip"), set(), 10).check(9, nan)[0]
    assert loggable({"num_tokens": 0.0, "loss": 0.0, "response_len": 3.0}) == {"num_tokens": 0.0, "response_len": 3.0}


@pytest.mark.slow
def test_a_run_with_no_loss_tokens_stops_and_says_why(tmp_path, capsys):
    cfg = write_tiny(tmp_path / "tiny.yaml", train={"steps": 12, "guard": {"patience": 3}},
                     loss={"special_token_ids": list(range(200))})  # every target masked: nothing to learn from
    out = tmp_path / "run"
    code = cli.main(["train", str(cfg), f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}",
                     "checkpoint.every=2"])
    err = capsys.readouterr().err
    assert code == 3 and "stopped: the run has degenerated: no response token counts in the loss" in err
    assert "last good checkpoint" in err and "(problems [" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "num_tokens" in r]
    assert steps and all(r["num_tokens"] == 0 and "loss" not in r and "divergence" not in r for r in steps)
    assert max(r["step"] for r in steps) == 3  # stopped at the patience-th degenerate step
    assert not (out / "summary.json").read_text().count('"after"')


@pytest.mark.slow
def test_a_nonfinite_update_is_skipped_and_stops_the_run(tmp_path, capsys):
    from jopd.lab.runs import restore_state, run_config
    from jopd.run import loop

    cfg = write_tiny(tmp_path / "tiny.yaml", train={"steps": 8}, optim={"learning_rate": 1e38, "warmup_steps": 0})
    out = tmp_path / "run"
    code = cli.main(["train", str(cfg), f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}",
                     "checkpoint.every=1", "checkpoint.async_save=false"])
    err = capsys.readouterr().err
    assert code == 3 and "non-finite loss or gradient" in err and "the update was not applied" in err
    rc = run_config(out)
    run, _ = loop.build(rc, log=lambda *_: None)
    state, step = restore_state(out / "checkpoints", run.step.abstract_state())
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(state.params))
