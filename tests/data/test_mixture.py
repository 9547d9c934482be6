"""Several tasks in one stream (`data.mix`): fixed rows per task in every batch, each task's stream as if alone,
the held-out split task after task, JSONL task labels, resume, and the errors."""

import dataclasses
import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jopd.config_dataclass import ConfigError, build
from jopd.data import DataConfig, build_toy_tokenizer, heldout_dataset, load_problems, train_iterator
from jopd.data.mixture import batch_rows, task_sources

MIX = {"arithmetic": 3, "counting": 1}


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_every_batch_holds_each_tasks_share_and_each_share_is_that_tasks_own_stream(tok):
    cfg = DataConfig(mix=MIX, batch_size=8)
    batches = _take(train_iterator(cfg, tok), 3)
    alone = {name: _take(train_iterator(dataclasses.replace(cfg, mix={}, task=name, batch_size=n), tok), 3)
             for name, n in (("arithmetic", 6), ("counting", 2))}
    for step, b in enumerate(batches):
        assert list(b["task"]) == ["arithmetic"] * 6 + ["counting"] * 2
        assert list(b["task_id"]) == [0] * 6 + [1] * 2
        for name, rows in (("arithmetic", slice(0, 6)), ("counting", slice(6, 8))):
            ref = alone[name][step]
            for k in ("prompt_tokens", "prompt_mask", "index", "question", "answer"):
                assert np.array_equal(b[k][rows], ref[k]), (name, k)
    assert all(q.startswith("How many animals: ") for q in batches[0]["question"][6:])


def test_sft_batches_of_a_mix_and_two_processes_split_each_share(tok):
    cfg = DataConfig(mix=MIX, batch_size=8)
    sft = next(train_iterator(cfg, tok, kind="sft"))
    assert sft["tokens"].shape[0] == 8 and list(sft["task"]).count("counting") == 2
    halves = [next(train_iterator(cfg, tok, process_index=i, process_count=2)) for i in (0, 1)]
    for h in halves:
        assert list(h["task"]) == ["arithmetic"] * 3 + ["counting"]
    with pytest.raises(ValueError, match=r"each task.s rows per batch \(arithmetic: 6, counting: 2\) must split over the 4 p"):
        next(train_iterator(cfg, tok, process_index=0, process_count=4))  # 2 counting rows over 4 processes


def test_heldout_is_the_tasks_splits_one_after_the_other_capped_per_task(tok):
    cfg = DataConfig(mix=MIX, eval_batch_size=64, arithmetic={"heldout_size": 40}, counting={"heldout_size": 30})
    problems = load_problems(cfg, "heldout")
    assert len(problems) == 70 and problems[40].question.startswith("How many animals")
    rows = [r for b in heldout_dataset(cfg, tok, max_problems=25) for r in zip(b["index"], b["task"], b["valid"],
                                                                             b["question"])]
    valid = [r for r in rows if r[2]]
    assert [int(r[0]) for r in valid] == list(range(25)) + list(range(40, 65))
    assert all(problems[int(i)].question == q and t == ("arithmetic" if i < 40 else "counting")
               for i, t, _, q in valid)
    assert len(rows) == 64 and not any(r[2] for r in rows[50:])


def test_jsonl_task_labels_are_mix_sources(tok, tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"question": f"Q{i}?", "answer": f"#### {i}", "task": "even" if i % 2 == 0 else "odd"} for i in range(20)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = DataConfig(task="jsonl", train_path=str(path), heldout_path=str(path), mix={"odd": 1, "even": 1},
                     batch_size=4, eval_batch_size=8)
    assert [s.name for s in task_sources(cfg)] == ["odd", "even"]
    b = next(train_iterator(cfg, tok))
    assert list(b["task"]) == ["odd", "odd", "even", "even"]
    assert [int(q[1:-1]) % 2 for q in b["question"]] == [1, 1, 0, 0]
    bad = dataclasses.replace(cfg, mix={"odd": 1, "prime": 1})
    with pytest.raises(ValueError, match=r"DataConfig.mix: 'prime' is neither a registered task .* nor a `task` "
                                         r"label of .*mixed.jsonl"):
        next(train_iterator(bad, tok))


def test_resume_mid_stream_continues_every_tasks_stream(tok, tmp_path):
    cfg = DataConfig(mix=MIX, batch_size=4)
    reference = _take(train_iterator(cfg, tok), 5)
    it = train_iterator(cfg, tok)
    _take(it, 2)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(2, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(train_iterator(cfg, tok))))["data"]
    for a, b in zip(_take(restored, 3), reference[2:]):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_mix_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^DataConfig: mix: batch_size=6 does not split into whole rows per task "
                                          r"\(arithmetic: 4.5, counting: 1.5\)"):
        build(DataConfig, {"mix": MIX, "batch_size": 6})
    with pytest.raises(ConfigError, match=r"mix: 'poems' is not a registered task"):
        build(DataConfig, {"mix": {"poems": 1}})
    with pytest.raises(ConfigError, match=r"mix: 'counting' has weight 0"):
        build(DataConfig, {"mix": {"arithmetic": 1, "counting": 0}})
    assert batch_rows(task_sources(DataConfig(mix=MIX, batch_size=8)), 8) == (6, 2)
