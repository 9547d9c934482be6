"""Routing in the mismatch lab, through the production step with a mixture-of-experts student and a bf16 rollout
engine: the sampler's recorded experts against the trainer's fp32 forward, counted in numpy — the step's flip
metrics and `jopd mismatch`'s report (`jopd.lab.mismatch.measure`) — and with `train.routing_replay` the exact
mismatch measured against the replayed forward (the one the update differentiates), in the step and in the lab."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from jopd.lab import mismatch as measure
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.opd.batch import sequence_layout
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from jopd.run.config import load_config
from jopd.run.loop import OPDRun
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8, norm_topk_prob=True, eos_token_id=None)
B, P, N = 16, 5, 8


def _counts(own_LsxBxSxk, recorded_BxSxLsxk):
    """numpy: (the share of recorded router decisions whose expert set differs, the share of recorded tokens with
    one in any sparse layer)."""
    own = np.sort(np.moveaxis(np.asarray(own_LsxBxSxk), 0, 2), -1)
    rec = np.asarray(recorded_BxSxLsxk)
    where = rec[..., 0, 0] >= 0
    differ = np.any(own != np.sort(rec, -1), -1)[where]  # [tokens, Ls]
    return differ.mean(), differ.any(-1).mean()


def test_flip_rates_and_replayed_mismatch_of_a_bf16_engine():
    cfg = load_config(None, [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}",
                             "train.mismatch=exact", "mesh.data=1", "mesh.fsdp=1", "loss.kind=topk_rkl", "loss.top_k=8",
                             "rollout_precision.compute_dtype=bf16", "train.routing_replay=true"])
    step = build_step(cfg, CFG, (CFG,), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    params = numpy_params(CFG, seed=0, std=0.5)
    state = step.init_state(params)
    rng = np.random.default_rng(2)
    batch = {"prompt_tokens": rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32),
             "prompt_mask": np.ones((B, P), np.int32)}
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(state, batch, 0)
        scored = step.score((params,), rollout)
        _, metrics = step.update(step.init_state(params), scored)  # the update donates its state
    sample = jax.device_get(rollout.sample)
    recorded = sample.expert_ids_BxSxLsxk
    assert recorded.shape == (B, P + N, 2, 2) and np.all(np.asarray(scored.replay_B))

    # the trainer's fp32 forward on the sampled tokens, free and replaying the sampler's experts
    lay = sequence_layout(rollout.prompt_BxP, rollout.prompt_mask_BxP, sample.tokens_BxN, sample.lengths_B)
    forward = jax.jit(lambda replay: T.forward(params, lay.tokens_BxS, cfg=CFG, attn_mask_BxT=lay.attn_mask_BxS,
                                               return_routing=True, replay_experts_LsxBxTxk=replay))
    logits_free, _, own_free = forward(None)
    logits_replay, _, own_replay = forward(jnp.moveaxis(jnp.asarray(recorded), 2, 0))
    free, replayed = _counts(own_free, recorded), _counts(own_replay, recorded)
    print(f"\n[routing] bf16 engine: flips free {free}, with replay {replayed}")
    assert 0 < free[0] < free[1] < 0.5  # the bf16 engine flips some routers, and a token holds several

    mask = np.asarray(lay.response_mask_BxN)

    def kl(logits):  # the exact KL(sampler || trainer) per response token, scipy
        log_p = special.log_softmax(np.asarray(logits, np.float64)[:, P - 1:P - 1 + N], -1)
        log_q = np.asarray(sample.full_logprobs_BxNxV, np.float64)
        return float(np.sum(np.exp(log_q) * (log_q - log_p), -1)[mask].mean())

    kl_free, kl_replay = kl(logits_free), kl(logits_replay)
    print(f"[routing] exact KL free {kl_free:.3g}, with replay {kl_replay:.3g} nats/token")
    assert abs(kl_free - kl_replay) > 0.05 * kl_free  # replay changes what the trainer computes
    # the step: its update ran the replayed forward, its flips are counted on it
    assert float(metrics["mismatch_kl"]) == pytest.approx(kl_replay, rel=1e-4)
    assert float(metrics["mismatch_router_flip_frac"]) == pytest.approx(replayed[0], rel=1e-6)
    assert float(metrics["mismatch_token_flip_frac"]) == pytest.approx(replayed[1], rel=1e-6)

    # the lab, on the same rollout (step 0's draws), with and without replay
    for replay, (router, token), kl_ref in ((True, replayed, kl_replay), (False, free, kl_free)):
        run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, routing_replay=replay))
        rep = measure.measure(OPDRun(run_cfg, step, teacher_params=None, tokenizer=None), state, [batch],
                              resamples=200, progress=False)
        assert rep.exact_kl.mean == pytest.approx(kl_ref, rel=1e-4)
        assert rep.router_flip_frac.mean == pytest.approx(router, rel=1e-9)
        assert rep.token_flip_frac.mean == pytest.approx(token, rel=1e-9)
        assert rep.token_flip_frac.ci_low <= token <= rep.token_flip_frac.ci_high
    assert "routing flips, decisions" in rep.table() and "routing flips, tokens" in rep.table()
