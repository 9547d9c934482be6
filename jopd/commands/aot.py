"""Size a run before paying for it: ahead-of-time compile one OPD step for a TPU topology and report per-device memory.

    jopd aot configs/qwen3_1p7b_from_8b_v5e.yaml [key=value ...] --topology v5e:4x4 [--out report.json] [--no-cost]

(overrides follow the config directly, before the options)

Compiles the trainer's jitted stages (weight sync, sampler, teacher scoring, train step) from abstract inputs
only (no weights are read: a model path may be a directory holding just config.json, e.g. configs/arch/qwen3-8b)
for the given TPU topology (needs libtpu: pip install 'jopd[tpu]'; no TPU needed) or, without --topology, for
the local devices. Prints per-device memory per stage; exits with an error if a stage does not fit in HBM.

With --topology it also prints the step on paper (`jopd.sizing.roofline`): per stage XLA's FLOPs and bytes per device
from loop-free cost programs, the bytes its collectives send over ICI, the predicted time on the chip's peaks (its
compute/HBM bound plus its collectives, not overlapped; and with them overlapped), the predicted step time, rollout
tokens/s per chip and MFU. The cost programs (one prefill and one decode step; the scoring and the update each as
one program with its layers and loss chunks unrolled; the sampler program of the memory pass reused for the
prefill) take longer to compile than the stages themselves (timings in docs/performance.md): --no-cost skips them,
--stages compiles and costs only the stages named. Every program is lowered first, then compiled on
--compile-threads threads (default: the cores, at most 4), the largest first, the memory pass's and the cost
programs side by side (a TPU compile runs mostly on one core).

With rollout.placement=disaggregated (and rollout.sampler_devices=N) it sizes the split: the weight sync and the
sampler on the first N devices of the topology, scoring and the update on the rest, each stage's memory per device
of its own side; with --topology the roofline adds the weight transfer and the rollout's copy back (ICI) and
predicts the step as the longer side when rollout.staleness >= 1 (the next rollout runs beside the update), the
sum at 0. Run it beside the colocated config to compare (step tokens/s per chip of the slice).

With --sampler-layouts "data=-1 ; data=-1,tensor=4" it compares where the sampler runs (`sampling.mesh`, a mesh over
the same devices; `trainer` is the trainer's own mesh): for each candidate it compiles the weight sync (the trainer's
layout resharded into the candidate's) and the sampler's program (and, with --topology, their cost programs: one
prefill and one decode step each), prints each candidate's report, then one row per candidate: peak GiB per chip,
whether it fits, the predicted weight sync and sample times, rollout tok/s per chip, and marks the fastest that fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jopd.sizing.aot import LAYOUT_STAGES, STAGES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.batch_size=128 mesh.tensor=2")
    p.add_argument("--topology", default=None,
                   help="TPU topology to compile for, as libtpu names it: v5e:2x2, v5e:4x4 (v5litepod-16), "
                        "v5p:2x2x2 (v5p-16), v4:2x2x1, v6e:4x4 (default: the local devices)")
    p.add_argument("--out", default=None, help="also write the report as JSON (bytes per device) to this file")
    p.add_argument("--stages", default=None,
                   help=f"comma-separated subset of {','.join(STAGES)}: only these are compiled and costed (default: "
                        f"all; with --sampler-layouts: {','.join(LAYOUT_STAGES)})")
    p.add_argument("--sampler-layouts", default=None, metavar="LAYOUTS",
                   help="compare sampler layouts (sampling.mesh): candidates separated by ';', each axis=size pairs "
                        "separated by ',', or 'trainer' (the trainer's mesh), e.g. \"trainer ; data=-1,tensor=4\". "
                        "Compiles the weight sync and the sampler program (with --topology also their cost "
                        "programs) once per candidate, and prints a row per candidate (peak GiB per chip, fits, "
                        "predicted weight sync and sample s, rollout tok/s per chip) with the fastest that fits marked")
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="HBM per device in GiB (default: from the device kind; unknown kinds are not checked)")
    p.add_argument("--compile-threads", type=int, default=None, metavar="N",
                   help="programs compiled at once (default: the cores this process may use, at most 4): the memory "
                        "pass's stages and the cost programs compile side by side, the largest first; each large "
                        "compile holds GBs of host memory")
    p.add_argument("--no-cost", action="store_true",
                   help="with --topology: skip the roofline (XLA's cost analysis and collectives of loop-free "
                        "cost programs, the predicted step time, rollout tokens/s per chip, MFU): the scoring and "
                        "update compiled again with their layers and loss chunks unrolled, and one prefill and "
                        "decode step (use --stages to cost only some)")


def run(args: argparse.Namespace) -> int:
    import jax

    if args.topology is not None and not os.environ.get("JAX_PLATFORMS"):
        # The topology supplies the compile target; the host backend only traces. On a TPU VM this also
        # keeps the tool off chips that a training run may be using.
        jax.config.update("jax_platforms", "cpu")
    from jopd.run.config import load_config
    from jopd.sizing.aot import compare_sampler_layouts, compile_opd_step, parse_sampler_layouts
    from jopd.sizing.report import check_fits, layout_table
    from jopd.sizing.topology import topology_devices

    cfg = load_config(args.config, args.overrides)  # validation errors surface before any compile
    layouts = None if args.sampler_layouts is None else parse_sampler_layouts(args.sampler_layouts)
    default = LAYOUT_STAGES if layouts is not None else STAGES
    stages = [s.strip() for s in (args.stages or ",".join(default)).split(",") if s.strip()]
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        raise ValueError(f"--hbm-gib: must be positive, got {args.hbm_gib}")
    devices = topology_devices(args.topology) if args.topology else None
    options = {"target": args.topology or "local", "stages": stages,
               "hbm_bytes": None if args.hbm_gib is None else int(args.hbm_gib * (1 << 30)),
               "progress": sys.stderr.isatty(), "cost": args.topology is not None and not args.no_cost,
               "compile_threads": args.compile_threads}
    if layouts is not None:
        rows = compare_sampler_layouts(cfg, layouts, devices, **options)
        for row in rows:
            if row.report is not None:
                print(f"== sampler layout {row.name} ==")
                print(row.report.table())
        print(layout_table(rows))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({r.name: r.report.to_dict() if r.report else {"error": r.error} for r in rows}, f, indent=2)
            print(f"wrote {args.out}")
        if not any(r.fits for r in rows):
            raise ValueError("--sampler-layouts: no candidate fits (see the rows above)")
        return 0
    report = compile_opd_step(cfg, devices, **options)
    print(report.table())
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.to_json() + "\n")
        print(f"wrote {args.out}")
    check_fits(report)
    return 0
