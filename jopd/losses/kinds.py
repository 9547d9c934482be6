"""The registry of loss kinds: one `Objective` entry per kind says everything the trainer and the OPD step need
to know about it — its per-position terms, its reduction, its advantages (RL kinds), and what it reads from the
batch. `LossConfig.kind` validates against this registry, so a kind registered from a user's module (see
docs/extending.md) is configured, scored and trained exactly like a built-in one.

    OBJECTIVES.add("my_kind", Objective(chunk_fields=(...), after_fields=(), per_position=fn, reduce=...,
                                        options=MyOptions))

A kind's own settings are its `options`, a config dataclass that validates `loss.options` when the config is
loaded (`cfg.options` is then that dataclass); `LossConfig` keeps what the shared machinery reads for every kind.
Built-in kinds: `jopd.losses.builtin`, `jopd.losses.cross_kinds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import jax

from jopd.registry import Registry

if TYPE_CHECKING:
    from jopd.losses.batch import LossBatch
    from jopd.losses.config import LossConfig, RLConfig

Metrics = dict[str, jax.Array]
# (cfg, student logits of one chunk [B, C, V] at the loss temperature, the chunk's inputs) -> {name: [B, C, ...]}
PerPosition = Callable[["LossConfig", jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]
# (cfg, log pi_s(target) [B, T] (differentiable), the chunked terms, the batch, the loss mask [B, T], the IS
# weights [B, T]) -> (per-position loss [B, T], the weights to apply, metrics)
Reduce = Callable[["LossConfig", jax.Array, Mapping[str, jax.Array], "LossBatch", jax.Array, jax.Array],
                  tuple[jax.Array, jax.Array, Metrics]]
# (rewards [B] of this process's rollouts, the run's rl settings, the running baseline or None) -> advantages [B]
Advantages = Callable[[Any, "RLConfig", "float | None"], Any]
# (the batch, the loss mask [B, T]) -> the positions with the kind's signal (a subset of the mask)
SignalMask = Callable[["LossBatch", jax.Array], jax.Array]


def divergence_reduce(cfg, logp, terms, batch, mask, weights):
    """The default reduction: minimize the chunk terms' `divergence` per position."""
    from jopd.losses.masks import masked_mean

    per_position = terms["divergence"]
    return per_position, weights, {"divergence": masked_mean(jax.lax.stop_gradient(per_position), mask)}


@dataclasses.dataclass(frozen=True)
class Objective:
    """One loss kind.

    `chunk_fields`: `LossBatch` fields read per logits chunk (sliced with the hidden states); `after_fields`:
    fields read by `reduce`. `per_position`: the kind's terms from one chunk of student logits. `reduce`: the
    per-position loss, the weights and the kind's metrics from those terms (default: the `divergence` term).
    `support_ids` names a [B, T, K] ids field when the gradient needs the student logits at those ids only: the
    full logits are then stop-gradient and `inputs["support_logits"]` carries the differentiable ones.
    RL kinds: `advantages` computes per-sequence advantages from correctness rewards on the host (the step then
    hands them in `advantages_BxT`); `grouped`: rollouts come in groups of `rl.group_size` per prompt;
    `reuses_rollouts`: it may take `rl.inner_updates > 1` updates per rollout batch; `baselines`: the
    `rl.baseline` values it honours; `reads_reference`: with `loss.kl_coef > 0` it reads the frozen starting
    student's log-probs (`reference_logprobs_BxT`). `reads_teacher_head`: the step hands the teacher's LM head
    to the loss (`inputs["teacher_head"]` in every chunk), e.g. to project `teacher_hidden_BxTxD` to the
    teacher's logits one chunk at a time (the full-vocabulary kinds: no [B, N, V] teacher tensor exists).
    `signal_mask`: the positions that carry the kind's signal, when fewer than the loss mask's (the
    cross-tokenizer kinds: aligned ones); the loss, its normalization and every metric then count only them, so
    rows without a signal neither add to nor dilute the step.
    `options`: a config dataclass of the kind's own settings (validates `loss.options`; None: the kind takes
    none). `cross_tokenizer`: a kind for a teacher with another tokenizer, and what that teacher writes for it
    (`sampled`: per-span log-probs; `dense`: the projected support; `opd.cross_teacher`)."""

    chunk_fields: tuple[str, ...]
    after_fields: tuple[str, ...]
    per_position: PerPosition
    reduce: Reduce = divergence_reduce
    support_ids: str | None = None
    advantages: Advantages | None = None
    grouped: bool = False
    reuses_rollouts: bool = False
    baselines: tuple[str, ...] = ("batch_mean",)
    reads_reference: bool = False
    reads_teacher_head: bool = False  # per chunk, `inputs["teacher_head"]`: the teacher's LM head (no gradient)
    student_support: bool = False  # the sampler hands over the student's top-K ids per step (its support)
    signal_mask: SignalMask | None = None
    options: type | None = None
    cross_tokenizer: Literal["sampled", "dense"] | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        return ("targets_BxT", "response_mask_BxT") + self.chunk_fields + self.after_fields

    @property
    def uses_rewards(self) -> bool:
        return self.advantages is not None

    @property
    def needs_teacher_hidden(self) -> bool:
        return "teacher_hidden_BxTxD" in self.fields

    @property
    def needs_teacher_topk(self) -> bool:
        return "teacher_topk_ids_BxTxK" in self.fields


OBJECTIVES: Registry[Objective] = Registry("loss kind")


def kind_options(kind: str, value: Any):
    """`loss.options` validated by the kind's own options dataclass (its defaults when none are given); None for
    a kind without options. An error is one line naming the option (`ConfigError("beta: ...")`, relative to
    `loss.options`) or the mismatch (`ValueError`)."""
    from jopd.config_dataclass import ConfigError, build

    options = OBJECTIVES[kind].options
    if options is None:
        if value is not None and value != {}:
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"loss kind {kind!r} takes no options, got {got}")
        return None
    if isinstance(value, options):
        return value
    if dataclasses.is_dataclass(value):  # another kind's options (e.g. `dataclasses.replace` of the kind alone)
        raise ValueError(f"{type(value).__name__} is not the options of loss kind {kind!r} ({options.__name__})")
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"expected a mapping of loss kind {kind!r}'s options, got {value!r}")
    try:
        return build(options, dict(value or {}), where="options")
    except ConfigError as e:
        field, _, msg = str(e).partition(": ")
        if field.startswith("options."):
            raise ConfigError(f"{field[len('options.'):]}: {msg}") from None
        raise ValueError(msg) from None
