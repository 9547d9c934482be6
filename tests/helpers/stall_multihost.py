"""One of two trainer processes (1 CPU device each, localhost coordinator) in which process STALLED's sampler process
stalls (stopped with SIGSTOP) under `train.stall_timeout_s`, while the other process waits in a collective with it
(as a trainer process waits in `ProcessSampler.sample`'s gather of the decode iterations). Both run through
`jopd.cli.main` with `jopd train`'s command replaced by this stand-in, so the stall ends the process by the CLI's
own path (run by tests/opd/test_process_sampler_multihost.py, not collected by pytest).

usage: python tests/helpers/stall_multihost.py OUT_DIR CONFIG_YAML OVERRIDE...
env: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
Prints `worker pid N` (the stalled process), `waiting in a collective` (the other; then `collective returned` if it
ever does).
"""

import os
import signal
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

STALLED = 0


def stalled_train(args) -> int:
    """`jopd train`'s stand-in: a sampler process that never answers step 0's request (the stalled process), or a
    collective the stalled process never joins (the other)."""
    from jopd.parallel import distributed
    from jopd.run.config import load_config
    from jopd.run.sampler_process import ProcessSampler

    cfg = load_config(args.config, args.overrides)
    assert distributed.maybe_initialize({"initialization_timeout_s": 60}), "JAX_COORDINATOR_ADDRESS unset?"
    # a collective both join first, as a run's steps do: the collectives are set up (gloo's context on CPU), so the
    # next one waits on the stalled process itself
    assert distributed.gather_to_host(np.int32(jax.process_index())).tolist() == [0, 1]
    if jax.process_index() != STALLED:
        print("waiting in a collective", flush=True)
        distributed.gather_to_host(np.int32(1))
        print("collective returned", flush=True)
        return 0
    client = ProcessSampler(cfg, None, ())  # never builds its sampler: it is stopped first
    try:
        os.kill(client.pid, signal.SIGSTOP)
        print(f"worker pid {client.pid}", flush=True)
        client.exchange.write_request(0, 0, np.zeros(2, np.uint32), {"prompt_tokens": np.zeros((2, 3), np.int32)})
        client.wait(0, 0)
    finally:  # as `run.loop.train` closes its sampler process
        client.close()
    return 0


if __name__ == "__main__":
    from jopd import cli
    from jopd.commands import train

    train.run = stalled_train
    sys.exit(cli.main(["train", *sys.argv[2:]]))
