"""Run config: the components' own configs composed into one, loaded from YAML with `key=value` overrides.

Validation is strict (unknown key or wrong type -> one line naming it, e.g. `RunConfig.loss.top_k: Input
should be greater than or equal to 1`), and happens before any model is loaded or any compute starts: the
fields' own checks, then `opd.validate.check_run` (settings that do not go together).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Any, Literal

import pydantic
import yaml

from jopd import registry
from jopd.run.checkpoint import CheckpointConfig
from jopd.run.guards import GuardConfig
from jopd.config_dataclass import ConfigError, build, config_dataclass, read_yaml_mapping
from jopd.data.pipeline import DataConfig
from jopd.losses import LossConfig, RLConfig
from jopd.models.attention import check_attention_name
from jopd.models.families import FAMILIES, FamilyName
from jopd.parallel.mesh import MeshConfig
from jopd.opd.optim import OptimConfig
from jopd.opd.staleness import RolloutConfig
from jopd.opd.validate import check_run
from jopd.sampling.config import SamplingConfig
from jopd.sampling.precision import PrecisionConfig


EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")  # ArchConfig's MoE


@config_dataclass
class ArchConfig:
    """Architecture of a built-in testbed model (trained from scratch by SFT; the tokenizer sets the vocab)."""

    family: FamilyName = "llama"  # a registered model family (`jopd.models.families`, or a plugin's)
    hidden_size: int = pydantic.Field(64, ge=8)
    intermediate_size: int = pydantic.Field(192, ge=8)
    num_layers: int = pydantic.Field(2, ge=1)
    num_heads: int = pydantic.Field(2, ge=1)
    num_kv_heads: int = pydantic.Field(1, ge=1)
    head_dim: int = pydantic.Field(32, ge=2)
    tie_word_embeddings: bool = True
    max_position_embeddings: int = pydantic.Field(256, ge=8)
    # A mixture-of-experts testbed model (family qwen3_moe): every layer sparse, E experts of width
    # moe_intermediate_size, top-k routing. 0 experts: dense (the default; not part of the SFT cache key then).
    num_experts: int = pydantic.Field(0, ge=0)
    num_experts_per_tok: int = pydantic.Field(0, ge=0)
    moe_intermediate_size: int = pydantic.Field(0, ge=0)
    norm_topk_prob: bool = True

    def __post_init__(self):
        # one line naming the field (build() prefixes student.arch / teacher.arch)
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.moe_intermediate_size:
                raise ValueError("num_experts_per_tok / moe_intermediate_size: set num_experts > 0 for a MoE model")
            return
        if not FAMILIES[self.family].moe:
            raise ValueError(f"num_experts={self.num_experts}: family {self.family!r} has no experts (use qwen3_moe)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok}: must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size: must be >= 1 for a MoE model")

    def experts(self) -> dict:
        """The expert fields (`EXPERT_FIELDS`, as ModelConfig names them), none for a dense model: neither its
        ModelConfig nor its SFT cache key changes."""
        return {f: getattr(self, f) for f in EXPERT_FIELDS} if self.num_experts else {}


@config_dataclass
class WarmStartConfig:
    """SFT on the task's worked solutions (cached by content hash): makes a testbed model from scratch, or
    fine-tunes a checkpoint `path` (e.g. teach SmolLM2 the task before it teaches a student)."""

    # None: 300 for a testbed model, 0 for a checkpoint `path` (used as it is)
    steps: int | None = pydantic.Field(None, ge=0)
    batch_size: int = pydantic.Field(64, ge=1)
    learning_rate: float = pydantic.Field(3e-3, gt=0)
    warmup_steps: int = pydantic.Field(30, ge=0)
    seed: int = 0


@config_dataclass
class ModelSource:
    """Where a model comes from: a checkpoint path (HF dir or .gguf), or the built-in testbed recipe."""

    # HF dir / .gguf, or a built-in model name (`smollm2-135m-instruct`); None -> build `arch` by SFT
    # (`warm_start`) and cache it. A path with `warm_start.steps` > 0 is fine-tuned by that SFT (also cached).
    path: str | None = None
    # Keep only the first N decoder layers of `path` (a truncated copy of a larger model as the student)
    num_layers: int | None = pydantic.Field(None, ge=1)
    arch: ArchConfig = ArchConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    dtype: Literal["fp32", "bf16"] = "fp32"  # params and compute dtype of this model in the trainer
    # Its attention implementation (`jopd.models.attention`): "auto" picks by platform and length (xla at the
    # testbed's lengths on CPU, chunked from 1k tokens, splash on a TPU), or a registered name (xla, chunked,
    # splash, or a plugin's).
    attention: Annotated[str, pydantic.AfterValidator(check_attention_name)] = "auto"
    # The model's tokenizer when it is not the checkpoint's own (an HF directory or .gguf); None: the
    # checkpoint's, or the toy tokenizer for a testbed model. A teacher's may differ from the student's with
    # a cross-tokenizer loss.kind (each of several teachers its own: one sharing the student's is scored directly).
    tokenizer: str | None = None

    def resolved_warm_start(self) -> WarmStartConfig:
        """`warm_start` with its `steps` default filled in for this kind of source."""
        steps = self.warm_start.steps
        return dataclasses.replace(self.warm_start, steps=(300 if self.path is None else 0) if steps is None else steps)


@config_dataclass
class TeacherSource(ModelSource):
    """One of several teachers (`RunConfig.teachers`): a model source with a name, the tasks it teaches and its
    weight in a mixture."""

    name: str = ""  # required: how `routing`, the logs and the evals name it
    # The `data.mix` tasks it owns: under routing=task it scores their rows; the held-out eval measures their rows'
    # teacher divergence against it; a testbed recipe or fine-tune (`warm_start`) trains on them alone. Empty: the
    # run's whole stream.
    tasks: tuple[str, ...] = ()
    weight: float = pydantic.Field(1.0, gt=0)  # its weight under routing=mixture
    # How its parameters sit on the mesh: `fsdp`, split like the student's (FSDP x tensor: the least memory per
    # chip, its forward all-gathers each layer's weights); `replicated`, held whole on every device (no
    # all-gather, its full size on every chip: for a small teacher; its forward then runs on each device's rows
    # with the whole weights, so a tensor axis computes it redundantly).
    placement: Literal["fsdp", "replicated"] = "fsdp"


@config_dataclass
class TrainConfig:
    steps: int = pydantic.Field(100, ge=0)  # OPD updates
    seed: int = 0
    out_dir: str = "runs/testbed"  # metrics.jsonl, TensorBoard, checkpoints, eval JSON/CSV and PNGs
    log_every: int = pydantic.Field(1, ge=1)
    eval_every: int = pydantic.Field(0, ge=0)  # held-out eval every N steps (0: before and after only)
    eval_problems: int = pydantic.Field(530, ge=1)  # held-out problems per eval (<= the held-out split)
    eval_max_new_tokens: int = pydantic.Field(48, ge=1)
    # Sampling seed of the held-out eval, independent of `seed`: every run of a study (all setups, all training
    # seeds) answers each problem with the same random draws, so per-problem comparisons pair like with like.
    eval_seed: int = 99991
    # Teacher-reliability probe during training (`jopd probe`'s measurement, greedy teacher by default): before
    # the first step and every N steps, on the first `probe_problems` held-out problems; logged as probe/* metrics
    # (recovery, agreement, follows_error from the student's current erroneous prefixes). 0: off.
    probe_every: int = pydantic.Field(0, ge=0)
    probe_problems: int = pydantic.Field(64, ge=1)
    probe_samples: int = pydantic.Field(0, ge=0)  # seeded teacher continuations per prefix beside the greedy one
    # The matmul dtype of the student's update and of the teachers' scoring (mixed precision: the master weights
    # and optimizer state keep the models' `dtype`; bf16 matmuls accumulate in fp32, activations are bf16, the
    # logits, log-softmax and loss fp32; `opd.resolve.compute_dtypes`). A bf16 student (`student.dtype`) computes
    # in bf16 either way.
    compute_dtype: Literal["fp32", "bf16"] = "fp32"
    mismatch: Literal["exact", "estimators"] = "exact"  # exact full-vocab KL needs [B,N,V] sampler logprobs
    is_logprobs: Literal["unprocessed", "processed"] = "unprocessed"  # sampler logprobs used for IS weights
    # A mixture-of-experts student: the update's forward runs the experts the sampler chose for each token (every
    # sparse layer), weighted by the trainer's own router probabilities at them (R3, routing replay); the router
    # still gets its gradient. The exact mismatch is then measured against this replayed forward.
    routing_replay: bool = False
    # Which response targets the loss masks. template_first: the tokens named in `template_tokens`, at their first
    # occurrence in a response (where a chat template legitimately writes them); every other special token the
    # student emits (pad, bos, unk, role markers) is trained against, so emitting them is never free.
    # all_special: every special token of the tokenizer but EOS, wherever it occurs (the earlier default).
    # An explicit loss.special_token_ids / loss.template_token_ids list takes precedence.
    mask: Literal["template_first", "all_special", "none"] = "template_first"
    template_tokens: tuple[str, ...] = ()  # token strings, e.g. ["<|im_start|>"]; unknown ones are an error
    log_rollouts: int = pydantic.Field(2, ge=0)  # responses decoded into rollouts.jsonl per step (ids always)
    cache_dir: str | None = None  # testbed model cache; None -> $JOPD_CACHE or ~/.cache/jopd
    # Recompute each layer's activations in the backward pass (jax.checkpoint per scanned layer): ~1/3 more
    # train-step compute for a fraction of the activation memory; needed at real scale (see `jopd aot`).
    remat: bool = False
    # Pack the rollouts for the teacher scoring and the update (`opd.packing`): several sequences per row, each
    # attending to itself, and the LM head and the loss on real response tokens only; the loss and its gradient
    # equal the padded computation's (tested). Not with optim.grad_accum_steps > 1.
    pack: bool = False
    # Columns of a packed row (None: max_prompt_len + max_new_tokens, the padded row; wider rows pack more short
    # sequences each, at a quadratic attention cost per row)
    pack_width: int | None = pydantic.Field(None, ge=1)
    # Packed rows per batch shard are rounded up to a multiple of this, and the compact response rows likewise, so
    # that few shapes compile (None: an eighth of the shard's rows, a sixteenth of its compact rows); 1: no
    # rounding, the fewest columns, a compile for every new row count
    pack_granularity: int | None = pydantic.Field(None, ge=1)
    guard: GuardConfig = GuardConfig()  # what stops a run that goes non-finite or degenerates (`opd.guards`)
    # How long the loop waits for a step's rollout and update before it stops with an error naming the side that
    # has not finished (`run.stall`); None: as long as it takes
    stall_timeout_s: float | None = pydantic.Field(None, gt=0)


@config_dataclass
class RunConfig:
    # Modules (`my_pkg.my_loss`) or .py files (a relative path: in the config's folder, else the working
    # directory) imported before the config is validated: what registers a user's own loss kinds, tasks and
    # model families (`jopd.registry`, docs/extending.md).
    plugins: tuple[str, ...] = ()
    student: ModelSource = ModelSource()
    teacher: ModelSource = ModelSource()
    # Several teachers (`jopd.opd.routing`), instead of `teacher`; each is loaded, sharded and held like it.
    teachers: tuple[TeacherSource, ...] = ()
    # Which teacher scores a row (with `teachers`): `task`, the teacher that lists the row's task (each teacher runs
    # on its own rows only); `mixture`, every teacher on every row, the loss against their mixture
    # p(v) = sum_i w_i p_i(v) / sum_i w_i; or a teacher's name, that teacher on every row (the others are the
    # held-out eval's references for their tasks: a single-teacher baseline on the same footing).
    routing: str = "task"
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout_precision: PrecisionConfig = PrecisionConfig()
    rollout: RolloutConfig = RolloutConfig()  # how stale the rollouts may be (`opd.staleness`)
    loss: LossConfig = LossConfig()
    rl: RLConfig = RLConfig()  # the RL kinds' advantages and rollout reuse (their per-token settings: loss.*)
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        check_run(self)  # every check the config alone decides (`opd.validate`), whenever a config is built

    def teacher_sources(self) -> tuple[TeacherSource, ...]:
        """The run's teachers: `teachers`, or `teacher` alone (named "teacher")."""
        if self.teachers:
            return self.teachers
        return (TeacherSource(**{f.name: getattr(self.teacher, f.name) for f in dataclasses.fields(ModelSource)},
                              name="teacher"),)

    def teacher_roles(self) -> tuple[str, ...]:
        """Each teacher's config field, as errors name it: `teacher`, or `teachers[i]`."""
        return tuple(f"teachers[{i}]" for i in range(len(self.teachers))) or ("teacher",)

    @property
    def scoring_routing(self) -> str:
        """`routing` as the step resolves it (`opd.routing`): the one `teacher` is a routing of one, to it."""
        return self.routing if self.teachers else self.teacher_sources()[0].name


