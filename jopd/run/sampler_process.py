"""`rollout.placement=process`: the sampler in a worker process of its own, on the same host.

The trainer (`ProcessSampler`, set as `OPDStep.remote` by the loop's `build`) starts one worker (multiprocessing,
spawn context: a fresh interpreter with the trainer's XLA_FLAGS / JAX_PLATFORMS and jax options) and talks to it
only through the exchange (`run.exchange`: a TensorStore kvstore, a local directory or `gs://`; zarr arrays, atomic
markers). Per step n it writes the params version v = n - k the step samples with (once per version: the fp32
params the weight sync reads), then the request (the host prompt rows, v, and the weight-noise key
`weight_sync_key(state.rng, v)`), and polls for the rollout. With `rollout.queue` = q > 1 (q <= k) it also writes
the requests of steps n+1 .. n+q-1 at step n (`OPDStep.queue_requests`: their params are the window's, their
prompt batches the loop's `Lookahead`), so the worker samples them while the trainer trains; each request is
written once. The worker builds the step's sampling side (`build_step` of the run's config, colocated on its own
devices: only the weight sync and the sampler are ever compiled there) and loops: the first pending request (step
order), its params version (loaded once), `OPDStep.sync_policy`, `OPDStep.sample_rows` (step n's row randomness),
the rollout's arrays. The trainer turns them into the very `Rollout` the in-place mode makes (`OPDStep.rollout`).
A read step's request and rollout are deleted, and the params versions no unread request reads.

With `rollout.sampler_devices` = N the worker runs on the host's first N devices and the trainer on the rest (each
side's environment: `run.device_split`); its step's mesh is then the sampler's (`sampling.mesh`, `{data: -1}` when
unset), and each rollout's marker says its device count.

A worker that exits (killed, crashed) is seen while the trainer polls: it is restarted and answers the pending
requests (in the store: a queue survives it) with the params versions they read, so no step is lost or sampled
twice (a rollout is read only once its marker is whole; a step with a rollout is not pending). A worker that
raises writes its one-line error first: that is raised in the trainer, not restarted. With
`train.stall_timeout_s` a rollout not written in time stops the run naming the sampler process and its pid
(in a multi-process run that process exits at once, `jopd.cli`: the others may be blocked in a collective with it).
The worker exits when the trainer does (it watches its parent's pid).

A multi-process run (jax.distributed, a trainer process per host): each trainer process starts its own worker,
which samples that process's host rows only, through an exchange of its own (`<exchange_dir>/p<process index>`).
The params may be sharded across processes (fsdp): each process gathers the full fp32 policy to its host before
writing it (one collective per params version, on every process at the same steps). The worker is a one-process
jax of its own: it is told its trainer's (process index, count), draws the rows' randomness by their global row
index (`OPDStep.sample_rows`), and builds the step for one host's share (`one_host`: the batch and the mesh
divided by the count), so it samples what the in-place multi-process run samples. The decode iterations are the
maximum over the processes' workers (the in-place sampler's loop runs until every row is done)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jopd.parallel.distributed import gather_to_host
from jopd.run import device_split, stall
from jopd.run.exchange import Exchange

# jax options a worker takes from its trainer, set before its backend starts (a caller may set them in code, not in
# the environment: the tests' matmul precision, for one): what devices it sees and how the sampler computes
JAX_OPTIONS = ("jax_platforms", "jax_num_cpu_devices", "jax_default_matmul_precision", "jax_enable_x64",
               "jax_threefry_partitionable")
ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")
# what makes a process join the trainers' distributed run (`parallel.distributed`): never the worker's (spawn passes
# the environment on)
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
RESTARTS = 3  # restarts while one rollout is awaited before the run stops (a worker that dies at once)
NOTICE_S = 60.0  # without train.stall_timeout_s, a line per minute while a rollout is awaited: never silent


def exchange_dir(cfg, process: tuple[int, int] = (0, 1)) -> str:
    """`rollout.exchange_dir` (a local directory or `gs://bucket/path`), default `<train.out_dir>/exchange`; with
    several trainer processes (`process`: (index, count)) the subdirectory `p<index>` of it, one per process."""
    root = cfg.rollout.exchange_dir or str(Path(cfg.train.out_dir) / "exchange")
    return root if process[1] == 1 else f"{root.rstrip('/')}/p{process[0]}"


def leaf_name(path) -> str:
    """A params leaf's array name in the exchange: its tree path's keys joined by '.' (e.g. `layers.attn.wq`)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def flat_params(params) -> dict[str, np.ndarray]:
    """Host copies of `params`' leaves by tree path (`leaf_name`): the whole arrays, gathered from every process
    when they are split across several (a collective: every process calls it)."""
    leaves = jax.tree_util.tree_flatten_with_path(gather_to_host(params))[0]
    return {leaf_name(path): np.asarray(x) for path, x in leaves}


