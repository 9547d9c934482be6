"""A run's checks, in one place: each failure is one line naming the field to change, raised before any compute.

- `check_run(cfg)`: what the config alone decides (settings that do not go together, a kind's needs).
  `RunConfig` runs it when it is built, so every loaded, overridden or replaced config has passed it.
- `check_tokenizer(cfg, tokenizer)`: what needs the student's tokenizer (`loss.top_k`, `train.template_tokens`);
  the loop runs it where the tokenizer is first read, `resolve_loss_config` for every other caller of the step.
- `check_models(cfg, student, teachers, own_tokenizer)`: what needs the models' configs (each same-vocabulary
  teacher against the student, every model's context); `model_sources.precheck_sources` runs it on the
  checkpoints' metadata before any weight is read or any model is trained, `jopd aot` on the architectures it
  sizes. `check_compatible` is one teacher against the student (and their tokenizers when given).
- `check_cross(cfg, cross)`: `build_step`'s `cross` against the kind; `check_routing_replay` the student against
  `train.routing_replay`, `check_experts` the models against `mesh.expert` and `loss.router_aux_coef` (both from
  `check_models` and `build_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jopd.config_dataclass import ConfigError
from jopd.data.mixture import task_sources
from jopd.losses.config import RLConfig
from jopd.losses.kinds import OBJECTIVES, Objective
from jopd.opd.cross_teacher import TEACHER_SLACK

if TYPE_CHECKING:
    from jopd.models.config import ModelConfig
    from jopd.run.config import RunConfig


# -- the config alone -----------------------------------------------------------------------------------------

def check_run(cfg: "RunConfig") -> None:
    """Every check the config alone decides: one `ConfigError` (field relative to `RunConfig`) at the first."""
    objective = OBJECTIVES[cfg.loss.kind]
    if cfg.teachers:
        _check_teachers(cfg)
    check_rl(cfg.loss.kind, objective, cfg.rl)
    if objective.grouped and cfg.sampling.samples_per_prompt not in (1, cfg.rl.group_size):
        raise ConfigError(f"sampling.samples_per_prompt={cfg.sampling.samples_per_prompt}: loss.kind={cfg.loss.kind} "
                          f"samples rl.group_size={cfg.rl.group_size} rollouts per prompt")
    several = cfg.teachers and cfg.routing in ("task", "mixture") and len(cfg.teachers) > 1
    if several and (objective.needs_teacher_hidden or objective.reads_teacher_head):
        raise ConfigError(f"routing={cfg.routing}: loss.kind={cfg.loss.kind} projects one teacher's hidden states "
                          f"with its head; with several teachers use a support kind (topk_rkl_tail, topk_rkl, "
                          f"sampled_opd) or route to one teacher")
    if several and cfg.train.pack:
        raise ConfigError(f"train.pack: not with routing={cfg.routing} over several teachers (a packed row mixes rows "
                          f"of different teachers)")
    if objective.cross_tokenizer is not None and cfg.train.pack:
        raise ConfigError(f"train.pack: not with loss.kind={cfg.loss.kind} (a teacher with another tokenizer scores "
                          f"its own sequences)")
    if cfg.train.pack and cfg.loss.router_aux_coef:
        raise ConfigError(f"loss.router_aux_coef={cfg.loss.router_aux_coef}: not with train.pack (the router's loss "
                          f"is counted over the padded rows' response positions)")
    if cfg.train.pack and cfg.optim.grad_accum_steps > 1:
        raise ConfigError(f"train.pack: not with optim.grad_accum_steps={cfg.optim.grad_accum_steps} (a packed row "
                          f"holds several rollouts; micro-batches would split its packing)")
    lag = cfg.rollout.staleness
    if lag and lag >= cfg.train.steps:
        raise ConfigError(f"rollout.staleness={lag}: must be below train.steps={cfg.train.steps} (every step would "
                          f"sample with the initial parameters)")
    if cfg.rollout.placement == "disaggregated" and not cfg.rollout.sampler_devices:
        raise ConfigError("rollout.sampler_devices: rollout.placement=disaggregated needs the sampler's device count")
    if cfg.rollout.sampler_devices and cfg.rollout.placement == "colocated":
        raise ConfigError(f"rollout.sampler_devices={cfg.rollout.sampler_devices}: only with "
                          f"rollout.placement=disaggregated or process")
    if cfg.rollout.exchange_dir is not None and cfg.rollout.placement != "process":
        raise ConfigError(f"rollout.exchange_dir={cfg.rollout.exchange_dir}: only with rollout.placement=process")
    where = cfg.rollout.exchange_dir
    if where is not None and "://" in where and not (where.startswith("gs://") and where[5:].strip("/")):
        raise ConfigError(f"rollout.exchange_dir={where}: a local directory or gs://bucket/path (a TensorStore "
                          f"kvstore both processes open: `run.exchange`)")
    if cfg.rollout.queue > 1 and cfg.rollout.placement != "process":
        raise ConfigError(f"rollout.queue={cfg.rollout.queue}: only with rollout.placement=process")
    if cfg.rollout.queue > max(lag, 1):
        raise ConfigError(f"rollout.queue={cfg.rollout.queue}: at most rollout.staleness={lag} (step n+j's request "
                          f"samples with step n+j-k's params, known at step n only for j < k)")
    if cfg.rollout.placement == "process" and cfg.loss.cross_tokenizer != "off":
        raise ConfigError(f"rollout.placement=process: not with loss.kind={cfg.loss.kind} (a teacher with another "
                          f"tokenizer: its alignment objects are not sent to the sampler process)")
    if cfg.rollout.partial:
        _check_partial(cfg, objective)
    if cfg.train.probe_every and objective.cross_tokenizer is not None:
        raise ConfigError(f"train.probe_every: the probe feeds the teacher the student's token ids; not with "
                          f"loss.kind={cfg.loss.kind} (a teacher with another tokenizer)")


def _partial_conflict(cfg: "RunConfig", objective: Objective) -> str | None:
    """What `rollout.partial` cannot go with in `cfg` (None: nothing)."""
    rollout = cfg.rollout
    if not rollout.staleness:
        return "rollout.staleness=0 (a carried row's tokens are an older version's: k >= 1)"
    if not cfg.sampling.slots:
        return "sampling.slots=0 (the slot engine's rows are what carries)"
    if rollout.placement != "colocated":
        return f"rollout.placement={rollout.placement} (the carry is the colocated sampler's)"
    if objective.uses_rewards:
        return f"loss.kind={cfg.loss.kind} (rewards and advantages of rows of several steps)"
    if objective.cross_tokenizer is not None:
        return f"loss.kind={cfg.loss.kind} (a teacher with another tokenizer aligns the host rows)"
    if cfg.teachers and len(cfg.teachers) > 1 and cfg.routing in ("task", "mixture"):
        return f"routing={cfg.routing} (rows routed to teachers by their host rows)"
    if len(task_sources(cfg.data)) > 1:
        return "data.mix (per-task rows and metrics)"
    if cfg.sampling.samples_per_prompt > 1:
        return f"sampling.samples_per_prompt={cfg.sampling.samples_per_prompt} (one row per prompt)"
    return None


def _check_partial(cfg: "RunConfig", objective: Objective) -> None:
    conflict = _partial_conflict(cfg, objective)
    if conflict:
        raise ConfigError(f"rollout.partial: not with {conflict}")


def check_rl(kind: str, objective: Objective, rl: RLConfig) -> None:
    """`rl` settings that only some kinds honour (their entries say which): one-line errors, not ignored knobs."""
    if rl.inner_updates > 1 and not objective.reuses_rollouts:
        raise ConfigError(f"rl.inner_updates={rl.inner_updates}: loss.kind={kind} does not reuse a rollout batch "
                          f"(grpo does: its clipped ratio accounts for the policy's change)")
    if rl.baseline != "batch_mean" and rl.baseline not in objective.baselines:
        raise ConfigError(f"rl.baseline={rl.baseline}: loss.kind={kind} does not use it (reinforce does; grpo's "
                          f"baseline is its group mean)")


def _check_teachers(cfg: "RunConfig") -> None:
    """`teachers` against the rest of the config: names, routing, and (routing=task) one teacher per task."""
    if cfg.teacher != type(cfg.teacher)():
        raise ConfigError("teacher: set `teacher` or `teachers`, not both")
    names = [t.name for t in cfg.teachers]
    for i, name in enumerate(names):
        if not name:
            raise ConfigError(f"teachers[{i}].name: every teacher needs a name")
        if name in names[:i] or name in ("task", "mixture"):
            raise ConfigError(f"teachers[{i}].name: {name!r} is taken (names are unique, and not task / mixture)")
    if cfg.routing not in ("task", "mixture", *names):
        raise ConfigError(f"routing: {cfg.routing!r} is not task, mixture or a teacher's name ({', '.join(names)})")
    if cfg.loss.cross_tokenizer != "off" and cfg.routing == "mixture" and len(cfg.teachers) > 1:
        raise ConfigError(f"routing: mixture is not available with loss.kind={cfg.loss.kind} (a mixture adds the "
                          f"teachers' probabilities of one next token; route by task or to one teacher)")
    tasks = [s.name for s in task_sources(cfg.data)]
    owner: dict[str, str] = {}
    for i, t in enumerate(cfg.teachers):
        for task in t.tasks:
            if task not in tasks:
                raise ConfigError(f"teachers[{i}].tasks: {task!r} is not one of the run's tasks ({', '.join(tasks)}; "
                                  f"data.mix or data.task)")
            if task in owner:
                raise ConfigError(f"teachers[{i}].tasks: {task!r} already belongs to teacher {owner[task]!r}")
            owner[task] = t.name
    if cfg.routing == "task":
        missing = [task for task in tasks if task not in owner]
        if missing:
            raise ConfigError(f"routing: task needs a teacher for every task; {', '.join(map(repr, missing))} has "
                              f"none (list it in one teacher's `tasks`)")


# -- the tokenizer --------------------------------------------------------------------------------------------

def check_tokenizer(cfg: "RunConfig", tokenizer) -> None:
    """The settings that name tokens against the student's tokenizer (None: nothing to check)."""
    if tokenizer is None:
        return
    if OBJECTIVES[cfg.loss.kind].needs_teacher_topk and cfg.loss.top_k > len(tokenizer):
        raise ValueError(f"RunConfig.loss.top_k={cfg.loss.top_k}: larger than the vocabulary ({len(tokenizer)} "
                         f"tokens)")
    if cfg.train.mask == "template_first" and cfg.train.template_tokens and not cfg.loss.template_token_ids:
        vocab = tokenizer.get_vocab()
        unknown = [t for t in cfg.train.template_tokens if t not in vocab]
        if unknown:
            raise ValueError(f"RunConfig.train.template_tokens: {unknown} not in the tokenizer's vocabulary")


