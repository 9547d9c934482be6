"""The screening check, run: measure calibration setups and candidates offline (`jopd.lab.mismatch`, the same
student checkpoint, prompts and random draws for all), calibrate the budget from the calibration runs'
quality-rule verdicts, and admit / reject / leave undecided each candidate (`jopd.lab.budget`).

Mismatch is calibrated and screened on one scale: by default both sides are the offline measurement (what
a candidate can be given without training). The runs' own logged mean mismatch (`in_run`) is reported beside
it; the two differ because the student changes during training, so a budget read off the in-run scale and
applied to offline measurements would sit in the wrong place.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from jopd.lab import quality
from jopd.lab.mismatch import measure_config
from jopd.lab.runs import config_field, mean_mismatch, read_eval, read_run_config, run_config
from jopd.lab.budget import Calibration, calibrate, count_matches, decide
from jopd.lab.sweep import run_config as setup_run_config
from jopd.lab.sweep_config import QualityConfig, SweepConfig
from jopd.run.config import RunConfig


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
    exact = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mismatch="exact"))
    t0 = time.perf_counter()
    report, _ = measure_config(exact, student, None, batches, resamples, log=lambda m: None)
    e = report.exact_kl
    log(f"  {name}: offline mismatch {e.mean:.4g} [{e.ci_low:.4g}, {e.ci_high:.4g}] nats/token")
    return Measured(name, {"mean": e.mean, "ci_low": e.ci_low, "ci_high": e.ci_high}, time.perf_counter() - t0)


def calibration_from_runs(baseline: Sequence[str], calibration: Sequence[str], q: QualityConfig
                          ) -> tuple[list[dict[str, Any]], dict[str, RunConfig], dict[str, float]]:
    """From full runs on disk, for `screen`: each calibration run's {label, setup, verdict} (the quality rule
    against the baseline run of its train.seed, else the first baseline run), its config (to re-measure it
    offline) and its logged mean mismatch (where it logged one)."""
    by_seed = {config_field(read_run_config(d), "train", "seed"): d for d in baseline}
    runs, configs, in_run = [], {}, {}
    for d in calibration:
        base = by_seed.get(config_field(read_run_config(d), "train", "seed"), baseline[0])
        _, r, b = quality.pair(read_eval(d, q.eval), read_eval(base, q.eval))
        runs.append({"label": d, "setup": d, "verdict": quality.quality_rule(r, b, q.threshold, q.resamples,
                                                                             q.seed).verdict})
        configs[d] = run_config(d)
        mm = mean_mismatch(d)
        if mm is not None:
            in_run[d] = mm
    return runs, configs, in_run


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


def screen_sweep(sweep: SweepConfig, result: dict[str, Any], log=print) -> dict[str, ScreenReport]:
    """A sweep's `screen` section, on its analysis (`sweep_report.analyze`), both ways: per run (every run of a
    calibration setup is a point, every run of a candidate a check: the seed study's one-run rule) and
    seed-aware (one point / one check per setup, its verdict over all its seeds). The offline measurements are
    shared by the two."""
    sc = sweep.screen
    configs = {s.name: setup_run_config(sweep, s, s.seeds[0]) for s in sweep.all_setups()}
    student = None
    if sc.student == "baseline":
        student = str(Path(sweep.out_dir) / sweep.baseline.name / f"seed{sweep.baseline.seeds[0]}")
    in_run = {s["setup"]: s["mismatch"] for s in result["setups"]}
    setups = {s["setup"]: s for s in result["setups"]}
    modes = {
        "per_run": ([{"label": f"{r['setup']}/seed{r['seed']}", "setup": r["setup"], "verdict": r["verdict"]}
                     for r in result["runs"] if r["setup"] in sc.calibration],
                    {n: setups[n]["per_run_verdicts"] for n in sc.candidates if n in setups}),
        "seed_aware": ([{"label": n, "setup": n, "verdict": setups[n]["seed_aware"]["verdict"]}
                        for n in sc.calibration if n in setups],
                       {n: [setups[n]["seed_aware"]["verdict"]] for n in sc.candidates if n in setups}),
    }
    measured: dict[str, Measured] = {}
    return {mode: screen(cal, [(n, configs[n], truth.get(n, [])) for n in sc.candidates], student=student,
                         batches=sc.batches, resamples=sc.resamples, setup_configs=configs, in_run=in_run,
                         measured=measured, verdicts=mode.replace("_", "-"), log=log)
            for mode, (cal, truth) in modes.items()}
