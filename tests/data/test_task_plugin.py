"""A task from outside the package: docs/examples/reverse_task.py (the file docs/extending.md shows), imported by a
run config's `plugins`, supplies the problems, the prompts and the answer check of a tiny testbed run."""

import json
from pathlib import Path

import pytest

from jopd import registry
from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import load_problems, train_iterator
from jopd.data.tasks import TASKS
from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.run.loop import train
from jopd.run.config import load_config
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "reverse_task.py"
PLUGIN = [f"plugins=[{EXAMPLE}]", "data.task=reverse"]


def test_the_task_entry_gives_problems_prompts_and_its_own_answer_check():
    cfg = load_config(None, PLUGIN + ["data.options={min_len: 2, max_len: 4, heldout_size: 10}"])
    heldout = load_problems(cfg.data, "heldout")
    assert len(heldout) == 10 and all(2 <= len(p.answer) <= 4 for p in heldout)
    assert all(p.question == f"Reverse: {p.answer[::-1]}" for p in heldout)
    assert load_problems(cfg.data, "heldout")[3] == heldout[3]  # a pure function of (seed, split, index)
    check = TASKS["reverse"].is_correct
    assert check("so #### cba", "cba") and not check("#### abc", "cba") and not check("cba", "cba")
    assert TASKS["reverse"].reward_of("#### ab", "ab") == 1.0
    batch = next(train_iterator(cfg.data, build_toy_tokenizer(), kind="sft"))
    assert all(q.startswith("Reverse: ") for q in batch["question"])


def test_task_options_are_validated_with_the_config():
    with pytest.raises(ConfigError, match=r"^RunConfig.data.options.min_len: Input should be greater than or equal"):
        load_config(None, PLUGIN + ["data.options={min_len: 0}"])
    with pytest.raises(ConfigError, match=r"^RunConfig.data.options.typo: unknown key"):
        load_config(None, PLUGIN + ["data.options={typo: 1}"])
    with pytest.raises(ConfigError, match=r"^RunConfig.data.options: task 'arithmetic' takes no options"):
        load_config(None, ["data.options={min_len: 2}"])
    with pytest.raises(ConfigError, match=r"^RunConfig.data.task: unknown task 'nope' \(registered: arithmetic, counting, jsonl"):
        load_config(None, ["data.task=nope"])


@pytest.mark.slow
def test_task_from_a_plugin_file_trains_end_to_end(tmp_path):
    registry.load_plugins([str(EXAMPLE)])
    path = write_tiny(tmp_path / "tiny.yaml", plugins=[str(EXAMPLE)],
                      data={"task": "reverse", "options": {"max_len": 4, "heldout_size": 24}, "batch_size": 8,
                            "eval_batch_size": 16},
                      train={"steps": 4, "log_rollouts": 2})
    out = tmp_path / "run"
    summary = train(load_config(str(path), [f"train.out_dir={out}", f"train.cache_dir={tiny_cache()}"]),
                    log=lambda *a: None)
    assert "after" in summary
    # the arithmetic checker would raise on a word reference: the eval went through the task's own check
    for name in ("before", "after"):
        ev = json.loads((out / "eval" / f"{name}.json").read_text())
        assert ev["num_problems"] == 24 and 0.0 <= ev["accuracy"] <= 1.0
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and all(ex["question"].startswith("Reverse: ") for r in rollouts for ex in r["examples"])


def test_extending_doc_shows_the_example_file_as_it_is():
    doc = (EXAMPLE.parents[1] / "extending.md").read_text()
    section = doc.split("## A task", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{EXAMPLE.read_text()}```" in section
    assert "plugins: [docs/examples/reverse_task.py]" in section and "task: reverse" in section
