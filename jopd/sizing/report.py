"""What `jopd aot` reports: per-device memory of each compiled stage (XLA's `memory_analysis()`), the buffers
other stages hold meanwhile, whether the step fits the devices' HBM, and the roofline table."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jopd.sizing.roofline import Cost, Roofline
from jopd.sizing.topology import (
    GiB,
)


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one compiled program, from XLA's `memory_analysis()`."""

    argument: int
    output: int
    alias: int  # outputs written into donated arguments (counted once)
    temp: int
    generated_code: int

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp + self.generated_code

    @classmethod
    def of(cls, compiled) -> "StageMemory":
        m = compiled.memory_analysis()
        return cls(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
                   alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes),
                   generated_code=int(m.generated_code_size_in_bytes))


@dataclasses.dataclass
class StageReport:
    name: str
    memory: StageMemory | None  # None when the compiler itself refused the program (out of memory)
    resident: dict[str, int]  # bytes per device of other stages' buffers alive meanwhile, by buffer
    compile_s: float
    error: str | None = None
    cost: Cost | None = None  # XLA's cost of this (looped) program: loop bodies counted once (not reported)

    @property
    def peak(self) -> int | None:
        return None if self.memory is None else self.memory.total + sum(self.resident.values())

    def to_dict(self) -> dict[str, Any]:
        mem = dataclasses.asdict(self.memory) | {"total": self.memory.total} if self.memory else None
        return {"name": self.name, "memory": mem, "resident": self.resident,
                "resident_total": sum(self.resident.values()), "peak": self.peak,
                "compile_s": round(self.compile_s, 2), "error": self.error}


@dataclasses.dataclass
class AotReport:
    target: str  # topology name, or "local"
    device_kind: str
    num_devices: int
    devices_per_chip: int
    hbm_per_device: int | None
    mesh: dict[str, int]
    models: dict[str, dict[str, Any]]
    shapes: dict[str, int]
    buffers: dict[str, int]  # long-lived buffers, bytes per device
    stages: list[StageReport]
    roofline: Roofline | None = None  # the predicted time (compile_opd_step(cost=True))
    sampler_mesh: dict[str, int] | None = None  # the sampler's mesh (`sampling.mesh`; None: the trainer's)
    sampler_devices: int = 0  # disaggregated (`opd.placement`): the first ones are the sampler's own; 0: colocated
    compile_threads: int = 1  # programs compiled at once (`sizing.compile_pool`)
    wall_s: float = 0.0  # the whole report's time: lowering and every compile, the memory pass's and the cost's
    notes: list[str] = dataclasses.field(default_factory=list)  # what a stage's program is, where not the default

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        d["fits"] = not self.failures()
        d["roofline"] = None if self.roofline is None else self.roofline.to_dict()
        if not self.notes:  # a default run's report as before
            del d["notes"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def failures(self) -> list[str]:
        """One line per stage that does not fit (compiler refusal, or peak above the HBM budget)."""
        out = []
        where = f"{self.device_kind} ({self.target})"
        for s in self.stages:
            if s.error is not None:
                out.append(f"stage {s.name}: the compiler rejected it for {where}: {s.error}")
            elif self.hbm_per_device is not None and s.peak > self.hbm_per_device:
                out.append(f"stage {s.name}: needs {gib(s.peak)} GiB per device (program {gib(s.memory.total)} + "
                           f"held by other stages {gib(sum(s.resident.values()))}) > {gib(self.hbm_per_device)} "
                           f"GiB HBM of {where}")
        return out

    def table(self) -> str:
        biggest = max([s.peak or 0 for s in self.stages] + list(self.buffers.values()) + [1])
        unit, scale = ("GiB", GiB) if biggest >= GiB // 4 else ("MiB", 1 << 20)
        num = lambda n: "-" if n is None else f"{n / scale:.2f}"  # noqa: E731
        hbm = f"{self.hbm_per_device / GiB:.2f} GiB HBM per device" if self.hbm_per_device else "HBM unknown"
        chips = f", {self.devices_per_chip} devices per chip" if self.devices_per_chip > 1 else ""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"target {self.target}: {self.num_devices} x {self.device_kind} ({hbm}{chips}), mesh {mesh}"]
        if self.sampler_mesh is not None:
            lines[0] += ", sampler mesh " + " ".join(f"{k}={v}" for k, v in self.sampler_mesh.items())
        if self.sampler_devices:
            lines.append(f"disaggregated: the sampler (weight_sync, sample) on devices 0..{self.sampler_devices - 1}, "
                         f"the trainer (mesh above) on {self.sampler_devices}..{self.num_devices - 1}; each stage's "
                         f"memory is per device of its own side")
        for role, m in self.models.items():
            placed = f", {m['placement']} ({num(m['bytes_per_device'])} {unit} per device)" if "placement" in m else ""
            lines.append(f"{role}: {m['family']} {m['params'] / 1e9:.3f}B params, {m['dtype']}, {m['source']}{placed}")
        lines.append("shapes: " + " ".join(f"{k}={v}" for k, v in self.shapes.items()))
        lines.append(f"long-lived buffers per device ({unit}): "
                     + ", ".join(f"{k} {num(v)}" for k, v in self.buffers.items()))
        head = ("stage", "argument", "output", "alias", "temp", "code", "total", "+held", "=peak", "HBM", "fits")
        rows = [head]
        hbm_cell = num(self.hbm_per_device)
        for s in self.stages:
            if s.memory is None:
                rows.append((s.name, *["-"] * 8, hbm_cell, "NO"))
                continue
            m = s.memory
            fits = "-" if self.hbm_per_device is None else ("yes" if s.peak <= self.hbm_per_device else "NO")
            rows.append((s.name, *(num(x) for x in (m.argument, m.output, m.alias, m.temp, m.generated_code,
                                                    m.total, sum(s.resident.values()), s.peak)), hbm_cell, fits))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths)))
        lines.append(f"per-device memory ({unit}); +held = buffers of other stages alive meanwhile:")
        lines += [fmt(r) for r in rows]
        lines += [f"  {s.name}: {s.error}" for s in self.stages if s.error]
        lines += [f"note: {n}" for n in self.notes]
        if self.roofline is not None:
            lines.append(self.roofline.table())
        if self.wall_s:
            lines.append(f"compiled in {self.wall_s:.1f} s, {self.compile_threads} program"
                         f"{'s' if self.compile_threads > 1 else ''} at once (--compile-threads)")
        return "\n".join(lines)


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def check_fits(report: AotReport) -> None:
    """Raise ValueError listing every stage that does not fit the devices' HBM."""
    failures = report.failures()
    if failures:
        raise ValueError("does not fit: " + "; ".join(failures) + ". Use more chips (a larger fsdp axis), a "
                         "smaller data.batch_size or sequence lengths, optim.grad_accum_steps, bf16 weights")


