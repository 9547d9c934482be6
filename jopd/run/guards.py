"""Guards of a training run against silent failure: a non-finite update, and a run that degenerates (no tokens
left in the loss, or responses pinned at the length cap with special tokens) while its loss reads as fine.

The update itself never applies a non-finite step (`train_state.make_train_step(skip_nonfinite=True)`: decided
on the device); the guard decides, on the host, one step later, whether the run stops or goes on, and says why.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pydantic

from jopd.config_dataclass import config_dataclass

# Metrics that do not depend on the loss mask: still meaningful for a step with no counted tokens.
MASK_FREE_METRICS = frozenset({"num_tokens", "nonfinite", "mismatch_kl", "response_len", "step_time_s",
                               "tokens_per_s", "reward", "reward_std", "response_at_cap", "special_token_frac",
                               "counted_token_frac", "mismatch_router_flip_frac", "mismatch_token_flip_frac"})


@config_dataclass
class GuardConfig:
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss or gradient: stop the run, or skip that update
    # a step is degenerate when the fraction of response tokens that count in the loss is below this (0 counted
    # tokens always is), or >= 95% of its responses hit max_new_tokens with >= half their tokens special
    min_token_frac: float = pydantic.Field(0.05, ge=0.0, le=1.0)
    patience: int = pydantic.Field(10, ge=1)  # consecutive degenerate steps before the guard acts
    degenerate: Literal["stop", "warn"] = "stop"


class RunGuard:
    """Host-side checks of each step's metrics and rollout (`check`); keeps the degenerate streak."""

    def __init__(self, cfg: GuardConfig, special_ids: set[int], max_new_tokens: int):
        self.cfg = cfg
        self.special_ids = np.asarray(sorted(special_ids), np.int64)
        self.max_new_tokens = max_new_tokens
        self.streak = 0
        self.warned = False

    def rollout_metrics(self, tokens_BxN: np.ndarray, lengths_B: np.ndarray, num_tokens: float) -> dict[str, float]:
        mask = np.arange(tokens_BxN.shape[1])[None, :] < lengths_B[:, None]
        total = float(mask.sum())
        special = float((np.isin(tokens_BxN, self.special_ids) & mask).sum()) if self.special_ids.size else 0.0
        return {"special_token_frac": special / total if total else 0.0,
                "counted_token_frac": num_tokens / total if total else 0.0,
                "response_at_cap": float(np.mean(lengths_B >= self.max_new_tokens))}

    def check(self, step: int, metrics: dict[str, float]) -> tuple[str | None, str | None]:
        """(a warning to print once, a reason to stop) for the step whose metrics (`rollout_metrics` included)
        these are."""
        if metrics.get("nonfinite", 0.0) > 0:
            what = f"step {step}: non-finite loss or gradient (loss {metrics.get('loss')}, grad_norm " \
                   f"{metrics.get('grad_norm')}); the update was not applied"
            return (what, None) if self.cfg.nonfinite == "skip" else (None, what)
        at_cap = metrics.get("response_at_cap", 0.0)
        reasons = []
        if metrics.get("num_tokens", 1.0) == 0:
            reasons.append("no response token counts in the loss")
        elif metrics.get("counted_token_frac", 1.0) < self.cfg.min_token_frac:
            reasons.append(f"only {metrics['counted_token_frac']:.1%} of response tokens count in the loss "
                           f"(< train.guard.min_token_frac={self.cfg.min_token_frac})")
        if at_cap >= 0.95 and metrics.get("special_token_frac", 0.0) >= 0.5:
            reasons.append(f"{at_cap:.0%} of responses hit max_new_tokens, {metrics['special_token_frac']:.0%} of "
                           f"their tokens special")
        self.streak = self.streak + 1 if reasons else 0
        if self.streak < self.cfg.patience:
            return None, None
        what = (f"the run has degenerated: {'; '.join(reasons)}, for {self.streak} consecutive steps "
                f"(up to step {step})")
        if self.cfg.degenerate == "stop":
            return None, what
        if not self.warned:
            self.warned = True
            return what, None
        return None, None


def loggable(metrics: dict[str, float]) -> dict[str, float]:
    """A step with no counted tokens logs its loss-dependent metrics as missing, never as a 0 that reads as a
    perfect step."""
    if metrics.get("num_tokens", 1.0) > 0:
        return metrics
    return {k: v for k, v in metrics.items() if k in MASK_FREE_METRICS}
