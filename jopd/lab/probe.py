"""Teacher-reliability probe: from the student's own wrong prefixes, does the teacher recover, or carry the error on?

OPD scores the student's tokens with the teacher on the student's own prefixes. Once a prefix has gone wrong, a
teacher that keeps writing along the error gives a token-level signal that reinforces it. The probe measures
that before anyone trusts the signal:

1. The student answers held-out problems (`train.eval_seed`, the run's sampling: the same draws as `jopd
   train`'s held-out eval; or greedily); the responses with a wrong final answer are kept.
2. Each wrong response is cut at its first error (a task with a step checker, `jopd.data.tasks`: the arithmetic
   task's is `jopd.data.arithmetic_steps`) or, where
   steps cannot be checked (JSONL math), at fixed fractions of its tokens. The **erroneous prefix** is the
   prompt + the response tokens up to and including the token that produced the first wrong character (the
   first token after which no correct solution starts with the response). A stop token is never kept: when
   the error is stopping early, the prefix ends before the stop token and the teacher may go on instead.
   (With fraction cuts the "erroneous" prefixes are cuts of wrong responses: the error may lie after the cut.)
3. From each prefix the teacher continues greedily and with K seeded samples (the run's temperature / top-p /
   top-k; sample j of a problem has the same random draws in every prefix set), within the responses' token
   budget (prefix + continuation <= train.eval_max_new_tokens tokens). The continued response
   (prefix + continuation) ends on a final answer, its last `#### n` (a continuation may restate one):
   **recovery**: it is the correct answer; **agreement**: it is the student's wrong answer (or both have none);
   **other**: anything else. Per prefix the three add up to 1 (sampled: fractions of the K samples). Also, on
   the arithmetic task, **follows_error** (the student's prefixes): not recovered, and the completed response
   has exactly one local error (`arithmetic_steps.local_violations`), i.e. the teacher wrote along the error to
   the answer it implies, whether or not the student landed there too.
4. **Recognition**, from one teacher forward: at the position that predicts the prefix's last kept token (the
   erroneous token; a stop token when the error is stopping early), the teacher's probability of that token
   (at the sampling temperature), its probability of its own top choice, and the token's rank (1 = the
   teacher's top choice: it does not "see" the error there).
5. Controls, on the same problems, cut at the same place (same step, same character offset in it; or the same
   fraction): the **reference** worked solution (a correct prefix: the erroneous token replaced by the correct
   one) and the **teacher's own** sampled response.

Rates are means over prefixes with 95% percentile-bootstrap CIs over prefixes (`scipy.stats.bootstrap`).
`probe(run, student_params, problems)` is the whole measurement, so a training hook (`training_probe`, which
`jopd train` hands to the loop for `train.probe_every`) calls it on a small fixed set; `continue_fn` replaces the
teacher's continuation (tests use an oracle that writes the right solution).
The rates, the verdict and the files are built in `jopd.lab.probe_report`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jopd.data.answers import extract_answer, parse_number
from jopd.data.arithmetic_steps import fraction_cuts, prefix_char_lengths, token_at_char
from jopd.data.chat import prompt_ids, prompt_response_ids
from jopd.data.mixture import TaskSource, task_sources
from jopd.data.problem import Problem
from jopd.data.tasks import StepChecker, Task
from jopd.data.toy_tokenizer import special_token_ids
from jopd.lab.probe_report import (  # noqa: F401  (some re-exported: the probe's public names)
    AGREEMENT_WARNING, FOLLOWS, OUTCOMES, SET_LABELS, SETS, ProbeReport, position_key, set_summary,
    training_metrics, verdict)
from jopd.models import transformer
from jopd.models.config import ModelConfig
from jopd.sampling.config import SamplingConfig, row_randomness
from jopd.sampling.sampler import Sampler, bucket_size, check_prompts


# (prefixes, sample) -> the teacher's continuation text of each prefix; sample None = greedy, j = the j-th draw
ContinueFn = Callable[[Sequence["Prefix"], "int | None"], list[str]]


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    samples: int = 4  # K seeded teacher continuations per prefix (0: greedy only)
    seed: int | None = None  # None: the run's train.eval_seed
    student_greedy: bool = False  # the student answers greedily instead of with the run's sampling
    cut: Literal["auto", "first_error", "fractions"] = "auto"  # auto: first_error on the arithmetic task
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75)  # cut points of the fractions fallback
    max_new_tokens: int | None = None  # response / continuation budget; None: train.eval_max_new_tokens
    batch_size: int | None = None  # sampler rows per call; None: data.eval_batch_size
    resamples: int = 2000  # bootstrap resamples
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Prefix:
    """One prefix the teacher continues: prompt + the first len(response_ids) tokens of some response."""

    set: str  # one of SETS
    problem: int  # index of the problem in the probed list (= held-out id for `load_problems(..., "heldout")`)
    position: str  # bucket: "step 1", ..., "answer" (first error) or "25%", ... (fractions)
    kind: str  # the student's first-error kind on this problem (the same in all three sets), or "cut"
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]  # the kept response tokens
    scored_index: int  # recognition: the teacher's next-token distribution after response_ids[:scored_index]
    scored_id: int  # ... evaluated at this token (the erroneous token, or the correct / own token at the cut)
    student_answer: str | None  # the student's final answer on this problem (wrong)
    answer: str  # the reference answer
    text: str  # the kept response tokens, decoded
    response: str = ""  # the whole response it was cut from
    erroneous: bool | None = None  # teacher_own: does the kept prefix contain the teacher's own first error


# ---------------------------------------------------------------------------------------------
# answers and outcomes


def final_answer(text: str) -> str | None:
    """The final answer a response ends on: the number after its last `####` (None if none)."""
    at = text.rfind("####")
    return None if at < 0 else extract_answer(text[at:])


def outcome(full_text: str, answer: str, student_answer: str | None) -> str:
    """recovery (ends on the right answer), agreement (on the student's answer; or both have none), other."""
    got = parse_number(final_answer(full_text))
    if got is not None and got == parse_number(answer):
        return "recovery"
    if got == parse_number(student_answer):
        return "agreement"
    return "other"


# ---------------------------------------------------------------------------------------------
# sampling, keyed by problem


def sample_seed(seed: int, sample: int) -> int:
    """Seed of the teacher's j-th sampled continuation (distinct from the responses' own seed)."""
    return seed + 1 + sample


def generate_keyed(sampler: Sampler, params, prompts: Sequence[Sequence[int]], keys: Sequence[int], *, seed: int,
                   batch: int, desc: str = "", progress: bool = True) -> list[list[int]]:
    """Sampled token ids (stop token included) of each prompt; row i's draws come from (seed, keys[i]) whatever
    its batch-mates, and every call is padded to `batch` rows (one compiled shape per prompt bucket)."""
    if not prompts:
        return []
    check_prompts(prompts, sampler.cfg, sampler.sampling.max_new_tokens)
    out: list[list[int]] = []
    for lo in tqdm(range(0, len(prompts), batch), desc=desc, leave=False, disable=not progress):
        chunk = prompts[lo:lo + batch]
        toks, mask = sampler.pad(chunk, min_batch=batch)
        row_keys = np.zeros(toks.shape[0], np.int64)
        row_keys[:len(chunk)] = keys[lo:lo + batch]
        rand = row_randomness(seed, row_keys, sampler.sampling.max_new_tokens)
        res = sampler.sample_padded(params, toks, mask, rand)
        tokens, lengths = np.asarray(res.tokens_BxN), np.asarray(res.lengths_B)
        out += [tokens[b, :lengths[b]].tolist() for b in range(len(chunk))]
    return out


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def sampler_continue_fn(model_cfg: ModelConfig, params, tokenizer, sampling: SamplingConfig, *, seed: int,
                        batch: int, prompt_bucket: int = 8, progress: bool = True) -> ContinueFn:
    """The real continuation: `Sampler` on the teacher (greedy, or draw j seeded by (sample_seed, problem)).
    The completed response keeps the responses' budget: prefix + continuation <= sampling.max_new_tokens tokens."""
    samplers: dict[bool, Sampler] = {}

    def continue_fn(prefixes: Sequence[Prefix], sample: int | None) -> list[str]:
        greedy = sample is None
        if greedy not in samplers:
            samplers[greedy] = Sampler(model_cfg, dataclasses.replace(sampling, greedy=greedy,
                                                                      return_full_logprobs=False),
                                       min_prompt_bucket=prompt_bucket)
        prompts = [list(p.prompt_ids) + list(p.response_ids) for p in prefixes]
        new = generate_keyed(samplers[greedy], params, prompts, [p.problem for p in prefixes],
                             seed=0 if greedy else sample_seed(seed, sample), batch=batch, progress=progress,
                             desc="teacher greedy" if greedy else f"teacher sample {sample + 1}")
        texts = []
        for p, ids in zip(prefixes, new):
            ids = ids[:max(0, sampling.max_new_tokens - len(p.response_ids))]  # the response's own budget
            full = _decode(tokenizer, list(p.response_ids) + ids)  # decoded whole: BPE merges across the cut
            texts.append(full[len(p.text):] if full.startswith(p.text) else _decode(tokenizer, ids))
        return texts

    return continue_fn


# ---------------------------------------------------------------------------------------------
# recognition: one teacher forward


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def next_token_stats(params, tokens_BxT, mask_BxT, last_B, target_B, *, cfg: ModelConfig, temperature: float):
    """At position last_B (predicting the next token): log p(target), log p(top), top id, rank of target (1 =
    top), under the model's next-token distribution at `temperature`. Right-padded rows."""
    hidden_BxTxD, _ = transformer.forward(params, tokens_BxT, cfg=cfg, attn_mask_BxT=mask_BxT, return_hidden=True)
    h_Bx1xD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)
    logits_BxV = transformer.logits_from_hidden(params, h_Bx1xD)[:, 0].astype(jnp.float32) / temperature
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    target_logit_B = jnp.take_along_axis(logits_BxV, target_B[:, None], axis=1)[:, 0]
    rank_B = 1 + jnp.sum(logits_BxV > target_logit_B[:, None], axis=1)
    return (jnp.take_along_axis(logp_BxV, target_B[:, None], axis=1)[:, 0], jnp.max(logp_BxV, axis=1),
            jnp.argmax(logits_BxV, axis=1), rank_B)


