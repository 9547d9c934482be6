"""Checkpointer: bit-identical pytree round trip (typed PRNG keys, optax state, resharding), keep-last-N, metadata,
async safety, and a SIGTERM-preempted subprocess that saves, exits 0 and resumes."""

import importlib.util
import os
import signal
import socket
import subprocess
import time
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd.run.checkpoint import CheckpointConfig, Checkpointer, PreemptionGuard
from tests.helpers.xla_test_flags import FAST_COMPILE
from jopd.config_dataclass import ConfigError, build
from jopd.data import DataConfig, build_toy_tokenizer, train_iterator

REPO = Path(__file__).resolve().parents[2]


def _bits(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _assert_bit_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert _bits(x).tobytes() == _bits(y).tobytes()


def _train_state(mesh):
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((16, 8), np.float32)
    params = {"embed": jax.device_put(embed, NamedSharding(mesh, P("data", "model"))),
              "scale": jax.device_put(np.ones((8,), jnp.bfloat16), NamedSharding(mesh, P()))}
    opt = optax.adamw(1e-3)

    @jax.jit
    def one_update(params):  # non-trivial moments and count; one compile instead of many eager ops
        opt_state = opt.init(params)
        return opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)[1]

    with jax.set_mesh(mesh):
        opt_state = one_update(params)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(7),
            "rng": jax.random.key(42), "rbg_keys": jax.random.split(jax.random.key(3, impl="rbg"), 4)}


def test_state_round_trip_is_bit_identical_and_reshards(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = _train_state(mesh)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1)) as ckpt:
        assert ckpt.restore_latest(state) is None
        assert ckpt.save(7, state, metadata={"step": 7, "note": "x"})
    # Restore into a different mesh layout, given as abstract arrays with shardings.
    other = jax.make_mesh((4, 2), ("data", "model"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P())),
                            state)
    abstract["params"]["embed"] = jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                                       sharding=NamedSharding(other, P("model", "data")))
    with Checkpointer(CheckpointConfig(dir=str(tmp_path))) as ckpt:
        restored = ckpt.restore_latest(abstract)
        assert ckpt.metadata() == {"step": 7, "note": "x"}
    assert restored.step == 7 and restored.iterator is None
    _assert_bit_identical(restored.state, state)
    assert restored.state["rng"].dtype == state["rng"].dtype  # typed key<fry>, not raw uint32
    assert str(restored.state["rbg_keys"].dtype) == "key<rbg>"
    assert restored.state["params"]["embed"].sharding == abstract["params"]["embed"].sharding
    assert restored.state["params"]["scale"].sharding == abstract["params"]["scale"].sharding


def test_keep_last_n_and_every_k(tmp_path):
    state = {"w": jnp.arange(3.0)}
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=2, keep=2)) as ckpt:
        saved = [step for step in range(1, 8) if ckpt.save(step, {"w": state["w"] + step})]
        assert saved == [2, 4, 6]
        assert ckpt.save(7, {"w": state["w"] + 7}, force=True)  # e.g. on preemption
        assert not ckpt.save(7, state, force=True)  # a step is never written twice
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7]
        restored = ckpt.restore_latest({"w": state["w"]})
    assert restored.step == 7 and restored.state["w"].tolist() == [7.0, 8.0, 9.0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["6", "7"]


def test_async_save_is_safe_against_donation_and_iterator_advance(tmp_path):
    tok = build_toy_tokenizer()
    data_cfg = DataConfig(batch_size=2)
    state = {"w": jnp.full((256, 256), 3.0)}
    it = train_iterator(data_cfg, tok)
    next(it)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1, async_save=True)) as ckpt:
        ckpt.save(1, state, it)
        update = jax.jit(lambda s: {"w": s["w"] * 0}, donate_argnums=0)
        state = update(state)  # the saved buffers are donated while the save may still be writing
        expected_next = next(it)
        restored = None
        ckpt.wait()
        restored = ckpt.restore_latest({"w": state["w"]}, train_iterator(data_cfg, tok))
    assert float(restored.state["w"].min()) == float(restored.state["w"].max()) == 3.0
    assert np.array_equal(next(restored.iterator)["index"], expected_next["index"])


def test_restore_errors_and_config(tmp_path):
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1)) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(2)})
        ckpt.wait()
        with pytest.raises(ValueError, match=r"checkpoint .*/1 holds no data iterator position"):
            ckpt.restore_latest({"w": jnp.zeros(2)}, train_iterator(DataConfig(batch_size=1),
                                                                     build_toy_tokenizer()))
    with pytest.raises(ValueError, match=r"CheckpointConfig.dir: not set"):
        Checkpointer(CheckpointConfig())
    with pytest.raises(ConfigError, match=r"CheckpointConfig.keep: Input should be greater than or equal to 1"):
        build(CheckpointConfig, {"dir": "x", "keep": 0})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_preemption_guard_flag_and_handler_restore(sig):
    previous = signal.getsignal(sig)
    with PreemptionGuard() as guard:
        assert not guard.should_stop(1)
        os.kill(os.getpid(), sig)
        assert guard.requested and guard.should_stop(2)
    assert signal.getsignal(sig) is previous


