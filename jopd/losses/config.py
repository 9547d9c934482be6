"""`LossConfig`: which per-token objective the trainer minimizes (its kind, and the kind's own `options`), with
the settings every kind shares: masks, IS correction, temperature, chunking, normalization, and those of the
shared stages a kind's entry opts into (the teacher's support, the frozen reference). `RLConfig`: how the RL kinds
turn rewards into advantages and how often they reuse a rollout batch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from jopd.config_dataclass import config_dataclass
from jopd.losses.kinds import OBJECTIVES, kind_options
from jopd.registry import registered

LossKind = registered(OBJECTIVES)  # the registered kinds (built-ins: `jopd.losses.builtin`; a plugin may add more)
ISMode = Literal["none", "tis", "icepop"]

_Pos = pydantic.Field(gt=0)


@config_dataclass
class LossConfig:
    """Frozen and hashable, so it can be a static argument of the jitted train step."""

    # topk_rkl: truncated reverse KL renormalized on the support S below;
    # topk_rkl_tail (the default OPD loss, with S = union): the same support plus one "tail" outcome, not
    # renormalized (penalizes off-support mass; lowest held-out divergence of the truncated losses measured on
    # both the testbed and the SmolLM2 task, docs/results.md "Which truncated reverse KL");
    # sampled_opd: policy gradient with advantage -(log pi_s(y) - log pi_t(y)) on the sampled token;
    # rkl / fkl / jsd: full-vocabulary divergences (need full teacher logits); sft: cross-entropy on targets;
    # reinforce / grpo: RL baselines, policy gradient with per-sequence advantages from rewards (`RLConfig`);
    # xtok_sampled / xtok_dense: a teacher with another tokenizer (`opd.cross_teacher`): the exact per-span
    # sampled-token objective (the cross-tokenizer form of sampled_opd), and the truncated reverse KL with a tail
    # at the span starts against the teacher's distribution projected onto the student's top-K (of topk_rkl_tail).
    kind: LossKind = "topk_rkl_tail"
    # The kind's own settings, validated by its entry's `options` dataclass (`kinds.kind_options`): e.g.
    # `{beta: 0.3}` for jsd; None/absent: its defaults. After validation, that dataclass (None: no options).
    options: Any = None
    top_k: Annotated[int, pydantic.Field(ge=1)] = 32  # K; must match the teacher top-K in the batch
    # The support S of the kinds that read the teacher's support (the topk kinds, a plugin's; orthogonal to
    # renormalized vs tail; other kinds ignore it; the scoring builds it for whichever kind reads it): the teacher's
    # top-K, or its union with the student's top-K (taken from the sampler's logits at rollout time);
    # `support_sampled` adds the sampled token. The teacher is scored at every id of S; repeated ids count once
    # (`support_mask_BxTxK`). The default is the union: on the teacher's top-K alone the student's mass outside
    # it is never penalized, and the held-out divergence counts exactly that mass (docs/results.md, "Which truncated
    # reverse KL").
    support: Literal["teacher_topk", "union"] = "union"
    support_sampled: bool = False
    # Divides student (and full teacher) logits; must equal the sampler's temperature for IS/mismatch and the
    # temperature given to `teacher_topk`.
    temperature: Annotated[float, _Pos] = 1.0
    # Importance-sampling correction from sampler vs trainer logprobs of the sampled tokens (stop-gradient):
    # tis: w = min(p/q, is_cap); icepop: w = p/q if icepop_low <= p/q <= icepop_high else 0.
    is_mode: ISMode = "none"
    is_cap: Annotated[float, _Pos] = 2.0
    icepop_low: Annotated[float, pydantic.Field(ge=0.0)] = 0.5
    icepop_high: Annotated[float, _Pos] = 5.0
    # Positions whose TARGET token is one of these ids are masked out, wherever they occur.
    special_token_ids: tuple[Annotated[int, pydantic.Field(ge=0)], ...] = ()
    # Masked at their first occurrence in each response only (chat-template tokens where the template writes them).
    template_token_ids: tuple[Annotated[int, pydantic.Field(ge=0)], ...] = ()
    # The run's tasks, when it mixes several (`data.mix`; filled by the step from the data config): the loss then
    # also reports each task's loss and teacher k1 (`task/<name>/...`), from the batch's per-row task ids.
    task_names: tuple[str, ...] = ()
    # Sequence positions per chunk of student logits (peak memory ~ B * chunk_size * V floats; the full-vocabulary
    # kinds, which also project the teacher's logits in each chunk, run chunk_size // 2 positions).
    chunk_size: Annotated[int, pydantic.Field(ge=1)] = 128
    # The kinds that read the frozen reference (`reads_reference`: reinforce, grpo), per token:
    # + kl_coef * k3(pi_theta || pi_ref), pi_ref = the run's starting student (the step holds it when > 0)
    kl_coef: Annotated[float, pydantic.Field(ge=0.0)] = 0.0
    # Denominator = rows x response slots (a constant per batch shape) instead of the count of loss tokens
    # (Dr. GRPO: a sequence's weight no longer depends on its own or its batch-mates' lengths).
    token_sum_norm: bool = False
    # A mixture-of-experts student: + router_aux_coef * its routers' load-balancing loss (Switch / Qwen3-MoE:
    # E * sum_e f_e * P_e, averaged over the sparse layers, over the tokens whose hidden states the loss reads;
    # `moe.load_balancing_loss`), logged as `router_aux_loss`. 0: off (not computed).
    router_aux_coef: Annotated[float, pydantic.Field(ge=0.0)] = 0.0

    @property
    def support_size(self) -> int:
        """Ids per position in the support (repeats included): K, 2K for a union, +1 with the sampled token."""
        return self.top_k * (2 if self.support == "union" else 1) + int(self.support_sampled)

    @property
    def extra_support(self) -> bool:
        return self.support != "teacher_topk" or self.support_sampled

    @property
    def cross_tokenizer(self) -> Literal["off", "sampled", "dense"]:
        """How a teacher with another tokenizer is scored for this kind (its entry's `cross_tokenizer`); off: the
        kind needs a teacher of the student's vocabulary."""
        return OBJECTIVES[self.kind].cross_tokenizer or "off"

    @pydantic.field_validator("options")
    @classmethod
    def _kind_options(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        kind = info.data.get("kind")
        return value if kind is None else kind_options(kind, value)  # no kind: its own error is reported

    @pydantic.field_validator("icepop_high")
    @classmethod
    def _high_above_low(cls, high: float, info: pydantic.ValidationInfo) -> float:
        low = info.data.get("icepop_low")
        if low is not None and high <= low:
            raise ValueError(f"must be above icepop_low={low}, got {high}")
        return high


Baseline = Literal["batch_mean", "leave_one_out", "running_mean"]


@config_dataclass
class RLConfig:
    """The RL kinds' per-sequence side (`jopd.losses.advantages`; their per-token settings are `LossConfig`'s)."""

    group_size: int = pydantic.Field(4, ge=1)  # GRPO samples per prompt (the batch holds batch_size prompts)
    normalize_std: bool = True  # GRPO: divide by the group's reward std (Dr. GRPO sets this False)
    eps: float = pydantic.Field(1e-6, gt=0)
    baseline: Baseline = "batch_mean"  # REINFORCE's baseline (GRPO's is its group mean)
    baseline_decay: float = pydantic.Field(0.9, ge=0, lt=1)  # running_mean: EMA decay per rollout batch
    # Optimizer updates per rollout batch (GRPO only: its clipped ratio accounts for the policy's change).
    # optim.warmup_steps / decay_steps count optimizer updates, i.e. train.steps * inner_updates in all.
    inner_updates: int = pydantic.Field(1, ge=1)
