"""One of two cooperating CPU processes polling PreemptionGuard each step (run by test_checkpoint.py).

usage: python tests/helpers/preemption_multiprocess.py PROCESS_ID PORT
Prints `ready` once inside the guard, `step N` every 20 steps, and `exit N` at the step it stopped at.
"""

import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jopd.run.checkpoint import PreemptionGuard


def main(process_id: int, port: int) -> int:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    step = 0
    with PreemptionGuard() as guard:
        print("ready", flush=True)
        while step < 100_000:
            step += 1
            multihost_utils.process_allgather(np.int32(step))  # a collective per step, as a train step has
            time.sleep(0.005)
            if step % 20 == 0:
                print(f"step {step}", flush=True)
            if guard.should_stop(step):
                break
    print(f"exit {step}", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
