"""`jopd mismatch`'s measurement (`jopd.lab.mismatch`) through the production step's rollout: zero for identical
engines, the exact KL under logit noise against a numpy Monte-Carlo estimate of E[KL], estimators' signs, the
bootstrap CI against scipy, and the command end to end on the smoke config."""

import json

import jax
import numpy as np
import pytest
from scipy import special, stats

from jopd import cli
from jopd.lab import mismatch as measure
from jopd.lab.position_kl import position_mismatch
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.opd.batch import sequence_layout
from jopd.run.loop import OPDRun
from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, eos_token_id=None)
B, P, N = 64, 5, 12


def _run(*overrides):
    cfg = load_config(None, [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
                             "train.mismatch=exact", "mesh.data=1", "mesh.fsdp=1", "loss.kind=topk_rkl",
                             "loss.top_k=8", *overrides])
    step = build_step(cfg, CFG, (CFG,), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    params = numpy_params(CFG, seed=0, std=0.5)
    return OPDRun(cfg, step, teacher_params=None, tokenizer=None), step.init_state(params)


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_tokens": rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32),
             "prompt_mask": np.ones((B, P), np.int32)} for _ in range(n)]


def test_identical_engines_measure_zero():
    run, state = _run()
    rep = measure.measure(run, state, _batches(2), resamples=200, progress=False)
    assert rep.n_prompts == 2 * B and rep.n_tokens == 2 * B * N  # no EOS: every row runs N tokens
    assert abs(rep.exact_kl.mean) <= 1e-6 and abs(rep.k1.mean) <= 1e-6
    assert 0.0 <= rep.k3.mean <= 1e-6 and rep.max_abs_dprob.mean <= 1e-5
    assert rep.ess.mean == pytest.approx(1.0, abs=1e-6)


def test_logit_noise_exact_kl_matches_monte_carlo_expectation():
    sigma = 0.8
    run, state = _run(f"rollout_precision.logit_noise={sigma}")
    batch = _batches(1, seed=3)[0]
    rollout = run.step.rollout(state, batch, 0)
    terms = jax.jit(lambda p, a, m, s: position_mismatch(p, a, m, s, model_cfg=CFG, temperature=1.0))(
        state.params, rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample)
    measured = float(np.mean(terms["exact_kl_BxN"]))
    # numpy reference: the trainer's logits z at the visited positions, E over eps of KL(softmax(z + s eps) || softmax(z))
    lay = sequence_layout(rollout.prompt_BxP, rollout.prompt_mask_BxP, rollout.sample.tokens_BxN,
                          rollout.sample.lengths_B)
    logits = np.asarray(T.forward(jax.device_get(state.params), lay.tokens_BxS, cfg=CFG,
                                  attn_mask_BxT=lay.attn_mask_BxS)[0], np.float64)[:, P - 1:P - 1 + N]
    z = logits.reshape(-1, 1, CFG.vocab_size)
    eps = np.random.default_rng(0).normal(size=(1, 400, CFG.vocab_size))
    log_q, log_p = special.log_softmax(z + sigma * eps, -1), special.log_softmax(z, -1)
    expected = float(np.mean(np.sum(np.exp(log_q) * (log_q - log_p), -1)))
    assert expected > 0.05
    assert measured == pytest.approx(expected, rel=0.05)
    rep = measure.measure(run, state, [batch], resamples=200, progress=False)
    assert rep.exact_kl.mean == pytest.approx(measured, rel=1e-5)
    assert rep.k3.mean > 0 and rep.exact_kl.ci_low < rep.exact_kl.mean < rep.exact_kl.ci_high
    assert 0 < rep.ess.mean < 1


def test_ratio_ci_is_scipy_paired_bootstrap_of_the_token_weighted_mean():
    rng = np.random.default_rng(1)
    n = rng.integers(1, 30, 50).astype(np.float64)
    rows = {"n": n, "kl": n * rng.gamma(2.0, 0.05, 50), "k1": n * 0.1, "k3": n * 0.01, "dprob": n * 0.02,
            "r": n, "r2": n * 1.1, "max_dprob": rng.random(50)}
    rep = measure.summarize(rows, [0.1], 1.0, resamples=4000, seed=5)
    ref = stats.bootstrap((rows["n"], rows["kl"]), lambda a, b, axis=-1: b.sum(axis) / a.sum(axis), paired=True,
                          vectorized=True, n_resamples=4000, method="percentile", random_state=9)
    assert rep.exact_kl.mean == pytest.approx(rows["kl"].sum() / n.sum())
    width = ref.confidence_interval.high - ref.confidence_interval.low
    assert abs(rep.exact_kl.ci_low - ref.confidence_interval.low) < 0.1 * width
    assert abs(rep.exact_kl.ci_high - ref.confidence_interval.high) < 0.1 * width
    assert rep.ess.mean == pytest.approx(n.sum() ** 2 / (n.sum() * 1.1 * n.sum()))
    with pytest.raises(ValueError, match="no tokens"):
        measure.summarize(dict(rows, n=np.zeros(50)), [], 0.0)


def test_mismatch_command_on_the_smoke_config(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["mismatch", "configs/smoke.yaml", "rollout_precision.logit_noise=1.0", f"train.cache_dir={tmp_path}",
            "--batches", "2", "--resamples", "200", "--json", str(out)]
    assert cli.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["exact_kl"]["mean"] > 0.01 and rep["n_prompts"] == 16 and rep["rollout_precision"]["logit_noise"] == 1.0
    assert "exact KL(sampler || trainer)" in capsys.readouterr().out
    assert cli.main(["mismatch", "configs/smoke.yaml", "--batches", "0"]) == 2  # bad input: one line, exit 2
