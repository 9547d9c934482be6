"""`jopd mismatch --staleness K`: the offline measure of bounded staleness from two checkpoints of a short tiny
testbed run. K = 0 is today's report bit for bit; with the trainer's own numerics the engine part is 0 and the
total is the staleness part; a K > 0 report against numpy from the two checkpoints' params; one-line errors."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jopd import cli
from jopd.data.pipeline import train_iterator
from jopd.lab import runs
from jopd.lab.mismatch import measure_config
from jopd.models import transformer
from jopd.opd.batch import sequence_layout
from jopd.run.checkpoint import CheckpointConfig, Checkpointer
from jopd.run.loop import build
from tests.helpers.tiny_testbed import tiny_cache, write_tiny
from tests.helpers.reference_kl import kl64, log_softmax64

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """A 3-step tiny run with a checkpoint at every step (1, 2, 3) and params that move."""
    tmp = tmp_path_factory.mktemp("stale")
    cfg = write_tiny(tmp / "tiny.yaml", train={"steps": 3, "eval_problems": 8, "eval_max_new_tokens": 4},
                     optim={"learning_rate": 3e-2, "warmup_steps": 0},
                     checkpoint={"every": 1, "keep": 3, "async_save": False})
    run_dir = tmp / "run"
    assert cli.main(["train", str(cfg), f"train.out_dir={run_dir}", f"train.cache_dir={tiny_cache()}"]) == 0
    return run_dir


def _cfg(run_dir, *overrides):
    return runs.run_config(run_dir, [f"train.cache_dir={tiny_cache()}", "train.mismatch=exact", *overrides])


def test_staleness_0_is_the_plain_report_bit_for_bit(stale_run):
    cfg = _cfg(stale_run)
    plain, at = measure_config(cfg, str(stale_run), 3, batches=1, resamples=200, **QUIET)
    zero, at0 = measure_config(cfg, str(stale_run), 3, batches=1, resamples=200, staleness=0, **QUIET)
    assert at == at0 == 3 and plain.split is None
    drop = lambda d: {k: v for k, v in d.items() if k not in ("wall_s", "split")}  # noqa: E731
    assert drop(zero.to_dict()) == drop(plain.to_dict())  # every figure, exactly
    sp = zero.split
    assert (sp.staleness, sp.sampler_step, sp.trainer_step) == (0, 3, 3)
    assert sp.engine_kl == plain.exact_kl and dataclasses.astuple(sp.staleness_kl) == (0.0, 0.0, 0.0)


def test_trainer_numerics_engine_part_is_zero_and_the_total_is_staleness(stale_run, tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["mismatch", str(stale_run / "config.yaml"), f"train.cache_dir={tiny_cache()}", "--checkpoint",
            str(stale_run), "--staleness", "1", "--batches", "1", "--resamples", "200", "--json", str(out)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "rollouts sampled at step 2 (staleness 1)" in text and "staleness KL(r || p)" in text
    rep = json.loads(out.read_text())
    sp = rep["split"]
    assert (sp["staleness"], sp["sampler_step"], sp["trainer_step"], rep["student_step"]) == (1, 2, 3, 3)
    total, stale = rep["exact_kl"]["mean"], sp["staleness_kl"]["mean"]
    assert stale > 1e-3  # the params moved: a real lag
    assert sp["engine_kl"]["mean"] <= 1e-6 and abs(sp["cross"]["mean"]) <= 1e-6  # the engine is the trainer's
    assert total == pytest.approx(stale, rel=1e-4, abs=1e-6)


def test_stale_split_matches_numpy_from_the_two_checkpoints(stale_run):
    cfg = _cfg(stale_run, "rollout_precision.logit_noise=0.3")  # an engine part of its own
    rep, at = measure_config(cfg, str(stale_run), 3, batches=1, resamples=200, staleness=2, **QUIET)
    assert at == 3 and (rep.split.sampler_step, rep.split.trainer_step) == (1, 3)

    # independently: both param trees from the checkpoints, batch 0 sampled with step 1's, KL in numpy
    run, _ = build(cfg, **QUIET)
    opd = run.step
    with Checkpointer(CheckpointConfig(dir=str(stale_run / "checkpoints"), async_save=False)) as ckpt:
        old, new = (ckpt.restore(s, opd.abstract_state()).state for s in (1, 3))
    batch = next(train_iterator(cfg.data, run.tokenizer, kind="prompt"))
    with jax.set_mesh(opd.mesh):
        a = opd.rollout(new, batch, 0, old.params, 0).arrays
    lay = sequence_layout(a.prompt_BxP, a.prompt_mask_BxP, a.sample.tokens_BxN, a.sample.lengths_B)
    S, N = lay.tokens_BxS.shape[1], lay.targets_BxN.shape[1]
    temp = cfg.sampling.temperature

    def trainer(params):  # one plain forward, full logits, float64 log-softmax
        logits, _ = transformer.forward(jax.device_get(params), np.asarray(lay.tokens_BxS), cfg=opd.student_cfg,
                                        attn_mask_BxT=np.asarray(lay.attn_mask_BxS))
        return log_softmax64(np.asarray(logits, np.float64)[:, S - N - 1:S - 1] / temp)

    log_q, log_r, log_p = np.asarray(a.sample.full_logprobs_BxNxV, np.float64), trainer(old.params), trainer(new.params)
    mask = np.asarray(lay.response_mask_BxN, bool)
    ref = {"total": kl64(log_q, log_p)[mask].mean(), "engine": kl64(log_q, log_r)[mask].mean(),
           "staleness": kl64(log_r, log_p)[mask].mean()}
    assert ref["engine"] > 1e-3 and ref["staleness"] > 1e-3  # both parts are real here
    assert rep.n_tokens == mask.sum()
    np.testing.assert_allclose(rep.exact_kl.mean, ref["total"], rtol=2e-3)
    np.testing.assert_allclose(rep.split.engine_kl.mean, ref["engine"], rtol=2e-3)
    np.testing.assert_allclose(rep.split.staleness_kl.mean, ref["staleness"], rtol=2e-3)
    np.testing.assert_allclose(rep.split.cross.mean, ref["total"] - ref["engine"] - ref["staleness"],
                               atol=2e-3 * ref["total"])
    parts = rep.split.engine_kl.mean + rep.split.staleness_kl.mean + rep.split.cross.mean
    np.testing.assert_allclose(parts, rep.exact_kl.mean, rtol=1e-4)  # the parts add up, to rounding


@pytest.mark.parametrize("extra, message", [
    (["--step", "3", "--staleness", "5"],
     r"--staleness 5: step 3 - 5 = -2 is not saved in .* \(saved steps: \[1, 2, 3\]; both steps must be kept"),
    (["--staleness", "-1"], r"--staleness -1: must be >= 0"),
    (["--staleness", "1", "--no-checkpoint"], r"--staleness 1: needs --checkpoint"),
])
def test_bad_staleness_is_one_line(stale_run, capsys, extra, message):
    import re

    where = [] if "--no-checkpoint" in extra else ["--checkpoint", str(stale_run)]
    extra = [e for e in extra if e != "--no-checkpoint"]
    assert cli.main(["mismatch", str(stale_run / "config.yaml"), *where, *extra]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jopd mismatch: error:")]
    assert len(err) == 1 and re.search(message, err[0]), err