def recognition(model_cfg: ModelConfig, params, prefixes: Sequence[Prefix], *, temperature: float, batch: int,
                min_width: int = 32, progress: bool = True) -> dict[str, np.ndarray]:
    """Per prefix: p_token, p_top, top_id, rank of the scored token under the teacher (see `next_token_stats`)."""
    contexts = [list(p.prompt_ids) + list(p.response_ids[:p.scored_index]) for p in prefixes]
    width = max(min_width, -(-max(len(c) for c in contexts) // 32) * 32)
    cols: dict[str, list] = {"p_token": [], "p_top": [], "top_id": [], "rank": []}
    for lo in tqdm(range(0, len(contexts), batch), desc="teacher recognition", leave=False, disable=not progress):
        chunk = contexts[lo:lo + batch]
        tokens_BxT = np.zeros((batch, width), np.int32)
        mask_BxT = np.zeros((batch, width), bool)
        mask_BxT[:, 0] = True  # filler rows: one token
        last_B = np.zeros(batch, np.int32)
        target_B = np.zeros(batch, np.int32)
        for b, c in enumerate(chunk):
            tokens_BxT[b, :len(c)] = c
            mask_BxT[b, :len(c)] = True
            last_B[b] = len(c) - 1
            target_B[b] = prefixes[lo + b].scored_id
        lp, lp_top, top, rank = jax.device_get(next_token_stats(params, tokens_BxT, mask_BxT, last_B, target_B,
                                                                cfg=model_cfg, temperature=temperature))
        n = len(chunk)
        cols["p_token"] += np.exp(lp[:n]).tolist()
        cols["p_top"] += np.exp(lp_top[:n]).tolist()
        cols["top_id"] += top[:n].tolist()
        cols["rank"] += rank[:n].tolist()
    return {k: np.asarray(v) for k, v in cols.items()}


# ---------------------------------------------------------------------------------------------
# cutting responses into prefixes


@dataclasses.dataclass(frozen=True)
class Response:
    """One sampled (or reference) response: its tokens (stop included) and their decoded text."""

    ids: tuple[int, ...]
    text: str


def response_of(tokenizer, ids: Sequence[int]) -> Response:
    return Response(tuple(int(i) for i in ids), _decode(tokenizer, ids))


def keep_through(ids: Sequence[int], token: int, specials: frozenset[int]) -> tuple[tuple[int, ...], int, int]:
    """(kept ids, scored index, scored id) when the prefix ends at response token `token`: kept through it, or
    up to it when it is a stop/special token (a continuation cannot start after a stop)."""
    tok = int(ids[token])
    kept = tuple(ids[:token] if tok in specials else ids[:token + 1])
    return kept, token, tok


def _position_label(step: int, n_steps: int) -> str:
    return "answer" if step >= n_steps else f"step {step + 1}"


@dataclasses.dataclass
class _Cuts:
    prefixes: list[Prefix]
    skipped: dict[str, int]
    kinds: dict[str, int]


def _error_cuts(problem_ids: Sequence[int], problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                student: Sequence[Response], teacher: Sequence[Response], reference: Sequence[Response],
                tokenizer, specials: frozenset[int], checker: StepChecker) -> _Cuts:
    """Cut the wrong responses at their first error (the task's step checker); the controls at the same (step,
    offset)."""
    out, skipped, kinds = [], {}, {}

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    for i in problem_ids:
        prob, resp = problems[i], student[i]
        check = checker.check_response(resp.text, prob.solution)
        err = check.error
        if err is None:
            skip("no_error_found")
            continue
        token = token_at_char(prefix_char_lengths(tokenizer, resp.ids), err.char)
        if token is None:
            skip("error_after_last_token")  # it ran out of tokens; nothing to score
            continue
        kinds[err.kind] = kinds.get(err.kind, 0) + 1
        n_steps = checker.num_steps(prob.solution)
        common = dict(problem=i, position=_position_label(err.step, n_steps), kind=err.kind,
                      prompt_ids=tuple(prompts[i]), student_answer=final_answer(resp.text), answer=prob.answer)
        kept, j, tok = keep_through(resp.ids, token, specials)
        out.append(Prefix(set="student_error", response_ids=kept, scored_index=j, scored_id=tok,
                          text=_decode(tokenizer, kept), response=resp.text, **common))
        for name, other in (("reference", reference[i]), ("teacher_own", teacher[i])):
            other_check = checker.check_response(other.text, prob.solution)
            char = other_check.char_of(err.step, err.offset, len(other.text))
            t = token_at_char(prefix_char_lengths(tokenizer, other.ids), char)
            t = len(other.ids) - 1 if t is None else t
            kept, j, tok = keep_through(other.ids, t, specials)
            own_err = other_check.error
            erroneous = None if name == "reference" else bool(own_err is not None and own_err.char <= char)
            out.append(Prefix(set=name, response_ids=kept, scored_index=j, scored_id=tok,
                              text=_decode(tokenizer, kept), response=other.text, erroneous=erroneous,
                              **common))
    return _Cuts(out, skipped, kinds)


def _fraction_cuts(problem_ids: Sequence[int], problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                   student: Sequence[Response], teacher: Sequence[Response], reference: Sequence[Response],
                   tokenizer, specials: frozenset[int], fractions: Sequence[float]) -> _Cuts:
    """Cut each wrong response (and the controls) at `fractions` of its tokens (stop token not counted)."""
    out = []
    for i in problem_ids:
        common = dict(problem=i, kind="cut", prompt_ids=tuple(prompts[i]), answer=problems[i].answer,
                      student_answer=final_answer(student[i].text))
        for name, resp in (("student_error", student[i]), ("reference", reference[i]),
                           ("teacher_own", teacher[i])):
            body = [t for t in resp.ids if t not in specials] or list(resp.ids[:1])
            for f, k in zip(fractions, fraction_cuts(len(body), fractions)):
                kept = tuple(body[:k])
                out.append(Prefix(set=name, position=f"{round(100 * f)}%", response_ids=kept, scored_index=k - 1,
                                  scored_id=int(body[k - 1]), text=_decode(tokenizer, kept), response=resp.text,
                                  **common))
    return _Cuts(out, {}, {})


# ---------------------------------------------------------------------------------------------
# the probe


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What one probe call needs, resolved once from the run and the options."""

    tokenizer: Any
    student_cfg: ModelConfig
    teacher_cfg: ModelConfig
    teacher_params: Any
    sampling: SamplingConfig  # the run's, with the responses' budget
    cut: str
    seed: int
    batch: int
    bucket: int  # the one prompt bucket of every sampler call (prompt + prefix fit)
    system_prompt: str | None
    specials: frozenset[int]
    task: Task  # the run's task entry: prompts, answer check, step checker


def _setup(run, options: ProbeOptions, teacher: int, source: TaskSource) -> _Setup:
    cfg = run.cfg
    if cfg.loss.cross_tokenizer != "off":
        raise ValueError(f"RunConfig.loss.kind={cfg.loss.kind}: the teacher-reliability probe "
                         f"feeds the teacher the student's token ids; not with a teacher of another tokenizer")
    if options.samples < 0:
        raise ValueError(f"samples: must be >= 0, got {options.samples}")
    task = source.task
    cut = options.cut if options.cut != "auto" else ("first_error" if task.step_checker else "fractions")
    if cut == "first_error" and task.step_checker is None:
        raise ValueError(f"cut=first_error: task {source.name!r} has no step checker (its steps are not checkable)")
    sampling = dataclasses.replace(cfg.sampling, return_full_logprobs=False,
                                   max_new_tokens=options.max_new_tokens or cfg.train.eval_max_new_tokens)
    params = run.teacher_params[teacher]
    params = jax.device_get(params) if jax.process_count() == 1 else params
    return _Setup(tokenizer=run.tokenizer, student_cfg=run.step.student_cfg, teacher_cfg=run.step.teacher_cfgs[teacher],
                  teacher_params=params, sampling=sampling, cut=cut, task=task,
                  seed=cfg.train.eval_seed if options.seed is None else options.seed,
                  batch=options.batch_size or cfg.data.eval_batch_size,
                  bucket=bucket_size(cfg.data.max_prompt_len + sampling.max_new_tokens, minimum=8, pow2_up_to=256),
                  system_prompt=cfg.data.system_prompt, specials=frozenset(special_token_ids(run.tokenizer)))


def _responses(su: _Setup, model_cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], keys: Sequence[int],
               *, greedy: bool, desc: str, progress: bool) -> list[Response]:
    sampler = Sampler(model_cfg, dataclasses.replace(su.sampling, greedy=greedy), min_prompt_bucket=su.bucket)
    ids = generate_keyed(sampler, params, prompts, keys, seed=su.seed, batch=su.batch, desc=desc, progress=progress)
    return [response_of(su.tokenizer, x) for x in ids]


@dataclasses.dataclass
class _Continued:
    values: np.ndarray  # [draws, prefixes, 4]: one-hot outcome (OUTCOMES), then follows_error (NaN: not measured)
    answers: list[list[str | None]]  # [draws][prefixes] the final answer each completed response ends on
    greedy_texts: list[str]  # the greedy continuations


def _continue_all(prefixes: Sequence[Prefix], cont: ContinueFn, samples: int, solutions: dict[int, str] | None,
                  checker: StepChecker | None = None) -> _Continued:
    """Greedy then K sampled continuations of every prefix, scored. `solutions` (problem -> worked solution)
    with the task's step `checker`: measure follows_error on the student's prefixes."""
    draws = [None] + list(range(samples))
    values = np.zeros((len(draws), len(prefixes), len(OUTCOMES) + 1))
    values[..., len(OUTCOMES)] = np.nan
    answers, greedy_texts = [], []
    for d, sample in enumerate(draws):
        texts = cont(prefixes, sample)
        if len(texts) != len(prefixes):
            raise ValueError(f"continue_fn: returned {len(texts)} continuations for {len(prefixes)} prefixes")
        greedy_texts = texts if sample is None else greedy_texts
        answers.append([])
        for k, (p, t) in enumerate(zip(prefixes, texts)):
            full = p.text + t
            result = outcome(full, p.answer, p.student_answer)
            values[d, k, OUTCOMES.index(result)] = 1
            if solutions is not None and p.set == "student_error":
                values[d, k, -1] = result != "recovery" and checker.local_violations(full, solutions[p.problem]) == 1
            answers[-1].append(final_answer(full))
    return _Continued(values, answers, list(greedy_texts))


def _cell(x: float, fmt: str = ".4g") -> str:
    return "" if np.isnan(x) else format(x, fmt)


def _rows(prefixes: Sequence[Prefix], done: _Continued, rec: dict[str, np.ndarray], tokenizer) -> list[dict]:
    """One CSV row per prefix."""
    greedy_N, sampled_N = done.values[0], done.values[1:].mean(0) if len(done.values) > 1 else None
    rows = []
    for k, p in enumerate(prefixes):
        row = {"set": p.set, "problem": p.problem, "position": p.position, "kind": p.kind,
               "kept_tokens": len(p.response_ids), "scored_index": p.scored_index, "prefix": p.text,
               "scored_token": tokenizer.decode([p.scored_id]),
               "teacher_top_token": tokenizer.decode([int(rec["top_id"][k])]),
               "p_token": f"{rec['p_token'][k]:.6g}", "p_top": f"{rec['p_top'][k]:.6g}", "rank": int(rec["rank"][k]),
               "student_answer": p.student_answer or "", "answer": p.answer,
               "greedy_outcome": OUTCOMES[int(np.argmax(greedy_N[k, :len(OUTCOMES)]))],
               "greedy_answer": done.answers[0][k] or "", "greedy_follows_error": _cell(greedy_N[k, -1], "g"),
               "greedy_continuation": done.greedy_texts[k], "response": p.response}
        if sampled_N is not None:
            row |= {f"sampled_{o}": _cell(sampled_N[k, j]) for j, o in enumerate((*OUTCOMES, FOLLOWS))}
        rows.append(row | {"prefix_erroneous": "" if p.erroneous is None else int(p.erroneous)})
    return rows


def probe(run, student_params, problems: Sequence[Problem], *, options: ProbeOptions = ProbeOptions(),
          continue_fn: ContinueFn | None = None, teacher: int = 0, source: TaskSource | None = None) -> ProbeReport:
    """The teacher-reliability probe of `run` (a `jopd.run.loop.OPDRun`: teacher, tokenizer, sampling, data
    config) with the student at `student_params`, on `problems` (keyed by their position in the list), all of
    task `source` (default: the run's only task). `teacher`: which of several teachers (`RunConfig.teachers`).
    `continue_fn` replaces the teacher's continuation (default: `sampler_continue_fn` on the teacher).
    Pure measurement (no files): a training hook can call it on a small fixed set every N steps."""
    if not problems:
        raise ValueError("probe: no problems given")
    if source is None:
        sources = task_sources(run.cfg.data)
        if len(sources) > 1:
            raise ValueError("probe: the run mixes several tasks; probe one task's problems at a time (`probe_pairs`)")
        source = sources[0]
    su = _setup(run, options, teacher, source)
    tok, progress = su.tokenizer, options.progress
    student_params = jax.device_get(student_params) if jax.process_count() == 1 else student_params

    prompts = [prompt_ids(tok, su.task.user_turn(p), su.system_prompt) for p in problems]
    student = _responses(su, su.student_cfg, student_params, prompts, range(len(problems)),
                         greedy=options.student_greedy, desc="student", progress=progress)
    wrong = [i for i, (p, r) in enumerate(zip(problems, student)) if not su.task.is_correct(r.text, p.answer)]
    # a wrong first answer restated right at the end would count as both recovery and agreement: not probed
    restated = {i for i in wrong if outcome(student[i].text, problems[i].answer, None) == "recovery"}
    wrong = [i for i in wrong if i not in restated]
    own = dict(zip(wrong, _responses(su, su.teacher_cfg, su.teacher_params, [prompts[i] for i in wrong], wrong,
                                     greedy=False, desc="teacher own", progress=progress)))
    reference = {i: response_of(tok, prompt_response_ids(tok, su.task.user_turn(problems[i]), problems[i].solution,
                                                         su.system_prompt)[1]) for i in wrong}
    args = (wrong, problems, prompts, student, own, reference, tok, su.specials)
    cuts = (_error_cuts(*args, su.task.step_checker) if su.cut == "first_error"
            else _fraction_cuts(*args, options.fractions))
    if restated:
        cuts.skipped["answer_restated_right"] = len(restated)
    prefixes = cuts.prefixes

    cont = continue_fn or sampler_continue_fn(su.teacher_cfg, su.teacher_params, tok, su.sampling, seed=su.seed,
                                              batch=su.batch, prompt_bucket=su.bucket, progress=progress)
    solutions = {i: problems[i].solution for i in wrong} if su.cut == "first_error" else None
    done = _continue_all(prefixes, cont, options.samples, solutions, su.task.step_checker) if prefixes else \
        _Continued(np.zeros((1 + options.samples, 0, len(OUTCOMES) + 1)), [[]], [])
    rec = (recognition(su.teacher_cfg, su.teacher_params, prefixes, temperature=su.sampling.temperature,
                       batch=su.batch, min_width=su.bucket, progress=progress) if prefixes
           else {k: np.zeros(0) for k in ("p_token", "p_top", "top_id", "rank")})
    rows = _rows(prefixes, done, rec, tok)

    sets = {}
    for name in SETS:
        sel = np.array([p.set == name for p in prefixes], bool)
        sampled = done.values[1:, sel].mean(0) if options.samples else None
        sets[name] = set_summary([r for r, s in zip(rows, sel) if s], done.values[0, sel], sampled,
                                  {n: v[sel] for n, v in rec.items()}, options.resamples,
                                  by_kind=name == "student_error" and su.cut == "first_error")
    line, warn = verdict(sets, options.samples)
    sp = su.sampling
    settings = {"seed": su.seed, "student_greedy": options.student_greedy, "samples": options.samples,
                "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                "max_new_tokens": sp.max_new_tokens,
                "fractions": list(options.fractions) if su.cut == "fractions" else None,
                "resamples": options.resamples, "task": source.name}
    if run.cfg.teachers:  # named in the config: the report says which
        settings["teacher"] = run.step.routing.names[teacher]
    return ProbeReport(n_problems=len(problems), n_wrong=len(wrong) + len(restated), skipped=cuts.skipped,
                       kinds=cuts.kinds, samples=options.samples, cut=su.cut, sets=sets,
                       positions=sorted({p.position for p in prefixes}, key=position_key), verdict=line,
                       warning=warn, rows=rows, settings=settings)


def probe_pairs(run) -> list[tuple[str, int, TaskSource]]:
    """What a run's probe covers: (label, teacher, task) pairs. One teacher and one task: ("", 0, it). Several
    tasks or teachers: each teacher on each task it teaches (its `tasks`, else every task of the run), labelled
    "<teacher>/<task>" (a single teacher: "<task>")."""
    sources = task_sources(run.cfg.data)
    out = []
    for i, t in enumerate(run.cfg.teacher_sources()):
        for s in sources:
            if not t.tasks or s.name in t.tasks:  # the labels name a teacher the config names
                label = f"{t.name}/{s.name}" if run.cfg.teachers else "" if len(sources) == 1 else s.name
                out.append((label, i, s))
    return out


def training_probe(run) -> Callable[[Any], dict[str, float]]:
    """`train.probe_every`'s measurement, the probe hook of `jopd.run.loop.train`: student params -> the probe's
    `training_metrics`, on problems fixed for the run (the first `train.probe_problems` held-out ones of each
    task); with several teachers or tasks, each (`probe_pairs`) as `<teacher>/<task>/<metric>`."""
    tc = run.cfg.train
    options = ProbeOptions(samples=tc.probe_samples, resamples=200, progress=False)
    pairs = [(label, teacher, source, list(source.problems(run.cfg.data, "heldout"))[: tc.probe_problems])
             for label, teacher, source in probe_pairs(run)]

    def measure(params) -> dict[str, float]:
        out = {}
        for label, teacher, source, problems in pairs:
            m = training_metrics(probe(run, params, problems, options=options, teacher=teacher, source=source))
            out |= {f"{label}/{k}" if label else k: v for k, v in m.items()}
        return out

    return measure
