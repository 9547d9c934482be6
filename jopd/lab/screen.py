"""The screening check, run: measure calibration setups and candidates offline (`jopd.lab.measure`, the same
student checkpoint, prompts and random draws for all), calibrate the budget from the calibration runs'
quality-rule verdicts, and admit / reject / leave undecided each candidate (`jopd.lab.screening`).

Mismatch is calibrated and screened on one scale: by default both sides are the offline measurement (what
a candidate can be given without training). The runs' own logged mean mismatch (`in_run`) is reported beside
it; the two differ because the student changes during training, so a budget read off the in-run scale and
applied to offline measurements would sit in the wrong place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from jopd.lab.screening import Calibration, calibrate, count_matches, decide
from jopd.opd.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class Measured:
    name: str
    offline: dict[str, float]  # exact KL mean and 95% CI over prompts, from `measure`
    wall_s: float  # build + measurement, seconds
    in_run: float | None = None  # mean mismatch_kl logged by a full run of this setup (if one exists)


@dataclasses.dataclass
class ScreenReport:
    scale: str
    calibration: Calibration
    calibration_points: list[dict[str, Any]]  # {label, setup, mismatch, verdict}
    measured: list[Measured]
    decisions: list[dict[str, Any]]  # per candidate: decision (+ its full-run verdicts when known)
    matches: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "calibration": self.calibration.to_dict(),
                "calibration_points": self.calibration_points,
                "measured": [dataclasses.asdict(m) for m in self.measured], "decisions": self.decisions,
                "matches": self.matches}

    def table(self) -> str:
        c = self.calibration
        high = "none failed" if c.bracket_high is None else f"{c.bracket_high:.4g}"
        lines = [f"budget ({self.scale}; nats/token): bracket ({c.bracket_low:.4g}, {high}], admission "
                 f"threshold {c.threshold:.4g}; {c.note}"]
        if c.non_monotone:
            lines.append("  non-monotone: " + ", ".join(f"{r['label']} PASS at {r['mismatch']:.4g}"
                                                        for r in c.non_monotone))
        lines.append(f"{'candidate':18s} {'mismatch':>10s} {'95% CI':>23s} {'decision':>10s} {'log10(m/thr)':>12s} "
                     f"{'full runs':>12s} {'secs':>6s}")
        walls = {m.name: m.wall_s for m in self.measured}
        for d in self.decisions:
            full = ",".join(d.get("full_run_verdicts", [])) or "-"
            ratio = "-inf" if d["log10_ratio"] is None else f"{d['log10_ratio']:+.2f}"
            lines.append(f"{d['name']:18s} {d['mismatch']:10.4g} [{d['ci_low']:10.4g}, {d['ci_high']:10.4g}] "
                         f"{d['decision']:>10s} {ratio:>12s} {full:>12s} {walls[d['name']]:6.1f}")
        if self.matches:
            m = self.matches
            lines.append(f"decisions matching the full runs: {m['matched']} of {m['decided']} decided "
                         f"({m['undecided']} undecided, {m['mismatched']} wrong)")
        return "\n".join(lines)


def measure_setup(name: str, cfg: RunConfig, student: str | None, batches: int, resamples: int,
                  log=print) -> Measured:
    """Offline mismatch of one setup's rollout engine (its config forced to exact mismatch measurement)."""
    from jopd.commands.mismatch import measure_config

    exact = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mismatch="exact"))
    t0 = time.perf_counter()
    report, _ = measure_config(exact, student, None, batches, resamples, log=lambda m: None)
    e = report.exact_kl
    log(f"  {name}: offline mismatch {e.mean:.4g} [{e.ci_low:.4g}, {e.ci_high:.4g}] nats/token")
    return Measured(name, {"mean": e.mean, "ci_low": e.ci_low, "ci_high": e.ci_high}, time.perf_counter() - t0)


def screen(calibration_runs: list[dict[str, Any]], candidates: list[tuple[str, RunConfig, list[str]]], *,
           student: str | None, batches: int, resamples: int, scale: Literal["offline", "in_run"] = "offline",
           setup_configs: dict[str, RunConfig] | None = None, in_run: dict[str, float] | None = None,
           measured: dict[str, Measured] | None = None, verdicts: str = "per run", log=print) -> ScreenReport:
    """`calibration_runs`: one dict per full run {label, setup, verdict}; `setup_configs[setup]` is the config to
    measure a calibration setup with (offline scale); `in_run[setup]` its runs' mean logged mismatch.
    `candidates`: (name, config, the verdicts of its full runs if any, for the match count). `measured`: a
    cache of offline measurements shared between calls (filled here); `verdicts` names where the verdicts
    come from, for the report."""
    in_run = in_run or {}
    measured = {} if measured is None else measured

    def offline(name: str, cfg: RunConfig) -> Measured:
        if name not in measured:
            measured[name] = dataclasses.replace(measure_setup(name, cfg, student, batches, resamples, log),
                                                 in_run=in_run.get(name))
        return measured[name]

    points = []
    for r in calibration_runs:
        if scale == "offline":
            m = offline(r["setup"], setup_configs[r["setup"]]).offline["mean"]
        else:
            m = in_run[r["setup"]] if r.get("mismatch") is None else r["mismatch"]
        points.append({"label": r["label"], "setup": r["setup"], "mismatch": float(m), "verdict": r["verdict"]})
    cal = calibrate([(p["mismatch"], p["verdict"]) for p in points], labels=[p["label"] for p in points])
    decisions, decided, truth = [], [], []
    for name, cfg, full_runs in candidates:
        o = offline(name, cfg).offline
        d = decide(o["mean"], o["ci_low"], o["ci_high"], cal).to_dict()
        decisions.append({"name": name, **d, "full_run_verdicts": list(full_runs)})
        for v in full_runs:  # one comparison per full run of the candidate
            decided.append(d["decision"])
            truth.append(v)
    matches = count_matches(decided, truth).to_dict() if truth else None
    names = {p["setup"] for p in points} | {name for name, _, _ in candidates}
    return ScreenReport(f"{scale} mismatch, {verdicts} verdicts", cal, points,
                        [m for n, m in measured.items() if n in names], decisions, matches)
