"""The exchange between the trainer and its sampler process (`rollout.placement=process`): one TensorStore key-value
store (`tensorstore.KvStore`) that both sides open, a local directory (kvstore driver `file`) or a bucket path
(`gs://bucket/path`, driver `gcs`); `memory://` (driver `memory`, one process) serves the tests. Every access goes
through the kvstore (arrays, markers, listings, deletes), so one code path serves them all:

    arrays/<kind>/<name>/<array>/   zarr arrays (TensorStore's default chunks, about 4 MB, blosc-lz4)
    <kind>/<name>.json              the marker of group <kind>/<name>, written after all its arrays are

    params/v<V>.json     the policy's fp32 params of version V (flattened by tree path)
    request/<n>.json     step n's host prompt rows; the marker: its params version and weight-noise key
    rollout/<n>.json     step n's `SampleOutput` arrays; the marker: its decode iterations and the worker's pid
    error.txt            a worker's one-line error

A reader that sees a marker reads whole arrays: the marker is one kvstore key, written once its arrays' writes have
returned, and a single key's write is atomic on both drivers. `file`: the value is written to `<key>.__lock`,
fsynced and renamed onto the key (tensorstore/kvstore/file/file_key_value_store.cc, its header comment: "the files
containing the values of existing keys are never modified; instead, they are replaced via rename"), and listings
skip the lock files. `gcs`: a key is one object put, and Cloud Storage's object read-after-write, read-after-delete
and listing are strongly consistent (cloud.google.com/storage/docs/consistency). The gcs path is the same code with
another spec (`kvstore_spec`); it has not been run against a bucket (no bucket is reachable from the machines this
was built on). Deletes go marker first, arrays after: a marker is never found without its arrays.

The trainer writes params and requests (`rollout.queue` of them pending at most) and deletes what no unread
request needs; the sampler process writes rollouts (in step order: `pending_request`)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import tensorstore as ts

KINDS = ("params", "request", "rollout")
ERROR = "error.txt"


LOCAL_POLL_S, REMOTE_POLL_S = 0.005, 0.5


def kvstore_spec(root: str | os.PathLike) -> dict:
    """`root` as a kvstore spec of a directory (its path ends in '/', keys are appended to it): `gs://bucket/path`
    -> gcs, `memory://path` -> memory, a path without a scheme -> file (made absolute: both processes agree)."""
    root = str(root)
    scheme, sep, rest = root.partition("://")
    if not sep:
        return {"driver": "file", "path": os.path.abspath(root) + "/"}
    path = rest.partition("/")[2] if scheme == "gs" else rest
    path = path.strip("/") + "/" if path.strip("/") else ""
    if scheme == "gs" and rest.partition("/")[0]:
        bucket = rest.partition("/")[0]
        return {"driver": "gcs", "bucket": bucket, **({"path": path} if path else {})}
    if scheme == "memory":
        return {"driver": "memory", **({"path": path} if path else {})}
    raise ValueError(f"exchange {root}: a local directory, gs://bucket/path or memory://path")


def poll_interval(root: str | os.PathLike) -> float:
    """How often a side that waits on the exchange at `root` lists its markers: a bucket bills each list request
    and answers in tens of ms, a local directory or memory in microseconds."""
    return REMOTE_POLL_S if kvstore_spec(root)["driver"] == "gcs" else LOCAL_POLL_S


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The keys that start with `prefix` (which ends in '/': the next byte, '0', bounds them)."""
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


