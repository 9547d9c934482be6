"""The per-stage table of one or more `jopd aot --topology ... --out report.json` reports, as markdown (the tables of
docs/performance.md): per device, XLA's FLOPs (+ the fp32 matmuls' extra MXU passes) and HBM bytes, the bytes its
collectives send over ICI and their time, the predicted time and its bound, the stage's MFU (its model FLOPs over
the slice's peak for the predicted time) and HBM utilization (HBM time over predicted time); then the step.

    python benchmarks/aot_table.py before=llama_before.json after=llama_after.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def stage_rows(roofline: dict) -> list[str]:
    chips, peak = roofline["chips"], roofline["peak_flops_per_chip"]
    sampler = set(roofline.get("sampler_stages") or ())
    own = roofline.get("sampler_devices") or 0
    rows = []
    for s in roofline["stages"]:
        if s.get("error") or s.get("time_s") is None:
            rows.append(f"| {s['name']} | not costed: {s.get('error')} | | | | | | | |")
            continue
        # disaggregated: a stage runs on its own side's chips (`sampler_devices` counts devices, not chips)
        devices = chips * roofline["devices_per_chip"]
        n = (own if s["name"] in sampler else devices - own) / roofline["devices_per_chip"] if own else chips
        mfu = s["model_flops"] / (n * peak * s["time_s"]) if s["time_s"] and s.get("model_flops") else 0.0
        passes = f" (+{s['extra_pass_flops'] / 1e9:,.0f})" if s.get("extra_pass_flops") else ""
        rows.append(f"| {s['name']} | {s['flops'] / 1e9:,.0f}{passes} | {s['bytes'] / 1e9:,.1f} | "
                    f"{s['ici_bytes'] / 1e9:,.2f} | {s['ici_s']:.3f} | {s['time_s']:.3f} | {s['bound']} | "
                    f"{mfu:.1%} | {s['hbm_s'] / s['time_s']:.0%} |")
    return rows


def table(label: str, report: dict) -> str:
    r = report["roofline"]
    head = [f"**{label}** ({report['num_devices']} × {report['device_kind']}, mesh {report['mesh']}"
            + (f", sampler mesh {report['sampler_mesh']}" if report.get("sampler_mesh") else "") + ")", "",
            "| stage | GFLOP (+passes) | GB | ICI GB | ICI s | predicted s | bound | MFU | HBM util |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    step = (f"step {r['step_s']:.3f} s ({r['step_overlapped_s']:.3f} s collectives hidden), "
            f"{r['rollout_tokens']:,} rollout tokens, {r['step_tokens_per_s_per_chip']:.0f} tok/s per chip of the "
            f"slice, MFU {r['mfu']:.1%}") if r.get("step_s") else "step: not predicted (a stage was not costed)"
    return "\n".join(head + stage_rows(r) + ["", step])


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for item in argv:
        label, _, path = item.rpartition("=")
        report = json.loads(Path(path).read_text())
        if not report.get("roofline"):
            raise SystemExit(f"{path}: no roofline (run jopd aot with --topology and without --no-cost)")
        print(table(label or Path(path).stem, report) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
