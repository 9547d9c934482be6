"""Held-out evaluation: the student answers each held-out problem under a fixed seed; per problem we report
the teacher divergence (mean per-token full-vocabulary KL(student ‖ teacher) over that response) and whether
the final answer is right. One number per problem, so two runs can be compared pairwise (`jopd compare`, the quality rule).

A teacher with another tokenizer (`cross`): the divergence is tokenizer-free, the sampled reverse KL of the text
per character, (log p_student(response) - log p_teacher(response)) / (characters + 1 for the end of the turn),
both sides scoring their own tokenization of the same text (with several teachers, one of the student's
vocabulary scores the student's tokens, so every row of the run is per character); a response the pair cannot
align is counted (`misaligned` in the summary) and left out of the divergence's mean, never scored as 0.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jopd.data.mixture import task_sources
from jopd.data.pipeline import DataConfig, heldout_dataset
from jopd.losses.chunked import chunked_map, head_params
from jopd.losses.divergences import reverse_kl
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.opd.routing import Routing
from jopd.sampling.config import SamplingConfig
from jopd.sampling.sampler import Sampler


@dataclasses.dataclass
class EvalResult:
    index: np.ndarray  # [n] held-out problem ids
    teacher_divergence: np.ndarray  # [n] nats/token, mean over the response
    correct: np.ndarray  # [n] bool
    response_len: np.ndarray  # [n] tokens
    responses: list[str]
    task: list[str] | None = None  # [n] each problem's task, when the run mixes several (`data.mix`)

    def summary(self) -> dict[str, float]:
        out = _means(self.teacher_divergence, self.correct, self.response_len)
        if self.task is not None:  # and each task's, `<task>/teacher_divergence` ...
            task = np.asarray(self.task)
            for name in dict.fromkeys(self.task):
                rows = task == name
                mine = _means(self.teacher_divergence[rows], self.correct[rows], self.response_len[rows])
                out |= {f"{name}/{k}": v for k, v in mine.items()}
        return out

    def save(self, out_dir: str | Path, name: str) -> dict[str, float]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["index", "teacher_divergence", "correct", "response_len", "response"]
                       + (["task"] if self.task is not None else []))
            tasks = self.task if self.task is not None else [None] * len(self.index)
            for row in zip(self.index, self.teacher_divergence, self.correct, self.response_len, self.responses, tasks):
                w.writerow([int(row[0]), f"{row[1]:.6g}", int(row[2]), int(row[3]), row[4]]
                           + ([row[5]] if row[5] is not None else []))
        summary = self.summary()
        (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
        return summary


def _means(divergence, correct, response_len) -> dict[str, float]:
    scored = np.isfinite(divergence)  # a cross-tokenizer response that did not align: NaN
    out = {"teacher_divergence": float(divergence[scored].mean()) if scored.any() else float("nan"),
           "accuracy": float(correct.mean()), "response_len": float(response_len.mean()),
           "num_problems": int(len(divergence))}
    if not scored.all():
        out["misaligned"] = int((~scored).sum())
    return out


def _chunked_pair_kl(s_hidden_BxNxD, t_hidden_BxNxD, s_head, t_head, chunk: int, temperature: float):
    """KL(student ‖ teacher) per position, projecting both heads `chunk` positions at a time."""
    B, N, _ = s_hidden_BxNxD.shape
    n_chunks = -(-N // chunk)
    pad = n_chunks * chunk - N

    def split(h):
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        return h.reshape(B, n_chunks, chunk, -1).swapaxes(0, 1)

    def one(args):
        hs, ht = args
        ls = transformer.logits_from_hidden(s_head, hs) / temperature
        lt = transformer.logits_from_hidden(t_head, ht) / temperature
        return reverse_kl(ls, lt)

    kl = jax.lax.map(one, (split(s_hidden_BxNxD), split(t_hidden_BxNxD)))  # [n_chunks, B, chunk]
    return kl.swapaxes(0, 1).reshape(B, n_chunks * chunk)[:, :N]


@functools.partial(jax.jit, static_argnames=("s_cfg", "t_cfg", "n_response", "chunk", "temperature"))
def teacher_divergence_BxN(student_params, teacher_params, tokens_BxT, attn_mask_BxT, *, s_cfg: ModelConfig,
                           t_cfg: ModelConfig, n_response: int, chunk: int = 64, temperature: float = 1.0):
    """Per response position, the full-vocab KL(student ‖ teacher) of the next-token distributions."""
    hs = transformer.response_hidden(student_params, s_cfg, tokens_BxT, attn_mask_BxT, n_response)
    ht = transformer.response_hidden(teacher_params, t_cfg, tokens_BxT, attn_mask_BxT, n_response)
    return _chunked_pair_kl(hs, ht, head_params(student_params), head_params(teacher_params), chunk, temperature)


@functools.partial(jax.jit, static_argnames=("s_cfg", "t_cfgs", "log_weights", "n_response", "chunk", "temperature"))
def mixture_divergence_BxN(student_params, teachers_params, tokens_BxT, attn_mask_BxT, *, s_cfg: ModelConfig,
                           t_cfgs: tuple[ModelConfig, ...], log_weights: tuple[float, ...], n_response: int,
                           chunk: int = 64, temperature: float = 1.0):
    """Per response position, the full-vocab KL(student ‖ mixture) with log p_mix = logsumexp_i(log w_i +
    log p_i) over the teachers (`opd.routing`, routing=mixture)."""
    s_head = head_params(student_params)
    heads = [head_params(p) for p in teachers_params]
    inputs = {"s": transformer.response_hidden(student_params, s_cfg, tokens_BxT, attn_mask_BxT, n_response)}
    for i, (p, c) in enumerate(zip(teachers_params, t_cfgs)):
        inputs[f"t{i}"] = transformer.response_hidden(p, c, tokens_BxT, attn_mask_BxT, n_response)

    def one(inp):
        ls = transformer.logits_from_hidden(s_head, inp["s"]) / temperature
        parts = [jax.nn.log_softmax(transformer.logits_from_hidden(h, inp[f"t{i}"]) / temperature, axis=-1) + w
                 for i, (h, w) in enumerate(zip(heads, log_weights))]
        return {"kl": reverse_kl(ls, jax.nn.logsumexp(jnp.stack(parts), axis=0))}

    return chunked_map(one, inputs, chunk)["kl"]


@functools.partial(jax.jit, static_argnames=("t_cfg", "temperature"))
def _teacher_text_logprobs(teacher_params, cross, *, t_cfg: ModelConfig, temperature: float):
    """log p_teacher of each row's aligned response (text + end of turn), its own tokenization."""
    from jopd.opd.cross_teacher import cross_teacher_fields

    out = cross_teacher_fields(teacher_params, cross, None, teacher_cfg=t_cfg, table=None, mode="sampled",
                               temperature=temperature, chunk=64)
    return jnp.sum(out["span_teacher_logprobs_BxT"], axis=1)


