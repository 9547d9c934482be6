"""Grain pipelines: batches of chat-formatted prompts (OPD, eval) and prompt + worked solution (SFT warm starts).

Train: problem ids -> this process's shard (`ids[process_index::process_count]`) -> seeded global shuffle,
reshuffled every epoch -> repeat forever -> encode -> batch (drop remainder) -> iterator. With `data.mix`, one
such stream per task, each batched to its fixed share of the batch, and step n's batch their n-th batches in the
mix's order (task-major). The iterator is a
`grain.DatasetIterator`: its position is saved with `grain.checkpoint.CheckpointSave` beside the train state
(see `jopd.run.checkpoint`) and a restored iterator continues with the next batch.

Held-out: fixed order, padded with copies of the last problem (`valid` False) to a multiple of the global eval
batch, then sharded the same way, so every process sees the same number of batches.

Every batch is a dict of numpy arrays (B = per-process batch, P = max_prompt_len, R = max_response_len):
  prompt_tokens [B,P] int32   chat-formatted prompt, LEFT-padded with the pad id (ends at column P-1)
  prompt_mask   [B,P] int32   1 on prompt tokens, 0 on padding
  prompt_len    [B]   int32   number of prompt tokens
  index         [B]   int64   problem id within its split (pairs runs per held-out problem; with `data.mix`, the
                              held-out id counts through the tasks' splits in the mix's order)
  valid         [B]   bool    False only on held-out padding rows
  question      [B]   str     raw question text
  user_turn     [B]   str     the user's message the prompt renders (the task's `user_turn`; a teacher with
                              another tokenizer renders it in its own template)
  answer        [B]   str     reference final answer (bare number; check with the row's task's `is_correct`)
  task          [B]   str     the row's task (`jopd.data.mixture`; `data.task` without a mix)
  task_id       [B]   int32   its position in the run's task sources (train batches: task-major, fixed rows each)
SFT batches (kind="sft") add, in the layout an OPD rollout has (prompt in columns [0,P), response after it):
  tokens        [B,P+R] int32 left-padded prompt, then the response (solution + end-of-turn), right-padded
  attn_mask     [B,P+R] int32 1 on real tokens
  loss_mask     [B,P+R] int32 1 on response tokens: the targets. Position t predicts tokens[t+1], so a
                              trainer weighs logits[:, :-1] against tokens[:, 1:] with loss_mask[:, 1:].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import grain
import jax
import numpy as np
import pydantic
from transformers import PreTrainedTokenizerBase

from jopd.config_dataclass import config_dataclass
from jopd.data.arithmetic import ArithmeticConfig
from jopd.data.counting import CountingConfig
from jopd.data.chat import prompt_ids, prompt_response_ids
from jopd.data.problem import Problem
from jopd.data.mixture import TaskSource, batch_rows, task_sources
from jopd.data.tasks import TASKS, task_options
from jopd.registry import registered

Kind = Literal["prompt", "sft"]
Split = Literal["train", "heldout"]
Batch = dict[str, np.ndarray]
_LAZY_PRECHECK = 256


@config_dataclass
class DataConfig:
    # a registered task (`jopd.data.tasks`): the built-in synthetic arithmetic, JSONL math files, or a plugin's
    task: registered(TASKS) = "arithmetic"
    arithmetic: ArithmeticConfig = ArithmeticConfig()  # generator settings (task=arithmetic)
    counting: CountingConfig = CountingConfig()  # generator settings (task=counting)
    # Several tasks in one stream: task -> weight, a registered task or a `task` label of the JSONL files. Every
    # batch holds batch_size * weight / sum(weights) prompts of each (whole numbers) and each row carries its task
    # (`jopd.data.mixture`); the held-out split is the tasks' splits one after the other. Empty: `task` alone.
    mix: dict[str, float] = pydantic.Field(default_factory=dict)
    options: dict[str, Any] = pydantic.Field(default_factory=dict)  # a plugin task's own settings (its `options`)
    train_path: str | None = None  # JSONL train problems (task=jsonl)
    heldout_path: str | None = None  # JSONL held-out problems (task=jsonl)
    batch_size: int = pydantic.Field(16, ge=1)  # global prompts per train batch, split over processes
    eval_batch_size: int = pydantic.Field(64, ge=1)  # global prompts per held-out batch
    max_prompt_len: int = pydantic.Field(80, ge=1)  # P: chat-formatted prompt tokens; longer -> error
    max_response_len: int = pydantic.Field(48, ge=1)  # R: SFT response tokens (solution + end); longer -> error
    system_prompt: str | None = None  # optional system turn before every question
    seed: int = 0  # shuffle seed (the problems themselves come from `arithmetic.seed` or the files)
    num_threads: int = pydantic.Field(0, ge=0)  # grain read threads; 0 reads in the caller's thread
    prefetch_buffer_size: int = pydantic.Field(0, ge=0)  # grain prefetch buffer (elements); 0 disables

    def __post_init__(self):
        if self.task == "jsonl" and not self.train_path:
            raise ValueError("task=jsonl needs train_path")
        for name, weight in self.mix.items():
            if weight <= 0:
                raise ValueError(f"mix: {name!r} has weight {weight}; weights must be > 0")
            if name not in TASKS.names() and not self.train_path:
                raise ValueError(f"mix: {name!r} is not a registered task ({', '.join(TASKS.names())}), and no "
                                 f"train_path holds JSONL problems labelled with it")
            if name == "jsonl" and not self.train_path:
                raise ValueError("mix: jsonl needs train_path")
        if self.mix:
            batch_rows(task_sources(self), self.batch_size)
        task_options(self)  # a task's options are checked with the config, before any compute


def load_problems(cfg: DataConfig, split: Split) -> Sequence[Problem]:
    """The problems of a split (`TASKS[cfg.task].problems`); a streaming train split is indexed by problem id.
    With `data.mix`, the held-out split is the tasks' held-out splits one after the other (the held-out ids)."""
    sources = task_sources(cfg)
    if len(sources) == 1:
        return sources[0].problems(cfg, split)
    if split == "train":
        raise ValueError("load_problems: a mix of tasks has one train stream per task (`train_dataset`)")
    return [p for s in sources for p in s.problems(cfg, split)]


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def _too_long(problem: Problem, field: str, n: int, limit_name: str, limit: int) -> ValueError:
    return ValueError(f"{problem.where} ({field}): {n} tokens after chat formatting > DataConfig.{limit_name}"
                      f"={limit}")


