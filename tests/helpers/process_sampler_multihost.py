"""One of two trainer processes (4 CPU devices each, localhost coordinator) training the tiny config with the
in-place 1-lag mode, then with a sampler process per trainer process (run by
tests/opd/test_process_sampler_multihost.py, not collected by pytest).

usage: python tests/helpers/process_sampler_multihost.py OUT_DIR CONFIG_YAML OVERRIDE...
env: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (read by jopd.parallel.distributed.maybe_initialize)
Writes OUT_DIR/<mode>.npz per mode (`colocated`, `process`; process 0 only): each step's global tokens and decode
iterations, the final params (gathered); and OUT_DIR/process_<index>.json: which worker pid sampled each step, the
restarts and their log lines, the pid killed, and its exchange's keys after the run. In the `process` mode process
KILL_PROCESS's worker is killed with SIGKILL right after step KILL_STEP's request is written (it may be reading it):
the run must go on as if it had not been.
"""

import json
import os
import signal
import sys

if __name__ == "__main__":
    from tests.helpers.xla_test_flags import with_fast_compile

    os.environ["XLA_FLAGS"] = with_fast_compile("--xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

STEPS = 3
KILL_PROCESS, KILL_STEP = 1, 1


def train(cfg, log=lambda *_: None) -> tuple[dict[str, np.ndarray], object]:
    """STEPS steps as the loop runs them: each step's global tokens and decode iterations, the final params' leaves
    (gathered to every host); the sampler process's client (closed) or None."""
    from jopd.data.pipeline import train_iterator
    from jopd.parallel.distributed import gather_to_host
    from jopd.run.loop import build

    run, state = build(cfg, log=log)
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    out = {}
    try:
        for t in range(STEPS):
            with jax.set_mesh(opd.mesh):
                state, _, rollout = opd(state, run.teacher_params, next(data), t)
            out[f"tokens_{t}"] = gather_to_host(rollout.sample.tokens_BxN)
            out[f"iterations_{t}"] = np.asarray(jax.device_get(rollout.decode_iterations))
    finally:
        if opd.remote is not None:
            opd.remote.close()
    out |= {f"params_{i}": x for i, x in enumerate(jax.tree.leaves(gather_to_host(state.params)))}
    return out, opd.remote


def kill_after_request(killed: list[int]) -> None:
    """This process's `ProcessSampler.write_request` kills the worker right after step KILL_STEP's request."""
    from jopd.run.sampler_process import ProcessSampler

    write = ProcessSampler.write_request

    def write_then_kill(self, step, *args):
        write(self, step, *args)
        if step == KILL_STEP:
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)

    ProcessSampler.write_request = write_then_kill


def main(out_dir: str, config: str, overrides: list[str]) -> None:
    from jopd.parallel import distributed
    from jopd.run.config import load_config
    from jopd.run.exchange import Exchange

    jax.config.update("jax_default_matmul_precision", "highest")  # the test suite's (tests/conftest.py)
    assert distributed.maybe_initialize({"initialization_timeout_s": 60}), "JAX_COORDINATOR_ADDRESS unset?"
    index = jax.process_index()
    killed, logs = [], []
    for mode in ("colocated", "process"):
        if mode == "process" and index == KILL_PROCESS:
            kill_after_request(killed)
        cfg = load_config(config, [*overrides, f"rollout.placement={mode}"])
        arrays, client = train(cfg, log=logs.append)
        if index == 0:
            np.savez(os.path.join(out_dir, f"{mode}.npz"), **arrays)
        if client is not None:
            info = {"pid": os.getpid(), "sampled_by": client.sampled_by, "restarts": client.restarts,
                    "killed": killed, "restart_logs": [line for line in logs if "restarted" in line],
                    "exchange": client.exchange.root, "keys": Exchange(client.exchange.root).keys()}
            with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
                json.dump(info, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
