"""TPU on paper: a roofline prediction of one OPD step from XLA's cost analysis and a table of chip peaks.

Each stage's time is the sum over its cost programs (`jopd.sizing.cost.cost_programs`: loop-free programs lowered
with the stage's shardings, each run `count` times) of max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), per
device, from `compiled.cost_analysis()`. The stages run one after another, so the step is their sum. Matmuls
with float32 operands at Precision.HIGHEST (the fp32 trainer's and the teacher scoring's) run as 6 bf16 passes
on the MXU and HIGH as 3 (XLA's BF16_BF16_F32_X6 / _X3 algorithms); XLA counts their FLOPs once, so the extra
passes are added from the lowered StableHLO (`dot_flops_by_passes`).

Attention that XLA cannot see (a Pallas kernel's custom call, the chunked entry's loops) is added on paper
(`jopd.sizing.attention_cost`, an `attention[...]` part of its stage).

Communication: every collective of a cost program (`jopd.sizing.collectives`: bytes each device sends, ring
steps) is timed on the chip's ICI (`ICI`): bytes / the bandwidth of a bidirectional ring along one torus axis
(the chip's ICI bandwidth / its ports: two ports, one direction each) + steps x a per-hop latency. A stage's time
is its compute/HBM bound plus that communication, not overlapped (a conservative bound: XLA overlaps async
collectives with compute where it can); the bound with every collective hidden under compute/HBM is reported
beside it (`overlapped`).

What the prediction leaves out: host work and dispatch between stages, the loops' own control, overlap of
stages, a collective over several torus axes using more links, and compiler efficiency (the compute/HBM part is
a lower bound: 100% of peak FLOP/s or HBM bandwidth, whichever binds).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jopd.sizing.collectives import collectives


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """A chip's ICI: bidirectional bandwidth per chip over its ports, the latency of one ring step, and where the
    figures come from."""

    bytes_per_s: float
    ports: int
    hop_s: float
    source: str

    @property
    def ring_bytes_per_s(self) -> float:
        """What one device sends per second in a bidirectional ring along one torus axis: two of its ports, one
        direction each, i.e. the chip's bidirectional bandwidth / its ports."""
        return self.bytes_per_s / self.ports


