"""`rollout.placement=process` (`jopd.run.sampler_process`): the sampler in a worker process of its own, the params
and rollouts exchanged as TensorStore arrays, samples exactly what the in-place k-lag mode samples for the same k
(1) and trains to the same params, though its worker is killed with SIGKILL while a request is pending and
restarted (logged); a stalled worker is named; bad configs are one-line errors."""

import os
import signal

import jax
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import train_iterator
from jopd.opd import placement
from jopd.opd.step import OPDStep
from jopd.run import exchange as exlib
from jopd.run.lookahead import Lookahead
from jopd.run.loop import build
from jopd.run.sampler_process import ProcessSampler
from tests.opd.test_disaggregated import _config

STEPS, K = 3, 1


def _train(cfg, log=lambda *_: None, steps=STEPS, after_read=None):
    """`steps` steps as the loop runs them (with `rollout.queue` > 1 the next steps' batches from a `Lookahead`):
    per step the rollout's tokens and the metrics; the final params; the sampler process's client (closed) when
    there is one. `after_read(client)`: called after each rollout is read from the sampler process."""
    run, state = build(cfg, log=log)
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    lookahead = Lookahead(train_iterator(cfg.data, run.tokenizer, kind="prompt"), data, cfg.rollout.queue - 1)
    tokens, metrics = [], []
    try:
        for t in range(steps):
            batch, ahead = next(data), lookahead.ahead()[:steps - t - 1]
            with jax.set_mesh(opd.mesh):
                state, m, rollout = opd(state, run.teacher_params, batch, t, ahead=ahead)
            if after_read:
                after_read(opd.remote)
            tokens.append(np.asarray(rollout.sample.tokens_BxN))
            metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
    finally:
        if opd.remote is not None:
            opd.remote.close()
    return jax.device_get((state.params, state.policies)), tokens, metrics, opd.remote


@pytest.fixture(scope="module")
def in_place(tmp_path_factory):
    """The in-place k-lag mode (colocated, all 8 devices): the reference."""
    return _train(_config(tmp_path_factory.mktemp("in_place"), f"rollout.staleness={K}"))


def _assert_same_run(got, want, steps=STEPS, k=K):
    (params, window), tokens, metrics, _ = got
    (ref_params, ref_window), ref_tokens, ref_metrics, _ = want
    for t in range(steps):  # the same row seeds, params and weight-noise key: the very same tokens
        np.testing.assert_array_equal(tokens[t], ref_tokens[t], err_msg=f"step {t}")
        assert metrics[t]["rollout_lag"] == ref_metrics[t]["rollout_lag"] == t - max(t - k, 0)
        for key in ("loss", "mismatch_kl", "mismatch_kl_staleness"):  # the trainer's side: the same programs
            np.testing.assert_allclose(metrics[t][key], ref_metrics[t][key], rtol=1e-6, atol=1e-9, err_msg=key)
    assert ref_metrics[-1]["mismatch_kl_staleness"] > 1e-4  # the params moved: a lagged policy was sampled
    for a, b in zip(jax.tree.leaves((params, window)), jax.tree.leaves((ref_params, ref_window))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_sampler_process_samples_as_the_in_place_mode_and_a_killed_one_is_restarted(tmp_path, in_place,
                                                                                       monkeypatch):
    """The worker samples every step (none in the trainer's process) and the run equals the in-place k-lag mode's,
    though the worker is killed with SIGKILL right after step 1's request is written (it may be reading it): the
    trainer sees the exit while it polls, starts a new worker, which reads the last params version and the
    pending request; steps 0 and 2 run on the first and the restarted worker undisturbed."""
    def not_here(*_):
        raise AssertionError("sampled in the trainer's process")

    monkeypatch.setattr(OPDStep, "sample_rows", not_here)  # this process's class only: the worker samples
    write, killed = ProcessSampler.write_request, []

    def write_then_kill(self, step, *args):
        write(self, step, *args)
        if step == 1:
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)

    monkeypatch.setattr(ProcessSampler, "write_request", write_then_kill)
    logs = []
    cfg = _config(tmp_path, f"rollout.staleness={K}", "rollout.placement=process", "train.stall_timeout_s=300")
    got = _train(cfg, log=logs.append)
    _assert_same_run(got, in_place)
    client = got[3]
    assert client.restarts == 1 and len(killed) == 1
    restarted = [m for m in logs if "restarted" in m]
    assert len(restarted) == 1 and f"the sampler process (pid {killed[0]}) exited" in restarted[0]
    assert "from params version 0" in restarted[0]  # step 1 samples with step 0's params (k = 1): the last written
    assert client.process is None  # closed: the worker stopped
    assert exlib.Exchange(tmp_path / "run" / "exchange").keys() == []  # and its exchange emptied


