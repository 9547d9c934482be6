"""Held-out accuracy of a config's teacher, sampled at the run's settings and greedy (builds and caches the
teacher and student first, as `jopd train` would).

    python benchmarks/teacher_accuracy.py configs/testbed_long.yaml [key=value ...] [--problems N]

Prints one JSON line per teacher and mode: accuracy (per task with `data.mix`), mean response length, and the
first responses.
"""

import argparse
import dataclasses
import json
import time

import jax

from jopd.data.mixture import task_sources
from jopd.run.evaluate import evaluate_heldout
from jopd.run.loop import build
from jopd.opd.routing import Routing
from jopd.run.config import load_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--problems", type=int, default=None, help="held-out problems (default: train.eval_problems)")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    t0 = time.perf_counter()
    run, _ = build(cfg)
    print(json.dumps({"build_s": round(time.perf_counter() - t0, 1)}), flush=True)
    params = jax.device_get(run.teacher_params)
    tasks = tuple(s.name for s in task_sources(cfg.data))
    for src, teacher, t_cfg in zip(cfg.teacher_sources(), params, run.step.teacher_cfgs):  # each on every task
        name = src.name
        for greedy in (False, True):
            t1 = time.perf_counter()
            s = dataclasses.replace(cfg.sampling, max_new_tokens=cfg.train.eval_max_new_tokens, greedy=greedy)
            res = evaluate_heldout(teacher, (teacher,), s_cfg=t_cfg, t_cfgs=(t_cfg,), tokenizer=run.tokenizer,
                                   data_cfg=cfg.data, sampling=s, seed=cfg.train.eval_seed,
                                   routing=Routing.one(name, tasks),
                                   max_problems=args.problems or cfg.train.eval_problems)
            print(json.dumps({"teacher": name, "mode": "greedy" if greedy else "sampled", **res.summary(),
                              "examples": res.responses[:3], "eval_s": round(time.perf_counter() - t1, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
