"""`jopd eval RUN_DIR --step N` reproduces the run's own final evaluation at that step, problem by problem, and a
write that fails mid-run (a full disk) is one error line while the previous checkpoint stays restorable."""

import csv
import errno

import pytest

from jopd import cli
from jopd.run import checkpoint
from tests.helpers.tiny_testbed import tiny_cache, write_tiny


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_eval_of_the_last_step_reproduces_the_runs_after_eval(tmp_path, capsys):
    cfg = write_tiny(tmp_path / "tiny.yaml", train={"steps": 2}, checkpoint={"every": 1, "async_save": False})
    run = tmp_path / "run"
    assert cli.main(["train", str(cfg), f"train.out_dir={run}", f"train.cache_dir={tiny_cache()}"]) == 0
    assert cli.main(["eval", str(run), "--step", "2"]) == 0
    assert '"step": 2' in capsys.readouterr().out
    after, again = _rows(run / "eval" / "after.csv"), _rows(run / "eval" / "step_2.csv")
    assert len(after) == 24 and after == again  # same params, same eval seed: the same responses and numbers
    assert cli.main(["eval", str(run), "--step", "1", "--problems", "8", "--name", "early"]) == 0
    assert len(_rows(run / "eval" / "early.csv")) == 8
    assert cli.main(["eval", str(run), "--step", "7"]) == 2
    assert "--step 7: not saved" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_error_line_and_the_last_checkpoint_restores(tmp_path, capsys, monkeypatch):
    cfg = write_tiny(tmp_path / "tiny.yaml", train={"steps": 4}, checkpoint={"every": 1, "async_save": False})
    run = tmp_path / "run"
    real_save = checkpoint.Checkpointer.save

    def save(self, step, *args, **kwargs):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "3"))
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    args = ["train", str(cfg), f"train.out_dir={run}", f"train.cache_dir={tiny_cache()}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"jopd train: error: {run / 'checkpoints' / '3'}: No space left on device"
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real_save)
    assert cli.main(args) == 0  # the disk has room again: resumes from step 2 and finishes
    assert "resumed from" in capsys.readouterr().out