def _parse_value(text: str) -> Any:
    """`key=value` values are YAML scalars/lists (`1e-3`, `true`, `[1, 2]`, `null`)."""
    return yaml.safe_load(text)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. loss.top_k=16)")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key}: {p!r} is not a section")
            node[p] = child = dict(child)
            node = child
        node[parts[-1]] = _parse_value(value)
    return data


# The RL kinds' per-token settings, once `rl.*` (and copied into `loss.*` by the step), then `loss.*` (their
# defaults then): clip_eps / clip_eps_high have since moved on to grpo's options (`_MOVED_TO_OPTIONS`).
_MOVED_TO_LOSS = {"clip_eps": 0.2, "clip_eps_high": None, "kl_coef": LossConfig().kl_coef,
                  "token_sum_norm": LossConfig().token_sum_norm}
# Kind-specific settings, once fields of `loss` (the union of every built-in kind's), now the kind's `loss.options`:
# old key -> (the kind that read it, its option, the old default)
_MOVED_TO_OPTIONS = {"jsd_beta": ("jsd", "beta", 0.5), "gamma": ("sampled_opd", "gamma", 0.0),
                     "clip_eps": ("grpo", "clip_eps", 0.2), "clip_eps_high": ("grpo", "clip_eps_high", None)}
# `loss.cross_tokenizer: sampled | dense` selected the cross-tokenizer kinds beside `loss.kind`; they are kinds now:
# the old value -> (the kind, the kinds `loss.kind` could name beside it: its same-tokenizer form, the default)
_CROSS_KINDS = {"sampled": ("xtok_sampled", ("sampled_opd", "xtok_sampled", "topk_rkl_tail")),
                "dense": ("xtok_dense", ("topk_rkl_tail", "xtok_dense"))}


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Configs saved by earlier versions (a run's config.yaml) still load: `train.mask_special_tokens: true` was
    what `train.mask: all_special` is now; `rl.clip_eps` / `clip_eps_high` / `kl_coef` / `token_sum_norm` are
    `loss.*` now (a saved config holds both copies, the `loss.*` one at its default: the `rl.*` one counts);
    the kind-specific `loss.*` settings are the kind's `loss.options` and `loss.cross_tokenizer` is `loss.kind`
    (`_upgrade_loss`)."""
    train = data.get("train")
    if isinstance(train, dict) and "mask_special_tokens" in train and "mask" not in train:
        train = dict(train)
        train["mask"] = "all_special" if train.pop("mask_special_tokens") else "none"
        data = dict(data, train=train)
    rl = data.get("rl")
    if isinstance(rl, dict) and any(k in rl for k in _MOVED_TO_LOSS):
        rl, loss = dict(rl), dict(data.get("loss") or {})
        for k, default in _MOVED_TO_LOSS.items():
            if k not in rl:
                continue
            value, mine = rl.pop(k), loss.get(k, default)
            if value != default:
                if mine != default and mine != value:
                    raise ConfigError(f"RunConfig.rl.{k}={value} and loss.{k}={mine}: set loss.{k} only")
                loss[k] = value
        data = dict(data, rl=rl, loss=loss)
    loss = data.get("loss")
    if isinstance(loss, dict) and ("cross_tokenizer" in loss or any(k in loss for k in _MOVED_TO_OPTIONS)):
        data = dict(data, loss=_upgrade_loss(dict(loss)))
    return data


def _upgrade_loss(loss: dict[str, Any]) -> dict[str, Any]:
    """`loss.cross_tokenizer` and the kind-specific `loss.*` settings, as an earlier version wrote them, in their
    new places. A saved config holds every field: one at its old default says nothing and is dropped; another
    value moves where it belongs when the run's kind is the one that read it, else it is one line naming its new
    place."""
    kind = loss.get("kind", LossConfig().kind)
    cross = loss.pop("cross_tokenizer", None)
    if cross not in (None, False, "off"):
        if cross not in _CROSS_KINDS:
            raise ConfigError(f"RunConfig.loss.cross_tokenizer: {cross!r}: a teacher with another tokenizer is a loss "
                              f"kind now: loss.kind=xtok_dense or xtok_sampled")
        new, allowed = _CROSS_KINDS[cross]
        if kind not in allowed:
            raise ConfigError(f"RunConfig.loss.cross_tokenizer={cross}: runs {new} (the cross-tokenizer form of "
                              f"{allowed[0]}), now loss.kind={new}; got loss.kind={kind}")
        loss["kind"] = kind = new
    for key in [k for k in _MOVED_TO_OPTIONS if k in loss]:
        owner, option, default = _MOVED_TO_OPTIONS[key]
        value = loss.pop(key)
        if value == default:
            continue
        options = loss.get("options")
        if kind != owner or not isinstance(options or {}, dict):
            raise ConfigError(f"RunConfig.loss.{key}: now loss.options.{option} of loss.kind={owner} (loss.kind="
                              f"{kind} does not read it)")
        options = dict(options or {})
        if options.get(option, value) != value:
            raise ConfigError(f"RunConfig.loss.{key}={value} and loss.options.{option}={options[option]}: set "
                              f"loss.options.{option} only")
        loss["options"] = dict(options, **{option: value})
    return loss


def load_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    data = read_yaml_mapping(path) if path is not None else {}
    try:  # a relative plugin file: in the config's folder if it is there, else in the working directory
        if "plugins" in data:
            data["plugins"] = registry.resolve_plugins(data["plugins"] or (), os.path.dirname(os.path.abspath(path)),
                                                       only_existing=True)
        data = _upgrade(apply_overrides(data, list(overrides)))
        if "plugins" in data:  # the user's registry entries (loss kinds, tasks, families) exist before validation
            data["plugins"] = registry.resolve_plugins(data["plugins"] or (), os.getcwd())
            registry.load_plugins(data["plugins"])
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, ConfigError) or not str(e).startswith("plugins: "):
            raise
        raise ConfigError(f"RunConfig.{e}") from None
    return build(RunConfig, data, where="RunConfig")


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