def encode_problem(problem: Problem, index: int, *, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig,
                   kind: Kind, valid: bool = True, source: TaskSource | None = None, task_id: int = 0
                   ) -> dict[str, Any]:
    """One problem of `source` (default: the run's first task) -> one (unbatched) element of the batch layout
    documented in this module."""
    P, R, pad = cfg.max_prompt_len, cfg.max_response_len, _pad_id(tokenizer)
    source = source or task_sources(cfg)[0]
    user_turn = source.task.user_turn(problem)
    if kind == "sft":
        prompt, response = prompt_response_ids(tokenizer, user_turn, problem.solution, cfg.system_prompt)
        if len(response) > R:
            raise _too_long(problem, "solution", len(response), "max_response_len", R)
    else:
        prompt = prompt_ids(tokenizer, user_turn, cfg.system_prompt)
    n = len(prompt)
    if n > P:
        raise _too_long(problem, "question", n, "max_prompt_len", P)
    prompt_tokens = np.full((P,), pad, np.int32)
    prompt_tokens[P - n:] = prompt
    prompt_mask = np.zeros((P,), np.int32)
    prompt_mask[P - n:] = 1
    element = {
        "prompt_tokens": prompt_tokens, "prompt_mask": prompt_mask, "prompt_len": np.int32(n),
        "index": np.int64(index), "valid": np.bool_(valid), "question": problem.question,
        "user_turn": user_turn, "answer": problem.answer, "task": source.name, "task_id": np.int32(task_id),
    }
    if kind == "sft":
        m = len(response)
        resp_tokens = np.full((R,), pad, np.int32)
        resp_tokens[:m] = response
        resp_mask = np.zeros((R,), np.int32)
        resp_mask[:m] = 1
        element["tokens"] = np.concatenate([prompt_tokens, resp_tokens])
        element["attn_mask"] = np.concatenate([prompt_mask, resp_mask])
        element["loss_mask"] = np.concatenate([np.zeros((P,), np.int32), resp_mask])
    return element


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    if not 0 <= pi < pc:
        raise ValueError(f"process_index={pi} not in [0, process_count={pc})")
    return pi, pc


def _per_process(global_batch: int, pc: int, name: str) -> int:
    if global_batch % pc:
        raise ValueError(f"DataConfig.{name}={global_batch} is not divisible by the process count {pc}")
    return global_batch // pc


