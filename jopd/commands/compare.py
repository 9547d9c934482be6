"""Quality rule: did RUN_DIR's held-out teacher divergence rise against BASE_DIR's, problem by problem?

Pairs the per-problem divergences of RUN_DIR/eval/NAME.csv and BASE_DIR/eval/NAME.csv by problem index;
rise = mean(run)/mean(base) - 1; a 95% paired (percentile) bootstrap CI of the mean per-problem difference
(run - base); FAIL iff rise >= --threshold and the CI excludes 0, else PASS. With more training seeds
(--run-also / --base-also), also the seed-aware verdict (bootstrap over seeds and problems), the rise against
the base seeds' own spread, and the per-run rule for every pair of seeds.
Exit code: 0 PASS, 1 FAIL (the seed-aware verdict when more seeds are given), 2 bad input (e.g. differing
problem sets). Runs that mix several tasks (`data.mix`: their evals have a `task` column) also get the rule on
each task's problems (printed and in --json's `per_task`; the exit code stays the whole set's).

With --rl (reward-trained runs: REINFORCE, GRPO; BASE = the same method at the standard engine), the broke
criterion of `jopd.lab.rl_verdict` instead: BROKE iff held-out accuracy is below BASE's by >= --acc-margin with
the paired bootstrap interval of the per-problem difference excluding 0, or a collapse signal over the run's
last 20% of steps (reward < --collapse-reward while BASE's was higher, entropy < --collapse-entropy, >= 95% of
rollouts at max_new_tokens, any NaN). Exit code: 0 OK, 1 BROKE, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run to judge (a `jopd train` out_dir)")
    p.add_argument("base_dir", metavar="BASE_DIR", help="its baseline run (same problems, same step)")
    p.add_argument("--eval", dest="eval_name", default="after", metavar="NAME",
                   help="which eval/NAME.csv to compare: after (default), before, step_N")
    p.add_argument("--threshold", type=float, default=0.2, help="rise that fails the rule (default 0.2 = +20%%)")
    p.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap random seed (default 0)")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")
    p.add_argument("--run-also", action="append", default=[], metavar="DIR",
                   help="another training seed of the run (repeatable)")
    p.add_argument("--base-also", action="append", default=[], metavar="DIR",
                   help="another training seed of the base (repeatable)")
    rl = p.add_argument_group("RL runs (--rl): the broke criterion instead of the quality rule")
    rl.add_argument("--rl", action="store_true", help="judge reward-trained runs by the broke criterion")
    rl.add_argument("--acc-margin", type=float, default=0.05,
                    help="absolute held-out accuracy drop that breaks a run (default 0.05)")
    rl.add_argument("--collapse-reward", type=float, default=0.02,
                    help="mean reward over the last 20%% of steps below this (base higher) is a collapse (0.02)")
    rl.add_argument("--collapse-entropy", type=float, default=0.05,
                    help="mean entropy (nats/token) over the last 20%% of steps below this is a collapse (0.05)")


def _fmt(v: float | None, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def _table(v, eval_name: str, run_dir: str, base_dir: str, mm_run: float | None, mm_base: float | None) -> str:
    pct = f"{v.confidence:.0%}"
    rows = [
        ("", "base", "run"),
        ("mean teacher divergence (nats/token)", _fmt(v.base_mean), _fmt(v.run_mean)),
        ("mean mismatch_kl in training", _fmt(mm_base, ".3g"), _fmt(mm_run, ".3g")),
    ]
    lines = [f"jopd compare: eval/{eval_name}.csv, {v.n} problems paired", f"  run:  {run_dir}", f"  base: {base_dir}"]
    lines += [f"  {a:38s} {b:>14s} {c:>14s}" for a, b, c in rows]
    lines += [f"  {'rise':38s} {v.rise:+.1%} (threshold {v.threshold:+.1%})",
              f"  {'mean difference (run - base)':38s} {v.diff_mean:+.4f}  "
              f"{pct} CI [{v.ci_low:+.4f}, {v.ci_high:+.4f}]",
              f"  {'verdict (per-run rule)':38s} {v.verdict}: {v.reason}"]
    return "\n".join(lines)


def _seed_table(s, run_dirs: list[str], base_dirs: list[str]) -> str:
    pct = f"{s.confidence:.0%}"
    dots = lambda xs: " · ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    spread = (f"{min(s.base_seed_rises):+.1%} .. {max(s.base_seed_rises):+.1%} of their mean, "
              f"rel. std {s.base_rel_std:.1%}" if s.base_rel_std is not None else "n/a (one base seed)")
    lines = [f"seed-aware: {len(run_dirs)} run seed(s), {len(base_dirs)} base seed(s), "
             f"bootstrap over seeds and problems",
             f"  {'run seed means':38s} {dots(s.run_seed_means)}  (mean {s.run_mean:.4f})",
             f"  {'base seed means':38s} {dots(s.base_seed_means)}  (mean {s.base_mean:.4f})",
             f"  {'base seeds spread':38s} {spread}",
             f"  {'rise of the seed means':38s} {s.rise:+.1%}  {pct} CI [{s.rise_ci_low:+.1%}, {s.rise_ci_high:+.1%}]"
             + (f", {s.rise_over_base_std:.1f} x the base rel. std" if s.rise_over_base_std is not None else ""),
             f"  {'mean difference (run - base)':38s} {s.diff_mean:+.4f}  {pct} CI [{s.ci_low:+.4f}, {s.ci_high:+.4f}]",
             f"  {'verdict (seed-aware)':38s} {s.verdict}: {s.reason}",
             f"  {'per-run rule, every seed pair':38s} {s.per_run_fails} of {len(s.pairs)} FAIL"
             + ("  <- disagrees with the seed-aware verdict" if s.disagree else "")]
    for p in s.pairs:
        lines.append(f"    {run_dirs[p['run']]} vs {base_dirs[p['base']]}: rise {p['rise']:+.1%}, "
                     f"CI [{p['ci_low']:+.4f}, {p['ci_high']:+.4f}] {p['verdict']}")
    return "\n".join(lines)


def _rl_table(v, eval_name: str, run_dir: str, base_dir: str) -> str:
    a, c, b, k = v.accuracy, v.collapse, v.base_collapse, v.criterion
    pct = f"{k.confidence:.0%}"
    lines = [f"jopd compare --rl: eval/{eval_name}.csv, {a.n} problems paired", f"  run:  {run_dir}",
             f"  base: {base_dir}", f"  {'':40s} {'base':>10s} {'run':>10s}",
             f"  {'held-out accuracy':40s} {a.base_accuracy:>10.3f} {a.run_accuracy:>10.3f}",
             f"  {'accuracy difference (run - base)':40s} {a.diff_mean:+.3f}  {pct} CI [{a.ci_low:+.3f}, "
             f"{a.ci_high:+.3f}] (margin {a.margin:.3f})",
             f"  last {k.tail:.0%} of steps (run {c.steps[0]}-{c.steps[1]}, base {b.steps[0]}-{b.steps[1]}):"]
    rows = [("mean reward", b.reward, c.reward, f"< {k.collapse_reward} with the base higher"),
            ("mean entropy (nats/token)", b.entropy, c.entropy, f"< {k.collapse_entropy}"),
            (f"rollouts at the cap ({c.at_cap_source})", b.at_cap, c.at_cap, f">= {k.cap_fraction}")]
    lines += [f"    {name:38s} {_fmt(x):>10s} {_fmt(y):>10s}   collapse if {rule}" for name, x, y, rule in rows]
    lines += [f"    {'non-finite metric':38s} {b.nonfinite or 'none':>10s} {c.nonfinite or 'none':>10s}",
              f"  {'accuracy check':40s} {'BROKE' if a.broke else 'ok'}: {a.reason}",
              f"  {'collapse check':40s} " + ("BROKE: " + "; ".join(c.signals) if c.broke else "ok: no signal")]
    if b.broke:
        lines.append(f"  warning: the base itself shows collapse signals ({'; '.join(b.signals)})")
    lines.append(f"  {'verdict':40s} {v.verdict}")
    return "\n".join(lines)


def run_rl(args: argparse.Namespace) -> int:
    from jopd.lab import rl_verdict as rv

    if args.run_also or args.base_also:
        raise ValueError("--rl: judges one run against one base (no --run-also / --base-also); run it per seed")
    crit = rv.Criterion(acc_margin=args.acc_margin, collapse_reward=args.collapse_reward,
                        collapse_entropy=args.collapse_entropy, resamples=args.resamples, seed=args.seed)
    v = rv.rl_verdict(args.run_dir, args.base_dir, args.eval_name, crit)
    print(_rl_table(v, args.eval_name, args.run_dir, args.base_dir))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"run_dir": args.run_dir, "base_dir": args.base_dir, "eval": args.eval_name, **v.to_dict()}
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if v.verdict == "BROKE" else 0


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from jopd.lab import quality as q
    from jopd.lab.runs import mean_mismatch, read_eval

    if args.rl:
        return run_rl(args)
    if args.resamples < 1:
        raise ValueError(f"--resamples: must be >= 1, got {args.resamples}")
    if not (args.threshold >= 0 and args.threshold != float("inf")):
        raise ValueError(f"--threshold: must be a finite number >= 0, got {args.threshold}")
    run_dirs, base_dirs = [args.run_dir, *args.run_also], [args.base_dir, *args.base_also]
    for w in q.check_comparable(run_dirs, base_dirs, args.eval_name):
        print(f"jopd compare: warning: {w}", file=sys.stderr)
    evals = [read_eval(d, args.eval_name) for d in [args.base_dir, *args.base_also, args.run_dir, *args.run_also]]
    ids, aligned = q.align(evals)  # every run against the base's problem set: errors say how many are missing
    bases, runs = aligned[:len(base_dirs)], aligned[len(base_dirs):]
    v = q.quality_rule(runs[0], bases[0], args.threshold, args.resamples, args.seed)
    mm_run, mm_base = mean_mismatch(args.run_dir), mean_mismatch(args.base_dir)
    print(_table(v, args.eval_name, args.run_dir, args.base_dir, mm_run, mm_base))
    result = {"run_dir": args.run_dir, "base_dir": args.base_dir, "eval": args.eval_name,
              "run_eval": str(evals[len(base_dirs)].path), "base_eval": str(evals[0].path),
              **v.to_dict(), "run_mismatch_kl": mm_run, "base_mismatch_kl": mm_base, "decided_by": "per-run"}
    verdict = v.verdict
    if len(run_dirs) > 1 or len(base_dirs) > 1:
        s = q.seed_aware_rule(runs, bases, args.threshold, args.resamples, args.seed)
        print()
        print(_seed_table(s, run_dirs, base_dirs))
        result["seed_aware"] = {"run_dirs": run_dirs, "base_dirs": base_dirs, **s.to_dict()}
        result["decided_by"] = "seed-aware"
        verdict = s.verdict
    base_tasks = evals[0].task
    if base_tasks is not None:  # a mix of tasks: the rule on each task's problems too
        tasks = base_tasks[np.argsort(evals[0].index)][np.isin(np.sort(evals[0].index), ids)]  # scored ones
        result["per_task"] = {}
        print()
        print("per task (the rule on each task's problems; the verdict above is the whole set's):")
        for name in dict.fromkeys(tasks.tolist()):
            rows = tasks == name
            vt = q.quality_rule(runs[0][rows], bases[0][rows], args.threshold, args.resamples, args.seed)
            line = (f"  {name:20s} {vt.n:5d} problems  base {vt.base_mean:.4f}  run {vt.run_mean:.4f}  rise "
                    f"{vt.rise:+.1%}  CI [{vt.ci_low:+.4f}, {vt.ci_high:+.4f}]  {vt.verdict}")
            result["per_task"][name] = vt.to_dict()
            if len(run_dirs) > 1 or len(base_dirs) > 1:
                st = q.seed_aware_rule([r[rows] for r in runs], [b[rows] for b in bases], args.threshold,
                                       args.resamples, args.seed)
                line += f"; seed-aware rise {st.rise:+.1%} [{st.rise_ci_low:+.1%}, {st.rise_ci_high:+.1%}] {st.verdict}"
                result["per_task"][name]["seed_aware"] = st.to_dict()
            print(line)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if verdict == "PASS" else 1
