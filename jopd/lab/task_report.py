"""A sweep over runs that mix several tasks (`data.mix`): each setup on each task's held-out problems — accuracy
and teacher divergence per seed, and the seed-aware rule on that task's problems against the baseline setup.
Written as OUT/tasks.{csv,json} and OUT/tasks.png; nothing when the runs have one task."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np

from jopd.lab import quality
from jopd.lab.runs import read_eval
from jopd.lab.sweep import run_dir
from jopd.lab.sweep_report import finished_seeds
from jopd.lab.sweep_config import SweepConfig


def _per_task(sweep: SweepConfig, setup: str, seeds) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """task -> per seed (divergence, correct), each sorted by problem id (the seeds' problem sets must agree)."""
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for seed in seeds:
        ev = read_eval(run_dir(sweep, setup, seed), sweep.quality.eval, correctness=True)
        if ev.task is None:
            return {}
        order = np.argsort(ev.index)
        for name in dict.fromkeys(ev.task.tolist()):
            rows = ev.task[order] == name
            out.setdefault(name, []).append((ev.divergence[order][rows], ev.correct[order][rows]))
    return out


def analyze_tasks(sweep: SweepConfig) -> dict[str, Any] | None:
    """Per (setup, task): divergence and accuracy per seed, and the seed-aware rise of the divergence against the
    baseline's on that task (None: the runs have one task). A sweep in progress: finished runs only (a setup
    with none is left out)."""
    q = sweep.quality
    base = _per_task(sweep, sweep.baseline.name, finished_seeds(sweep, sweep.baseline))
    if not base:
        return None
    rows = []
    for setup in [sweep.baseline, *sweep.setups]:
        done = finished_seeds(sweep, setup)
        mine = base if setup is sweep.baseline else _per_task(sweep, setup.name, done)
        for task, seeds in mine.items():
            row = {"setup": setup.name, "task": task, "seeds": done, "n": len(seeds[0][0]),
                   "divergence_per_seed": [float(np.nanmean(d)) for d, _ in seeds],
                   "accuracy_per_seed": [float(c.mean()) for _, c in seeds]}
            if setup is not sweep.baseline:
                runs, bases = [d for d, _ in seeds], [d for d, _ in base[task]]
                scored = np.all([np.isfinite(d) for d in runs + bases], axis=0)  # NaN: unscored (EvalData)
                sa = quality.seed_aware_rule([d[scored] for d in runs], [d[scored] for d in bases], q.threshold,
                                             q.resamples, q.seed)
                row |= {"rise": sa.rise, "rise_ci_low": sa.rise_ci_low, "rise_ci_high": sa.rise_ci_high,
                        "verdict": sa.verdict}
            rows.append(row)
    return {"baseline": sweep.baseline.name, "eval": q.eval, "rows": rows}


def write_tasks(result: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "tasks.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    with open(out_dir / "tasks.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setup", "task", "seeds", "problems", "divergence_per_seed", "accuracy_per_seed",
                    "seed_aware_rise", "ci_low", "ci_high", "verdict"])
        for r in result["rows"]:
            w.writerow([r["setup"], r["task"], " ".join(map(str, r["seeds"])), r["n"],
                        " ".join(f"{x:.4f}" for x in r["divergence_per_seed"]),
                        " ".join(f"{x:.4f}" for x in r["accuracy_per_seed"]),
                        *(f"{r[k]:.4f}" if k in r else "" for k in ("rise", "rise_ci_low", "rise_ci_high")),
                        r.get("verdict", "baseline")])


def tasks_table(result: dict[str, Any]) -> str:
    lines = [f"per task (eval/{result['eval']}; seed-aware rule against {result['baseline']} on that task's "
             f"problems):", f"  {'setup':24s} {'task':12s} {'divergence per seed':>22s} {'accuracy per seed':>20s}"
             f"  rise [95% CI]"]
    for r in result["rows"]:
        div = " · ".join(f"{x:.3f}" for x in r["divergence_per_seed"])
        acc = " · ".join(f"{x:.1%}" for x in r["accuracy_per_seed"])
        rise = (f"{r['rise']:+.1%} [{r['rise_ci_low']:+.1%}, {r['rise_ci_high']:+.1%}] {r['verdict']}"
                if "rise" in r else "(baseline)")
        lines.append(f"  {r['setup']:24s} {r['task']:12s} {div:>22s} {acc:>20s}  {rise}")
    return "\n".join(lines)


def plot_tasks(result: dict[str, Any], path: Path) -> None:
    """Per task, each setup's held-out divergence and accuracy: a bar at the seeds' mean, a dot per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in result["rows"]))
    setups = list(dict.fromkeys(r["setup"] for r in result["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(setups)
    for ax, key, label in ((axes[0], "divergence_per_seed", "held-out teacher divergence (nats/token)"),
                           (axes[1], "accuracy_per_seed", "held-out accuracy")):
        for k, setup in enumerate(setups):
            for i, task in enumerate(tasks):
                r = next(r for r in result["rows"] if r["setup"] == setup and r["task"] == task)
                x = i + (k - (len(setups) - 1) / 2) * width
                ax.bar(x, np.mean(r[key]), width, color=f"C{k}", alpha=0.5, label=setup if i == 0 else None)
                ax.scatter([x] * len(r[key]), r[key], color=f"C{k}", s=14, zorder=3)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("each task's held-out problems, divergence to that task's teacher (dots: training seeds)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
