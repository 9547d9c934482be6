"""Two cooperating processes (2 x 4 CPU devices, localhost coordinator, gloo) give the 1-process logits."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jopd import parallel as M
from tests.helpers import multiprocess_worker as worker

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(out_dir: Path, script: str = "multiprocess_worker.py", args=()) -> list[str]:
    """tests/helpers/`script` OUT_DIR ARGS... in two cooperating processes: their outputs."""
    port = _free_port()
    procs = []
    for pid in range(2):
        # proxy variables can make gRPC route 127.0.0.1 through a proxy and hang the coordinator handshake
        env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
        env = {**env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid), "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)  # the worker sets 4 devices itself
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / script), str(out_dir),
                                       *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        raise AssertionError(f"2-process run timed out after {TIMEOUT_S}s:\n" + _fmt(outputs)) from None
    if any(p.returncode for p in procs):
        raise AssertionError(f"2-process run failed (exit codes {[p.returncode for p in procs]}):\n"
                             + _fmt(outputs))
    return outputs


def _fmt(outputs: list[str]) -> str:
    return "\n".join(f"--- process {i} (last 3000 chars) ---\n{o[-3000:]}" for i, o in enumerate(outputs))


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    outputs = _run_two_processes(tmp_path)
    print(_fmt(outputs))  # timings, shown with -s or on failure
    assert "loads batch rows 0:4" in outputs[0] and "loads batch rows 4:8" in outputs[1], _fmt(outputs)

    # 1-process reference: same params, same batch, same mesh shape over this process's 8 devices
    cfg = worker.CFG
    tokens, mask = worker.make_batch()
    params = worker.make_params()
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    fwd = M.make_sharded_forward(cfg, mesh, M.TRAIN_RULES, tokens.shape)
    one_process = np.asarray(fwd(jax.device_put(params, M.param_shardings(cfg, mesh, M.TRAIN_RULES)),
                                 tokens, mask))
    assert np.abs(one_process).max() > 1.0  # O(1) logits: the tolerance is meaningful
    for pid in range(2):
        two_process = np.load(tmp_path / f"logits_{pid}.npy")
        assert two_process.shape == (worker.BATCH, worker.LENGTH, cfg.vocab_size)
        np.testing.assert_allclose(two_process, one_process, atol=1e-4, rtol=0)


def test_single_process_helpers_and_config_errors(monkeypatch):
    from jopd.parallel import distributed as D
    from jopd.config_dataclass import ConfigError, build

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert D.maybe_initialize() is False  # nothing asks for several processes
    assert D.maybe_initialize({"enabled": "off", "coordinator_address": "127.0.0.1:1"}) is False
    with pytest.raises(ValueError, match=r"DistributedConfig.num_processes: required with coordinator_address"):
        D.maybe_initialize({"coordinator_address": "127.0.0.1:1"})
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"DistributedConfig.process_id: 2 must be < num_processes 2"):
        D.maybe_initialize()
    with pytest.raises(ConfigError, match=r"DistributedConfig.coordinator_address"):
        build(D.DistributedConfig, {"coordinator_address": "localhost"})

    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    sh = M.batch_sharding(mesh, M.TRAIN_RULES, (8, 4))
    assert D.process_batch_slice(8) == slice(0, 8) == D.process_batch_slice(8, sh)
    local = np.arange(32).reshape(8, 4)
    (glob,) = D.host_local_to_global((local,), sh)
    assert glob.sharding == sh
    np.testing.assert_array_equal(D.gather_to_host(glob), local)