def unflat_params(arrays: dict[str, np.ndarray], like):
    """`arrays` (by tree path) as the pytree of `like` (ShapeDtypeStructs), checked leaf by leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    for path, x in leaves:
        a = arrays[leaf_name(path)]
        if a.shape != tuple(x.shape) or a.dtype != x.dtype:
            raise ValueError(f"exchange params {leaf_name(path)}: {a.dtype}{list(a.shape)}, the student's is "
                             f"{x.dtype}{list(x.shape)}")
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)


class ProcessSampler:
    """The trainer's side: the worker process and the exchange (see the module docstring)."""

    def __init__(self, cfg, student_cfg, teacher_cfgs, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.trainer = (jax.process_index(), jax.process_count())  # whose rows the worker samples
        self.exchange = Exchange(exchange_dir(cfg, self.trainer))
        self.exchange.clear()
        env = {k: os.environ[k] for k in ENV if k in os.environ}
        options = {k: getattr(jax.config, k) for k in JAX_OPTIONS if hasattr(jax.config, k)}
        split = device_split.host_split(cfg)  # rollout.sampler_devices: the worker's own devices
        if split is not None:
            env, options = env | split.worker_env, options | split.worker_options
        self._args = (cfg, student_cfg, tuple(teacher_cfgs), self.exchange.root, os.getpid(), env, options,
                      self.trainer)
        self.process = None
        # the params versions written: decided here, not from the store, so every trainer process gathers the
        # same versions at the same steps (`flat_params` is a collective)
        self.versions: set[int] = set()
        self.restarts = 0  # over the run
        self.unread: dict[int, int] = {}  # step -> params version: the requests written, their rollout not read yet
        self.sampled_by: dict[int, int] = {}  # step -> the pid of the worker that wrote its rollout (read ones)
        self.worker_devices: int | None = None  # the device count the last rollout's worker reported
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=worker_main, args=self._args, name="jopd-sampler", daemon=True)
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def write_request(self, step: int, version: int, policy, key: jax.Array, rows: dict[str, np.ndarray]) -> None:
        """Step `step`'s request: params `version` first (unless written), then the request's rows and marker; then
        the params versions no unread request reads are deleted."""
        ex = self.exchange
        if version not in self.versions:
            ex.write_params(version, flat_params(policy))
            self.versions.add(version)
        rows = {"prompt_tokens": rows["prompt_tokens"], "prompt_mask": rows["prompt_mask"]}
        ex.write_request(step, version, np.asarray(jax.random.key_data(key)), rows)
        self.unread[step] = version
        ex.drop_params_before(min(self.unread.values()))

    def request(self, step: int, version: int, policy, key: jax.Array, rows: dict[str, np.ndarray]) -> None:
        """`write_request` unless step `step`'s request is written already (queued ahead: `rollout.queue`)."""
        if step not in self.unread:
            self.write_request(step, version, policy, key, rows)

    def sample(self, step: int, version: int, policy, key: jax.Array, rows: dict[str, np.ndarray]):
        """Step `step`'s rollout from the worker (requested now unless queued before): (its `SampleOutput` as host
        arrays, the decode iterations)."""
        from jopd.sampling.config import SampleOutput

        self.request(step, version, policy, key, rows)
        self.wait(step, version)
        meta, fields = self.exchange.read("rollout", step)
        # read once. The request goes first: a worker that lists the rollouts, then the requests, never finds
        # this step's request without its rollout (and samples it again)
        self.exchange.delete("request", step)
        self.exchange.delete("rollout", step)
        del self.unread[step]
        self.sampled_by[step] = meta["pid"]
        self.worker_devices = meta.get("devices")
        if self.unread:  # the versions the queued requests read stay
            self.exchange.drop_params_before(min(self.unread.values()))
        iterations = np.int32(meta["iterations"])
        if self.trainer[1] > 1:  # every process's worker's: the in-place sampler decodes until all rows are done
            iterations = np.int32(np.max(gather_to_host(iterations)))
        return SampleOutput(**fields), iterations

    def wait(self, step: int, version: int) -> dict:
        """Poll for step `step`'s rollout marker: restart a worker that has exited, raise a worker's own error,
        and past `train.stall_timeout_s` stop naming the sampler process."""
        timeout = self.cfg.train.stall_timeout_s
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        restarts, notices = 0, 0
        while (meta := self.exchange.meta("rollout", step)) is None:
            code = self.process.exitcode
            if code is not None:
                error = self.exchange.error()
                if error is not None:
                    raise RuntimeError(f"rollout.placement=process: the sampler process (pid {self.pid}) failed: "
                                       f"{error.strip()}")
                if restarts == RESTARTS:
                    raise RuntimeError(f"rollout.placement=process: the sampler process exited {RESTARTS + 1} times "
                                       f"while step {step}'s rollout was awaited (last pid {self.pid}, code {code})")
                old = self.pid
                self._start()
                restarts += 1
                self.restarts += 1
                pending = ", ".join(map(str, sorted(self.unread)))
                self.log(f"step {step}: the sampler process (pid {old}) exited with code {code}; restarted it "
                         f"(pid {self.pid}) from params version {version} and the pending requests (steps "
                         f"{pending})")
            if deadline is not None and time.monotonic() > deadline:
                raise stall.stall_error(timeout, f"step {step}", f"the sampler process (pid {self.pid})")
            if deadline is None and time.monotonic() - t0 > NOTICE_S * (notices + 1):
                notices += 1
                self.log(f"step {step}: waiting for the sampler process (pid {self.pid}) for "
                         f"{NOTICE_S * notices:g} s (train.stall_timeout_s stops the run instead)")
            time.sleep(self.exchange.poll_s)
        return meta

    def close(self) -> None:
        """Stop the worker and delete the exchange's keys."""
        if self.process is not None and self.process.exitcode is None:
            self.process.terminate()
            with contextlib.suppress(ProcessLookupError):  # a stopped worker (SIGSTOP, a debugger) takes its SIGTERM
                os.kill(self.pid, signal.SIGCONT)  # once resumed
            self.process.join(timeout=10)
            if self.process.exitcode is None:  # never left behind (it would outlive a trainer that exits now)
                self.process.kill()
                self.process.join(timeout=10)
        self.process = None
        self.exchange.clear()


