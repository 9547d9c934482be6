"""`rollout.partial` in the OPD step (`jopd.opd.partial_rollout`): a tiny run with the sampler over two batch shards
carries rows across steps (each shard its own queue and carried rows), logs each token's lag and the older
version's share, splits the exact mismatch with each token's r from its own version's params (numpy), resumes from
an Orbax checkpoint (the carry restored with the state, split over the shards) bit for bit, and refuses what it
does not go with in one line."""

from pathlib import Path

import jax
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.data.pipeline import train_iterator
from jopd.run.checkpoint import CheckpointConfig, Checkpointer
from jopd.run.config import load_config
from jopd.run.loop import build
from tests.helpers.reference_kl import kl64
from tests.helpers.tiny_testbed import tiny_cache, write_tiny
from tests.opd.test_staleness import _bits, _steps, _trainer_logprobs

# the trainer on one batch shard (the 8 test devices over `tensor`, the tiny dims replicated), the sampler on a
# mesh of its own with two batch shards: each runs its own queue of 2 slots
ONE_SHARD = ["mesh.data=1", "mesh.tensor=-1", "mesh.on_indivisible=replicate"]
TWO_SAMPLER_SHARDS = ["sampling.mesh.data=2", "sampling.mesh.tensor=4", "sampling.mesh.on_indivisible=replicate"]


def _config(tmp: Path, steps: int, *extra: str):
    path = write_tiny(tmp / "tiny.yaml", train={"steps": steps, "eval_problems": 8, "eval_max_new_tokens": 4},
                      optim={"learning_rate": 3e-2, "warmup_steps": 0}, sampling={"max_new_tokens": 16})
    over = [f"train.cache_dir={tiny_cache()}", "rollout.staleness=1", "rollout.partial=true", "sampling.slots=4",
            "train.mismatch=exact", *ONE_SHARD, *TWO_SAMPLER_SHARDS, *extra]
    return load_config(str(path), [*over, f"train.out_dir={tmp / 'run'}"])


@pytest.mark.slow  # ~30 s on 2 cores: 8 steps of the tiny testbed, a checkpoint and a restore
def test_partial_run_carries_rows_logs_their_lag_splits_per_token_and_resumes_bit_identical(tmp_path):
    steps = 4
    cfg = _config(tmp_path, steps)
    run, state = build(cfg, log=lambda *_: None)
    opd = run.step
    assert len(state.policies) == 2 and state.carry.lengths_S.shape == (4,) and opd.sampler.shards == 2
    # the carry's rows split over the sampler's two batch shards (2 each), not replicated
    assert {s.index[0].indices(4) for s in state.carry.tokens_SxN.addressable_shards} == {(0, 2, 1), (2, 4, 1)}
    data = train_iterator(cfg.data, run.tokenizer, kind="prompt")
    final, params, _, rollouts, metrics = _steps(opd, state, run.teacher_params, data, 0, steps)
    old = [m["rollout_old_frac"] for m in metrics]
    assert max(old) > 0, "no token of an older version in any batch: nothing was carried with tokens"
    for t in range(steps):
        m, r = metrics[t], rollouts[t]
        tags = np.asarray(r.partial.version_BxN)
        lengths = np.asarray(r.sample.lengths_B)
        real = np.arange(tags.shape[1])[None] < lengths[:, None]
        v, older = max(t - 1, 0), max(t - 2, 0)
        assert set(np.unique(tags[real])) <= {v, older} and (tags[~real] == -1).all()
        np.testing.assert_allclose(m["rollout_lag"], (t - tags[real]).mean(), rtol=1e-6)
        np.testing.assert_allclose(m["rollout_old_frac"], (tags[real] < v).mean(), rtol=1e-6)
        assert 0 < r.useful_fraction(lengths) <= 1
        # each shard hands on its 4 rows, all its own: a new row by its place in its step's batch, a priming one
        # by its carry slot (2 per shard)
        ids = r.host_batch["index"]
        np.testing.assert_array_equal(np.where(ids >= 0, (ids % 8) // 4, (-1 - ids) // 2), np.arange(8) // 4)
        # numpy's split: q the sampler's log-softmax, r per token from its tagged version's params, p theta_t
        log_q = np.asarray(r.sample.full_logprobs_BxNxV, np.float64)
        log_r = np.where((tags == v)[..., None], _trainer_logprobs(params[v], opd.student_cfg, r)[0],
                         _trainer_logprobs(params[older], opd.student_cfg, r)[0])
        log_p, mask = _trainer_logprobs(params[t], opd.student_cfg, r)
        ref = {"mismatch_kl": kl64(log_q, log_p), "mismatch_kl_engine": kl64(log_q, log_r),
               "mismatch_kl_staleness": kl64(log_r, log_p)}
        for name, kl in ref.items():
            np.testing.assert_allclose(m[name], kl[mask].mean(), rtol=2e-3, atol=1e-6, err_msg=f"step {t} {name}")

    # the loop's checkpoint after step 2 (state with its carry, and the iterator), restored into the abstract state
    data = train_iterator(cfg.data, run.tokenizer, kind="prompt")
    mid = _steps(opd, opd.init_state(jax.device_get(params[0])), run.teacher_params, data, 0, 2)[0]
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), async_save=False)) as ckpt:
        assert ckpt.save(2, mid, data, force=True)
        ckpt.wait()
        restored = ckpt.restore_latest(opd.abstract_state(), train_iterator(cfg.data, run.tokenizer, kind="prompt"))
    assert restored.step == 2
    assert restored.state.carry.tokens_SxN.sharding == state.carry.tokens_SxN.sharding  # split, as saved
    resumed = _steps(opd, restored.state, run.teacher_params, restored.iterator, 2, steps)[0]
    assert _bits(resumed) == _bits(final)  # params, optimizer state, window and carry


@pytest.mark.parametrize("over, conflict", [
    (["rollout.staleness=0"], "rollout.staleness=0"),
    (["sampling.slots=0"], "sampling.slots=0"),
    (["rollout.placement=disaggregated", "rollout.sampler_devices=2"], "rollout.placement=disaggregated"),
    (["loss.kind=reinforce"], "loss.kind=reinforce"),
    (["sampling.samples_per_prompt=2"], "sampling.samples_per_prompt=2"),
])
def test_partial_conflicts_are_one_line_naming_both_fields(tmp_path, over, conflict):
    with pytest.raises(ConfigError, match=rf"^RunConfig\.rollout\.partial: not with {conflict} ") as err:
        _config(tmp_path, 3, *over)
    assert "\n" not in str(err.value)