@pytest.mark.slow
def test_a_queue_of_requests_samples_ahead_as_the_in_place_mode_through_a_restart(tmp_path, monkeypatch):
    """rollout.queue=2 with k=2: at step n the trainer sends steps n and n+1's requests (n+1's with the window's
    params of step n-1), so the worker samples ahead; the run equals the in-place 2-lag mode's bit for bit. The
    worker is stopped before step 1's request (queued during step 0) is written and killed after: the restarted
    one answers the queued requests in the store, steps 1 to 3 (step 0 by either). After each read, the store holds
    the unread requests and only the params versions they read (step 3 is the first with version 1)."""
    steps, k = 4, 2
    (tmp_path / "in_place").mkdir(), (tmp_path / "process").mkdir()
    want = _train(_config(tmp_path / "in_place", f"rollout.staleness={k}"), steps=steps)
    write, killed = ProcessSampler.write_request, []

    def stop_write_kill(self, step, *args):
        if step == 1:
            os.kill(self.pid, signal.SIGSTOP)  # it answers nothing more: step 1's request survives it
        write(self, step, *args)
        if step == 1:
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)

    monkeypatch.setattr(ProcessSampler, "write_request", stop_write_kill)
    stored = []

    def after_read(client):
        stored.append((client.exchange.names("request"), client.exchange.names("params")))

    cfg = _config(tmp_path / "process", f"rollout.staleness={k}", "rollout.placement=process", "rollout.queue=2",
                  "train.stall_timeout_s=300")
    got = _train(cfg, steps=steps, after_read=after_read)
    _assert_same_run(got, want, steps, k)
    client = got[3]
    assert client.restarts == 1 and len(killed) == 1
    new = client.sampled_by[1]
    assert new != killed[0] and client.sampled_by[0] in (killed[0], new)
    assert client.sampled_by[2] == client.sampled_by[3] == new
    assert stored == [([1], [0]), ([2], [0]), ([3], [1]), ([], [1])]


def test_a_stalled_sampler_process_is_named_and_a_failed_one_is_not_restarted(tmp_path, monkeypatch):
    """The worker is alive but never answers (stopped with SIGSTOP): past train.stall_timeout_s the trainer stops
    with one line naming it by pid, instead of waiting silently; without the timeout it says so every NOTICE_S.
    Let go (at the notice), the worker fails to build its sampler (it is given no student config): its own error
    is raised in the trainer, with no restart."""
    import dataclasses

    from jopd.run import sampler_process, stall

    logs = []

    def log(line):
        logs.append(line)
        os.kill(client.pid, signal.SIGCONT)

    cfg = _config(tmp_path, "rollout.placement=process", "train.stall_timeout_s=0.5")
    client = ProcessSampler(cfg, None, (), log=log)
    try:
        os.kill(client.pid, signal.SIGSTOP)
        ex = client.exchange
        ex.write_request(0, 0, np.zeros(2, np.uint32), {"prompt_tokens": np.zeros((2, 3), np.int32)})
        with pytest.raises(stall.StallError, match=rf"^train.stall_timeout_s=0.5: step 0: the sampler process "
                                                   rf"\(pid {client.pid}\) has not finished after 0.5 s"):
            client.wait(0, 0)
        assert not logs
        client.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stall_timeout_s=None))
        monkeypatch.setattr(sampler_process, "NOTICE_S", 0.3)
        with pytest.raises(RuntimeError, match=rf"^rollout.placement=process: the sampler process \(pid "
                                               rf"{client.pid}\) failed: ValueError: build_step: one "
                                               r"RunConfig.teacher"):
            client.wait(0, 0)
        assert logs[0] == f"step 0: waiting for the sampler process (pid {client.pid}) for 0.3 s " \
                          f"(train.stall_timeout_s stops the run instead)"
        assert client.restarts == 0
    finally:
        if client.process.exitcode is None:
            os.kill(client.pid, signal.SIGCONT)
        client.close()


@pytest.mark.parametrize("where", ["file", "memory"])
def test_the_exchange_publishes_whole_arrays_and_cleans_up(tmp_path, where):
    """The whole exchange through TensorStore's kvstore, on a local directory (driver `file`) and in memory (driver
    `memory`): arrays without their marker are not published; a published group reads back its arrays (values and
    dtypes); stale params versions and read steps are deleted, arrays and marker; `clear` leaves no key."""
    root = tmp_path / "ex" if where == "file" else f"memory://ex{os.getpid()}"
    ex = exlib.Exchange(root)
    ex.clear()
    rows = {"prompt_tokens": np.arange(6, dtype=np.int32).reshape(2, 3), "prompt_mask": np.ones((2, 3), bool)}
    assert ex.pending_request() is None
    ex.write_arrays("arrays/request/5/", rows)  # a request being written: its marker not yet
    assert ex.pending_request() is None and ex.meta("request", 5) is None and ex.names("request") == []
    ex.write_request(4, 2, np.array([1, 2], np.uint32), rows)
    assert ex.pending_request() == 4
    meta, got = ex.read("request", 4)
    assert meta["version"] == 2 and meta["key"] == [1, 2]
    for k in rows:
        np.testing.assert_array_equal(got[k], rows[k])
        assert got[k].dtype == rows[k].dtype
    ex.write_rollout(4, {"tokens_BxN": np.ones((2, 5), np.int32)}, 7)
    assert ex.pending_request() is None and ex.meta("rollout", 4)["iterations"] == 7
    for v in (0, 1, 2, 10):
        ex.write_params(v, {"embed": np.full((2, 2), v, np.float32)})
    ex.drop_params_before(2)
    assert ex.names("params") == [2, 10] and ex.read_params(2)["embed"][0, 0] == 2
    assert not [k for k in ex.keys() if k.startswith(("arrays/params/v0/", "arrays/params/v1/"))]
    ex.delete("request", 4)
    assert ex.names("request") == [] and not [k for k in ex.keys() if k.startswith("arrays/request/4/")]
    assert ex.error() is None
    ex.write_error("ValueError: x")
    assert ex.error() == "ValueError: x"
    ex.clear()
    assert ex.keys() == []
    if where == "file":  # the kvstore's keys are the directory's files
        assert not [p for p in (tmp_path / "ex").rglob("*") if p.is_file()]