# -- the models' configs --------------------------------------------------------------------------------------

def check_compatible(student_cfg: "ModelConfig", teacher_cfg: "ModelConfig", student_tok, teacher_tok,
                     role: str = "teacher", own_tokenizer_run: bool = False) -> None:
    """Distillation compares distributions token by token: the two models must share the vocabulary. `role`
    names the teacher in the error (`teachers[1]` of several); `own_tokenizer_run`: the run's kind is a
    cross-tokenizer one, and this teacher was taken to share the student's tokenizer (the hint says so)."""
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        hint = (f"its tokenizer is the student's: give it its own, {role}.tokenizer" if own_tokenizer_run else
                "a teacher with another tokenizer: set loss.kind=xtok_dense or xtok_sampled")
        raise ValueError(f"{role}/student vocab mismatch: {role} vocab_size={teacher_cfg.vocab_size}, "
                         f"student vocab_size={student_cfg.vocab_size} ({hint})")
    if student_tok is not None and teacher_tok is not None:
        if student_tok.get_vocab() != teacher_tok.get_vocab():
            raise ValueError(f"{role}/student tokenizer mismatch: same size but different token ids")
        if (student_tok.chat_template or "") != (teacher_tok.chat_template or ""):
            raise ValueError(f"{role}/student chat_template mismatch: prompts would be formatted differently")