def _encoder(problems: Sequence[Problem], tokenizer, cfg: DataConfig, kind: Kind, eager: bool,
             source: TaskSource, task_id: int, first_index: int = 0) -> Callable[[int], dict[str, Any]]:
    """Problem id -> element (its `index`: first_index + id). Finite splits are encoded up front: bad input fails
    before any compute."""
    def encode(i: int) -> dict[str, Any]:
        return encode_problem(problems[i], first_index + i, tokenizer=tokenizer, cfg=cfg, kind=kind, source=source,
                              task_id=task_id)

    if not eager:
        return encode
    cache = [encode(i) for i in range(len(problems))]
    return cache.__getitem__


def _read_options(cfg: DataConfig) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch_buffer_size)


def train_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, kind: Kind = "prompt",
                  process_index: int | None = None, process_count: int | None = None) -> grain.IterDataset:
    """Endless, seeded-shuffled, per-process-sharded batches of the train split (per-process batch size); with
    `data.mix`, each task's fixed share of every batch, task-major."""
    pi, pc = _process(process_index, process_count)
    sources = task_sources(cfg)
    rows = batch_rows(sources, cfg.batch_size) if len(sources) > 1 else (cfg.batch_size,)
    if len(sources) > 1 and any(n % pc for n in rows):
        shares = ", ".join(f"{s.name}: {n}" for s, n in zip(sources, rows))
        raise ValueError(f"DataConfig.mix: each task's rows per batch ({shares}) must split over the {pc} processes")
    streams = [_task_batches(cfg, tokenizer, kind, source, i, _per_process(n, pc, "batch_size"), pi, pc)
               for i, (source, n) in enumerate(zip(sources, rows))]
    ds = streams[0] if len(streams) == 1 else grain.MapDataset.range(len(streams[0])).map(
        lambda step: {k: np.concatenate([s[step][k] for s in streams]) for k in streams[0][step]})
    return ds.to_iter_dataset(_read_options(cfg))


def _task_batches(cfg: DataConfig, tokenizer, kind: Kind, source: TaskSource, task_id: int, per_process: int,
                  pi: int, pc: int) -> grain.MapDataset:
    """One task's endless stream of this process's batches of `per_process` rows (its share of each batch)."""
    problems = source.problems(cfg, "train")
    if len(problems) < pc * per_process:
        raise ValueError(f"train split{'' if not cfg.mix else f' of {source.name}'} has {len(problems)} problems, "
                         f"fewer than one global batch (DataConfig.batch_size={cfg.batch_size})")
    lazy = source.task.streams_train
    encode = _encoder(problems, tokenizer, cfg, kind, eager=not lazy, source=source, task_id=task_id)
    if lazy:  # a stream cannot be checked whole; its first problems catch a too-small length limit early
        for i in range(min(len(problems), _LAZY_PRECHECK)):
            encode(i)
    ids = grain.MapDataset.range(len(problems))[pi::pc]
    ds = ids.shuffle(seed=cfg.seed).repeat(None).map(encode)
    return ds.batch(per_process, drop_remainder=True)


def train_iterator(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, kind: Kind = "prompt",
                   process_index: int | None = None, process_count: int | None = None) -> grain.DatasetIterator:
    """A fresh checkpointable iterator over `train_dataset` (also the 'fresh iterator' a restore fills in)."""
    return iter(train_dataset(cfg, tokenizer, kind=kind, process_index=process_index, process_count=process_count))


def heldout_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, kind: Kind = "prompt",
                    process_index: int | None = None, process_count: int | None = None,
                    max_problems: int | None = None) -> grain.IterDataset:
    """One ordered pass over the held-out split in batches of `eval_batch_size` (global); padding rows invalid.
    `max_problems`: the first that many of each task's held-out problems (their ids stay the full split's)."""
    pi, pc = _process(process_index, process_count)
    per_process = _per_process(cfg.eval_batch_size, pc, "eval_batch_size")
    encoders, rows, first = [], [], 0
    for task_id, source in enumerate(task_sources(cfg)):
        problems = source.problems(cfg, "heldout")
        encoders.append(_encoder(problems, tokenizer, cfg, kind, eager=True, source=source, task_id=task_id,
                                 first_index=first))
        rows += [(task_id, i, True) for i in range(min(len(problems), max_problems or len(problems)))]
        first += len(problems)
    total = -(-len(rows) // cfg.eval_batch_size) * cfg.eval_batch_size
    rows += [rows[-1][:2] + (False,)] * (total - len(rows))

    def encode_row(row: tuple[int, int, bool]) -> dict[str, Any]:
        task_id, i, valid = row
        return {**encoders[task_id](i), "valid": np.bool_(valid)}

    ds = grain.MapDataset.source(rows)[pi::pc].map(encode_row)
    return ds.batch(per_process, drop_remainder=False).to_iter_dataset(_read_options(cfg))