def test_the_exchange_kvstore_spec():
    """`rollout.exchange_dir` as a kvstore spec, against TensorStore's own URL parser (gs:// is not opened: no bucket
    is reachable here)."""
    import tensorstore as ts

    for url in ("gs://bkt/p", "gs://bkt/a/b/", "gs://bkt", "memory://ex"):  # a directory: its path ends in '/'
        want = ts.KvStore.Spec(url if url.endswith("/") or url == "gs://bkt" else url + "/").to_json()
        assert exlib.kvstore_spec(url) == want, url
    assert exlib.kvstore_spec("rel/dir") == {"driver": "file", "path": os.path.abspath("rel/dir") + "/"}
    with pytest.raises(ValueError, match="^exchange s3://b/p: a local directory"):
        exlib.kvstore_spec("s3://b/p")
    # a bucket is polled 100x less often than a directory (each list request is billed)
    assert exlib.poll_interval("gs://bkt/p") == exlib.REMOTE_POLL_S == 100 * exlib.poll_interval("rel/dir")


def test_the_lookahead_yields_the_next_steps_batches_and_leaves_the_loops_iterator(tmp_path):
    """From a resumed position (2 batches read), after each of the loop's batches the `Lookahead` gives the next
    two steps' batches: the very batches the loop's own iterator yields next, which it still does."""
    from jopd.run.model_sources import run_tokenizer

    cfg = _config(tmp_path)
    tok = run_tokenizer(cfg)
    loop_it = train_iterator(cfg.data, tok, kind="prompt")
    next(loop_it), next(loop_it)
    lookahead = Lookahead(train_iterator(cfg.data, tok, kind="prompt"), loop_it, 2)
    loop, ahead = [], []
    for _ in range(5):
        loop.append(next(loop_it)["index"])
        ahead.append([b["index"] for b in lookahead.ahead()])
    assert len({a.tobytes() for a in loop}) == 5  # distinct batches: the comparison below can fail
    for n in range(3):
        assert len(ahead[n]) == 2
        for j in range(2):
            np.testing.assert_array_equal(ahead[n][j], loop[n + 1 + j])


def test_process_placement_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.exchange_dir=/x: only with rollout.placement=process"):
        _config(tmp_path, "rollout.exchange_dir=/x")
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.exchange_dir=s3://b/x: a local directory or gs://"):
        _config(tmp_path, "rollout.placement=process", "rollout.exchange_dir=s3://b/x")
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.queue=2: only with rollout.placement=process"):
        _config(tmp_path, "rollout.staleness=2", "rollout.queue=2")
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.queue=3: at most rollout.staleness=2"):
        _config(tmp_path, "rollout.placement=process", "rollout.staleness=2", "rollout.queue=3")
    cfg = _config(tmp_path, "rollout.placement=process", "rollout.exchange_dir=gs://bkt/x")  # accepted
    assert exlib.kvstore_spec(cfg.rollout.exchange_dir) == {"driver": "gcs", "bucket": "bkt", "path": "x/"}
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.sampler_devices=2: only with "
                                          r"rollout.placement=disaggregated or process$"):
        _config(tmp_path, "rollout.sampler_devices=2")
    # rollout.sampler_devices with placement process: the worker's share of the process's 8 devices, checked before
    # the worker starts (`run.device_split`, `opd.placement`)
    cfg = _config(tmp_path, "rollout.placement=process", "rollout.sampler_devices=8")
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=8: must be between 1 and 7 \(the sampler "
                                          r"process's share of this host's 8 CPU devices"):
        build(cfg, log=lambda *_: None)
    cfg = _config(tmp_path, "rollout.placement=process", "rollout.sampler_devices=4", "sampling.mesh.data=3")
    with pytest.raises(ValueError, match=r"^sampling.mesh.data=3: does not divide the 4 devices "
                                         r"rollout.sampler_devices gives the sampler process$"):
        build(cfg, log=lambda *_: None)
    assert placement.split_devices(_config(tmp_path, "rollout.placement=process", "rollout.sampler_devices=3")) == \
        (jax.devices()[3:], [])  # the trainer's share on CPU; none of the sampler's in this process