def _per_character(t_lp_B, out, tokenizer) -> np.ndarray:
    """(log p_s(response) - log p_t(response)) / (characters + 1 where the response ended its turn)."""
    s_lp = np.sum(out.unprocessed_logprobs_BxN * out.response_mask_BxN, axis=1)
    chars = np.asarray([len(tokenizer.decode(t[:n], skip_special_tokens=True)) + int(d)
                        for t, n, d in zip(out.tokens_BxN, out.lengths_B, out.done_B)], np.float64)
    return (s_lp - np.asarray(t_lp_B)) / np.maximum(chars, 1.0)


def cross_divergence_B(cross_teacher, teacher_params, t_cfg: ModelConfig, batch, out, temperature: float):
    """Per row: (log p_s(response) - log p_t(response)) / (characters + end of turn); NaN if not aligned."""
    from jopd.opd.cross_teacher import TEACHER_SLACK, CrossBatch

    P, N = batch["prompt_tokens"].shape[1], out.tokens_BxN.shape[1]
    arrays, reasons = cross_teacher.align(batch["user_turn"], out.tokens_BxN, out.lengths_B, P, N + TEACHER_SLACK)
    t_lp = _teacher_text_logprobs(teacher_params, CrossBatch(**arrays), t_cfg=t_cfg, temperature=temperature)
    div = _per_character(t_lp, out, cross_teacher.pair.student_tok)
    return np.where([r is None for r in reasons], div, np.nan)