class Exchange:
    """The exchange at `root` (see the module docstring): a local directory, `gs://bucket/path` or `memory://path`."""

    def __init__(self, root: str | os.PathLike):
        self.root = str(root)
        self.context = ts.Context()  # the kvstore's and the arrays' (a memory store is shared within one context)
        self.kv = ts.KvStore.open(kvstore_spec(self.root), context=self.context).result()
        self.poll_s = poll_interval(self.root)

    def clear(self) -> None:
        """Delete every key (a new run, or a resumed one: nothing of an earlier sampler is read; and at the end)."""
        self.kv.delete_range(ts.KvStore.KeyRange()).result()

    def keys(self) -> list[str]:
        return sorted(k.decode() for k in self.kv.list().result())

    # -- arrays and markers -----------------------------------------------------------------------------------

    def _arrays(self, kind: str, name: str) -> str:
        return f"arrays/{kind}/{name}/"

    def write_arrays(self, prefix: str, arrays: dict[str, np.ndarray]) -> None:
        """Each array of `arrays` as a zarr array under `prefix` (any earlier one replaced); returns when all are
        written."""
        writes = []
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            store = ts.open({"driver": "zarr"}, kvstore=self.kv / f"{prefix}{name}/", create=True,
                            delete_existing=True, dtype=ts.dtype(a.dtype.name), shape=a.shape).result()
            writes.append(store.write(a))
        for w in writes:
            w.result()

    def read_arrays(self, prefix: str, names) -> dict[str, np.ndarray]:
        stores = {n: ts.open({"driver": "zarr"}, kvstore=self.kv / f"{prefix}{n}/", open=True).result() for n in names}
        reads = {n: s.read() for n, s in stores.items()}
        return {n: np.asarray(r.result()) for n, r in reads.items()}

    def _write(self, kind: str, name: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
        self.write_arrays(self._arrays(kind, name), arrays)
        # one key: visible whole or not at all, and only after its arrays (the module docstring)
        self.kv.write(f"{kind}/{name}.json", json.dumps(dict(meta, arrays=sorted(arrays)))).result()

    def meta(self, kind: str, name) -> dict | None:
        """The marker of `kind`/`name` (None: not (wholly) written yet)."""
        r = self.kv.read(f"{kind}/{name}.json").result()
        return json.loads(r.value) if r.state == "value" else None

    def read(self, kind: str, name) -> tuple[dict, dict[str, np.ndarray]]:
        """(the marker, its arrays) of a published `kind`/`name`."""
        meta = self.meta(kind, name)
        if meta is None:
            raise FileNotFoundError(f"{self.root} {kind}/{name}: no marker (not written)")
        return meta, self.read_arrays(self._arrays(kind, str(name)), meta["arrays"])

    def delete(self, kind: str, name) -> None:
        """The marker first, then the arrays: a reader never finds a marker without them."""
        self.kv.write(f"{kind}/{name}.json", None).result()
        self.kv.delete_range(prefix_range(self._arrays(kind, str(name)))).result()

    def names(self, kind: str) -> list[int]:
        """The published names of `kind` (ints: steps, or versions without their `v`), sorted."""
        keys = self.kv.list(prefix_range(f"{kind}/"), strip_prefix_length=len(kind) + 1).result()
        return sorted(int(k.decode()[:-len(".json")].lstrip("v")) for k in keys
                      if k.endswith(b".json") and b"/" not in k)

    def write_error(self, line: str) -> None:
        self.kv.write(ERROR, line).result()

    def error(self) -> str | None:
        """A worker's one-line error (None: none written)."""
        r = self.kv.read(ERROR).result()
        return r.value.decode() if r.state == "value" else None

    # -- what each side writes ------------------------------------------------------------------------------

    def write_params(self, version: int, leaves: dict[str, np.ndarray]) -> None:
        self._write("params", f"v{version}", leaves, {"version": version})

    def write_request(self, step: int, version: int, key_data: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        self._write("request", str(step), rows, {"step": step, "version": version,
                                                "key": np.asarray(key_data).tolist()})

    def write_rollout(self, step: int, fields: dict[str, np.ndarray], iterations: int, pid: int = 0,
                      devices: int = 0) -> None:
        """`pid`: the worker's (which worker answered, after a restart); `devices`: its device count."""
        self._write("rollout", str(step), fields, {"step": step, "iterations": iterations, "pid": pid,
                                                   "devices": devices})

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
