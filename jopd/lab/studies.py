"""Read-outs of the lab's studies beyond one sweep's table: how a setup's rise differs between two methods of a
contrast sweep (e.g. two horizons), held-out accuracy along a run (`train.eval_every`), the teacher-reliability
probe along a run (`train.probe_every`), and their plots.

Pure numpy on top of `jopd.lab.runs` (the readers) and `jopd.lab.quality` (the bootstrap), so it runs anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jopd.lab import quality
from jopd.lab.runs import prefixed_rows, read_eval
from jopd.lab.sweep import run_dir
from jopd.lab.sweep_config import SweepConfig


def rise_difference(runs_a: Sequence[np.ndarray], bases_a: Sequence[np.ndarray], runs_b: Sequence[np.ndarray],
                    bases_b: Sequence[np.ndarray], resamples: int = 10_000, seed: int = 0,
                    confidence: float = 0.95) -> dict[str, float]:
    """rise_b − rise_a, each rise = mean over seeds of the run's per-problem mean / the same of its base − 1 (as in
    `quality.seed_aware_rule`), with a percentile interval from independent hierarchical bootstraps of the two
    comparisons (`quality.hierarchical_replicates`: seeds and problems; a and b may hold different problems)."""
    out = {}
    reps = []
    for tag, runs, bases, s in (("a", runs_a, bases_a, seed), ("b", runs_b, bases_b, seed + 1)):
        R, B = np.stack([np.asarray(r, np.float64) for r in runs]), np.stack([np.asarray(b, np.float64) for b in bases])
        if R.shape[1] != B.shape[1]:
            raise ValueError(f"side {tag}: runs have {R.shape[1]} problems, bases {B.shape[1]}")
        out[f"rise_{tag}"] = float(R.mean(1).mean() / B.mean(1).mean() - 1)
        rr, rb = quality.hierarchical_replicates(R, B, resamples, s)
        reps.append(rr / rb - 1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(reps[1] - reps[0], [alpha, 1 - alpha])
    return out | {"diff": out["rise_b"] - out["rise_a"], "ci_low": float(lo), "ci_high": float(hi)}


def method_gaps(sweep: SweepConfig) -> list[dict[str, Any]]:
    """For a contrast sweep whose methods are all judged by the quality rule (e.g. `short` and `long`): per setup
    finished in every method, its rise over the method's baseline in each, and the last method's rise minus the
    first's (`rise_difference`). Seeds: the ones finished on both sides of each comparison."""
    methods = [m for m in sweep.method_names() if m is not None and sweep.methods[m].rule == "quality"]
    if len(methods) < 2:
        return []
    first, last = methods[0], methods[-1]
    q = sweep.quality

    def arrays(setup: str, seeds: Sequence[int], method: str) -> list[np.ndarray] | None:
        dirs = [run_dir(sweep, setup, k, method) for k in seeds]
        if not all((d / "summary.json").is_file() and (d / "eval" / f"{q.eval}.csv").is_file() for d in dirs):
            return None
        evals = [read_eval(d, q.eval) for d in dirs]
        return quality.align(evals)[1]

    rows = []
    for setup in sweep.setups:
        sides = {m: (arrays(setup.name, setup.seeds, m), arrays(sweep.baseline.name, sweep.baseline.seeds, m))
                 for m in (first, last)}
        if any(r is None or b is None for r, b in sides.values()):
            continue
        d = rise_difference(*sides[first], *sides[last], q.resamples, q.seed)
        rows.append({"setup": setup.name, "methods": [first, last], f"rise_{first}": d["rise_a"],
                     f"rise_{last}": d["rise_b"], "diff": d["diff"], "ci_low": d["ci_low"], "ci_high": d["ci_high"]})
    return rows


