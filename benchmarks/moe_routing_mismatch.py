"""Routing mismatch of a mixture-of-experts testbed student, with and without routing replay ([MoE] item 5).

    PYTHONPATH=. python benchmarks/moe_routing_mismatch.py [--out docs/moe_routing] [--seeds 0 1]

For each warm-start seed (student.warm_start.seed: a different SFT'd MoE student), each rollout engine (bf16
compute; logit noise 0.5) and routing replay off/on, runs `jopd mismatch configs/testbed_moe.yaml` (4 batches of
32 prompts, the warm-started student, no OPD training) and keeps its JSON; a measurement already on disk is reused.
Then prints the table (exact KL and routing flips with 95% bootstrap CIs over prompts) and writes routing.png.
Replay changes only the trainer's forward: the sampler's prompts, draws and tokens are the same with it on or off.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ENGINES = {"bf16": "rollout_precision.compute_dtype=bf16", "noise0.5": "rollout_precision.logit_noise=0.5"}


def measure(out: Path, seed: int, engine: str, replay: bool) -> dict:
    path = out / f"seed{seed}_{engine}_replay{int(replay)}.json"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "jopd.cli", "mismatch", "configs/testbed_moe.yaml", ENGINES[engine],
                        f"train.routing_replay={str(replay).lower()}", f"student.warm_start.seed={seed}",
                        "--batches", "4", "--json", str(path)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def ci(d: dict, key: str, scale: float = 1.0) -> tuple[float, float, float]:
    return d[key]["mean"] * scale, d[key]["ci_low"] * scale, d[key]["ci_high"] * scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/moe_routing")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [(s, e, r) for s in args.seeds for e in ENGINES for r in (False, True)]
    results = {c: measure(out, *c) for c in tqdm(cells, desc="jopd mismatch")}
    print("| engine | seed | replay | tokens | exact KL nats/token [95% CI] | router flips % [CI] | token flips % [CI] |")
    print("|---|---:|---|---:|---|---|---|")
    for (s, e, r), d in results.items():
        kl, rf, tf = ci(d, "exact_kl"), ci(d, "router_flip_frac", 100), ci(d, "token_flip_frac", 100)
        print(f"| {e} | {s} | {'on' if r else 'off'} | {d['n_tokens']} | {kl[0]:.2e} [{kl[1]:.2e}, {kl[2]:.2e}] | "
              f"{rf[0]:.2f} [{rf[1]:.2f}, {rf[2]:.2f}] | {tf[0]:.2f} [{tf[1]:.2f}, {tf[2]:.2f}] |")
    plot(results, args.seeds, out / "routing.png")


def plot(results: dict, seeds: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ENGINES), figsize=(9, 3.6))
    for ax, engine in zip(axes, ENGINES):
        for i, s in enumerate(seeds):
            for j, replay in enumerate((False, True)):
                m, lo, hi = ci(results[(s, engine, replay)], "exact_kl")
                x = i * 3 + j
                ax.bar(x, m, color="tab:orange" if replay else "tab:blue",
                       label=("replay on" if replay else "replay off") if i == 0 else None)
                ax.errorbar(x, m, yerr=[[m - lo], [hi - m]], color="k", capsize=3)
        ax.set_xticks([i * 3 + 0.5 for i in range(len(seeds))], [f"seed {s}" for s in seeds])
        ax.set_yscale("log")
        ax.set_title(f"engine: {engine}")
        ax.set_ylabel("exact KL(sampler || trainer), nats/token")
        ax.legend(fontsize=8)
    fig.suptitle("MoE testbed student (8 experts, top 2): routing replay and the exact mismatch", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