def check_models(cfg: "RunConfig", student: "ModelConfig | None", teachers: Sequence["ModelConfig | None"],
                 own_tokenizer: Sequence[bool]) -> None:
    """The models against each other and the run's lengths, from their configs (None: not known yet, e.g. a
    testbed model whose vocabulary the tokenizer sets; its `arch` still gives its context). `own_tokenizer[i]`:
    teacher i scores its own tokenization (a cross-tokenizer kind), else the student's tokens."""
    roles = list(zip(cfg.teacher_roles(), cfg.teacher_sources()))  # (how errors name each, its source)
    crossed = cfg.loss.cross_tokenizer != "off"
    if student is not None:
        check_routing_replay(cfg, student)
        check_experts(cfg, student, teachers)
        for (role, _), t_cfg, own in zip(roles, teachers, own_tokenizer):
            if t_cfg is not None and not own:
                check_compatible(student, t_cfg, None, None, role, own_tokenizer_run=crossed)
    answer = max(cfg.sampling.max_new_tokens, cfg.train.eval_max_new_tokens)
    need = cfg.data.max_prompt_len + answer
    models = [("student", cfg.student, student, False)] + [
        (role, src, t_cfg, own) for (role, src), t_cfg, own in zip(roles, teachers, own_tokenizer)]
    for role, src, model, own in models:
        context = model.max_position_embeddings if model is not None else (
            None if src.path is not None else src.arch.max_position_embeddings)
        where = f"{role}.path" if src.path is not None else f"{role}.arch.max_position_embeddings"
        if context is None:
            continue
        if not own and need > context:
            raise ValueError(f"RunConfig.{where}: a context of {context} tokens cannot hold data.max_prompt_len "
                             f"{cfg.data.max_prompt_len} + the longest answer {answer} (sampling.max_new_tokens, "
                             f"train.eval_max_new_tokens) = {need}")
        # a teacher with another tokenizer scores rows of its own tokens: the prompt + response + TEACHER_SLACK
        rows = cfg.data.max_prompt_len + cfg.sampling.max_new_tokens + TEACHER_SLACK
        if own and rows > context:
            raise ValueError(f"RunConfig.{where}: a context of {context} tokens cannot hold its scoring rows of "
                             f"data.max_prompt_len {cfg.data.max_prompt_len} + sampling.max_new_tokens "
                             f"{cfg.sampling.max_new_tokens} + {TEACHER_SLACK} = {rows}")