@functools.partial(jax.jit, static_argnames=("t_cfg", "temperature"))
def _teacher_token_logprobs(teacher_params, tokens_BxT, attn_mask_BxT, targets_BxN, *, t_cfg: ModelConfig,
                            temperature: float):
    """log p_teacher of each row's response as the student's tokens (a teacher of the student's vocabulary)."""
    from jopd.opd.batch import SequenceLayout
    from jopd.opd.cross_teacher import same_vocab_fields

    N = targets_BxN.shape[1]
    layout = SequenceLayout(tokens_BxT, attn_mask_BxT, targets_BxN, attn_mask_BxT[:, -N:])
    out = same_vocab_fields(teacher_params, layout, None, jnp.zeros(targets_BxN.shape[0], bool), teacher_cfg=t_cfg,
                            mode="sampled", temperature=temperature, chunk=64)
    return jnp.sum(out["span_teacher_logprobs_BxT"], axis=1)


def _response_mean(kl_BxN, resp_mask_BxN) -> np.ndarray:
    """Per row, the mean of a per-position divergence over its response."""
    kl = np.asarray(kl_BxN)
    return (kl * resp_mask_BxN).sum(1) / np.maximum(resp_mask_BxN.sum(1), 1)


def heldout_divergence_B(student_params, teacher_params: tuple[Any, ...], task_id_B, *, s_cfg: ModelConfig,
                         t_cfgs: tuple[ModelConfig, ...], routing: Routing, crosses: tuple[Any, ...],
                         per_character: bool, tokenizer, batch, out, tokens, attn, temperature: float) -> np.ndarray:
    """Per row, its response's divergence to its task's teacher (`Routing.eval_teacher`; one teacher: every row's):
    every teacher that some row needs scores the whole batch, and each row keeps its own. Against a mixture or a
    teacher of the student's vocabulary, the full-vocabulary KL(student ‖ teacher) per token; in a cross-tokenizer
    run (`per_character`) the sampled reverse KL of the text per character, a teacher with another tokenizer
    (`crosses[i]`) scoring its own tokenization, one of the student's vocabulary the student's tokens."""
    targets = np.asarray([routing.eval_teacher(int(t)) for t in task_id_B], object)
    N = out.tokens_BxN.shape[1]
    result = np.full(len(task_id_B), np.nan)
    for target in dict.fromkeys(targets.tolist()):
        rows = targets == target
        if target is None:
            kl = mixture_divergence_BxN(student_params, tuple(teacher_params), tokens, attn, s_cfg=s_cfg,
                                        t_cfgs=tuple(t_cfgs), log_weights=routing.log_weights, n_response=N,
                                        temperature=temperature)
            div = _response_mean(np.asarray(kl)[rows], attn[rows, -N:])
        elif crosses[target] is not None:
            div = cross_divergence_B(crosses[target], teacher_params[target], t_cfgs[target], batch, out,
                                     temperature)[rows]
        elif per_character:
            t_lp = _teacher_token_logprobs(teacher_params[target], tokens, attn, out.tokens_BxN.astype(np.int32),
                                           t_cfg=t_cfgs[target], temperature=temperature)
            div = _per_character(t_lp, out, tokenizer)[rows]
        else:
            kl = teacher_divergence_BxN(student_params, teacher_params[target], tokens, attn, s_cfg=s_cfg,
                                        t_cfg=t_cfgs[target], n_response=N, temperature=temperature)
            div = _response_mean(np.asarray(kl)[rows], attn[rows, -N:])
        result[rows] = div
    return result


