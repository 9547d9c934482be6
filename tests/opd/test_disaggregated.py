"""`rollout.placement=disaggregated` (`jopd.opd.placement`): the sampler on 4 of the 8 CPU devices, the trainer on
the other 4, samples exactly what the in-place k-lag mode samples on all 8 for the same k (2), and trains to the same
params; each side's arrays stay on its own devices; the update does not output the window (so the next step's
rollout need not wait for it), nor the key; bad placements are one-line errors."""

import json

import jax
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import train_iterator
from jopd.opd import placement, staleness as stale
from jopd.run.config import load_config
from jopd.run.loop import build
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

SPLIT = ["rollout.placement=disaggregated", "rollout.sampler_devices=4"]


def _config(tmp, *over):
    path = write_tiny(tmp / "tiny.yaml", optim={"learning_rate": 3e-2, "warmup_steps": 0},  # params that move
                      rollout_precision={"logit_noise": 0.3})  # the engine's own noise: row-seeded, like the draws
    return load_config(str(path), [f"train.cache_dir={tiny_cache()}", f"train.out_dir={tmp / 'run'}",
                                   "train.mismatch=exact", *over])


def _train(cfg, steps: int):
    """`steps` steps as the loop runs them: per step the rollout's tokens and the metrics; the final state."""
    run, state = build(cfg, log=lambda *_: None)
    opd, data = run.step, train_iterator(cfg.data, run.tokenizer, kind="prompt")
    tokens, metrics = [], []
    try:
        for t in range(steps):
            with jax.set_mesh(opd.mesh):
                state, m, rollout = opd(state, run.teacher_params, next(data), t)
            tokens.append(np.asarray(rollout.sample.tokens_BxN))
            metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
    finally:
        if opd.remote is not None:  # a sampler process (rollout.placement=process) stops with the run
            opd.remote.close()
    return opd, state, tokens, metrics


def _raw(key) -> bytes:
    return np.asarray(jax.random.key_data(key)).tobytes()


def _devices(tree) -> set:
    return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


@pytest.mark.slow
def test_a_sampler_on_devices_of_its_own_samples_and_trains_as_the_in_place_k_lag_mode(tmp_path, k=2):
    """k = 2 here (the loop's test below runs k = 1)."""
    ref_step, ref_state, ref_tokens, ref_metrics = _train(_config(tmp_path, f"rollout.staleness={k}"), 4)
    opd, state, tokens, metrics = _train(_config(tmp_path, f"rollout.staleness={k}", *SPLIT), 4)
    devices = jax.devices()
    assert _devices(ref_state) == set(devices)
    # the trainer's state (params, moments, the window) on devices 4..7, the sampler's mesh on 0..3
    assert _devices(state) == set(devices[4:]) and set(opd.sampler_mesh.devices.flat) == set(devices[:4])
    assert opd.shardings.own_sampler_layout and set(opd.mesh.devices.flat) == set(devices[4:])
    for t in range(4):  # the same row seeds and lagged params: the very same tokens
        np.testing.assert_array_equal(tokens[t], ref_tokens[t], err_msg=f"step {t}")
        assert metrics[t]["rollout_lag"] == ref_metrics[t]["rollout_lag"] == t - max(t - k, 0)
        # the loss and the exact mismatch (engine + staleness) on 4 trainer devices vs 8: rounding apart
        for key in ("loss", "mismatch_kl", "mismatch_kl_staleness"):
            np.testing.assert_allclose(metrics[t][key], ref_metrics[t][key], rtol=2e-5, atol=1e-7, err_msg=key)
    assert metrics[3]["mismatch_kl_staleness"] > 1e-4  # the params moved: staleness is measured, not 0
    got, want = jax.device_get((state.params, state.policies)), jax.device_get((ref_state.params, ref_state.policies))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # Adam's 1/sqrt(v) scales a near-0 gradient's
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)       # rounding up: 4 steps at lr 3e-2


