"""The exchange directory between the trainer and its sampler process (`rollout.placement=process`): arrays written
with TensorStore (zarr), each group of them made visible by a marker, a small JSON file written under a temporary
name and renamed into place (`os.replace`) after its arrays, so a reader that sees the marker reads whole arrays.
TensorStore's default zarr chunks (about 4 MB, blosc-lz4) keep each file small.

    params/v<V>/<leaf path>  + params/v<V>.json     the policy's fp32 params of version V (flattened by tree path)
    request/<n>/<rows>       + request/<n>.json     step n's host prompt rows; the marker: its params version and key
    rollout/<n>/<field>      + rollout/<n>.json     step n's `SampleOutput` arrays; the marker: its decode iterations

The trainer writes params and requests and deletes what no pending request needs; the sampler process writes
rollouts. One request is pending at a time (the trainer waits for its rollout before the next step's)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

KINDS = ("params", "request", "rollout")


def _spec(path: Path) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}


def write_arrays(directory: Path, arrays: dict[str, np.ndarray]) -> None:
    """Each array of `arrays` as a zarr array `directory/<name>` (any earlier one replaced); returns when all are
    written."""
    writes = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        store = ts.open(_spec(directory / name), create=True, delete_existing=True, dtype=ts.dtype(a.dtype.name),
                        shape=a.shape).result()
        writes.append(store.write(a))
    for w in writes:
        w.result()


def read_arrays(directory: Path, names) -> dict[str, np.ndarray]:
    stores = {n: ts.open(_spec(directory / n), open=True).result() for n in names}
    reads = {n: s.read() for n, s in stores.items()}
    return {n: np.asarray(r.result()) for n, r in reads.items()}


class Exchange:
    """The exchange directory `root` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def clear(self) -> None:
        """Empty it (a new run, or a resumed one: nothing of an earlier sampler is read)."""
        shutil.rmtree(self.root, ignore_errors=True)
        for kind in KINDS:
            (self.root / kind).mkdir(parents=True, exist_ok=True)

    def _marker(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}.json"

    def _publish(self, kind: str, name: str, meta: dict) -> None:
        final = self._marker(kind, name)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, final)  # atomic: the marker appears whole, after its arrays

    def _write(self, kind: str, name: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
        write_arrays(self.root / kind / name, arrays)
        self._publish(kind, name, dict(meta, arrays=sorted(arrays)))

    def meta(self, kind: str, name) -> dict | None:
        """The marker of `kind`/`name` (None: not (wholly) written yet)."""
        try:
            return json.loads(self._marker(kind, str(name)).read_text())
        except FileNotFoundError:
            return None

    def read(self, kind: str, name) -> tuple[dict, dict[str, np.ndarray]]:
        """(the marker, its arrays) of a published `kind`/`name`."""
        meta = self.meta(kind, name)
        if meta is None:
            raise FileNotFoundError(f"{self.root / kind / str(name)}: no marker (not written)")
        return meta, read_arrays(self.root / kind / str(name), meta["arrays"])

    def delete(self, kind: str, name) -> None:
        """The marker first, then the arrays: a reader never finds a marker without them."""
        self._marker(kind, str(name)).unlink(missing_ok=True)
        shutil.rmtree(self.root / kind / str(name), ignore_errors=True)

    def names(self, kind: str) -> list[int]:
        """The published names of `kind` (ints: steps, or versions without their `v`), sorted."""
        out = []
        for p in (self.root / kind).glob("*.json"):
            if not p.name.startswith("."):
                out.append(int(p.stem.lstrip("v")))
        return sorted(out)

    # -- what each side writes ------------------------------------------------------------------------------

    def write_params(self, version: int, leaves: dict[str, np.ndarray]) -> None:
        self._write("params", f"v{version}", leaves, {"version": version})

    def write_request(self, step: int, version: int, key_data: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        self._write("request", str(step), rows, {"step": step, "version": version,
                                                "key": np.asarray(key_data).tolist()})

    def write_rollout(self, step: int, fields: dict[str, np.ndarray], iterations: int) -> None:
        self._write("rollout", str(step), fields, {"step": step, "iterations": iterations})

    def pending_request(self) -> int | None:
        """The first step with a request and no rollout yet (None: nothing to do). The rollouts are listed first:
        the trainer deletes a read step's request before its rollout."""
        done = set(self.names("rollout"))
        return next((n for n in self.names("request") if n not in done), None)

    def drop_params_before(self, version: int) -> None:
        for v in self.names("params"):
            if v < version:
                self.delete("params", f"v{v}")

    def read_params(self, version: int) -> dict[str, Any]:
        return self.read("params", f"v{version}")[1]