def check_routing_replay(cfg: "RunConfig", student: "ModelConfig") -> None:
    """`train.routing_replay` replays the student's router choices: it needs a student with sparse layers."""
    if cfg.train.routing_replay and not student.sparse_layers:
        raise ValueError(f"RunConfig.train.routing_replay: the student ({student.family}) has no mixture-of-experts "
                         f"layer whose routing to replay; set it false")


def check_experts(cfg: "RunConfig", student: "ModelConfig", teachers: Sequence["ModelConfig | None"] = ()) -> None:
    """`mesh.expert` (expert parallelism) and `loss.router_aux_coef` against the models: a split needs a model
    with experts (a dense student beside a MoE teacher is fine: its weights split over fsdp x expert), and the expert count of every mixture-of-experts model (its layers sit on the same mesh) divisible
    by it; the router's loss needs a router."""
    ep = cfg.mesh.expert
    if ep > 1 and not student.sparse_layers and not any(t is not None and t.sparse_layers for t in teachers):
        raise ValueError(f"RunConfig.mesh.expert={ep}: no model (student {student.family}, or a teacher) has a "
                         f"mixture-of-experts layer whose experts to split; set it 1")
    for name, model in [("student", student)] + [(f"teacher {i}", t) for i, t in enumerate(teachers)]:
        if ep > 1 and model is not None and model.sparse_layers and model.num_experts % ep:
            raise ValueError(f"RunConfig.mesh.expert={ep}: does not divide the {name}'s num_experts="
                             f"{model.num_experts}")
    if cfg.loss.router_aux_coef and not student.sparse_layers:
        raise ValueError(f"RunConfig.loss.router_aux_coef={cfg.loss.router_aux_coef}: the student ({student.family}) "
                         f"has no router to balance; set it 0")


def own_tokenizers(cross, teachers: int) -> tuple[bool, ...]:
    """Whether each teacher scores its own tokenization, from `cross_teachers`' answer (one entry per teacher, None
    for a teacher that scores the student's tokens)."""
    return (False,) * teachers if cross is None else tuple(c is not None for c in cross)


# -- the step's arguments -------------------------------------------------------------------------------------

def check_cross(cfg: "RunConfig", cross) -> None:
    """`build_step`'s `cross` (per teacher, its `CrossTeacher` or None; None: no teacher has another tokenizer)
    against the run's kind."""
    kind, crossed = cfg.loss.kind, cfg.loss.cross_tokenizer != "off"
    if cross is None and crossed:
        raise ValueError(f"RunConfig.loss.kind={kind}: scores a teacher with another tokenizer and needs its "
                         f"tokenizer (build_step's `cross`)")
    if not crossed and any(c is not None for c in cross or ()):
        raise ValueError(f"RunConfig.loss.kind={kind}: needs a teacher of the student's vocabulary, but the step was "
                         f"given a cross-tokenizer teacher")


def check_teacher_tuples(cfg: RunConfig, s_cfg: ModelConfig, t_cfgs, cross) -> None:
    """`t_cfgs` and `cross` against the run's teachers: one entry each per teacher (`teacher_sources`); with a
    cross-tokenizer `loss.kind`, a `CrossTeacher` for a teacher with another tokenizer, None for one of the
    student's vocabulary (scored directly: same `vocab_size`); without it, None for all."""
    n = len(cfg.teacher_sources())
    if not isinstance(t_cfgs, tuple) or len(t_cfgs) != n:
        where = f"{n} teachers in RunConfig.teachers" if cfg.teachers else "one RunConfig.teacher"
        raise ValueError(f"build_step: {where}, but t_cfg is "
                         f"{'a tuple of ' + str(len(t_cfgs)) if isinstance(t_cfgs, tuple) else 'one ModelConfig'} "
                         f"(a tuple of one ModelConfig per teacher)")
    if not isinstance(cross, tuple) or len(cross) != n:
        raise ValueError(f"build_step: {n} teachers with loss.kind={cfg.loss.kind} need `cross` as a tuple "
                         f"of as many (None: a teacher of the student's vocabulary)")
    for i, (c, m) in enumerate(zip(cross, t_cfgs)):
        if c is None and m.vocab_size != s_cfg.vocab_size and cfg.loss.cross_tokenizer != "off":
            raise ValueError(f"RunConfig.teachers[{i}]: vocab_size={m.vocab_size} is not the student's "
                             f"({s_cfg.vocab_size}), so it needs its own tokenizer (`teachers[{i}].tokenizer`)")