def gaps_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        a, b = r["methods"]
        lines.append(f"{r['setup']}: rise {r[f'rise_{a}']:+.1%} ({a}) -> {r[f'rise_{b}']:+.1%} ({b}); "
                     f"{b} - {a}: {r['diff']:+.1%} [{r['ci_low']:+.1%}, {r['ci_high']:+.1%}]")
    return "\n".join(lines)


def accuracy_curve(run: str | Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every eval the run logged (before = step 0, `train.eval_every`, after)."""
    return [(s, float(r["accuracy"])) for s, r in sorted(prefixed_rows(run, "eval/").items())
            if isinstance(r.get("accuracy"), (int, float))]


def probe_curve(runs: Sequence[str | Path], key: str) -> list[tuple[int, float, list[float]]]:
    """(step, mean over runs, per-run values) of the training probe's `probe/<key>` at every step some run
    logged it; a run with no value at a step (e.g. no erroneous prefix) is left out of that step's mean."""
    per_run = [{s: r.get(key) for s, r in prefixed_rows(d, "probe/").items()} for d in runs]
    steps = sorted({s for p in per_run for s in p})
    out = []
    for s in steps:
        vals = [float(p[s]) for p in per_run if isinstance(p.get(s), (int, float)) and math.isfinite(p[s])]
        if vals:
            out.append((s, float(np.mean(vals)), vals))
    return out


def plot_accuracy_curves(curves: dict[str, list[tuple[int, float]]], path: str | Path, gain: float = 0.05,
                         title: str = "") -> None:
    """Held-out accuracy vs step, one line per run, with the start + `gain` line of each run's start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, (name, pts) in enumerate(curves.items()):
        if not pts:
            continue
        x, y = zip(*pts)
        ax.plot(x, [v * 100 for v in y], marker="o", color=f"C{k}", label=name)
        ax.axhline((y[0] + gain) * 100, color=f"C{k}", ls=":", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title or f"held-out accuracy along the run (dotted: start + {gain:.0%})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_horizon(divergence: dict[str, dict[str, dict[str, list[float]]]],
                 probes: dict[str, dict[str, list[tuple[int, float, list[float]]]]], path: str | Path) -> None:
    """Left: held-out teacher divergence after training relative to the start, per loss (x) and horizon (colour),
    one dot per seed (`divergence[horizon][loss] = {"before": [...], "after": [...]}` per seed). Right: the
    training probe per horizon (`probes[horizon][key]` from `probe_curve`), one line style per key."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    horizons = list(divergence)
    losses = list(dict.fromkeys(loss for h in horizons for loss in divergence[h]))
    width = 0.8 / max(len(horizons), 1)
    for k, h in enumerate(horizons):
        for i, loss in enumerate(losses):
            d = divergence[h].get(loss)
            if not d:
                continue
            rel = [a / b * 100 for a, b in zip(d["after"], d["before"])]
            xs = [i + (k - (len(horizons) - 1) / 2) * width] * len(rel)
            ax.scatter(xs, rel, color=f"C{k}", label=h if i == 0 else None, zorder=3)
            ax.bar(xs[0], float(np.mean(rel)), width=width * 0.9, color=f"C{k}", alpha=0.25)
    ax.axhline(100, color="0.5", lw=0.8)
    ax.set_xticks(range(len(losses)), losses, fontsize=8)
    ax.set_ylabel("held-out divergence after / before (%)")
    ax.set_title("what each loss removes, per horizon (dots: seeds)", fontsize=10)
    ax.legend(fontsize=8)
    styles = ["-", "--", ":", "-."]
    for k, h in enumerate(probes):
        for j, (key, pts) in enumerate(probes[h].items()):
            if pts:
                x, y, _ = zip(*pts)
                bx.plot(x, [v * 100 for v in y], ls=styles[j % len(styles)], marker="o", ms=3, color=f"C{k}",
                        label=f"{h}: {key}")
    bx.set_xlabel("OPD step")
    bx.set_ylabel("% of the student's erroneous prefixes")
    bx.set_title("teacher-reliability probe over training (truncated loss)", fontsize=10)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