@dataclasses.dataclass
class LayoutRow:
    """One candidate sampler layout (`--sampler-layouts`): its report, or why the run refuses it."""

    name: str
    report: AotReport | None
    error: str | None = None

    @property
    def sampler_mesh(self) -> dict[str, int]:
        if self.report is None:
            return {}
        return self.report.mesh if self.report.sampler_mesh is None else self.report.sampler_mesh

    @property
    def peak_per_chip(self) -> int | None:
        """The highest peak of its compiled stages, per chip (a chip's devices together)."""
        peaks = [s.peak for s in self.report.stages if s.peak is not None] if self.report else []
        return max(peaks) * self.report.devices_per_chip if peaks else None

    @property
    def fits(self) -> bool:
        return self.report is not None and not self.report.failures()

    @property
    def seconds(self) -> float | None:
        """Predicted seconds of its stages in sequence (weight sync + sample), or None without a roofline."""
        r = self.report.roofline if self.report else None
        return None if r is None else r.step_s


def layout_table(rows: list[LayoutRow]) -> str:
    """One line per candidate sampler layout: peak GiB per chip, whether it fits, the predicted weight sync and
    sample times, rollout tok/s per chip; `<- fastest` on the quickest (weight sync + sample) of those that fit."""
    ranked = [r for r in rows if r.fits and r.seconds is not None]
    best = min(ranked, key=lambda r: r.seconds) if ranked else None
    head = ("sampler layout", "mesh", "peak GiB/chip", "fits", "weight_sync s", "sample s", "=s", "rollout tok/s/chip",
            "")
    table = [head]
    for r in rows:
        roof = r.report.roofline if r.report else None
        sync, sample, tok = (None, None, None) if roof is None else (
            roof.stage_seconds("weight_sync"), roof.stage_seconds("sample"), roof.rollout_tokens_per_s_per_chip)
        mesh = " ".join(f"{k}={v}" for k, v in r.sampler_mesh.items()) or "-"
        table.append((r.name, mesh, _fmt(None if r.peak_per_chip is None else r.peak_per_chip / GiB, "{:.3g}"),
                      "yes" if r.fits else "NO", _fmt(sync), _fmt(sample), _fmt(r.seconds), _fmt(tok, "{:.0f}"),
                      "<- fastest" if r is best else ""))
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    lines = ["sampler layouts (sampling.mesh), each compiled on the same devices:"]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))).rstrip()
              for t in table]
    lines += [f"  {r.name}: {r.error}" for r in rows if r.error]
    if not any(r.report is not None and r.report.roofline is not None for r in rows):
        lines.append("  (no roofline: compile for a --topology, without --no-cost, to rank them by time)")
    return "\n".join(lines)


def _fmt(x: float | None, spec: str = "{:.4g}") -> str:
    return "-" if x is None else spec.format(x)
