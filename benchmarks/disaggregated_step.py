"""Wall time per OPD step, the sampler on the trainer's devices (colocated) vs on devices of its own
(`rollout.placement=disaggregated`) vs in a worker process of its own (`rollout.placement=process`: its own
process and XLA runtime, the same 8 devices), with and without staleness, in one run on 8 devices (8 simulated
CPU devices here: `--xla_force_host_platform_device_count=8`).

Per setup: the median time of a step dispatched as `jopd train`'s loop dispatches it (step n+1 dispatched before
step n's metrics are read: what lets the sampler's program of step n+1 run beside the update of step n), and, from
blocked stage calls, the rollout (weight sync + sampler) and the scoring + update alone. Serial = their sum;
pipelined ideal = their max; overlap = (serial - measured) / (serial - ideal): 0 when nothing ran at the same time,
1 when the two sides overlapped perfectly. The setups' steps are interleaved in rounds so that a shared machine's
drift hits all of them.

    PYTHONPATH=. python benchmarks/disaggregated_step.py [--config configs/testbed.yaml] [--steps 20] [--rounds 3]
Writes disaggregated_step.json under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jopd.data.pipeline import train_iterator  # noqa: E402
from jopd.opd import staleness as stale  # noqa: E402
from jopd.run.config import load_config  # noqa: E402
from jopd.run.loop import build  # noqa: E402

SPLIT = ["rollout.placement=disaggregated", "rollout.sampler_devices=4"]
SETUPS = {  # name -> overrides
    "colocated k=0": ["rollout.staleness=0"],
    "colocated k=1": ["rollout.staleness=1"],
    "disaggregated 4+4 k=0": ["rollout.staleness=0", *SPLIT],
    "disaggregated 4+4 k=1": ["rollout.staleness=1", *SPLIT],
    "process k=0": ["rollout.staleness=0", "rollout.placement=process"],
    "process k=1": ["rollout.staleness=1", "rollout.placement=process"],
}


class Bench:
    def __init__(self, config: str, overrides: list[str], out_dir: Path):
        self.cfg = load_config(config, ["train.log_rollouts=0", f"train.out_dir={out_dir}", *overrides])
        self.run, self.state = build(self.cfg, log=lambda *_: None)
        self.data = train_iterator(self.cfg.data, self.run.tokenizer, kind="prompt")
        self.t = 0
        self.loop_s: list[float] = []
        self.rollout_s: list[float] = []
        self.update_s: list[float] = []

    def loop_steps(self, n: int) -> None:
        """n steps dispatched as the loop does; the time of each, from one dispatch to the next."""
        opd, prev = self.run.step, None
        jax.block_until_ready(self.state)
        for _ in range(n):
            t0 = time.perf_counter()
            with jax.set_mesh(opd.mesh):
                self.state, metrics, _ = opd(self.state, self.run.teacher_params, next(self.data), self.t)
            if prev is not None:
                jax.device_get(prev)  # step n-1's metrics, read while step n runs
            prev, self.t = metrics, self.t + 1
            self.loop_s.append(time.perf_counter() - t0)
        jax.block_until_ready((self.state, prev))

    def stage_steps(self, n: int) -> None:
        """n steps with each side blocked on its own: the rollout, then the scoring and the update."""
        opd, k = self.run.step, self.cfg.rollout.staleness
        for _ in range(n):
            batch = next(self.data)
            with jax.set_mesh(opd.mesh):
                t0 = time.perf_counter()
                if k:
                    rollout = opd.rollout(self.state, batch, self.t, self.state.policies[0],
                                          stale.policy_step(self.t, k)).block_until_ready()
                else:
                    rollout = opd.rollout(self.state, batch, self.t).block_until_ready()
                t1 = time.perf_counter()
                scored = opd.score(self.run.teacher_params, rollout)
                core, window = stale.split_window(self.state) if k else (self.state, None)
                if k:  # the step's own window update: a copy of this step's params in, the oldest out
                    window = window[1:] + (opd.copy_fn(core.params),)
                    rng = jax.device_put(core.rng, core.rng.sharding, may_alias=False)
                core, _ = jax.block_until_ready(opd.update(core, scored, self.run.teacher_params))
                self.state = stale.with_policies(core.replace(rng=rng), window) if k else core
                t2 = time.perf_counter()
            self.rollout_s.append(t1 - t0)
            self.update_s.append(t2 - t1)
            self.t += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/testbed.yaml")
    ap.add_argument("--steps", type=int, default=20, help="steps per setup per round (loop, then blocked stages)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="jopd-disagg-"))  # the process placement's exchange directories
    benches = {name: Bench(args.config, over, scratch / f"run{i}") for i, (name, over) in enumerate(SETUPS.items())}
    for b in benches.values():  # compile every program once
        b.loop_steps(2)
        b.stage_steps(2)
        b.loop_s, b.rollout_s, b.update_s = [], [], []
    for r in range(args.rounds):
        for name, b in benches.items():
            b.loop_steps(args.steps)
            b.stage_steps(args.steps)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for b in benches.values():
        if b.run.step.remote is not None:  # the sampler processes end here
            b.run.step.remote.close()
    rows = []
    for name, b in benches.items():
        step, ro, up = (float(np.median(x)) for x in (b.loop_s, b.rollout_s, b.update_s))
        serial, ideal = ro + up, max(ro, up)
        overlap = (serial - step) / (serial - ideal) if serial > ideal else float("nan")
        rows.append({"setup": name, "step_s": step, "rollout_s": ro, "score_update_s": up, "serial_s": serial,
                     "pipelined_ideal_s": ideal, "overlap": overlap})
    base = rows[0]["step_s"]
    print(f"\n{'setup':24s} {'step ms':>8s} {'vs coloc k=0':>12s} {'rollout ms':>10s} {'score+upd ms':>12s} "
          f"{'serial ms':>9s} {'ideal ms':>8s} {'overlap':>7s}")
    for r in rows:
        print(f"{r['setup']:24s} {1e3 * r['step_s']:8.1f} {base / r['step_s']:11.2f}x {1e3 * r['rollout_s']:10.1f} "
              f"{1e3 * r['score_update_s']:12.1f} {1e3 * r['serial_s']:9.1f} {1e3 * r['pipelined_ideal_s']:8.1f} "
              f"{r['overlap']:7.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "steps": args.steps, "rounds": args.rounds, "devices": jax.device_count(),
            "platform": jax.devices()[0].platform, "cpus": os.cpu_count(), "jax": jax.__version__}
    (out / "disaggregated_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out / 'disaggregated_step.json'}")


if __name__ == "__main__":
    main()
