"""A finished sweep's analysis: the quality rule for every run against the baseline run of the same training
seed, a seed-aware verdict per setup, the pass/fail bracket on the mismatch axis, the baseline's own seed
spread, each run's wall time; written as OUT/summary.{csv,json} and OUT/bracket.png.

Setups with a `group` (e.g. one IS correction over a ladder of engines) get a bracket per group beside the main
one (the ungrouped setups'), each grouped setup is also compared with its ungrouped twin (the same engine
without the group's overrides), and OUT/groups.png puts the groups' brackets on one plot.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jopd.lab import quality
from jopd.lab.runs import is_finished, mean_metric, mean_mismatch, read_eval, read_eval_summary, wall_seconds
from jopd.lab.budget import calibrate
from jopd.lab.sweep import run_dir
from jopd.lab.sweep_config import SetupConfig, SweepConfig

# per-step metrics averaged over each run's training steps into its row (None where the run did not log them)
RUN_METRICS = ("is_frac_truncated", "is_frac_dropped", "is_weight_mean", "is_ess")


def _run_record(sweep: SweepConfig, setup: str, seed: int, method: str | None = None) -> dict[str, Any]:
    d = run_dir(sweep, setup, seed, method)
    ev = read_eval(d, sweep.quality.eval)
    mm = mean_mismatch(d)
    if mm is None:
        raise ValueError(f"{d}/metrics.jsonl: no mismatch_kl logged (the sweep runs with train.mismatch=exact)")
    summary = read_eval_summary(d, sweep.quality.eval)
    return {"setup": setup, "seed": seed, "dir": str(d), "mismatch": mm, "eval": ev,
            "divergence": float(np.nanmean(ev.divergence)), "accuracy": float(summary.get("accuracy", math.nan)),
            "wall_s": wall_seconds(d), **{k: mean_metric(d, k) for k in RUN_METRICS}}


def ungrouped_twin(setup: SetupConfig, setups: list[SetupConfig]) -> SetupConfig | None:
    """The ungrouped setup whose overrides are the largest proper subset of `setup`'s (e.g. `noise_2.0` for
    `noise_2.0_tis` = noise 2.0 + is_mode=tis): the same engine without the group's own overrides. None when
    no ungrouped setup's overrides are a proper subset, or when the largest is not unique."""
    mine = set(setup.overrides)
    cands = [s for s in setups if s.group is None and set(s.overrides) < mine]
    if not cands:
        return None
    best = max(len(s.overrides) for s in cands)
    top = [s for s in cands if len(s.overrides) == best]
    return top[0] if len(top) == 1 else None


def finished_seeds(sweep: SweepConfig, setup: SetupConfig, method: str | None = None) -> list[int]:
    """The seeds of `setup` whose runs have finished (their final eval written)."""
    return [k for k in setup.seeds if is_finished(run_dir(sweep, setup.name, k, method))]


def missing_runs(sweep: SweepConfig, method: str | None = None) -> list[str]:
    """`setup/seed<k>` of every planned run not finished yet (an analysis of a sweep in progress leaves them out)."""
    return [f"{s.name}/seed{k}" for s in sweep.all_setups() for k in s.seeds
            if not is_finished(run_dir(sweep, s.name, k, method))]


def _seed_aware(run_evals: list, base_evals: list, q) -> quality.SeedAwareVerdict:
    """The seed-aware rule on the problems every eval of both sides scored (`quality.align`)."""
    _, arrays = quality.align([*base_evals, *run_evals])
    return quality.seed_aware_rule(arrays[len(base_evals):], arrays[:len(base_evals)], q.threshold, q.resamples,
                                   q.seed)


