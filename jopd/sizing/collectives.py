"""The collectives of a compiled program, read from its HLO text (`compiled.as_text()`), for the roofline's
communication term (`jopd.sizing.roofline`).

Each all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (and their async `-start` forms;
a `-done` only ends its `-start`, and an op wrapped in `async-start` is read where it stands in its async
computation) gives the bytes one device sends over ICI and the steps of the algorithm a ring would run, from
its result shape and its group of n devices (`replica_groups` as explicit groups, an iota `[g,n]<=[...]` or
named mesh axes, `mesh[...] {'axis'}`):

| op | bytes sent per device | ring steps |
|---|---|---|
| all-gather (result R) | (n - 1) / n x R | n - 1 |
| reduce-scatter (result R, a 1/n shard) | (n - 1) x R | n - 1 |
| all-reduce (result R) | 2 (n - 1) / n x R | 2 (n - 1) |
| all-to-all (result R) | (n - 1) / n x R | n - 1 |
| collective-permute (result R) | R (0 if every pair is a device to itself) | 1 |

A text parse counts an instruction once: a collective in a while loop's body is counted once, not once per
iteration, so it is meant for loop-free programs (the cost programs of `jopd.sizing.cost`).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# `= <shape> <op>(`: the op (its async start included) and the result shape before it
_OP = re.compile(r"=\s*(?P<shape>.+?)\s(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, result bytes per device, group size, and what a ring sends."""

    kind: str
    result_bytes: float
    group: int

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends over ICI (the table in the module docstring)."""
        n, r = self.group, self.result_bytes
        if n <= 1:
            return 0.0
        if self.kind == "reduce-scatter":
            return (n - 1) * r
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * r
        if self.kind == "collective-permute":
            return r
        return (n - 1) / n * r  # all-gather, all-to-all

    @property
    def steps(self) -> int:
        """Steps of a ring algorithm: each pays one hop's latency."""
        n = self.group
        if n <= 1:
            return 0
        return {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(self.kind, n - 1)


def dtype_bytes(name: str) -> float:
    """Bytes of one element of an HLO element type: pred 1, f32 4, bf16 2, s4 0.5, f8e4m3fn 1, token 0."""
    if name == "pred":
        return 1.0
    bits = re.match(r"[a-z]+(\d+)", name)
    return int(bits.group(1)) / 8 if bits else 0.0


def _strip_layouts(shape: str) -> str:
    """`f32[4,8]{1,0:T(8,128)}` -> `f32[4,8]`: the layouts' braces hold commas and parentheses of their own."""
    out, depth = [], 0
    for ch in shape:
        depth += ch == "{"
        if depth == 0:
            out.append(ch)
        depth -= ch == "}"
    return "".join(out)


def shape_bytes(shape: str):
    """Bytes of an HLO shape: an int for an array, a (nested) tuple of them for a tuple shape."""
    plain = re.sub(r"/\*.*?\*/", "", _strip_layouts(shape)).strip()  # and the printer's /*index=5*/ comments
    text = _ARRAY.sub(lambda m: str(dtype_bytes(m.group(1)) * math.prod(int(d) for d in m.group(2).split(",") if d)),
                      plain)
    return ast.literal_eval(text.replace(")", ",)") if text.startswith("(") else text)


def _total(x) -> float:
    return float(sum(_total(e) for e in x)) if isinstance(x, tuple) else float(x)


def group_size(line: str, num_devices: int) -> int:
    """The number of devices in each of the op's groups (`num_devices` for an empty group list: all of them)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        return _mesh_group(mesh.group(1), mesh.group(2))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\})", line)
    if explicit:
        return len([d for d in explicit.group(1).strip("{}").split(",") if d])
    return num_devices


def _mesh_group(axes: str, named: str) -> int:
    """`mesh['a'=2,'b'=4]` and `{'a'}` (or a sub-axis `{'b':(1)2}`: size 2 of axis b): the product of the sizes."""
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", axes)}
    n = 1
    for name, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", named):
        n *= int(sub) if sub else sizes[name]
    return n


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective instruction of a compiled program's HLO text (each computation's, once)."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        kind, shape = m.group("op"), shape_bytes(m.group("shape"))
        if m.group("start") and kind in ("all-gather", "collective-permute"):
            shape = shape[1]  # (operands, results[, scratch]): the results
        if kind == "collective-permute" and _only_to_itself(line):
            continue
        group = 2 if kind == "collective-permute" else group_size(line, num_devices)
        out.append(Collective(kind, _total(shape), group))
    return out


def _only_to_itself(line: str) -> bool:
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return pairs is not None and all(a == b for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}"))
