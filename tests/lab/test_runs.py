"""`jopd.lab.runs`, the one reader of `jopd train` output directories: its eval, config and metrics readers on
constructed files (every error names the file), and all of it on a real run directory of the tiny testbed."""

import json

import numpy as np
import pytest

from jopd import cli
from jopd.lab import runs
from tests.helpers.tiny_testbed import tiny_cache, write_tiny


def write_csv(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


HEADER = "index,teacher_divergence,correct,response_len,response\n"


def test_read_eval_reads_the_train_format(tmp_path):
    write_csv(tmp_path / "eval" / "after.csv",
              HEADER + '2,0.5,1,3,"a, quoted\nmultiline answer"\n0,0.25,0,4,x\n1,1e-3,1,2,y\n')
    e = runs.read_eval(tmp_path, "after")
    np.testing.assert_array_equal(e.index, [2, 0, 1])
    np.testing.assert_allclose(e.divergence, [0.5, 0.25, 1e-3])


@pytest.mark.parametrize("text, message", [
    ("", "empty file"),
    (HEADER, "no problems"),
    ("index,correct\n0,1\n", "header lacks column.*teacher_divergence"),
    (HEADER + "0,0.5,1,3,a\n1,abc,1,3,b\n", r"after.csv:3: teacher_divergence 'abc' is not a number"),
    (HEADER + "zero,0.5,1,3,a\n", r"after.csv:2: index 'zero' is not an integer"),
    (HEADER + "0,inf,1,3,a\n", r"after.csv:2: teacher_divergence is inf"),
    (HEADER + "0,0.5,1,3,a\n0,0.6,1,3,b\n", "problem index 0 appears 2 times"),
    ("index,teacher_divergence\n0\n", r"after.csv:2: too few fields"),
])
def test_read_eval_errors_name_the_file(tmp_path, text, message):
    write_csv(tmp_path / "eval" / "after.csv", text)
    with pytest.raises(ValueError, match=message) as e:
        runs.read_eval(tmp_path, "after")
    assert str(tmp_path / "eval" / "after.csv") in str(e.value)


def test_read_eval_keeps_unscored_problems_as_nan(tmp_path):
    # a cross-tokenizer eval writes nan for a response the pair could not align: read, counted, not refused
    write_csv(tmp_path / "eval" / "after.csv", HEADER + "0,0.5,1,3,a\n1,nan,0,32,b\n")
    e = runs.read_eval(tmp_path, "after", correctness=True)
    assert e.unscored == 1 and np.isnan(e.divergence[1])
    np.testing.assert_array_equal(e.correct, [1, 0])


def test_read_eval_missing_file_lists_what_exists(tmp_path):
    write_csv(tmp_path / "eval" / "before.csv", HEADER + "0,0.5,1,3,a\n")
    with pytest.raises(FileNotFoundError, match=r"after.csv: no such eval file \(this run has: before\)"):
        runs.read_eval(tmp_path, "after")
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        runs.read_eval(tmp_path / "nope", "after")


def test_mean_mismatch_reads_training_lines_once_per_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"eval/teacher_divergence": 0.6, "step": 0}\n{"mismatch_kl": 0.1, "loss": 1, "step": 1}\n'
        '{"mismatch_kl": 0.3, "step": 2}\n{"mismatch_kl": 0.5, "step": 2}\n\n')  # step 2 logged again on resume
    assert runs.mean_mismatch(tmp_path) == pytest.approx(0.3)
    assert runs.mean_mismatch(tmp_path / "none") is None


def test_read_eval_correctness_reads_the_correct_column(tmp_path):
    write_csv(tmp_path / "eval" / "after.csv", HEADER + "2,0.5,True,3,a\n0,0.25,0,4,b\n1,1e-3,1.0,2,c\n")
    e = runs.read_eval(tmp_path, "after", correctness=True)
    np.testing.assert_array_equal(e.correct, [1.0, 0.0, 1.0])
    assert runs.read_eval(tmp_path, "after").correct is None  # not asked for: not read
    write_csv(tmp_path / "eval" / "bad.csv", HEADER + "0,0.5,maybe,3,a\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: correct 'maybe' is not a boolean"):
        runs.read_eval(tmp_path, "bad", correctness=True)
    write_csv(tmp_path / "eval" / "nocol.csv", "index,teacher_divergence\n0,0.5\n")
    assert runs.read_eval(tmp_path, "nocol").divergence.tolist() == [0.5]
    with pytest.raises(ValueError, match="nocol.csv: header lacks column correct"):
        runs.read_eval(tmp_path, "nocol", correctness=True)