def test_the_update_leaves_the_window_out_so_the_next_rollout_need_not_wait(tmp_path):
    cfg = _config(tmp_path, "rollout.staleness=2", *SPLIT)
    run, state = build(cfg, log=lambda *_: None)
    core, window = stale.split_window(state)
    assert len(window) == 2 and not hasattr(core, "policies") and type(core).__name__ == "TrainState"
    data = train_iterator(cfg.data, run.tokenizer, kind="prompt")
    with jax.set_mesh(run.step.mesh):
        before, key = state.policies, _raw(state.rng)
        state, _, _ = run.step(state, run.teacher_params, next(data), 0)
    # the window moved on by reference: its arrays are the ones the step held before the update (and the copy of
    # step 0's params), never outputs of the update's program, which would make step 1's rollout wait for it
    assert all(a is b for a, b in zip(jax.tree.leaves(state.policies[0]), jax.tree.leaves(before[1])))
    assert _raw(state.rng) == key  # the weight-noise key's source: a copy made before the update (which donates it)
    assert not any(a is b for a, b in zip(jax.tree.leaves(state.policies[1]), jax.tree.leaves(state.params)))


def test_placement_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.sampler_devices: rollout.placement=disaggregated needs"):
        _config(tmp_path, "rollout.placement=disaggregated")
    with pytest.raises(ConfigError, match=r"^RunConfig.rollout.sampler_devices=2: only with rollout.placement=disaggregated or process"):
        _config(tmp_path, "rollout.sampler_devices=2")
    cfg = _config(tmp_path, "rollout.placement=disaggregated", "rollout.sampler_devices=8")
    with pytest.raises(ValueError, match=r"^rollout.sampler_devices=8: must be between 1 and 7"):
        placement.trainer_mesh(cfg)
    cfg = _config(tmp_path, *SPLIT, "sampling.mesh.data=3")
    with pytest.raises(ValueError, match=r"^sampling.mesh.data=3: does not divide the 4 devices rollout.sampler_devices"):
        build(cfg, log=lambda *_: None)


@pytest.mark.slow
def test_the_loop_trains_with_the_sampler_running_beside_the_update(tmp_path, monkeypatch):
    """`jopd train`'s loop dispatches step n+1's rollout before it reads step n's metrics: the two programs on
    their two device sets run together (XLA:CPU's simulated devices included) and the run ends as the direct
    step calls do.
    The direct run is also the reference of rollout.placement=process with rollout.sampler_devices=4: the sampler
    in a worker process on 4 CPU devices of its own (it reports its device count), the trainer on devices 4..7 of
    its process, the same sampler mesh {data: 4}: the very same tokens, the same loss and params (the same trainer
    programs on the same devices)."""
    from jopd.opd.step import OPDStep
    from jopd.run.loop import train

    # with the loop's stall watchdog on (`run.stall`): it polls each step's rollout and update before reading them
    cfg = _config(tmp_path, "rollout.staleness=1", *SPLIT, "train.steps=4", "train.stall_timeout_s=300")
    summary = train(cfg, log=lambda *_: None)
    _, state, tokens, metrics = _train(_config(tmp_path, "rollout.staleness=1", *SPLIT, "train.steps=4"), 4)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "loss" in m]
    assert [m["step"] for m in logged] == [1, 2, 3, 4] and summary["steps"] == 4
    for got, want in zip(logged, metrics):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
        assert got["rollout_lag"] == want["rollout_lag"]

    def not_here(*_):
        raise AssertionError("sampled in the trainer's process")

    monkeypatch.setattr(OPDStep, "sample_rows", not_here)  # this process's class only: the worker samples
    (tmp_path / "process").mkdir()
    cfg = _config(tmp_path / "process", "rollout.staleness=1", "rollout.placement=process",
                  "rollout.sampler_devices=4", "train.steps=4", "train.stall_timeout_s=300")
    opd, got_state, got_tokens, got_metrics = _train(cfg, 4)
    assert opd.remote is not None and opd.remote.worker_devices == 4 and jax.device_count() == 8
    assert _devices(got_state) == _devices(state) == set(jax.devices()[4:])  # the trainer's state: 4..7 only
    for t in range(4):
        np.testing.assert_array_equal(got_tokens[t], tokens[t], err_msg=f"step {t}")
        assert got_metrics[t]["rollout_lag"] == metrics[t]["rollout_lag"] == min(t, 1)
        for key in ("loss", "mismatch_kl", "mismatch_kl_staleness"):
            np.testing.assert_allclose(got_metrics[t][key], metrics[t][key], rtol=1e-6, atol=1e-9, err_msg=key)
    assert metrics[3]["mismatch_kl_staleness"] > 1e-4  # the params moved: a lagged policy was sampled
    got, want = jax.device_get((got_state.params, got_state.policies)), jax.device_get((state.params, state.policies))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