# Per-chip bidirectional ICI bandwidth and ports: Google Cloud's TPU pages (v5e: 400 GB/s, 4 ports; v5p:
# 1200 GB/s, 6 ports (3D torus); v6e: 800 GB/s, 4 ports). v4's page gives no per-chip figure: 6 ports (3D torus)
# x 90 GB/s bidirectional per link (45 GB/s each way, the JAX scaling book's "How to think about TPUs" table) is
# an assumption. HOP_S, 1 us per ring step (link latency plus the step's synchronisation), is an assumption for
# every chip (no published figure): it only matters for small collectives.
HOP_S = 1e-6
ICI: dict[str, Interconnect] = {
    "v4": Interconnect(540e9, 6, HOP_S, "assumed: 6 links x 2 x 45 GB/s (jax-ml.github.io/scaling-book/tpus)"),
    "v5e": Interconnect(400e9, 4, HOP_S, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Interconnect(1200e9, 6, HOP_S, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Interconnect(800e9, 4, HOP_S, "https://cloud.google.com/tpu/docs/v6e"),
}


@dataclasses.dataclass(frozen=True)
class ChipPeak:
    """Per-chip peaks: dense bf16 matmul FLOP/s and HBM bytes/s, with where the figures are published; the ICI."""

    flops: float
    hbm_bytes_per_s: float
    source: str
    ici: Interconnect | None = None


CHIP_PEAKS: dict[str, ChipPeak] = {
    "v4": ChipPeak(275e12, 1200e9, "https://cloud.google.com/tpu/docs/v4", ICI["v4"]),
    "v5e": ChipPeak(197e12, 819e9, "https://cloud.google.com/tpu/docs/v5e", ICI["v5e"]),
    "v5p": ChipPeak(459e12, 2765e9, "https://cloud.google.com/tpu/docs/v5p", ICI["v5p"]),
    "v6e": ChipPeak(918e12, 1638e9, "https://cloud.google.com/tpu/docs/v6e", ICI["v6e"]),
}
# MXU passes of a float32 x float32 matmul by StableHLO precision (DEFAULT: one bf16 pass)
F32_PASSES: dict[str, int] = {"DEFAULT": 1, "HIGH": 3, "HIGHEST": 6}


def program_loops(hlo_text: str) -> int:
    """The while loops of a compiled program that its own code holds (scan, fori, while: JAX names each `while`),
    not those XLA:CPU's loop emitters make of a scatter (named after the scatter, or after an add XLA merged it
    with: a TPU scatters natively; a CPU compile of the same step expands it). A loop without a name counts."""
    loops = 0
    for line in re.findall(r"^.*\swhile\(.*$", hlo_text, re.M):
        op = re.search(r'op_name="([^"]*)"', line)
        loops += not op or op.group(1).rsplit("/", 1)[-1] == "while"
    return loops


@dataclasses.dataclass(frozen=True)
class Cost:
    """One compiled program, per device: XLA's FLOPs and bytes accessed, the MXU's extra bf16 passes for fp32
    matmuls (as FLOPs), the while loops left in it (XLA counts a loop body once), and its collectives: the bytes
    a device sends over ICI and the ring steps they take (`collectives.collectives`)."""

    flops: float
    bytes: float
    extra_pass_flops: float = 0.0
    loops: int = 0
    ici_bytes: float = 0.0
    ici_steps: float = 0.0

    @classmethod
    def of(cls, compiled, lowered_text: str | None = None, num_devices: int = 1) -> "Cost":
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca  # older jax: one dict per program
        extra = 0.0
        if lowered_text is not None:  # global (unpartitioned) shapes: the matmuls split evenly over the devices
            extra = sum((p - 1) * f for p, f in dot_flops_by_passes(lowered_text).items()) / num_devices
        text = compiled.as_text()
        ops = collectives(text, num_devices)
        return cls(float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)), extra, program_loops(text),
                   float(sum(c.sent_bytes for c in ops)), float(sum(c.steps for c in ops)))

    @staticmethod
    def linear(terms: Sequence[tuple[float, "Cost"]]) -> "Cost":
        """sum(coefficient x cost), e.g. a loop body as scale x (P - P'), two programs that differ only by the
        body's size. `loops` is the first program's (for a loop body: the loops it accounts for)."""
        fields = ("flops", "bytes", "extra_pass_flops", "ici_bytes", "ici_steps")
        sums = {f: sum(coef * getattr(cost, f) for coef, cost in terms) for f in fields}
        return Cost(loops=terms[0][1].loops, **sums)

    def seconds(self, peak: ChipPeak, devices_per_chip: int = 1) -> tuple[float, float]:
        """(compute-bound, HBM-bound) seconds on one device."""
        return (devices_per_chip * (self.flops + self.extra_pass_flops) / peak.flops,
                devices_per_chip * self.bytes / peak.hbm_bytes_per_s)

    def ici_seconds(self, peak: ChipPeak, devices_per_chip: int = 1) -> float:
        """Seconds of its collectives on the chip's ICI (its devices share the chip's links); 0 without an ICI."""
        if peak.ici is None:
            return 0.0
        return devices_per_chip * self.ici_bytes / peak.ici.ring_bytes_per_s + self.ici_steps * peak.ici.hop_s


# ---------------------------------------------------------------------------------------------
# matmul FLOPs by MXU passes, from the lowered StableHLO


_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(", re.M)
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_DOT_TYPES = re.compile(r":\s*\(tensor<([^>]*)>, tensor<[^>]*>\) -> tensor<([^>]*)>")


def _tensor_type(t: str) -> tuple[list[int], str]:
    *dims, elem = t.split("x")
    return [int(d) for d in dims], elem


def _dot_flops(line: str) -> tuple[int, int]:
    """(MXU passes, FLOPs) of one `stablehlo.dot_general` line: 2 x output elements x contracted size."""
    contracting = re.search(r"contracting_dims = \[([\d, ]*)\] x", line)
    types = _DOT_TYPES.search(line)
    if contracting is None or types is None:
        raise ValueError(f"dot_flops_by_passes: cannot read the dot_general {line.strip()[:200]!r}")
    lhs, elem = _tensor_type(types.group(1))
    out, _ = _tensor_type(types.group(2))
    k = math.prod(lhs[int(i)] for i in contracting.group(1).replace(" ", "").split(",") if i)
    precision = re.search(r"precision = \[(\w+)", line)
    passes = F32_PASSES.get(precision.group(1) if precision else "DEFAULT", 1) if elem == "f32" else 1
    return passes, 2 * math.prod(out) * k


def dot_flops_by_passes(stablehlo: str) -> dict[int, int]:
    """{MXU passes: FLOPs} of every dot_general in a lowered module (global shapes), each private function counted
    once per call. Loop bodies count once, as in XLA's cost analysis: meant for loop-free programs."""
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(stablehlo)]
    bodies = {name: stablehlo[a:b] for (a, name), (b, _) in zip(starts, starts[1:] + [(len(stablehlo), "")])}
    memo: dict[str, dict[int, int]] = {}

    def total(name: str) -> dict[int, int]:
        if name not in memo:
            out: dict[int, int] = {}
            for line in bodies[name].splitlines():
                if "stablehlo.dot_general" in line:
                    p, f = _dot_flops(line)
                    out[p] = out.get(p, 0) + f
                for callee in _CALL.findall(line):
                    for p, f in total(callee).items():
                        out[p] = out.get(p, 0) + f
            memo[name] = out
        return memo[name]

    return total("main") if "main" in bodies else {}


