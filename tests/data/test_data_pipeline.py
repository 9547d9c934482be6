"""Grain pipelines: batch layout, determinism, per-process sharding, held-out padding, Orbax-checkpointed resume."""

import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jopd.config_dataclass import ConfigError, build
from jopd.data import (DataConfig, build_toy_tokenizer, heldout_dataset, heldout_problems, load_problems,
                       train_iterator)


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


@pytest.fixture
def jsonl_cfg(tmp_path):
    """24 distinct problems in a JSONL file: small enough to check whole epochs."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i}+1={i + 1}. #### {i + 1}"})
                            + "\n" for i in range(24)))
    return DataConfig(task="jsonl", train_path=str(path), heldout_path=str(path), batch_size=4, eval_batch_size=10)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_prompt_batch_layout(tok):
    cfg = DataConfig(batch_size=4, max_prompt_len=80)
    batch = next(train_iterator(cfg, tok))
    assert {k: (v.dtype.kind, v.shape) for k, v in batch.items()} == {
        "prompt_tokens": ("i", (4, 80)), "prompt_mask": ("i", (4, 80)), "prompt_len": ("i", (4,)),
        "index": ("i", (4,)), "valid": ("b", (4,)), "question": ("U", (4,)), "user_turn": ("U", (4,)),
        "answer": ("U", (4,)), "task": ("U", (4,)), "task_id": ("i", (4,))}
    assert set(batch["task"]) == {"arithmetic"} and not batch["task_id"].any()
    assert batch["prompt_tokens"].dtype == np.int32 and batch["index"].dtype == np.int64
    problems = load_problems(cfg, "train")
    for row in range(4):
        n = batch["prompt_len"][row]
        p = problems[int(batch["index"][row])]
        assert (p.question, p.question, p.answer) == (batch["question"][row], batch["user_turn"][row],
                                                      batch["answer"][row])
        assert batch["prompt_mask"][row].tolist() == [0] * (80 - n) + [1] * n  # left padded
        assert np.all(batch["prompt_tokens"][row, : 80 - n] == tok.pad_token_id)
        assert tok.decode(batch["prompt_tokens"][row, 80 - n:]) == tok.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True)
    assert batch["valid"].all()


def test_sft_batch_masks_only_the_response(tok):
    cfg = DataConfig(batch_size=2, max_prompt_len=80, max_response_len=48)
    batch = next(train_iterator(cfg, tok, kind="sft"))
    assert batch["tokens"].shape == batch["attn_mask"].shape == batch["loss_mask"].shape == (2, 128)
    problems = load_problems(cfg, "train")
    for row in range(2):
        p = problems[int(batch["index"][row])]
        tokens, loss_mask = batch["tokens"][row], batch["loss_mask"][row]
        assert np.array_equal(tokens[:80], batch["prompt_tokens"][row])
        assert tok.decode(tokens[loss_mask == 1]) == p.solution + "<|end|>"
        assert np.all(loss_mask[:80] == 0)  # nothing in the prompt is a target
        assert np.array_equal(batch["attn_mask"][row], np.concatenate([batch["prompt_mask"][row], loss_mask[80:]]))
        m = loss_mask.sum()
        assert loss_mask[80:80 + m].all() and not loss_mask[80 + m:].any()  # response starts right at column P


def test_order_is_deterministic_per_seed(tok):
    cfg = DataConfig(batch_size=4)
    a, b = _take(train_iterator(cfg, tok), 3), _take(train_iterator(cfg, tok), 3)
    assert all(_same(x, y) for x, y in zip(a, b))
    other = _take(train_iterator(DataConfig(batch_size=4, seed=1), tok), 3)
    assert [x["index"].tolist() for x in a] != [x["index"].tolist() for x in other]


def test_epochs_cover_everything_and_reshuffle(tok, jsonl_cfg):
    it = train_iterator(jsonl_cfg, tok)
    epoch1 = np.concatenate([b["index"] for b in _take(it, 6)])
    epoch2 = np.concatenate([b["index"] for b in _take(it, 6)])
    assert sorted(epoch1.tolist()) == sorted(epoch2.tolist()) == list(range(24))
    assert epoch1.tolist() != epoch2.tolist()


def test_per_process_sharding_is_disjoint(tok, jsonl_cfg):
    per = [train_iterator(jsonl_cfg, tok, process_index=i, process_count=2) for i in range(2)]
    epochs = [np.concatenate([b["index"] for b in _take(it, 6)]) for it in per]  # 6 x 2 rows = half the data
    assert all(len(e) == 12 for e in epochs)
    assert set(epochs[0].tolist()).isdisjoint(epochs[1].tolist())
    assert sorted(np.concatenate(epochs).tolist()) == list(range(24))
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=4 is not divisible by the process count 3"):
        train_iterator(jsonl_cfg, tok, process_index=0, process_count=3)
    # The arithmetic stream shards the same way.
    cfg = DataConfig(batch_size=8)
    streams = [np.concatenate([b["index"] for b in _take(train_iterator(cfg, tok, process_index=i,
                                                                         process_count=2), 4)]) for i in range(2)]
    assert set(streams[0].tolist()).isdisjoint(streams[1].tolist())


def test_heldout_is_ordered_padded_and_sharded(tok):
    cfg = DataConfig(eval_batch_size=64)
    batches = list(heldout_dataset(cfg, tok))
    assert len(batches) == 9 and all(b["index"].shape == (64,) for b in batches)
    index = np.concatenate([b["index"] for b in batches])
    valid = np.concatenate([b["valid"] for b in batches])
    assert index[valid].tolist() == list(range(530)) and valid.sum() == 530
    assert [str(a) for b in batches for a, v in zip(b["answer"], b["valid"]) if v] == [
        p.answer for p in heldout_problems(cfg.arithmetic)]
    shards = [list(heldout_dataset(cfg, tok, process_index=i, process_count=2)) for i in range(2)]
    assert len(shards[0]) == len(shards[1]) == 9 and shards[0][0]["index"].shape == (32,)
    got = np.concatenate([b["index"][b["valid"]] for s in shards for b in s])
    assert sorted(got.tolist()) == list(range(530))


def test_too_long_inputs_name_problem_and_field(tok, jsonl_cfg, tmp_path):
    with pytest.raises(ValueError, match=r"arithmetic train #0 \(question\): \d+ tokens after chat formatting "
                                         r"> DataConfig.max_prompt_len=20"):
        train_iterator(DataConfig(max_prompt_len=20), tok)
    with pytest.raises(ValueError, match=r"arithmetic train #0 \(solution\): \d+ tokens .* "
                                         r"> DataConfig.max_response_len=5"):
        train_iterator(DataConfig(max_response_len=5), tok, kind="sft")
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"question": "short", "answer": "#### 1"}) + "\n"
                    + json.dumps({"question": "x" * 100, "answer": "#### 1"}) + "\n")
    cfg = DataConfig(task="jsonl", train_path=str(path), batch_size=1)
    with pytest.raises(ValueError, match=r"long.jsonl:2 \(question\): 104 tokens after chat formatting"):
        train_iterator(cfg, tok)


def test_data_config_errors():
    with pytest.raises(ConfigError, match=r"^DataConfig.task: unknown task 'gsm' \(registered: arithmetic, counting, jsonl"):
        build(DataConfig, {"task": "gsm"})
    with pytest.raises(ConfigError, match=r"DataConfig.arithmetic.max_steps: Input should be less than"):
        build(DataConfig, {"arithmetic": {"max_steps": 60}})
    with pytest.raises(ConfigError, match=r"task=jsonl needs train_path"):
        build(DataConfig, {"task": "jsonl"})


@pytest.mark.parametrize("num_threads", [0, 2])
def test_orbax_checkpoint_mid_stream_resumes_with_next_batch(tok, tmp_path, num_threads):
    cfg = DataConfig(batch_size=4, num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
    reference = _take(train_iterator(cfg, tok, kind="sft"), 7)
    it = train_iterator(cfg, tok, kind="sft")
    assert all(_same(a, b) for a, b in zip(_take(it, 3), reference[:3]))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        _take(it, 2)  # the live iterator moves on while the save completes
        mgr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(3, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(train_iterator(cfg, tok, kind="sft"))))["data"]
    assert all(_same(a, b) for a, b in zip(_take(restored, 4), reference[3:]))
