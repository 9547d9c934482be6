"""The staleness study's tables (issue [AO] item 4) from `jopd sweep configs/sweeps/testbed_staleness.yaml`'s
per-method summaries: per loss and staleness k, the mismatch in training (nats/token: the exact KL between the
k-stale sampler and the trainer), the rise of the held-out teacher divergence per seed against k = 0 with its
per-run verdict, the seed-aware rise and verdict; then the screening check: the budget calibrated on precision
engines (the default loss's seed-aware bracket on the same in-training scale, (0.80, 1.54] nats/token,
docs/results.md "The default loss's bracket"; threshold at its geometric midpoint) applied to each staleness
setup's mismatch (admit below the threshold), against that setup's own seed-aware verdict.

    PYTHONPATH=. python benchmarks/staleness_study.py [--sweep runs/sweeps/testbed_staleness] [--out docs/staleness]
Writes study.json, study.md and study.png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PRECISION_BRACKET = (0.80, 1.54)  # the default loss, seed-aware, in training (docs/results.md, 2026-12-02)
METHODS = ("rkl", "fkl", "default", "sampled_opd", "grpo")


def load(sweep: Path) -> dict[str, dict]:
    out = {}
    for m in METHODS:
        f = sweep / m / "summary.json"
        if f.is_file():
            out[m] = json.loads(f.read_text())
    return out


def rows_of(summaries: dict[str, dict]) -> list[dict]:
    threshold = math.sqrt(PRECISION_BRACKET[0] * PRECISION_BRACKET[1])
    rows = []
    for method, s in summaries.items():
        if s.get("rule") == "broke":  # GRPO: the broke criterion on held-out accuracy (points), no rise
            for st in sorted(s["setups"], key=lambda x: int(x["setup"][1:])):
                runs = {r["seed"]: r for r in s["runs"] if r["setup"] == st["setup"]}
                rows.append({"method": method, "k": int(st["setup"][1:]), "seeds": st["seeds"],
                             "mismatch": st["mismatch"], "rule": "broke",
                             "acc_diff_per_seed": [runs[k]["acc_diff"] for k in sorted(runs)],
                             "acc_ci_per_seed": [[runs[k]["ci_low"], runs[k]["ci_high"]] for k in sorted(runs)],
                             "verdict_per_seed": [runs[k]["verdict"] for k in sorted(runs)],
                             "seed_aware_rise": None, "seed_aware_verdict": None,
                             "screen": "admit" if st["mismatch"] < threshold else "reject", "screen_matches": None})
            continue
        for st in sorted(s["setups"], key=lambda x: int(x["setup"][1:])):
            sa = st.get("seed_aware") or {}
            runs = {r["seed"]: r for r in s["runs"] if r["setup"] == st["setup"]}
            decision = "admit" if st["mismatch"] < threshold else "reject"
            verdict = sa.get("verdict")
            rows.append({
                "method": method, "k": int(st["setup"][1:]), "seeds": st["seeds"], "mismatch": st["mismatch"],
                "rule": "quality",
                "mismatch_per_seed": st["mismatch_per_seed"],
                "rise_per_seed": [runs[k]["rise"] for k in sorted(runs)],
                "verdict_per_seed": [runs[k]["verdict"] for k in sorted(runs)],
                "seed_aware_rise": sa.get("rise"), "seed_aware_ci": [sa.get("rise_ci_low"), sa.get("rise_ci_high")],
                "seed_aware_verdict": verdict, "screen": decision,
                "screen_matches": None if verdict is None else (decision == "admit") == (verdict == "PASS"),
                "bracket_seed_aware": s.get("bracket_seed_aware"),
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| loss | k | mismatch in training (nats/token) | rise per seed (per-run verdict) | seed-aware rise [95% CI] "
             "| seed-aware | screen by the precision budget |", "|---|---:|---:|---|---:|---|---|"]
    for r in rows:
        if r["rule"] == "broke":
            per = " · ".join(f"{100 * d:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}] {v}" for d, (lo, hi), v in
                             zip(r["acc_diff_per_seed"], r["acc_ci_per_seed"], r["verdict_per_seed"]))
            lines.append(f"| {r['method']} | {r['k']} | {r['mismatch']:.3g} | accuracy vs k=0: {per} | — | "
                         f"{'BROKE' if 'BROKE' in r['verdict_per_seed'] else 'OK'} (broke criterion) | "
                         f"{r['screen']} |")
            continue
        per = " · ".join(f"{x:+.0%}{' F' if v == 'FAIL' else ''}" for x, v in zip(r["rise_per_seed"],
                                                                             r["verdict_per_seed"]))
        sa = "—" if r["seed_aware_rise"] is None else \
            f"{r['seed_aware_rise']:+.1%} [{r['seed_aware_ci'][0]:+.1%}, {r['seed_aware_ci'][1]:+.1%}]"
        match = "" if r["screen_matches"] is None else (" ✓" if r["screen_matches"] else " ✗")
        lines.append(f"| {r['method']} | {r['k']} | {r['mismatch']:.3g} | {per} | {sa} | "
                     f"{r['seed_aware_verdict'] or '—'} | {r['screen']}{match} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method and r.get("seed_aware_rise") is not None]
        if not mine:
            continue
        xs = [r["mismatch"] for r in mine]
        ys = [100 * r["seed_aware_rise"] for r in mine]
        lo = [100 * (r["seed_aware_rise"] - r["seed_aware_ci"][0]) for r in mine]
        hi = [100 * (r["seed_aware_ci"][1] - r["seed_aware_rise"]) for r in mine]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, label=method)
        for r in mine:
            ax.annotate(f"k={r['k']}", (r["mismatch"], 100 * r["seed_aware_rise"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(20, color="r", ls="--", lw=1, label="threshold +20%")
    ax.axvspan(*PRECISION_BRACKET, color="tab:orange", alpha=0.15, label="precision bracket (default loss)")
    ax.set_xscale("log")
    ax.set_xlabel("mismatch in training: exact KL(k-stale sampler || trainer), nats/token")
    ax.set_ylabel("seed-aware rise of held-out teacher divergence vs k=0 (%)")
    ax.set_title("staleness as a mismatch (testbed, 2 seeds; bars: 95% CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", default="runs/sweeps/testbed_staleness")
    ap.add_argument("--out", default="docs/staleness")
    args = ap.parse_args()
    rows = rows_of(load(Path(args.sweep)))
    if not rows:
        raise SystemExit(f"{args.sweep}: no finished method summaries (run `jopd sweep ... --analyze-only` first)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(rows)
    decided = [r for r in rows if r["screen_matches"] is not None]
    matches = sum(r["screen_matches"] for r in decided)
    summary = f"screening by the precision budget: {matches} of {len(decided)} setups match their seed-aware verdict"
    (out / "study.json").write_text(json.dumps({"precision_bracket": PRECISION_BRACKET, "rows": rows,
                                                "screen_matches": [matches, len(decided)]}, indent=2))
    (out / "study.md").write_text(md + "\n\n" + summary + "\n")
    plot(rows, out / "study.png")
    print(md)
    print(summary)


if __name__ == "__main__":
    main()