def test_second_sigint_exits_at_once():
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)  # first Ctrl-C: finish the step, save, exit 0
        assert guard.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # second: now
            time.sleep(1)  # the handler runs here, on the main thread


def _load_loop():
    spec = importlib.util.spec_from_file_location("preemption_loop", REPO / "tests" / "helpers" / "preemption_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_preemption_signal_saves_exits_zero_and_resumes(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE}
    script = str(REPO / "tests" / "helpers" / "preemption_loop.py")
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, script, str(ckpt_dir), "100000", str(tmp_path / "a.npy")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("step 5"):
                proc.send_signal(sig)
                break
        lines += [line.strip() for line in proc.stdout]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    stopped = steps[-1]
    assert lines[0] == "start 0" and lines[-1] == f"exit {stopped}" and stopped >= 5
    with Checkpointer(CheckpointConfig(dir=str(ckpt_dir))) as ckpt:
        assert ckpt.latest_step() == stopped  # saved the step it finished, though `every` is 1000
        assert ckpt.metadata() == {"step": stopped, "preempted": True}

    total = stopped + 4
    out = subprocess.run([sys.executable, script, str(ckpt_dir), str(total), str(tmp_path / "b.npy")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == f"start {stopped}"
    assert out.stdout.splitlines()[-1] == f"exit {total}"
    # Params and data order after preempt + resume equal an uninterrupted run, bit for bit.
    expected = np.asarray(_load_loop().run_uninterrupted(total)["w"])
    assert np.load(tmp_path / "b.npy").tobytes() == expected.tobytes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_multiprocess_sigterm_on_one_host_stops_every_host_at_the_same_step():
    """jax.distributed with 2 CPU processes: SIGTERM to process 1 only -> both leave the loop at one step."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE}
    script, port = str(REPO / "tests" / "helpers" / "preemption_multiprocess.py"), str(_free_port())
    procs = [subprocess.Popen([sys.executable, script, str(i), port], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for i in range(2)]
    try:
        for line in procs[1].stdout:
            if line.startswith("step "):  # both are inside the guard and stepping together
                procs[1].send_signal(signal.SIGTERM)
                break
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    exits = [out.strip().splitlines()[-1] for out in outputs]
    assert exits[0] == exits[1] and exits[0].startswith("exit ")


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_step(tmp_path, damage):
    """A truncated or deleted file inside the latest step: restore warns naming it and resumes from the step
    before (never a crash, never silently older data); training can then save that step again."""
    rng = np.random.default_rng(0)
    states = {s: {"w": jnp.asarray(rng.normal(size=(4096,)), jnp.float32)} for s in (1, 2)}
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1, keep=5, async_save=False)) as ckpt:
        for s, st in states.items():
            ckpt.save(s, st, metadata={"step": s})
    files = [p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        if damage == "truncate":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        else:
            p.unlink()
    warnings = []
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1, keep=5, async_save=False)) as ckpt:
        restored = ckpt.restore_latest({"w": jnp.zeros(4096)}, warn=warnings.append)
        assert restored.step == 1
        np.testing.assert_array_equal(restored.state["w"], states[1]["w"])
        assert len(warnings) == 1 and f"{tmp_path}/2 does not restore" in warnings[0]
        assert "resuming from step 1" in warnings[0]
        assert ckpt.save(2, states[2], metadata={"step": 2})  # the damaged step 2 is replaced
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1, keep=5, async_save=False)) as ckpt:
        again = ckpt.restore_latest({"w": jnp.zeros(4096)}, warn=warnings.append)
        assert again.step == 2 and len(warnings) == 1
        np.testing.assert_array_equal(again.state["w"], states[2]["w"])


def test_no_restorable_step_is_an_error_that_touches_nothing(tmp_path):
    with Checkpointer(CheckpointConfig(dir=str(tmp_path), every=1, async_save=False)) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(8)})
        ckpt.save(2, {"w": jnp.ones(8)})
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(ValueError, match=r"no checkpoint restores \(tried steps 2, 1; step 2: "):
            ckpt.restore_latest({"w": jnp.zeros(3)})  # shapes of another config: not damage
    assert sorted(p.name for p in tmp_path.iterdir()) == before
