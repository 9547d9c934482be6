"""`rollout.placement=process` in a multi-process run: two trainer processes (4 CPU devices each, a localhost
coordinator), each with a sampler process of its own serving its host rows through its own exchange, sample the very
tokens of the same two processes' in-place 1-lag run and train to its params, though process 1's worker is killed
(SIGKILL) mid-run and restarted by process 1 alone. A process whose worker stalls ends the whole run at once."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jopd.opd import placement
from jopd.run.config import load_config
from jopd.run.loop import build
from jopd.run.sampler_process import exchange_dir, one_host
from tests.helpers.process_sampler_multihost import KILL_PROCESS, KILL_STEP, STEPS
from tests.helpers.stall_multihost import STALLED
from tests.helpers.tiny_testbed import tiny_cache, write_tiny
from tests.parallel.test_mesh_multiprocess import ROOT, _free_port, _run_two_processes


def _config_args(tmp) -> tuple[str, list[str]]:
    path = write_tiny(tmp / "tiny.yaml", optim={"learning_rate": 3e-2, "warmup_steps": 0},  # params that move
                      rollout_precision={"logit_noise": 0.3})  # the engine's own noise: row-seeded, like the draws
    return str(path), [f"train.cache_dir={tiny_cache()}", f"train.out_dir={tmp / 'run'}", "train.mismatch=exact",
                       "rollout.staleness=1"]


@pytest.mark.slow
def test_a_sampler_process_per_trainer_process_samples_as_the_in_place_multiprocess_run(tmp_path):
    path, overrides = _config_args(tmp_path)
    build(load_config(path, overrides), log=lambda *_: None)  # the tiny models, trained once here (cached)
    _run_two_processes(tmp_path, "process_sampler_multihost.py", [path, *overrides])
    ref, got = np.load(tmp_path / "colocated.npz"), np.load(tmp_path / "process.npz")
    assert sorted(got.files) == sorted(ref.files)
    for i in range(STEPS):  # each step's global tokens (both hosts' rows) and decode iterations (the longest row's)
        np.testing.assert_array_equal(got[f"tokens_{i}"], ref[f"tokens_{i}"], err_msg=f"step {i}")
        assert got[f"iterations_{i}"] == ref[f"iterations_{i}"], i
    assert len({ref[f"tokens_{i}"].tobytes() for i in range(STEPS)}) == STEPS  # the steps sampled different tokens
    params = [name for name in ref.files if name.startswith("params_")]
    assert params
    for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
    infos = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
    for i, info in enumerate(infos):  # each trainer process had workers of its own, and its own exchange, emptied
        assert info["exchange"] == str(tmp_path / "run" / "exchange" / f"p{i}") and info["keys"] == []
        assert info["pid"] not in info["sampled_by"].values()
    # process 1's worker, killed right after step 1's request was written, was restarted by process 1 (logged with
    # the killed pid) and the new one answered steps 1 and 2; process 0's one worker sampled every step
    killer, other = infos[KILL_PROCESS], infos[1 - KILL_PROCESS]
    assert other["restarts"] == 0 and other["killed"] == [] and other["restart_logs"] == []
    assert len(set(other["sampled_by"].values())) == 1
    (killed,) = killer["killed"]
    assert killer["restarts"] == 1 and len(killer["restart_logs"]) == 1
    assert killer["restart_logs"][0].startswith(f"step {KILL_STEP}: the sampler process (pid {killed}) exited")
    by = [killer["sampled_by"][str(t)] for t in range(STEPS)]
    assert by[:KILL_STEP] == [killed] * KILL_STEP and set(by[KILL_STEP:]) == {by[-1]} and by[-1] != killed
    assert "from params version 0" in killer["restart_logs"][0]  # step 1 samples with step 0's params (k = 1)
    assert not set(by) & set(other["sampled_by"].values())


def test_a_stalled_sampler_process_ends_the_whole_multiprocess_run(tmp_path):
    """Process 0's worker stalls (SIGSTOP) under train.stall_timeout_s while process 1 waits in a collective with
    process 0. Process 0 prints its one line naming its worker's pid and exits 2 at once, its worker ended (not left
    stopped); process 1 is ended by jax's coordination service (it went with process 0), well before the 100 s
    heartbeat or the 300 s shutdown barrier a normal exit would wait at."""
    path, overrides = _config_args(tmp_path)
    port, procs = _free_port(), []
    t0 = time.monotonic()
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower() and k != "XLA_FLAGS"}
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
                "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "stall_multihost.py"),
                                       str(tmp_path), path, *overrides, "rollout.placement=process",
                                       "train.stall_timeout_s=1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("the run did not end within 60 s:\n" + "\n".join(p.communicate()[0][-3000:]
                                                                              for p in procs)) from None
    elapsed = time.monotonic() - t0
    stalled, other = outputs[STALLED], outputs[1 - STALLED]
    report = f"--- stalled ---\n{stalled[-3000:]}\n--- other ---\n{other[-3000:]}"
    assert procs[STALLED].returncode == 2, report
    (pid,) = [int(line.split()[-1]) for line in stalled.splitlines() if line.startswith("worker pid ")]
    errors = [line for line in stalled.splitlines() if "error" in line]
    assert errors == [f"jopd train: error: train.stall_timeout_s=1: step 0: the sampler process (pid {pid}) has not "
                      f"finished after 1 s (a hung collective, a lost device, or a step slower than the timeout); "
                      f"the last checkpoint is intact"], report
    assert "Traceback" not in stalled, report
    assert not os.path.exists(f"/proc/{pid}"), report  # the stopped worker was ended, not left behind
    assert procs[1 - STALLED].returncode not in (0, None), report
    assert "waiting in a collective" in other and "collective returned" not in other, report
    assert elapsed < 60, elapsed


def test_one_hosts_share_of_a_multiprocess_config(tmp_path, monkeypatch):
    """A worker's config: one host's prompt rows, and a mesh its host's devices can form; the exchange per
    process; a multi-process run is no longer refused (disaggregated still is)."""
    path, overrides = _config_args(tmp_path)
    cfg = load_config(path, overrides + ["rollout.placement=process", "mesh.data=4", "mesh.fsdp=2"])
    assert one_host(cfg, 1) is cfg
    two = one_host(cfg, 2)
    assert two.data.batch_size == cfg.data.batch_size // 2 == 4
    assert (two.mesh.data, two.mesh.fsdp) == (2, 2) and two.sampling.mesh is None
    assert one_host(load_config(path, overrides), 2).mesh == load_config(path, overrides).mesh  # data: -1
    with pytest.raises(ValueError, match=r"^data.batch_size=8: not divisible by the 3 trainer processes"):
        one_host(cfg, 3)
    assert exchange_dir(cfg) == str(tmp_path / "run" / "exchange")
    assert exchange_dir(cfg, (1, 2)) == str(tmp_path / "run" / "exchange" / "p1")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    placement.check_placement(cfg, 8)  # accepted
    disagg = load_config(path, overrides + ["rollout.placement=disaggregated", "rollout.sampler_devices=2"])
    with pytest.raises(ValueError, match=r"^rollout.placement=disaggregated: one process only"):
        placement.check_placement(disagg, 8)
