"""Run a grid of rollout setups x training seeds as full OPD runs, then the quality rule, the bracket and the screen.

    jopd sweep SWEEP.yaml [--analyze-only] [--no-screen] [--only SETUP_OR_GROUP[,...]]

Each (setup, seed) trains as `jopd train` would, in OUT/<setup>/seed<k>/ (format: jopd/lab/sweep_config.py).
Resumable: finished runs are skipped and an interrupted one resumes from its checkpoint, so rerunning the same
command after a kill continues where it stopped. Then every run is compared with the baseline run of the same
training seed (the per-run quality rule), every setup with all baseline seeds (the seed-aware rule), and the
pass/fail bracket is read off the mismatch axis. Writes OUT/runs.csv, OUT/setups.csv, OUT/summary.json,
OUT/bracket.png and, with a `screen` section, OUT/screen.json (offline decisions vs the full runs' verdicts);
runs that mix several tasks (`data.mix`) add OUT/tasks.{csv,json,png}: each setup on each task's problems;
setups with a `group` get a bracket each and OUT/groups.png. `--analyze-only` tables the runs finished so far
(the others are listed as not finished; the screen waits for its setups), with each run's wall time.
With `methods` (a contrast: e.g. OPD vs REINFORCE vs GRPO on the same setups), every method runs the baseline and
every setup, each is judged by its own rule (the quality rule, or the RL broke criterion of `jopd compare --rl`)
against its own baseline, and OUT/contrast.{json,png} put them side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep YAML (see configs/sweeps/)")
    p.add_argument("--analyze-only", action="store_true", help="do not train; analyze the runs that exist")
    p.add_argument("--no-screen", action="store_true", help="skip the screening section")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="train only these setups or groups (and the baseline); the analysis tables every finished run")


def _screen_ready(sweep, result, log) -> bool:
    """The screen needs every calibration and candidate setup's runs finished; otherwise it waits (one line)."""
    names = set(sweep.screen.calibration) | set(sweep.screen.candidates)
    missing = [m for m in result["missing"] if m.split("/")[0] in names]
    if missing:
        log(f"screen: skipped until {len(missing)} more run(s) finish ({', '.join(missing)})")
    return not missing


def run(args: argparse.Namespace) -> int:
    from jopd.lab import studies, sweep_report, task_report
    from jopd.lab.sweep import run_sweep
    from jopd.lab.sweep_config import load_sweep

    sweep = load_sweep(args.sweep)
    out = Path(sweep.out_dir)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    t0 = time.perf_counter()
    if not args.analyze_only:
        from jopd.lab.sweep import only_setups

        try:
            only = only_setups(sweep, args.only.split(",")) if args.only else None
        except ValueError as e:
            print(f"jopd sweep: {e}", file=sys.stderr)
            return 2
        records = run_sweep(sweep, log=log, only=only)
        out.mkdir(parents=True, exist_ok=True)
        (out / "runs_log.jsonl").open("a").write("".join(json.dumps(r) + "\n" for r in records))
        if any(r["status"] == "interrupted" for r in records):
            return 0
    if sweep.methods is not None:  # a contrast of methods: each judged by its own rule, then side by side
        results = {}
        for method in sweep.methods:
            try:
                results[method] = sweep_report.analyze(sweep, method)
            except ValueError as e:  # a contrast in progress: this method's baseline has not finished yet
                log(f"{method}: {e}")
                continue
            sweep_report.write_tables(results[method], out / method)
            if results[method]["rule"] == "quality":
                sweep_report.plot(results[method], out / method / "bracket.png")
            print(sweep_report.table(results[method]))
        c = sweep_report.contrast(results)
        c["gaps"] = studies.method_gaps(sweep)  # quality-rule methods only (e.g. two horizons); else []
        (out / "contrast.json").write_text(json.dumps(c, indent=2, default=float) + "\n")
        pngs = []
        if c["rows"]:  # none when every run is a baseline (e.g. RL tuning on the standard engine)
            sweep_report.plot_contrast(c, out / "contrast.png")
            pngs.append("contrast.png")
            print(sweep_report.contrast_table(c))
        if sweep_report.plot_baseline_curves(results, out / "baseline_curves.png"):
            pngs.append("baseline_curves.png")
        if c["gaps"]:
            print(studies.gaps_table(c["gaps"]))
        print(f"wrote {out}/contrast.json, {', '.join(pngs + ['per-method tables'])} "
              f"({time.perf_counter() - t0:.0f} s)")
        return 0
    result = sweep_report.analyze(sweep)
    sweep_report.write_tables(result, out)
    sweep_report.plot(result, out / "bracket.png")
    if result["groups"]:
        sweep_report.plot_groups(result, out / "groups.png")
    print(sweep_report.table(result))
    tasks = task_report.analyze_tasks(sweep)
    if tasks is not None:  # runs that mix several tasks: each setup on each task's problems
        task_report.write_tasks(tasks, out)
        task_report.plot_tasks(tasks, out / "tasks.png")
        print(task_report.tasks_table(tasks))
    if sweep.screen is not None and not args.no_screen and _screen_ready(sweep, result, log):
        from jopd.lab.screen import screen_sweep

        reports = screen_sweep(sweep, result, log=log)
        for rep in reports.values():
            print(rep.table())
        (out / "screen.json").write_text(json.dumps({m: r.to_dict() for m, r in reports.items()}, indent=2,
                                                    default=float) + "\n")
    print(f"wrote {out}/summary.json, runs.csv, setups.csv, bracket.png ({time.perf_counter() - t0:.0f} s)")
    return 0
