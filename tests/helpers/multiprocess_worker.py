"""One process of the 2-process mesh test (run by tests/parallel/test_mesh_multiprocess.py, not collected by pytest).

usage: python tests/helpers/multiprocess_worker.py OUT_DIR
env: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (read by jopd.parallel.distributed.maybe_initialize)
Writes OUT_DIR/logits_<process_id>.npy: the full global logits, gathered to this host.
"""

import os
import sys
import time

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)

if __name__ == "__main__":
    from tests.helpers.xla_test_flags import with_fast_compile

    os.environ["XLA_FLAGS"] = with_fast_compile("--xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jopd.models.config import ModelConfig  # noqa: E402

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
BATCH, LENGTH = 8, 16


def make_params() -> dict:
    """Host (numpy) params, identical on every process; random norms too so every weight matters."""
    from jopd.models import transformer as T

    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                        T.abstract_params(CFG))


def make_batch() -> tuple[np.ndarray, np.ndarray]:
    """The global batch (same on every process): tokens and a right-padding mask."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (BATCH, LENGTH), dtype=np.int32)
    lengths = np.array([16, 12, 9, 16, 3, 16, 16, 7])
    return tokens, np.arange(LENGTH)[None] < lengths[:, None]


def main(out_dir: str) -> None:
    from jopd import parallel as M
    from jopd.parallel import distributed

    log("initializing")
    assert distributed.maybe_initialize({"initialization_timeout_s": 60}), "expected a multi-process job (JAX_COORDINATOR_ADDRESS unset?)"
    pid = jax.process_index()
    log(f"process {pid}/{jax.process_count()}: {jax.local_device_count()} local, {jax.device_count()} global")
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    rules = M.TRAIN_RULES
    # Each process materializes only the shards its own devices hold (the sharded-loading path).
    params = jax.tree.map(lambda host, sh: jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx]),
                          make_params(), M.param_shardings(CFG, mesh, rules))
    tokens, mask = make_batch()
    batch_sh = M.batch_sharding(mesh, rules, tokens.shape)
    rows = distributed.process_batch_slice(BATCH, batch_sh)
    log(f"process {pid}: loads batch rows {rows.start}:{rows.stop}")
    tokens_g, mask_g = distributed.host_local_to_global((tokens[rows], mask[rows]), batch_sh)
    fwd = M.make_sharded_forward(CFG, mesh, rules, (BATCH, LENGTH))
    logits = fwd(params, tokens_g, mask_g)
    full = distributed.gather_to_host(logits)
    np.save(os.path.join(out_dir, f"logits_{pid}.npy"), np.asarray(full, np.float32))
    log(f"process {pid}: done, logits {full.shape}")
    jax.distributed.shutdown()
    log(f"process {pid}: shut down")


if __name__ == "__main__":
    main(sys.argv[1])