def analyze(sweep: SweepConfig, method: str | None = None) -> dict[str, Any]:
    """Every run's verdict (vs the baseline run with its seed, else the baseline's first seed), each setup's
    seed-aware verdict (vs all baseline seeds), the per-run and seed-aware brackets, the baseline spread.
    A method judged by the broke rule (RL) gets `analyze_broke` instead. A sweep in progress is analyzed on
    its finished runs: the others are listed in "missing" (a setup with no finished seed is left out)."""
    if method is not None and sweep.methods[method].rule == "broke":
        return analyze_broke(sweep, method)
    q = sweep.quality
    base_seeds = finished_seeds(sweep, sweep.baseline, method)
    if not base_seeds:
        raise ValueError(f"{run_dir(sweep, sweep.baseline.name, sweep.baseline.seeds[0], method).parent}: no "
                         f"finished baseline run yet, nothing to compare with")
    base = {s: _run_record(sweep, sweep.baseline.name, s, method) for s in base_seeds}
    first = base_seeds[0]
    base_evals = [b["eval"] for b in base.values()]
    runs, setups, setup_evals = [], [], {}
    for s in base_seeds[1:]:  # what the per-run rule says about seed noise alone
        ids, run_B, base_B = quality.pair(base[s]["eval"], base[first]["eval"])
        v = quality.quality_rule(run_B, base_B, q.threshold, q.resamples, q.seed)
        runs.append(_row(base[s], v, paired_with=first, baseline=True))
    done = [(setup, finished_seeds(sweep, setup, method)) for setup in sweep.setups]
    for setup, seeds in done:
        if not seeds:
            continue
        recs = [_run_record(sweep, setup.name, s, method) for s in seeds]
        for r in recs:
            b = base.get(r["seed"], base[first])
            _, run_B, base_B = quality.pair(r["eval"], b["eval"])
            v = quality.quality_rule(run_B, base_B, q.threshold, q.resamples, q.seed)
            runs.append(_row(r, v, paired_with=b["seed"]))
        setup_evals[setup.name] = [r["eval"] for r in recs]
        sa = _seed_aware(setup_evals[setup.name], base_evals, q)
        per_run = [x["verdict"] for x in runs if x["setup"] == setup.name]
        setups.append({"setup": setup.name, "group": setup.group, "seeds": seeds,
                       "overrides": list(setup.overrides),
                       "wall_s": _total([r["wall_s"] for r in recs]),
                       **{k: _mean_or_none([r[k] for r in recs]) for k in RUN_METRICS},
                       "mismatch": float(np.mean([r["mismatch"] for r in recs])),
                       "mismatch_per_seed": [r["mismatch"] for r in recs],
                       "divergence_per_seed": [r["divergence"] for r in recs],
                       "accuracy_per_seed": [r["accuracy"] for r in recs],
                       "per_run_verdicts": per_run, "seed_aware": sa.to_dict(),
                       "disagree": any(v != sa.verdict for v in per_run)})
    analyzed = [setup for setup, seeds in done if seeds]
    for row, setup in zip(setups, analyzed):  # a grouped setup against the same engine without the group
        twin = ungrouped_twin(setup, analyzed) if setup.group is not None else None
        if twin is not None:
            v = _seed_aware(setup_evals[setup.name], setup_evals[twin.name], q)
            row["vs_ungrouped"] = {"setup": twin.name, "rise": v.rise, "rise_ci_low": v.rise_ci_low,
                                   "rise_ci_high": v.rise_ci_high, "diff_mean": v.diff_mean, "ci_low": v.ci_low,
                                   "ci_high": v.ci_high}
    base_means = [b["divergence"] for b in base.values()]
    grand = float(np.mean(base_means))
    group_of = {s.name: s.group for s in sweep.setups}
    setup_runs = [r for r in runs if not r["baseline"] and group_of[r["setup"]] is None]
    main_setups = [s for s in setups if s["group"] is None]
    out = {"method": method, "rule": "quality", "threshold": q.threshold, "eval": q.eval,
           "missing": missing_runs(sweep, method),
           "baseline": {"setup": sweep.baseline.name, "seeds": base_seeds,
                        "divergence_per_seed": base_means, "accuracy_per_seed": [b["accuracy"] for b in base.values()],
                        "seed_rises": [m / grand - 1 for m in base_means],
                        "rel_range": (max(base_means) - min(base_means)) / grand,
                        "mismatch_per_seed": [b["mismatch"] for b in base.values()],
                        "wall_s_per_seed": [b["wall_s"] for b in base.values()]},
           "runs": runs, "setups": setups,
           "bracket_per_run": _bracket([(r["mismatch"], r["verdict"]) for r in setup_runs],
                                       [f"{r['setup']}/seed{r['seed']}" for r in setup_runs]),
           "bracket_seed_aware": _bracket([(s["mismatch"], s["seed_aware"]["verdict"]) for s in main_setups],
                                          [s["setup"] for s in main_setups]),
           "groups": _group_brackets(runs, setups),
           "compute": _compute(base.values(), runs, setups)}
    return out