# ---------------------------------------------------------------------------------------------
# stages, the step, the table


@dataclasses.dataclass(frozen=True)
class Part:
    """One cost program of a stage, run `count` times per step."""

    name: str
    count: int
    cost: Cost | None  # None: the compiler refused it
    compile_s: float = 0.0
    error: str | None = None
    derived: bool = False  # a loop body (`Cost.linear` of two programs); its `loops` are those it accounts for


@dataclasses.dataclass(frozen=True)
class StageCost:
    name: str
    parts: tuple[Part, ...]

    @property
    def error(self) -> str | None:
        return next((f"{p.name}: {p.error}" for p in self.parts if p.error), None)

    def total(self, field: str) -> float:
        return sum(p.count * getattr(p.cost, field) for p in self.parts if p.cost is not None)

    def seconds(self, peak: ChipPeak, devices_per_chip: int = 1) -> tuple[float, float, float]:
        """(compute-bound s, HBM-bound s, predicted s): each part at the max of its two bounds plus its collectives
        (not overlapped), times its count."""
        compute = memory = time = 0.0
        for p in self.parts:
            if p.cost is not None:
                c, m = p.cost.seconds(peak, devices_per_chip)
                ici = p.cost.ici_seconds(peak, devices_per_chip)
                compute, memory, time = compute + p.count * c, memory + p.count * m, time + p.count * (max(c, m) + ici)
        return compute, memory, time

    def ici_seconds(self, peak: ChipPeak, devices_per_chip: int = 1) -> float:
        return sum(p.count * p.cost.ici_seconds(peak, devices_per_chip) for p in self.parts if p.cost is not None)

    def overlapped_seconds(self, peak: ChipPeak, devices_per_chip: int = 1) -> float:
        """The stage with each part's collectives hidden under its compute/HBM time: max of the three, per part."""
        return sum(p.count * max(*p.cost.seconds(peak, devices_per_chip), p.cost.ici_seconds(peak, devices_per_chip))
                   for p in self.parts if p.cost is not None)

    def bound(self, peak: ChipPeak, devices_per_chip: int = 1) -> str:
        """What limits the stage: compute, HBM or ICI, whichever takes most of its (not overlapped) time."""
        by = {"compute": 0.0, "HBM": 0.0, "ICI": 0.0}
        for p in self.parts:
            if p.cost is not None:
                c, m = p.cost.seconds(peak, devices_per_chip)
                by["compute" if c >= m else "HBM"] += p.count * max(c, m)
                by["ICI"] += p.count * p.cost.ici_seconds(peak, devices_per_chip)
        return max(by, key=by.get)


def model_flops(layer_params: int, head_params: int, positions: int, projected: int, factor: int) -> float:
    """factor x (layer params x positions + head params x positions projected to logits): 2 for a forward, 6 for
    forward + backward; the attention's score and value matmuls (`attention_cost.causal_model_flops`) are added
    by the caller; the embedding lookup is not counted."""
    return float(factor * (layer_params * positions + head_params * projected))