def evaluate_heldout(student_params, teacher_params: tuple[Any, ...], *, s_cfg: ModelConfig,
                     t_cfgs: tuple[ModelConfig, ...], tokenizer, data_cfg: DataConfig, sampling: SamplingConfig,
                     seed: int, max_problems: int, routing: Routing, desc: str = "eval",
                     crosses: tuple[Any, ...] | None = None, per_character: bool = False) -> EvalResult:
    """Sample one response per held-out problem (randomness keyed by the problem id), then score it. With
    `data.mix`, the first `max_problems` of each task, each graded by its task. `teacher_params`, `t_cfgs` and
    `crosses` (None: no teacher with another tokenizer) hold one entry per teacher; each row's divergence is to
    its task's teacher under `routing` (`heldout_divergence_B`)."""
    crosses = (None,) * len(t_cfgs) if crosses is None else crosses
    sampler = Sampler(s_cfg, dataclasses.replace(sampling, return_full_logprobs=False))
    sources = task_sources(data_cfg)
    idx, kls, correct, lens, texts, tasks = [], [], [], [], [], []
    total = sum(min(max_problems, len(s.problems(data_cfg, "heldout"))) for s in sources)
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)
    for batch in heldout_dataset(data_cfg, tokenizer, max_problems=max_problems):
        keep = batch["valid"]
        if not keep.any():
            break
        prompts = [list(p[m.astype(bool)]) for p, m in zip(batch["prompt_tokens"], batch["prompt_mask"])]
        out = sampler.generate(student_params, prompts, seed=seed, row_ids=batch["index"])
        tokens = np.concatenate([batch["prompt_tokens"], out.tokens_BxN], axis=1)
        resp_mask = out.response_mask_BxN
        attn = np.concatenate([batch["prompt_mask"].astype(bool), resp_mask], axis=1)
        per_problem = heldout_divergence_B(student_params, teacher_params, batch["task_id"], s_cfg=s_cfg,
                                           t_cfgs=t_cfgs, routing=routing, crosses=crosses,
                                           per_character=per_character, tokenizer=tokenizer, batch=batch, out=out,
                                           tokens=tokens, attn=attn, temperature=sampling.temperature)
        for b in np.nonzero(keep)[0]:
            text = tokenizer.decode(out.tokens_BxN[b, :out.lengths_B[b]], skip_special_tokens=True)
            idx.append(int(batch["index"][b]))
            kls.append(float(per_problem[b]))
            correct.append(sources[int(batch["task_id"][b])].task.is_correct(text, str(batch["answer"][b])))
            lens.append(int(out.lengths_B[b]))
            texts.append(text)
            tasks.append(str(batch["task"][b]))
        bar.update(int(keep.sum()))
    bar.close()
    return EvalResult(np.asarray(idx), np.asarray(kls), np.asarray(correct, bool), np.asarray(lens), texts,
                      tasks if len(sources) > 1 else None)


def compare_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Plain-text before/after table for the end of a run."""
    rows = [("held-out teacher divergence (nats/token)", "teacher_divergence", "{:.4f}"),
            ("held-out accuracy", "accuracy", "{:.1%}"), ("mean response length", "response_len", "{:.1f}")]
    lines = [f"{'':42s} {'before':>10s} {'after':>10s} {'change':>9s}"]
    for label, key, fmt in rows:
        b, a = before[key], after[key]
        change = f"{(a / b - 1):+.1%}" if b else "n/a"
        lines.append(f"{label:42s} {fmt.format(b):>10s} {fmt.format(a):>10s} {change:>9s}")
    return "\n".join(lines)