def _total(vals: list[float | None]) -> float | None:
    return float(sum(vals)) if vals and all(v is not None for v in vals) else None


def _mean_or_none(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def _group_brackets(runs: list[dict], setups: list[dict]) -> dict[str, dict[str, Any]]:
    """Per group: its brackets (per run and seed-aware) from its own setups only."""
    out = {}
    for g in dict.fromkeys(s["group"] for s in setups if s["group"] is not None):
        mine = [s for s in setups if s["group"] == g]
        names = {s["setup"] for s in mine}
        rr = [r for r in runs if r["setup"] in names and not r["baseline"]]
        out[g] = {"setups": sorted(names, key=lambda n: next(s["mismatch"] for s in mine if s["setup"] == n)),
                  "bracket_per_run": _bracket([(r["mismatch"], r["verdict"]) for r in rr],
                                              [f"{r['setup']}/seed{r['seed']}" for r in rr]),
                  "bracket_seed_aware": _bracket([(s["mismatch"], s["seed_aware"]["verdict"]) for s in mine],
                                                 [s["setup"] for s in mine])}
    return out


def _compute(base_recs, runs: list[dict], setups: list[dict]) -> dict[str, Any]:
    """Wall time the sweep spent training (runs without a record are counted, not timed)."""
    walls = [b["wall_s"] for b in base_recs] + [r["wall_s"] for r in runs if not r["baseline"]]
    timed = [w for w in walls if w is not None]
    return {"runs": len(walls), "timed_runs": len(timed), "wall_s_total": float(sum(timed)),
            "wall_s_median": float(np.median(timed)) if timed else None,
            "wall_s_max": float(max(timed)) if timed else None}


def analyze_broke(sweep: SweepConfig, method: str) -> dict[str, Any]:
    """RL runs: the broke criterion (`jopd.lab.rl_verdict`) of every run against the method's standard-engine
    run of the same seed (else its first seed); per setup, how many of its seeds broke."""
    from jopd.lab.rl_verdict import rl_verdict
    from jopd.lab.studies import accuracy_curve

    q = sweep.quality
    base_seeds = finished_seeds(sweep, sweep.baseline, method)
    if not base_seeds:
        raise ValueError(f"{run_dir(sweep, sweep.baseline.name, sweep.baseline.seeds[0], method).parent}: no "
                         f"finished baseline run yet, nothing to compare with")
    first = base_seeds[0]
    base_dir = lambda seed: run_dir(sweep, sweep.baseline.name, seed if seed in base_seeds else first,  # noqa: E731
                                    method)
    runs, setups = [], []
    for setup in sweep.setups:
        rows = []
        seeds = finished_seeds(sweep, setup, method)
        if not seeds:
            continue
        for seed in seeds:
            rec = _run_record(sweep, setup.name, seed, method)
            v = rl_verdict(rec["dir"], base_dir(seed), q.eval)
            rows.append({"setup": setup.name, "seed": seed, "baseline": False, "mismatch": rec["mismatch"],
                         "divergence": rec["divergence"], "accuracy": rec["accuracy"],
                         "base_accuracy": v.accuracy.base_accuracy, "acc_diff": v.accuracy.diff_mean,
                         "ci_low": v.accuracy.ci_low, "ci_high": v.accuracy.ci_high, "verdict": v.verdict,
                         "reasons": [v.accuracy.reason] * v.accuracy.broke + list(v.collapse.signals),
                         "final_reward": v.collapse.reward, "final_entropy": v.collapse.entropy,
                         "wall_s": rec["wall_s"]})
        runs += rows
        setups.append({"setup": setup.name, "seeds": seeds, "overrides": list(setup.overrides),
                       "mismatch": float(np.mean([r["mismatch"] for r in rows])),
                       "per_run_verdicts": [r["verdict"] for r in rows],
                       "broke": sum(r["verdict"] == "BROKE" for r in rows),
                       "acc_diff_mean": float(np.mean([r["acc_diff"] for r in rows]))})
    base = [_run_record(sweep, sweep.baseline.name, s, method) for s in base_seeds]
    return {"method": method, "rule": "broke", "eval": q.eval, "runs": runs, "setups": setups,
            "missing": missing_runs(sweep, method),
            "baseline": {"setup": sweep.baseline.name, "seeds": base_seeds,
                         "accuracy_per_seed": [b["accuracy"] for b in base],
                         "divergence_per_seed": [b["divergence"] for b in base],
                         "wall_s_per_seed": [b["wall_s"] for b in base],
                         # held-out accuracy at every eval of the run (before = step 0, train.eval_every, after)
                         "accuracy_curve_per_seed": [accuracy_curve(b["dir"]) for b in base]},
            "compute": _compute(base, [r | {"baseline": False} for r in runs], setups)}


def _row(rec: dict[str, Any], v: quality.QualityVerdict, *, paired_with: int, baseline: bool = False) -> dict:
    return {"setup": rec["setup"], "seed": rec["seed"], "baseline": baseline, "paired_with_base_seed": paired_with,
            "mismatch": rec["mismatch"], "divergence": rec["divergence"], "accuracy": rec["accuracy"],
            "rise": v.rise, "diff_mean": v.diff_mean, "ci_low": v.ci_low, "ci_high": v.ci_high,
            "verdict": v.verdict, "wall_s": rec["wall_s"], **{k: rec[k] for k in RUN_METRICS}}


def _bracket(points, labels) -> dict[str, Any] | None:
    if not any(v == "PASS" for _, v in points):
        return None
    try:
        return calibrate(points, labels).to_dict()
    except ValueError as e:  # e.g. no PASS below the lowest FAIL: say so instead of a bracket
        return {"error": str(e)}


def write_tables(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    if result["rule"] == "broke":
        cols = ["setup", "seed", "mismatch", "accuracy", "base_accuracy", "acc_diff", "ci_low", "ci_high", "verdict",
                "wall_s"]
        with open(out_dir / "runs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows({k: r[k] for k in cols} for r in result["runs"])
        return
    cols = ["setup", "seed", "baseline", "paired_with_base_seed", "mismatch", "divergence", "accuracy", "rise",
            "diff_mean", "ci_low", "ci_high", "verdict", "wall_s", *RUN_METRICS]
    with open(out_dir / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows({k: r[k] for k in cols} for r in result["runs"])
    with open(out_dir / "setups.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setup", "group", "seeds", "mismatch", "per_run_verdicts", "seed_aware_rise", "seed_aware_ci_low",
                    "seed_aware_ci_high", "seed_aware_verdict", "disagree", "wall_s", *RUN_METRICS,
                    "vs_ungrouped", "vs_ungrouped_rise", "vs_ungrouped_ci_low", "vs_ungrouped_ci_high"])
        fmt = lambda v: "" if v is None else f"{v:.4g}"  # noqa: E731
        for s in result["setups"]:
            sa, vs = s["seed_aware"], s.get("vs_ungrouped") or {}
            w.writerow([s["setup"], s.get("group") or "", " ".join(map(str, s["seeds"])), f"{s['mismatch']:.6g}",
                        " ".join(s["per_run_verdicts"]), f"{sa['rise']:.4f}", f"{sa['rise_ci_low']:.4f}",
                        f"{sa['rise_ci_high']:.4f}", sa["verdict"], int(s["disagree"]), fmt(s.get("wall_s")),
                        *(fmt(s.get(k)) for k in RUN_METRICS), vs.get("setup", ""), fmt(vs.get("rise")),
                        fmt(vs.get("rise_ci_low")), fmt(vs.get("rise_ci_high"))])


def _wall(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}s"


def _bracket_line(name: str, br: dict[str, Any] | None) -> str | None:
    if br and "error" not in br:
        high = "none" if br["bracket_high"] is None else f"{br['bracket_high']:.3g}"
        return (f"{name}: ({br['bracket_low']:.3g}, {high}] nats/token"
                + (f"; non-monotone: {', '.join(r['label'] for r in br['non_monotone'])}" if br["non_monotone"] else ""))
    return f"{name}: {br['error']}" if br else None


def _footer(result: dict[str, Any]) -> list[str]:
    lines = []
    c = result.get("compute")
    if c:
        lines.append(f"compute: {c['runs']} finished runs, {c['timed_runs']} timed: {c['wall_s_total'] / 60:.1f} min of "
                     f"training wall time" + (f" (median {c['wall_s_median']:.0f} s, max {c['wall_s_max']:.0f} s per run)"
                                              if c["timed_runs"] else ""))
    if result.get("missing"):
        lines.append(f"not finished yet ({len(result['missing'])}): {', '.join(result['missing'])} "
                     f"(rerun `jopd sweep` on the same file to train them)")
    return lines


def table(result: dict[str, Any]) -> str:
    b = result["baseline"]
    if result["rule"] == "broke":
        lines = [f"{result['method']}: baseline {b['setup']} held-out accuracy per seed "
                 + " · ".join(f"{a:.1%}" for a in b["accuracy_per_seed"])]
        for seed, curve in zip(b["seeds"], b.get("accuracy_curve_per_seed", [])):
            if len(curve) > 1:
                lines.append(f"  seed {seed} along the run: " + ", ".join(f"{a:.1%} @{s}" for s, a in curve)
                             + f" (gain {curve[-1][1] - curve[0][1]:+.1%}, best {max(a for _, a in curve) - curve[0][1]:+.1%})")
        lines.append(f"{'setup':16s} {'mismatch':>9s}  accuracy change per seed (verdict)")
        for s in sorted(result["setups"], key=lambda s: s["mismatch"]):
            rows = [r for r in result["runs"] if r["setup"] == s["setup"]]
            per = "  ".join(f"{r['acc_diff']:+.1%} [{r['ci_low']:+.1%}, {r['ci_high']:+.1%}] {r['verdict']}"
                            for r in rows)
            lines.append(f"{s['setup']:16s} {s['mismatch']:9.3g}  {per}")
        return "\n".join(lines + _footer(result))
    lines = [f"baseline {b['setup']}: held-out divergence per seed "
             + " · ".join(f"{m:.3f}" for m in b["divergence_per_seed"])
             + f" (range {b['rel_range']:.1%} of their mean); wall per seed "
             + " · ".join(_wall(w) for w in b.get("wall_s_per_seed", []))]
    groups = [None] + list(result.get("groups", {}))
    for g in groups:
        mine = [s for s in result["setups"] if s.get("group") == g]
        if not mine:
            continue
        if g is not None:
            lines.append(f"-- group {g}")
        lines.append(f"{'setup':18s} {'mismatch':>9s} {'rise per seed (per-run verdict)':>32s} "
                     f"{'seed-aware rise [95% CI]':>30s} {'wall':>6s}" + ("  IS: truncated dropped ess; vs the same "
                                                                           "engine uncorrected" if g else ""))
        for s in sorted(mine, key=lambda s: s["mismatch"]):
            rows = [r for r in result["runs"] if r["setup"] == s["setup"]]
            per = " ".join(f"{r['rise']:+.0%}{'F' if r['verdict'] == 'FAIL' else ''}" for r in rows)
            sa = s["seed_aware"]
            line = (f"{s['setup']:18s} {s['mismatch']:9.3g} {per:>32s} {sa['rise']:+8.1%} "
                    f"[{sa['rise_ci_low']:+.1%}, {sa['rise_ci_high']:+.1%}] {sa['verdict']} {_wall(s.get('wall_s')):>6s}")
            if g is not None:
                fr = lambda k: "-" if s.get(k) is None else f"{s[k]:.3f}"  # noqa: E731
                line += f"  {fr('is_frac_truncated')} {fr('is_frac_dropped')} {fr('is_ess')}"
                vs = s.get("vs_ungrouped")
                if vs:
                    line += f"; vs {vs['setup']} {vs['rise']:+.1%} [{vs['rise_ci_low']:+.1%}, {vs['rise_ci_high']:+.1%}]"
            lines.append(line + ("  <- rules disagree" if s["disagree"] else ""))
        brackets = result if g is None else result["groups"][g]
        for key in ("bracket_per_run", "bracket_seed_aware"):
            line = _bracket_line(key.replace("_", " ") + ("" if g is None else f" ({g})"), brackets[key])
            if line:
                lines.append(line)
    return "\n".join(lines + _footer(result))


def plot(result: dict[str, Any], path: Path) -> None:
    """Rise vs mismatch (log x): each run (o PASS, x FAIL), each setup's seed-aware rise with its CI, the
    bracket shaded, the threshold, and the baseline seeds' spread as a band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    b = result["baseline"]
    ax.axhspan(min(b["seed_rises"]) * 100, max(b["seed_rises"]) * 100, color="0.85",
               label=f"baseline seeds' spread ({len(b['seed_rises'])} seeds)")
    ax.axhline(result["threshold"] * 100, color="C3", ls="--", lw=1, label=f"threshold +{result['threshold']:.0%}")
    ax.axhline(0, color="0.5", lw=0.8)
    for key, label in (("bracket_seed_aware", "bracket (seed-aware rule)"), ("bracket_per_run", "bracket (per-run rule)")):
        br = result[key]
        if br and "error" not in br and br["bracket_high"] is not None:
            ax.axvspan(br["bracket_low"], br["bracket_high"], color="C1", alpha=0.15, label=label)
            break
    main = {s["setup"] for s in result["setups"] if s.get("group") is None}  # groups: plot_groups
    runs = [r for r in result["runs"] if not r["baseline"] and r["setup"] in main]
    for verdict, marker, color in (("PASS", "o", "C0"), ("FAIL", "x", "C3")):
        pts = [(r["mismatch"], r["rise"] * 100) for r in runs if r["verdict"] == verdict]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=f"run: {verdict}", zorder=3)
    for s in result["setups"]:
        if s["setup"] not in main:
            continue
        sa = s["seed_aware"]
        y, lo, hi = sa["rise"] * 100, sa["rise_ci_low"] * 100, sa["rise_ci_high"] * 100
        ax.errorbar(s["mismatch"], y, yerr=[[y - lo], [hi - y]], color="k", alpha=0.5, capsize=3, lw=1)
        ax.annotate(s["setup"], (s["mismatch"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    _save_vs_mismatch(fig, ax, "rise in held-out teacher divergence vs baseline (%)",
                      "quality rule vs rollout mismatch (bars: seed-aware rise, 95% CI)", path)


def _save_vs_mismatch(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Finish a plot against the in-training mismatch (log x) and write it."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel("mismatch: mean exact KL(sampler ‖ trainer) over training (nats/token)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_groups(result: dict[str, Any], path: Path, main_label: str = "none") -> None:
    """The ungrouped setups (`main_label`) and each group on one plot: seed-aware rise vs mismatch (log x) per
    setup with its CI, one colour per group, each group's seed-aware bracket as a band at the bottom."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [None] + list(result.get("groups", {}))
    fig, ax = plt.subplots(figsize=(8, 5))
    b = result["baseline"]
    ax.axhspan(min(b["seed_rises"]) * 100, max(b["seed_rises"]) * 100, color="0.9",
               label=f"baseline seeds' spread ({len(b['seed_rises'])} seeds)")
    ax.axhline(result["threshold"] * 100, color="C3", ls="--", lw=1, label=f"threshold +{result['threshold']:.0%}")
    ax.axhline(0, color="0.5", lw=0.8)
    ys = [s["seed_aware"]["rise_ci_high"] * 100 for s in result["setups"]] + [result["threshold"] * 100]
    band_h = max(ys) * 0.04
    for k, g in enumerate(names):
        mine = sorted((s for s in result["setups"] if s.get("group") == g), key=lambda s: s["mismatch"])
        if not mine:
            continue
        color, label = f"C{k}", main_label if g is None else g
        x = [s["mismatch"] for s in mine]
        y = [s["seed_aware"]["rise"] * 100 for s in mine]
        lo = [s["seed_aware"]["rise_ci_low"] * 100 for s in mine]
        hi = [s["seed_aware"]["rise_ci_high"] * 100 for s in mine]
        ax.errorbar(x, y, yerr=[[a - c for a, c in zip(y, lo)], [c - a for a, c in zip(y, hi)]], color=color,
                    marker="o", ms=4, capsize=3, lw=1, label=label)
        for s in mine:
            runs = [r for r in result["runs"] if r["setup"] == s["setup"] and not r["baseline"]]
            ax.scatter([r["mismatch"] for r in runs], [r["rise"] * 100 for r in runs], color=color, s=10, alpha=0.5,
                       marker="x")
        br = result["bracket_seed_aware"] if g is None else result["groups"][g]["bracket_seed_aware"]
        if br and "error" not in br and br["bracket_high"] is not None:
            y0 = -band_h * (2 + 1.5 * k)
            ax.fill_between([br["bracket_low"], br["bracket_high"]], y0, y0 + band_h, color=color, alpha=0.5, lw=0)
            ax.annotate(f"{label}: ({br['bracket_low']:.2g}, {br['bracket_high']:.2g}]", (br["bracket_high"], y0),
                        fontsize=7, xytext=(3, 0), textcoords="offset points", color=color)
    _save_vs_mismatch(fig, ax, "seed-aware rise in held-out teacher divergence (%)",
                      "bracket per group (bands: seed-aware bracket; x: single runs; bars: 95% CI)", path)


def contrast(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row per (method, setup): mean mismatch, the verdict of each seed's run, how many broke/failed, and the
    effect (OPD: rise of held-out teacher divergence; RL: change of held-out accuracy)."""
    rows = []
    for method, res in results.items():
        for s in res["setups"]:
            runs = [r for r in res["runs"] if r["setup"] == s["setup"] and not r.get("baseline")]
            bad = sum(r["verdict"] in ("FAIL", "BROKE") for r in runs)
            effect = [r["rise"] if res["rule"] == "quality" else r["acc_diff"] for r in runs]
            rows.append({"method": method, "setup": s["setup"], "rule": res["rule"], "mismatch": s["mismatch"],
                         "verdicts": [r["verdict"] for r in runs], "bad": bad, "n": len(runs),
                         "effect_per_seed": effect, "effect_mean": float(np.mean(effect)),
                         "effect": "rise of teacher divergence" if res["rule"] == "quality" else "accuracy change"})
    return {"rows": rows}


def contrast_table(c: dict[str, Any]) -> str:
    lines = [f"{'method':10s} {'setup':14s} {'mismatch':>9s} {'effect per seed':>26s}  verdicts"]
    for r in c["rows"]:
        eff = " ".join(f"{e:+.1%}" for e in r["effect_per_seed"])
        lines.append(f"{r['method']:10s} {r['setup']:14s} {r['mismatch']:9.3g} {eff:>26s}  {' '.join(r['verdicts'])}"
                     f" ({r['bad']}/{r['n']} {'failed' if r['rule'] == 'quality' else 'broke'})")
    return "\n".join(lines)


def plot_contrast(c: dict[str, Any], path: Path) -> None:
    """Per setup (by mismatch): each method's effect per seed, hollow markers where the run failed/broke."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in c["rows"]))
    setups = sorted(dict.fromkeys(r["setup"] for r in c["rows"]),
                    key=lambda n: next(r["mismatch"] for r in c["rows"] if r["setup"] == n))
    labels = {"quality": "rise of held-out teacher divergence (%)", "broke": "change of held-out accuracy (points)"}
    rules = [rule for rule in labels if any(r["rule"] == rule for r in c["rows"])]  # one panel per rule present
    if not rules:  # baseline runs only (e.g. tuning on the standard engine): nothing to contrast
        return
    fig, axes = plt.subplots(1, len(rules), figsize=(5.5 * len(rules), 4.2), squeeze=False)
    for ax, rule in zip(axes[0], rules):
        label = labels[rule]
        mine = [m for m in methods if any(r["method"] == m and r["rule"] == rule for r in c["rows"])]
        for k, m in enumerate(mine):
            for i, name in enumerate(setups):
                r = next((r for r in c["rows"] if r["method"] == m and r["setup"] == name), None)
                if r is None:
                    continue
                for e, v in zip(r["effect_per_seed"], r["verdicts"]):
                    bad = v in ("FAIL", "BROKE")
                    ax.scatter(i + (k - (len(mine) - 1) / 2) * 0.2, e * 100, color=f"C{methods.index(m)}",
                               marker="X" if bad else "o", s=60 if bad else 30,
                               label=m if (i == 0 and e == r["effect_per_seed"][0]) else None)
        ax.axhline(0, color="0.5", lw=0.8)
        if rule == "quality":
            ax.axhline(20, color="C3", ls="--", lw=1)
        ax.set_xticks(range(len(setups)), [f"{n}\n{next(r['mismatch'] for r in c['rows'] if r['setup'] == n):.2g}"
                                           for n in setups], fontsize=8)
        ax.set_xlabel("rollout setup (mean mismatch, nats/token)")
        ax.set_ylabel(label, fontsize=9)
        if mine:
            ax.legend(fontsize=8)
    title = {("quality",): "methods judged by the quality rule (X: failed)",
             ("broke",): "methods judged by the broke rule (X: broke)"}.get(
        tuple(rules), "the same rollout mismatch under OPD and under RL (X: failed / broke)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_baseline_curves(results: dict[str, dict[str, Any]], path: Path, gain: float = 0.05) -> bool:
    """Change of held-out accuracy along each broke-rule method's standard-engine runs (one line per method and
    seed; runs may start from different students), with +`gain` dashed: where RL learns, before any mismatched
    run. False (nothing drawn) when no such run evaluated along the way."""
    curves = [(m, seed, curve) for m, res in results.items() if res["rule"] == "broke"
              for seed, curve in zip(res["baseline"]["seeds"], res["baseline"].get("accuracy_curve_per_seed", []))
              if len(curve) > 1]
    if not curves:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(m for m, _, _ in curves))
    colors = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 4.8))
    for m, seed, curve in curves:
        steps, acc = zip(*curve)
        ax.plot(steps, [(a - acc[0]) * 100 for a in acc], marker="o", ms=3, color=colors(methods.index(m) % 20),
                ls="-" if seed == curves[0][1] else ":", label=f"{m} (seed {seed}, from {acc[0]:.1%})")
    ax.axhline(gain * 100, color="0.4", ls="--", lw=1, label=f"+{gain * 100:.0f} points")
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy change since step 0 (points)")
    ax.set_title("RL on the standard engine: held-out accuracy along the run", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: collapsed runs fill the bottom
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