def test_config_and_metrics_readers(tmp_path):
    assert runs.read_run_config(tmp_path) is None and runs.config_field(None, "train", "seed") is None
    (tmp_path / "config.yaml").write_text("train: {seed: 3}\nloss: kind\n")
    cfg = runs.read_run_config(tmp_path)
    assert runs.config_field(cfg, "train", "seed") == 3
    assert runs.config_field(cfg, "train", "steps") is None and runs.config_field(cfg, "loss", "kind") is None
    (tmp_path / "config.yaml").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="config.yaml: expected a mapping"):
        runs.read_run_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl: no such metrics file"):
        runs.training_rows(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"eval/accuracy": 0.5, "step": 0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: no training rows"):
        runs.training_rows(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1, "step": 2}\n{"loss": 2, "step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl:3: not valid JSON"):
        runs.step_rows(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert runs.resolve_checkpoint_dir(tmp_path) == tmp_path / "checkpoints"
    assert runs.resolve_checkpoint_dir(tmp_path / "checkpoints") == tmp_path / "checkpoints"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 2-step run of the tiny testbed (checkpoints at steps 1 and 2)."""
    tmp = tmp_path_factory.mktemp("runs")
    cfg = write_tiny(tmp / "tiny.yaml", train={"steps": 2}, checkpoint={"every": 1, "async_save": False})
    run_dir = tmp / "run"
    assert cli.main(["train", str(cfg), f"train.out_dir={run_dir}", f"train.cache_dir={tiny_cache()}"]) == 0
    return run_dir


def test_reader_on_a_real_run_directory(tiny_run):
    d = tiny_run
    assert runs.is_finished(d) and not runs.is_finished(d / "nope")
    cfg = runs.run_config(d)
    assert cfg.train.out_dir == str(d) and cfg.train.steps == 2
    assert runs.config_field(runs.read_run_config(d), "train", "steps") == 2
    assert runs.checkpoint_dir(cfg) == str(d / "checkpoints")

    ev = runs.read_eval(d, "after", correctness=True)
    summary = runs.read_eval_summary(d, "after")
    assert ev.path == runs.eval_path(d, "after") and sorted(ev.index.tolist()) == list(range(24))
    assert summary["num_problems"] == 24 and summary["accuracy"] == pytest.approx(ev.correct.mean())
    assert summary["teacher_divergence"] == pytest.approx(ev.divergence.mean(), rel=1e-5)  # CSV: 6 digits
    assert runs.read_eval(d, "before").divergence.shape == (24,)
    with pytest.raises(FileNotFoundError, match=r"step_9.csv: no such eval file \(this run has: after, before\)"):
        runs.read_eval(d, "step_9")

    rows = runs.training_rows(d)
    assert [r["step"] for r in rows] == [1, 2] and all("loss" in r for r in rows)
    logged = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("eval/") for r in logged for k in r)  # the eval rows are there, and left out
    assert runs.mean_mismatch(d) == pytest.approx(np.mean([r["mismatch_kl"] for r in rows]))

    run, state, at = runs.build_at_checkpoint(cfg, d, log=lambda *_: None)  # RUN_DIR: its checkpoints/
    assert at == 2 and int(state.step) == 2
    state1, at1 = runs.restore_state(runs.checkpoint_dir(cfg), run.step.abstract_state(), 1)
    assert at1 == 1 and int(state1.step) == 1
    with pytest.raises(ValueError, match=r"--step 7: not saved in .* \(saved steps: \[1, 2\]\)"):
        runs.restore_state(d / "checkpoints", run.step.abstract_state(), 7)
