"""`jopd aot`'s own time on a <= 1B config ([PS] item 6: sizing and costing must take <= 4 minutes on a quiet
2-core machine): the Qwen3 v5e config's shapes (64 prompts x 512 new tokens, prompts of 256) with a Qwen2.5-0.5B
student and teacher, data-parallel over a v5e:2x2 topology. Runs `jopd aot` as a new user would (a fresh process
each: imports, libtpu, every compile), with and without the cost programs, on 2 compile threads and on 1
(`--compile-threads`), and prints one table: wall and CPU seconds, the memory pass's and the cost programs' compile
seconds (from the report JSON: each program's own, so with 2 threads they overlap and add up to more than the
wall), and the target check.

    PYTHONPATH=. python benchmarks/aot_time.py [--topology v5e:2x2] [--runs cost:2,cost:1,no-cost:2] [--out FILE]

Needs libtpu (pip install 'jopd[tpu]'). Run it on a quiet machine: the compiles use every core they get.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/qwen3_1p7b_from_8b_v5e.yaml"
OVERRIDES = ["student.path=configs/arch/qwen2.5-0.5b-instruct", "teacher.path=configs/arch/qwen2.5-0.5b-instruct",
             "mesh.data=-1", "mesh.fsdp=1", "sampling.mesh=null"]  # the sampler on the trainer's data-parallel mesh
TARGET_S = 240.0


def run_aot(topology: str, cost: bool, threads: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "jopd.cli", "aot", CONFIG, *OVERRIDES, "--topology", topology, "--out", str(out),
           "--compile-threads", str(threads)]
    if not cost:
        cmd.append("--no-cost")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"jopd aot failed ({done.returncode}):\n{done.stderr[-2000:]}")
    report = json.loads(out.read_text())
    roofline = report.get("roofline") or {}
    return {"run": "cost" if cost else "no-cost", "threads": threads, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "memory_pass_s": sum(s["compile_s"] for s in report["stages"]),
            "cost_programs_s": roofline.get("compile_s", 0.0),
            "step_s": roofline.get("step_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--runs", default="cost:2,cost:1,no-cost:2",
                   help="comma-separated RUN:THREADS, RUN cost or no-cost, THREADS the --compile-threads")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in [r.strip() for r in args.runs.split(",") if r.strip()]:
            name, _, threads = item.partition(":")
            if name not in ("cost", "no-cost") or not threads.isdigit() or int(threads) < 1:
                raise SystemExit(f"--runs: {item!r} is not RUN:THREADS (cost:2, no-cost:1, ...)")
            rows.append(run_aot(args.topology, name == "cost", int(threads), Path(tmp) / f"{name}{threads}.json"))
            print(f"{item}: {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"jopd aot on a Qwen2.5-0.5B student and teacher, {args.topology}, {os.cpu_count()} CPUs; target <= "
          f"{TARGET_S:.0f} s for sizing and costing")
    print(f"{'run':8} {'threads':>7} {'wall s':>7} {'CPU s':>7} {'memory pass s':>13} {'cost programs s':>15} "
          f"{'step s':>7}  target")
    for r in rows:
        ok = "met" if r["wall_s"] <= TARGET_S else "missed"
        step = f"{r['step_s']:.3f}" if r["step_s"] else "-"
        print(f"{r['run']:8} {r['threads']:7d} {r['wall_s']:7.0f} {r['cpu_s']:7.0f} {r['memory_pass_s']:13.0f} "
              f"{r['cost_programs_s']:15.0f} {step:>7}  {ok if r['run'] == 'cost' else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
