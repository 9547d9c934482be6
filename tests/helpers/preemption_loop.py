"""A tiny resumable training-like loop under PreemptionGuard (run as a subprocess by test_checkpoint.py).

usage: python tests/helpers/preemption_loop.py CKPT_DIR NUM_STEPS OUT.npy
Prints `start S` (the step it resumed from), `step N` after every step, and `exit N` when it leaves.
"""

import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np

from jopd.run.checkpoint import CheckpointConfig, Checkpointer, PreemptionGuard


def data_iterator():
    ds = grain.MapDataset.range(1000).shuffle(seed=0).repeat().batch(2, drop_remainder=True)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def init_state():
    return {"w": jnp.zeros((4,), jnp.float32), "key": jax.random.key(0), "step": jnp.int32(0)}


@jax.jit
def step_fn(state, batch):
    key, sub = jax.random.split(state["key"])
    w = state["w"] + jax.random.normal(sub, (4,)) * batch.sum().astype(jnp.float32)
    return {"w": w, "key": key, "step": state["step"] + 1}


def run_uninterrupted(num_steps: int):
    state, it = init_state(), data_iterator()
    for _ in range(num_steps):
        state = step_fn(state, jnp.asarray(next(it)))
    return state


def main(ckpt_dir: str, num_steps: int, out: str) -> int:
    ckpt = Checkpointer(CheckpointConfig(dir=ckpt_dir, every=1000, keep=2))
    restored = ckpt.restore_latest(init_state(), data_iterator())
    state, it, step = restored if restored is not None else (init_state(), data_iterator(), 0)
    print(f"start {step}", flush=True)
    with PreemptionGuard() as guard:
        while step < num_steps:
            state = step_fn(state, jnp.asarray(next(it)))
            step += 1
            print(f"step {step}", flush=True)
            time.sleep(0.02)  # leaves the test time to signal mid-run
            stop = guard.should_stop(step)
            ckpt.save(step, state, it, {"step": step, "preempted": stop}, force=stop or step == num_steps)
            if stop:
                break
    ckpt.close()
    np.save(out, np.asarray(state["w"]))
    print(f"exit {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