@dataclasses.dataclass
class Roofline:
    """The prediction of one step on `chips` chips of `chip` (see the module docstring)."""

    chip: str
    peak: ChipPeak
    num_devices: int
    devices_per_chip: int
    stages: list[StageCost]
    rollout_tokens: int  # rows x max_new_tokens: every row decodes to the length cap (the programs' shapes)
    model_flops: dict[str, float]  # global, per stage (`model_flops`)
    compile_s: float
    notes: list[str] = dataclasses.field(default_factory=list)
    # disaggregated (`opd.placement`): the stages on the sampler's own `sampler_devices` (the others on the rest of
    # the `num_devices`), and whether the two sides run at once (`rollout.staleness` >= 1: the next rollout beside
    # the update, so a step takes the longer side; 0: one after the other)
    sampler_stages: tuple[str, ...] = ()
    sampler_devices: int = 0
    sides_overlap: bool = False

    @property
    def chips(self) -> int:
        return max(1, self.num_devices // self.devices_per_chip)

    @property
    def sampler_chips(self) -> int:
        """The chips that sample: the sampler's own (disaggregated), else all of them."""
        return max(1, self.sampler_devices // self.devices_per_chip) if self.sampler_stages else self.chips

    def side_seconds(self, overlapped: bool = False) -> tuple[float, float] | None:
        """(sampler side s, trainer side s) of a disaggregated step (None when a stage failed)."""
        times = {s.name: self.stage_seconds(s.name, overlapped) for s in self.stages}
        if any(t is None for t in times.values()):
            return None
        return (sum(t for n, t in times.items() if n in self.sampler_stages),
                sum(t for n, t in times.items() if n not in self.sampler_stages))

    def _step(self, overlapped: bool) -> float | None:
        sides = self.side_seconds(overlapped)
        if sides is None:
            return None
        return max(sides) if self.sampler_stages and self.sides_overlap else sum(sides)

    def stage_seconds(self, name: str, overlapped: bool = False) -> float | None:
        """The stage's predicted time: collectives not overlapped, or (`overlapped`) hidden under compute/HBM."""
        stage = next((s for s in self.stages if s.name == name), None)
        if stage is None or stage.error:
            return None
        if overlapped:
            return stage.overlapped_seconds(self.peak, self.devices_per_chip)
        return stage.seconds(self.peak, self.devices_per_chip)[2]

    @property
    def step_s(self) -> float | None:
        """The stages in sequence; disaggregated with overlapping sides, the longer side."""
        return self._step(overlapped=False)

    @property
    def step_overlapped_s(self) -> float | None:
        return self._step(overlapped=True)

    @property
    def rollout_tokens_per_s_per_chip(self) -> float | None:
        """While sampling, per chip that samples."""
        t = self.stage_seconds("sample")
        return None if not t else self.rollout_tokens / (t * self.sampler_chips)

    @property
    def step_tokens_per_s_per_chip(self) -> float | None:
        """Rollout tokens per second of step per chip of the slice: what colocated and disaggregated compare on."""
        step = self.step_s
        return None if not step else self.rollout_tokens / (step * self.chips)

    @property
    def mfu(self) -> float | None:
        step = self.step_s
        done = [s.name for s in self.stages]
        if not step or not done:
            return None
        return sum(self.model_flops.get(n, 0.0) for n in done) / (step * self.chips * self.peak.flops)

    def to_dict(self) -> dict[str, Any]:
        stages = []
        for s in self.stages:
            compute, memory, time = s.seconds(self.peak, self.devices_per_chip)
            stages.append({"name": s.name, "flops": s.total("flops"), "bytes": s.total("bytes"),
                           "extra_pass_flops": s.total("extra_pass_flops"), "compute_s": compute, "hbm_s": memory,
                           "ici_bytes": s.total("ici_bytes"), "ici_s": s.ici_seconds(self.peak, self.devices_per_chip),
                           "time_s": None if s.error else time,
                           "time_overlapped_s": self.stage_seconds(s.name, overlapped=True),
                           "bound": s.bound(self.peak, self.devices_per_chip),
                           "model_flops": self.model_flops.get(s.name), "error": s.error,
                           "parts": [{"name": p.name, "count": p.count, "compile_s": round(p.compile_s, 2),
                                      "error": p.error, **(dataclasses.asdict(p.cost) if p.cost else {})}
                                     for p in s.parts]})
        return {"chip": self.chip, "peak_flops_per_chip": self.peak.flops,
                "hbm_bytes_per_s_per_chip": self.peak.hbm_bytes_per_s, "source": self.peak.source,
                "ici": None if self.peak.ici is None else dataclasses.asdict(self.peak.ici),
                "chips": self.chips, "devices_per_chip": self.devices_per_chip, "per_device": True,
                "stages": stages, "step_s": self.step_s, "step_overlapped_s": self.step_overlapped_s,
                "rollout_tokens": self.rollout_tokens,
                "rollout_tokens_per_s_per_chip": self.rollout_tokens_per_s_per_chip,
                "step_tokens_per_s_per_chip": self.step_tokens_per_s_per_chip, "mfu": self.mfu,
                "sampler_stages": list(self.sampler_stages), "sampler_devices": self.sampler_devices,
                "sides_overlap": self.sides_overlap,
                "side_seconds": self.side_seconds() if self.sampler_stages else None,
                "compile_s": round(self.compile_s, 2), "notes": self.notes}

    def table(self) -> str:
        p = self.peak
        ici = "" if p.ici is None else (f", ICI {p.ici.bytes_per_s / 1e9:.0f} GB/s over {p.ici.ports} ports, "
                                        f"{p.ici.hop_s * 1e6:g} us per ring step")
        lines = [f"roofline on {self.chips} x {self.chip} ({p.flops / 1e12:.0f} TFLOP/s bf16, "
                 f"{p.hbm_bytes_per_s / 1e9:.0f} GB/s HBM per chip{ici}; {p.source}), per device:"]
        head = ("stage", "programs", "GFLOP", "+passes", "GB", "ICI GB", "compute s", "HBM s", "ICI s", "=time s",
                "overlapped s", "bound")
        rows = [head]
        dpc = self.devices_per_chip
        for s in self.stages:
            compute, memory, time = s.seconds(self.peak, dpc)
            programs = " + ".join(f"{q.name} x{q.count}" for q in s.parts)
            rows.append((s.name, programs, _num(s.total("flops") / 1e9), _num(s.total("extra_pass_flops") / 1e9),
                         _num(s.total("bytes") / 1e9), _num(s.total("ici_bytes") / 1e9), _num(compute),
                         _num(memory), _num(s.ici_seconds(self.peak, dpc)), "-" if s.error else _num(time),
                         "-" if s.error else _num(s.overlapped_seconds(self.peak, dpc)),
                         "-" if s.error else s.bound(self.peak, dpc)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        lines += [f"  {s.name}: {s.error}" for s in self.stages if s.error]
        lines.append(self.summary())
        lines.append(f"cost programs: {self.compile_s:.1f} s of compiles, each program's own (--no-cost skips them)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def summary(self) -> str:
        mfu, tok_s, step_tok_s = self.mfu, self.rollout_tokens_per_s_per_chip, self.step_tokens_per_s_per_chip
        overlapped = self.step_overlapped_s
        order = "the stages in sequence"
        if self.sampler_stages:
            sides = self.side_seconds()
            trainer = self.num_devices - self.sampler_devices
            order = (f"disaggregated: sampler side ({', '.join(self.sampler_stages)}) "
                     f"{'-' if sides is None else _num(sides[0])} s on {self.sampler_devices} devices, trainer side "
                     f"{'-' if sides is None else _num(sides[1])} s on {trainer}; "
                     + ("the two at once (rollout.staleness >= 1): the longer side" if self.sides_overlap else
                        "one after the other (rollout.staleness = 0)"))
        per = "sampler chip" if self.sampler_stages else "chip"
        return (f"predicted step {'-' if self.step_s is None else _num(self.step_s)} s ({order}; "
                f"collectives not overlapped; {'-' if overlapped is None else _num(overlapped)} s with each hidden "
                f"under its program's compute/HBM time); "
                f"rollout {'-' if tok_s is None else f'{tok_s:.0f}'} tok/s per {per} while sampling, "
                f"{'-' if step_tok_s is None else f'{step_tok_s:.0f}'} per chip of the slice over the step "
                f"({self.rollout_tokens} tokens: every row to max_new_tokens); MFU "
                f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} (model FLOPs: 2 x "
                f"params x tokens for rollout and scoring, 6 x for the update, plus the attention's causal pairs)")


def _num(x: float) -> str:
    return f"{x:.4g}"


def chip_of(device_kind: str, kinds: Mapping[str, tuple[str, float]]) -> str | None:
    """The chip name (`CHIP_PEAKS` key) of a `device.device_kind`, via `kinds` (aot's HBM table), else None."""
    chip = kinds.get(device_kind, (None,))[0]
    return chip if chip in CHIP_PEAKS else None


def loop_notes(stages: Sequence[StageCost]) -> list[str]:
    """A note for every stage whose cost programs hold while loops that no derived part accounts for (the top-p
    bisection, a loop the compiler made): their bodies are counted once per run."""
    notes = []
    for s in stages:
        left = sum(p.cost.loops for p in s.parts if p.cost and not p.derived)
        left -= sum(p.cost.loops for p in s.parts if p.cost and p.derived)
        if left > 0:
            notes.append(f"{s.name}: {left} while loop(s) left in its cost programs (e.g. the top-p bisection), "
                         f"each body counted once per run")
    return notes