# -- the worker's side ------------------------------------------------------------------------------------------

def worker_main(cfg, student_cfg, teacher_cfgs, root: str, parent: int, env: dict[str, str],
                options: dict[str, Any], trainer: tuple[int, int] = (0, 1)) -> None:
    """The sampler process of trainer process `trainer` (index, count): the trainer's environment and jax options,
    its sampling side, then `serve`. An exception is written to the exchange's `error.txt` (one line) before the
    process exits. (jax is imported, but its backend, which reads XLA_FLAGS and the options, starts only when the
    sampling side is built.)"""
    os.environ.update(env)  # before jax's backend starts here (spawn passes them on too; explicit for clarity)
    for k in DISTRIBUTED_ENV:  # a one-process jax of its own, never a member of the trainers' run
        os.environ.pop(k, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops this process
    try:
        for k, v in options.items():
            jax.config.update(k, v)
        serve(sampling_side(one_host(cfg, trainer[1]), student_cfg, teacher_cfgs), Exchange(root), parent, trainer)
    except Exception as e:  # noqa: BLE001 (one line for the trainer, the traceback on this process's stderr)
        traceback.print_exc()
        Exchange(root).write_error(f"{type(e).__name__}: {e}".splitlines()[0])
        raise SystemExit(1) from None


def one_host(cfg, count: int):
    """`cfg` for one of `count` trainer processes' share: its prompt rows (`data.batch_size` / count) on a mesh of
    one host's devices (`mesh`, `sampling.mesh`: an axis of -1 fills this host's devices; else the first axis the
    count divides is divided), so the worker's per-device rows and prefill sharing are the in-place run's."""
    if count == 1:
        return cfg
    if cfg.data.batch_size % count:
        raise ValueError(f"data.batch_size={cfg.data.batch_size}: not divisible by the {count} trainer processes")

    def share(mesh, field: str):
        sizes = mesh.sizes()
        if -1 in sizes.values():
            return mesh
        axis = next((a for a in ("data", "fsdp", "expert", "tensor") if sizes[a] % count == 0), None)
        if axis is None:
            raise ValueError(f"{field}: no axis of {sizes} divides over the {count} trainer processes")
        return dataclasses.replace(mesh, **{axis: sizes[axis] // count})

    sampling = cfg.sampling
    if sampling.mesh is not None:
        sampling = dataclasses.replace(sampling, mesh=share(sampling.mesh, "sampling.mesh"))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size // count),
                               mesh=share(cfg.mesh, "mesh"), sampling=sampling)


def sampling_side(cfg, student_cfg, teacher_cfgs):
    """The step of `cfg`, colocated on this process's devices: only its weight sync and sampler are used (the
    other stages are jit wrappers never called, so never compiled). With `rollout.sampler_devices` (this process's
    own devices) its mesh is the sampler's, `sampling.mesh`'s shape (`{data: -1}` when unset), as disaggregated;
    else the trainer's `mesh`."""
    from jopd import parallel as meshlib
    from jopd.opd.step import build_step

    mesh_cfg = cfg.mesh
    if cfg.rollout.sampler_devices:
        mesh_cfg = cfg.sampling.mesh or meshlib.MeshConfig(on_indivisible=cfg.mesh.on_indivisible)
    local = dataclasses.replace(cfg, mesh=mesh_cfg, rollout=dataclasses.replace(
        cfg.rollout, placement="colocated", sampler_devices=0, exchange_dir=None, queue=1))
    mesh = meshlib.make_mesh(local.mesh, jax.devices())
    return build_step(local, student_cfg, teacher_cfgs, mesh)


def serve(opd, ex: Exchange, parent: int, trainer: tuple[int, int] = (0, 1)) -> None:
    """Answer the exchange's pending requests, in step order, until the trainer (pid `parent`) is gone; the rows
    are trainer process `trainer`'s (index, count): their randomness is drawn by their global row index."""
    from jopd.models import transformer
    from jopd.models.dtypes import DTYPES

    like = transformer.abstract_params(opd.student_cfg, DTYPES[opd.cfg.student.dtype])
    loaded: tuple[int | None, Any] = (None, None)
    while os.getppid() == parent:
        step = ex.pending_request()
        if step is None:
            time.sleep(ex.poll_s)
            continue
        meta, rows = ex.read("request", step)
        version = meta["version"]
        if loaded[0] != version:  # the params version of this request (the last one the trainer wrote)
            params = jax.device_put(unflat_params(ex.read_params(version), like), opd.shardings.student)
            loaded = (version, params)
        key = jax.device_put(jax.random.wrap_key_data(np.asarray(meta["key"], np.uint32)), opd.shardings.state.rng)
        with jax.set_mesh(opd.mesh):  # the sampler's activation constraints, as in the trainer's loop
            sample, iterations, _, _ = opd.sample_rows(opd.sync_policy(loaded[1], key), rows, step, trainer)
        fields = {k: np.asarray(v) for k, v in jax.device_get(sample._asdict()).items() if v is not None}
        ex.write_rollout(step, fields, int(jax.device_get(iterations)), os.getpid(), jax.device_count())
